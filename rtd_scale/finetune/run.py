"""Fine-tune one model directory on one task with transformers' ``Trainer``, once per seed, and
summarise: each metric's mean and sample standard deviation (n − 1) over the seeds.

The model is the directory's encoder with the task's head (``AutoModelForSequenceClassification``
/ ``AutoModelForTokenClassification``; a regression task is one output with
``problem_type="regression"``, MSE); with ``init="random"`` the same architecture from its
config at random initialisation (a control: what pretraining must beat). The seed sets the new
head's initial weights (``transformers.set_seed`` before the model is built) and the order of the
training examples (``TrainingArguments.seed``). Token classification labels a word's first piece
(transformers' ``run_ner`` example, ``label_all_tokens`` off); words past ``max_seq_length``
pieces are left out of training and evaluation. Evaluation is on the task's evaluation set
after the last step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import numpy as np

from rtd_scale.cli_errors import UserInputError
from rtd_scale.finetune import metrics
from rtd_scale.finetune.tasks import Task

Init = Literal["pretrained", "random"]
# the metrics each kind of task reports, the first its default --metric
METRICS = {"classification": ("accuracy", "f1", "matthews"),
           "regression": ("pearson", "spearman"),
           "token-classification": ("accuracy", "f1")}


@dataclasses.dataclass(kw_only=True)
class Settings:
    """What ``TrainingArguments`` gets (its names and, where the CLI has no other default,
    its defaults), and the tokeniser's length limit."""

    learning_rate: float = 5e-5
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 64
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_seq_length: int = 128


def check_model_dir(model_dir: Path) -> None:
    """Raises UserInputError unless ``model_dir`` holds a transformers ``config.json``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserInputError(f"EXPORT {model_dir}: no such directory; pass a tools/export_hf.py output "
                             "or a Hugging Face encoder directory")
    if not (model_dir / "config.json").is_file():
        raise UserInputError(f"EXPORT {model_dir}: no config.json there; pass a tools/export_hf.py output "
                             "(its top directory, or generator/) or a Hugging Face encoder directory")
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserInputError(f"EXPORT {model_dir}/config.json: not readable JSON ({e}); pass a "
                             "tools/export_hf.py output or a Hugging Face encoder directory") from None
    if isinstance(config, dict) and "model_type" not in config and "train" in config:
        # a pretraining run's own config.json (rtd_scale/config.py's sections), not transformers'
        raise UserInputError(f"EXPORT {model_dir}: a pretraining run directory, not an export; export it "
                             f"first: python tools/export_hf.py --load {model_dir} --output "
                             f"hf/{model_dir.name}, then pass hf/{model_dir.name}")
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserInputError(f"EXPORT {model_dir}/config.json: no model_type, so transformers cannot "
                             "build it; pass a tools/export_hf.py output or a Hugging Face encoder "
                             "directory")


def load_tokenizer(model_dir: Path, token_level: bool):
    """The directory's fast tokenizer; for token classification one that takes words
    (``is_split_into_words``), which byte-level BPE tokenizers do only with
    ``add_prefix_space=True``."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise UserInputError(f"{model_dir}: no tokenizer loads from it ({' '.join(str(e).split())[:160]}); "
                             "an export holds tokenizer.json: re-export with tools/export_hf.py") from None
    if token_level:
        if not tok.is_fast:
            raise UserInputError(f"{model_dir}: token classification needs a fast tokenizer "
                                 "(tokenizer.json) for word ids; re-export with tools/export_hf.py")
        try:
            tok(["a", "b"], is_split_into_words=True)
        except Exception:
            tok = AutoTokenizer.from_pretrained(str(model_dir), add_prefix_space=True)
    return tok


def position_limit(config) -> Optional[int]:
    """How many tokens the model's learned positions hold (None: no fixed limit): RoBERTa-style
    position ids start at ``pad_token_id + 1`` (transformers' ``create_position_ids_from_input_ids``)."""
    n = getattr(config, "max_position_embeddings", None)
    if not n:
        return None
    if config.model_type.startswith("roberta") or config.model_type in ("xlm-roberta", "camembert"):
        n -= (config.pad_token_id or 0) + 1
    return n


