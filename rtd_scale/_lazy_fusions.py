"""megatron-core's import-time ``torch.compile`` calls, deferred to first use.

megatron-core 0.16.1 decorates its fused kernels (bias-GeLU, bias-GeGLU, bias-SwiGLU, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile``. Each decoration builds a dynamo
wrapper at import time, and the first one imports TorchInductor: on a 2-core machine that is 3-9 s
of every process's start (``python -X importtime -c "import megatron.core"``), although a run
whose config turns the fusions off (every CPU run) never calls them.

While ``megatron.core`` executes its package ``__init__`` (which imports the fusion modules and
``megatron.core.jit``), ``torch.compile`` is replaced by :func:`lazy_compile`: the decorated
function is compiled with the same arguments on its first call, outside a dynamo trace. Inside
one (``--compile-layers``) the plain function is called, which dynamo traces into as it would a
nested compiled function. ``torch.compile`` itself is restored as soon as the import ends.
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


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` through the normal machinery, then runs its package ``__init__``
    with ``torch.compile`` deferred. Removes itself after the first lookup."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
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


_FINDER = _MegatronCoreFinder()


def install() -> None:
    """Put the hook first on ``sys.meta_path`` unless megatron-core is already imported."""
    if "megatron.core" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
