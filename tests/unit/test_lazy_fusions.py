"""megatron-core's import-time torch.compile calls are deferred to first use (rtd_scale._lazy_fusions).
A fresh process's import is in tests/tools/test_lazy_fusions_fresh_process.py."""
from __future__ import annotations

import torch

from rtd_scale._lazy_fusions import lazy_compile


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
