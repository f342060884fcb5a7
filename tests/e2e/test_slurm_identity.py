"""Who is who under Slurm, without a cluster: the scripts and the entry point run as Slurm runs
them, with the variables it sets.

- slurm/preprocess.sh as array tasks (SLURM_ARRAY_TASK_ID): outputs are named after their input,
  so a list that changes between submissions tokenizes every file exactly once, and a
  task whose file is already tokenized elsewhere, or was edited since, refuses in one line;
- slurm/lib/pretrain_job.sh's environment checks (a path with a space in RTD_DATA_PATH, a
  non-integer RTD_MAX_REQUEUES), the tokenizer held to the preset's vocabulary size, and the
  command it hands srun: --preset and the regime, --lr / --lr-warmup-iters / --seed only when
  RTD_LR / RTD_WARMUP_ITERS / RTD_SEED are set;
- `srun python rtd_scale/pretrain.py` without the rank wrapper: two processes with only SLURM_*
  variables form one world of 2;
- a single process on a node where port 29500 is taken trains on a free port, and a MASTER_PORT
  that is taken is one line naming it; a shard without its sidecar gets a one-line note.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rtd_scale.launch_env import slurm_port
from tests.helpers.env import CASES, REPO
from tests.helpers.launcher import common

# holds port 29500, the launcher's default: one machine-wide module at a time
# (tests/conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("machine-wide")]

PREPROCESS = REPO / "slurm" / "preprocess.sh"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any Slurm or launcher variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in LAUNCH_VARS}
    env.update(extra)
    return env


def _dataset_name(path: Path) -> str:
    """What slurm/preprocess.sh names the dataset of ``path``: stem, hash of the real path."""
    digest = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:10]
    return f"{path.name.split('.')[0]}-{digest}_text_document"


@pytest.fixture(scope="module")
def list_inputs(tmp_path_factory) -> Path:
    """A folder with the inputs of the changing list, tests/data/cases/list_{a,b,c}.jsonl (10
    documents each), and a tokenizer trained on them."""
    work = tmp_path_factory.mktemp("list_inputs")
    for name in "abc":
        shutil.copy(CASES / f"list_{name}.jsonl", work / f"list_{name}.jsonl")
    subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input",
                    *(str(work / f"list_{n}.jsonl") for n in "abc"), "--vocab-size", "200",
                    "--output-prefix", str(work / "spm"), "--num-threads", "1"],
                   check=True, capture_output=True)
    return work


class Array:
    """slurm/preprocess.sh run as the tasks of a Slurm array job would run it."""

    def __init__(self, inputs: Path, work: Path):
        self.work, self.shards, self.tokenizer = work, work / "shards", inputs / "spm.model"

    def list(self, name: str, *files: str) -> str:
        (self.work / name).write_text("".join(f"{f}\n" for f in files))
        return name

    def task(self, listfile: str, i: int) -> subprocess.CompletedProcess:
        env = _env(SLURM_JOB_ID=str(500 + i), SLURM_ARRAY_JOB_ID="500",
                   SLURM_ARRAY_TASK_ID=str(i), SLURM_CPUS_PER_TASK="1",
                   RTD_TOKENIZER=str(self.tokenizer), RTD_SHARD_DIR=str(self.shards))
        return subprocess.run(["bash", str(PREPROCESS), listfile], cwd=self.work, env=env,
                              capture_output=True, text=True, timeout=300)

    def manifests(self) -> dict[str, dict]:
        return {p.name[:-len(".manifest.json")]: json.loads(p.read_text())
                for p in sorted(self.shards.glob("*.manifest.json"))}


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), \
        (r.returncode, r.stdout, r.stderr)
    return lines[0]


def test_changed_list_tokenizes_every_file_once(list_inputs, tmp_path):
    """List a, c and tasks 0–1; then list a, b, c and tasks 0–2."""
    array = Array(list_inputs, tmp_path)
    a, b, c = (str(list_inputs / f"list_{n}.jsonl") for n in "abc")
    first, second = array.list("first.txt", a, c), array.list("second.txt", a, b, c)
    runs = [array.task(first, i) for i in (0, 1)] + [array.task(second, i) for i in (0, 1, 2)]
    assert [r.returncode for r in runs] == [0] * 5, [r.stderr for r in runs]
    outs = [r.stdout for r in runs]
    assert "done: 10 documents written" in outs[0] and "done: 10 documents written" in outs[1]
    assert "nothing to do" in outs[2]  # a, done in the first submission
    assert "done: 10 documents written" in outs[3]  # b: the new file, now tokenized
    assert "nothing to do" in outs[4]  # c, done in the first submission at another line
    manifests = array.manifests()
    names = {n: _dataset_name(list_inputs / f"list_{n}.jsonl") for n in "abc"}
    assert sorted(manifests) == sorted(names.values())
    for n, dataset in names.items():  # each dataset made from its own file, 10 documents each
        inputs = manifests[dataset]["run"]["inputs"]
        assert [i["path"] for i in inputs] == [os.path.realpath(list_inputs / f"list_{n}.jsonl")]
        assert manifests[dataset]["documents"] == 10


def test_a_task_refuses_a_file_tokenized_elsewhere_or_edited(list_inputs, tmp_path):
    array = Array(list_inputs, tmp_path)
    a, b, c = (str(list_inputs / f"list_{n}.jsonl") for n in "abc")
    # an output of the older script, which named outputs by list position: part-00001 made
    # from c when the list was a, c
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", c,
                    "--tokenizer-model", str(array.tokenizer), "--output-prefix",
                    str(array.shards / "part-00001"), "--workers", "1"],
                   check=True, capture_output=True)
    listed = array.list("list.txt", a, b, c)
    assert array.task(listed, 1).returncode == 0  # b is new
    err = _one_line_error(array.task(listed, 2))
    assert err == (f"error: task 2: list.txt line 3: {os.path.realpath(c)} is already tokenized: "
                   f"{array.shards}/part-00001_text_document holds this file; delete that "
                   f"dataset to tokenize it as {_dataset_name(Path(c))[:-len('_text_document')]}"
                   ", or drop the line from the list")

    # a copy of b under another name would be read twice
    copy = tmp_path / "copy_of_b.jsonl"
    shutil.copy(b, copy)
    err = _one_line_error(array.task(array.list("copy.txt", b, str(copy)), 1))
    assert f"{copy} is already tokenized: {array.shards}/{_dataset_name(Path(b))} holds the " \
           f"same content (from {os.path.realpath(b)})" in err

    # the same file on two lines (another spelling of its path): tokenized once
    twice = array.list("twice.txt", a, os.path.relpath(a, tmp_path))
    r = array.task(twice, 1)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "twice.txt line 2 names the same file as line 1" in r.stdout
    assert "nothing to do" in r.stdout and not list(array.shards.glob("list_a-*"))

    # a file edited after its dataset was made
    edited = tmp_path / "edited.jsonl"
    shutil.copy(a, edited)
    once = array.list("edited.txt", str(edited))
    assert array.task(once, 0).returncode == 0
    with open(edited, "a", encoding="utf-8") as f:
        f.write('{"text": "one more document"}\n')
    err = _one_line_error(array.task(once, 0))
    assert f"{edited} changed since {array.shards}/{_dataset_name(edited)} was made from it" in err
    assert err.endswith("delete that dataset to tokenize the file again")


def _pretrain_job(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    """slurm/lib/pretrain_job.sh's main inside a (pretend) 2-task job, up to its checks."""
    env = _env(RTD_REPO=str(REPO), RTD_PRESET="tiny", RTD_TRAIN_ITERS="2", RTD_GLOBAL_BATCH="8",
               RTD_MICRO_BATCH="4", RTD_SEQ_LENGTH="64", RTD_LR="1e-3", RTD_WARMUP_ITERS="0",
               RTD_DEVICE="cpu", RTD_EXPECT_VOCAB="", SLURM_JOB_ID="77", SLURM_NTASKS="2",
               **env_extra)
    code = f'source "{REPO}/slurm/lib/pretrain_job.sh"; rtd_pretrain_main'
    return subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_pretrain_job_environment_errors(list_inputs, tmp_path):
    array = Array(list_inputs, tmp_path / "with space")
    (tmp_path / "with space").mkdir()
    assert array.task(array.list("l.txt", str(list_inputs / "list_a.jsonl")), 0).returncode == 0
    dataset = array.shards / _dataset_name(list_inputs / "list_a.jsonl")
    err = _one_line_error(_pretrain_job({"RTD_DATA_PATH": str(dataset)}))
    assert err.startswith(f"error: RTD_DATA_PATH: no dataset '{tmp_path}/with' (neither ")
    assert "a path with a space must be linked to one without (ln -s)" in err
    for value in ("abc", "1.5", "-1"):
        err = _one_line_error(_pretrain_job({"RTD_MAX_REQUEUES": value}))
        assert err == f"error: RTD_MAX_REQUEUES={value}: expected a whole number (0 or more)"
    err = _one_line_error(_pretrain_job({"RTD_MASTER_PORT": "70000"}))
    assert err == "error: RTD_MASTER_PORT=70000: expected a TCP port, 1-65535"


