"""tools/finetune.py: fine-tuning an export with transformers' Trainer on tasks whose answer is
known. The export is a tiny ELECTRA-layout model (2 layers × 32, random initial weights: the
tasks are learnable from scratch) written by rtd_scale's own exporter with the tests' SentencePiece
tokenizer. The data are sentences of animal and colour words: which pool a sentence's words come
from is its class (separable), the share of animal words its score (regression), and each word's
pool its BIO tag (token classification)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.finetune import metrics
from rtd_scale.finetune.tasks import read_tagged
from tests.helpers.env import REPO, standalone_env
from tests.helpers.tools import load_tool

ANIMALS = ["cat", "dog", "horse", "bird", "fish", "cow", "sheep", "goat"]
COLOURS = ["red", "blue", "green", "black", "white", "yellow", "brown", "pink"]
FILLERS = ["the", "a", "and", "of"]
# a few Trainer steps suffice for the tiny model on these tasks (measured: accuracy 1.0 after 40)
TRAIN = ["--learning-rate", "3e-3", "--max-steps", "40", "--per-device-train-batch-size", "16",
         "--max-seq-length", "32"]


@pytest.fixture(scope="module")
def export(single_process_group, wiki_shards, tmp_path_factory):
    """A tools/export_hf.py-layout directory (ElectraForPreTraining + generator/ + tokenizer)."""
    from rtd_scale.config import Sharing
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.hf.export import write_export
    from tests.helpers.hf_models import POST, build_model, canonical_state, tiny_config

    tok = Tokenizer(wiki_shards[0])
    cfg = tiny_config(POST, Sharing.GDES, False, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    out = tmp_path_factory.mktemp("finetune") / "export"
    write_export(canonical_state(model, single_process_group), cfg.model, str(out),
                 pad_id=tok.pad_id, cls_id=tok.cls_id, sep_id=tok.sep_id,
                 tokenizer_model=wiki_shards[0], note=lambda m: None)
    return out


def _sentence(rng, pool, n=6):
    return " ".join(rng.choice(pool) for _ in range(n))


def _write_tsv(path, header, rows):
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))


def _pools(n, seed):
    """n (sentence, class) rows, the classes alternating."""
    rng = random.Random(seed)
    return [(_sentence(rng, ANIMALS), "animal") if i % 2 else (_sentence(rng, COLOURS), "colour")
            for i in range(n)]


def _finetune(argv, out_dir, capsys):
    """tools/finetune.py's main in this process, writing to ``out_dir``; (its result JSON, what
    it printed)."""
    load_tool("finetune").main([*argv, "--output-dir", str(out_dir)])
    return json.loads((out_dir / "results.json").read_text()), capsys.readouterr().out


def test_a_separable_task_is_learned_and_shuffled_labels_stay_at_chance(export, tmp_path,
                                                                         capsys):
    glue = tmp_path / "glue"
    glue.mkdir()
    train = _pools(64, seed=0)
    _write_tsv(glue / "train.tsv", ["sentence", "label"], train)
    _write_tsv(glue / "dev.tsv", ["sentence", "label"], _pools(128, seed=1))
    # the real command, as a user types it (GLUE's directory layout, two seeds)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "finetune.py"), str(export),
                           "--task", "classification", "--data-dir", str(glue), "--seeds", "0",
                           "1", "--output-dir", str(tmp_path / "out"), *TRAIN],
                          capture_output=True, text=True, timeout=600, env=standalone_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["seed"] for r in res["per_seed"]] == [0, 1]
    assert all(r["accuracy"] >= 0.95 for r in res["per_seed"]), res["per_seed"]
    assert res["summary"]["accuracy"]["mean"] >= 0.95 and res["metric"] == "accuracy"
    assert res["train_examples"] == 64 and res["eval_examples"] == 128
    assert res["num_labels"] == 2 and res["f1_is"] == "F1 of label 1"
    table = (tmp_path / "out" / "results.md").read_text()
    assert table in proc.stdout and "| export | classification | 2 |" in table
    # negative control: the same sentences, labels drawn independently of the pool (each pool
    # gets each label for exactly half of its sentences) — nothing that carries over to new
    # sentences, so the held-out accuracy stays near the 0.5 of a balanced set (128: sd 0.044)
    rng = random.Random(2)
    shuffled = {}
    for pool in ("animal", "colour"):
        labels = ["animal", "colour"] * 16
        rng.shuffle(labels)
        shuffled[pool] = iter(labels)
    _write_tsv(glue / "train.tsv", ["sentence", "label"],
               [(s, next(shuffled[pool])) for s, pool in train])
    res, _ = _finetune([str(export), "--task", "classification", "--data_dir", str(glue),
                        "--seeds", "0", "--learning_rate", "3e-3", *TRAIN[2:]],
                       tmp_path / "shuffled", capsys)
    assert 0.35 <= res["per_seed"][0]["accuracy"] <= 0.65, res["per_seed"]


def test_regression_reaches_a_high_pearson(export, tmp_path, capsys):
    """The score is the share of animal words in a sentence (0, 1/6, …, 1), from JSON lines
    with a sentence pair (the second text a filler) and a named label column."""
    def rows(n, seed):
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            k = rng.randint(0, 6)
            words = [rng.choice(ANIMALS) for _ in range(k)] + [rng.choice(COLOURS) for _ in range(6 - k)]
            rng.shuffle(words)
            out.append({"first": " ".join(words), "second": "the end", "score": k / 6})
        return out

    for name, seed in (("train", 0), ("dev", 1)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(128, seed)))
    res, _ = _finetune([str(export), "--task", "regression", "--train-file",
                        str(tmp_path / "train.jsonl"), "--validation-file", str(tmp_path / "dev.jsonl"),
                        "--text-columns", "first", "second", "--label-column", "score",
                        "--seeds", "0", *TRAIN], tmp_path / "out", capsys)
    assert res["metric"] == "pearson" and res["num_labels"] == 0
    assert res["per_seed"][0]["pearson"] >= 0.9, res["per_seed"]
    assert res["per_seed"][0]["spearman"] >= 0.9, res["per_seed"]


def test_token_classification_round_trip(export, tmp_path, capsys):
    """The same sentences written as CoNLL and as word/tag read back equal; trained on the CoNLL
    files, each word's tag (its pool, as a BIO entity) is learned, scored by entity F1."""
    tag_of = {**{w: "B-ANI" for w in ANIMALS}, **{w: "B-COL" for w in COLOURS},
              **{w: "O" for w in FILLERS}}

    def sents(n, seed):
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            words = [rng.choice(ANIMALS + COLOURS + FILLERS) for _ in range(rng.randint(3, 8))]
            out.append((words, [tag_of[w] for w in words]))
        return out

    for name, seed in (("train", 0), ("dev", 1)):
        data = sents(96, seed)
        conll = tmp_path / f"{name}.conll"
        conll.write_text("-DOCSTART- O\n\n" + "\n".join(
            "".join(f"{w} NN {t}\n" for w, t in zip(ws, ts)) for ws, ts in data))
        word_tag = tmp_path / f"{name}.txt"
        word_tag.write_text("".join(" ".join(f"{w}/{t}" for w, t in zip(ws, ts)) + "\n"
                                    for ws, ts in data))
        assert read_tagged(conll) == read_tagged(word_tag) == data
    res, printed = _finetune([str(export), "--task", "token-classification", "--train-file",
                              str(tmp_path / "train.conll"), "--validation-file",
                              str(tmp_path / "dev.conll"), "--seeds", "0", *TRAIN,
                              "--max-steps", "150"], tmp_path / "out", capsys)
    assert res["num_labels"] == 3 and res["f1_is"] == "entity F1 over BIO chunks"
    assert res["per_seed"][0]["accuracy"] >= 0.95 and res["per_seed"][0]["f1"] >= 0.9, res
    assert "f1: entity F1 over BIO chunks" in printed


