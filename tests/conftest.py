"""Shared fixtures: a one-process gloo group with megatron-core's parallel state, paths."""
from __future__ import annotations

import os

# Before anything imports rtd_scale: every process of the suite (the test workers, the ranks and
# tools they start, which inherit it) defers megatron-core's and DeepSpeed's import-time
# torch.compile calls (rtd_scale/_lazy_fusions.py); no test calls a fused kernel on CPU.
os.environ.setdefault("RTD_SCALE_LAZY_FUSIONS", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

from tests.helpers.env import CASES, TEST_DATA, free_port  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

# One intra-op thread in every process of the suite (the test workers, the ranks and tools they
# start), as torchrun sets for several processes a node: two pytest-xdist workers already share
# the cores, and torch's default, a thread per core in each process, makes the processes'
# OpenMP threads spin against each other. Two one-rank 40-step runs of the tiny preset side by
# side on 2 cores took 66 s and 124 CPU-s so, 23 s and 38 CPU-s at one thread each. A value the
# caller set is kept (an empty one counts as unset, as rtd_scale/launch_env.py reads it); the
# known-answer runs set theirs (tests/helpers/launcher.launch_together).
if not os.environ.get("OMP_NUM_THREADS", "").strip():
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402 (after OMP_NUM_THREADS, which it reads; it imports no Triton)

# Without a CUDA device every process of the suite runs Triton kernels in Triton's interpreter:
# flashdeberta's, which tests/unit/test_flash_core.py and tests/multiproc/test_tensor_parallel.py
# prove exact on the CPU. Triton reads the variable when its language module is imported, and
# megatron-core imports it (megatron/core/utils.py), so it is set before anything imports
# megatron-core. With a CUDA device the compiled kernels stay (TorchInductor's too).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def single_process_group():
    """torch.distributed (gloo, world 1) and megatron-core parallel state at TP=1, for the whole
    session; yields the ParallelContext."""
    from rtd_scale import distributed
    from rtd_scale.config import ParallelConfig

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    ctx = distributed.initialize(ParallelConfig(), seed=1234)
    yield ctx
    distributed.teardown()


def _tokenizer_and_shards(out, corpus, vocab_size: int, name: str) -> tuple[str, str]:
    """A SentencePiece model and megatron-core shards of ``corpus``, made with the real tools'
    ``main`` in this process (one preprocessing worker: no worker processes), so that a
    tests/unit/ test using it stays single-process."""
    from tests.helpers.tools import load_tool

    load_tool("train_tokenizer").main(["--input", corpus, "--vocab-size", str(vocab_size),
                                       "--output-prefix", str(out / "spm")])
    load_tool("preprocess_data").main(["--input", corpus, "--tokenizer-model", str(out / "spm.model"),
                                       "--output-prefix", str(out / name), "--workers", "1"])
    return str(out / "spm.model"), str(out / f"{name}_text_document")


@pytest.fixture(scope="session")
def wiki_shards(tmp_path_factory):
    """A SentencePiece model (vocab 1000) and shards of tests/data/wiki_sample.jsonl (real
    English text), made with the real tools. Returns (tokenizer_model, shard_prefix)."""
    return _tokenizer_and_shards(tmp_path_factory.mktemp("wiki"),
                                 str(TEST_DATA / "wiki_sample.jsonl"), 1000, "wiki")


@pytest.fixture(scope="session")
def cjk_shards(tmp_path_factory):
    """A SentencePiece model (vocab 800) and shards of tests/data/cases/cjk_no_spaces.jsonl
    (synthetic CJK text without spaces), made with the real tools. Returns (tokenizer_model,
    shard_prefix)."""
    return _tokenizer_and_shards(tmp_path_factory.mktemp("cjk"),
                                 str(CASES / "cjk_no_spaces.jsonl"), 800, "cjk")


@pytest.fixture(scope="session")
def two_datasets(tmp_path_factory):
    """Shard prefixes of two small synthetic datasets, ``a`` (200 documents of ids 100-149) and
    ``b`` (60 of ids 500-549), for the blending and loader tests (tests/helpers/blend_data.py)."""
    from tests.helpers import blend_data

    return blend_data.two_datasets(tmp_path_factory.mktemp("blend"))


# Which tests share a worker under pytest-xdist (tools/run_tests.sh runs ``-n 3 --dist
# loadgroup``). Every module is one group, so its module-scoped runs (one launch that several
# tests read) happen once, on one worker. A module that takes a machine-wide resource (installs
# Debian packages: apt's lock; starts Slurm daemons on fixed ports; holds port 29500, the
# launcher's default) marks itself ``pytest.mark.xdist_group("machine-wide")`` instead, so that
# no two of them run at once; a test's or module's own xdist_group marker is kept.
# tryfirst: pytest-xdist's own hook (xdist/remote.py) reads the xdist_group markers to name each
# item's group; a marker added after it is never seen, and a module's tests then spread over the
# workers, each running the module's shared runs again
#
# The order the groups are handed out in (tools/run_tests.sh passes --no-loadscope-reorder, so
# xdist keeps this order instead of its own, most tests first): longest first, by tier — the
# known-answer runs (minutes each), then the machine-wide group, the launcher tests, the tools,
# the multi-process tests, the unit tests — so that the run does not end with one worker on a
# long group while the other idles (longest-processing-time-first scheduling).
TIERS = ("known-answer", "machine-wide", "tests/e2e/", "tests/tools/", "tests/multiproc/")


def _tier(item) -> int:
    group = item.get_closest_marker("xdist_group").args[0]
    return next((i for i, prefix in enumerate(TIERS) if group.startswith(prefix)), len(TIERS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=_tier)  # stable: collection order within a tier


def pytest_terminal_summary(terminalreporter):
    """One line at the end of every run: how many ``assert`` statements the suite holds (an
    ``ast`` count over tests/), so that a run's output shows a change that drops checks."""
    import ast
    from pathlib import Path

    count = sum(isinstance(node, ast.Assert)
                for path in Path(__file__).parent.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))
    terminalreporter.write_line(f"assert statements in tests/: {count}")
