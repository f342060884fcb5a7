"""Vocabulary 32,003 — padding deterministic; saved at TP=2, loaded at TP=1 (and back)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import dist as harness, dist_workers as workers

pytestmark = pytest.mark.dist

VOCAB = 32_003


def test_padded_vocab_saved_at_tp2_loads_at_tp1(tmp_path):
    path = str(tmp_path / "full.pt")
    saved = harness.run(workers.tp_agnostic_save, path, VOCAB, world_size=2, tp=2)[0]
    assert saved["padded_vocab"] == 32_256  # 128 × TP = 256 divides it
    assert saved["table_rows"] == 16_128  # this rank's half
    loaded = harness.run(workers.tp_agnostic_load, path, VOCAB, world_size=1, tp=1)[0]
    assert loaded["padded_vocab"] == 32_128
    # same logits on every real id
    assert (loaded["logits"] - saved["logits"]).abs().max().item() < 1e-5
    # padded ids are never predicted or sampled
    assert torch.isneginf(saved["padded_logits"]).all() and saved["padded_logits"].shape[1] == 253
    assert torch.isneginf(loaded["padded_logits"]).all() and loaded["padded_logits"].shape[1] == 125
    assert loaded["sampled"].max().item() < VOCAB
    # and back to TP=2 from the same file
    again = harness.run(workers.tp_agnostic_load, path, VOCAB, world_size=2, tp=2)[0]
    assert (again["logits"] - saved["logits"]).abs().max().item() < 1e-5
