"""fp16 and ZeRO-Offload on a GPU, through the real launcher: the checks the CPU test suite cannot
make where DeepSpeed refuses fp16 on the CPU (tests/e2e/test_offload_fp16.py).

    python bench/fp16_check.py [--out DIR] [--gpus 1] [--checks A,B]

Builds a tiny corpus (tests/data/wiki_sample.jsonl, a 1000-piece SentencePiece model), then:

A. ``--fp16`` at ZeRO-2 with the loss scaler starting at 2^32 and ``--max-consecutive-nonfinite-
   iters 3``, 30 iterations of the tiny preset. Expected: the first iterations overflow and are
   skipped (counted in the log line's "number of skipped iterations" and in TensorBoard's
   ``optim/skipped_iters``) while the loss scale halves (log and ``optim/loss_scale``); the run
   is not stopped by the overflows (more than 3 in a row; only a non-finite loss counts toward
   the limit, as in Megatron-LM); an iteration after a skipped one has the skipped one's
   learning rate (a skip does not advance the schedule); the last losses are finite; the
   ``--export`` holds the fp32 master weights (values fp16 cannot represent).
B. ``--fp16`` with ``ds_configs/zero3_offload.json`` (parameters and optimizer on the CPU,
   DeepSpeed's CPU Adam), 8 iterations: trains, losses finite.

Prints one ``PASS``/``FAIL`` line per check and a JSON summary (also ``DIR/fp16_check.json``),
with each run's log in ``DIR/<run>.log``; exits 1 when a check fails. Needs deepspeed and
megatron-core importable (on the bare GPU machine, step 1 of ``bench/device_check.sh`` installs
them from ``.wheels``), and for B a C++ compiler and ninja: DeepSpeed compiles its CPU Adam op on
first use; without them B fails with rtd_scale's one-line error naming
``zero_force_ds_cpu_optimizer``. Not yet timed on a GPU (two launcher runs of the tiny
preset). On a CPU without fp16 it runs end to end and reports the one-line refusal in each log
(a plumbing check only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tiny_data import wiki_sample_data  # noqa: E402
from rtd_scale.launch_env import free_port  # noqa: E402


def _run(cmd: list[str], log: Path, timeout: int = 900) -> tuple[int, str]:
    t0 = time.time()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    print(f"[fp16_check] {time.time() - t0:.0f}s rc={r.returncode}: {' '.join(cmd[-6:])}",
          flush=True)
    return r.returncode, r.stdout


def iterations(stdout: str) -> list[dict[str, str]]:
    """The Megatron-style log lines as {field: value}."""
    rows = []
    for line in stdout.splitlines():
        if line.lstrip().startswith("iteration"):
            rows.append({k.strip(): v.strip() for k, v in
                         (f.split(":", 1) for f in line.split("|")[1:] if ":" in f)})
    return rows


def tb_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "build/fp16_check"))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--checks", default="A,B",
                    help="which of A (loss scaling) and B (ZeRO-Offload) to run (default both; "
                         "bench/device_check.sh runs A, which needs no CPU Adam build)")
    args = ap.parse_args()
    wanted = set(filter(None, args.checks.split(",")))
    if not wanted or wanted - {"A", "B"}:
        ap.error(f"--checks {args.checks}: name A, B or A,B")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks: dict[str, bool] = {}
    facts: dict[str, object] = {}

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks[name] = bool(ok)
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    import torch

    from rtd_scale.training.ds_config import fp16_supported

    facts["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    check("deepspeed_runs_fp16_here", fp16_supported(), facts["device"])

    work = Path(tempfile.mkdtemp(prefix="fp16_check_"))
    py = sys.executable
    wiki_sample_data(work, vocab_size=1000, workers=1)

    def launch(name: str, ds: Path, iters: int, *extra: str) -> tuple[int, str, Path]:
        save = work / name
        cmd = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.gpus),
               "--master_port", str(free_port()), "rtd_scale/pretrain.py", "--ds_config", str(ds),
               "--preset", "tiny", "--data-path", str(work / "wiki_text_document"),
               "--tokenizer-model", str(work / "spm.model"), "--save", str(save),
               "--train-iters", str(iters), "--seq-length", "64", "--micro-batch-size", "4",
               "--global-batch-size", str(4 * args.gpus), "--lr", "1e-3", "--lr-warmup-iters",
               "10", "--log-interval", "1", "--save-interval", "0", "--seed", "11", "--fp16",
               *extra]
        rc, stdout = _run(cmd, out / f"{name}.log")
        return rc, stdout, save

    # A. the loss scaler finds its scale; overflow skips are counted and do not stop the run
    if "A" in wanted:
        check_a(launch, check, facts, work)
    if "B" in wanted:
        check_b(launch, check)
    summary = {"checks": checks, "facts": facts}
    (out / "fp16_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0 if all(checks.values()) else 1


def check_a(launch, check, facts, work: Path) -> None:
    """A: fp16 at ZeRO-2, the loss scaler from 2^32 (module docstring)."""
    import torch

    user = json.loads((REPO / "ds_configs" / "zero2_fp16.json").read_text())
    user["fp16"]["initial_scale_power"] = 32
    ds_a = work / "fp16_scale32.json"
    ds_a.write_text(json.dumps(user))
    export = work / "fp16_zero2.pt"
    rc, stdout, save = launch("fp16_zero2", ds_a, 30, "--max-consecutive-nonfinite-iters", "3",
                              "--export", str(export))
    rows = iterations(stdout)
    check("A_exit_0", rc == 0, f"rc={rc}")
    check("A_30_log_lines", len(rows) == 30, str(len(rows)))
    if rows:
        skipped = [int(r.get("number of skipped iterations", -1)) for r in rows]
        scales = [float(r["loss scale"]) for r in rows if "loss scale" in r]
        lrs = [float(r["learning rate"]) for r in rows]
        facts.update(skipped=skipped, loss_scale=scales, lr=lrs)
        run = 0
        longest = 0
        for s in skipped:
            run = run + 1 if s else 0
            longest = max(longest, run)
        check("A_overflows_skipped_and_counted", skipped[0] == 1 and sum(skipped) >= 4,
              f"skipped per iteration {skipped}")
        check("A_more_than_3_in_a_row_did_not_stop_the_run", longest > 3 and rc == 0,
              f"longest run {longest}")
        check("A_loss_scale_in_log_and_halving", len(scales) == len(rows)
              and scales[-1] < 2.0 ** 32 and scales[-1] >= 1.0, f"{scales[:3]} … {scales[-1]}")
        after_skip = [(i, lrs[i - 1], lrs[i]) for i in range(1, len(rows)) if skipped[i - 1]]
        check("A_skip_does_not_advance_the_schedule", all(a == b for _, a, b in after_skip),
              str(after_skip[:4]))
        last = rows[-1]
        check("A_last_losses_finite", math.isfinite(float(last["mlm loss"]))
              and math.isfinite(float(last["rtd loss"])), f"{last['mlm loss']} {last['rtd loss']}")
        tb = tb_scalars(save / "tensorboard")
        check("A_tensorboard_loss_scale_and_skips",
              "optim/loss_scale" in tb and sum(tb.get("optim/skipped_iters", {}).values())
              == sum(skipped), f"optim/skipped_iters total "
              f"{sum(tb.get('optim/skipped_iters', {}).values())}")

    if export.exists():  # the export holds the fp32 master weights, not fp16-rounded ones
        state = torch.load(export, map_location="cpu", weights_only=False)["model"]
        weights = [v for v in state.values() if v.is_floating_point() and v.numel() > 1000]
        off_fp16 = sum(int((w.float() != w.float().half().float()).any()) for w in weights)
        check("A_export_holds_fp32_master_weights", off_fp16 == len(weights) > 0,
              f"{off_fp16} of {len(weights)} large tensors hold values fp16 cannot")
    else:
        check("A_export_holds_fp32_master_weights", False, "no export written")



def check_b(launch, check) -> None:
    """B: ZeRO-3 with parameters and optimizer offloaded, in fp16."""
    rc, stdout, _ = launch("fp16_zero3_offload", REPO / "ds_configs" / "zero3_offload.json", 8)
    rows = iterations(stdout)
    check("B_exit_0", rc == 0, f"rc={rc}")
    check("B_finite_losses",
          len(rows) == 8 and all(math.isfinite(float(r["mlm loss"])) for r in rows),
          str(len(rows)))


if __name__ == "__main__":
    sys.exit(main())