def encode(task: Task, tok, max_len: int) -> tuple[list[dict], list[dict]]:
    """(train features, eval features): dicts of ``input_ids``, ``attention_mask`` (and
    ``token_type_ids`` where the tokenizer gives them) and ``labels`` (class id, float, or per
    piece tag id with −100 off a word's first piece)."""
    label_id = {name: i for i, name in enumerate(task.labels)}

    def seq(examples):
        cols = list(zip(*[texts for texts, _ in examples]))
        enc = tok(*[list(c) for c in cols], truncation=True, max_length=max_len)
        out = []
        for i, (_, label) in enumerate(examples):
            f = {k: v[i] for k, v in enc.items()}
            f["labels"] = float(label) if task.kind == "regression" else label_id[label]
            out.append(f)
        return out

    def tokens(examples):
        enc = tok([w for w, _ in examples], is_split_into_words=True, truncation=True,
                  max_length=max_len)
        out = []
        for i, (_, tags) in enumerate(examples):
            f = {k: v[i] for k, v in enc.items()}
            labels, prev = [], None
            for w in enc.word_ids(i):
                labels.append(label_id[tags[w]] if w is not None and w != prev else -100)
                prev = w
            f["labels"] = labels
            out.append(f)
        return out

    fn = tokens if task.kind == "token-classification" else seq
    return fn(task.train), fn(task.eval)


