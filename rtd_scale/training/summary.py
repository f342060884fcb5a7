"""What the log says about a run: its start-up lines (:func:`start_lines`: the model, the
layout, the batch arithmetic, the data) and the end-of-run summary (:func:`summary_text`: what
the losses, the embedding cosines and the held-out RTD AUC say, and where the logs, the
checkpoint and the export command are), with its learning curves (:func:`write_curves`)."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from rtd_scale.config import Objective
from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR,
                                            VALID_AUC, VALID_AUC_CHANCE_SD, prior_bce)
from rtd_scale.training.stragglers import summary_line


def start_lines(cfg, ctx, model, ds_config: dict, dp: int, gas: int, data: dict) -> list[str]:
    """The run's first lines: preset, sharing, attention and LayerNorm layout, parameters on
    this rank's model-parallel shard (ZeRO-3's ``ds_numel``: the whole parameter), vocabulary,
    the process layout, the batch arithmetic, ZeRO stage, precision, the sample length (and
    "(document-masked)" under ``data.document_masking``); then one line per data
    split (``BlendedDataset.describe``)."""
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                   for p in {id(p): p for p in model.parameters()}.values())
    objective = ("objective mlm (the masked LM alone)" if cfg.rtd.objective is Objective.MLM
                 else f"sharing {cfg.model.sharing.value}")
    lines = [f"rtd_scale: preset {cfg.preset}, {objective}, "
             f"{cfg.model.attention_type.value} attention, "
             f"{cfg.model.layernorm_position.value}-LN layers, "
             f"{n_params / 1e6:.2f}M parameters on this rank's model-parallel shard, vocab "
             f"{cfg.model.vocab_size} (padded {model.padded_vocab_size}), world "
             f"{ctx.world_size} = TP {ctx.tp_size} × PP {ctx.pp_size} × DP {ctx.dp_size}, "
             f"micro-batch {cfg.train.micro_batch_size} × accumulation {gas} × DP {dp} = global "
             f"{cfg.train.global_batch_size}, ZeRO stage "
             f"{ds_config.get('zero_optimization', {}).get('stage', 0)}, "
             f"{cfg.train.precision.value}, packed samples of {cfg.data.seq_length} "
             f"tokens{' (document-masked)' if cfg.data.document_masking else ''}, "
             f"{cfg.data.num_workers} loader workers"]
    return lines + [f"  data {split.describe()}" for split in data.values()]

def summary_text(summary: dict) -> str:
    """Human summary: first and last logged losses, arXiv 2111.09543 Table 1's average
    embedding cosines, the held-out RTD AUC and a verdict on it, where the logs and checkpoint
    are.

    The verdict reads the AUC at the last validation (``valid/rtd/auc``) in units of its chance
    standard deviation σ (``diagnostics.auc_chance_sd`` for that validation's class sizes):
    more than 3σ above 0.5 and more than 3σ above the first validation's (or only one
    validation): learning; more than 3σ above 0.5 but not rising: above chance, on a plateau;
    within 3σ of 0.5: on the prior plateau (a discriminator that knows only the replaced
    fraction); more than 3σ below: below chance (a fault)."""
    hist = summary["history"]
    lines = (_rtd_lines(summary) if "rtd/replaced_fraction" in hist[-1][1]
             else _masked_lm_lines(summary))
    memory = summary.get("memory")
    if memory:
        lines.append(memory_line(memory))
    stragglers = summary_line(summary.get("stragglers"))
    if stragglers:
        lines.append(stragglers)
    test = summary.get("test")
    if test:
        lines.append(f"  test (--test-data-path) L_MLM {test['test/loss/mlm']:.4f}" + (
            "" if "test/loss/rtd" not in test else  # rtd.objective=mlm: L_MLM alone
            f", L_RTD {test['test/loss/rtd']:.4f}, RTD AUC "
            f"{test.get('test/rtd/auc', math.nan):.4f}"))
    if summary.get("tensorboard_dir"):
        lines.append(f"  TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
    if summary.get("checkpoint_dir"):
        lines.append(f"  checkpoint:  {summary['checkpoint_dir']}")
    if summary.get("export_hint"):
        lines.append(f"  export:      {summary['export_hint']}")
    return "\n".join(lines)


def _masked_lm_lines(summary: dict) -> list[str]:
    """The summary's head for ``rtd.objective=mlm``: L_MLM and MLM accuracy, train and held out
    (its logs hold no rtd/* scalar)."""
    hist = summary["history"]
    (s0, first), (s1, last) = hist[0], hist[-1]
    lines = ["", "MLM pretraining summary",
             f"  L_MLM  first {first['loss/mlm']:.4f} (iteration {s0})  →  last "
             f"{last['loss/mlm']:.4f} (iteration {s1})",
             f"  MLM accuracy {first['mlm/accuracy']:.3f} → {last['mlm/accuracy']:.3f}"]
    valid = list(summary.get("valid_history") or [])
    if valid:
        (v0, a), (v1, b) = valid[0], valid[-1]
        lines.append(f"  validation L_MLM {a['valid/loss/mlm']:.4f} (iteration {v0}) → "
                     f"{b['valid/loss/mlm']:.4f} (iteration {v1}), MLM accuracy "
                     f"{b['valid/mlm/accuracy']:.3f}")
    return lines


def _rtd_lines(summary: dict) -> list[str]:
    """The summary's head for the RTD objective: losses, cosines, AUC and its verdict."""
    hist = summary["history"]
    (s0, first), (s1, last) = hist[0], hist[-1]
    p = last["rtd/replaced_fraction"]
    prior = prior_bce(p)
    lines = [
        "",
        "RTD pretraining summary",
        f"  L_MLM  first {first['loss/mlm']:.4f} (iteration {s0})  →  last {last['loss/mlm']:.4f}"
        f" (iteration {s1})",
        f"  L_RTD  first {first['loss/rtd']:.4f} (iteration {s0})  →  last {last['loss/rtd']:.4f}"
        f" (iteration {s1}); knowing only the replaced fraction {p:.3f} gives {prior:.4f}",
        f"  MLM accuracy {first['mlm/accuracy']:.3f} → {last['mlm/accuracy']:.3f}; discriminator "
        f"accuracy on replaced {last['rtd/accuracy_replaced']:.3f}, on original "
        f"{last['rtd/accuracy_original']:.3f} (at logit 0)",
    ]
    if AVG_COSINE_GENERATOR in last:
        lines.append(f"  average cosine within each token table (arXiv 2111.09543 Table 1): "
                     f"generator {last[AVG_COSINE_GENERATOR]:.3f}, discriminator "
                     f"{last[AVG_COSINE_DISCRIMINATOR]:.3f}")
    valid = list(summary.get("valid_history") or [])
    if valid:
        (v0, a), (v1, b) = valid[0], valid[-1]
        lines.append(f"  validation L_MLM {a['valid/loss/mlm']:.4f} (iteration {v0}) → "
                     f"{b['valid/loss/mlm']:.4f} (iteration {v1}), L_RTD "
                     f"{a['valid/loss/rtd']:.4f} → {b['valid/loss/rtd']:.4f}")
    auc = [(k, v[VALID_AUC]) for k, v in valid if not math.isnan(v.get(VALID_AUC, math.nan))]
    if not auc:
        lines.append("  verdict: no held-out RTD AUC (no validation ran; set --eval-interval "
                     "and --eval-iters above 0 with a validation share in --split or a "
                     "--valid-data-path)")
    else:
        (a0, auc0), (a1, auc1) = auc[0], auc[-1]
        sd = dict(valid)[a1].get(VALID_AUC_CHANCE_SD, math.nan)
        z = (auc1 - 0.5) / sd if sd > 0 else math.nan
        trend = (f"; {auc0:.4f} at iteration {a0}, {auc1 - auc0:+.4f} since" if a0 != a1
                 else "")
        lines.append(f"  held-out RTD AUC {auc1:.4f} at iteration {a1} (0.5 = chance, "
                     f"± {sd:.4f} for these token counts{trend})")
        rising = a0 == a1 or auc1 - auc0 > 3 * sd
        if z > 3 and rising:
            verdict = ("learning: the discriminator ranks replaced tokens above original ones "
                       f"({z:.1f} chance standard deviations above 0.5); early in a run, while "
                       "L_MLM is near ln V, the generator samples rare tokens and the token "
                       "alone can give them away, so read this as use of context only once "
                       "L_MLM has fallen well below ln V")
        elif z > 3:
            verdict = (f"above chance ({z:.1f} chance standard deviations above 0.5) but not "
                       f"rising since iteration {a0}: the discriminator tells some replaced tokens "
                       "apart (early on, often by the token alone) and is on a plateau; "
                       "train longer (see docs/main-job.md#what-the-main-job-shows)")
        elif z < -3:
            verdict = ("below chance: the discriminator ranks replaced tokens below original "
                       "ones, which training should never do; check the data and the labels")
        else:
            verdict = ("on the prior plateau: the discriminator does not yet tell replaced "
                       "tokens from original ones (AUC within 3 chance standard deviations of "
                       "0.5); train longer (see docs/main-job.md#what-the-main-job-shows)")
        lines.append(f"  verdict: {verdict}")
    return lines


def memory_line(memory: dict) -> str:
    """The summary's memory line: the largest rank's measured peak and the estimate
    (``rtd_scale/memory.py``) of the same quantity."""
    what = ("max_memory_allocated" if memory.get("device") == "cuda"
            else "peak resident size")
    line = f"  memory per rank: peak {memory['memory/peak_gb']:.2f} GB ({what}, largest rank)"
    estimate = memory.get("estimate_gb")
    if estimate:
        line += (f", estimate {estimate:.2f} GB "
                 f"({100 * (memory['memory/peak_gb'] / estimate - 1):+.0f}%)")
    return line


# The figure: tools/plot_run.py's, a file of the repository beside the package, not in it
CURVES_TOOL = Path(__file__).resolve().parents[2] / "tools" / "curves.py"


def write_curves(save_dir: str, tensorboard_dir: Optional[str],
                 valid_history: Sequence[tuple[int, dict]], tool: Path = CURVES_TOOL) -> str:
    """Draw ``save_dir/curves.png`` for the run that has just finished with ``tool``'s
    ``write_after_run`` (loaded here, once, at the end of a run: 1.3 s on 2 cores, matplotlib
    included) and return the summary's line about it. Without ``tool`` (the package installed
    without its repository) the line gives the command that draws the figure. Never raises: a
    finished run must not fail because its picture could not be drawn (the line is then a
    warning)."""
    if not tool.is_file():
        return f"  curves:      python tools/plot_run.py {save_dir}"
    try:
        spec = importlib.util.spec_from_file_location("rtd_scale_run_curves", tool)
        figure = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = figure  # its dataclasses look their module up there
        spec.loader.exec_module(figure)
        return figure.write_after_run(save_dir, tensorboard_dir, valid_history)
    except Exception as e:  # noqa: BLE001 — reported in one line, never fatal
        return (f"warning: {save_dir}/curves.png not drawn ({tool}: "
                f"{' '.join(str(e).split()) or type(e).__name__})")
