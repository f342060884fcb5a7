"""A loss spike rolls back, through the real launcher (--loss-spike-policy rollback, the default).

One run of the tiny preset on 2 ranks (ZeRO-3, checkpoints every 5 iterations, window 20) whose
iteration 32 gets a corrupted batch on rank 0 (``RTD_FAULTS=corrupt@32:0!once``: half the global
batch read with another tokenizer's ids, rtd_scale/training/faults.py). Asserted on that one run:
the spike is found at iteration 32 and nowhere else (iterations 21–31, armed, are the negative
control); the run reloads global_step30, replays 31 bitwise, never reads samples 496–511 again
(every later step reads the next 16 samples outside them, --data-digest), records the range in
every later checkpoint's client state, writes loss_spike/* to TensorBoard with one value per
step and tag, and finishes at iteration 40 with exit status 0.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from rtd_scale.data.loader import global_batch
from tests.helpers.launcher import common, launch, scalars

SPIKE_AT, BACK_TO, ITERS, BATCH = 32, 30, 40, 16
SKIPPED = (496, 512)  # iteration 32's samples: it starts after 31 × 16


@pytest.fixture(scope="module")
def run(wiki_shards, tmp_path_factory):
    save = tmp_path_factory.mktemp("spike") / "run"
    args = common(wiki_shards, save, ITERS, save_interval=5, lr="3e-3",
                  extra=["--lr-decay-style", "constant", "--loss-spike-window-iters", "20",
                         "--eval-interval", "0", "--data-digest", str(save / "digest.jsonl")])
    r = launch(args, ranks=2, env={"RTD_FAULTS": f"corrupt@{SPIKE_AT}:0!once"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return save, r


def test_the_spike_is_rolled_back_once_at_its_iteration(run):
    save, r = run
    lines = [ln for ln in r.stdout.splitlines() if "loss spike" in ln]
    assert len(lines) == 1, lines  # the armed iterations before the fault: no spike
    m = re.fullmatch(r"loss spike at iteration 32 \(32: mlm loss (\S+) = (\S+) × its median "
                     r"\(limit (\S+) ×\)\): rolled back to iteration 30 \((\S+), loaded in "
                     r"(\S+) s\); global samples 496–511 \(16\) will not be read; rollback 1 of "
                     r"at most 5 \(--max-loss-spike-rollbacks\)", lines[0])
    assert m, lines[0]
    ratio, limit = float(m[2]), float(m[3])
    assert ratio > limit >= 1.1  # a real spike: 1.22 × the median L_MLM (limit 1.15) measured
    assert m[4] == str(save / "global_step30")
    assert "[rtd-fault] rank 0: injecting corrupt@32:0!once at iteration 32" in r.stdout
    assert re.search(r"iteration +40/ +40 \|", r.stdout)


def test_the_replay_is_exact_and_the_spiking_samples_are_never_read_again(run):
    save, _ = run
    rows = [json.loads(ln) for ln in (save / "digest.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [*range(1, SPIKE_AT + 1),
                                             *range(BACK_TO + 1, ITERS + 1)]
    first, replay = rows[BACK_TO], rows[SPIKE_AT]  # iteration 31, before and after the rollback
    assert first["step"] == replay["step"] == 31 and first == replay  # bitwise: losses in hex
    assert rows[SPIKE_AT - 1]["sample_index"] == list(range(*SKIPPED))  # the corrupted step
    after = rows[SPIKE_AT + 1:]
    read = [k for row in after for k in row["sample_index"]]
    assert not set(read) & set(range(*SKIPPED))
    for row in after:  # each step: the next 16 outside the skipped range
        want = global_batch(row["consumed_samples"], BATCH, [SKIPPED]).tolist()
        assert row["sample_index"] == want
    assert after[0]["sample_index"] == list(range(512, 528))


def test_every_later_checkpoint_records_the_skipped_samples(run):
    save, _ = run
    for tag, want in (("global_step30", None), ("global_step35", 1), ("global_step40", 1)):
        for path in sorted((save / tag).glob("*model_states.pt")):  # every rank's
            client = torch.load(path, map_location="cpu", weights_only=False)
            got = client["loss_spikes"]
            if want is None:  # saved before the spike
                assert got["skipped_samples"] == [] and got["rollbacks"] == 0
                continue
            assert got["skipped_samples"] == [list(SKIPPED)] and got["rollbacks"] == want
            assert [row[0] for row in got["window"]][-1] == int(tag[len("global_step"):])
            assert client["consumed_samples"] == 16 * int(tag[len("global_step"):]) + 16


def test_tensorboard_holds_the_rollback_and_one_value_per_step(run):
    save, _ = run
    tb = scalars(str(save / "tensorboard"))
    assert sorted(tb["loss/mlm"]) == list(range(1, ITERS + 1))
    assert tb["loss_spike/rollbacks"] == {SPIKE_AT: 1.0}
    assert tb["loss_spike/rolled_back_to_iteration"] == {SPIKE_AT: float(BACK_TO)}
    assert tb["loss_spike/skipped_samples"] == {SPIKE_AT: 16.0}
    assert tb["loss_spike/ratio"][SPIKE_AT] > 1.1
    # iteration 32's L_MLM is the replay's (the mean of its micro-batches' in the digest), not
    # the spike's: TensorBoard hid the events after the checkpoint it went back to
    rows = [json.loads(ln) for ln in (save / "digest.jsonl").read_text().splitlines()]
    spiked, replayed = (sum(float.fromhex(x[0]) for x in row["losses"]) / len(row["losses"])
                        for row in (rows[SPIKE_AT - 1], rows[-(ITERS - SPIKE_AT + 1)]))
    assert tb["loss/mlm"][SPIKE_AT] == pytest.approx(replayed, rel=1e-6)
    assert spiked > 1.1 * replayed
