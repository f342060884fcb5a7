"""Post-LN encoders with BERT attention → ELECTRA (``ElectraForPreTraining`` /
``ElectraForMaskedLM``, transformers ``models/electra/modeling_electra.py``).

Embedding LayerNorm, ``embeddings_project`` when E ≠ H, LayerNorm after each residual add;
positions 0…s−1 as ours; our one token-type row is ELECTRA's row 0 (an import drops rows 1…,
which rtd_scale's encoders never read). The RTD head is the class's own
``discriminator_predictions``; the MLM head is ``generator_predictions`` (dense H→E, GELU,
LayerNorm) + ``generator_lm_head`` tied to the table, with bias.
"""
from __future__ import annotations

from rtd_scale.hf.common import (POST_LN_NORMS, Adapter, Pair, base_config_kwargs, layer_pairs,
                                 mlm_head_names, wb)

# positions 0…s−1 as ours; our one token-type row is ELECTRA's row 0
POSITIONS = [Pair("embeddings.position.weight", "embeddings.position_embeddings.weight"),
             Pair("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight",
                  rows=1, dropped=("token-type", "rtd_scale's encoders have one token type"))]


class Electra(Adapter):
    name = "ELECTRA"
    model_type = "electra"
    attention_words = "BERT-style"
    discriminator_class = "ElectraForPreTraining"
    generator_class = "ElectraForMaskedLM"
    discriminator_base = generator_base = "electra."
    rtd_head_in_model = True
    mlm_head_maps = (mlm_head_names("generator_predictions", "LayerNorm",
                                    "generator_lm_head.bias"),)
    tied_to_table = ("generator_lm_head.weight",)
    # an ElectraForMaskedLM directory read as the discriminator: its MLM head is left aside
    # (a note says so, ``pretrained.read_pretrained``)
    ignored_heads = ("generator_predictions.", "generator_lm_head.")

    def hf_config(self, model, which, *, pad_id, cls_id, sep_id):
        from transformers import ElectraConfig

        return ElectraConfig(embedding_size=model.embedding_size,
                             max_position_embeddings=model.max_position_embeddings,
                             **base_config_kwargs(model, getattr(model, which), pad_id=pad_id,
                                                  architecture=self.class_of(which)))

    def encoder_pairs(self, num_layers, projected):
        pairs = wb("embeddings.norm", "embeddings.LayerNorm") + POSITIONS
        if projected:
            pairs += wb("embeddings.projection", "embeddings_project")
        return pairs + layer_pairs(num_layers, POST_LN_NORMS)


ADAPTER = Electra()
