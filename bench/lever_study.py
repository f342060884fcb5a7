"""Which settings take the main job's model off the RTD plateau on real text (2 CPU cores).

Each lever is the main job's command (``tools/run_default.sh``: the ``debertav3-tiny`` preset on
the sample corpus, 2 ranks, ZeRO-3, 600 steps, validation every 100 steps over 8 global batches)
at the preset's earlier mask rate and dropout (``BASE``), with one change, run through the real ``deepspeed`` launcher. The table gives the held-out RTD
AUC at every validation, the last validation L_MLM and MLM accuracy, the seconds a step took and
the exact flags, then a second table of the held-out L_MLM at every validation; the figure (``--work-dir/levers.png``, ``tools/curves.py``) puts the
runs on one set of axes.

    python bench/lever_study.py --work-dir runs/levers                  # every lever
    python bench/lever_study.py --work-dir runs/levers --levers baseline dropout-0
    python bench/lever_study.py --work-dir runs/levers --levers baseline mask-0.25 --seeds 1234 1 2

One run is one draw: on this corpus the held-out AUC at step 600 of runs that differ only in
``--seed`` spans about ±0.05, as wide as most levers' effects, so ``--seeds`` repeats every lever
(the preset's seed is 1234) and the table gives the mean at each validation and each seed's last.

A lever whose run finished is not run again (delete ``--work-dir/runs/NAME`` to redo it), so the
same command continues an interrupted study. Outputs: the table on stdout and in
``--work-dir/levers.md``, the numbers in ``--work-dir/levers.json``, one log per run in
``--work-dir/logs``.

The levers (arXiv 2003.10555 §3.2 and Table 6 for the generator's width, the mask rate and
dropout; arXiv 2111.09543 §4 for relative-position attention):

* ``bert-attention``: BERT attention with learned absolute positions (``--preset tiny``'s
  attention) in the same post-LN layout; ``bert-attention-scope-tokens`` the same with only the
  token table shared (``--sharing-scope tokens``; under disentangled attention there is no
  absolute table, so scope changes nothing there);
* ``generator-1/3``: ELECTRA's generator, the discriminator's depth at a third of its width;
* ``mask-0.25``: mask rate 0.25 (ELECTRA-large's);
* ``dropout-0``: no dropout in either model;
* ``lr-2e-3`` and ``batch-64``: twice the learning rate; twice the batch for half the steps
  (the same sequences) at √2 × the learning rate;
* ``vocab-3000``: a 3,000-piece SentencePiece vocabulary (its own tokenizer and shards);
  ``seq-64``: sequences of 64 at twice the batch (the same tokens a step);
* ``combined``: ``dropout-0`` and ``mask-0.25`` together, which is ``debertav3-tiny`` now;
  ``combined-doc-mask`` the same with document-masked packing (``--reset-attention-mask``: no
  attention across the documents of a packed sample); ``combined-attention-dropout-0.1`` the same
  with DeBERTaV3's attention-probability dropout 0.1 back in both models (the ``flash`` core,
  flashdeberta's kernel, has none; docs/gpu.md#the-device-check, the dropout decision);
* ``modern-block``: the ``modernbert-tiny`` preset (ModernBERT's block at ``tiny``'s dimensions,
  document-masked packing on) at ``combined``'s mask rate and dropout, so that the block is the
  one change; ``modern-block-no-doc-mask`` the same with attention across documents. The
  ``--preset`` a lever names comes after the main job's and wins (argparse keeps the last).

    python bench/lever_study.py --work-dir runs/levers --seeds 1234 1 \\
        --levers combined combined-doc-mask modern-block modern-block-no-doc-mask
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "tools") not in sys.path:  # tools/curves.py, tools/plot_run.py's figure
    sys.path.append(str(REPO / "tools"))

from bench.runs import child_env, logger, run_logged, sample_data  # noqa: E402
from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import OneLineArgumentParser, run_cli  # noqa: E402

NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0",
              "--generator-hidden-dropout", "0", "--generator-attention-dropout", "0")
# Every lever starts from ``debertav3-tiny`` as it was when the study was made (mask rate 0.15,
# dropout 0.1, the config defaults); the preset now holds the two levers that helped, the
# ``combined`` run (rtd_scale/presets.py:_debertav3_tiny). The last of a repeated flag wins.
BASE = ("--mask-prob", "0.15", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--generator-hidden-dropout", "0.1", "--generator-attention-dropout", "0.1")
# name → (flags added to the main job's command, tokenizer vocabulary size, steps ÷ this)
LEVERS: dict[str, tuple[tuple[str, ...], int, int]] = {
    "baseline": ((), 8000, 1),
    "bert-attention": (("--attention-type", "bert"), 8000, 1),
    "bert-attention-scope-tokens": (("--attention-type", "bert", "--sharing-scope", "tokens"),
                                    8000, 1),
    "generator-1/3": (("--generator-num-layers-ratio", "1", "--generator-hidden-size-ratio",
                       "0.3333"), 8000, 1),
    "mask-0.25": (("--mask-prob", "0.25"), 8000, 1),
    "dropout-0": (NO_DROPOUT, 8000, 1),
    "lr-2e-3": (("--lr", "2e-3"), 8000, 1),
    "batch-64": (("--global-batch-size", "64", "--lr", "1.414e-3", "--lr-warmup-iters", "15"),
                 8000, 2),
    "vocab-3000": ((), 3000, 1),
    "seq-64": (("--seq-length", "64", "--global-batch-size", "64"), 8000, 1),
    "combined": (NO_DROPOUT + ("--mask-prob", "0.25"), 8000, 1),  # debertav3-tiny's own now
    "combined-doc-mask": (NO_DROPOUT + ("--mask-prob", "0.25", "--reset-attention-mask"), 8000, 1),
    # debertav3-tiny with DeBERTaV3's attention-probability dropout (0.1) back in both models
    "combined-attention-dropout-0.1": (NO_DROPOUT + ("--mask-prob", "0.25", "--attention-dropout",
                                                     "0.1", "--generator-attention-dropout", "0.1"),
                                       8000, 1),
    # the modern block at debertav3-tiny's mask rate and dropout: the preset named last wins
    "modern-block": (("--preset", "modernbert-tiny") + NO_DROPOUT + ("--mask-prob", "0.25"),
                     8000, 1),
    "modern-block-no-doc-mask": (("--preset", "modernbert-tiny") + NO_DROPOUT
                                 + ("--mask-prob", "0.25", "--set", "data.document_masking=false"),
                                 8000, 1),
}


def run_key(lever: str, seed: int) -> str:
    """A run's directory and log name: the lever, and the seed unless it is the preset's."""
    return lever.replace("/", "_") + ("" if seed == 1234 else f"-seed{seed}")


log = logger("levers")


def command(args, flags: tuple[str, ...], steps: int, spm: str, prefix: str,
            run_dir: Path) -> list[str]:
    """The main job's launcher command (tools/run_default.sh) with ``flags`` added."""
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    return [deepspeed, "--num_gpus", str(args.ranks), "--master_port", str(args.master_port),
            "rtd_scale/pretrain.py", "--ds_config", "ds_configs/zero3.json",
            "--preset", "debertav3-tiny", "--data-path", prefix, "--tokenizer-model", spm,
            "--save", str(run_dir), "--train-iters", str(steps), "--log-interval", "25",
            "--save-interval", str(steps), "--eval-iters", "8", "--eval-interval",
            str(max(1, args.eval_interval * steps // args.steps)), *BASE, *flags]


def finished(run_dir: Path, steps: int) -> bool:
    return (run_dir / f"global_step{steps}").is_dir() and (run_dir / "curves.png").exists()


def results_of(name: str, run_dir: Path, flags: tuple[str, ...], seconds: float | None,
               steps: int, scale: int) -> dict:
    """The validations of one run, read from its TensorBoard events; steps are reported as the
    main job's (a run of half the steps at twice the batch is drawn at 2 × its step)."""
    import curves

    run = curves.load_run(str(run_dir), name=name)
    auc = {s * scale: v for s, v in run.scalars.get("valid/rtd/auc", {}).items()}
    mlm = run.scalars.get("valid/loss/mlm", {})
    acc = run.scalars.get("valid/mlm/accuracy", {})
    last = max(mlm) if mlm else None
    return {"flags": list(flags), "auc": auc, "steps": steps,
            "mlm": {s * scale: v for s, v in mlm.items()},
            "valid_mlm": mlm.get(last) if last else None,
            "valid_mlm_accuracy": acc.get(last) if last else None,
            "s_per_step": None if seconds is None else seconds / steps}


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _flags_cell(run: dict) -> str:
    cell = f"`{' '.join(run['flags'])}`" if run["flags"] else ""
    vocab = run.get("vocab_size", 8000)
    return " ".join(filter(None, [cell, f"a {vocab:,}-piece tokenizer" if vocab != 8000 else ""])) \
        or "(none)"


def table(results: dict[str, list[dict]], steps: int, eval_interval: int) -> str:
    """One row per lever: the mean over its seeds' runs at each validation (AUC ≥ 0.65 in bold),
    each seed's last AUC, and the means of the last validation L_MLM, MLM accuracy and s/step."""
    cols = list(range(eval_interval, steps + 1, eval_interval))
    head = ("| lever | flags added to the main job | seeds | "
            + " | ".join(f"AUC @{c}" for c in cols)
            + " | last AUC of each seed | valid L_MLM | MLM acc | s/step |")
    lines = [head, "|" + "---|" * (len(cols) + 7)]
    f = lambda x, fmt: "—" if x is None else fmt.format(x)  # noqa: E731
    for name, runs in results.items():
        aucs = [{int(k): v for k, v in r["auc"].items()} for r in runs]
        cells = [f(_mean([a.get(c) for a in aucs]) if all(c in a for a in aucs) else None,
                   "{:.3f}") for c in cols]
        cells = [f"**{c}**" if c != "—" and float(c) >= 0.65 else c for c in cells]
        last = ", ".join(f"{a[max(a)]:.3f}" for a in aucs if a) or "—"
        lines.append(
            f"| {name} | {_flags_cell(runs[0])} | {len(runs)} | "
            + " | ".join(cells) + f" | {last}"
            + f" | {f(_mean([r['valid_mlm'] for r in runs]), '{:.2f}')}"
            + f" | {f(_mean([r['valid_mlm_accuracy'] for r in runs]), '{:.3f}')}"
            + f" | {f(_mean([r['s_per_step'] for r in runs]), '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def mlm_table(results: dict[str, list[dict]], steps: int, eval_interval: int) -> str:
    """One row per lever: the mean over its seeds' runs of the held-out L_MLM at each
    validation (runs recorded before it was kept show —)."""
    cols = list(range(eval_interval, steps + 1, eval_interval))
    lines = ["| lever | seeds | " + " | ".join(f"L_MLM @{c}" for c in cols) + " |",
             "|" + "---|" * (len(cols) + 2)]
    for name, runs in results.items():
        mlms = [{int(k): v for k, v in r.get("mlm", {}).items()} for r in runs]
        cells = [_mean([m.get(c) for m in mlms]) if all(c in m for m in mlms) else None
                 for c in cols]
        lines.append(f"| {name} | {len(runs)} | "
                     + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="all outputs; rerun to continue")
    p.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    p.add_argument("--steps", type=int, default=600, help="the main job's steps")
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234],
                   help="run every lever once per --seed (1234: the preset's, the main job's)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--master-port", type=int, default=29571)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    levers = LEVERS
    store = work / "levers.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    for name in args.levers:
        for seed in args.seeds:
            flags, vocab, scale = levers[name]
            steps = args.steps // scale
            key = run_key(name, seed)
            run_dir = work / "runs" / key
            seconds = results.get(key, {}).get("seconds")
            if not finished(run_dir, steps):
                if run_dir.exists():
                    raise SystemExit(f"{run_dir}: an unfinished run; delete it to run {key} again")
                spm, prefix = sample_data(work, vocab, log)
                t0 = time.time()
                seed_flags = () if seed == 1234 else ("--seed", str(seed))
                run_logged(command(args, flags + seed_flags, steps, spm, prefix, run_dir),
                           work / "logs" / f"{key}.log", log=log, env=child_env())
                seconds = time.time() - t0
                log(f"{key}: {steps} steps in {seconds:.0f} s")
            results[key] = {**results_of(key, run_dir, flags, seconds, steps, scale),
                            "seconds": seconds, "vocab_size": vocab}
            write_atomic(store, json.dumps(results, indent=2) + "\n")
    chosen = {n: [results[run_key(n, s)] for s in args.seeds] for n in args.levers}
    text = (table(chosen, args.steps, args.eval_interval) + "\n"
            + mlm_table(chosen, args.steps, args.eval_interval))
    write_atomic(work / "levers.md", text)
    print(text, flush=True)

    import curves
    runs = []
    for n in args.levers:
        for seed in args.seeds:
            run = curves.load_run(str(work / "runs" / run_key(n, seed)), name=run_key(n, seed))
            scale = levers[n][2]  # drawn at the main job's step: the same samples read
            run.scalars = {tag: {k * scale: v for k, v in points.items()}
                           for tag, points in run.scalars.items()}
            runs.append(run)
    fig = curves.build_figure(runs)
    curves.save_figure(fig, str(work / "levers.png"))
    log(f"figure: {work / 'levers.png'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
