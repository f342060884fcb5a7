"""tools/run_default.sh around the launch: MASTER_PORT reaches the `deepspeed` launcher as
--master_port, and a run refused before it writes anything leaves no empty run directory (the
export command of docs/hf.md, `ls -d runs/debertav3-tiny-* | tail -n 1`, would pick it), while
anything written stays.

The script runs from a copy of the repository's tools/ whose setup_env.sh puts stand-ins for
`python` (the set-up steps: no-ops) and `deepspeed` on PATH; the stand-in launcher records its
arguments and does what pretrain.py does in each case: create --save and then be refused (as
a taken MASTER_PORT is, after the checks), or write into it and fail, or be refused at parse."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers.env import REPO

FAKE_DEEPSPEED = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$RTD_FAKE_ARGV"
save=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--save" ]; then save="$2"; fi
  shift
done
case "$RTD_FAKE_MODE" in
  refused) mkdir -p "$save"; echo "error: MASTER_PORT 29500 is already in use on 127.0.0.1"; exit 1 ;;
  wrote) mkdir -p "$save"; echo step > "$save/config.json"; echo "error: interrupted"; exit 1 ;;
  badflag) echo "error: unrecognized arguments: --train-it 5"; exit 2 ;;
esac
"""


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "run_default.sh", root / "tools" / "run_default.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(FAKE_DEEPSPEED)
    (bin_dir / "python").write_text("#!/usr/bin/env bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (root / "tools" / "setup_env.sh").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return root


def _run(root, mode, **env):
    argv_file = root.parent / "argv.txt"
    full = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RTD_RUN_DIR")}
    full.update(RTD_FAKE_MODE=mode, RTD_FAKE_ARGV=str(argv_file), **env)
    r = subprocess.run(["bash", str(root / "tools" / "run_default.sh")], env=full,
                       capture_output=True, text=True, timeout=60)
    return r, argv_file.read_text().splitlines()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "tools" / "run_default.sh")]).returncode == 0


def test_master_port_reaches_the_launcher(tree):
    r, argv = _run(tree, "badflag", MASTER_PORT="29611")
    assert r.returncode == 2, r.stderr
    assert argv[:4] == ["--num_gpus", "2", "--master_port", "29611"]
    r, argv = _run(tree, "badflag")  # unset: the launcher's own default (29500)
    assert r.returncode == 2 and "--master_port" not in argv
    assert argv[:3] == ["--num_gpus", "2", "rtd_scale/pretrain.py"]
    assert "main job done" not in r.stdout


def test_a_refused_run_leaves_no_empty_run_directory(tree):
    r, argv = _run(tree, "refused", MASTER_PORT="29500")
    assert r.returncode == 1
    assert "error: MASTER_PORT 29500 is already in use" in r.stdout
    run_dir = tree / argv[argv.index("--save") + 1]
    assert run_dir.parent == tree / "runs" and run_dir.name.startswith("debertav3-tiny-")
    assert not run_dir.exists() and list((tree / "runs").iterdir()) == []


def test_what_a_failed_run_wrote_stays(tree):
    r, argv = _run(tree, "wrote", RTD_RUN_DIR="runs/mine")
    assert r.returncode == 1
    assert (tree / "runs" / "mine" / "config.json").read_text() == "step\n"
    # a run directory that existed before the script ran is the user's: kept, even if empty
    (tree / "runs" / "empty").mkdir()
    r, _ = _run(tree, "refused", RTD_RUN_DIR="runs/empty")
    assert r.returncode == 1 and (tree / "runs" / "empty").is_dir()
