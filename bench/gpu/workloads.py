"""The run's settings, the workloads (rtd_scale's presets at the reference micro-batches) and the
titles of the table's rows."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from bench.common import SEED
from rtd_scale.flops import RTDDims, dims_of

# the reference rows measure every workload at 15% (the electra-large preset has 25%)
MASK_PROB = 0.15


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How long and how hard to measure (GPU defaults; ``--tiny`` shrinks everything)."""

    device: torch.device
    tiny: bool
    deadline_s: float  # the whole run, from start-up
    warmup_steps: int
    min_steps: int
    max_steps: int
    row_budget_s: float  # timed steps of one row (after warm-up)
    profile_steps: int
    compile_backend: str
    zero_stage: int
    matmul_size: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def to_json(self) -> str:
        """These settings as one JSON object (``from_json`` reads it back): what a row's child
        process is handed."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({**fields, "device": str(self.device)})

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        fields = json.loads(text)
        return cls(**{**fields, "device": torch.device(fields["device"])})


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One row group of the comparison table. Dimensions come from rtd_scale's preset."""

    key: str
    preset: str
    micro_batch: int
    target_tokens_per_s: Optional[float]
    # ElectraFor{MaskedLM,PreTraining} / DebertaV2 / ModernBert
    hf_arch: Literal["electra", "deberta-v2", "modernbert"]
    anchors: dict  # implementation key -> tokens/s measured on one H200 (the reference rows)


WORKLOADS = {
    "electra-large": Workload(key="electra-large", preset="electra-large", micro_batch=32,
                              target_tokens_per_s=175e3, hf_arch="electra",
                              anchors={"hf-eager": 96.4e3, "hf-compile": 124.9e3}),
    "electra-base": Workload(key="electra-base", preset="electra-base", micro_batch=64,
                             target_tokens_per_s=450e3, hf_arch="electra",
                             anchors={"hf-eager": 230e3}),
    "debertav3-large": Workload(key="debertav3-large", preset="debertav3-large", micro_batch=16,
                                target_tokens_per_s=110e3, hf_arch="deberta-v2",
                                anchors={"hf-eager": 24.5e3}),
    # ModernBERT-base's discriminator at its 1,024 tokens (no measured target or anchor yet)
    "modernbert-base": Workload(key="modernbert-base", preset="modernbert-base", micro_batch=16,
                                target_tokens_per_s=None, hf_arch="modernbert", anchors={}),
}
# what a run without --workloads measures (the reference rows of bench/README.md)
DEFAULT_WORKLOADS = ("electra-large", "electra-base", "debertav3-large")
# The attention cores a rtd_scale row can run on, per attention layout (``--cores``):
# disentangled attention's ``model/disentangled.py`` IMPLEMENTATIONS ("sdpa": a float bias to
# PyTorch's SDPA; "flex": FlexAttention; "flash": flashdeberta's Triton kernels); BERT
# attention's SDPA core on megatron-core's local linears ("sdpa") or Transformer Engine's ("te",
# where transformer-engine imports); the modern block's explicit band mask + SDPA ("sdpa",
# RTD_SCALE_FLEX_ATTENTION=0) or FlexAttention's block mask ("flex").
CORES = {"disentangled": ("sdpa", "flex", "flash"), "bert": ("sdpa", "te"),
         "rotary": ("sdpa", "flex")}
# The stack-only row: 24 × 1024, 16 heads, FFN 4096, seq 512, batch 16, bf16 weights, fwd + bwd.
STACK = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
             seq_length=512, micro_batch=16)
STACK_ANCHORS = {"stack-hf": 191.5e3, "stack-mcore": 143.6e3}
STACK_TARGET = 191.5e3  # at least HF's plain encoder

SHORT = {"hf-eager": "HF eager", "hf-compile": "HF compile", "hf-electra-arch": "HF ELECTRA",
         "rtd-engine": "rtd_scale DS", "rtd-engine-z0": "rtd_scale DS Z0",
         "rtd-compile": "rtd_scale DS compiled",
         "rtd-autocast": "rtd_scale autocast", "stack-hf": "HF encoder",
         "stack-mcore": "rtd_scale spec", "stack-mcore-mask": "spec + mask"}
IMPL_TITLES = {
    "hf-eager": "HF eager",
    "hf-compile": "HF + torch.compile",
    "hf-electra-arch": "HF ELECTRA arch (abs. pos.)",
    "rtd-engine": "rtd_scale (DeepSpeed bf16{zs})",
    "rtd-engine-z0": "rtd_scale (DeepSpeed bf16, ZeRO-0)",
    "rtd-compile": "rtd_scale (DeepSpeed bf16{zs}, compiled layers)",
    "rtd-autocast": "rtd_scale (autocast, no DS)",
    "stack-hf": "HF ElectraEncoder (SDPA)",
    "stack-mcore": "rtd_scale spec, no mask",
    "stack-mcore-mask": "rtd_scale spec, pad mask",
}


def rtd_config(wl: Workload, tiny: bool):
    """rtd_scale's config for a workload: the preset at the reference micro-batch and 15% masking,
    bf16; ``tiny`` keeps its shape (ELECTRA: narrower generator; DeBERTaV3: half depth) at
    CPU size (seq 64)."""
    from rtd_scale import config as C
    from rtd_scale.presets import preset

    cfg = preset(wl.preset)
    cfg.rtd.mask_prob = MASK_PROB
    cfg.train.precision = C.Precision.BF16
    cfg.train.seed = SEED
    cfg.train.micro_batch_size = cfg.train.global_batch_size = wl.micro_batch
    if tiny:
        m = cfg.model
        narrow = m.generator.hidden_size < m.discriminator.hidden_size
        deep_ratio = m.discriminator.num_layers // m.generator.num_layers
        m.discriminator = dataclasses.replace(m.discriminator, num_layers=2, hidden_size=64,
                                              num_attention_heads=2, ffn_hidden_size=256)
        gh = 32 if narrow else 64
        m.generator = dataclasses.replace(m.generator, num_layers=max(1, 2 // deep_ratio),
                                          hidden_size=gh, num_attention_heads=2,
                                          ffn_hidden_size=4 * gh)
        m.embedding_size = 64
        m.vocab_size = 3000 if wl.hf_arch == "deberta-v2" else 1000
        m.max_position_embeddings = 64
        if m.window_size > 0:  # the modern block: local layers narrower than the sequence
            m.window_size = 16
        cfg.data.seq_length = 64
        cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
    cfg.validate()
    return cfg


def rtd_dims(cfg) -> RTDDims:
    """The FLOP-count shapes of ``cfg`` (``rtd_scale.flops.dims_of``: with the relative rows of
    disentangled attention for the debertav3 workloads)."""
    return dims_of(cfg)


def stack_shape(tiny: bool) -> dict:
    if tiny:
        return dict(num_layers=2, hidden_size=64, num_attention_heads=2, ffn_hidden_size=256,
                    seq_length=64, micro_batch=4)
    return dict(STACK)
