"""megatron-core's and DeepSpeed's import-time torch.compile calls are deferred to first use
(rtd_scale._lazy_fusions), seen from a fresh Python process: under RTD_SCALE_LAZY_FUSIONS=1 (the
suite's own setting, tests/conftest.py), importing megatron-core and DeepSpeed's Muon module
(which every ZeRO engine's optimizer check imports) through rtd_scale compiles nothing, imports
neither dynamo nor inductor, and leaves torch.compile as it was; without it, importing rtd_scale
installs no hook at all."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.env import REPO

_HOOKED = ("import sys, rtd_scale; "
           "print([type(f).__name__ for f in sys.meta_path if 'rtd_scale' in type(f).__module__])")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_a_fresh_process_imports_megatron_core_without_compiling_and_restores_torch_compile():
    code = ("import sys, torch, rtd_scale.distributed, megatron.core.jit as jit; "
            "import deepspeed.runtime.zero.muon.original_muon as muon; "
            "print(torch.compile.__module__, jit.jit_fuser.__qualname__, "
            "muon.zeropower_via_newtonschulz5.__code__.co_name, "
            "'torch._inductor.compile_fx' in sys.modules, 'torch._dynamo' in sys.modules)")
    r = _python(code, RTD_SCALE_LAZY_FUSIONS="1")
    assert r.returncode == 0, r.stderr[-2000:]
    # the last line: DeepSpeed logs its accelerator choice to stdout first
    assert r.stdout.splitlines()[-1].split() == ["torch", "lazy_compile.<locals>.compile_later",
                                "call", "False", "False"]


def test_the_hook_is_installed_only_when_asked():
    asked = _python(_HOOKED, RTD_SCALE_LAZY_FUSIONS="1")
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert asked.stdout.split("\n")[0] == "['_DeferredCompileFinder']"  # the control
    for value in ("", "0"):
        r = _python(_HOOKED, RTD_SCALE_LAZY_FUSIONS=value)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split("\n")[0] == "[]", value
