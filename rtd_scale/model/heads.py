"""The generator's MLM head (masked positions only, tied, vocab-parallel), its replacement
sampler and its loss; the RTD head and its loss. The step's pieces after each encoder are these
modules (``RTDModel.generator_head`` / ``discriminator_head`` call them), so the step's timers
see them from outside (``training/timers.py``, ``PARTS``)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from rtd_scale.model.embeddings import TokenTable
from rtd_scale.model.weights import mark_vocab_parallel
from rtd_scale.objectives.losses import rtd_loss
from rtd_scale.objectives.sampling import sample_from_logits


class MLMHead(torch.nn.Module):
    """dense(H → E) → GELU → LayerNorm(E) → logits against the generator's token table
    (tied, as BERT/ELECTRA/DeBERTa) plus a vocab-parallel output bias.

    Evaluated at masked positions only (DESIGN.md §1): input [n, H], output [n, V_local] logits of
    this rank's vocabulary shard. Columns that are padded ids (>= real vocab size) are -inf, so
    they are never predicted, never sampled and carry no loss (DESIGN.md §3, Vocabulary).
    """

    def __init__(self, hidden_size: int, table: TokenTable, vocab_size: int, eps: float,
                 init_std: float):
        super().__init__()
        # the table's shape on this rank (``ds_shape`` once DeepSpeed's zero.Init partitioned it)
        rows, embedding_size = getattr(table.weight, "ds_shape", table.weight.shape)
        self.dense = torch.nn.Linear(hidden_size, embedding_size)
        torch.nn.init.normal_(self.dense.weight, std=init_std)
        torch.nn.init.zeros_(self.dense.bias)
        self.norm = torch.nn.LayerNorm(embedding_size, eps=eps)
        self.table = table
        self.bias = torch.nn.Parameter(torch.zeros(rows))
        from megatron.core import tensor_parallel

        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        mark_vocab_parallel(self.bias)
        global_ids = torch.arange(table.vocab_start_index, table.vocab_end_index)
        self.register_buffer("padded_column", global_ids >= vocab_size, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.dense(hidden)))  # [n, E]
        h = copy_to_tensor_model_parallel_region(h, group=self.table.tp_group)
        logits = F.linear(h, self.table.weight, self.bias)  # [n, V_local]
        return logits.masked_fill(self.padded_column, float("-inf"))

    def foreign_parameters(self) -> list[torch.nn.Parameter]:
        """The tied table's weight, read in forward but owned by the table (for ZeRO-3)."""
        return [self.table.weight]


