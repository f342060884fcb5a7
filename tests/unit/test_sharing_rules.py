"""Everything a sharing mode means comes from ``rtd_scale/model/sharing.py``'s
``SHARING_RULES``: a fourth mode, added here and nowhere in the product, builds, trains a step,
exports with parity, imports back bitwise and is read by Table 1's diagnostic.

The mode (``half``: E_D = ½·stopgrad(E_G) + E_O, E_O zero-initialised, the token table only) is
made for this test. It differs from every real mode in what the discriminator's table is, so a
product file that still switched on ES / NES / GDES (treating an unknown mode as one of them)
would export, import or measure the wrong table here; and its residual is named ``offset``, not
``delta``, so no rule keyed on a parameter's name can pass for the sharing rule. A mode must be a
member of ``config.Sharing`` to pass config validation, so the fixture adds one to the enum for
the test's duration and removes it after: what a new mode's author would write in
``config.py`` and ``sharing.py``, done in the test instead.

A static check goes with it: no product file but those two names a sharing mode.
"""
from __future__ import annotations

import re

import pytest
import torch

from rtd_scale.config import LayerNormPosition, Sharing
from rtd_scale.model import embeddings, sharing
from rtd_scale.model.sharing import SHARING_RULES, SharingRule, Tie, exact_residual
from tests.helpers.env import REPO
from tests.helpers.hf_models import (
    TOL,
    build_model,
    canonical_state,
    hf_outputs,
    max_diffs,
    ours,
    perturb,
    real_batch,
    tiny_config,
)
from tests.helpers.tiny_model import grad_abs_sums

HALF = "half"


class HalfTable(torch.nn.Module):
    """E_D = ½·stopgrad(E_G) + E_O, vocab-parallel with E_G's partition. forward(ids [b, s]) ->
    [b, s, E]."""

    def __init__(self, generator_table):
        super().__init__()
        self.generator_table = generator_table
        self.offset = sharing.zero_residual(generator_table)

    @property
    def vocab_start_index(self) -> int:
        return self.generator_table.vocab_start_index

    def forward(self, ids):
        t = self.generator_table
        return embeddings.vocab_parallel_lookup((0.5 * t.weight.detach(), self.offset), ids,
                                                t.vocab_start_index, t.tp_group)

    def foreign_parameters(self):
        return [self.generator_table.weight]


class HalfResidual(Tie):
    """The tie of ``HalfTable``: export E_D = ½·E_G + E_O; import E_O = E_D − ½·E_G exactly
    (halving is exact in fp32); without a generator E_G = 2·E_D, E_O = 0."""

    def build(self, component, generator_module):
        assert component == "table"
        return HalfTable(generator_module)

    def export(self, state, gen, disc, leaves):
        state[disc + "weight"] = 0.5 * state[gen + "weight"] + state.pop(disc + "offset")

    def split(self, state, gen, disc, leaves, with_generator, component):
        mine = state.pop(disc + "weight")
        if not with_generator:
            state[gen + "weight"] = 2.0 * mine
        state[disc + "offset"] = exact_residual(mine, 0.5 * state[gen + "weight"])

    def diagnostic_parameters(self, module):
        return [module.offset]

    def diagnostic_rows(self, generator_rows, module, lo, hi):
        return 0.5 * generator_rows + module.offset[lo:hi].double()


@pytest.fixture
def half_mode():
    """``Sharing("half")`` and its rule, for this test only (the enum and the table restored
    after)."""
    member = str.__new__(Sharing, HALF)
    member._name_, member._value_, member.__objclass__ = "HALF", HALF, Sharing
    Sharing._member_map_["HALF"] = member
    Sharing._value2member_map_[HALF] = member
    Sharing._member_names_.append("HALF")
    SHARING_RULES[member] = SharingRule(HalfResidual())
    try:
        yield member
    finally:
        del SHARING_RULES[member]
        Sharing._member_names_.remove("HALF")
        del Sharing._value2member_map_[HALF]
        del Sharing._member_map_["HALF"]


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


