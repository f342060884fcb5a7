"""bench/step_vs_hf.py's pieces (bench/common.py) in-process. The benchmark run at test size on
CPU is in tests/tools/test_bench_step.py."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_bf16_master_steps_fp32_copies_and_writes_them_back():
    """bench.common.BF16Master (what the DeBERTa bench times as pretrain.py --bf16 trains): the
    model computes in bf16; AdamW steps fp32 masters on the bf16 gradients, exactly as an fp32
    AdamW on the same gradients, and the model gets the masters rounded to bf16."""
    import copy

    import torch

    from bench.common import BF16Master

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    opt = BF16Master(lin, torch.optim.AdamW(lin.parameters(), lr=0.1))
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.bfloat16
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(2):
        lin(torch.randn(5, 4).bfloat16()).float().pow(2).sum().backward()
        for p, r in zip(lin.parameters(), ref.parameters()):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for (p, master), r in zip(opt.pairs, ref.parameters()):
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            assert torch.equal(p.detach(), r.detach().bfloat16())
        opt.zero_grad()
        assert all(p.grad is None and m.grad is None for p, m in opt.pairs)
    assert not torch.equal(ref.weight, copy.deepcopy(lin).float().weight)  # bf16 rounding shows


EMBEDDING_MODULES = ("word_embeddings", "position_embeddings", "token_type_embeddings",
                     "LayerNorm")


def _tied(pair, base: str) -> dict:
    """{HF embedding module: "same" | "residual" | "own"} of the pair's discriminator."""
    from bench.common import ResidualEmbedding

    gen = getattr(pair.modules["generator"], base).embeddings
    disc = pair.modules["discriminator"]
    disc = getattr(disc, base, disc).embeddings
    out = {}
    for name in EMBEDDING_MODULES:
        mine, theirs = getattr(disc, name, None), getattr(gen, name, None)
        if mine is None:
            continue
        if mine is theirs:
            out[name] = "same"
        elif isinstance(mine, ResidualEmbedding):
            assert mine.base is theirs and not mine.delta.any()  # E_Δ starts at zero
            out[name] = "residual"
        else:
            out[name] = "own"
    return out


@pytest.mark.parametrize("sharing, expected", [
    ("es", dict.fromkeys(EMBEDDING_MODULES, "same")),
    ("nes", dict.fromkeys(EMBEDDING_MODULES, "own")),
    ("gdes", {"word_embeddings": "residual", "position_embeddings": "residual",
              "token_type_embeddings": "own", "LayerNorm": "own"}),
])
def test_the_hf_reference_ties_its_embeddings_by_the_products_sharing_rule(sharing, expected):
    """bench.common.hf_electra ties the discriminator's embedding layer as rtd_scale's rule
    (rtd_scale/model/sharing.py SHARING_RULES, scope "embeddings") ties its own: ES the
    generator's modules themselves, NES none, GDES the token and position tables as
    E.detach() + E_Δ; L_RTD reaches E_Δ and, under ES, the one table, never E_G under GDES."""
    import torch

    from bench import common
    from rtd_scale.config import Sharing

    cfg = common.run_config("electra-small", micro_batch=2, seq_length=16, tiny=True)
    cfg.model.sharing = Sharing(sharing)
    cfg.validate()
    pair = common.hf_electra(cfg, torch.device("cpu"))
    assert _tied(pair, "electra") == expected
    ids = torch.randint(len(common.SPECIAL_IDS), cfg.model.vocab_size, (2, 16))
    pair.rtd_loss(ids, torch.ones_like(ids), (ids % 2).float()).backward()
    gen_table = pair.modules["generator"].electra.embeddings.word_embeddings.weight
    disc_table = pair.modules["discriminator"].electra.embeddings.word_embeddings
    assert (gen_table.grad is not None) == (sharing == "es")
    if sharing == "gdes":
        assert disc_table.delta.grad is not None and disc_table.delta.grad.abs().sum() > 0


@pytest.mark.parametrize("sharing, expected", [
    ("gdes", {"word_embeddings": "residual", "LayerNorm": "own"}),
    ("es", {"word_embeddings": "same", "LayerNorm": "own"}),
    ("nes", {"word_embeddings": "own", "LayerNorm": "own"}),
])
def test_the_hf_deberta_reference_follows_the_sharing_mode(sharing, expected):
    """bench.common.hf_deberta under disentangled attention: only the token table is tied (no
    position table; DeBERTa shares no LayerNorm), by the mode's rule, not GDES whatever it is."""
    pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    import torch

    from bench import common, deberta_step_vs_hf
    from rtd_scale.config import Sharing

    cfg = deberta_step_vs_hf.run_config("xsmall", batch=2, seq=16, tiny=True)
    cfg.model.sharing = Sharing(sharing)
    cfg.validate()
    assert _tied(common.hf_deberta(cfg, torch.device("cpu")), "deberta") == expected


def test_a_tie_the_hf_reference_cannot_write_is_an_error(monkeypatch):
    """A sharing rule whose tie has no Hugging Face form here raises, naming the mode and the
    component; it is not built as some other mode."""
    import torch

    from bench import common
    from rtd_scale.config import Sharing
    from rtd_scale.model import sharing

    class Halved(sharing.Tie):
        pass

    monkeypatch.setitem(sharing.SHARING_RULES, Sharing.NES, sharing.SharingRule(Halved()))
    cfg = common.run_config("electra-small", micro_batch=2, seq_length=16, tiny=True)
    cfg.model.sharing = Sharing.NES
    cfg.validate()
    with pytest.raises(ValueError, match="model.sharing nes: .* cannot tie table by Halved"):
        common.hf_electra(cfg, torch.device("cpu"))


def test_an_unknown_sampler_of_the_hf_reference_is_an_error():
    import torch

    from bench import common

    cfg = common.run_config("electra-small", micro_batch=2, seq_length=16, tiny=True)
    with pytest.raises(ValueError, match="sample 'top-k': choose 'gumbel' or 'multinomial'"):
        common.hf_rtd_forward(cfg, torch.device("cpu"), None, None, None, sample="top-k")