def _launch(cwd: Path, env_extra: dict[str, str], unset: tuple[str, ...] = ()
            ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """slurm/lib/pretrain_job.sh's main in a (pretend) 2-task job run through to srun, with
    stand-ins for srun (records its arguments) and scontrol: the job's result, and the
    pretrain.py command it handed srun ([] when it stopped before)."""
    (cwd / "d_text_document.idx").write_bytes(b"")  # the data-path check wants only a name
    argv = cwd / "srun.argv"
    argv.unlink(missing_ok=True)
    stubs = (f'srun() {{ printf "%s\\n" "$@" > "{argv}"; }}; '
             'scontrol() { if [ "$1" = show ]; then echo localhost; fi; }; ')
    env = _env(**{"RTD_REPO": str(REPO), "RTD_PRESET": "tiny", "RTD_TRAIN_ITERS": "2",
                  "RTD_GLOBAL_BATCH": "8", "RTD_MICRO_BATCH": "4", "RTD_SEQ_LENGTH": "64",
                  "RTD_DEVICE": "cpu", "RTD_EXPECT_VOCAB": "",
                  "RTD_DATA_PATH": str(cwd / "d_text_document"), "RTD_SAVE": str(cwd / "run"),
                  "SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                  "SLURM_JOB_NUM_NODES": "1",
                  "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                  **env_extra})
    for name in ("RTD_LR", "RTD_WARMUP_ITERS", "RTD_SEED", *unset):
        if name not in env_extra:
            env.pop(name, None)
    code = stubs + f'source "{REPO}/slurm/lib/pretrain_job.sh"; rtd_pretrain_main'
    r = subprocess.run(["bash", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=120)
    if not argv.exists():
        return r, []
    args = argv.read_text().splitlines()
    return r, args[args.index("python"):]


def _flag(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_the_launcher_passes_the_preset_and_only_the_recipe_flags_that_are_set(tmp_path):
    """Unset RTD_LR, RTD_WARMUP_ITERS and RTD_SEED mean the preset's values: no flag restates
    them. Set, each becomes its flag."""
    (tmp_path / "a").mkdir()
    r, cmd = _launch(tmp_path / "a", {})
    assert r.returncode == 0 and cmd, (r.stdout, r.stderr)
    assert _flag(cmd, "--preset") == "tiny" and _flag(cmd, "--global-batch-size") == "8"
    assert _flag(cmd, "--train-iters") == "2" and _flag(cmd, "--seq-length") == "64"
    assert not {"--lr", "--lr-warmup-iters", "--seed"} & set(cmd), cmd
    (tmp_path / "b").mkdir()
    r, cmd = _launch(tmp_path / "b", {"RTD_LR": "1e-3", "RTD_WARMUP_ITERS": "5",
                                      "RTD_SEED": "7"})
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert (_flag(cmd, "--lr"), _flag(cmd, "--lr-warmup-iters"), _flag(cmd, "--seed")) == \
        ("1e-3", "5", "7")


def test_the_tokenizer_is_checked_against_the_presets_vocabulary(list_inputs, tmp_path):
    """RTD_EXPECT_VOCAB unset: the preset's model.vocab_size (a relative RTD_TOKENIZER is the
    job's working directory's); a number: that; empty: no check."""
    from rtd_scale.presets import preset
    from rtd_scale.data.tokenizer import Tokenizer

    shutil.copy(list_inputs / "spm.model", tmp_path / "spm.model")
    pieces, want = Tokenizer(str(list_inputs / "spm.model")).vocab_size, preset("tiny").model.vocab_size
    assert pieces != want
    r, cmd = _launch(tmp_path, {"RTD_TOKENIZER": "spm.model"}, unset=("RTD_EXPECT_VOCAB",))
    assert _one_line_error(r) == (
        f"error: RTD_TOKENIZER=spm.model has {pieces} pieces; the preset tiny needs {want} "
        f"(tools/train_tokenizer.py --vocab-size {want}), or set RTD_EXPECT_VOCAB= to accept it")
    assert cmd == []
    r, _ = _launch(tmp_path, {"RTD_TOKENIZER": "spm.model", "RTD_EXPECT_VOCAB": str(pieces + 1)})
    assert _one_line_error(r).startswith(
        f"error: RTD_TOKENIZER=spm.model has {pieces} pieces; RTD_EXPECT_VOCAB={pieces + 1} needs")
    for expect in (str(pieces), ""):
        r, cmd = _launch(tmp_path, {"RTD_TOKENIZER": "spm.model", "RTD_EXPECT_VOCAB": expect})
        assert r.returncode == 0 and _flag(cmd, "--tokenizer-model") == "spm.model", r.stderr


def _free_slurm_job_id() -> int:
    """A job id whose derived rendezvous port (10000 + id mod 20000) is free here."""
    for job_id in range(31000 + os.getpid() % 9000, 60000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_port(job_id)))
            except OSError:
                continue
            return job_id
    raise AssertionError("no free port in 10000-29999")


def test_srun_without_the_rank_wrapper_forms_one_world(wiki_shards, tmp_path):
    """What `srun --ntasks=2 python rtd_scale/pretrain.py …` gives each task: SLURM_* only."""
    save = tmp_path / "run"
    job_id = _free_slurm_job_id()
    procs = []
    for rank in (0, 1):
        env = _env(SLURM_JOB_ID=str(job_id), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_NODEID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0",
                   SLURM_STEP_NUM_TASKS="2", SLURM_JOB_NODELIST="localhost",
                   SLURM_STEP_NODELIST="localhost", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen(
            [sys.executable, "rtd_scale/pretrain.py", *common(wiki_shards, save, 2)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert "world 2 = TP 1 × PP 1 × DP 2" in outs[0][0], outs[0][0][-3000:]
    assert "world 1" not in outs[0][0] + outs[1][0]  # not two trainings of one rank each
    assert (save / "latest").read_text().strip() == "global_step2"
    # one run wrote it: one RNG state per rank of a world of 2
    ranks = [re.fullmatch(r"rng_rank(\d+)\.pt", p.name) for p in (save / "global_step2").iterdir()]
    assert sorted(int(m.group(1)) for m in ranks if m) == [0, 1]


def test_single_process_port_and_shard_without_sidecar(wiki_shards, tmp_path):
    tok, dataset = wiki_shards
    # a Megatron-LM-style shard: .bin/.idx, no sidecar
    for ext in ("bin", "idx"):
        shutil.copy(f"{dataset}_00000.{ext}", tmp_path / f"bare.{ext}")
    args = common((tok, str(tmp_path / "bare")), tmp_path / "run", 1)
    holder = socket.socket()  # the default port taken (if another process has it, so much the
    try:                      # better: it is taken either way)
        holder.bind(("", 29500))
        holder.listen()
    except OSError:
        pass
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        r = subprocess.run([sys.executable, "rtd_scale/pretrain.py", *args], cwd=REPO,
                           env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "world 1 = TP 1 × PP 1 × DP 1" in r.stdout
        largest = int(np.fromfile(tmp_path / "bare.bin", dtype=np.uint16).max())
        notes = [line for line in r.stdout.splitlines() if "sidecar" in line]
        assert notes == [f"note: shard {tmp_path}/bare has no .meta.json sidecar, so the "
                         f"tokenizer it was made with cannot be verified: its ids fit {tok} "
                         f"(largest {largest} < 1000), which is all that can be checked; make "
                         "sure it was made with that tokenizer"], notes

        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "rtd_scale/pretrain.py",
                            *common(wiki_shards, tmp_path / "run2", 1,
                                    ["--lr-warmup-iters", "0"])], cwd=REPO,
                           env=_env(CUDA_VISIBLE_DEVICES="", MASTER_PORT=str(port)),
                           capture_output=True, text=True, timeout=600)
        assert _one_line_error(r) == (
            f"error: MASTER_PORT {port} is already in use on 127.0.0.1 (rank 0 listens there "
            "to start the run); unset MASTER_PORT to let a single process pick a free one")
        assert "Traceback" not in r.stdout + r.stderr
    finally:
        holder.close()
        busy.close()