def test_a_fourth_mode_is_one_rule(single_process_group, tok, tmp_path, half_mode):
    from rtd_scale.hf.export import write_export
    from rtd_scale.hf.pretrained import load_pretrained
    from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, ROWWISE_COSINE,
                                                avg_pairwise_cosine, table_cosines)

    ctx = single_process_group
    cfg = tiny_config(LayerNormPosition.POST, half_mode, True, tok.vocab_size)
    assert cfg.model.sharing is half_mode
    # builds, the residual zero-initialised (weights.initialize reads the rule's mark)
    model = build_model(cfg, single_process_group, tok)
    d_table, g_table = model.discriminator_table, model.generator_table
    assert isinstance(d_table, HalfTable) and d_table.generator_table is g_table
    assert torch.count_nonzero(d_table.offset).item() == 0
    ids = real_batch(tok)
    assert torch.equal(d_table(ids), 0.5 * g_table(ids))
    state = canonical_state(model, ctx)
    assert "discriminator.embeddings.table.offset" in state
    assert "discriminator.embeddings.table.weight" not in state

    # one training step: L_RTD reaches E_O and not E_G (the stop-gradient), L_MLM the reverse
    model.train()
    sample_index = torch.arange(ids.shape[0])
    out = model(ids, sample_index)
    params = [g_table.weight, d_table.offset]
    g_mlm = grad_abs_sums(out.mlm_loss, params)
    g_rtd = grad_abs_sums(out.rtd_loss, params)
    assert g_mlm[0] > 0 and g_mlm[1] == 0.0
    assert g_rtd[0] == 0.0 and g_rtd[1] > 0
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(ids, sample_index).loss.backward()
    opt.step()
    assert torch.count_nonzero(d_table.offset).item() > 0
    perturb(model)  # every weight off its initial value
    model.eval()

    # Table 1's diagnostic reads ½·E_G + E_O
    got = table_cosines(model, ctx.tp_group, zero3=False)
    v = cfg.model.vocab_size
    g = g_table.weight.detach()[:v].double()
    d = 0.5 * g + d_table.offset.detach()[:v].double()
    assert got[AVG_COSINE_DISCRIMINATOR] == pytest.approx(avg_pairwise_cosine(d), abs=1e-10)
    rowwise = torch.nn.functional.cosine_similarity(g, d, dim=-1).mean().item()
    assert got[ROWWISE_COSINE] == pytest.approx(rowwise, abs=1e-10)

    # exports to ELECTRA with parity: the discriminator's word table is ½·E_G + E_O
    mine = ours(model, ids, tok.pad_id)
    out_dir = tmp_path / "hf"
    state = canonical_state(model, ctx)
    write_export(state, cfg.model, str(out_dir), pad_id=tok.pad_id, cls_id=tok.cls_id,
                 sep_id=tok.sep_id, note=lambda m: None)
    from safetensors.torch import load_file

    exported = load_file(out_dir / "model.safetensors")["electra.embeddings.word_embeddings.weight"]
    assert torch.equal(exported, 0.5 * state["generator.embeddings.table.weight"]
                       + state["discriminator.embeddings.table.offset"])
    diffs = max_diffs(mine, hf_outputs(out_dir, LayerNormPosition.POST, ids, tok.pad_id))
    assert max(diffs) < TOL, diffs

    # and imports back: E_O split out so that ½·E_G + E_O is the exported table bitwise (E_O
    # itself to an ulp of E_D: fp32 addition has several exact residuals), the rest as it was
    back = build_model(cfg, single_process_group, tok, seed=11)
    load_pretrained(back, str(out_dir), cfg.model, pad_id=tok.pad_id, tp_group=ctx.tp_group,
                    tp_rank=0)
    again = canonical_state(back, ctx)
    offset = "discriminator.embeddings.table.offset"
    assert again.keys() == state.keys()
    assert torch.equal(0.5 * again["generator.embeddings.table.weight"] + again[offset], exported)
    assert torch.allclose(again[offset], state[offset], rtol=0, atol=1e-6)
    assert all(torch.equal(again[k], state[k]) for k in state if k != offset)


# A sharing mode by name: a Sharing member, or a mode's value as a string literal.
_MODE = re.compile(r"\bSharing\.(ES|NES|GDES)\b|[\"'](es|nes|gdes)[\"']")
_MAY_NAME_MODES = {"rtd_scale/config.py", "rtd_scale/presets.py", "rtd_scale/model/sharing.py"}


def test_only_config_and_sharing_name_a_sharing_mode():
    """A new mode touches only ``config.py`` (the enum) and ``model/sharing.py`` (its rule):
    no other product file names one (the HF adapters, diagnostics, weights and checkpoint code
    ask ``sharing.sharing_rule``; the embedding modules, ``model/embeddings.py``, know no mode;
    ``presets.py`` names the mode each preset trains with)."""
    named = {}
    for path in sorted((REPO / "rtd_scale").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        hits = [m.group(0) for m in _MODE.finditer(path.read_text(encoding="utf-8"))]
        if hits and rel not in _MAY_NAME_MODES:
            named[rel] = hits
    assert named == {}
    # the control: the two files that hold the modes are seen naming them
    assert all(_MODE.search((REPO / rel).read_text(encoding="utf-8")) for rel in _MAY_NAME_MODES)
