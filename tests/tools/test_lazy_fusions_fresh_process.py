"""megatron-core's and DeepSpeed's import-time torch.compile calls are deferred to first use
(rtd_scale._lazy_fusions), seen from a fresh Python process: importing megatron-core and
DeepSpeed's Muon module (which every ZeRO engine's optimizer check imports) through rtd_scale
compiles nothing, imports neither dynamo nor inductor, and leaves torch.compile as it was."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers.env import REPO


def test_a_fresh_process_imports_megatron_core_without_compiling_and_restores_torch_compile():
    code = ("import sys, torch, rtd_scale.distributed, megatron.core.jit as jit; "
            "import deepspeed.runtime.zero.muon.original_muon as muon; "
            "print(torch.compile.__module__, jit.jit_fuser.__qualname__, "
            "muon.zeropower_via_newtonschulz5.__code__.co_name, "
            "'torch._inductor.compile_fx' in sys.modules, 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # the last line: DeepSpeed logs its accelerator choice to stdout first
    assert r.stdout.splitlines()[-1].split() == ["torch", "lazy_compile.<locals>.compile_later",
                                "call", "False", "False"]
