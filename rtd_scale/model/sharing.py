"""The three embedding-sharing modes (arXiv 2111.09543 §3.2–3.3, Tables 1–2): what each means,
as one rule per mode (``SHARING_RULES``), the GDES modules, and the generator / discriminator
embedding layers built from the rule (``embedding_pair``).

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
the generator's parameter detached and adds its own Δ (``GDESTable``, ``GDESPositions``) — no
hooks, no parameter surgery (STYLE rule 4). The tables and layers themselves are
``model/embeddings.py``'s.

The modes differ only here: ``SHARING_RULES`` gives each mode one ``SharingRule``, a ``Tie``
(``Own`` / ``Same`` / ``Residual``) for its token table and for each embedding component it
shares. The builder below, the Hugging Face export and import (``rtd_scale/hf/convert.py``:
``export_state`` materialises the discriminator's effective tensors, ``import_state`` splits an
imported pair back, E_Δ = E_D − E_G exactly), Table 1's diagnostic
(``training/diagnostics.py``: ``Tie.diagnostic_rows``), the initialisation (``mark_zero_init``
on each Δ, read by ``model/weights.py``) and the checkpoint checks
(``SharingRule.layer_components``) all read the rule. A new mode is a ``config.Sharing`` member
and a rule here (tests/unit/test_sharing_rules.py adds one in a test).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from rtd_scale.config import (LayerNormPosition, ModelConfig, Sharing,
                              SharingScope)
from rtd_scale.model.embeddings import EncoderEmbeddings, TokenTable, vocab_parallel_lookup
from rtd_scale.model.weights import mark_vocab_parallel, mark_zero_init


def _zeros_of(weight: torch.nn.Parameter) -> torch.Tensor:
    """Zeros of ``weight``'s shape on this rank, also once DeepSpeed's ``zero.Init`` has
    partitioned it (its shape is then ``ds_shape``; the new parameter is partitioned in turn)."""
    return torch.zeros(getattr(weight, "ds_shape", weight.shape), dtype=weight.dtype,
                       device=weight.device)


def zero_residual(table: TokenTable) -> torch.nn.Parameter:
    """A residual table beside ``table``: zeros of its shape [V/tp, E], vocab-parallel with its
    partition, and kept at zero by every initialisation (``mark_zero_init``). GDES's E_Δ; a
    sharing mode that adds a learned residual to the generator's table makes it here."""
    residual = torch.nn.Parameter(_zeros_of(table.weight))
    tensor_parallel.set_tensor_model_parallel_attributes(residual, True, 0, 1)
    mark_vocab_parallel(residual)
    mark_zero_init(residual)
    return residual


class GDESTable(torch.nn.Module):
    """E_D = stopgrad(E_G) + E_Δ (arXiv 2111.09543 §3.3), vocab-parallel with E_G's partition.

    ``delta`` is zero at initialisation (``zero_residual``). forward(ids [b, s]) -> [b, s, E].
    """

    def __init__(self, generator_table: TokenTable):
        super().__init__()
        self.generator_table = generator_table
        self.delta = zero_residual(generator_table)

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
    at initialisation (``mark_zero_init``, read by ``model/weights.py``), so both models start
    with the same positions. forward(positions [s] int64) -> [s, E].
    """

    def __init__(self, generator_position: torch.nn.Embedding):
        super().__init__()
        self.generator_position = generator_position
        self.delta = torch.nn.Parameter(_zeros_of(generator_position.weight))
        mark_zero_init(self.delta)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return (F.embedding(positions, self.generator_position.weight.detach())
                + F.embedding(positions, self.delta))

    def foreign_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters read in forward but owned by another module (for ZeRO-3)."""
        return [self.generator_position.weight]


# ------------------------------------------------------------------------------------------
# What each sharing mode means: one rule per mode, read by the builder (below), the Hugging Face
# export and import (``rtd_scale/hf/``), Table 1's diagnostic (``training/diagnostics.py``) and
# the initialisation (``model/weights.py``).
# ------------------------------------------------------------------------------------------

# The tensors of each component of an embedding layer, as the canonical state names them
# (``<encoder>.embeddings.<component>.<leaf>``, ``model/weights.py``).
COMPONENT_LEAVES = {"table": ("weight",), "position": ("weight",), "token_type": ("weight",),
                    "norm": ("weight", "bias")}


