"""What the bench scripts share: rtd_scale's special ids, world-1 parallel state, the host
batches, rtd_scale's model (``model/build.py``'s ``build_model``) and its training step without
DeepSpeed, the Hugging Face reference models (ELECTRA and DebertaV2 pairs at rtd_scale's
dimensions, their embeddings tied by rtd_scale's sharing rule) and the reference RTD step's
masking / sampling / loss, and the interleaved step timer (the launcher benches' tokenized test
corpus: bench/tiny_data.py; the launcher benches' logged commands: bench/runs.py; neither needs
torch).

A bench script is run as ``python bench/X.py`` from the repository root; it puts the root on
``sys.path`` and imports this module as ``bench.common`` (as the tests import bench scripts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch

REPO = Path(__file__).resolve().parents[1]  # the checkout


# rtd_scale's fixed special ids (rtd_scale/data/tokenizer.py); the HF steps use the same ids.
PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID)
RTD_LAMBDA = 50.0  # L_MLM + 50 · L_RTD (arXiv 2003.10555 §3)
SEED = 1234  # = TrainConfig.seed's default: build_model's initial weights


@dataclasses.dataclass(frozen=True)
class FixedIds:
    """What ``rtd_scale.model.build.build_model`` reads of a tokenizer, for the benches' random
    ids: the fixed layout tools/train_tokenizer.py writes (rtd_scale/data/tokenizer.py). The
    bench configs mask by token, so no word-start table is asked for."""

    special_ids: tuple = SPECIAL_IDS
    pad_id: int = PAD_ID
    mask_id: int = MASK_ID

    def word_start_table(self):
        raise ValueError("the bench's random ids have no words: keep rtd.mask_strategy 'token'")


FIXED_IDS = FixedIds()


# ----------------------------------------------------------------------------------------------
# Process set-up
# ----------------------------------------------------------------------------------------------

_CTX = None


def world_one():
    """torch.distributed (world 1) and megatron-core's parallel state through
    ``rtd_scale.distributed``, once per process (a free port unless MASTER_PORT is set)."""
    global _CTX
    if _CTX is not None:
        return _CTX
    from rtd_scale import distributed
    from rtd_scale.config import ParallelConfig
    from rtd_scale.launch_env import free_port

    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    _CTX = distributed.initialize(ParallelConfig(), seed=SEED)
    return _CTX


def teardown_world() -> None:
    """Undo ``world_one`` (nothing when it never ran)."""
    global _CTX
    if _CTX is not None:
        from rtd_scale import distributed

        distributed.teardown()
        _CTX = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# Configuration, batches and steps
# ----------------------------------------------------------------------------------------------

def run_config(dims: str, *, micro_batch: int, seq_length: int, tiny: bool):
    """rtd_scale's config for a preset at this micro-batch and sequence length.

    ``tiny`` keeps the preset's shape (ELECTRA: narrow generator and projected embedding;
    DeBERTaV3: same width, half depth) at test size: hidden 32, 2 layers, vocab 1000.
    """
    from rtd_scale import config as C
    from rtd_scale.presets import preset

    cfg = preset(dims)
    m = cfg.model
    # BERT / ELECTRA attention at every preset's dimensions, as the HF recipe's ELECTRA classes
    # (DeBERTa's disentangled attention against Hugging Face's: bench/deberta_step_vs_hf.py)
    m.attention_type = C.AttentionType.BERT
    if tiny:
        narrow = m.generator.hidden_size < m.discriminator.hidden_size
        m.discriminator = dataclasses.replace(m.discriminator, num_layers=2, hidden_size=32,
                                              num_attention_heads=2, ffn_hidden_size=128)
        gh = 16 if narrow else 32
        m.generator = dataclasses.replace(m.generator, num_layers=1 if not narrow else 2,
                                          hidden_size=gh, num_attention_heads=1 if narrow else 2,
                                          ffn_hidden_size=4 * gh)
        m.embedding_size = 24 if narrow else 32
        m.vocab_size = 1000
    m.max_position_embeddings = max(m.max_position_embeddings, seq_length)
    cfg.data.seq_length = seq_length
    cfg.train.micro_batch_size = cfg.train.global_batch_size = micro_batch
    cfg.train.seed = SEED
    cfg.validate()
    return cfg


def token_batches(vocab_size: int, b: int, seq: int, count: int = 4) -> list[torch.Tensor]:
    """``count`` id batches [b, s] on the host: ``[CLS]`` random ids ``[SEP]``, full length
    (packed pretraining sequences have no padding). Every step copies its batch to the device
    with ``.to(device)`` as ``training/loop.py`` does (and as a user's loop over a DataLoader)."""
    g = torch.Generator(device="cpu").manual_seed(SEED)
    out = []
    for _ in range(count):
        ids = torch.randint(len(SPECIAL_IDS), vocab_size, (b, seq), generator=g)
        ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
        out.append(ids)
    return out


def host_batches(cfg, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [b, s], sample_index [b]) pairs on the host, as the packed dataset yields, at
    ``cfg``'s micro-batch, sequence length and vocabulary (``token_batches``)."""
    b = cfg.train.micro_batch_size
    ids = token_batches(cfg.model.vocab_size, b, cfg.data.seq_length, count)
    return [(x, torch.arange(k * b, (k + 1) * b)) for k, x in enumerate(ids)]


def parallel_context(device: torch.device):
    """``world_one()``'s context with ``device`` as the training device (``--device cpu`` on a
    machine with a GPU)."""
    return dataclasses.replace(world_one(), device=torch.device(device))


def build_rtd_model(cfg, device: torch.device):
    """rtd_scale's ``RTDModel`` of ``cfg`` on ``device`` (world 1) by ``model/build.py``'s
    ``build_model``, as ``pretrain.py`` builds it (initial weights from ``cfg.train.seed``), and
    dropout's model-parallel RNG seeded after the build as ``pretrain.py`` does."""
    from rtd_scale import distributed
    from rtd_scale.model.build import build_model

    ctx = parallel_context(device)
    model = build_model(cfg, ctx, FIXED_IDS)
    distributed.seed_after_build(ctx, SEED)
    return model


@dataclasses.dataclass
class Step:
    """One training step (``run(i)``: forward, backward and optimizer on batch i) and what the
    profile needs: ``model`` (rtd_scale's, or None) and ``optimizer``."""

    run: Callable[[int], Any]
    model: Optional[torch.nn.Module]
    optimizer: torch.optim.Optimizer


def cuda_bf16_autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing on CPU (fp32): the default precision of the steps here."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class BF16Master:
    """DeepSpeed's bf16 training in miniature (``deepspeed/runtime/bf16_optimizer.py``, what
    ``pretrain.py --bf16`` runs): the model holds bf16 parameters and computes without
    autocast; ``optimizer`` (built over the fp32 parameters, which become the master copies)
    steps on the bf16 gradients cast to fp32, and the result is copied back into the model."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        masters = {id(p): p.detach().clone() for g in optimizer.param_groups for p in g["params"]}
        self.pairs = [(p, masters[id(p)]) for p in model.parameters() if id(p) in masters]
        for g in optimizer.param_groups:  # no step has run: nothing is keyed by the old tensors
            g["params"] = [masters[id(p)] for p in g["params"]]
        model.to(torch.bfloat16)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:  # noqa: D102
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, master in self.pairs:
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for p, master in self.pairs:
            p.grad = master.grad = None


def ours(cfg, device: torch.device, *, bf16_params: bool = False,
         autocast: Callable[[torch.device], Any] = cuda_bf16_autocast) -> Step:
    """rtd_scale's step: ``RTDModel(ids, sample_index, step).loss.backward()``, AdamW
    (``training.optimizer.build_optimizer``), without DeepSpeed, under ``autocast(device)``.
    ``bf16_params``: as ``pretrain.py --bf16`` trains (``BF16Master``), not under autocast."""
    from rtd_scale.training.optimizer import build_optimizer

    model = build_rtd_model(cfg, device)
    model.train()
    opt = build_optimizer(model, cfg.optim)
    if bf16_params:
        opt = BF16Master(model, opt)
    precision = contextlib.nullcontext if bf16_params else lambda: autocast(device)
    batches = host_batches(cfg)

    def run(i: int) -> None:  # as training/loop.py: has_padding decided on the host
        ids, idx = batches[i % len(batches)]
        with precision():
            loss = model(ids.to(device, non_blocking=True), idx.to(device, non_blocking=True),
                         i, has_padding=bool((ids == PAD_ID).any())).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Step(run, model, opt)


@dataclasses.dataclass
class HFPair:
    """A Hugging Face reference generator + discriminator at rtd_scale's dimensions, as a
    ``transformers`` user builds them: ``gen`` (``*ForMaskedLM``), ``modules`` (every trained
    module, a GDES residual E_Δ among them, one ``ModuleDict`` for the optimizer) and
    ``rtd_loss(corrupted [b, s], attention_mask [b, s], labels [b, s] float)``."""

    gen: torch.nn.Module
    modules: torch.nn.Module
    rtd_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _compiled(module: torch.nn.Module, backend: Optional[str]):
    # as users do: compile each model whole (the loss around them may graph-break)
    return torch.compile(module, backend=backend) if backend else module


# rtd_scale's embedding components (rtd_scale/model/sharing.py, COMPONENT_LEAVES) → the
# modules of a Hugging Face ``*Embeddings`` layer (ElectraEmbeddings, DebertaV2Embeddings)
HF_EMBEDDING_MODULES = {"table": "word_embeddings", "position": "position_embeddings",
                        "token_type": "token_type_embeddings", "norm": "LayerNorm"}


class ResidualEmbedding(torch.nn.Module):
    """GDES's discriminator lookup written plainly (arXiv 2111.09543 §3.3): the rows of
    ``E_G.detach() + E_Δ``, E_Δ zero-initialised and E_G the generator's ``base`` table;
    ``forward(ids [b, s]) → [b, s, E]``."""

    def __init__(self, base: torch.nn.Embedding):
        super().__init__()
        self.base = base
        self.delta = torch.nn.Parameter(torch.zeros_like(base.weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.base.weight.detach() + self.delta,
                                             padding_idx=self.base.padding_idx)


def share_hf_embeddings(model, generator: torch.nn.Module, discriminator: torch.nn.Module) -> None:
    """Tie the discriminator's Hugging Face embedding layer to the generator's as rtd_scale ties
    its own: the sharing rule of ``model.sharing`` (``rtd_scale.model.sharing.sharing_rule``)
    at ``model.sharing_scope`` and attention, component by component (``HF_EMBEDDING_MODULES``):
    ``Same`` → the generator's module itself (ES), ``Residual`` → a ``ResidualEmbedding`` over
    it (GDES); a component the rule does not tie stays the discriminator's own (NES: all), and
    one the generator's layer lacks is left out, as ``embeddings.discriminator_shared`` does.

    Raises:
        ValueError: a tie or a component this reference has no Hugging Face form for.
    """
    from rtd_scale.config import AttentionType
    from rtd_scale.model.sharing import Residual, Same, sharing_rule

    relative = model.attention_type is AttentionType.DISENTANGLED
    ties = sharing_rule(model.sharing).ties(model.sharing_scope, relative)
    for component, tie in ties.items():
        name = HF_EMBEDDING_MODULES.get(component)
        if name is None:
            raise ValueError(f"model.sharing {model.sharing.value}: the embedding component "
                             f"{component!r} has no Hugging Face module in "
                             "bench/common.py HF_EMBEDDING_MODULES; add it there")
        theirs = getattr(generator, name, None)
        if theirs is None:
            continue
        if isinstance(tie, Same):
            setattr(discriminator, name, theirs)
        elif isinstance(tie, Residual):
            setattr(discriminator, name, ResidualEmbedding(theirs))
        else:
            raise ValueError(f"model.sharing {model.sharing.value}: the Hugging Face reference "
                             f"cannot tie {component} by {type(tie).__name__}; write it in "
                             "bench/common.py share_hf_embeddings")


def hf_electra(cfg, device: torch.device, *, compile_backend: Optional[str] = None) -> HFPair:
    """``ElectraForMaskedLM`` + ``ElectraForPreTraining`` (SDPA attention) at ``cfg``'s
    dimensions (the export's ``ElectraConfig``, ``rtd_scale/hf/convert.py``; absolute positions
    whatever ``cfg``'s attention), the embedding layers tied as ``cfg.model.sharing`` ties
    rtd_scale's (``share_hf_embeddings``: ES the generator's modules themselves, GDES
    ``E_G.detach() + E_Δ``, NES two layers). ``compile_backend``: both models under
    ``torch.compile``."""
    import transformers as T

    from rtd_scale.config import AttentionType, LayerNormPosition
    from rtd_scale.hf import convert

    electra = dataclasses.replace(cfg.model, layernorm_position=LayerNormPosition.POST,
                                  attention_type=AttentionType.BERT)
    built = []
    with torch.device(device):
        for cls, which in ((T.ElectraForMaskedLM, "generator"),
                           (T.ElectraForPreTraining, "discriminator")):
            c = convert.hf_config(electra, which, pad_id=PAD_ID)
            try:
                built.append(cls._from_config(c, attn_implementation="sdpa"))
            except (ValueError, TypeError, ImportError):  # a version without SDPA for ELECTRA
                built.append(cls._from_config(c))
    gen, disc = built
    share_hf_embeddings(electra, gen.electra.embeddings, disc.electra.embeddings)
    both = torch.nn.ModuleDict({"generator": gen, "discriminator": disc})
    gen_c, disc_c = _compiled(gen, compile_backend), _compiled(disc, compile_backend)

    def rtd_loss(corrupted, attn, labels):
        return disc_c(input_ids=corrupted, attention_mask=attn, labels=labels).loss

    return HFPair(gen_c, both, rtd_loss)


def hf_deberta(cfg, device: torch.device, *, compile_backend: Optional[str] = None) -> HFPair:
    """``DebertaV2ForMaskedLM`` + ``DebertaV2Model`` with an RTD head (dense, GELU, dense → 1)
    at ``cfg``'s dimensions (the export's ``DebertaV2Config``), the token tables tied as
    ``cfg.model.sharing`` ties rtd_scale's (``share_hf_embeddings``; GDES, the DeBERTaV3
    presets': ``E_G.detach() + E_Δ``), BCE over the non-pad positions."""
    import transformers as T
    import torch.nn.functional as F

    from rtd_scale.hf import convert

    m = cfg.model
    with torch.device(device):
        gen = T.DebertaV2ForMaskedLM(convert.hf_config(m, "generator", pad_id=PAD_ID))
        disc = T.DebertaV2Model(convert.hf_config(m, "discriminator", pad_id=PAD_ID))
        h = m.discriminator.hidden_size
        head = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, 1))
    share_hf_embeddings(m, gen.deberta.embeddings, disc.embeddings)
    both = torch.nn.ModuleDict({"generator": gen, "discriminator": disc, "head": head})
    gen_c, disc_c = _compiled(gen, compile_backend), _compiled(disc, compile_backend)

    def rtd_loss(corrupted, attn, labels):
        hidden = disc_c(input_ids=corrupted, attention_mask=attn).last_hidden_state
        logits = head(hidden).squeeze(-1).float()
        active = attn.bool()
        return F.binary_cross_entropy_with_logits(logits[active], labels[active])

    return HFPair(gen_c, both, rtd_loss)


