#!/usr/bin/env python
"""Write a known-answer corpus: text from a seeded sparse Markov chain over made-up words
(``verify/known_answer.py``), and the numbers a run on it must approach.

    python tools/make_known_answer_corpus.py --output data/known_answer
    for split in train valid; do
      python tools/preprocess_data.py --input data/known_answer/$split.jsonl \
        --tokenizer-model data/known_answer/vocab.txt --output-prefix data/known_answer/$split
    done
    deepspeed rtd_scale/pretrain.py ... --tokenizer-model data/known_answer/vocab.txt \
        --data-path data/known_answer/train_text_document \
        --valid-data-path data/known_answer/valid_text_document --eval-dump-dir DUMPS

and score each dump with ``verify.known_answer.score_known_answer``
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
from rtd_scale.cli_errors import (OneLineArgumentParser, UserInputError,  # noqa: E402
                                  check_writable_dir, exit_process, run_cli)
from verify.known_answer import (MAX_WORDS, SPECIAL_TOKENS, MarkovLanguage,  # noqa: E402
                                 chain_problem)


def parse_args(argv) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="tools/make_known_answer_corpus.py",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory to write (created)")
    p.add_argument("--seed", type=int, default=1, help="the chain's and the text's seed (>= 0)")
    p.add_argument("--num-words", type=int, default=64, help=f"1 … {MAX_WORDS}")
    p.add_argument("--num-successors", type=int, default=3,
                   help="possible successors of every word")
    p.add_argument("--train-documents", type=int, default=4000)
    p.add_argument("--valid-documents", type=int, default=200)
    p.add_argument("--min-words", type=int, default=20, help="shortest document in words")
    p.add_argument("--max-words", type=int, default=60, help="longest document in words")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """One line naming the flag and the fix for numbers no corpus can have."""
    for flag, v in (("--num-words", a.num_words), ("--train-documents", a.train_documents),
                    ("--valid-documents", a.valid_documents), ("--min-words", a.min_words)):
        if v < 1:
            raise UserInputError(f"{flag} must be >= 1, got {v}")
    if a.seed < 0:
        raise UserInputError(f"--seed must be >= 0, got {a.seed}")
    if a.num_words > MAX_WORDS:
        raise UserInputError(f"--num-words {a.num_words}: at most {MAX_WORDS} distinct made-up "
                             f"words (two consonant-vowel syllables) exist; pass --num-words "
                             f"<= {MAX_WORDS}")
    if not 1 <= a.num_successors <= a.num_words:
        raise UserInputError(f"--num-successors must be in [1, --num-words {a.num_words}], got "
                             f"{a.num_successors}")
    problem = chain_problem(a.num_words, a.num_successors)
    if problem:  # its field names are these flags' names
        raise UserInputError(f"--num-successors {a.num_successors} --num-words {a.num_words}: "
                             + problem.replace("num_successors", "--num-successors"))
    if a.max_words < a.min_words:
        raise UserInputError(f"--max-words {a.max_words} is below --min-words {a.min_words}; "
                             "pass --max-words >= --min-words")
    check_writable_dir(a.output, "--output")


def main(argv=None) -> None:
    a = parse_args(argv)
    check_args(a)
    lang = MarkovLanguage.make(a.seed, a.num_words, a.num_successors)
    files = {f"{name}.jsonl": "".join(json.dumps({"text": lang.text(d)}) + "\n"
                                      for d in lang.documents(n, seed, a.min_words, a.max_words))
             for name, n, seed in (("train", a.train_documents, 2 * a.seed + 1),
                                   ("valid", a.valid_documents, 2 * a.seed + 2))}
    files["language.json"] = json.dumps(lang.to_json())
    files["vocab.txt"] = "".join(f"{t}\n" for t in (*SPECIAL_TOKENS, *lang.words))
    for name, text in files.items():  # everything drawn before the first file is written
        write_atomic(os.path.join(a.output, name), text)
    # + 0.0: one word's entropies are -0.0, printed as such by json
    print(json.dumps({"unigram_entropy": round(lang.unigram_entropy(), 4) + 0.0,
                      "bigram_entropy": round(lang.bigram_entropy(), 4) + 0.0,
                      "num_words": a.num_words, "num_successors": a.num_successors}))


if __name__ == "__main__":
    exit_process(run_cli(main))
