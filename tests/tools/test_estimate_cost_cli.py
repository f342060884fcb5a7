"""tools/estimate_cost.py run as the command a user types: its printed totals and its one-line
usage errors (exit status 2, nothing on stdout)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.env import REPO


def test_cli():
    r = subprocess.run([sys.executable, "tools/estimate_cost.py", "--preset", "debertav3-large",
                        "--tokens-per-step", "8192*512", "--steps", "500000", "--mfu", "0.4",
                        "--peak-tflops", "989", "--gpus", "64"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "total                      3.2957e+09" in r.stdout
    assert "6.9117e+21 FLOPs" in r.stdout
    assert "4,853 GPU-hours = 75.8 h (3.2 days) on 64 GPUs" in r.stdout
    r = subprocess.run([sys.executable, "tools/estimate_cost.py", "--tokens-per-s", "1e6"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "also pass --gpus" in r.stderr


@pytest.mark.parametrize("argv, message", [
    # no abbreviations (OneLineArgumentParser's allow_abbrev=False, as Megatron-LM)
    (["--gpu", "8", "--tokens-per-s", "1e6"], "error: unrecognized arguments: --gpu 8 (did you "
     "mean --gpus?); estimate_cost.py --help lists every flag"),
    (["--tokens_per_s", "1e6"], "error: unrecognized arguments: --tokens_per_s 1e6 (did you mean "
     "--tokens-per-s?); estimate_cost.py --help lists every flag"),
    (["--mfu", "0.4"], "error: --mfu and --peak-tflops go together; estimate_cost.py --help "
     "lists every flag"),
    (["--mfu", "40", "--peak-tflops", "989"], "error: argument --mfu: a fraction in (0, 1], got 40 "
     "(for 40% pass 0.4); estimate_cost.py --help lists every flag"),
    (["--mfu", "40%", "--peak-tflops", "989"], "error: argument --mfu: a fraction in (0, 1], got "
     "40% (for 40% pass 0.4); estimate_cost.py --help lists every flag"),
    (["--mfu", "0", "--peak-tflops", "989"], "error: argument --mfu: must be > 0, got 0; "
     "estimate_cost.py --help lists every flag"),
    (["--mfu", "high", "--peak-tflops", "989"], "error: argument --mfu: expected a fraction such "
     "as 0.4, got 'high'; estimate_cost.py --help lists every flag"),
])
def test_usage_errors_are_one_line(argv, message):
    r = subprocess.run([sys.executable, "tools/estimate_cost.py", *argv], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr.strip()) == (2, "", message)


def test_the_masked_lm_breakdown_names_one_encoder():
    """Under ``--set rtd.objective=mlm`` the breakdown lists the one encoder's rows (it sits in
    the generator's slot) and no discriminator or RTD head rows."""
    r = subprocess.run([sys.executable, "tools/estimate_cost.py", "--preset", "debertav3-tiny",
                        "--set", "rtd.objective=mlm"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
    assert rows == ["encoder_matmul", "encoder_attention", "embedding_projection", "mlm_head",
                    "total"], r.stdout
    assert "  encoder_matmul             2.6542e+06   47.5%" in r.stdout
    assert "  total                      5.5849e+06" in r.stdout
