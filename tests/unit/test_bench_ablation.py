"""bench/sharing_ablation.py and bench/pos_probe.py: their pure parts on fixed inputs. The whole
bench end to end at toy size is in tests/tools/test_bench_ablation.py."""
from __future__ import annotations

import json
import math

import pytest

from bench import pos_probe, sharing_ablation
from tests.helpers.env import REPO

POS_SAMPLE = REPO / "tests" / "data" / "pos_sample"


def test_coarse_tag_strips_markers_and_compounds():
    assert [pos_probe.coarse_tag(t) for t in
            ("nn-tl", "NP-HL", "fw-nn", "ppss+bem", "do*", "*", "pp$", "jj-tl-nc", ".", "--")] == \
        ["nn", "np", "nn", "ppss", "do", "*", "pp$", "jj", ".", "--"]


def test_read_and_split_brown_sample():
    files = pos_probe.read_brown(POS_SAMPLE)
    assert sorted(files) == ["ca01", "ca02", "cb01", "cc01", "cd01"]  # README.md is not read
    assert files["ca01"][2] == [("She", "pps"), ("has", "hvz"), ("written", "vbn"),
                                ("three", "cd"), ("letters", "nns"), ("to", "in"), ("the", "at"),
                                ("mayor", "nn"), (".", ".")]
    train, test = pos_probe.split_brown(files, 100, 100)
    # the fifth file in name order (cd01, 3 sentences) is the test side
    assert len(train) == 16 and len(test) == 3
    assert sorted(s[0][0] for s in test) == ["A", "The", "They"]
    b = pos_probe.baselines(train, test)
    # 24 test words, 6 of them tagged "at" (the most frequent training tag); each word's most
    # frequent training tag is right for 15: all but doctor, sick, child, tall, tree, stood, near,
    # house, evening, which training never saw (they fall back to "at", wrong for each)
    assert b == {"most_frequent_tag": 6 / 24, "word_most_frequent_tag": 15 / 24}


def test_read_brown_errors_name_the_file(tmp_path):
    with pytest.raises(pos_probe.UserInputError, match="no Brown corpus files"):
        pos_probe.read_brown(tmp_path)
    (tmp_path / "ca01").write_text("The/at dog\n")
    with pytest.raises(pos_probe.UserInputError, match=r"ca01:1: token 'dog' is not word/tag"):
        pos_probe.read_brown(tmp_path)


def test_slice_corpus_takes_every_kth_document_and_holds_out_others(tmp_path):
    corpus = tmp_path / "c.jsonl"
    docs = [f"document number {i} " + "x" * 95 for i in range(50)]  # ~118 bytes each
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stats = sharing_ablation.slice_corpus(corpus, tmp_path / "out", corpus_mb=0.0012,
                                          heldout_docs=3)
    total = sum(len(d.encode()) for d in docs)
    stride = math.ceil(total / 1200)
    assert stats["stride"] == stride == 5
    train = [json.loads(l)["text"] for l in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(l)["text"] for l in (tmp_path / "out" / "heldout.jsonl").read_text().splitlines()]
    assert train == docs[::5]
    # 10 candidates (1, 6, …, 46), every third of them: 1, 16, 31
    assert held == [docs[1], docs[16], docs[31]]
    assert not set(held) & set(train)


def test_verdict_states_both_claims():
    res = {"es": {"avg_cosine_generator": 0.1, "avg_cosine_discriminator": 0.1},
           "nes": {"avg_cosine_generator": 0.3, "avg_cosine_discriminator": 0.05},
           "gdes": {"avg_cosine_generator": 0.3, "avg_cosine_discriminator": 0.08}}
    lines = sharing_ablation.verdict(res)
    assert lines[0].endswith("0.300 vs 0.100 -> holds")
    assert lines[1].endswith("0.080 vs NES 0.050, ES 0.100 -> does NOT hold")


def test_last_validation_reads_the_last_line(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        " validation at iteration      200 | samples: 128 | mlm loss: 6.8E+00 | rtd loss: 4.1E-01 | "
        "total loss: 2.7E+01 | mlm acc: 0.06 | rtd auc: 0.7000 |\n"
        " validation at iteration      400 | samples: 128 | mlm loss: 6.5E+00 | rtd loss: 3.9E-01 | "
        "total loss: 2.6E+01 | mlm acc: 0.07 | rtd acc replaced: 0.0 | rtd auc: 0.8125 |\n")
    assert sharing_ablation.last_validation(log) == {"step": 400, "mlm": 6.5, "rtd": 0.39,
                                                     "auc": 0.8125}
    assert sharing_ablation.last_validation(tmp_path / "none.log") == {}


def test_an_unknown_encoder_kind_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="kind 'teacher': choose one of discriminator, random"):
        pos_probe.load_encoder(tmp_path, "teacher")