def hf_modernbert(cfg, device: torch.device, *, compile_backend: Optional[str] = None) -> HFPair:
    """``ModernBertForMaskedLM`` + ``ModernBertModel`` (SDPA attention; its sliding window a
    mask) with an RTD head (dense, GELU, dense → 1) at ``cfg``'s dimensions (the export's
    ``ModernBertConfig``, ``rtd_scale/hf/modernbert.py``), the token tables tied as GDES ties
    rtd_scale's (``E_G.detach() + E_Δ``; ModernBERT's embedding layer names its table
    ``tok_embeddings``, so ``share_hf_embeddings`` is not used), BCE over the non-pad positions.
    ``compile_backend``: both models under ``torch.compile``."""
    import transformers as T
    import torch.nn.functional as F

    from rtd_scale.config import Sharing
    from rtd_scale.hf import convert

    m = cfg.model
    if m.sharing is not Sharing.GDES:
        raise ValueError(f"model.sharing {m.sharing.value}: the ModernBERT reference ties the "
                         "token table as GDES only (the modern presets')")
    built = []
    with torch.device(device):
        for cls, which in ((T.ModernBertForMaskedLM, "generator"), (T.ModernBertModel,
                                                                     "discriminator")):
            c = convert.hf_config(m, which, pad_id=PAD_ID)
            try:
                built.append(cls._from_config(c, attn_implementation="sdpa"))
            except (ValueError, TypeError, ImportError):
                built.append(cls._from_config(c))
        gen, disc = built
        h = m.discriminator.hidden_size
        head = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(), torch.nn.Linear(h, 1))
    disc.embeddings.tok_embeddings = ResidualEmbedding(gen.model.embeddings.tok_embeddings)
    both = torch.nn.ModuleDict({"generator": gen, "discriminator": disc, "head": head})
    gen_c, disc_c = _compiled(gen, compile_backend), _compiled(disc, compile_backend)

    def rtd_loss(corrupted, attn, labels):
        hidden = disc_c(input_ids=corrupted, attention_mask=attn).last_hidden_state
        logits = head(hidden).squeeze(-1).float()
        active = attn.bool()
        return F.binary_cross_entropy_with_logits(logits[active], labels[active])

    return HFPair(gen_c, both, rtd_loss)


