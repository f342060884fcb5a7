"""One row of the GPU bench in a process of its own, so that the run can cut a slow
``torch.compile`` off at its deadline (``run.Bench.run_child`` starts it, from the repository
root, with the run's settings):

    python -m bench.gpu.child --row WORKLOAD:IMPL[:CORE] --out ROW.json --settings SETTINGS_JSON

It measures the row as the run would (``run.Bench.run``, no deadline check at its start) and
writes the row (``timing.Row``) to ``--out`` as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

from bench.gpu.run import Bench, Item
from bench.gpu.workloads import Settings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", required=True, help="WORKLOAD:IMPL[:CORE], as run.Item names them")
    p.add_argument("--out", required=True, help="where the row is written (JSON)")
    p.add_argument("--settings", required=True, help="workloads.Settings.to_json() of the run")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    workload, impl, *core = args.row.split(":")
    bench = Bench(Settings.from_json(args.settings), in_child=True)
    bench.log = lambda *a, **k: None
    row = bench.run(Item(workload, impl, min_left_s=0.0, core=core[0] if core else ""))
    Path(args.out).write_text(json.dumps(dataclasses.asdict(row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
