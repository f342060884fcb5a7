"""Token tables, embedding layers and the three embedding-sharing modes (arXiv 2111.09543
§3.2–3.3, Tables 1–2).

What the discriminator shares with the generator (``model.sharing``, ``model.sharing_scope``):

- ES, scope "embeddings" (default): the whole embedding layer — the token table, the position
  table, the token-type row (post layout) and the embedding LayerNorm are the generator's very
  modules, so L_MLM and L_RTD both train them; each model keeps its own ``projection`` (E != H)
  and dropout. Pinned by ELECTRA (google-research/electra ``model/modeling.py``,
  ``BertModel.__init__``: ``embedding_lookup`` and ``embedding_postprocessor`` — word, token
  type, position embeddings and LayerNorm — run under the one variable scope
  ``electra/embeddings`` unless ``untied_embeddings``; ``embeddings_project`` under each model's
  own scope).
- GDES, scope "embeddings" (default): the token table is ``E_G.detach() + E_Δ`` and the position
  table ``P_G.detach() + P_Δ``; each Δ is zero-initialised and trained only by L_RTD, each base
  only by L_MLM. The token-type row and the LayerNorm stay the discriminator's own. Pinned by
  DeBERTa (microsoft/DeBERTa ``DeBERTa/apps/tasks/rtd_task.py``, ``RTDModel``: a zero
  ``_weight`` residual for ``word_embeddings`` and ``position_embeddings`` only, added to the
  generator's detached weights before every discriminator forward; its 'es' mode likewise
  ties those two tables only — rtd_scale's ES follows ELECTRA, whose mode it is).
- scope "tokens": ES / GDES share the token table only; position, token type and LayerNorm are
  per model (selectable with ``--sharing-scope tokens``).
- NES: the discriminator has its own table and embedding layer (either scope).
- Disentangled attention (DeBERTa's ``DebertaV2Embeddings`` with ``position_biased_input`` false
  and no token types) has no position or token-type table: nothing past the token table is
  shared there under either scope (DeBERTa's hook shares no LayerNorm).

A shared tensor is one ``Parameter`` object held by both embedding layers (ES; saved once, under
the generator's name, ``model/weights.py``); a GDES table is a module whose ``forward`` reads
the generator's parameter detached and adds its own Δ — no hooks, no parameter surgery (STYLE
rule 4). Both embedding layers live on the first pipeline stage, so no sharing crosses stages.

Every token lookup is one masked local gather of this rank's rows (under GDES, of the rows of
E_G and E_Δ, summed — the tables themselves are never added) and one all-reduce over the
tensor-parallel group (megatron-core's ``reduce_from_tensor_model_parallel_region``). Position
tables, token-type rows and LayerNorms are replicated on every tensor-parallel rank (their
gradients are equal there: the first layer's column-parallel linear all-reduces its input
gradient). The modes differ only here.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from rtd_scale.config import (AttentionType, EncoderConfig, LayerNormPosition, ModelConfig,
                              Sharing, SharingScope)
from rtd_scale.model.weights import mark_vocab_parallel


def vocab_parallel_lookup(
    weights: torch.Tensor | tuple[torch.Tensor, ...], ids: torch.Tensor, vocab_start: int, tp_group
) -> torch.Tensor:
    """Rows of a vocab-parallel table, or of the sum of tables that share one partition.

    Args:
        weights: [V_local, E] this rank's rows (global ids [vocab_start, vocab_start + V_local)),
            or a tuple of such tables whose looked-up rows are summed (GDES: E_G.detach(), E_Δ)
            — only the b·s rows are added, never the whole tables.
        ids: [b, s] int64 global ids.
        vocab_start: global id of the tables' first row.
        tp_group: tensor-parallel group the vocabulary is split over.
    Returns:
        [b, s, E], identical on every rank of ``tp_group`` (one all-reduce).
    """
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    v_local = weights[0].shape[0]
    outside = None
    if tp_group.size() > 1:
        outside = (ids < vocab_start) | (ids >= vocab_start + v_local)
        ids = (ids - vocab_start).masked_fill(outside, 0)
    rows = F.embedding(ids, weights[0])
    for w in weights[1:]:
        rows = rows + F.embedding(ids, w)
    if outside is not None:
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_model_parallel_region(rows, group=tp_group)


class TokenTable(VocabParallelEmbedding):
    """A vocab-parallel token table (megatron-core ``VocabParallelEmbedding``).

    Initialised from the full [V_padded, E] draw on every rank and sliced, so the weights are the
    same at any tensor-parallel size. forward(ids [b, s]) -> [b, s, E].
    """

    def __init__(self, padded_vocab_size: int, embedding_size: int, config: TransformerConfig):
        super().__init__(padded_vocab_size, embedding_size, init_method=config.init_method,
                         config=config)
        mark_vocab_parallel(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(self.weight, ids, self.vocab_start_index, self.tp_group)


class TiedOutputTable(TokenTable):
    """The last pipeline stage's copy of the generator's token table, used as the MLM output
    weight (Megatron-LM's tied ``output_layer`` across first and last stage).

    Same shape, partition and initial values as the first stage's table (its canonical name is
    the table's, ``rtd_scale.model.weights``); the two stay equal because the embedding group
    all-reduces their gradients before every optimizer step. Marked ``ds_pipe_replicated`` so
    DeepSpeed counts it once, not twice, in the global gradient norm.
    """

    TIED_NAME = "generator.embeddings.table.weight"

    def __init__(self, padded_vocab_size: int, embedding_size: int, config: TransformerConfig):
        super().__init__(padded_vocab_size, embedding_size, config)
        self.weight.rtd_tied_name = self.TIED_NAME
        self.weight.ds_pipe_replicated = True


class GDESTable(torch.nn.Module):
    """E_D = stopgrad(E_G) + E_Δ (arXiv 2111.09543 §3.3), vocab-parallel with E_G's partition.

    ``delta`` is zero at initialisation. forward(ids [b, s]) -> [b, s, E].
    """

    def __init__(self, generator_table: TokenTable):
        super().__init__()
        self.generator_table = generator_table
        self.delta = torch.nn.Parameter(torch.zeros_like(generator_table.weight))
        tensor_parallel.set_tensor_model_parallel_attributes(self.delta, True, 0, 1)
        mark_vocab_parallel(self.delta)

    @property
    def vocab_start_index(self) -> int:
        return self.generator_table.vocab_start_index

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.generator_table
        return vocab_parallel_lookup((table.weight.detach(), self.delta), ids,
                                     table.vocab_start_index, table.tp_group)

    def foreign_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters read in forward but owned by another module (for ZeRO-3)."""
        return [self.generator_table.weight]


class GDESPositions(torch.nn.Module):
    """P_D = stopgrad(P_G) + P_Δ: GDES on the absolute position table (microsoft/DeBERTa
    ``rtd_task.py`` treats ``position_embeddings`` as it treats ``word_embeddings``).

    Replicated on every tensor-parallel rank, as the generator's table. ``delta`` [P, E] is zero
    at initialisation (``model/weights.py``), so both models start with the same positions.
    forward(positions [s] int64) -> [s, E].
    """

    def __init__(self, generator_position: torch.nn.Embedding):
        super().__init__()
        self.generator_position = generator_position
        self.delta = torch.nn.Parameter(torch.zeros_like(generator_position.weight))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return (F.embedding(positions, self.generator_position.weight.detach())
                + F.embedding(positions, self.delta))

    def foreign_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters read in forward but owned by another module (for ZeRO-3)."""
        return [self.generator_position.weight]


def discriminator_table(sharing: Sharing, generator_table: TokenTable, padded_vocab_size: int,
                        embedding_size: int, config: TransformerConfig) -> torch.nn.Module:
    """The discriminator's token table for a sharing mode (either scope)."""
    if sharing is Sharing.ES:
        return generator_table
    if sharing is Sharing.NES:
        return TokenTable(padded_vocab_size, embedding_size, config)
    if sharing is Sharing.GDES:
        return GDESTable(generator_table)
    raise AssertionError(f"unhandled sharing mode {sharing}")


def discriminator_shared(sharing: Sharing, scope: SharingScope,
                         generator: "EncoderEmbeddings") -> dict[str, torch.nn.Module]:
    """The discriminator's embedding modules, other than the token table, that come from the
    generator's embedding layer (``EncoderEmbeddings``'s ``shared``; the module docstring gives
    the rule and its source for each mode): ES → the generator's ``position``, ``token_type`` and
    ``norm`` modules themselves; GDES → a ``GDESPositions`` over the generator's ``position``;
    scope "tokens", NES, or disentangled attention (no position table; DeBERTa shares no
    LayerNorm) → none."""
    if scope is SharingScope.TOKENS or sharing is Sharing.NES or generator.relative:
        return {}
    if sharing is Sharing.ES:  # ELECTRA: the whole ``electra/embeddings`` scope
        shared = {"position": generator.position, "norm": generator.norm}
        if generator.token_type is not None:
            shared["token_type"] = generator.token_type
        return shared
    if sharing is Sharing.GDES:  # DeBERTa: word and position embeddings, nothing else
        return {"position": GDESPositions(generator.position)}
    raise AssertionError(f"unhandled sharing mode {sharing}")


def embedding_pair(model: ModelConfig, generator_config: TransformerConfig,
                   discriminator_config: TransformerConfig,
                   padded_vocab_size: int) -> tuple["EncoderEmbeddings", "EncoderEmbeddings"]:
    """(generator, discriminator) embedding layers, shared as ``model.sharing`` and
    ``model.sharing_scope`` say (first pipeline stage only)."""
    sharing, scope = Sharing(model.sharing), SharingScope(model.sharing_scope)
    post = LayerNormPosition(model.layernorm_position) is LayerNormPosition.POST
    relative = AttentionType(model.attention_type) is AttentionType.DISENTANGLED
    common = dict(embedding_size=model.embedding_size,
                  max_positions=model.max_position_embeddings, init_std=model.init_method_std,
                  token_type=post and not relative, relative=relative)
    gen_table = TokenTable(padded_vocab_size, model.embedding_size, generator_config)
    gen = EncoderEmbeddings(gen_table, model.generator, **common)
    disc_table = discriminator_table(sharing, gen_table, padded_vocab_size,
                                     model.embedding_size, discriminator_config)
    shared = discriminator_shared(sharing, scope, gen)
    assert "norm" not in shared or (model.generator.layernorm_epsilon
                                    == model.discriminator.layernorm_epsilon), \
        "one shared embedding LayerNorm needs one epsilon (ModelConfig.validate refuses this)"
    disc = EncoderEmbeddings(disc_table, model.discriminator, shared=shared, **common)
    return gen, disc


class EncoderEmbeddings(torch.nn.Module):
    """Token rows + learned absolute positions (+ under the post-LayerNorm layout one token-type
    row), LayerNorm and dropout at the table's width E, then (ELECTRA style, E != H) a linear
    projection to the encoder's hidden size H, with no dropout after it: the order of Hugging
    Face's ``ElectraEmbeddings`` (word + token type, then + position) then
    ``ElectraModel.embeddings_project``.

    Parameters (names relative to this module): ``table`` (the token table, ``TokenTable`` /
    ``GDESTable``), ``position.weight`` [max_positions, E], ``token_type.weight`` [1, E] (post
    layout only: BERT's segment embedding with its single type id 0, ELECTRA's
    ``type_vocab_size`` 2 being unused in pretraining), ``norm.{weight, bias}`` [E],
    ``projection.{weight [H, E], bias [H]}`` (E != H only).

    forward(ids [b, s], pad_mask [b, s] bool (True at [PAD]) or None) -> [s, b, H] (megatron
    layout; the one transpose of this model). ``pad_mask`` is read only with ``relative``.

    ``shared`` gives modules to hold instead of building them — keys ``position`` (an
    ``nn.Embedding`` or a ``GDESPositions``), ``token_type``, ``norm`` — the discriminator's
    share of the generator's layer (``discriminator_shared``).

    With ``relative=True`` (disentangled attention, DeBERTa) the embeddings are Hugging Face's
    ``DebertaV2Embeddings`` with ``position_biased_input`` false and ``type_vocab_size`` 0: token
    rows → (E != H: ``projection`` [H, E] without bias) → LayerNorm at H → rows at [PAD] set to 0
    → dropout; no ``position`` or ``token_type`` table (positions enter every layer's attention).
    """

    def __init__(self, table: torch.nn.Module, encoder: EncoderConfig, embedding_size: int,
                 max_positions: int, init_std: float, token_type: bool = False,
                 relative: bool = False, shared: Optional[dict[str, torch.nn.Module]] = None):
        super().__init__()
        assert not (relative and token_type), "DeBERTaV3's embeddings have no token type"
        shared = dict(shared or {})
        assert set(shared) <= {"position", "token_type", "norm"}, sorted(shared)
        assert not (relative and "position" in shared), "disentangled: no position table"
        assert token_type or "token_type" not in shared
        self.table = table
        self.relative = relative
        self.position: Optional[torch.nn.Module] = shared.get("position")
        if not relative and self.position is None:
            self.position = torch.nn.Embedding(max_positions, embedding_size)
            torch.nn.init.normal_(self.position.weight, std=init_std)
        self.token_type: Optional[torch.nn.Embedding] = shared.get("token_type")
        if token_type and self.token_type is None:
            self.token_type = torch.nn.Embedding(1, embedding_size)
            torch.nn.init.normal_(self.token_type.weight, std=init_std)
        norm_size = encoder.hidden_size if relative else embedding_size
        self.norm = shared.get("norm")
        if self.norm is None:
            self.norm = torch.nn.LayerNorm(norm_size, eps=encoder.layernorm_epsilon)
        self.dropout = torch.nn.Dropout(encoder.hidden_dropout)
        self.projection: Optional[torch.nn.Linear] = None
        if embedding_size != encoder.hidden_size:
            self.projection = torch.nn.Linear(embedding_size, encoder.hidden_size,
                                              bias=not relative)
            torch.nn.init.normal_(self.projection.weight, std=init_std)
            if self.projection.bias is not None:
                torch.nn.init.zeros_(self.projection.bias)

    def foreign_parameters(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        """(module, parameter) pairs where a module of this layer reads, in its forward, a
        parameter another module owns (GDES: the generator's token and position tables).
        DeepSpeed ZeRO-3 must gather them for that module (``register_external_parameter``)."""
        pairs = []
        for module in (self.table, self.position):
            if hasattr(module, "foreign_parameters"):
                pairs += [(module, p) for p in module.foreign_parameters()]
        return pairs

    def forward(self, ids: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.relative:
            x = self.table(ids)  # [b, s, E]
            if self.projection is not None:
                x = self.projection(x)  # [b, s, H]
            x = self.norm(x)
            if pad_mask is not None:
                x = x * (~pad_mask).unsqueeze(-1).to(x.dtype)
            return self.dropout(x).transpose(0, 1).contiguous()  # [s, b, H]
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.table(ids)  # [b, s, E]
        if self.token_type is not None:
            # called as a module (not .weight read directly) so ZeRO-3 gathers its row
            x = x + self.token_type(pos[:1])  # type id 0 everywhere, added before the positions
        x = x + self.position(pos).unsqueeze(0)
        x = self.dropout(self.norm(x))
        if self.projection is not None:
            x = self.projection(x)  # [b, s, H]
        return x.transpose(0, 1).contiguous()  # [s, b, H]


def init_normal(std: float):
    """megatron-style initialiser: N(0, std²)."""
    def init_(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, mean=0.0, std=std)
    return init_


def scaled_init_normal(std: float, num_layers: int):
    """megatron's output-layer initialiser: N(0, (std / sqrt(2 · num_layers))²)."""
    return init_normal(std / math.sqrt(2.0 * num_layers))
