"""What the benches that drive the product's own commands share (no torch import, so that a
bench which only launches them starts fast): a timestamped log line, the child's environment, a
command run from the repository root with its output appended to a log, and a corpus tokenized
by ``tools/train_tokenizer.py`` and ``tools/preprocess_data.py``.

A bench script is run as ``python bench/X.py`` from the repository root; it puts the root on
``sys.path`` and imports this module as ``bench.runs``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]

Log = Callable[[str], None]


def logger(name: str) -> Log:
    """``log(msg)``: ``[name HH:MM:SS] msg`` on stdout, flushed."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    return log


def child_env() -> dict[str, str]:
    """This environment without launcher variables (the child is its own job) and with the
    library warnings the main job also hides."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning:megatron,ignore::FutureWarning")
    # this checkout's rtd_scale, whatever an editable install points at
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_logged(cmd: list[str], log_path: Path, *, log: Log,
               env: Optional[dict[str, str]] = None) -> None:
    """Run ``cmd`` from the repository root, its stdout and stderr appended to ``log_path``
    after a ``$ cmd`` line; ``log`` gets the command line.

    Raises:
        SystemExit: the command failed (its status and the log's tail)."""
    log(" ".join(cmd))
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2500:]
        raise SystemExit(f"command failed ({proc.returncode}), see {log_path}:\n{tail}")


def tokenized(corpus: Path, data: Path, name: str, vocab_size: int, *, log_path: Path,
              log: Log) -> tuple[str, str]:
    """(tokenizer model, dataset prefix) of the ``text`` field of ``corpus`` (.jsonl) under
    ``data``: ``spm.model`` by ``tools/train_tokenizer.py`` (``vocab_size`` pieces, character
    coverage 1.0) and the shards ``NAME_text_document`` by ``tools/preprocess_data.py`` (2
    workers), each made only when missing (the shards' manifest is written last)."""
    data.mkdir(parents=True, exist_ok=True)
    spm, prefix = data / "spm.model", data / f"{name}_text_document"
    if not spm.exists():
        run_logged([sys.executable, "tools/train_tokenizer.py", "--input", str(corpus),
                    "--vocab-size", str(vocab_size), "--character-coverage", "1.0",
                    "--output-prefix", str(data / "spm")], log_path, log=log)
    if not Path(f"{prefix}.manifest.json").exists():
        run_logged([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                    "--json-keys", "text", "--tokenizer-model", str(spm),
                    "--output-prefix", str(data / name), "--workers", "2", "--overwrite"],
                   log_path, log=log)
    return str(spm), str(prefix)


def sample_data(work: Path, vocab_size: int, log: Log) -> tuple[str, str]:
    """The main job's sample corpus (``tools/build_sample_corpus.py``), tokenized at
    ``vocab_size``; (tokenizer, dataset prefix). The 8,000-piece set is README command 1's own
    ``data/sample`` when it exists, another size goes under ``work/data``."""
    main = REPO / "data" / "sample"
    corpus = main / "corpus.jsonl"
    logs = work / "logs" / "data.log"
    if not corpus.exists():
        run_logged([sys.executable, "tools/build_sample_corpus.py", "--output", str(corpus)], logs,
                   log=log)
    data = main if vocab_size == 8000 else work / "data" / f"vocab{vocab_size}"
    return tokenized(corpus, data, "wiki", vocab_size, log_path=logs, log=log)
