"""Pre-LN encoders with BERT attention → RoBERTa-PreLayerNorm (``RobertaPreLayerNormModel`` /
``RobertaPreLayerNormForMaskedLM``, transformers ``models/roberta_prelayernorm/``).

The one Hugging Face encoder with an embedding LayerNorm, a LayerNorm on each residual branch's
input and a final LayerNorm — our pre layout exactly. It has no embedding projection, so E must
equal H. Its position ids start at ``pad_id + 1`` (RoBERTa's
``create_position_ids_from_input_ids``: a non-pad token at index i gets ``pad_id + 1 + i`` when
padding only trails, as in our packed samples), so our position row i is written to row
``pad_id + 1 + i`` and rows 0…pad_id are zero; ``max_position_embeddings`` grows by
``pad_id + 1``. At pad positions RoBERTa reads row ``pad_id`` where we read row i: hidden states
differ there (only there — keys at pads are masked) unless ``position_ids = pad_id + 1 +
arange(s)`` are passed, with which every position agrees. Its one token-type row is written as
zeros (we have none); an import folds a non-zero row into every position. The RTD head goes to
``rtd_head.safetensors``; the MLM head is RoBERTa's ``lm_head`` (dense, GELU, ``layer_norm``,
decoder tied, ``bias``).
"""
from __future__ import annotations

from rtd_scale.hf.common import (Adapter, ExportError, Pair, base_config_kwargs, layer_pairs,
                                 mlm_head_names, wb)

PRE_LN_NORMS = [("input_layernorm", "attention.LayerNorm"),
                ("pre_mlp_layernorm", "intermediate.LayerNorm")]
# our position row i at row pad_id + 1 + i
POSITIONS = Pair("embeddings.position.weight", "embeddings.position_embeddings.weight",
                 after_pad=True)
TOKEN_TYPE = "embeddings.token_type_embeddings.weight"  # one row, zeros out, folded in


class RobertaPreLayerNorm(Adapter):
    name = "RoBERTa-PreLayerNorm"
    model_type = "roberta-prelayernorm"
    attention_words = "BERT-style"
    discriminator_class = "RobertaPreLayerNormModel"
    generator_class = "RobertaPreLayerNormForMaskedLM"
    discriminator_base = ""
    generator_base = "roberta_prelayernorm."
    model_kwargs = {"add_pooling_layer": False}
    mlm_head_maps = (mlm_head_names("lm_head", "layer_norm", "lm_head.bias"),)
    tied_to_table = ("lm_head.decoder.weight",)
    tied_to_bias = ("lm_head.decoder.bias",)
    checks_embedding_size = False  # no embedding_size: E = H
    # RobertaPreLayerNormModel's pooler, which the export drops, and the MLM head of a
    # RobertaPreLayerNormForMaskedLM directory read as the discriminator (a note says so)
    ignored_heads = ("pooler.", "lm_head.")

    def check_exportable(self, model):
        for name in ("discriminator", "generator"):
            h = getattr(model, name).hidden_size
            if h != model.embedding_size:
                raise ExportError(
                    f"cannot export: the pre-LayerNorm layout's Hugging Face class "
                    f"(RobertaPreLayerNorm) has no embedding projection, but model.embedding_size "
                    f"{model.embedding_size} != model.{name}.hidden_size {h}; train with "
                    f"--layernorm-position post (whose targets have one) or an embedding size "
                    f"equal to both hidden sizes")

    def hf_config(self, model, which, *, pad_id, cls_id, sep_id):
        from transformers import RobertaPreLayerNormConfig

        return RobertaPreLayerNormConfig(
            max_position_embeddings=model.max_position_embeddings + pad_id + 1,
            bos_token_id=cls_id, eos_token_id=sep_id,
            **base_config_kwargs(model, getattr(model, which), pad_id=pad_id,
                                 architecture=self.class_of(which)))

    def encoder_pairs(self, num_layers, projected):
        # no embedding projection: check_exportable refuses E ≠ H
        return (wb("embeddings.norm", "embeddings.LayerNorm") + [POSITIONS]
                + layer_pairs(num_layers, PRE_LN_NORMS) + wb("block.final_layernorm", "LayerNorm"))

    def extra_to_hf(self, hf):
        position = hf[POSITIONS.theirs]  # [P + pad_id + 1, E]
        hf[TOKEN_TYPE] = position.new_zeros(1, position.shape[1])

    def extra_from_hf(self, theirs, ours, which, notes):
        token_type = theirs[TOKEN_TYPE]
        if bool(token_type[0].ne(0).any()):  # fold the type-0 row into every position
            ours[POSITIONS.ours] = ours[POSITIONS.ours] + token_type[0]
            notes.append(f"the {which}'s token-type row 0 is folded into its position table")


ADAPTER = RobertaPreLayerNorm()