class SharingConflict(ValueError):
    """An imported generator / discriminator pair that a sharing mode cannot hold (the message
    names the tensors and the flags that fix it; the caller prefixes the source)."""


class Tie:
    """How one component of the discriminator's embedding layer (its token table, position
    table, token-type row or LayerNorm) relates to the generator's.

    ``build`` makes the discriminator's module; ``export`` / ``split`` turn a canonical state's
    discriminator tensors into the effective ones its forward reads (the tensors a Hugging Face
    export holds) and back; ``diagnostic_rows`` are those effective rows for Table 1's cosine.
    Canonical names: ``gen + leaf``, ``disc + leaf`` (e.g. ``"generator.embeddings.table."`` +
    ``"weight"``)."""

    def build(self, component: str, generator_module: Optional[torch.nn.Module]
              ) -> Optional[torch.nn.Module]:
        """The discriminator's module for ``component``, or None: it builds its own."""
        return None

    def export(self, state: dict[str, torch.Tensor], gen: str, disc: str,
               leaves: tuple[str, ...]) -> None:
        """In place: the discriminator's effective tensors under ``disc + leaf``."""

    def split(self, state: dict[str, torch.Tensor], gen: str, disc: str,
              leaves: tuple[str, ...], with_generator: bool, component: str) -> None:
        """In place, the inverse of ``export``: ``state`` holds the discriminator's effective
        tensors (and the generator's when ``with_generator``); without a generator, the
        generator's tensors this mode derives the discriminator's from start as the
        discriminator's (so a Δ starts at 0).

        Raises:
            SharingConflict: the pair cannot be held by this mode.
        """

    def diagnostic_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The discriminator's own parameters ``diagnostic_rows`` reads (ZeRO-3 gathers them)."""
        return []

    def diagnostic_rows(self, generator_rows: torch.Tensor, module: torch.nn.Module, lo: int,
                        hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the discriminator's effective token table [hi − lo, E] float64, from
        the generator's rows [lo, hi) (float64) and the discriminator's table ``module``."""
        raise NotImplementedError


class Own(Tie):
    """The discriminator's own module (NES; every component a mode does not share)."""

    def diagnostic_parameters(self, module):
        return [module.weight]

    def diagnostic_rows(self, generator_rows, module, lo, hi):
        return module.weight[lo:hi].double()


class Same(Tie):
    """The generator's very module (ES): one ``Parameter`` object, saved once under the
    generator's name (``model/weights.py``), trained by both losses."""

    def build(self, component, generator_module):
        return generator_module

    def export(self, state, gen, disc, leaves):
        for leaf in leaves:
            if gen + leaf in state:
                state[disc + leaf] = state[gen + leaf]

    def split(self, state, gen, disc, leaves, with_generator, component):
        for leaf in leaves:
            if disc + leaf not in state:
                continue
            mine = state.pop(disc + leaf)
            if with_generator and not torch.equal(state[gen + leaf], mine):
                if component == "table":
                    raise SharingConflict(
                        "the discriminator's and the generator's token tables differ, which one "
                        "shared table (--sharing es) cannot hold; pass --sharing nes or "
                        "--sharing gdes")
                raise SharingConflict(
                    f"the discriminator's and the generator's embeddings.{component}.{leaf} "
                    "differ, which one shared embedding layer (--sharing es) cannot hold; pass "
                    "--sharing-scope tokens (only the token table shared), --sharing nes or "
                    "--sharing gdes")
            state[gen + leaf] = mine

    def diagnostic_rows(self, generator_rows, module, lo, hi):
        return generator_rows


def exact_residual(target: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Δ with ``base + Δ == target`` bitwise in fp32, so that HF → rtd_scale → HF gives back
    the discriminator's table exactly.

    ``target − base`` rounded to fp32 can miss by one unit in the last place after the add; such
    entries are stepped one ulp at a time (``torch.nextafter``) toward the target. An exact Δ
    exists whenever the table was some fp32 E_G + E_Δ (every GDES export); for unrelated foreign
    tables an entry may stay one ulp of E_G away.
    """
    target = target.float()
    base = base.float()
    delta = target - base
    for _ in range(64):
        miss = (base + delta) != target
        if not bool(miss.any()):
            break
        toward = torch.where((base + delta) < target, torch.full_like(delta, float("inf")),
                             torch.full_like(delta, float("-inf")))
        delta = torch.where(miss, torch.nextafter(delta, toward), delta)
    return delta


class Residual(Tie):
    """stopgrad(generator's) + Δ, Δ zero-initialised (GDES, arXiv 2111.09543 §3.3): the
    discriminator holds only ``delta`` (``GDESTable`` / ``GDESPositions``). Export: the
    effective weight, summed in fp32 as the lookup sums the rows; import: Δ = E_D − E_G exactly
    (``exact_residual``)."""

    def build(self, component, generator_module):
        if component == "table":
            return GDESTable(generator_module)
        assert component == "position", component  # weight-only components
        return GDESPositions(generator_module)

    def export(self, state, gen, disc, leaves):
        state[disc + "weight"] = state[gen + "weight"] + state.pop(disc + "delta")

    def split(self, state, gen, disc, leaves, with_generator, component):
        mine = state.pop(disc + "weight")
        if not with_generator:
            state[gen + "weight"] = mine
        state[disc + "delta"] = exact_residual(mine, state[gen + "weight"])

    def diagnostic_parameters(self, module):
        return [module.delta]

    def diagnostic_rows(self, generator_rows, module, lo, hi):
        return generator_rows + module.delta[lo:hi].double()


OWN, SAME, RESIDUAL = Own(), Same(), Residual()


@dataclass(frozen=True)
class SharingRule:
    """Everything one sharing mode means: how the discriminator's token table relates to the
    generator's (``table``), and which other components of the embedding layer it shares and
    how (``layer``; only with ``sharing_scope`` "embeddings" and absolute positions — a
    component not named is the discriminator's own)."""

    table: Tie
    layer: dict[str, Tie] = field(default_factory=dict)

    def ties(self, scope: SharingScope, relative: bool) -> dict[str, Tie]:
        """component → tie, the token table first; only the components that are not own."""
        ties = {} if self.table is OWN else {"table": self.table}
        if scope is SharingScope.EMBEDDINGS and not relative:
            ties.update(self.layer)
        return ties

    def layer_components(self, scope: SharingScope, relative: bool) -> tuple[str, ...]:
        """The components past the token table this mode shares (none: the scope changes
        nothing)."""
        return tuple(c for c in self.ties(scope, relative) if c != "table")

    def export_state(self, state: dict[str, torch.Tensor], scope: SharingScope,
                     relative: bool) -> dict[str, torch.Tensor]:
        """A canonical state with the discriminator's embedding tensors as its forward reads
        them, under its own names (ES: the generator's; GDES: E_G + E_Δ in place of
        ``table.delta``, and P_G + P_Δ), the mode's own parameters (Δ) gone."""
        out = dict(state)
        for component, tie in self.ties(scope, relative).items():
            tie.export(out, f"generator.embeddings.{component}.",
                       f"discriminator.embeddings.{component}.", COMPONENT_LEAVES[component])
        return out

    def import_state(self, state: dict[str, torch.Tensor], scope: SharingScope, relative: bool,
                     with_generator: bool) -> dict[str, torch.Tensor]:
        """Inverse of ``export_state``: the effective discriminator tensors folded into what
        this mode holds (ES: one copy; GDES: Δ = E_D − E_G). Without a generator its shared
        tensors start as the discriminator's.

        Raises:
            SharingConflict: a pair this mode cannot hold (ES: two different tables).
        """
        out = dict(state)
        for component, tie in self.ties(scope, relative).items():
            tie.split(out, f"generator.embeddings.{component}.",
                      f"discriminator.embeddings.{component}.", COMPONENT_LEAVES[component],
                      with_generator, component)
        return out


# A new mode: a member of ``config.Sharing`` and its rule here (with a new ``Tie`` if its
# relation is none of these).
SHARING_RULES: dict[Sharing, SharingRule] = {
    # ELECTRA: the whole ``electra/embeddings`` scope (module docstring)
    Sharing.ES: SharingRule(SAME, {"position": SAME, "token_type": SAME, "norm": SAME}),
    Sharing.NES: SharingRule(OWN),
    # DeBERTa: word and position embeddings, nothing else
    Sharing.GDES: SharingRule(RESIDUAL, {"position": RESIDUAL}),
}


def sharing_rule(sharing: Sharing) -> SharingRule:
    """The rule of a sharing mode (``SHARING_RULES``)."""
    rule = SHARING_RULES.get(sharing)
    assert rule is not None, f"no SHARING_RULES entry for {sharing!r} (model/sharing.py)"
    return rule


def discriminator_table(sharing: Sharing, generator_table: TokenTable, padded_vocab_size: int,
                        embedding_size: int, config: TransformerConfig) -> torch.nn.Module:
    """The discriminator's token table for a sharing mode (either scope)."""
    table = sharing_rule(sharing).table.build("table", generator_table)
    return table if table is not None else TokenTable(padded_vocab_size, embedding_size, config)


def discriminator_shared(sharing: Sharing, scope: SharingScope,
                         generator: EncoderEmbeddings) -> dict[str, torch.nn.Module]:
    """The discriminator's embedding modules, other than the token table, that come from the
    generator's embedding layer (``EncoderEmbeddings``'s ``shared``; the module docstring gives
    the rule and its source for each mode): ES → the generator's ``position``, ``token_type`` and
    ``norm`` modules themselves; GDES → a ``GDESPositions`` over the generator's ``position``;
    scope "tokens", NES, or disentangled attention (no position table; DeBERTa shares no
    LayerNorm) → none."""
    ties = sharing_rule(sharing).ties(scope, generator.relative)
    shared = {}
    for component, tie in ties.items():
        if component == "table" or getattr(generator, component) is None:
            continue  # the token table is discriminator_table's; no token type in the pre layout
        shared[component] = tie.build(component, getattr(generator, component))
    return {k: v for k, v in shared.items() if v is not None}


def _embedding_kwargs(model: ModelConfig) -> dict:
    """What both encoders' embedding layers are built with, from the model's layout."""
    post = model.layernorm_position is LayerNormPosition.POST
    relative = not model.attention_type.absolute_positions  # DeBERTa's layer
    rotary = model.attention_type.rotary  # ModernBERT's layer, no positions
    return dict(embedding_size=model.embedding_size,
                max_positions=model.max_position_embeddings, init_std=model.init_method_std,
                token_type=post and not relative, relative=relative, rotary=rotary,
                **(dict(normalization=model.normalization, norm_bias=model.norm_bias)
                   if rotary else {}))


def generator_embeddings(model: ModelConfig, generator_config: TransformerConfig,
                         padded_vocab_size: int) -> EncoderEmbeddings:
    """The generator's embedding layer alone (its own table): the one encoder of
    ``rtd.objective=mlm``, which shares with nothing (first pipeline stage only)."""
    table = TokenTable(padded_vocab_size, model.embedding_size, generator_config)
    return EncoderEmbeddings(table, model.generator, **_embedding_kwargs(model))


def embedding_pair(model: ModelConfig, generator_config: TransformerConfig,
                   discriminator_config: TransformerConfig,
                   padded_vocab_size: int) -> tuple[EncoderEmbeddings, EncoderEmbeddings]:
    """(generator, discriminator) embedding layers, shared as ``model.sharing`` and
    ``model.sharing_scope`` say (first pipeline stage only)."""
    sharing, scope = model.sharing, model.sharing_scope
    common = _embedding_kwargs(model)
    gen = generator_embeddings(model, generator_config, padded_vocab_size)
    gen_table = gen.table
    disc_table = discriminator_table(sharing, gen_table, padded_vocab_size,
                                     model.embedding_size, discriminator_config)
    shared = discriminator_shared(sharing, scope, gen)
    assert "norm" not in shared or (model.generator.layernorm_epsilon
                                    == model.discriminator.layernorm_epsilon), \
        "one shared embedding LayerNorm needs one epsilon (ModelConfig.validate refuses this)"
    disc = EncoderEmbeddings(disc_table, model.discriminator, shared=shared, **common)
    return gen, disc
