"""Import-time ``torch.compile`` calls in megatron-core and DeepSpeed, deferred to first use.

megatron-core 0.16.1 decorates its fused kernels (bias-GeLU, bias-GeGLU, bias-SwiGLU, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile``. Each decoration builds a dynamo
wrapper at import time, and the first one imports TorchInductor: on a 2-core machine that is 3-9 s
of every process's start (``python -X importtime -c "import megatron.core"``), although a run
whose config turns the fusions off (every CPU run) never calls them. DeepSpeed 0.19.8 does the
same in ``deepspeed.runtime.zero.muon.original_muon`` (Muon's kernels), which
``deepspeed.runtime.zero.utils.is_zero_supported_optimizer`` imports whenever a ZeRO engine is
built, whatever its optimizer: 1.4 s of every rank's start, for kernels only Muon calls.

While one of :data:`DEFERRED` executes (megatron-core's package ``__init__``, which imports the
fusion modules and ``megatron.core.jit``; DeepSpeed's Muon module), ``torch.compile`` is
replaced by :func:`lazy_compile`: the decorated function is compiled with the same arguments on
its first call, outside a dynamo trace. Inside one (``--compile-layers``) the plain function is
called, which dynamo traces into as it would a nested compiled function. ``torch.compile`` itself
is restored as soon as that import ends.

Opt-in: ``import rtd_scale`` installs the hook only under ``RTD_SCALE_LAZY_FUSIONS=1``
(``rtd_scale/__init__.py``), which the tests and ``tools/run_default.sh`` set. A GPU run that
calls the fusions compiles them on first use either way (torch.compile is lazy), so there the hook
moves TorchInductor's import from start-up to the first step and saves nothing.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


def lazy_compile(real_compile: Callable) -> Callable:
    """A stand-in for ``torch.compile`` whose result compiles with ``real_compile`` on first call."""

    def compile_later(model: Callable | None = None, **kwargs: Any):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **kwargs)
        compiled: Callable | None = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            import torch

            if torch.compiler.is_compiling():
                return model(*args, **kw)
            if compiled is None:
                compiled = real_compile(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile_later


# the modules whose own import decorates functions with torch.compile
DEFERRED = ("megatron.core", "deepspeed.runtime.zero.muon.original_muon")


class _DeferredCompileFinder(importlib.abc.MetaPathFinder):
    """Finds each module of :data:`DEFERRED` through the normal machinery, then executes it with
    ``torch.compile`` deferred. Removes itself once it has seen all of them."""

    def __init__(self) -> None:
        self.pending = set(DEFERRED)

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)  # the lookup below then passes this finder by
        if not self.pending:
            uninstall()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_lazy_compile(module):
            import torch

            real = torch.compile
            torch.compile = lazy_compile(real)
            try:
                exec_module(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_with_lazy_compile
        return spec


_FINDER = _DeferredCompileFinder()


def install() -> None:
    """Put the hook first on ``sys.meta_path`` for the modules of :data:`DEFERRED` not imported
    yet."""
    _FINDER.pending = {name for name in DEFERRED if name not in sys.modules}
    if _FINDER.pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
