"""Disentangled attention (post-LN) → DeBERTaV3 (``DebertaV2Model`` / ``DebertaV2ForMaskedLM``,
transformers ``models/deberta_v2/``).

The config is DeBERTaV3's (arXiv 2111.09543; the released ``microsoft/deberta-v3-*`` configs):
``relative_attention``, ``position_buckets`` / ``max_relative_positions`` as ours,
``pos_att_type`` [p2c, c2p], ``norm_rel_ebd`` layer_norm, ``share_att_key``,
``position_biased_input`` false, ``type_vocab_size`` 0, ``embedding_size`` E. Names:
``linear_qkv`` split per head into ``attention.self.{query,key,value}_proj``; the encoder's
relative table and its LayerNorm → ``encoder.rel_embeddings`` / ``encoder.LayerNorm``;
``embeddings.projection`` (E ≠ H, no bias, before the LayerNorm as in DebertaV2Embeddings) →
``embeddings.embed_proj``; the rest under BERT's sub-module names. No absolute positions, no
token type. MLM head → the ``legacy`` head ``cls.predictions.{transform.dense,
transform.LayerNorm, bias}`` with the decoder tied to the table (dense H→E, GELU, LayerNorm(E)
as ours, so E ≠ H works); import also reads DeBERTa's own ``lm_predictions.lm_head.*``
(``legacy=False``, E = H). The RTD head goes to ``rtd_head.safetensors`` (DebertaV2 has no RTD
class, and the released checkpoints' ``mask_predictions`` head has another shape: dense,
LayerNorm, classifier); ``DebertaV2ForTokenClassification`` reads the discriminator with only
its fresh ``classifier``. One difference from transformers is kept (``model/disentangled.py``):
outputs at [PAD] positions, which no loss reads — transformers zeroes the embedding there (as
we do) but lets a pad query attend to every key; our pad rows attend to the real keys. Every
real token's output is equal (tests/unit/test_hf_deberta.py).
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ModelConfig
from rtd_scale.hf.common import (POST_LN_NORMS, Adapter, Pair, base_config_kwargs, layer_pairs,
                                 mlm_head_names, wb)


def relative_positions(model: ModelConfig) -> tuple[int, int]:
    """(position_buckets, max_relative_positions) of a disentangled model, as DebertaV2Config
    holds them (arXiv 2111.09543 §4: 256 buckets; the span is the maximum position)."""
    return model.position_buckets, model.resolved_max_relative_positions()


class DebertaV2(Adapter):
    name = "DeBERTaV3"
    model_type = "deberta-v2"
    attention_words = "disentangled"
    discriminator_class = "DebertaV2Model"
    generator_class = "DebertaV2ForMaskedLM"
    discriminator_base = ""
    generator_base = "deberta."
    qkv_parts = ("query_proj", "key_proj", "value_proj")
    mlm_head_maps = (
        # DebertaV2ForMaskedLM's legacy head: transform, tied decoder (the export's)
        mlm_head_names("cls.predictions.transform", "LayerNorm", "cls.predictions.bias"),
        # legacy=False (DeBERTa's own head names), E = H
        mlm_head_names("lm_predictions.lm_head", "LayerNorm", "lm_predictions.lm_head.bias"))
    tied_to_table = ("cls.predictions.decoder.weight",)
    tied_to_bias = ("cls.predictions.decoder.bias",)
    # heads a DebertaV2Model read from a DebertaV2For… checkpoint leaves aside (the pooler of
    # sequence classification, the MLM heads, DeBERTa's own RTD head, a task classifier)
    ignored_heads = ("pooler.", "cls.", "lm_predictions.", "mask_predictions.", "classifier.")
    slow_tokenizer_file = "spm.model"  # DebertaV2Tokenizer.vocab_files_names["vocab_file"]

    def hf_config(self, model, which, *, pad_id, cls_id, sep_id):
        from transformers import DebertaV2Config

        buckets, span = relative_positions(model)
        common = base_config_kwargs(model, getattr(model, which), pad_id=pad_id,
                                    architecture=self.class_of(which))
        common.update(type_vocab_size=0, bos_token_id=cls_id, eos_token_id=sep_id)
        # DeBERTaV3's released configuration (arXiv 2111.09543; microsoft/deberta-v3-*):
        # relative attention in log buckets, c2p and p2c, the relative table LayerNorm'd and
        # projected by each layer's own query / key (share_att_key), no absolute positions in
        # the input; legacy=True is the MLM head with the embedding-width transform (ours).
        return DebertaV2Config(
            max_position_embeddings=model.max_position_embeddings, relative_attention=True,
            position_buckets=buckets, max_relative_positions=span,
            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
            position_biased_input=False, embedding_size=model.embedding_size, legacy=True,
            **common)

    def encoder_pairs(self, num_layers, projected):
        pairs = wb("embeddings.norm", "embeddings.LayerNorm")
        if projected:  # DebertaV2Embeddings.embed_proj: E → H before the LayerNorm, no bias
            pairs.append(Pair("embeddings.projection.weight", "embeddings.embed_proj.weight"))
        pairs.append(Pair("rel_embeddings.weight", "encoder.rel_embeddings.weight"))
        pairs += wb("rel_embeddings_norm", "encoder.LayerNorm")
        return pairs + layer_pairs(num_layers, POST_LN_NORMS)

    def check_source(self, src, model, where):
        """Refuse a DebertaV2 config whose attention is not DeBERTaV3's (the one rtd_scale's
        disentangled attention computes).

        Raises:
            UserInputError: one line naming the config field, its value and the fix.
        """
        c = src.config
        fixed = [("relative_attention", True), ("position_biased_input", False),
                 ("share_att_key", True)]
        for key, want in fixed:
            if bool(getattr(c, key, None)) != want:
                raise UserInputError(
                    f"{where} {key} is {getattr(c, key, None)} there; rtd_scale's disentangled "
                    f"attention is DeBERTaV3's ({key}={want}): pass a DeBERTaV3 checkpoint")
        att = getattr(c, "pos_att_type", None) or []
        att = [a.strip() for a in att.lower().split("|")] if isinstance(att, str) else list(att)
        if sorted(att) != ["c2p", "p2c"]:
            raise UserInputError(f"{where} pos_att_type is {att} there; rtd_scale's disentangled "
                                 "attention computes both c2p and p2c: pass a DeBERTaV3 "
                                 "checkpoint")
        norm = [x.strip() for x in str(getattr(c, "norm_rel_ebd", "none")).lower().split("|")]
        if "layer_norm" not in norm:
            raise UserInputError(f"{where} norm_rel_ebd is {getattr(c, 'norm_rel_ebd', None)!r} "
                                 "there; rtd_scale LayerNorms the relative table ('layer_norm'): "
                                 "pass a DeBERTaV3 checkpoint")
        if getattr(c, "conv_kernel_size", 0) or getattr(c, "type_vocab_size", 0):
            key = "conv_kernel_size" if getattr(c, "conv_kernel_size", 0) else "type_vocab_size"
            raise UserInputError(f"{where} {key} is {getattr(c, key)} there; rtd_scale's "
                                 f"encoders have no "
                                 f"{'convolution layer' if key[0] == 'c' else 'token types'}"
                                 " (DeBERTaV3 has neither): pass a DeBERTaV3 checkpoint")
        head = getattr(c, "attention_head_size", None)
        if head is not None and head * c.num_attention_heads != c.hidden_size:
            raise UserInputError(f"{where} attention_head_size {head} × {c.num_attention_heads} "
                                 f"heads != hidden_size {c.hidden_size}; rtd_scale's heads "
                                 "split the hidden size")
        buckets, span = relative_positions(model)
        theirs_span = getattr(c, "max_relative_positions", -1)
        if theirs_span is None or theirs_span < 1:
            theirs_span = c.max_position_embeddings
        for key, theirs, ours in (("position_buckets", getattr(c, "position_buckets", -1),
                                   buckets), ("max_relative_positions", theirs_span, span)):
            if theirs != ours:
                raise UserInputError(f"{where} {key} is {theirs} there but {ours} in this model; "
                                     f"pass --set model.{key}={theirs}")


ADAPTER = DebertaV2()
