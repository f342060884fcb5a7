"""Transformers' DebertaV2 outputs and their differences from ours, for the DeBERTa export tests."""
from __future__ import annotations

import torch

from rtd_scale.hf import convert, debertav2
from tests.helpers.hf_models import load_checked


def _rtd_logits(hidden, head):
    """ELECTRA's discriminator_predictions (dense, GELU, dense → 1) from rtd_head.safetensors."""
    p = convert.RTD_HEAD_PREFIX
    x = torch.nn.functional.gelu(torch.nn.functional.linear(
        hidden, head[p + "dense.weight"], head[p + "dense.bias"]))
    return torch.nn.functional.linear(x, head[p + "dense_prediction.weight"],
                                      head[p + "dense_prediction.bias"]).squeeze(-1)


@torch.no_grad()
def hf_outputs(directory, ids, pad_id, head=None):
    """transformers' discriminator hidden [b, s, H], RTD logits [b, s] (``head``: the RTD head's
    tensors, default ``directory/rtd_head.safetensors``), generator hidden and MLM logits
    [b, s, V]; computed on ``ids``' device."""
    from safetensors.torch import load_file

    attention = (ids != pad_id).long()
    disc = load_checked(debertav2.ADAPTER.discriminator_class, directory).to(ids.device)
    d_hidden = disc(ids, attention_mask=attention).last_hidden_state
    head = load_file(directory / convert.RTD_HEAD_FILE) if head is None else head
    head = {k: v.to(ids.device) for k, v in head.items()}
    gen = load_checked(debertav2.ADAPTER.generator_class,
                       directory / convert.GENERATOR_DIR).to(ids.device)
    g_hidden = gen.deberta(ids, attention_mask=attention).last_hidden_state
    mlm = gen(ids, attention_mask=attention).logits
    return d_hidden, _rtd_logits(d_hidden, head), g_hidden, mlm


def _diffs(mine, theirs, keep):
    return [(a[keep] - b[keep]).abs().max().item() for a, b in zip(mine, theirs)]


def _tensors(directory, pattern="*.safetensors"):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.rglob(pattern)):
        out.update({f"{f.relative_to(directory)}:{k}": v for k, v in load_file(f).items()})
    return out


def round_trip(cfg, ctx, tok, tmp_path):
    """(first, second): ``cfg``'s model perturbed, exported to ``tmp_path / "a"``, read by
    ``--pretrained-checkpoint`` into a differently seeded model, exported again to
    ``tmp_path / "b"``; the two exports asserted equal tensor for tensor, bitwise."""
    from rtd_scale.hf.export import write_export
    from rtd_scale.hf.pretrained import load_pretrained
    from tests.helpers.hf_models import build_model, canonical_state, perturb

    def export(model, path):
        write_export(canonical_state(model, ctx), cfg.model, str(path), pad_id=tok.pad_id,
                     cls_id=tok.cls_id, sep_id=tok.sep_id, note=lambda m: None)

    first = build_model(cfg, ctx, tok, seed=3)
    perturb(first)
    export(first, tmp_path / "a")
    second = build_model(cfg, ctx, tok, seed=9)
    load_pretrained(second, str(tmp_path / "a"), cfg.model, pad_id=tok.pad_id,
                    tp_group=ctx.tp_group, tp_rank=0)
    export(second, tmp_path / "b")
    _assert_bitwise(_tensors(tmp_path / "a"), _tensors(tmp_path / "b"))
    return first, second


def _assert_bitwise(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