def hf_rtd_forward(cfg, device: torch.device, gen: torch.nn.Module,
                   rtd_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                   autocast: Callable[[], Any],
                   sample: Literal["gumbel", "multinomial"] = "gumbel"
                   ) -> Callable[[int], torch.Tensor]:
    """The forward of the Hugging Face reference RTD step as a ``transformers`` user writes it,
    around a generator ``*ForMaskedLM`` ``gen`` and a discriminator loss ``rtd_loss`` (``HFPair``):
    masking with ``torch.bernoulli`` (``mask_prob`` of the non-special ids, ``mask_token_prob``
    of those shown as ``[MASK]``), the generator's MLM loss with ``labels=-100`` outside the
    masked slots, replacements at the masked rows from the full vocabulary — ``sample``
    "gumbel": Gumbel-max (``argmax(logits - log(-log(torch.rand)))``), "multinomial":
    ``torch.multinomial`` of the softmax — and ``L_MLM + 50 · L_RTD`` under ``autocast()``.
    ``forward(i)`` returns that loss on ``host_batches(cfg)[i % 4]``.

    Raises:
        ValueError: ``sample`` is neither."""
    if sample not in ("gumbel", "multinomial"):
        raise ValueError(f"sample {sample!r}: choose 'gumbel' or 'multinomial'")
    batches = host_batches(cfg)
    mask_prob, mask_token_prob = cfg.rtd.mask_prob, cfg.rtd.mask_token_prob

    def forward(i: int) -> torch.Tensor:
        ids = batches[i % len(batches)][0].to(device, non_blocking=True)
        attn = torch.ones_like(ids)
        prob = torch.full(ids.shape, mask_prob, device=device)
        prob.masked_fill_(ids < len(SPECIAL_IDS), 0.0)
        masked = torch.bernoulli(prob).bool()
        to_mask = masked & torch.bernoulli(torch.full(ids.shape, mask_token_prob,
                                                      device=device)).bool()
        with autocast():
            out = gen(input_ids=ids.masked_fill(to_mask, MASK_ID), attention_mask=attn,
                      labels=ids.masked_fill(~masked, -100))
            with torch.no_grad():
                logits = out.logits[masked].float()
                if sample == "multinomial":
                    sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1)
                else:
                    gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-20, 1.0)))
                    sampled = (logits + gumbel).argmax(-1)
            corrupted = ids.clone()
            corrupted[masked] = sampled
            labels = (corrupted != ids).float()
            return out.loss + RTD_LAMBDA * rtd_loss(corrupted, attn, labels)

    return forward


