"""megatron-core's import-time torch.compile calls are deferred to first use (rtd_scale._lazy_fusions)."""
from __future__ import annotations

import subprocess
import sys

import torch

from rtd_scale._lazy_fusions import lazy_compile
from tests.helpers.env import REPO


def test_compiles_once_on_first_call_with_the_decorators_arguments():
    calls = []

    def real_compile(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = lazy_compile(real_compile)

    @compile_later
    def bias_gelu(bias, y):
        return bias + y

    @compile_later(dynamic=False, fullgraph=True)
    def scaled(x):
        return 2 * x

    assert calls == [] and bias_gelu.__name__ == "bias_gelu"  # nothing compiled at decoration
    assert bias_gelu(1, 2) == ("compiled", 3)
    assert scaled(4) == ("compiled", 8)
    assert bias_gelu(3, 4) == ("compiled", 7)
    assert calls == [("bias_gelu", {}), ("scaled", {"dynamic": False, "fullgraph": True})]


def test_inside_a_dynamo_trace_the_plain_function_runs():
    calls = []
    compile_later = lazy_compile(lambda fn, **kw: calls.append(fn) or fn)

    @compile_later
    def double(x):
        return 2 * x

    traced = torch.compile(lambda x: double(x) + 1, backend="eager")
    assert torch.equal(traced(torch.ones(3)), torch.full((3,), 3.0))
    assert calls == []  # dynamo traced into the function; no nested compile was made


def test_a_fresh_process_imports_megatron_core_without_compiling_and_restores_torch_compile():
    code = ("import sys, torch, rtd_scale.distributed, megatron.core.jit as jit; "
            "print(torch.compile.__module__, jit.jit_fuser.__qualname__, "
            "'torch._inductor.compile_fx' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["torch", "lazy_compile.<locals>.compile_later", "False"]
