"""--timing-log-level 2 through the real entry point (one process, ZeRO-3): the timers/<phase>_ms
scalars are in TensorBoard at every logged step and in the log line, and the phases add up to
the logged time per iteration."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.env import REPO, free_port, standalone_env
from tests.helpers.launcher import scalars

COARSE = ("data_wait", "forward", "backward", "optimizer_step")
FINE = ("data_wait", "mask", "generator_forward", "sample", "discriminator_forward", "backward",
        "optimizer_step")


def test_phase_scalars_exist_and_add_up_to_the_step(wiki_shards, tmp_path):
    tok, prefix = wiki_shards
    save = tmp_path / "run"
    args = ["--ds_config", "ds_configs/zero3.json", "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", "6",
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--eval-iters", "0", "--log-interval", "3", "--timing-log-level", "2"]
    env = dict(standalone_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "rtd_scale/pretrain.py", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tb = scalars(str(save / "tensorboard"))
    for phase in set(COARSE) | set(FINE):
        assert sorted(tb[f"timers/{phase}_ms"]) == [1, 3, 6], phase
    lines = {int(m.group(1)): m.group(0)
             for m in re.finditer(r" iteration +(\d+)/ +6 \|.*", r.stdout)}
    assert sorted(lines) == [1, 3, 6]
    for step, line in lines.items():
        ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
        fwd = tb["timers/forward_ms"][step]
        assert re.search(rf"\| time ms: data [\d.]+ \| fwd {fwd:.1f} \[mask [\d.]+, gen_fwd "
                         r"[\d.]+, sample [\d.]+, disc_fwd [\d.]+\] \| bwd [\d.]+ \| step [\d.]+ "
                         r"\|$", line), line
        coarse = sum(tb[f"timers/{p}_ms"][step] for p in COARSE)
        fine = sum(tb[f"timers/{p}_ms"][step] for p in FINE)
        # what no phase holds: the loss gate, the metric sums, the previous log line's own work
        # (the interval's clock restarts before the embedding cosines, which gather the tables
        # under ZeRO-3) — measured 0.6–5.2 % of the step at level 1, the most in the interval
        # after the first line; level 2 also leaves out the forward's ops outside its four
        # parts (the pad mask, ZeRO-3's hooks on the top module): 1.5–2 % more
        assert fine <= coarse <= ms, (step, fine, coarse, ms)
        assert ms - coarse <= 0.10 * ms + 5.0, (step, coarse, ms)
        assert ms - fine <= 0.10 * ms + 5.0, (step, fine, ms)
