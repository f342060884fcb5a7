"""--mask-strategy through the real launcher at TP=2: the masks the run trained with (its
--data-digest) are the ones ``mask_tokens`` computes for the same samples in this process."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from rtd_scale.config import MaskStrategy
from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.tokenizer import Tokenizer
from rtd_scale.objectives.masking import mask_tokens
from tests.helpers.launcher import common, launch

pytestmark = pytest.mark.e2e


def test_span_masks_at_tp2_equal_the_single_process_masks(wiki_shards, tmp_path):
    tok_path, prefix = wiki_shards
    save = tmp_path / "run"
    r = launch(common(wiki_shards, save, 3, [
        "--tensor-model-parallel-size", "2", "--mask-strategy", "span",
        "--set", "rtd.span_max_words=6", "--data-digest", str(save / "digest.jsonl")],
        ds_config="ds_configs/zero0.json", global_batch_size=8, seed=13, lr=None,
        lr_warmup_iters=None, save_interval=None))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world 2 = TP 2 × PP 1 × DP 1" in r.stdout
    assert "MLM slots" not in r.stderr  # English spans fit: no start-up warning (unit_fit.py)
    config = json.loads((save / "config.json").read_text())
    assert config["rtd"]["mask_strategy"] == "span" and config["rtd"]["span_max_words"] == 6

    tok = Tokenizer(tok_path)
    table = torch.from_numpy(tok.word_start_table())
    ds = PackedDataset([prefix], seq_length=64, split=(969, 30, 1), part=0)
    lines = [json.loads(x) for x in (save / "digest.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    for line in lines:
        ids = torch.from_numpy(np.stack([ds[s] for _, s in line["samples"]]))
        assert hashlib.sha256(ids.numpy().tobytes()).hexdigest() == line["inputs_sha256"]
        m = mask_tokens(ids, torch.tensor(line["sample_index"]), seed=13, mask_prob=0.15,
                        mask_token_prob=0.8, random_token_prob=0.1, mask_id=tok.mask_id,
                        vocab_size=tok.vocab_size, special_ids=tok.special_ids, strategy=MaskStrategy.SPAN,
                        word_start_table=table, span_max_words=6)
        masks = np.packbits(m.masked.numpy())
        assert hashlib.sha256(masks.tobytes()).hexdigest() == line["masks_sha256"]
        token = mask_tokens(ids, torch.tensor(line["sample_index"]), seed=13, mask_prob=0.15,
                            mask_token_prob=0.8, random_token_prob=0.1, mask_id=tok.mask_id,
                            vocab_size=tok.vocab_size, special_ids=tok.special_ids)
        assert not torch.equal(token.masked, m.masked)  # the flag changed what was masked