def hf_rtd_run(cfg, device: torch.device, gen: torch.nn.Module,
               rtd_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
               opt: torch.optim.Optimizer, autocast: Callable[[], Any]) -> Callable[[int], None]:
    """The whole Hugging Face reference RTD step: ``hf_rtd_forward`` (Gumbel-max sampling),
    backward, ``opt``'s step. ``run(i)`` trains on ``host_batches(cfg)[i % 4]``."""
    forward = hf_rtd_forward(cfg, device, gen, rtd_loss, autocast)

    def run(i: int) -> None:
        forward(i).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def interleaved_ms(steps: dict[str, Step], device: torch.device, *, warmup: int, rounds: int,
                   steps_per_round: int) -> dict[str, dict[str, list[float]]]:
    """Per-step times (ms) of each implementation, measured in alternating rounds: round r runs
    the implementations in turn (which goes first alternates), ``steps_per_round`` steps each,
    timed one by one (the device is synchronised at each step boundary).

    Returns {name: {"wall": [...], "cpu": [...]}}: wall-clock time, and this thread's CPU time
    (user + system; on CPU with one thread the step's whole work, and much less disturbed by
    other processes on a shared machine than the wall clock).
    """
    names = list(steps)
    counter = dict.fromkeys(names, 0)
    for name in names:
        for _ in range(warmup):
            steps[name].run(counter[name])
            counter[name] += 1
    sync(device)
    times = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for _ in range(steps_per_round):
                w0, c0 = time.perf_counter(), time.thread_time()
                steps[name].run(counter[name])
                sync(device)
                times[name]["wall"].append((time.perf_counter() - w0) * 1e3)
                times[name]["cpu"].append((time.thread_time() - c0) * 1e3)
                counter[name] += 1
    return times

