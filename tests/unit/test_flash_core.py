"""The flash core of disentangled attention (rtd_scale/model/disentangled_flash.py):
flashdeberta's Triton kernels, run on the CPU in Triton's interpreter, give the explicit core's
outputs and the gradients of q, k, v and both projected relative tables in fp32 within 1e-5
(relative to the largest value) — padded, document-masked (varlen), at the presets' buckets —
and a wrong bucket rule or swapped c2p / p2c tables are caught by the same comparison.
TP 2: tests/multiproc/test_tensor_parallel.py."""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest
import torch

from rtd_scale.config import ConfigError, DisentangledCore
from rtd_scale.model import disentangled_flash, document_mask
from rtd_scale.model.disentangled import (disentangled_attention, relative_position_index,
                                          used_rows)
from tests.helpers.tiny_model import tiny_config

HAVE_FLASH = all(importlib.util.find_spec(m) is not None for m in ("triton", "flashdeberta"))
needs_flash = pytest.mark.skipif(not HAVE_FLASH, reason="needs triton and flashdeberta "
                                                        "(pip install '.[test]')")
TOL = 1e-5


def _tiny_deberta(core: str, dropout: float = 0.0):
    cfg = tiny_config(sharing="gdes", layout="post", attention="disentangled", dropout=dropout)
    cfg.model.disentangled_core = core
    return cfg


@pytest.mark.skipif(disentangled_flash._FIXED in sys.modules,
                    reason="flashdeberta is already imported in this process")
def test_off_cuda_the_default_core_runs_with_one_note(single_process_group, monkeypatch):
    """On a CPU without Triton's interpreter the flash core is the explicit one, with one note
    for the whole process (several layers, two forwards)."""
    from tests.helpers.tiny_model import build
    from tests.helpers.dist_workers import fixed_batch

    monkeypatch.setattr(disentangled_flash, "_noted", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's (tests/conftest.py)
    ids, idx = fixed_batch(b=2)
    losses, notes = {}, {}
    for core in ("auto", "flash"):
        model = build(_tiny_deberta(core), seed=7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses[core] = [model(ids, idx, step=3).loss.item() for _ in range(2)]
        notes[core] = [str(w.message) for w in caught if "attention core" in str(w.message)]
    assert notes == {"auto": [], "flash": ["the flash attention core runs on CUDA "
                                           "(flashdeberta's Triton kernels); running the "
                                           "explicit core on cpu"]}
    assert losses["flash"] == losses["auto"]


def test_dropout_is_refused_in_one_line():
    """flashdeberta has no attention-probability dropout: the config refuses the flash core
    with attention dropout, naming the field and both ways out; the core itself too."""
    cfg = _tiny_deberta("flash", dropout=0.1)
    with pytest.raises(ConfigError) as e:
        cfg.model.validate()
    assert str(e.value) == (
        "model.disentangled_core 'flash' has no attention-probability dropout, but "
        "model.discriminator.attention_dropout is 0.1: pass --attention-dropout 0 (the generator "
        "follows it unless --generator-attention-dropout is given), or --set "
        "model.disentangled_core=sdpa")
    cfg.model.discriminator.attention_dropout = 0.0  # the generator's alone: its own flag
    with pytest.raises(ConfigError) as e:
        cfg.model.validate()
    assert str(e.value) == (
        "model.disentangled_core 'flash' has no attention-probability dropout, but "
        "model.generator.attention_dropout is 0.1: pass --generator-attention-dropout 0, or --set "
        "model.disentangled_core=sdpa")
    _tiny_deberta("flash").model.validate()  # without dropout: accepted
    _tiny_deberta("sdpa", dropout=0.1).model.validate()
    q = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="^the flash attention core has no attention-"
                                         "probability dropout"):
        disentangled_flash.flash_disentangled_attention(
            q, q, q, q[0], q[0], None, scale=0.1, first_row=0, position_buckets=2,
            max_relative_positions=8, dropout_p=0.1)
    with pytest.warns(UserWarning, match="model.disentangled_core 'flash' has no effect"):
        c = tiny_config(sharing="gdes", layout="post").model
        c.disentangled_core = DisentangledCore.FLASH
        c.validate()


# --- on Triton's interpreter ----------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreted():
    """flashdeberta's ``ops.position``, its kernels running in Triton's interpreter (the suite
    sets TRITON_INTERPRET=1 at start-up without a CUDA device: tests/conftest.py)."""
    if not HAVE_FLASH:
        pytest.skip("needs triton and flashdeberta (pip install '.[test]')")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off: tests/conftest.py turns it on without a "
                    "CUDA device")
    assert disentangled_flash.on_interpreter()
    assert disentangled_flash.runs_on(torch.device("cpu"))
    from flashdeberta.ops import position

    return position


