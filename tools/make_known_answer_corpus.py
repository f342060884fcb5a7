#!/usr/bin/env python
"""Write a known-answer corpus: text from a seeded sparse Markov chain over made-up words
(``rtd_scale/data/known_answer.py``), and the numbers a run on it must approach.

    python tools/make_known_answer_corpus.py --output data/known_answer
    for split in train valid; do
      python tools/preprocess_data.py --input data/known_answer/$split.jsonl \
        --tokenizer-model data/known_answer/vocab.txt --output-prefix data/known_answer/$split
    done
    deepspeed rtd_scale/pretrain.py ... --tokenizer-model data/known_answer/vocab.txt \
        --data-path data/known_answer/train_text_document \
        --valid-data-path data/known_answer/valid_text_document --eval-dump-dir DUMPS

and score each dump with ``rtd_scale.training.diagnostics.score_known_answer``
(tests/e2e/test_known_answer.py does all of this).

Writes OUTPUT/train.jsonl and OUTPUT/valid.jsonl (one document per line, field "text", the two
drawn with different seeds from the same chain), OUTPUT/language.json (the chain) and
OUTPUT/vocab.txt (a WordPiece vocabulary: the five special tokens, then one token per word, so
every word is exactly one token), and prints the chain's unigram and bigram entropies as one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.data.known_answer import SPECIAL_TOKENS, MarkovLanguage  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--output", required=True, help="directory to write (created)")
    p.add_argument("--seed", type=int, default=1, help="the chain's and the text's seed")
    p.add_argument("--num-words", type=int, default=64)
    p.add_argument("--num-successors", type=int, default=3,
                   help="possible successors of every word")
    p.add_argument("--train-documents", type=int, default=4000)
    p.add_argument("--valid-documents", type=int, default=200)
    p.add_argument("--min-words", type=int, default=20, help="shortest document in words")
    p.add_argument("--max-words", type=int, default=60, help="longest document in words")
    a = p.parse_args(argv)
    for flag, v in (("--num-words", a.num_words), ("--train-documents", a.train_documents),
                    ("--valid-documents", a.valid_documents), ("--min-words", a.min_words)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    if not 1 <= a.num_successors <= a.num_words:
        p.error(f"--num-successors must be in [1, --num-words {a.num_words}], got "
                f"{a.num_successors}")
    if a.max_words < a.min_words:
        p.error(f"--max-words {a.max_words} is below --min-words {a.min_words}")
    lang = MarkovLanguage.make(a.seed, a.num_words, a.num_successors)
    os.makedirs(a.output, exist_ok=True)
    for name, n, seed in (("train", a.train_documents, 2 * a.seed + 1),
                          ("valid", a.valid_documents, 2 * a.seed + 2)):
        lines = "".join(json.dumps({"text": lang.text(d)}) + "\n"
                        for d in lang.documents(n, seed, a.min_words, a.max_words))
        write_atomic(os.path.join(a.output, f"{name}.jsonl"), lines)
    write_atomic(os.path.join(a.output, "language.json"), json.dumps(lang.to_json()))
    write_atomic(os.path.join(a.output, "vocab.txt"),
                 "".join(f"{t}\n" for t in (*SPECIAL_TOKENS, *lang.words)))
    print(json.dumps({"unigram_entropy": round(lang.unigram_entropy(), 4),
                      "bigram_entropy": round(lang.bigram_entropy(), 4),
                      "num_words": a.num_words, "num_successors": a.num_successors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
