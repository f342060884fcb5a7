"""Does RTD earn its cost? RTD against MLM at equal pretraining FLOPs, then fine-tuned (2 CPU cores).

For each architecture (``debertav3-tiny``, the main job's model, and ``modernbert-tiny``, the
modern block at its size) and each seed, two pretraining runs on the sample corpus through the
real ``deepspeed`` launcher (the main job's command, ``tools/run_default.sh``):

* **RTD**: the preset as it is (generator + discriminator, L_MLM + λ·L_RTD), ``--steps`` steps;
* **MLM**: the discriminator's encoder alone with the masked-LM loss (``--set
  rtd.objective=mlm``) at the MLM recipe's mask rate (BERT's 15% with 80/10/10 for the DeBERTa
  model, ModernBERT's 30% for the modern block), for the steps whose model FLOPs equal the RTD
  run's (``rtd_scale/flops.py``: generator + discriminator against the encoder alone; the same
  tokens a step, so the step counts stand in the ratio of FLOPs per token).

Each run saves at ``--points`` equal fractions of its FLOPs; each checkpoint is exported
(``tools/export_hf.py``) and fine-tuned (``tools/finetune.py``) on the offline Brown tasks —
genre classification (15 genres, split by file) and part-of-speech tagging — once, with the
pretraining seed's index as the fine-tuning seed, so the spread over seeds holds both. The table
gives each task's score (mean ± sample sd over seeds) at every point, and, at the last point, the
difference RTD − MLM in units of the two objectives' pooled sd; the picture
(``--work-dir/objective_study.png``) puts the score against pretraining FLOPs, one line per
objective × architecture (ELECTRA, arXiv 2003.10555, Fig. 3's axes).

    python bench/objective_study.py --work-dir runs/objective                     # the study
    python bench/objective_study.py --work-dir runs/objective --steps 60 --seeds 1 \\
        --points 1 --finetune-max-steps 20                                      # a smoke run

What finished is not run again (a run with its last checkpoint, an export, a fine-tuning result),
so the same command continues an interrupted study. Outputs: the table on stdout and in
``--work-dir/objective_study.md``, the numbers in ``objective_study.json``, a log per command in
``--work-dir/logs``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.runs import child_env, logger, run_logged, sample_data  # noqa: E402
from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import OneLineArgumentParser, run_cli  # noqa: E402

# each architecture's MLM recipe: BERT's (and DeBERTa's released code's) 15%, ModernBERT's 30%
MLM_MASK_PROB = {"debertav3-tiny": 0.15, "modernbert-tiny": 0.30}
OBJECTIVES = ("rtd", "mlm")
TASKS = ("brown-genre", "brown-pos")

log = logger("objective")


def objective_flags(arch: str, objective: str) -> tuple[str, ...]:
    """What a run adds to the main job's command: the preset, and for MLM the objective and
    its recipe's mask rate."""
    flags = ("--preset", arch)
    if objective == "mlm":
        flags += ("--set", "rtd.objective=mlm", "--mask-prob", str(MLM_MASK_PROB[arch]))
    return flags


def step_flops(arch: str, objective: str) -> tuple[float, int]:
    """(model FLOPs of one training step per token, tokens a step) of ``arch``'s preset under
    ``objective`` (``rtd_scale/flops.py``), at the preset's batch and sequence length (the main
    job's)."""
    from rtd_scale import flops
    from rtd_scale.config import apply_override
    from rtd_scale.presets import preset

    cfg = preset(arch)
    if objective == "mlm":
        apply_override(cfg, "rtd.objective=mlm")
        cfg.rtd.mask_prob = MLM_MASK_PROB[arch]
    return (flops.rtd_flops_per_token(flops.dims_of(cfg)),
            cfg.train.global_batch_size * cfg.data.seq_length)


def matched_steps(rtd_steps: int, rtd_flops: float, mlm_flops: float) -> int:
    """The MLM steps whose FLOPs equal ``rtd_steps`` RTD steps' (the same tokens a step)."""
    return max(1, round(rtd_steps * rtd_flops / mlm_flops))


def save_points(steps: int, points: int) -> list[int]:
    """The steps at ``points`` equal fractions of a run (the last its end)."""
    return sorted({max(1, round(steps * (k + 1) / points)) for k in range(points)})