def _inputs(b, n, s, d, buckets, max_rel, seed=0):
    span = buckets if buckets > 0 else max_rel
    lo, hi = used_rows(s, span, buckets, max_rel)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=g) for _ in range(3))
    pos_q, pos_k = (torch.randn(n, hi - lo, d, generator=g) for _ in range(2))
    upstream = torch.randn(b, n, s, d, generator=g)  # every row, [PAD] queries' too
    return (q, k, v, pos_q, pos_k), lo, upstream


def _explicit(tensors, lo, mask, s, buckets, max_rel):
    span = buckets if buckets > 0 else max_rel
    index = relative_position_index(s, span, buckets, max_rel) - lo
    return disentangled_attention(*tensors, index, mask, impl="explicit")


def _flash(tensors, lo, mask, buckets, max_rel):
    d = tensors[0].shape[-1]
    return disentangled_flash.flash_disentangled_attention(
        *tensors, mask, scale=1.0 / (3 * d) ** 0.5, first_row=lo, position_buckets=buckets,
        max_relative_positions=max_rel)


def _worst(run, ref_run, tensors, upstream) -> float:
    """The largest relative difference (max |a − b| / max |b|) of the outputs and of the
    gradients of q, k, v, pos_q, pos_k between ``run`` and ``ref_run``."""
    results = []
    for fn in (run, ref_run):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = fn(leaves)
        grads = torch.autograd.grad((out * upstream).sum(), leaves)
        results.append([out.detach(), *grads])
    return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(*results))


def _documents(b, s):
    """Document ids [b, s] and [PAD] [b, s]: sample 0 holds three documents and padding,
    sample 1 two documents and no padding (the padding a run of its own, as PackedDataset's)."""
    docs = torch.zeros(b, s, dtype=torch.int32)
    pad = torch.zeros(b, s, dtype=torch.bool)
    docs[0, 9:], docs[0, 23:], docs[0, 34:], pad[0, 34:] = 1, 2, 3, True
    docs[1, 17:] = 1
    return docs, pad


# (b, n, s, d, position_buckets, max_relative_positions, [PAD] from, documents)
CASES = {
    # 8 buckets over 40 tokens: distances past 4 log-bucketed (a small table)
    "no padding": (2, 2, 40, 16, 8, 64, None, False),
    "right padding": (2, 2, 40, 16, 8, 64, 25, False),
    # 72 tokens: no multiple of the kernels' 64-, 32- and 16-row tiles; head size 12 (padded
    # to 16 at the boundary)
    "length off the tiles": (2, 2, 72, 12, 8, 64, 50, False),
    # the large presets' 256 buckets up to 512 at the presets' head size 64: 200 tokens reach
    # the log buckets past 128
    "presets' buckets": (1, 1, 200, 64, 256, 512, 170, False),
    "no buckets": (1, 2, 40, 16, -1, 16, 30, False),  # distances past 16 clamped
    "three documents (varlen)": (2, 2, 40, 16, 8, 64, None, True),
}


