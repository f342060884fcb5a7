"""bench/gpu_rtd_step.py run as a script: --print-setup names the pinned wheels, and a tiny CPU
run covers every row of the GPU table.

The tiny run needs Hugging Face transformers (not a dependency of rtd_scale; CI skips it).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu_rtd_step as bench
from tests.helpers.env import REPO, standalone_env

SCRIPT = REPO / "bench" / "gpu_rtd_step.py"


def test_print_setup_names_the_pinned_wheels():
    out = subprocess.run([sys.executable, str(SCRIPT), "--print-setup"], capture_output=True,
                         text=True, check=True).stdout
    assert "pip wheel --no-deps --no-build-isolation -w build/bench_wheels deepspeed==0.19.8" in out
    assert "megatron-core==0.16.1" in out and "--no-index --find-links build/bench_wheels" in out


def test_tiny_cpu_run_covers_every_row(tmp_path):
    """The GPU script's code paths end to end at tiny sizes: every row measured, the table,
    the kernel-family profiles, the phase split, the host-sync census and the sampler cost."""
    pytest.importorskip("transformers")
    out = tmp_path / "tiny.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny",
                           # every row must run: a loaded CI machine must not reach the default
                           # 300 s deadline of --tiny (it did at load 12, 311 s)
                           "--deadline-s", "800",
                           "--json", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env=standalone_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(r["workload"], r["impl"]): r for r in res["rows"]}
    expected = {(w, i) for w in bench.DEFAULT_WORKLOADS
                for i in ("hf-eager", "rtd-engine", "rtd-autocast")}
    expected |= {("electra-large", "hf-compile"), ("electra-large", "rtd-engine-z0"),
                 ("debertav3-large", "hf-electra-arch")}
    expected |= {("stack 2x64", i) for i in ("stack-hf", "stack-mcore", "stack-mcore-mask")}
    assert set(rows) == expected
    for key, r in rows.items():
        assert r["status"] == "ok", (key, r["note"])
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["steps"] == 2, key
    text = proc.stdout
    for column in ("workload", "implementation", "micro-batch", "tokens/s", "TFLOP/s", "MFU",
                   "peak GiB", "target"):
        assert column in text
    assert "bf16 matmul ceiling" in text and "pip wheel --no-deps" in text
    assert {"electra-large|rtd-engine", "electra-large|hf-eager", "stack|stack-hf",
            "stack|stack-mcore"} <= {k.replace("stack 2x64", "stack") for k in res["profiles"]}
    engine = next(v for k, v in res["host_syncs"].items() if "ZeRO-1" in k)
    # rtd_scale's own step waits for nothing; what is left is DeepSpeed's and the bench's
    assert engine["sync_ops"] > 0
    assert not any(site.split(" via ")[0].startswith("rtd_scale/") for site in engine["sites"])
    zero0 = next(v for k, v in res["host_syncs"].items() if "ZeRO-0" in k)
    assert zero0["sync_ops"] > engine["sync_ops"]  # DeepSpeed's per-parameter checks
    assert all(set(v) == {"forward", "backward", "update"} for v in res["phases_ms"].values())
    assert all(v["sample_from_logits"]["ms"] > 0 for v in res["objective_pieces"].values())