def prune(run_dir: Path, points: list[int]) -> list[str]:
    """Remove the run's checkpoints at steps other than ``points`` (the --save-interval that
    reaches every point, their gcd, is 1 where they share no factor: 307, 613, 920 for
    debertav3-tiny's MLM run, 14 MB a step); returns the names removed."""
    import shutil

    keep = {f"global_step{p}" for p in points}
    gone = sorted(d.name for d in run_dir.glob("global_step*")
                  if d.is_dir() and d.name not in keep)
    for name in gone:
        shutil.rmtree(run_dir / name)
    return gone


def command(args, flags: tuple[str, ...], steps: int, seed: int, spm: str, prefix: str,
            run_dir: Path) -> list[str]:
    """The main job's launcher command (tools/run_default.sh) for one run, saving at every
    point (``--save-interval``: the points are equal fractions, so their gcd; :func:`prune`
    removes the others after the run)."""
    interval = math.gcd(*save_points(steps, args.points))
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    return [deepspeed, "--num_gpus", str(args.ranks), "--master_port", str(args.master_port),
            "rtd_scale/pretrain.py", "--ds_config", "ds_configs/zero3.json",
            "--data-path", prefix, "--tokenizer-model", spm, "--save", str(run_dir),
            "--train-iters", str(steps), "--log-interval", "25", "--save-interval",
            str(interval), "--eval-iters", "8", "--eval-interval", str(steps), "--seed",
            str(seed), *flags]


def pooled_sds(a: list[float], b: list[float]) -> float | None:
    """mean(a) − mean(b) in units of the pooled sample sd (√((sd_a² + sd_b²)/2)); None with
    fewer than two values a side or no spread."""
    if len(a) < 2 or len(b) < 2:
        return None
    pooled = math.sqrt((statistics.variance(a) + statistics.variance(b)) / 2)
    return None if pooled == 0 else (statistics.fmean(a) - statistics.fmean(b)) / pooled


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    sd = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{sd}"


