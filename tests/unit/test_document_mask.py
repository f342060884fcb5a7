"""Document-masked packing (``--reset-attention-mask``; rtd_scale/data/packed.py's document ids,
rtd_scale/model/document_mask.py): the data path marks each packed sample's documents from the
sample index, the model attends within a document and restarts positions at each, and nothing
else changes — the same samples, order and MLM masks. The proof: at 2,048 tokens, a token of the
second document of a packed sample gets the discriminator output it gets when that document is
run alone from position 0, in BERT's, DeBERTa's and the modern block's layouts; without the
switch it does not."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rtd_scale.config import Sharing
from rtd_scale.data.blend import build_split
from rtd_scale.data.loader import DataParallelSampler, build_loader
from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.shards import ShardWriter
from rtd_scale.model.document_mask import attention_mask, document_position_ids
from tests.helpers import tiny_model


def _shard(tmp_path, docs) -> str:
    prefix = str(tmp_path / "docs")
    with ShardWriter(prefix, vocab_size=1000) as w:
        for d in docs:
            w.add_document(np.asarray(d, np.int64))
    return prefix


def test_document_ids_come_from_the_index_and_the_mask_is_block_diagonal(tmp_path):
    # the second document holds the [SEP] id (2) itself: only the index says where one ends
    ds = PackedDataset([_shard(tmp_path, [[10, 11, 12], [20, 2, 21], [30], [40, 41, 42, 43]])],
                       seq_length=10, cache=False)
    ids0, doc0 = ds.sample(0, documents=True)
    ids1, doc1 = ds.sample(1, documents=True)
    # [CLS] joins the first document; the body ends on the second's closing [SEP], and the
    # sample's final [SEP] stays in that run
    np.testing.assert_array_equal(ids0, [1, 10, 11, 12, 2, 20, 2, 21, 2, 2])
    np.testing.assert_array_equal(doc0, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    # the last sample: padding is a run of its own
    np.testing.assert_array_equal(ids1, [1, 30, 2, 40, 41, 42, 43, 2, 2, 0])
    np.testing.assert_array_equal(doc1, [0, 0, 0, 1, 1, 1, 1, 1, 1, 2])
    assert ds.sample(0)[1] is None and np.array_equal(ds[0], ids0)  # the samples themselves

    docs = torch.from_numpy(np.stack([doc0, doc1]))
    pad = torch.from_numpy(np.stack([ids0, ids1])) == 0
    mask = attention_mask(pad, docs)
    assert mask.shape == (2, 1, 10, 10)
    for b in range(2):
        for i in range(10):
            for j in range(10):
                crosses = bool(docs[b, i] != docs[b, j]) or bool(pad[b, j])
                assert bool(mask[b, 0, i, j]) == crosses, (b, i, j)
    # sample 1: documents [0, 3) and [3, 9) are diagonal blocks, the [PAD] key masked for all
    assert not mask[1, 0, :3, :3].any() and mask[1, 0, :3, 3:].all()
    assert not mask[1, 0, 3:9, 3:9].any() and mask[1, 0, :, 9].all()
    # negative control: without document ids only [PAD] keys are masked, so the documents see
    # each other
    key_only = attention_mask(pad, None)
    assert key_only.shape == (2, 1, 1, 10)
    full = key_only.expand(2, 1, 10, 10)
    assert not full[1, 0, :3, 3:9].any() and full[1, 0, :, 9].all()
    assert attention_mask(None, None) is None


def test_position_ids_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1, 1, 1, 1, 2]])
    np.testing.assert_array_equal(document_position_ids(docs).numpy(),
                                  [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], [0, 1, 2, 0, 1, 2, 3, 4, 5, 0]])
    assert document_position_ids(torch.zeros(1, 6, dtype=torch.int32)).tolist() == [
        list(range(6))]  # one document: positions as without the switch


def test_data_order_and_mlm_masks_are_the_same_with_the_switch(two_datasets,
                                                               single_process_group):
    """Three steps of a blend through the loader, with and without document ids: the same
    samples in the same order with the same sample indices, hence the same MLM masks; the model
    then sees other attention (its RTD logits differ) but masks the same positions."""
    a, b = two_datasets
    kw = dict(seq_length=16, split=(1,), part=0, seed=3)
    read = {}
    for on in (False, True):
        data = build_split([(0.75, [a]), (0.25, [b])], document_ids=on, **kw)
        sampler = DataParallelSampler(total_samples=24, consumed_samples=0, global_batch_size=8,
                                      micro_batch_size=4, dp_rank=0, dp_size=1)
        read[on] = list(build_loader(data, sampler, num_workers=0, pin_memory=False))
    assert len(read[True]) == len(read[False]) == 6
    cfg = tiny_model.tiny_config(Sharing.GDES, vocab_size=600)  # the datasets' ids: 100-549
    model = tiny_model.tiny_rtd_model(cfg).eval()
    runs = 0
    for off, on in zip(read[False], read[True]):
        assert off.document_ids is None and on.document_ids.shape == (4, 16)
        assert torch.equal(off.input_ids, on.input_ids)
        assert torch.equal(off.sample_index, on.sample_index)
        m_off, m_on = model.mask(off.input_ids, off.sample_index), model.mask(on.input_ids,
                                                                             on.sample_index)
        assert torch.equal(m_off.masked, m_on.masked)
        assert torch.equal(m_off.generator_input, m_on.generator_input)
        # each run of document ids ends at a [SEP] (a closing one or the sample's last)
        ids, docs = on.input_ids, on.document_ids
        ends = torch.ones_like(docs, dtype=torch.bool)
        ends[:, :-1] = docs[:, 1:] != docs[:, :-1]
        assert (ids[ends & (ids != 0)] == 2).all()
        runs += int(ends.sum())
        with torch.no_grad():
            out_off = model(off.input_ids, off.sample_index, step=1)
            out_on = model(on.input_ids, on.sample_index, step=1, document_ids=docs)
        assert torch.equal(out_off.masked, out_on.masked)
        assert not torch.allclose(out_off.rtd_logits, out_on.rtd_logits, atol=1e-3)
    assert runs > 2 * 6 * 4  # several documents a sample: the switch had boundaries to mask


@pytest.mark.parametrize("layout, attention",
                         [("pre", "bert"), ("post", "disentangled"), ("pre", "rotary")])
def test_a_document_inside_a_packed_sample_is_scored_as_if_alone(tmp_path, single_process_group,
                                                                 layout, attention):
    """2,048-token samples over three documents (600, 900 and 1,000 tokens): the discriminator's
    logits at every token of the second document equal those of the document run alone (its
    tokens and closing [SEP], positions from 0), within float reassociation (measured ≤ 1e-5 on
    logits of mean size ~2); without document ids they differ (the negative control, measured
    4.7 to 10). Weights are drawn with std 0.3, not 0.02, so that attention is peaked as in a
    trained model: at 0.02 the other documents move DeBERTa's output by 1e-5 only. The modern
    block's case has rotary positions and an 8-token window in its local layers, which sees
    across a boundary where the mask does not cut it."""
    g = np.random.default_rng(0)
    docs = [g.integers(5, 300, n) for n in (600, 900, 1000)]
    ds = PackedDataset([_shard(tmp_path, docs)], seq_length=2048, cache=False)
    ids, doc_ids = ds.sample(0, documents=True)
    assert np.array_equal(np.bincount(doc_ids), [602, 901, 545])  # [CLS]+600+[SEP], 900+[SEP], …
    second = slice(602, 602 + 901)
    alone = torch.from_numpy(ids[second]).unsqueeze(0)
    np.testing.assert_array_equal(alone[0, :-1].numpy(), docs[1])

    cfg = tiny_model.tiny_config(Sharing.GDES, layout=layout, attention=attention)
    cfg.model.max_position_embeddings = 2048
    cfg.model.init_method_std = 0.3
    model = tiny_model.tiny_rtd_model(cfg).eval()
    packed = torch.from_numpy(ids).unsqueeze(0)
    documents = torch.from_numpy(doc_ids).unsqueeze(0)

    def logits(x, document_ids=None):
        with torch.no_grad():
            return model.rtd_head(model.discriminator(x, None, document_ids))[0]

    by_itself = logits(alone)
    masked = logits(packed, documents)[second]
    assert by_itself.abs().mean() > 0.5
    assert torch.allclose(masked, by_itself, rtol=0, atol=5e-5), \
        (masked - by_itself).abs().max().item()
    assert (logits(packed)[second] - by_itself).abs().max().item() > 0.5


def test_the_flex_core_refuses_a_document_mask_before_any_kernel():
    from rtd_scale.model.disentangled import disentangled_attention

    q = torch.zeros(1, 2, 4, 8)
    pos = torch.zeros(2, 8, 8)
    mask = attention_mask(None, torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(ValueError, match="not a document mask .*sdpa or explicit core"):
        disentangled_attention(q, q, q, pos, pos, torch.zeros(4, 4, dtype=torch.long), mask,
                               impl="flex")


def test_either_megatron_name_sets_the_one_switch_on_in_the_modern_presets_only():
    from rtd_scale import arguments
    from rtd_scale.presets import PRESETS

    base = ["--ds_config", "ds_configs/zero3.json", "--data-path", "D", "--tokenizer-model",
            "t.model"]
    parse = arguments.build_parser().parse_args
    assert not arguments.config_from_args(parse(base)).data.document_masking
    for flag in ("--reset-attention-mask", "--reset-position-ids"):
        assert arguments.config_from_args(parse([*base, flag])).data.document_masking
    on = [name for name, make in PRESETS.items() if make().data.document_masking]
    assert on == ["modernbert-tiny", "modernbert-base", "modernbert-large"]
    assert arguments.config_from_args(parse([*base, "--preset", "modernbert-tiny"])
                                      ).data.document_masking


def test_a_resume_that_switches_document_masking_says_so_in_one_line():
    """Accepted (the samples, order and masks carry on; no parameter changes), with a note."""
    from rtd_scale.presets import preset
    from rtd_scale.resume import _resume_notes

    cfg = preset("tiny")

    def notes(now: bool, saved_data: dict) -> list[str]:
        cfg.data.document_masking = now
        return _resume_notes(cfg, {}, 10, 320, None, None, None, None, None, saved_data)

    assert notes(True, {"document_masking": True}) == [] == notes(False, {})
    [on] = notes(True, {})  # a checkpoint from before the field: it was off
    assert on.startswith("note: document masking (--reset-attention-mask) is on, the "
                         "checkpoint's run had it off: from iteration 11 attention stays within "
                         "each document")
    [off] = notes(False, {"document_masking": True})
    assert "is off, the checkpoint's run had it on" in off and "\n" not in off