def _case(name):
    b, n, s, d, buckets, max_rel, pad_from, documents = CASES[name]
    tensors, lo, upstream = _inputs(b, n, s, d, buckets, max_rel)
    if documents:
        docs, pad = _documents(b, s)
        ref_mask = document_mask.attention_mask(pad, docs)  # [b, 1, s, s], the explicit mask
        mask = document_mask.document_keys(pad, docs, (b, s))  # [b, s], the compact one
    elif pad_from is not None:
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[-1, ..., pad_from:] = True
        ref_mask = mask
    else:
        mask = ref_mask = None
    return tensors, lo, upstream, mask, ref_mask, (s, buckets, max_rel)


@needs_flash
@pytest.mark.parametrize("name", list(CASES))
def test_flash_equals_explicit(interpreted, name):
    tensors, lo, upstream, mask, ref_mask, (s, buckets, max_rel) = _case(name)
    worst = _worst(lambda t: _flash(t, lo, mask, buckets, max_rel),
                   lambda t: _explicit(t, lo, ref_mask, s, buckets, max_rel), tensors, upstream)
    assert worst <= TOL, f"{name}: {worst:.3g}"


@needs_flash
@pytest.mark.parametrize("name", ["right padding", "three documents (varlen)"])
@pytest.mark.parametrize("wrong", ["bucket rule", "c2p and p2c swapped"])
def test_the_comparison_catches_a_wrong_rule(interpreted, name, wrong):
    """Negative controls: the flash core given another bucket rule (the log buckets spread to
    128 instead of 64) or the tables swapped is far from the explicit core."""
    tensors, lo, upstream, mask, ref_mask, (s, buckets, max_rel) = _case(name)
    q, k, v, pos_q, pos_k = tensors

    def run(t):
        if wrong == "bucket rule":
            return _flash(t, lo, mask, buckets, 2 * max_rel)
        return _flash([t[0], t[1], t[2], t[4], t[3]], lo, mask, buckets, max_rel)

    worst = _worst(run, lambda t: _explicit(t, lo, ref_mask, s, buckets, max_rel), tensors,
                   upstream)
    assert worst > 1e-2, f"{name}, {wrong}: {worst:.3g}"


@needs_flash
@pytest.mark.parametrize("s, buckets, max_rel", [(512, 256, 512), (40, 8, 64), (300, -1, 128)])
def test_their_slot_of_each_distance_is_ours(interpreted, s, buckets, max_rel):
    """flashdeberta's lookup table (the relative row of each distance i − j, its
    ``ops/position.py``) equals ``relative_position_index`` at every distance; another rule
    (max_relative_positions doubled) does not, where there are log buckets."""
    span = buckets if buckets > 0 else max_rel
    ours = relative_position_index(s, span, buckets, max_rel)
    i, j = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    plan = interpreted.position_plan(s, s, buckets, max_rel, span, torch.device("cpu"))
    assert torch.equal(plan.lut.long()[i - j + s - 1], ours)
    if buckets > 0 and s > buckets // 2 + 1:
        other = interpreted.position_plan(s, s, buckets, 2 * max_rel, span, torch.device("cpu"))
        assert not torch.equal(other.lut.long()[i - j + s - 1], ours)


@needs_flash
def test_padding_must_be_on_the_right(interpreted):
    """A [PAD] before a real token cannot be one length: refused in one line."""
    tensors, lo, _, _, _, _ = _case("no padding")
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 5] = True
    with pytest.raises(RuntimeError, match="^the flash attention core needs right padding"):
        _flash(tensors, lo, mask, 8, 64)
    docs, pad = _documents(2, 40)
    docs[1, 30:] = 0  # document 0 again: not a contiguous run
    with pytest.raises(RuntimeError, match="documents as contiguous runs"):
        _flash(tensors, lo, document_mask.document_keys(pad, docs, (2, 40)), 8, 64)