def build_model(model_dir: Path, task: Task, seed: int, init: Init):
    import transformers
    from transformers import (AutoConfig, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    token = task.kind == "token-classification"
    auto = AutoModelForTokenClassification if token else AutoModelForSequenceClassification
    kw: dict = {"num_labels": 1, "problem_type": "regression"} if task.kind == "regression" else {
        "num_labels": len(task.labels), "id2label": dict(enumerate(task.labels)),
        "label2id": {n: i for i, n in enumerate(task.labels)}}
    if not token and task.kind != "regression":
        kw["problem_type"] = "single_label_classification"
    transformers.set_seed(seed)
    try:
        if init == "random":
            return auto.from_config(AutoConfig.from_pretrained(str(model_dir), **kw))
        return auto.from_pretrained(str(model_dir), **kw)
    except ValueError as e:  # a config transformers has no head class for
        raise UserInputError(f"{model_dir}: {' '.join(str(e).split())[:200]}") from None


def _scores(task: Task, logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    if task.kind == "regression":
        pred = logits.reshape(-1)
        return {"pearson": metrics.pearson(pred, labels), "spearman": metrics.spearman(pred, labels)}
    pred = logits.argmax(-1)
    if task.kind == "classification":
        return {"accuracy": metrics.accuracy(pred, labels),
                "f1": metrics.f1(pred, labels, len(task.labels)),
                "matthews": metrics.matthews(pred, labels)}
    keep = labels != -100
    out = {"accuracy": metrics.accuracy(pred[keep], labels[keep])}
    if metrics.is_bio(task.labels):
        names = np.array(task.labels)
        gold = [list(names[l[k]]) for l, k in zip(labels, keep)]
        guess = [list(names[p[k]]) for p, k in zip(pred, keep)]
        out["f1"] = metrics.entity_f1(guess, gold)
    else:
        out["f1"] = metrics.macro_f1(pred[keep], labels[keep])
    return out


def f1_kind(task: Task) -> str:
    """What the ``f1`` column means for ``task`` (metrics.py)."""
    if task.kind == "token-classification":
        return "entity F1 over BIO chunks" if metrics.is_bio(task.labels) else \
            "macro F1 over tags (micro F1 = accuracy)"
    return "F1 of label 1" if len(task.labels) == 2 else "macro F1 over classes"


def finetune_once(model_dir: Path, task: Task, settings: Settings, seed: int, *,
                  init: Init = "pretrained", features=None) -> dict[str, float]:
    """Train and evaluate once; returns the task's metrics (``METRICS[task.kind]``)."""
    import torch
    import transformers
    from transformers import (DataCollatorForTokenClassification, DataCollatorWithPadding,
                              PrinterCallback, Trainer, TrainingArguments)

    # one line a seed is ours to print: no weight-loading bars, no Trainer log dicts
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    token = task.kind == "token-classification"
    tok = load_tokenizer(model_dir, token)
    train, eval_ = features or encode(task, tok, settings.max_seq_length)
    model = build_model(model_dir, task, seed, init)
    collator = (DataCollatorForTokenClassification if token else DataCollatorWithPadding)(tok)
    scratch = tempfile.mkdtemp(prefix="rtd_scale_finetune_")
    try:
        args = TrainingArguments(
            output_dir=scratch, seed=seed, learning_rate=settings.learning_rate,
            num_train_epochs=settings.num_train_epochs, max_steps=settings.max_steps,
            per_device_train_batch_size=settings.per_device_train_batch_size,
            per_device_eval_batch_size=settings.per_device_eval_batch_size,
            weight_decay=settings.weight_decay, warmup_steps=settings.warmup_steps,
            eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_pin_memory=torch.cuda.is_available())
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        out = trainer.predict(eval_)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
    return _scores(task, np.asarray(logits), np.asarray(out.label_ids))


def check_metric(kind: str, metric: Optional[str]) -> str:
    """``metric``, or the task kind's default when None.

    Raises:
        UserInputError: ``metric`` is not one the kind reports."""
    if metric is None:
        return METRICS[kind][0]
    if metric not in METRICS[kind]:
        raise UserInputError(f"--metric {metric}: not a {kind} metric; choose one of "
                             f"{', '.join(METRICS[kind])}")
    return metric


def summarise(values: Sequence[float]) -> dict[str, Optional[float]]:
    """{"mean", "sd"}: sd is the sample standard deviation (n − 1), None for one seed."""
    return {"mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None}


def finetune_seeds(model_dir: Path, task: Task, settings: Settings, seeds: Sequence[int], *,
                   init: Init = "pretrained", metric: Optional[str] = None,
                   print_fn: Callable[[str], None] = print) -> dict:
    """``finetune_once`` for each seed; returns the JSON-ready result (``table`` prints it)."""
    check_model_dir(model_dir)
    metric = check_metric(task.kind, metric)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    limit = position_limit(config)
    if limit is not None and settings.max_seq_length > limit:
        print_fn(f"note: --max-seq-length {settings.max_seq_length} is more than {model_dir}'s "
                 f"{limit} positions; using {limit}")
        settings = dataclasses.replace(settings, max_seq_length=limit)
    tok = load_tokenizer(model_dir, task.kind == "token-classification")
    features = encode(task, tok, settings.max_seq_length)
    per_seed = []
    for seed in seeds:
        t0 = time.time()
        scores = finetune_once(model_dir, task, settings, seed, init=init, features=features)
        per_seed.append({"seed": seed, **scores, "seconds": round(time.time() - t0, 1)})
        print_fn(f"{task.name} seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
                 + f" ({time.time() - t0:.0f} s)")
    names = METRICS[task.kind]
    return {"model": str(model_dir), "model_type": config.model_type, "init": init,
            "task": task.name, "kind": task.kind, "data": task.source,
            "train_examples": len(task.train), "eval_examples": len(task.eval),
            "num_labels": len(task.labels), "metric": metric, "f1_is": f1_kind(task)
            if "f1" in names else None, "settings": dataclasses.asdict(settings),
            "seeds": list(seeds), "per_seed": per_seed,
            "summary": {n: summarise([r[n] for r in per_seed]) for n in names}}


def _cell(s: dict) -> str:
    if s["mean"] is None or math.isnan(s["mean"]):
        return "—"
    return f"{s['mean']:.4f}" + ("" if s["sd"] is None else f" ± {s['sd']:.4f}")


def table(result: dict) -> str:
    """A Markdown table of ``finetune_seeds``' result: one row, each metric mean ± sd."""
    names = list(result["summary"])
    head = ["model", "task", "seeds"] + [f"**{n}**" if n == result["metric"] else n for n in names]
    row = [f"{Path(result['model']).name}{' (random init)' if result['init'] == 'random' else ''}",
           result["task"], str(len(result["seeds"]))] + [_cell(result["summary"][n]) for n in names]
    labels = f"{result['num_labels']} labels" if result["num_labels"] else "regression"
    note = (f"\n{result['train_examples']} training / {result['eval_examples']} evaluation "
            f"examples, {labels}; mean ± sample sd over seeds {', '.join(map(str, result['seeds']))}")
    if result.get("f1_is"):
        note += f"; f1: {result['f1_is']}"
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      "| " + " | ".join(row) + " |"]) + note + "\n"


def write_results(result: dict, output_dir: Path) -> list[Path]:
    """``results.json`` and ``results.md`` in ``output_dir``, each written atomically."""
    from rtd_scale.atomic import write_atomic

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / "results.json", output_dir / "results.md"]
    write_atomic(str(paths[0]), json.dumps(result, indent=2) + "\n")
    write_atomic(str(paths[1]), table(result))
    return paths