def table(rows: list[dict], tasks: tuple[str, ...]) -> str:
    """One line per architecture × objective × point: pretraining steps and PFLOPs, each task's
    accuracy (mean ± sd over seeds); then, per architecture and task at the last point,
    RTD − MLM in pooled sds."""
    lines = ["| architecture | objective | point | steps | pretraining PFLOPs | seeds | "
             + " | ".join(f"{t} accuracy" for t in tasks) + " |",
             "|" + "---|" * (6 + len(tasks))]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['objective'].upper()} | {r['point']} | {r['steps']} | "
                     f"{r['flops'] / 1e15:.3g} | {len(r['scores'][tasks[0]])} | "
                     + " | ".join(_cell(r["scores"][t]) for t in tasks) + " |")
    lines.append("")
    for arch in dict.fromkeys(r["arch"] for r in rows):
        last = {r["objective"]: r for r in rows if r["arch"] == arch
                and r["point"] == max(x["point"] for x in rows if x["arch"] == arch)}
        if set(last) != set(OBJECTIVES):
            continue
        for t in tasks:
            a, b = last["rtd"]["scores"][t], last["mlm"]["scores"][t]
            k = pooled_sds(a, b)
            diff = (statistics.fmean(a) - statistics.fmean(b)) if a and b else float("nan")
            lines.append(f"- {arch}, {t}: RTD − MLM = {diff:+.3f}"
                         + ("" if k is None else f" ({k:+.1f} pooled sds over {len(a)} seeds)"))
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], tasks: tuple[str, ...], path: Path) -> None:
    """Score against pretraining FLOPs, one panel per task, one line per objective ×
    architecture, bars ± sd over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for arch in dict.fromkeys(r["arch"] for r in rows):
            for obj, style in zip(OBJECTIVES, ("-o", "--s")):
                line = [r for r in rows if r["arch"] == arch and r["objective"] == obj
                        and r["scores"][t]]
                if not line:
                    continue
                xs = [r["flops"] / 1e15 for r in line]
                ys = [statistics.fmean(r["scores"][t]) for r in line]
                err = [statistics.stdev(r["scores"][t]) if len(r["scores"][t]) > 1 else 0
                       for r in line]
                ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3,
                            label=f"{arch} {obj.upper()}")
        ax.set_xlabel("pretraining PFLOPs")
        ax.set_ylabel(f"{t} accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="all outputs; rerun to continue")
    p.add_argument("--archs", nargs="+", choices=list(MLM_MASK_PROB), default=list(MLM_MASK_PROB))
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--steps", type=int, default=600, help="the RTD run's steps (the main job's)")
    p.add_argument("--points", type=int, default=3, help="fine-tune at this many fractions")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--finetune-max-steps", type=int, default=300)
    p.add_argument("--finetune-train-samples", type=int, default=2000)
    p.add_argument("--finetune-eval-samples", type=int, default=500)
    p.add_argument("--finetune-learning-rate", type=float, default=1e-3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--master-port", type=int, default=29573)
    args = p.parse_args(argv)
    if Path(args.work_dir).exists() and not Path(args.work_dir).is_dir():
        p.error(f"--work-dir {args.work_dir}: exists and is not a directory; pass a directory")
    for flag in ("steps", "points", "finetune_max_steps", "ranks"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def _finetune(args, export: Path, task: str, seed: int, out: Path) -> float:
    """``tools/finetune.py`` on one export, one task, one seed; its accuracy."""
    results = out / "results.json"
    if not results.exists():
        run_logged([sys.executable, "tools/finetune.py", str(export), "--task", task,
                    "--seeds", str(seed), "--max-steps", str(args.finetune_max_steps),
                    "--max-train-samples", str(args.finetune_train_samples),
                    "--max-eval-samples", str(args.finetune_eval_samples),
                    "--per-device-train-batch-size", "16", "--learning-rate",
                    str(args.finetune_learning_rate), "--output-dir", str(out)],
                   Path(args.work_dir) / "logs" / "finetune.log", log=log, env=child_env())
    return json.loads(results.read_text())["per_seed"][0]["accuracy"]


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    spm, prefix = sample_data(work, 8000, log)
    rows: list[dict] = []
    for arch in args.archs:
        per_token, tokens = {}, {}
        for o in OBJECTIVES:
            per_token[o], tokens[o] = step_flops(arch, o)
        steps = {"rtd": args.steps,
                 "mlm": matched_steps(args.steps, per_token["rtd"], per_token["mlm"])}
        log(f"{arch}: {per_token['rtd'] / 1e6:.1f} MFLOPs a token RTD, "
            f"{per_token['mlm'] / 1e6:.1f} MLM: {steps['rtd']} RTD steps = {steps['mlm']} MLM steps")
        for obj in OBJECTIVES:
            points = save_points(steps[obj], args.points)
            scores = {p: {t: [] for t in args.tasks} for p in points}
            for i, seed in enumerate(args.seeds):
                key = f"{arch}-{obj}-seed{seed}"
                run_dir = work / "runs" / key
                if not (run_dir / f"global_step{steps[obj]}").is_dir():
                    if run_dir.exists():
                        raise SystemExit(f"{run_dir}: an unfinished run; delete it to run {key} "
                                         "again")
                    run_logged(command(args, objective_flags(arch, obj), steps[obj], seed, spm,
                                       prefix, run_dir), work / "logs" / f"{key}.log", log=log,
                               env=child_env())
                prune(run_dir, points)
                for p in points:
                    export = work / "exports" / f"{key}-step{p}"
                    if not (export / "config.json").exists():
                        run_logged([sys.executable, "tools/export_hf.py", "--load", str(run_dir),
                                    "--tag", f"global_step{p}", "--output", str(export),
                                    "--overwrite"], work / "logs" / "export.log", log=log,
                                   env=child_env())
                    for t in args.tasks:
                        scores[p][t].append(_finetune(args, export, t, i,
                                                      work / "finetune" / f"{key}-step{p}-{t}"))
            rows += [{"arch": arch, "objective": obj, "point": k + 1, "steps": p,
                      "flops": per_token[obj] * tokens[obj] * p, "scores": scores[p]}
                     for k, p in enumerate(points)]
    text = table(rows, tuple(args.tasks))
    write_atomic(str(work / "objective_study.json"), json.dumps(rows, indent=2) + "\n")
    write_atomic(str(work / "objective_study.md"), text)
    figure(rows, tuple(args.tasks), work / "objective_study.png")
    print(text, flush=True)
    log(f"figure: {work / 'objective_study.png'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
