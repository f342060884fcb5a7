"""What an attention type means (config.ATTENTION_TRAITS) and where DeBERTa's relative table
travels (model/disentangled.py): in the TransformerBlock's ``context`` and the self-attention's
``attention_bias``, never in megatron-core's rotary arguments, which carry the rotary attention's
angles (model/modern.py) and nothing else."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import ATTENTION_TRAITS, AttentionTraits, AttentionType, Sharing
from rtd_scale.model.disentangled import RELATIVE_TABLE_ATTENTION_ARG, RELATIVE_TABLE_BLOCK_ARG
from tests.helpers.tiny_model import sample_ids, tiny_config, tiny_rtd_model

ROTARY_ARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")


def test_each_type_is_a_row_of_four_answers():
    assert set(ATTENTION_TRAITS) == set(AttentionType)
    assert ATTENTION_TRAITS[AttentionType.BERT] == AttentionTraits(
        absolute_positions=True, relative_table=False, disentangled=False, rotary=False)
    assert ATTENTION_TRAITS[AttentionType.DISENTANGLED] == AttentionTraits(
        absolute_positions=False, relative_table=True, disentangled=True, rotary=False)
    assert ATTENTION_TRAITS[AttentionType.ROTARY] == AttentionTraits(
        absolute_positions=False, relative_table=False, disentangled=False, rotary=True)
    for a in AttentionType:
        assert (a.absolute_positions, a.relative_table, a.disentangled, a.rotary) == \
            tuple(vars(ATTENTION_TRAITS[a]).values())


@pytest.mark.parametrize("attention,layout", [("bert", "pre"), ("bert", "post"),
                                              ("disentangled", "post"), ("rotary", "pre")])
def test_the_model_follows_the_traits_and_the_rotary_arguments_carry_only_angles(
        single_process_group, attention, layout):
    """Per encoder: a position table and (post layout) a token-type row exactly with absolute
    positions, a relative table exactly with ``relative_table``; the block gets that table in
    ``context`` and every layer's self-attention in ``attention_bias`` (the same tensor, [2k, H]).
    ``rotary_pos_emb`` carries the rotary type's angles — both kinds [2, s, 1, 1, d] into the
    block, the layer's kind [s, 1, 1, d] into its self-attention — and nothing for the others;
    the other rotary arguments never carry anything."""
    traits = AttentionType(attention)
    model = tiny_rtd_model(tiny_config(Sharing.NES, layout=layout, attention=attention))
    seen = {"block": [], "attention": []}

    def record(where):
        def hook(module, args, kwargs):
            seen[where].append(kwargs)
        return hook

    handles = []
    for enc in (model.generator, model.discriminator):
        assert (enc.embeddings.position is not None) == traits.absolute_positions
        assert (enc.embeddings.token_type is not None) == (traits.absolute_positions
                                                          and layout == "post")
        assert (enc.rel_embeddings is not None) == traits.relative_table
        handles.append(enc.block.register_forward_pre_hook(record("block"), with_kwargs=True))
        handles += [layer.self_attention.register_forward_pre_hook(record("attention"),
                                                                   with_kwargs=True)
                    for layer in enc.block.layers]
    model(sample_ids(), torch.arange(4), step=0)
    for h in handles:
        h.remove()
    assert len(seen["block"]) == 2 and len(seen["attention"]) == 3  # 1 + 2 layers
    for kwargs in seen["block"] + seen["attention"]:
        assert all(kwargs.get(name) is None for name in ROTARY_ARGS[1:]), kwargs.keys()
    angles = [kw.get("rotary_pos_emb") for kw in seen["block"] + seen["attention"]]
    if traits.rotary:
        heads = [(32 // 2), (48 // 4)]  # generator, discriminator head dims
        assert [tuple(a.shape) for a in angles[:2]] == [(2, 32, 1, 1, d) for d in heads]
        assert [tuple(a.shape) for a in angles[2:]] == [(32, 1, 1, d) for d in heads[:1] + heads[1:] * 2]
        # layer 1 global (angles at rotary_base), the discriminator's layer 2 local
        gen_block, disc_block, gen_1, disc_1, disc_2 = angles
        assert torch.equal(gen_1, gen_block[0]) and torch.equal(disc_1, disc_block[0])
        assert torch.equal(disc_2, disc_block[1]) and not torch.equal(disc_2, disc_1)
    else:
        assert angles == [None] * 5
    tables = [kw.get(RELATIVE_TABLE_BLOCK_ARG) for kw in seen["block"]]
    handed = [kw.get(RELATIVE_TABLE_ATTENTION_ARG) for kw in seen["attention"]]
    if traits.relative_table:
        k2 = 2 * model.cfg.relative_span()
        assert [t.shape[0] for t in tables] == [k2, k2]
        assert handed[0] is tables[0] and handed[1] is handed[2] is tables[1]
    else:
        assert tables == [None, None] and handed == [None] * 3