def test_metrics_known_answers():
    gold, pred = [0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 2, 2, 0]
    assert metrics.accuracy(pred, gold) == 5 / 8
    # per class (tp, fp, fn): 0 (2, 1, 1) F1 2/3; 1 (2, 1, 1) 2/3; 2 (1, 1, 1) 1/2
    assert metrics.macro_f1(pred, gold) == pytest.approx((2 / 3 + 2 / 3 + 1 / 2) / 3)
    # Gorodkin's R_K from the confusion matrix: c = 5, s = 8, t = (3, 3, 2), p = (3, 3, 2)
    assert metrics.matthews(pred, gold) == pytest.approx((5 * 8 - 22) / (64 - 22))
    # two classes: the F1 of label 1, and Matthews = the phi coefficient
    assert metrics.f1([1, 1, 0, 0], [1, 0, 1, 0], 2) == 0.5
    assert metrics.matthews([1, 1, 0, 0], [1, 0, 1, 0]) == 0.0
    assert metrics.matthews([1, 1, 1, 1], [1, 0, 1, 0]) == 0.0  # a constant guess
    assert metrics.pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(0.9933992677987828)
    # ranks with ties: (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    assert metrics.spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    # BIO chunks: an I- that does not continue its type starts a chunk (conlleval, seqeval)
    assert metrics.chunks(["B-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-PER"]) == {
        (0, 2, "PER"), (3, 4, "LOC"), (4, 5, "LOC"), (5, 6, "PER")}
    # gold 3 chunks, guessed 3, 2 right: P = R = F1 = 2/3
    assert metrics.entity_f1([["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG"]],
                             [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG"]]) == pytest.approx(2 / 3)
    assert metrics.is_bio(["O", "B-X", "I-X"]) and not metrics.is_bio(["nn", "vb"])
    assert not metrics.is_bio(["O"])


def _bad_inputs(tmp_path, export):
    """(argv, the one line expected on stderr) for each kind of bad input."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "empty").mkdir()
    (d / "run").mkdir()  # a pretraining run's own config.json: rtd_scale's sections, no model_type
    (d / "run" / "config.json").write_text('{"preset": "tiny", "model": {}, "train": {}}')
    _write_tsv(d / "nolabel.tsv", ["sentence", "y"], [("a b", 1)])
    _write_tsv(d / "words.tsv", ["sentence", "label"], [("a b", "pos")])
    (d / "tags.txt").write_text("The/at dog/nn\nThe/at dog\n")
    ok = str(d / "words.tsv")
    return [
        ([str(d / "empty"), "--task", "brown-pos"],
         f"error: EXPORT {d / 'empty'}: no config.json there; pass a tools/export_hf.py output "
         "(its top directory, or generator/) or a Hugging Face encoder directory"),
        ([str(d / "run"), "--task", "brown-pos"],
         f"error: EXPORT {d / 'run'}: a pretraining run directory, not an export; export it "
         f"first: python tools/export_hf.py --load {d / 'run'} --output hf/run, then pass hf/run"),
        ([str(export), "--task", "brown-pos", "--brown-dir", str(d / "nothing")],
         f"error: --brown-dir {d / 'nothing'}: no such directory; pass the directory of the Brown "
         "corpus files (ca01 … cr09), or leave it out to fetch them"),
        ([str(export), "--task", "brown-pos", "--seeds", "0", "-1"],
         "error: argument --seeds: must be >= 0, got -1; finetune.py --help lists every flag"),
        ([str(export), "--task", "brown-pos", "--seeds", "4294967296"],
         "error: argument --seeds: must be at most 2**32 - 1 = 4294967295, got 4294967296; "
         "finetune.py --help lists every flag"),
        ([str(export), "--task", "brown-pos", "--warmup-steps", "-5"],
         "error: argument --warmup-steps: must be >= 0, got -5; finetune.py --help lists every "
         "flag"),
        ([str(export), "--task", "sst2"],
         "error: argument --task: invalid choice: 'sst2' (choose from 'classification', "
         "'regression', 'token-classification', 'brown-pos', 'brown-genre'); finetune.py --help "
         "lists every flag"),
        ([str(export), "--task", "classification", "--train-file", str(d / "nolabel.tsv"),
          "--validation-file", ok],
         f"error: {d / 'nolabel.tsv'}: no label column 'label' (columns: sentence, y); pass "
         "--label-column"),
        ([str(export), "--task", "regression", "--train-file", ok, "--validation-file", ok],
         f"error: {d / 'words.tsv'}: row 1: label 'pos' is not a number (--task regression); use "
         "--task classification for classes"),
        ([str(export), "--task", "token-classification", "--train-file", str(d / "tags.txt"),
          "--validation-file", str(d / "tags.txt")],
         f"error: {d / 'tags.txt'}:2: token 'dog' is not word/tag (a word/tag file: one sentence "
         "a line)"),
        ([str(export), "--task", "classification", "--train-file", ok],
         "error: --train-file and --validation-file go together; finetune.py --help lists every "
         "flag"),
        ([str(export), "--task", "classification", "--train-file", ok, "--validation-file", ok,
          "--metric", "pearson"],
         "error: --metric pearson: not a classification metric; choose one of accuracy, f1, "
         "matthews"),
        # offline (datasets' offline switch: the machine has no network, and without the switch
        # datasets retries for ~30 s before the same line)
        ([str(export), "--task", "classification", "--dataset-name", "nyu-mll/glue",
          "--dataset-config-name", "sst2"],
         "error: --dataset-name nyu-mll/glue: cannot load it (ConnectionError: Couldn't reach "
         "'nyu-mll/glue' on the Hub (OfflineModeIsEnabled)); where the machine is offline, pass "
         "--train-file and --validation-file instead"),
    ]


def test_bad_input_is_one_line_and_exit_2(export, tmp_path):
    env = {**standalone_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for argv, line in _bad_inputs(tmp_path, export):
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "finetune.py"), *argv],
                              capture_output=True, text=True, timeout=120, env=env)
        assert (proc.returncode, proc.stderr.strip()) == (2, line), (argv, proc.stderr)
        assert proc.stdout == ""


def test_brown_tasks_split_by_file():
    """brown-genre's passages: each file's genre, whole files held out (every fifth by name)."""
    from rtd_scale.finetune import brown, tasks

    sample = REPO / "tests" / "data" / "pos_sample"
    genre = tasks.brown_genre_task(sample, None, None, passage_words=10)
    # cd01 (religion) is the fifth file: its 3 sentences (24 words) make passages of ≥ 10
    # words: 7 + 9 → 16, then the last 8
    assert [label for _, label in genre.eval] == ["religion", "religion"]
    assert {label for _, label in genre.train} == {"news", "editorial", "reviews"}
    assert genre.labels == ["editorial", "news", "religion", "reviews"]
    pos = tasks.brown_pos_task(sample, None, None)
    assert len(pos.train) == 16 and len(pos.eval) == 3 and "at" in pos.labels
    assert brown.held_out(["ca01", "ca02", "cb01", "cc01", "cd01", "ce01"]) == {"cd01"}
    with pytest.raises(UserInputError, match="no Brown corpus files"):
        tasks.brown_pos_task(REPO / "tests", None, None)
