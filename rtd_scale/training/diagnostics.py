"""Learning diagnostics: arXiv 2111.09543 Table 1's embedding cosines and the held-out RTD AUC.

Table 1 (DeBERTaV3, arXiv 2111.09543 §3.2–3.3) reports, for each model, the *average cosine
similarity among the word embeddings of its own table*: ES 0.02 (generator) / 0.02
(discriminator), NES 0.45 / 0.02, GDES 0.45 / 0.29. ``table_cosines`` measures that quantity on
this run's tables (``embedding/avg_cosine_generator``, ``embedding/avg_cosine_discriminator``;
the discriminator's table as its sharing mode's rule reads it, ``model/sharing.py``
``Tie.diagnostic_rows``: under GDES E_G + E_Δ, under ES E_G itself), and, under its own
name, the row-wise cosine between a token's generator row and its discriminator row
(``embedding/rowwise_cosine_generator_discriminator``: 1 under ES; not a Table-1 number).

Convention of the average: the mean over the V·(V − 1) ordered pairs i ≠ j of the V real-token
rows (padded rows excluded), which equals the mean over the V·(V − 1)/2 unordered pairs. The paper
does not say whether it includes the V self-pairs (cosine 1); including them would add
(1 − c)/V, i.e. < 1e-4 at its 128k vocabulary.

``roc_auc`` is the exact ROC AUC (Mann–Whitney U / (n₁·n₀), ties counted ½): the probability that
a replaced token's discriminator logit is above an original token's. At 15 % masking the
discriminator's accuracy at logit 0 on replaced tokens stays near 0 for thousands of steps while
its ranking of tokens already improves; the AUC is the number that moves (0.5: no better than the
replaced-fraction prior).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["avg_pairwise_cosine", "cosine_parts", "cosine_from_parts", "table_cosines",
           "roc_auc", "auc_chance_sd", "auc_chance_sd_of_counts", "prior_bce",
           "gather_scores"]

AVG_COSINE_GENERATOR = "embedding/avg_cosine_generator"
AVG_COSINE_DISCRIMINATOR = "embedding/avg_cosine_discriminator"
ROWWISE_COSINE = "embedding/rowwise_cosine_generator_discriminator"
VALID_AUC = "valid/rtd/auc"
ROW_CHUNK = 16384  # table rows per float64 block in table_cosines
VALID_AUC_CHANCE_SD = "_valid/rtd/auc_chance_sd"  # "_": kept out of TensorBoard


def cosine_parts(rows: torch.Tensor) -> torch.Tensor:
    """The sufficient statistics of the mean pairwise cosine of ``rows`` [n, E]:
    [Σ u_i (E values), Σ |u_i|², n] in float64, where u_i = rows_i / |rows_i| (a zero row gives
    u_i = 0: cosine 0 with every row, as ``torch.nn.functional.cosine_similarity``). Parts of
    disjoint row sets add, so vocab-parallel shards combine with one all-reduce (sum)."""
    u = torch.nn.functional.normalize(rows.double(), dim=-1)
    n = torch.tensor([float(rows.shape[0])], dtype=torch.float64, device=rows.device)
    return torch.cat([u.sum(dim=0), (u * u).sum().reshape(1), n])


def cosine_from_parts(parts: torch.Tensor) -> float:
    """Mean cosine over the ordered pairs i ≠ j from ``cosine_parts`` (summed over shards):
    (|Σ u_i|² − Σ |u_i|²) / (n·(n − 1)), since |Σ u_i|² = Σ_i Σ_j u_i·u_j. NaN for n < 2."""
    s, sq, n = parts[:-2], float(parts[-2]), float(parts[-1])
    if n < 2:
        return float("nan")
    return (float(s.dot(s)) - sq) / (n * (n - 1))


def avg_pairwise_cosine(rows: torch.Tensor) -> float:
    """Mean cosine similarity over the ordered pairs i ≠ j of the rows of ``rows`` [n, E]
    (arXiv 2111.09543 Table 1's quantity), in O(n·E) time and O(E) extra memory from the sum of
    the normalised rows; float64 accumulation. NaN for n < 2."""
    return cosine_from_parts(cosine_parts(rows))


@torch.no_grad()
def table_cosines(model, tp_group: Optional[dist.ProcessGroup],
                  zero3: bool) -> Optional[dict[str, float]]:
    """Table 1's average cosines of the generator's and the discriminator's token tables over
    the real vocabulary, and the row-wise generator-vs-discriminator cosine.

    Args:
        model: an ``RTDModel`` (or this pipeline stage's share of one); its tables are
            vocab-parallel ``TokenTable``s, rows [V_local, E].
        tp_group: the tensor-parallel group the vocabulary is split over (one all-reduce of
            2·E + 5 float64 values).
        zero3: gather the ZeRO-3 partitions of the tables first (DeepSpeed
            ``GatheredParameters``); then every rank of the first stage must call it.
    Memory: float64 copies of ``ROW_CHUNK`` rows at a time, besides the gathered tables.

    Returns:
        {AVG_COSINE_GENERATOR, AVG_COSINE_DISCRIMINATOR, ROWWISE_COSINE} → float, or None on
        pipeline stages other than the first (the tables live there).
    """
    if not model.pre_process:
        return None
    from rtd_scale.model.sharing import sharing_rule

    g_table, d_mod = model.generator_table, model.discriminator_table
    tie = sharing_rule(model.cfg.sharing).table  # the mode's view of the discriminator's table
    params = [g_table.weight, *tie.diagnostic_parameters(d_mod)]
    gather = contextlib.nullcontext()
    if zero3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        # this rank's real-token rows are a prefix of its shard (padding sits at the end)
        n_real = max(0, min(model.cfg.vocab_size, g_table.vocab_end_index)
                     - g_table.vocab_start_index)
        e = g_table.weight.shape[1]
        stats = torch.zeros(2 * e + 5, dtype=torch.float64, device=g_table.weight.device)
        for lo in range(0, n_real, ROW_CHUNK):  # float64 copies of ROW_CHUNK rows at a time
            hi = min(lo + ROW_CHUNK, n_real)
            g = g_table.weight[lo:hi].double()
            d = tie.diagnostic_rows(g, d_mod, lo, hi)  # ES: g; NES: its own; GDES: g + E_Δ
            rowwise = torch.nn.functional.cosine_similarity(g, d, dim=-1).sum().reshape(1)
            stats += torch.cat([cosine_parts(g), cosine_parts(d), rowwise])
    if dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(stats, group=tp_group)
    gen, disc = stats[:e + 2], stats[e + 2:2 * e + 4]
    n = float(gen[-1])
    return {AVG_COSINE_GENERATOR: cosine_from_parts(gen),
            AVG_COSINE_DISCRIMINATOR: cosine_from_parts(disc),
            ROWWISE_COSINE: float(stats[-1]) / n if n > 0 else float("nan")}


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC of ``scores`` for ``labels`` (1 positive, 0 negative; other values, e.g.
    −1 for padding, ignored): (Σ ranks of the positives − n₁(n₁ + 1)/2) / (n₁·n₀) with tied
    scores given their average rank, i.e. P(score₊ > score₋) + ½·P(score₊ = score₋)
    (Mann–Whitney). O(N log N) (one sort). NaN when either class is empty.

    Args:
        scores: [N] (any shape, flattened) real scores, e.g. discriminator logits.
        labels: same number of elements.
    """
    scores, labels = scores.reshape(-1), labels.reshape(-1)
    keep = (labels == 0) | (labels == 1)
    s, pos = scores[keep], labels[keep] == 1
    n1 = int(pos.sum())
    n0 = int(s.numel()) - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    s_sorted, order = torch.sort(s)
    _, counts = torch.unique_consecutive(s_sorted, return_counts=True)
    ends = torch.cumsum(counts, 0)  # 1-based rank of each tie group's last element
    pos_before = torch.cumsum(pos[order].to(torch.int64), 0)[ends - 1]
    pos_in_group = torch.diff(pos_before, prepend=pos_before.new_zeros(1))
    avg_rank = ends.double() - (counts.double() - 1) / 2  # mean of ranks end − count + 1 … end
    r_pos = float((avg_rank * pos_in_group.double()).sum())
    return (r_pos - n1 * (n1 + 1) / 2) / (n1 * n0)


def auc_chance_sd(labels: torch.Tensor) -> float:
    """Standard deviation of the AUC of uninformative scores for ``labels`` (1 / 0; others
    ignored): sqrt((n₁ + n₀ + 1) / (12·n₁·n₀)), the Mann–Whitney U statistic's null variance
    over (n₁·n₀)² (no ties). An AUC more than ~3 of these above 0.5 is not chance. NaN when a
    class is empty."""
    return auc_chance_sd_of_counts(int((labels == 1).sum()), int((labels == 0).sum()))


def prior_bce(p: float) -> float:
    """L_RTD (nats per token) of a discriminator that knows only the replaced fraction ``p`` and
    predicts it for every token: −(p ln p + (1 − p) ln(1 − p)), the binary entropy; 0.4227 at
    p = 0.15 (ELECTRA's mask rate, arXiv 2003.10555 §3.1). NaN outside 0 < p < 1."""
    if not 0.0 < p < 1.0:
        return float("nan")
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def auc_chance_sd_of_counts(n1: int, n0: int) -> float:
    """``auc_chance_sd`` for n₁ positives and n₀ negatives; NaN when either is 0."""
    if n1 <= 0 or n0 <= 0:
        return float("nan")
    return ((n1 + n0 + 1) / (12.0 * n1 * n0)) ** 0.5


def gather_scores(scores: torch.Tensor, labels: torch.Tensor,
                  group: Optional[dist.ProcessGroup]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``scores`` [N] and ``labels`` [N] (values 0, 1, or −1 = ignore) of every rank of
    ``group``, concatenated on the group's first rank (``dist.gather``; ranks holding fewer than
    the largest N are padded with label −1). Returns (scores float32, labels int8) there, None on
    the other ranks. Collective over ``group``: one all-reduce (the common length), one gather.
    Memory on the first rank: 8 bytes × N × group size."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return scores.reshape(-1).float(), labels.reshape(-1).to(torch.int8)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    m = torch.tensor([scores.numel()], dtype=torch.int64, device=scores.device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    packed = torch.full((2, int(m)), -1.0, dtype=torch.float32, device=scores.device)
    packed[0, :scores.numel()] = scores.reshape(-1).float()
    packed[1, :labels.numel()] = labels.reshape(-1).float()
    parts = [torch.empty_like(packed) for _ in range(size)] if me == 0 else None
    dist.gather(packed, parts, dst=dst, group=group)
    if me != 0:
        return None
    allp = torch.cat(parts, dim=1)
    return allp[0], allp[1].to(torch.int8)

