"""Resuming with another ``--seed`` would reshuffle the data mid-epoch: refused in one line,
unless ``--override-data-order``, which says where the new order starts."""
from __future__ import annotations

import re

from tests.helpers.launcher import common, launch, pretrain_error

ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|", re.M)


def test_resume_with_another_seed_is_refused_unless_overridden(wiki_shards, tmp_path, capsys,
                                                               monkeypatch):
    save = tmp_path / "run"
    r = launch(common(wiki_shards, save, 2, ["--eval-iters", "0"]), ranks=1)  # --seed 11
    assert r.returncode == 0, r.stderr[-3000:]
    assert (save / "latest").read_text().strip() == "global_step2"

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
    assert [int(m) for m in ITERATION.findall(r.stdout)] == [3]
