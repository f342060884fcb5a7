"""A run's learning curves on one figure: ``tools/plot_run.py``'s, for any number of finished or
running runs, and ``curves.png`` at the end of a run (the summary loads this file,
``rtd_scale/training/summary.py``'s ``write_curves``; not part of the package).

Six panels, one colour per run (the legend names the run directory):

* L_MLM: train ``loss/mlm`` (solid), validation ``valid/loss/mlm`` (dashed, dots), and ln V
  (dotted), the loss of a generator that guesses uniformly over the V tokens of the run's
  ``config.json`` (``model.vocab_size``).
* L_RTD: train ``loss/rtd``, validation ``valid/loss/rtd`` and the prior (dotted),
  ``diagnostics.prior_bce`` of the logged ``rtd/replaced_fraction``: the L_RTD of a discriminator
  that knows only how many tokens were replaced. A discriminator on that line has learnt nothing
  about which.
* held-out RTD AUC ``valid/rtd/auc`` with the chance band 0.5 ± 3σ (shaded),
  σ = ``diagnostics.auc_chance_sd`` for the validation's class sizes: the run's own
  ``_valid/rtd/auc_chance_sd`` where the caller has it (it is not written to TensorBoard), else
  computed from ``train.eval_iters × train.global_batch_size × data.seq_length`` tokens split by
  ``valid/rtd/replaced_fraction`` (an upper bound on the non-pad tokens, so a band at most
  slightly too narrow).
* arXiv 2111.09543 Table 1's average cosine within each token table (generator solid,
  discriminator dashed).
* ``optim/lr`` and ``throughput/tokens_per_s``.

matplotlib is imported only when a figure is built (Agg, no display; no pyplot state).
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR,
                                            VALID_AUC, VALID_AUC_CHANCE_SD,
                                            auc_chance_sd_of_counts, prior_bce)

__all__ = ["RunCurves", "PANEL_TITLES", "read_scalars", "find_events_dir", "load_run",
           "chance_sd", "build_figure", "save_figure", "write_after_run"]

FIGSIZE_IN = (15.0, 8.6)  # 1500 × 860 pixels at DPI
DPI = 100

PANEL_TITLES = (
    "L_MLM (generator, nats per masked token)",
    "L_RTD (discriminator, nats per token)",
    "held-out RTD AUC (valid/rtd/auc)",
    "avg. cosine within each token table (arXiv 2111.09543 Tab. 1)",
    "learning rate (optim/lr)",
    "throughput (throughput/tokens_per_s)",
)


@dataclass
class RunCurves:
    """One run's scalars, ``tag → {iteration: value}``, and what its config says."""
    name: str
    scalars: dict[str, dict[int, float]]
    vocab_size: Optional[int] = None
    valid_tokens: Optional[int] = None  # tokens one validation scores (upper bound, see above)
    auc_chance_sd: dict[int, float] = field(default_factory=dict)  # iteration → σ, exact

    def series(self, tag: str) -> tuple[list[int], list[float]]:
        points = sorted(self.scalars.get(tag, {}).items())
        return [s for s, _ in points], [v for _, v in points]


def read_scalars(events_dir: str) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files in ``events_dir``; a later event of the same
    step (a resumed run's) replaces an earlier one."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events_dir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _has_events(path: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(path), "events.out.tfevents.*")))


def find_events_dir(run_dir: str) -> Optional[str]:
    """``RUN_DIR/tensorboard`` (pretrain.py's default ``--tensorboard-dir``), RUN_DIR itself, or
    the ``train.tensorboard_dir`` of its config.json, whichever holds event files first."""
    candidates = [os.path.join(run_dir, "tensorboard"), run_dir]
    tb = _config(run_dir).get("train", {}).get("tensorboard_dir")
    if tb:
        candidates.append(tb)
    return next((c for c in candidates if os.path.isdir(c) and _has_events(c)), None)


def _config(run_dir: str) -> dict:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{path}: not a readable run config ({e}); move it aside to plot "
                             "without it") from None
    return cfg if isinstance(cfg, dict) else {}


