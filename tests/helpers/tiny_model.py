"""One-process RTD models and batches for the unit tests of the model's gradient paths."""
from __future__ import annotations

import torch

from rtd_scale.model.rtd import RTDModel

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [CLS] [SEP] [UNK] [MASK], tools/train_tokenizer.py's ids


def tiny_rtd_model(cfg, seed: int = 5) -> RTDModel:
    """``cfg``'s RTDModel at TP 1, seeded."""
    torch.manual_seed(seed)
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                    pad_id=0, mask_id=4, seed=seed)


def sample_ids(b: int = 4, s: int = 32, seed: int = 0) -> torch.Tensor:
    """[b, s] ids in [5, 300) framed by [CLS] … [SEP]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    return ids


def grad_abs_sums(loss: torch.Tensor, params) -> list[float]:
    """Σ|∂loss/∂p| for each of ``params`` (0.0 where ``loss`` does not reach p)."""
    gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [0.0 if g is None else g.abs().sum().item() for g in gs]
