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


# --- the compact mask and FlexAttention's block mask (the CUDA path; forward checked here) ---

def _packed_keys(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three samples of ``s`` tokens: documents of uneven lengths ending in [PAD]; one document
    and no [PAD]; a short document, then [PAD] to the end. (pad [b, s], document_ids [b, s])"""
    g = np.random.default_rng(1)
    cuts = np.sort(g.choice(np.arange(5, s - 20), 6, replace=False))
    doc0 = np.searchsorted(cuts, np.arange(s), side="right")
    pad = np.zeros((3, s), bool)
    pad[0, s - 17:] = True
    pad[2, 40:] = True
    docs = np.stack([doc0, np.zeros(s, np.int64), np.zeros(s, np.int64)])
    docs[0, s - 17:] = docs[0, s - 18] + 1  # the padding, a run of its own
    docs[2, 40:] = 1
    return torch.from_numpy(pad), torch.from_numpy(docs)


def _band(s: int, window) -> torch.Tensor:
    from rtd_scale.model.attention import window_keep

    return torch.ones(s, s, dtype=torch.bool) if window is None else window_keep(s, window)


def _tiles(num: torch.Tensor, idx: torch.Tensor, t: int) -> torch.Tensor:
    """A BlockMask's tile lists as [b, t, t] bool."""
    b = num.shape[0]
    out = torch.zeros(b, t, t, dtype=torch.bool)
    for bi in range(b):
        for q in range(t):
            out[bi, q, idx[bi, 0, q, :num[bi, 0, q]].long()] = True
    return out


@pytest.mark.parametrize("s, block, window", [(300, 128, None), (300, 128, (16, 16)),
                                              (200, 32, (8, 8)), (256, 64, None)])
def test_the_block_mask_from_tile_ranges_covers_exactly_the_explicit_mask(s, block, window):
    """``document_mask.block_mask`` against the [b, s, s] mask it never writes: every tile it
    calls full holds only kept pairs (no mask_mod runs there), every kept pair lies in a tile it
    lists, and without a window its tiles are create_block_mask's (which evaluates every pair),
    full and partial alike."""
    from torch.nn.attention.flex_attention import create_block_mask

    from rtd_scale.model.document_mask import block_mask, document_keys, expand

    pad, docs = _packed_keys(s)
    keys = document_keys(pad, docs, pad.shape)
    keep = ~expand(keys)[:, 0] & _band(s, window)  # [b, s, s]
    bm = block_mask(keys, window, block)
    t = -(-s // block)
    full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, t)
    listed = full | _tiles(bm.kv_num_blocks, bm.kv_indices, t)
    assert not (full & _tiles(bm.kv_num_blocks, bm.kv_indices, t)).any()
    padded = torch.nn.functional.pad(keep, (0, t * block - s, 0, t * block - s))
    per_tile = padded.view(3, t, block, t, block).transpose(2, 3)  # [b, tq, tk, block, block]
    any_kept = per_tile.flatten(-2).any(-1)
    assert (listed | ~any_kept).all()  # a tile with a kept pair is listed
    for bi, q, k in full.nonzero().tolist():  # a full tile: every pair inside the sequence kept
        rows = slice(q * block, min(s, (q + 1) * block))
        cols = slice(k * block, min(s, (k + 1) * block))
        assert keep[bi, rows, cols].all(), (bi, q, k)
    # tiles skipped, with mask_mod and (a window of 33 is narrower than any tile) full occur
    assert (listed & ~full).any() and not listed.all() and full.any() == (window is None)

    reference = create_block_mask(
        lambda b, h, qi, kj: keep[b, qi, kj], 3, None, s, s, device="cpu", BLOCK_SIZE=block)
    if window is None:  # document ranges are exact: the same tiles as every pair evaluated
        assert torch.equal(listed, reference.to_dense()[:, 0].bool())
        assert torch.equal(full, _tiles(reference.full_kv_num_blocks, reference.full_kv_indices,
                                        t))


def test_the_block_mask_at_8192_tokens_writes_nothing_of_size_s_squared():
    """The construction's tensors, each op's output recorded: at b 2 and s 8,192 the largest
    has at most 2·b·s elements (the [b, s] ids padded; the tile lists are [b, 64, 64]), not the
    explicit mask's b·s² = 134M."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rtd_scale.model.document_mask import block_mask, document_keys

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    Largest.numel = max(Largest.numel, o.numel())
            return out

    b, s = 2, 8192
    docs = torch.arange(s).div(700, rounding_mode="floor").expand(b, s)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 8000:] = True
    with Largest():
        mask = block_mask(document_keys(pad, docs, (b, s)), (64, 64))
    assert mask.kv_indices.shape == (b, 1, 64, 64)
    assert 0 < Largest.numel <= 2 * b * s, Largest.numel
    # the window and the documents cut it: 64 key tiles of 64 possible are never listed
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) <= 3 * 64 * b


def test_the_compact_mask_is_cudas_unless_switched_off(monkeypatch):
    from rtd_scale.model.document_mask import FLEX_ENV, compact_on

    monkeypatch.delenv(FLEX_ENV, raising=False)
    assert compact_on(torch.device("cuda")) and not compact_on(torch.device("cpu"))
    monkeypatch.setenv(FLEX_ENV, "0")
    assert not compact_on(torch.device("cuda"))
    monkeypatch.setenv(FLEX_ENV, "1")
    assert compact_on(torch.device("cuda", 0))


def test_the_compact_mask_written_out_is_the_explicit_mask():
    from rtd_scale.model.document_mask import document_keys, expand

    pad, docs = _packed_keys(96)
    assert torch.equal(expand(document_keys(pad, docs, pad.shape)), attention_mask(pad, docs))


@pytest.mark.parametrize("attention", ["bert", "rotary"])
def test_the_model_under_the_compact_mask_equals_the_explicit_mask(single_process_group,
                                                                   monkeypatch, attention):
    """The CUDA path's wiring, run on the CPU: with ``compact_on`` true the encoder hands its
    layers the [b, s] ids and every SDPACoreAttention runs FlexAttention (eager: forward only)
    over the block mask; the discriminator's logits at every real token equal those under the
    explicit [b, 1, s, s] mask within float reassociation (measured 8.6e-6 and 7.7e-6 on logits
    of mean size ~2), in BERT's layout and the modern block's (8-token window in its local
    layers). Negative control: the compact mask without document ids lets the documents see
    each other (measured 11.3 and 8.2)."""
    from rtd_scale.model import document_mask

    cfg = tiny_model.tiny_config(Sharing.GDES, attention=attention)
    cfg.model.max_position_embeddings = 256
    cfg.model.init_method_std = 0.3
    model = tiny_model.tiny_rtd_model(cfg).eval()
    pad, docs = _packed_keys(256)
    ids = torch.randint(5, 300, pad.shape, generator=torch.Generator().manual_seed(2))
    ids[pad] = 0

    def logits(document_ids):
        with torch.no_grad():
            return model.rtd_head(model.discriminator(ids, pad, document_ids))  # [b, s]

    explicit = logits(docs)
    monkeypatch.setattr(document_mask, "compact_on", lambda device: True)
    compact = logits(docs)
    real = ~pad
    assert explicit.abs()[real].mean() > 0.5
    assert torch.allclose(compact[real], explicit[real], rtol=0, atol=5e-5), \
        (compact[real] - explicit[real]).abs().max().item()
    assert (logits(None)[real] - explicit[real]).abs().max().item() > 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("window", [None, (16, 16)])
def test_cuda_flex_document_attention_and_its_gradients_equal_the_explicit_masks(window):
    """On CUDA (bench/device_check.sh runs it): compiled FlexAttention over the block mask
    gives the explicit mask's outputs at real queries and the same gradients of q, k and v."""
    from rtd_scale.model.attention import flex_masked_attention, window_keep
    from rtd_scale.model.document_mask import document_keys, expand

    pad, docs = _packed_keys(300)
    keys = document_keys(pad, docs, pad.shape).cuda()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 300, 16, generator=g).cuda().requires_grad_() for _ in range(3))
    real = (~pad).cuda().view(3, 1, 300, 1)
    keep = ~expand(keys) & (True if window is None else window_keep(300, window, "cuda"))
    keep = keep | ~keep.any(-1, keepdim=True)
    grads = []
    for fn in (lambda: flex_masked_attention(q, k, v, keys, window, 0.25),
               lambda: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, attn_mask=keep, scale=0.25)):
        out = fn() * real
        out.square().sum().backward()
        grads.append([out.detach()] + [x.grad.clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    for got, want in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3), (got - want).abs().max().item()


def test_modernbert_base_flex_attention_and_its_gradients_equal_the_explicit_band_mask(
        single_process_group, monkeypatch):
    """What the CUDA path runs in the modern block, at ``modernbert-base``'s attention shapes (12
    heads of 64, its generator's and discriminator's alike, 1,024 tokens; a global layer and a
    local layer of ModernBERT's 128-token window), on two packed samples (documents of uneven
    lengths ending in [PAD]; one document filling the sample): the product's own
    ``SDPACoreAttention`` given the compact mask (FlexAttention over
    ``document_mask.block_mask``) and given the explicit [b, 1, s, s] mask with its band (SDPA,
    the CPU path) agree at every real query, outputs and the gradients of q, k and v, within
    fp32 reassociation (measured 4e-7 to 7e-7 of the largest value; asserted 1e-5).

    Two halves, because the CPU has no fused FlexAttention backward (PyTorch 2.13:
    ``flex_attention`` refuses ``requires_grad`` inputs on the CPU, eager or compiled, with
    "FlexAttention does not support backward on CPU"; with that check lifted the compiled
    backward fails in Inductor with "IndexError: tuple index out of range"):
    - the gradients run FlexAttention's own autograd (its eager forward and ``sdpa_dense_backward``,
      what PyTorch runs on CUDA without compiling) with the CPU check lifted; that path reads
      the block mask's ``mask_mod`` on every pair;
    - the fused kernel also reads the tile lists (skipping unlisted tiles, no ``mask_mod`` in
      full ones), so the pairs it keeps, tile by tile, are checked to be the explicit mask's.
    Negative control: the compact mask without document ids (documents see each other) moves
    the outputs far past the tolerance (measured 0.86 and 0.90)."""
    import torch.nn.attention.flex_attention as flex_api
    from megatron.core.transformer.enums import AttnMaskType

    from rtd_scale.presets import preset
    from rtd_scale.model.attention import SDPACoreAttention
    from rtd_scale.model.document_mask import block_mask, document_keys
    from rtd_scale.model.encoder import transformer_config

    cfg = preset("modernbert-base")
    s = cfg.data.seq_length
    assert s == 1024 and cfg.model.window_size == 128
    shapes = set()
    for enc in (cfg.model.generator, cfg.model.discriminator):
        tc = transformer_config(enc, init_std=0.02, tensor_model_parallel_size=1, model=cfg.model)
        for n in range(1, enc.num_layers + 1):
            core = SDPACoreAttention(tc, n, AttnMaskType.padding, "self")
            shapes.add((enc.num_attention_heads, tc.kv_channels, core.window_size))
    assert shapes == {(12, 64, None), (12, 64, (64, 64))}  # both encoders: global and local
    cores = {}
    tc = transformer_config(cfg.model.discriminator, init_std=0.02, tensor_model_parallel_size=1,
                            model=cfg.model)
    for n in (1, 2):  # layer 1 global, layer 2 local (ModernBERT: every third layer global)
        core = SDPACoreAttention(tc, n, AttnMaskType.padding, "self")
        cores[core.window_size] = core

    monkeypatch.setattr(flex_api, "_validate_device", lambda q, k, v: None)
    pad, docs = (x[:2] for x in _packed_keys(s))
    b = pad.shape[0]
    keys = document_keys(pad, docs, pad.shape)
    explicit = attention_mask(pad, docs)
    real = (~pad).t().reshape(s, b, 1)
    g = torch.Generator().manual_seed(5)
    qkv = [torch.randn(s, b, 12, 64, generator=g) for _ in range(3)]
    weight = torch.randn(s, b, 12 * 64, generator=g)

    def run(core, mask):
        q, k, v = (x.clone().requires_grad_() for x in qkv)
        out = core(q, k, v, mask) * real
        (out * weight).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    def rel(x, y):
        return (x - y).abs().max().item() / y.abs().max().item()

    for window, core in cores.items():
        # the pairs the fused kernel keeps: full tiles whole, listed tiles where mask_mod holds
        bm = block_mask(keys, window)
        t = -(-s // 128)
        full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, t)
        partial = _tiles(bm.kv_num_blocks, bm.kv_indices, t)
        def up(m):  # [b, t, t] tiles → [b, s, s] pairs
            return m.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :s, :s]

        i = torch.arange(s)
        mod = bm.mask_mod(torch.arange(b).view(b, 1, 1), 0, i.view(1, s, 1), i.view(1, 1, s))
        kernel_keeps = up(full) | (up(partial) & mod)
        keep = ~explicit[:, 0] & _band(s, window)
        assert torch.equal(kernel_keeps, keep), window
        assert full.any() == (window is None) and partial.any() and not (full | partial).all()

        want = run(core, explicit)
        got = run(core, keys)
        errors = {name: rel(x, y) for name, x, y in zip(("out", "dq", "dk", "dv"), got, want)}
        assert max(errors.values()) < 1e-5, (window, errors)
        with torch.no_grad():
            crossed = core(*qkv, document_keys(pad, None, pad.shape)) * real
        assert rel(crossed, want[0]) > 1e-2, window
