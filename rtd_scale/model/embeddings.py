"""Token tables and embedding layers: the vocab-parallel token table every encoder reads, its tied
copy on the last pipeline stage, and the embedding layer (token rows, positions, token type,
LayerNorm, projection). Which of these the discriminator shares with the generator, and how, is
``model/sharing.py``: an ``EncoderEmbeddings`` holds the modules it is given (``shared``) and
builds the rest; nothing here knows a sharing mode.

Every token lookup is one masked local gather of this rank's rows (under GDES, of the rows of
E_G and E_Δ, summed — the tables themselves are never added) and one all-reduce over the
tensor-parallel group (megatron-core's ``reduce_from_tensor_model_parallel_region``). Position
tables, token-type rows and LayerNorms are replicated on every tensor-parallel rank (their
gradients are equal there: the first layer's column-parallel linear all-reduces its input
gradient). Both embedding layers live on the first pipeline stage, so no sharing crosses stages.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from rtd_scale.config import EncoderConfig
from rtd_scale.model.modern import make_norm
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


class EncoderEmbeddings(torch.nn.Module):
    """Token rows + learned absolute positions (+ under the post-LayerNorm layout one token-type
    row), LayerNorm and dropout at the table's width E, then (ELECTRA style, E != H) a linear
    projection to the encoder's hidden size H, with no dropout after it: the order of Hugging
    Face's ``ElectraEmbeddings`` (word + token type, then + position) then
    ``ElectraModel.embeddings_project``.

    Parameters (names relative to this module): ``table`` (the token table, a ``TokenTable`` or
    the module a sharing mode gives, ``model/sharing.py``), ``position.weight`` [max_positions, E], ``token_type.weight`` [1, E] (post
    layout only: BERT's segment embedding with its single type id 0, ELECTRA's
    ``type_vocab_size`` 2 being unused in pretraining), ``norm.{weight, bias}`` [E],
    ``projection.{weight [H, E], bias [H]}`` (E != H only).

    forward(ids [b, s], pad_mask [b, s] bool (True at [PAD]) or None, position_ids [b, s] or None
    (0 … s − 1; document-masked packing restarts them per document, ``model/document_mask.py``))
    -> [s, b, H] (megatron layout; the one transpose of this model). ``pad_mask`` is read only
    with ``relative``, ``position_ids`` only without.

    ``shared`` gives modules to hold instead of building them — keys ``position`` (an
    ``nn.Embedding`` or a sharing mode's module), ``token_type``, ``norm`` — the discriminator's
    share of the generator's layer (``model/sharing.py``'s ``discriminator_shared``).

    With ``relative=True`` (disentangled attention, DeBERTa) the embeddings are Hugging Face's
    ``DebertaV2Embeddings`` with ``position_biased_input`` false and ``type_vocab_size`` 0: token
    rows → (E != H: ``projection`` [H, E] without bias) → LayerNorm at H → rows at [PAD] set to 0
    → dropout; no ``position`` or ``token_type`` table (positions enter every layer's attention).
    With ``rotary=True`` too (the modern block, ``model/modern.py``) the same order is Hugging
    Face's ``ModernBertEmbeddings`` (token rows → norm → dropout): the norm is
    ``normalization`` ("LayerNorm", with ``norm_bias`` or without, or "RMSNorm") and rows at
    [PAD] are kept (no key reads them).
    """

    def __init__(self, table: torch.nn.Module, encoder: EncoderConfig, embedding_size: int,
                 max_positions: int, init_std: float, token_type: bool = False,
                 relative: bool = False, shared: Optional[dict[str, torch.nn.Module]] = None,
                 rotary: bool = False, normalization: str = "LayerNorm", norm_bias: bool = True):
        super().__init__()
        assert relative or not rotary, "rotary attention has no position table"
        assert not (relative and token_type), "DeBERTaV3's embeddings have no token type"
        shared = dict(shared or {})
        assert set(shared) <= {"position", "token_type", "norm"}, sorted(shared)
        assert not (relative and "position" in shared), "disentangled: no position table"
        assert token_type or "token_type" not in shared
        self.table = table
        self.relative, self.rotary = relative, rotary
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
            self.norm = make_norm(normalization, norm_size, encoder.layernorm_epsilon, norm_bias)
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

    def forward(self, ids: torch.Tensor, pad_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.relative:
            x = self.table(ids)  # [b, s, E]
            if self.projection is not None:
                x = self.projection(x)  # [b, s, H]
            x = self.norm(x)
            if pad_mask is not None and not self.rotary:
                x = x * (~pad_mask).unsqueeze(-1).to(x.dtype)
            return self.dropout(x).transpose(0, 1).contiguous()  # [s, b, H]
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.table(ids)  # [b, s, E]
        if self.token_type is not None:
            # called as a module (not .weight read directly) so ZeRO-3 gathers its row
            x = x + self.token_type(pos[:1])  # type id 0 everywhere, added before the positions
        x = x + (self.position(pos).unsqueeze(0) if position_ids is None
                 else self.position(position_ids))
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
