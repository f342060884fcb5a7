"""The Hugging Face reference rows: the RTD step as a ``transformers`` user writes it (models,
masking and loss: ``bench/common.py``), and HF's ``ElectraEncoder`` alone."""
from __future__ import annotations

from typing import Literal, Optional

import torch

from bench import common
from bench.gpu.timing import Stepper, phased, stack_stepper
from bench.gpu.workloads import Settings


def hf_rtd_step(cfg, arch: Literal["electra", "deberta-v2", "modernbert"], s: Settings,
                compile_backend: Optional[str]) -> tuple[Stepper, str]:
    """The RTD step as a transformers user writes it: ``common.hf_electra`` (generator
    ``ElectraForMaskedLM``, discriminator ``ElectraForPreTraining``) or ``common.hf_deberta``
    (DebertaV2), their embeddings tied as the workload's sharing mode ties rtd_scale's (ES: the
    generator's modules; GDES: ``E_G.detach() + E_Δ``; ``common.share_hf_embeddings``),
    ``common.hf_modernbert`` (ModernBERT), ``common.hf_rtd_forward``'s masking with ``torch.bernoulli`` and ``torch.multinomial`` from
    the softmax at masked positions, L = L_MLM + 50 · L_RTD, bf16 autocast, fused AdamW.
    ``compile_backend``: both models under ``torch.compile``."""
    builders = {"electra": common.hf_electra, "deberta-v2": common.hf_deberta,
                "modernbert": common.hf_modernbert}
    if arch not in builders:
        raise ValueError(f"arch {arch!r}: choose one of {', '.join(builders)}")
    build = builders[arch]
    pair = build(cfg, s.device, compile_backend=compile_backend)
    opt = torch.optim.AdamW(pair.modules.parameters(), lr=2e-4, weight_decay=0.01, fused=True)
    pair.modules.train()
    dev = s.device
    forward = common.hf_rtd_forward(cfg, dev, pair.gen, pair.rtd_loss,
                                    lambda: torch.autocast(dev.type, dtype=torch.bfloat16),
                                    sample="multinomial")

    def backward(loss):
        if dev.type == "cpu":  # CPU autocast is not restored in backward (rtd_rows' autocast row)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss.backward()
        else:
            loss.backward()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    note = f"backend={compile_backend}" if compile_backend else ""
    return Stepper(phased(forward, backward, update), keep=[pair.modules, opt]), note


def stack_hf_step(shape: dict, s: Settings) -> tuple[Stepper, str]:
    """HF's ``ElectraEncoder`` (SDPA attention, eager where the version lacks it) alone,
    forward + backward of a fixed input."""
    import transformers as T
    from transformers.models.electra.modeling_electra import ElectraEncoder

    L, h, heads, f = (shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                         "ffn_hidden_size"))
    seq, b, dev = shape["seq_length"], shape["micro_batch"], s.device
    g = torch.Generator(device=dev).manual_seed(0)
    c = T.ElectraConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                        intermediate_size=f, max_position_embeddings=max(512, seq))
    c._attn_implementation = "sdpa"
    with torch.device(dev):
        try:
            module = ElectraEncoder(c)
        except (KeyError, ValueError):
            c._attn_implementation = "eager"
            module = ElectraEncoder(c)
    x = torch.randn(b, seq, h, device=dev, dtype=torch.bfloat16, generator=g)
    return stack_stepper(module, lambda inp: module(inp)[0], x), f"attn={c._attn_implementation}"
