"""It learns: the real path (tools/make_known_answer_corpus.py → tools/preprocess_data.py →
shards → the deepspeed launcher) on a language whose optimum is known
(``verify/known_answer.py``: a sparse Markov chain over 64 made-up words, 3 successors
each), scored on the run's own held-out samples, masks and replacements (``--eval-dump-dir``).

Thresholds, fixed before any run and derived from the computed optimum, not from this
implementation's results:

- L_MLM (validation, last evaluation) ≤ floor + ½ (H_unigram − floor): the generator has closed at
  least half the gap between a model that knows only the token frequencies (H_unigram, the
  unigram entropy) and the Bayes-optimal generator on the same masks (floor, forward–backward
  over the chain). Here H_unigram ≈ 3.9 nats and the floor ≈ 0.19, so the bar is ≈ 2.05.
- held-out AUC (over the words, [CLS]/[SEP] left out) ≥ ½ + ½ (oracle − ½): the discriminator
  has closed at least half the gap between chance and the chain oracle (a discriminator that
  knows the language's true probabilities, not the generator's, scoring each token by
  −log p(c_t | c_{t−1}, c_{t+1}), +inf where the chain cannot put c_t between its neighbours)
  on the same replacements. Here the oracle's AUC is 0.89–0.94, so the bar is 0.70–0.72. The
  oracle is a reference, not a ceiling: a trained discriminator also learns
  the generator's habits and can pass it.

The negative controls must fail the AUC bar, which is what makes the tests able to fail:
``--rtd-lambda 0`` (the discriminator gets no gradient) and ``rtd.shuffle_labels`` (each
sample's labels permuted, so the discriminator learns the replaced fraction but not where).
Both keep training the generator, so their L_MLM still passes: the AUC, not the MLM loss, is
what tells an RTD step that learns from one that does not. (An untrained discriminator over
trained embeddings is not at chance: λ = 0 gave AUC 0.43 at step 200, so the controls assert
only that the bar fails.)

The model is small enough for CPU (discriminator and generator 2 × 64, DeBERTaV3's layout:
disentangled attention, post-LayerNorm) with the knobs that take it off the plateau fastest on
this language: mask rate 0.25, dropout 0, lr 3e-3 held after warm-up, every masked slot [MASK]
(so the floor is exact). The constant rate is for margin, not for the bars: under a linear decay
to 0 at step 500 the last 100 steps barely move, and ES, whose one table also takes the
λ-weighted RTD gradient (arXiv 2111.09543 §3.2's tug-of-war), ended at L_MLM 2.21 against its
bar of 2.05 on one CPU and 1.29 on another (float reassociation in the steep part of learning).
With the rate held, seeds 3 and 4 gave ES 1.38 and 1.69, GDES 0.46 and 0.47, and word AUCs of
0.86–0.93 against bars of 0.69–0.73.

The modern block (``model/modern.py``: RoPE, GeGLU, bias-free pre-norm) runs at the same size
and knobs, GDES, with GeGLU at 1.5 × width (modernbert-tiny's rule) and a 16-token window in its
second layer (the first is global), so local attention sees a quarter of each 64-token sample; it
passes the same bars with the same 500 steps: seeds 3 and 4 gave L_MLM 0.556 and 0.559 against
bars of 2.05, AUC 0.835 and 0.804 against 0.723 and 0.730.

The masked-LM control (``rtd.objective=mlm``: the discriminator's shape, L_MLM alone, its head
tied to its table) runs the same knobs for 200 steps and must bring its held-out L_MLM to at
most half the unigram entropy (≈ 1.95 nats, under the generators' bar of ≈ 2.05); its negative
control is the same run on a shuffled corpus (every split's words permuted over the whole split,
document lengths kept), where no context predicts a word, so the best a model can do is the
unigram entropy and the same bar must fail. (It measured 1.86 at step 100; at step 200, seeds 3
and 4 gave 0.696 and 0.633.)

The TP=2 and PP=2 runs are the GDES run's configuration at another layout, for its first 100
steps: the same run at step 1 and within 1% at step 100. That is where they stop: past step 100
float reassociation, amplified by the steep part of learning, moves them apart (up to 7% in
L_MLM over steps 200–500, final AUCs 0.04–0.06 apart), so 400 more steps at two ranks each could
only hold them to a loose band. Exactness per step at TP 2 and PP 2 is pinned by
tests/multiproc and the launcher parity tests (tests/e2e/test_tensor_parallel_launcher.py,
test_pipeline_parallel_launcher.py); learning to the bars, by the one-rank runs here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtd_scale.data.tokenizer import Tokenizer
from tests.helpers.env import REPO
from tests.helpers.launcher import NO_DROPOUT, launch, launch_together, scalars
from verify.known_answer import MarkovLanguage, score_known_answer, word_ids_of_tokens

ITERS = 500
NES_ITERS = 700  # RUNS: its discriminator table starts from scratch
MLM_ITERS = 200  # the masked-LM control and its shuffled corpus
EARLY = 100  # the TP 2 and PP 2 runs' steps
MLM_GAP_CLOSED = 0.5  # of (H_unigram − floor)
AUC_GAP_CLOSED = 0.5  # of (oracle AUC − 0.5)
MODEL = [f"--set=model.{m}.{f}={v}" for m in ("generator", "discriminator")
         for f, v in (("num_layers", 2), ("hidden_size", 64), ("ffn_hidden_size", 256))]
MODEL += ["--set=model.embedding_size=64"]
# the modern block at the same size: GeGLU at 1.5 × width (modernbert-tiny's rule, ModernBERT-base's
# 1152 / 768), a 16-token window (a quarter of the 64-token samples) in layer 2, layer 1 global
MODERN = ("--preset", "modernbert-tiny", "--window-size", "16",
          *(f"--set=model.{m}.ffn_hidden_size=96" for m in ("generator", "discriminator")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("known_answer")
    tool = lambda *a: subprocess.run([sys.executable, *map(str, a)], cwd=REPO, check=True,  # noqa: E731
                                     capture_output=True, text=True)
    summary = json.loads(tool(REPO / "tools" / "make_known_answer_corpus.py", "--output", out,
                              "--seed", 1).stdout)
    for split in ("train", "valid"):
        tool(REPO / "tools" / "preprocess_data.py", "--input", out / f"{split}.jsonl",
             "--tokenizer-model", out / "vocab.txt", "--output-prefix", out / split)
    lang = MarkovLanguage.load(str(out / "language.json"))
    assert summary["unigram_entropy"] == pytest.approx(3.9055, abs=1e-4)  # seed 1's chain
    token_to_word = word_ids_of_tokens(lang, Tokenizer(str(out / "vocab.txt")).encode)
    assert len(token_to_word) == 64  # every word is one token of vocab.txt
    return out, lang, token_to_word


# every run of the module: its flags, ranks and steps (a run's flags come last, so "modern"'s
# --preset replaces debertav3-tiny). The one-rank runs start together in these groups
# (launch_together), one thread each. NES runs 700 steps: at 500 its AUC sat on the bar (0.731
# against 0.719 at two threads, 0.669 against 0.718 at one, float reassociation alone), while at
# 700 seeds 3 and 4 reached 0.821 and 0.865 against 0.716 and 0.729 (at 1000, 0.891 and 0.947).
# Its discriminator table starts from scratch, where ES and GDES start from the generator's.
RUNS = {"gdes": (("--sharing", "gdes"), 1, ITERS), "es": (("--sharing", "es"), 1, ITERS),
        "nes": (("--sharing", "nes"), 1, NES_ITERS), "lambda0": (("--rtd-lambda", "0"), 1, ITERS),
        "shuffled": (("--set=rtd.shuffle_labels=true",), 1, ITERS),
        "tp2": (("--sharing", "gdes", "--tensor-model-parallel-size", "2"), 2, EARLY),
        "pp2": (("--sharing", "gdes", "--pipeline-model-parallel-size", "2"), 2, EARLY),
        "modern": (MODERN, 1, ITERS),
        "mlm": (("--set=rtd.objective=mlm",), 1, MLM_ITERS),
        "mlm_shuffled_corpus": (("--set=rtd.objective=mlm",), 1, MLM_ITERS)}
PAIRS = (("gdes", "es"), ("nes", "lambda0", "shuffled", "modern"), ("mlm", "mlm_shuffled_corpus"))
MLM_BAR_OF_UNIGRAM = 0.5  # the masked-LM control's bar: L_MLM <= this × H_unigram


def shuffled_corpus(out: Path) -> Path:
    """``out``'s train and valid text with each split's words permuted over the whole split
    (document lengths kept; seeded), preprocessed with the same vocabulary, under
    ``out/shuffled``: the unigram distribution stays, the chain's context is gone."""
    import numpy as np

    dest = out / "shuffled"
    dest.mkdir(exist_ok=True)
    rng = np.random.default_rng(7)
    for split in ("train", "valid"):
        docs = [json.loads(line)["text"].split()
                for line in (out / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        words = [w for d in docs for w in d]
        words = [words[i] for i in rng.permutation(len(words))]
        lines, at = [], 0
        for d in docs:
            lines.append(json.dumps({"text": " ".join(words[at:at + len(d)])}))
            at += len(d)
        (dest / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                        str(dest / f"{split}.jsonl"), "--tokenizer-model", str(out / "vocab.txt"),
                        "--output-prefix", str(dest / split)], cwd=REPO, check=True,
                       capture_output=True, text=True)
    return dest


class Runs:
    """Each named run of RUNS once per module (the TP/PP test compares with the GDES run)."""

    def __init__(self, corpus, root: Path):
        self.corpus, self.root, self.done = corpus, root, {}

    def get(self, name: str) -> dict:
        if name not in self.done:
            pair = next((p for p in PAIRS if name in p), (name,))
            todo = [n for n in pair if n not in self.done]
            if RUNS[name][1] == 1:
                results = launch_together([self._args(n) for n in todo], timeout=1800)
            else:
                results = [launch(self._args(name), ranks=RUNS[name][1], timeout=900)]
            for n, r in zip(todo, results):
                self.done[n] = self._score(n, r)
        return self.done[name]

    def _args(self, name) -> list[str]:
        out, iters = self.corpus[0], RUNS[name][2]
        text = shuffled_corpus(out) if name == "mlm_shuffled_corpus" else out
        save = self.root / name
        return ["--ds_config", "ds_configs/zero1.json", "--preset", "debertav3-tiny",
                "--tokenizer-model", str(out / "vocab.txt"),
                "--data-path", str(text / "train_text_document"),
                "--valid-data-path", str(text / "valid_text_document"),
                "--save", str(save),
                *([] if name.startswith("mlm") else ["--eval-dump-dir", str(save / "dumps")]),
                "--train-iters", str(iters), "--seq-length", "64",
                "--micro-batch-size", "32", "--global-batch-size", "32",
                "--lr", "3e-3", "--lr-warmup-iters", "20", "--lr-decay-style", "constant",
                "--mask-prob", "0.25",
                "--set=rtd.mask_token_prob=1.0", "--set=rtd.random_token_prob=0.0",
                "--log-interval", "100", "--eval-interval", str(iters), "--eval-iters", "2",
                "--save-interval", str(iters), "--seed", "3", *MODEL, *NO_DROPOUT,
                *RUNS[name][0], *(["--export-hf", str(save / "hf")] if name == "mlm" else [])]

    def _score(self, name, r) -> dict:
        _, lang, token_to_word = self.corpus
        save, iters = self.root / name, RUNS[name][2]
        assert r.returncode == 0, f"{name} exited {r.returncode}:\n" + (r.stdout + r.stderr)[-6000:]
        if name.startswith("mlm"):  # no discriminator: no AUC and no dump to score
            tb = scalars(str(save / "tensorboard"))
            got = {"mlm_loss": tb["valid/loss/mlm"][iters],
                   "unigram_entropy": lang.unigram_entropy(),
                   "mlm_bar": MLM_BAR_OF_UNIGRAM * lang.unigram_entropy()}
            print(f"[known answer] {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
            got["tags"] = set(tb)
            got["export"] = save / "hf"
            return got
        dump = torch.load(save / "dumps" / f"valid_iter{iters}_dp0.pt")
        got = score_known_answer(lang, token_to_word, dump)
        tb = scalars(str(save / "tensorboard"))
        got["mlm_loss"] = tb["valid/loss/mlm"][iters]
        got["mlm_bar"] = got["masked_floor"] + MLM_GAP_CLOSED * (lang.unigram_entropy()
                                                                 - got["masked_floor"])
        got["auc_bar"] = 0.5 + AUC_GAP_CLOSED * (got["oracle_auc"] - 0.5)
        print(f"[known answer] {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
        got["train"] = {tag: tb[tag] for tag in ("loss/mlm", "loss/rtd")}
        return got


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    return Runs(corpus, tmp_path_factory.mktemp("known_answer_runs"))


# two pytest-xdist groups (tools/run_tests.sh): the GDES run and what is compared with it, and
# the NES run with the controls, which start together (PAIRS); each worker runs only its own
GDES_GROUP = pytest.mark.xdist_group("known-answer-gdes")
NES_GROUP = pytest.mark.xdist_group("known-answer-nes")


@pytest.mark.parametrize("sharing", [pytest.param("gdes", marks=GDES_GROUP),
                                     pytest.param("es", marks=GDES_GROUP),
                                     pytest.param("nes", marks=NES_GROUP)])
def test_each_sharing_mode_learns_the_language(runs, sharing):
    got = runs.get(sharing)
    assert got["mlm_loss"] <= got["mlm_bar"], got
    assert got["auc"] >= got["auc_bar"], got


@GDES_GROUP
@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_tp2_and_pp2_learn_the_same(runs, name):
    ref = runs.get("gdes")
    got = runs.get(name)
    # the same run: equal at step 1, within float reassociation at step 100 (with the rate held
    # at 3e-3 after warm-up, L_MLM measured 3.1e-3 apart at TP 2 and 1.4e-3 at PP 2; 3e-5 under
    # the earlier linear decay)
    for tag in ("loss/mlm", "loss/rtd"):
        assert got["train"][tag][1] == pytest.approx(ref["train"][tag][1], rel=1e-5), tag
        assert got["train"][tag][EARLY] == pytest.approx(ref["train"][tag][EARLY], rel=1e-2), tag


@NES_GROUP
def test_the_modern_block_learns_the_language(runs):
    got = runs.get("modern")
    assert got["mlm_loss"] <= got["mlm_bar"], got
    assert got["auc"] >= got["auc_bar"], got


@NES_GROUP
@pytest.mark.parametrize("name", ["lambda0", "shuffled"])
def test_negative_controls_fail_the_auc_bar(runs, name):
    got = runs.get(name)
    assert got["auc"] < got["auc_bar"], got  # the bar can fail
    assert got["mlm_loss"] <= got["mlm_bar"], got  # its generator still learns


MLM_GROUP = pytest.mark.xdist_group("known-answer-mlm")


@MLM_GROUP
def test_the_masked_lm_control_learns_the_language(runs):
    got = runs.get("mlm")
    assert got["mlm_loss"] <= got["mlm_bar"], got
    # the masked LM alone: its logs hold L_MLM and no RTD scalar
    assert "valid/loss/mlm" in got["tags"] and "loss/mlm" in got["tags"]
    assert not [t for t in got["tags"] if "rtd" in t], got["tags"]
    # --export-hf: the one model as DeBERTa's masked-LM class, its head included
    config = json.loads((got["export"] / "config.json").read_text())
    assert config["architectures"] == ["DebertaV2ForMaskedLM"]
    assert not (got["export"] / "generator").exists()


@MLM_GROUP
def test_the_masked_lm_control_fails_on_a_shuffled_corpus(runs):
    got = runs.get("mlm_shuffled_corpus")
    assert got["mlm_loss"] > got["mlm_bar"], got  # the bar can fail
    # without context the best is the unigram entropy (the model cannot go far below it)
    assert got["mlm_loss"] >= got["unigram_entropy"] - 0.25, got