def mlm_loss(logits: torch.Tensor, targets: torch.Tensor,
             valid: torch.Tensor | None = None,
             normaliser: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy summed over the masked positions, vocab-parallel (megatron-core), divided
    by ``normaliser``. Every tensor-parallel rank gets the full per-position loss (the kernel
    all-reduces the log-sum-exp and the target logit), so the same normaliser applies on each.

    Args:
        logits: [n, V_local] (consumed: megatron-core's kernel works in place on fp32 input).
        targets: [n] int64 original ids.
        valid: optional [n] bool, False at rows that are not masked positions (the unused slots
            of a static selection); they contribute exactly nothing.
        normaliser: scalar fp32, ``micro_batch_normaliser(...)[MLM_COUNT]`` (the global batch's
            masked positions / its micro-batches; ``objectives/losses.py``); None: this
            micro-batch's valid rows.
    Returns:
        scalar fp32 — sum of per-position losses over valid rows / normaliser (without one:
        their mean, 0 when none).
    """
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    per_position = vocab_parallel_cross_entropy(logits.float().unsqueeze(1),
                                                targets.unsqueeze(1)).view(-1)
    if valid is not None:
        per_position = torch.where(valid, per_position, torch.zeros((), device=logits.device))
    if normaliser is None:
        return per_position.mean() if valid is None else \
            per_position.sum() / valid.sum().clamp(min=1)
    return per_position.sum() / normaliser


@torch.no_grad()
def vocab_parallel_top1_correct(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                tp_group) -> torch.Tensor:
    """Whether each row's target holds the global maximum logit, without gathering the vocab
    and without a host sync (static shapes).

    Args:
        logits: [n, V_local] this rank's shard; targets: [n] int64 global ids.
    Returns:
        [n] bool, identical on every rank of ``tp_group`` (two MAX all-reduces of [n] floats).
    """
    n, v_local = logits.shape
    best = logits.float().amax(dim=-1)
    local = targets - vocab_start
    inside = (local >= 0) & (local < v_local)
    at_target = logits.gather(1, local.clamp(0, v_local - 1).view(-1, 1)).view(-1).float()
    target_logit = torch.where(inside, at_target, torch.full((), float("-inf"),
                                                             device=logits.device))
    if tp_group.size() > 1:
        torch.distributed.all_reduce(best, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        torch.distributed.all_reduce(target_logit, op=torch.distributed.ReduceOp.MAX,
                                     group=tp_group)
    return target_logit >= best


class MLMCriterion(torch.nn.Module):
    """L_MLM and the MLM accuracy's hits from the MLM head's logits (``mlm_loss``,
    ``vocab_parallel_top1_correct``); no parameters.

    forward(logits [n, V_local] (consumed by the loss), targets [n], valid [n] bool,
    normaliser scalar or None) -> (scalar L_MLM, [n] bool: target is the top-1 and row valid).
    """

    def __init__(self, table: torch.nn.Module):
        super().__init__()
        self.vocab_start, self.tp_group = table.vocab_start_index, table.tp_group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                normaliser: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        correct = vocab_parallel_top1_correct(logits, targets, self.vocab_start,
                                              self.tp_group) & valid
        return mlm_loss(logits, targets, valid, normaliser), correct  # the loss consumes logits


class RTDCriterion(torch.nn.Module):
    """L_RTD from the RTD head's logits (``objectives.losses.rtd_loss``); no parameters.

    forward(logits [b, s], labels [b, s] float, valid [b, s] bool, normaliser scalar or None)
    -> scalar L_RTD.
    """

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                normaliser: Optional[torch.Tensor]) -> torch.Tensor:
        return rtd_loss(logits, labels, valid, normaliser)


class ReplacementSampler(torch.nn.Module):
    """The generator's replacements: one id per masked position drawn from softmax(logits / T)
    (never the argmax, no gradient), vocab-parallel Gumbel-max with counter-based noise
    (``objectives/sampling.py``); never a special or padded id, and with ``disallow_correct``
    never the original (ELECTRA, arXiv 2003.10555 §2). No parameters; ``sampleable`` [V_local]
    bool is a non-persistent buffer over the output table's shard.

    forward(logits [n, V_local], step, sample_index [n], position [n], original [n]) ->
    [n] int64 global ids, the same on every tensor-parallel rank.
    """

    def __init__(self, table: torch.nn.Module, vocab_size: int, special_ids: Sequence[int], *,
                 seed: int, temperature: float, disallow_correct: bool):
        super().__init__()
        self.seed, self.temperature, self.disallow_correct = seed, temperature, disallow_correct
        self.vocab_start, self.tp_group = table.vocab_start_index, table.tp_group
        v0, v1 = table.vocab_start_index, table.vocab_end_index
        sampleable = torch.arange(v0, v1) < vocab_size
        for sid in special_ids:
            if v0 <= sid < v1:
                sampleable[sid - v0] = False
        self.register_buffer("sampleable", sampleable, persistent=False)

    def forward(self, logits: torch.Tensor, step: int, sample_index: torch.Tensor,
                position: torch.Tensor, original: Optional[torch.Tensor]) -> torch.Tensor:
        return sample_from_logits(
            logits.detach(), seed=self.seed, step=step, sample_index=sample_index,
            position=position, vocab_start=self.vocab_start, sampleable=self.sampleable,
            temperature=self.temperature,
            disallow_ids=original if self.disallow_correct else None, tp_group=self.tp_group)


class RTDHead(torch.nn.Module):
    """ELECTRA's discriminator head: dense(H → H) → GELU → linear(H → 1).

    forward(hidden [s, b, H]) -> logits [b, s].
    """

    def __init__(self, hidden_size: int, init_std: float):
        super().__init__()
        self.dense = torch.nn.Linear(hidden_size, hidden_size)
        self.out = torch.nn.Linear(hidden_size, 1)
        for lin in (self.dense, self.out):
            torch.nn.init.normal_(lin.weight, std=init_std)
            torch.nn.init.zeros_(lin.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.dense(hidden))).squeeze(-1).transpose(0, 1)  # [b, s]