def load_run(run_dir: str, *, name: Optional[str] = None,
             events_dir: Optional[str] = None) -> RunCurves:
    """The curves of the run in ``run_dir`` (a ``--save`` directory, or its TensorBoard folder).
    Raises ``UserInputError`` naming ``run_dir`` when it holds no TensorBoard events."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserInputError(f"{run_dir}: a file, not a run directory; pass a --save directory "
                             "or its tensorboard/ folder")
    if not os.path.isdir(run_dir):
        raise UserInputError(f"{run_dir}: no such run directory")
    events_dir = events_dir or find_events_dir(run_dir)
    if events_dir is None or not _has_events(events_dir):
        raise UserInputError(f"{run_dir}: no TensorBoard events (events.out.tfevents.*) in it or "
                             "in its tensorboard/ folder; pass a --save directory of a run that "
                             "has logged at least one iteration")
    cfg = _config(run_dir)
    model, train, data = (cfg.get(k, {}) for k in ("model", "train", "data"))
    tokens = None
    if all(isinstance(x, int) for x in (train.get("eval_iters"), train.get("global_batch_size"),
                                        data.get("seq_length"))):
        tokens = train["eval_iters"] * train["global_batch_size"] * data["seq_length"]
    vocab = model.get("vocab_size")
    return RunCurves(name=name or os.path.basename(os.path.normpath(run_dir)),
                     scalars=read_scalars(events_dir),
                     vocab_size=vocab if isinstance(vocab, int) and vocab > 1 else None,
                     valid_tokens=tokens or None)


def chance_sd(run: RunCurves, step: int) -> float:
    """σ of an uninformative discriminator's AUC at the validation of ``step`` (see the module
    docstring); NaN when neither the exact value nor the token count is known."""
    if step in run.auc_chance_sd:
        return run.auc_chance_sd[step]
    p = run.scalars.get("valid/rtd/replaced_fraction", {}).get(step)
    if p is None or not run.valid_tokens:
        return float("nan")
    n1 = round(p * run.valid_tokens)
    return auc_chance_sd_of_counts(n1, run.valid_tokens - n1)


def _display_names(runs: Sequence[RunCurves]) -> list[str]:
    names = [r.name for r in runs]
    return names if len(set(names)) == len(names) else [f"{i + 1}: {n}" for i, n in enumerate(names)]


def build_figure(runs: Sequence[RunCurves]):
    """The six-panel figure (a ``matplotlib.figure.Figure``) of ``runs``. Every drawn line and
    band has a ``gid`` ``"<series>:<run name>"``; series: mlm_train, mlm_valid, ln_v,
    rtd_train, rtd_valid, prior, auc, chance_band (0.5 ± 3σ; the 0.5 line is ``chance:0.5``),
    cos_generator, cos_discriminator, lr, tokens_per_s."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise UserInputError("matplotlib is not installed: pip install matplotlib "
                             "(a dependency of rtd_scale)") from None
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    ax_mlm, ax_rtd, ax_auc, ax_cos, ax_lr, ax_tps = axes
    for ax, title in zip(axes, PANEL_TITLES):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    names = _display_names(runs)

    def line(ax, run_name, series, xs, ys, colour, **kw):
        if xs:
            ax.plot(xs, ys, color=colour, gid=f"{series}:{run_name}", **kw)

    valid_style = dict(linestyle="--", marker="o", markersize=3.5, linewidth=1.2)
    for run, name, c in zip(runs, names, colours):
        line(ax_mlm, run.name, "mlm_train", *run.series("loss/mlm"), c, linewidth=1.5)
        line(ax_mlm, run.name, "mlm_valid", *run.series("valid/loss/mlm"), c, **valid_style)
        if run.vocab_size:
            ax_mlm.axhline(math.log(run.vocab_size), color=c, linestyle=":", linewidth=1.3,
                           gid=f"ln_v:{run.name}")
        line(ax_rtd, run.name, "rtd_train", *run.series("loss/rtd"), c, linewidth=1.5)
        line(ax_rtd, run.name, "rtd_valid", *run.series("valid/loss/rtd"), c, **valid_style)
        steps, fractions = run.series("rtd/replaced_fraction")
        line(ax_rtd, run.name, "prior", steps, [prior_bce(p) for p in fractions], c,
             linestyle=":", linewidth=1.3)
        steps, auc = run.series(VALID_AUC)
        line(ax_auc, run.name, "auc", steps, auc, c, marker="o", markersize=4, linewidth=1.5)
        band = [(s, chance_sd(run, s)) for s in steps]
        band = [(s, sd) for s, sd in band if math.isfinite(sd)]
        if len(band) == 1:
            ax_auc.axhspan(0.5 - 3 * band[0][1], 0.5 + 3 * band[0][1], color=c, alpha=0.15,
                           linewidth=0, gid=f"chance_band:{run.name}")
        elif band:
            xs, sd = [s for s, _ in band], [v for _, v in band]
            ax_auc.fill_between(xs, [0.5 - 3 * v for v in sd], [0.5 + 3 * v for v in sd],
                                color=c, alpha=0.15, linewidth=0, gid=f"chance_band:{run.name}")
        line(ax_cos, run.name, "cos_generator", *run.series(AVG_COSINE_GENERATOR), c,
             linewidth=1.5)
        line(ax_cos, run.name, "cos_discriminator", *run.series(AVG_COSINE_DISCRIMINATOR), c,
             linestyle="--", linewidth=1.5)
        line(ax_lr, run.name, "lr", *run.series("optim/lr"), c, linewidth=1.5)
        line(ax_tps, run.name, "tokens_per_s", *run.series("throughput/tokens_per_s"), c,
             linewidth=1.5, marker=".", markersize=4)
    if any(run.scalars.get(VALID_AUC) for run in runs):
        ax_auc.axhline(0.5, color="0.4", linewidth=0.8, gid="chance:0.5")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    def key(ax, entries, loc="best"):
        handles = [Line2D([], [], color="0.25", **style) if style is not None
                   else Patch(color="0.25", alpha=0.2) for _, style in entries]  # None: a band
        ax.legend(handles, [label for label, _ in entries], fontsize=8, loc=loc)

    solid, dashed = dict(linestyle="-"), dict(linestyle="--", marker="o", markersize=3.5)
    vocabs = {run.vocab_size for run in runs if run.vocab_size}
    ln_v = (f"ln V = {math.log(next(iter(vocabs))):.2f}: uniform guess over V = "
            f"{next(iter(vocabs))}" if len(vocabs) == 1 else "ln V: uniform guess over V tokens")
    key(ax_mlm, [("train", solid), ("validation", dashed), (ln_v, dict(linestyle=":"))])
    key(ax_rtd, [("train", solid), ("validation", dashed),
                 ("prior: −p ln p − (1−p) ln(1−p), p = replaced fraction",
                  dict(linestyle=":"))])
    sds = [chance_sd(run, s) for run in runs for s in run.scalars.get(VALID_AUC, {})]
    sds = [v for v in sds if math.isfinite(v)]
    band = (f"chance: 0.5 ± 3σ (σ {min(sds):.4f}" + (f"–{max(sds):.4f})" if
            f"{max(sds):.4f}" != f"{min(sds):.4f}" else ")") if sds else "chance: 0.5")
    key(ax_auc, [("validation AUC", dict(linestyle="-", marker="o", markersize=4)),
                 (band, None)], loc="upper left")
    key(ax_cos, [("generator table", solid), ("discriminator table", dict(linestyle="--"))])
    for ax, tag in ((ax_mlm, "loss/mlm"), (ax_rtd, "loss/rtd"), (ax_auc, VALID_AUC),
                    (ax_cos, AVG_COSINE_GENERATOR), (ax_lr, "optim/lr"),
                    (ax_tps, "throughput/tokens_per_s")):
        if not any(run.scalars.get(tag) for run in runs):
            ax.text(0.5, 0.5, f"{tag} not logged", transform=ax.transAxes, ha="center",
                    va="center", fontsize=9, color="0.4")
    fig.legend([Line2D([], [], color=c, linewidth=3) for c in colours], names,
               loc="outside upper center", ncols=min(len(runs), 4), fontsize=10, frameon=False)
    return fig


def save_figure(fig, path: str) -> None:
    """Write ``fig`` as a PNG at ``path`` atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.png"
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_after_run(save_dir: str, tensorboard_dir: Optional[str],
                    valid_history: Sequence[tuple[int, dict]]) -> str:
    """Draw ``save_dir/curves.png`` for the run that has just finished (its exact AUC chance σ
    from ``valid_history``) and return the summary's line about it. Never raises: a finished
    run must not fail because its picture could not be drawn (the line is then a warning)."""
    out = os.path.join(save_dir, "curves.png")
    try:
        run = load_run(save_dir, events_dir=tensorboard_dir)
        run.auc_chance_sd.update({s: v[VALID_AUC_CHANCE_SD] for s, v in valid_history
                                  if math.isfinite(v.get(VALID_AUC_CHANCE_SD, math.nan))})
        save_figure(build_figure([run]), out)
    except Exception as e:  # noqa: BLE001 — reported in one line, never fatal
        return f"warning: {out} not drawn ({' '.join(str(e).split()) or type(e).__name__})"
    return f"  curves:      {out}"
