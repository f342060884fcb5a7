#!/usr/bin/env python
"""Append missing special pieces to a SentencePiece model, keeping every existing id.

    python tools/add_special_pieces.py --input spm.model --output spm_rtd.model

rtd_scale needs a pad and a mask piece (and cls / sep). A model trained with SentencePiece's
defaults (<unk> 0, <s> 1, </s> 2) has no pad or mask piece, so --tokenizer-model refuses it; this
appends the missing ones as control pieces (never produced by encoding text), named in the
model's style (<pad> <mask> next to <unk>, else [PAD] [MASK]), at ids piece count, piece count + 1.
Text encodes to the same ids as before. --pieces names the pieces to append instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import OneLineArgumentParser, exit_process, run_cli  # noqa: E402
from rtd_scale.data.tokenizer_training import add_special_pieces  # noqa: E402


def main(argv: Sequence[str] | None = None) -> None:
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="SentencePiece .model to extend")
    p.add_argument("--output", required=True, help="where to write the extended .model")
    p.add_argument("--pieces", nargs="+", metavar="PIECE",
                   help="pieces to append (default: the missing pad / cls / sep / mask pieces)")
    args = p.parse_args(argv)
    added = add_special_pieces(args.input, args.output, args.pieces)
    print(f"appended {', '.join(f'{piece} = {i}' for piece, i in added)} -> {args.output}")


if __name__ == "__main__":
    exit_process(run_cli(main))
