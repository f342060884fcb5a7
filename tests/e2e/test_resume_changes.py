"""What a resume may change on purpose, through the real launcher, from one shared 2-step run:

* another ``--seed`` would reshuffle the data mid-epoch: refused in one line, unless
  ``--override-data-order``, which says where the new order starts;
* BERT's two-phase schedule (arXiv 1810.04805 §A.2): ``--load`` with a new ``--seq-length`` and
  ``--global-batch-size`` keeps the optimizer state and the step count, and continues at the
  same fraction of the data (``BlendedDataset.continue_after``)."""
from __future__ import annotations

import re
import shutil

import pytest

from tests.helpers.launcher import adam_steps, common, launch, pretrain_error

ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|", re.M)


@pytest.fixture(scope="module")
def two_steps(wiki_shards, tmp_path_factory):
    """A 2-step run at seq 64, global batch 16 (``common``'s), one rank; each test copies it."""
    save = tmp_path_factory.mktemp("resume_changes") / "run"
    r = launch(common(wiki_shards, save, 2, ["--eval-iters", "0"]), ranks=1)  # --seed 11
    assert r.returncode == 0, r.stderr[-3000:]
    assert (save / "latest").read_text().strip() == "global_step2"
    return save


def test_resume_with_another_seed_is_refused_unless_overridden(wiki_shards, two_steps, tmp_path,
                                                               capsys, monkeypatch):
    save = shutil.copytree(two_steps, tmp_path / "run")
    resume = common(wiki_shards, save, 3, ["--eval-iters", "0", "--load", str(save),
                                           "--seed", "4321"])  # the later --seed wins
    err = pretrain_error(capsys, resume, monkeypatch, world_size=1)
    assert err == (f"error: --load {save}: global_step2 was trained with --seed 11, this run has "
                   "--seed 4321, which would reshuffle the data mid-epoch (some samples read "
                   "twice, others never); pass --seed 11, or --override-data-order to start the "
                   "new seed's order where the run resumes")

    r = launch(resume + ["--override-data-order"], ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    note = re.search(r"^note: --override-data-order: the data order follows --seed 4321 \(the "
                     r"checkpoint's was 11\) from sample 32 on: (\S+) resumes in epoch (\d+) at "
                     r"position (\d+) of its (\d+) \(counted from 0\) of the new order, .*$",
                     r.stdout, re.M)
    assert note, r.stdout[-3000:]
    epoch, position, samples = int(note[2]), int(note[3]), int(note[4])
    assert epoch * samples + position == 32 and position < samples  # one dataset: j = k
    assert f"resumed from {save} at iteration 2 (32 samples consumed)" in r.stdout
    assert [int(m[0]) for m in ITERATION.findall(r.stdout)] == [3]


def test_second_phase_at_a_longer_sequence_and_another_batch(wiki_shards, two_steps, tmp_path):
    save = shutil.copytree(two_steps, tmp_path / "run")
    phase2 = common(wiki_shards, save, 4, ["--eval-iters", "0", "--load", str(save),
                                           "--seq-length", "128", "--global-batch-size", "8"])
    r = launch(phase2, ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    note = re.search(r"^note: --seq-length 128 \(the checkpoint's 64\): the checkpoint had read "
                     r"32 of the ([\d,]+) samples an epoch of its packing; the run continues at "
                     r"the same fraction of the data, global sample ([\d,]+) of the ([\d,]+) an "
                     r"epoch of 128-token samples \((\S+): epoch 0, position (\d+) counted from "
                     r"0\)$", r.stdout, re.M)
    assert note, r.stdout[-3000:]
    old, start, new = (int(note[i].replace(",", "")) for i in (1, 2, 3))
    assert start == 32 * new // old and int(note[5]) == start
    assert 1.8 < old / new < 2.2  # packing twice as long: about half the samples an epoch
    assert ("note: --global-batch-size 8 (the checkpoint's 16): iterations from 3 on read 8 "
            "samples each; the optimizer state, the step count and the schedule carry on"
            in r.stdout)
    assert f"resumed from {save} at iteration 2 (32 samples consumed)" in r.stdout
    # steps 3 and 4 read 8 samples each from the new position
    assert [(int(i), int(c)) for i, c in ITERATION.findall(r.stdout)] == [(3, start + 8),
                                                                          (4, start + 16)]
    # the schedule (warm-up 4 steps to 1e-3) continues at the step, not at the samples read:
    # iteration 3 is 2/4 of the way up, where 32 samples at the new batch of 8 would be 4/4
    lr = float(re.search(r"^learning rate of iteration 3: (\S+)$", r.stdout, re.M)[1])
    assert lr == pytest.approx(1e-3 * 2 / 4, rel=1e-12), lr
    # the AdamW moments came along: their step count is the run's, not the phase's
    assert adam_steps(save / "global_step2") == {2.0}
    assert adam_steps(save / "global_step4") == {4.0}
