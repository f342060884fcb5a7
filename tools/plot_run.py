#!/usr/bin/env python
"""Draw the learning curves of one or more runs from their TensorBoard events, as the end-of-run
summary draws ``curves.png`` (tools/curves.py: L_MLM with ln V, L_RTD with the
replaced-fraction prior, held-out AUC with its chance band, Table-1 embedding cosines, learning
rate, tokens/s; one colour per run).

    python tools/plot_run.py runs/tiny                       # → runs/tiny/curves.png
    python tools/plot_run.py runs/a runs/b --output ab.png   # two runs on one figure

RUN_DIR is a ``--save`` directory (its tensorboard/ folder and config.json are read) or a
TensorBoard folder itself. A run still training can be drawn: its events so far are read.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import curves  # noqa: E402  (tools/curves.py: a script's own folder is first on sys.path)
from rtd_scale.cli_errors import (OneLineArgumentParser, UserInputError,  # noqa: E402
                                  exit_process, run_cli)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--output", default=None,
                   help="PNG to write (default: RUN_DIR/curves.png with one RUN_DIR; required "
                        "with several)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.output is None and len(args.run_dirs) > 1:
        raise UserInputError(f"{len(args.run_dirs)} run directories on one figure: name the "
                             "picture with --output FILE.png")
    out = args.output or os.path.join(args.run_dirs[0], "curves.png")
    runs = [curves.load_run(d) for d in args.run_dirs]
    curves.save_figure(curves.build_figure(runs), out)
    print(f"wrote {out} ({', '.join(r.name for r in runs)})")


if __name__ == "__main__":
    exit_process(run_cli(main))
