"""The run: the planned rows in priority order, each built, timed and diagnosed under its time
budget and the run's deadline; a row's failure (out of memory or any other) is reported in the
table, and a ``torch.compile`` row runs in a child process that the deadline can cut off
(``python -m bench.gpu.child``, under this run's settings)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from bench.common import REPO, SEED
from bench.gpu.census import FamilyProfile, SyncCensus, profile_families, sampler_cost
from bench.gpu.hf_rows import hf_rtd_step, stack_hf_step
from bench.gpu.rtd_rows import rtd_autocast_step, rtd_engine_step, stack_mcore_step
from bench.gpu.timing import (PEAK_FLOPS, Row, RowSkipped, Stepper, fmt_k, failure_note, is_oom,
                              phase_split, release, time_steps)
from bench.gpu.workloads import (CORES, IMPL_TITLES, STACK_ANCHORS, STACK_TARGET, WORKLOADS,
                                 Settings, rtd_config, rtd_dims, stack_shape)
from rtd_scale.flops import EncoderDims, mfu, rtd_flops_per_token, stack_flops_per_token


@dataclass(frozen=True)
class Item:
    """One planned row."""

    workload: str  # a WORKLOADS key or "stack"
    impl: str
    # diagnostics after the timed steps: "families" (torch.profiler by kernel family), and for
    # rtd_scale rows "phases" (forward/backward/update), "syncs" (host-sync census), "sampler"
    diag: frozenset = frozenset()
    min_left_s: float = 25.0  # do not start with less time than this left
    core: str = ""  # rtd-engine rows: the attention core (workloads.CORES); "" the default


class Bench:
    def __init__(self, s: Settings, in_child: bool = False):
        self.s, self.in_child = s, in_child
        self.t0 = time.perf_counter()
        self.rows: list[Row] = []
        self.ceiling: Optional[float] = None
        self.profiles: dict[str, FamilyProfile] = {}
        self.phases: dict[str, dict] = {}
        self.syncs: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self.log = print

    def left(self) -> float:
        return self.s.deadline_s - (time.perf_counter() - self.t0)

    # rows -----------------------------------------------------------------------------------
    def new_row(self, item: Item) -> Row:
        if item.workload == "stack":
            shape = stack_shape(self.s.tiny)
            enc = EncoderDims(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                              ffn_hidden_size=shape["ffn_hidden_size"])
            return Row(workload=f"stack {shape['num_layers']}x{shape['hidden_size']}",
                       impl=item.impl, title=IMPL_TITLES[item.impl],
                       micro_batch=shape["micro_batch"], seq_length=shape["seq_length"],
                       flops_per_token=stack_flops_per_token(enc, shape["seq_length"]),
                       target_tokens_per_s=STACK_TARGET,
                       anchor_tokens_per_s=None if self.s.tiny else STACK_ANCHORS.get(item.impl))
        wl = WORKLOADS[item.workload]
        cfg = rtd_config(wl, self.s.tiny)
        title = IMPL_TITLES[item.impl].format(zs=f", ZeRO-{self.s.zero_stage}")
        if item.impl == "hf-eager" and wl.hf_arch == "deberta-v2":
            title = "HF eager (DebertaV2)"
        if item.core:
            title += f", core {item.core}"
        return Row(workload=wl.key, impl=item.impl, title=title, core=item.core,
                   micro_batch=cfg.train.micro_batch_size, seq_length=cfg.data.seq_length,
                   flops_per_token=rtd_flops_per_token(rtd_dims(cfg)),
                   target_tokens_per_s=wl.target_tokens_per_s,
                   anchor_tokens_per_s=None if self.s.tiny else wl.anchors.get(item.impl))

    def build(self, item: Item) -> tuple[Stepper, Any, str]:
        s = self.s
        if item.workload == "stack":
            shape = stack_shape(s.tiny)
            stepper, note = (stack_hf_step(shape, s) if item.impl == "stack-hf"
                             else stack_mcore_step(item.impl, shape, s))
            return stepper, None, note
        wl = WORKLOADS[item.workload]
        cfg = rtd_config(wl, s.tiny)
        if item.impl in ("hf-eager", "hf-electra-arch"):
            arch = "electra" if item.impl == "hf-electra-arch" else wl.hf_arch
            stepper, note = hf_rtd_step(cfg, arch, s, None)
            return stepper, None, note
        if item.impl == "hf-compile":
            stepper, note = hf_rtd_step(cfg, wl.hf_arch, s, s.compile_backend)
            return stepper, None, note
        if item.impl in ("rtd-engine", "rtd-engine-z0", "rtd-compile"):
            zs = 0 if item.impl == "rtd-engine-z0" else s.zero_stage
            cfg.model.compile_layers = item.impl == "rtd-compile"
            stepper, (model, note) = rtd_engine_step(cfg, s, zs, item.core)
            return stepper, (model, cfg), note
        if item.impl == "rtd-autocast":
            stepper, (model, note) = rtd_autocast_step(cfg, s)
            return stepper, (model, cfg), note
        raise AssertionError(item.impl)

    def run(self, item: Item) -> Row:
        row = self.new_row(item)
        self.rows.append(row)
        if self.left() < item.min_left_s:
            row.status, row.note = "skipped", f"deadline: {self.left():.0f}s left"
            return row
        if item.impl in ("hf-compile", "rtd-compile") and not self.in_child:
            return self.run_child(item, row)
        t0 = time.perf_counter()
        self.log(f"-- {row.workload} / {row.title} ...")
        if self.s.cuda:
            torch.cuda.reset_peak_memory_stats(self.s.device)
        stepper = rtd = None
        try:
            torch.manual_seed(SEED)
            stepper, rtd, note = self.build(item)
            row.note = note
            row.step_ms, row.steps = time_steps(stepper, self.s)
            self.finish(row)
        except RowSkipped as e:
            row.status, row.note = "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - a row's failure is reported, not fatal
            row.status = "OOM" if is_oom(e) else "error"
            row.note = failure_note(e)
            if row.status == "error":
                traceback.print_exc()
        if self.s.cuda and row.status in ("ok", "OOM"):
            row.peak_mem_gib = torch.cuda.max_memory_allocated(self.s.device) / 2 ** 30
        try:
            if row.status == "ok" and item.diag:
                self.diagnose(item, row, stepper, rtd)
        except Exception as e:  # noqa: BLE001 - the measurement stands; say what is missing
            row.note = (row.note + f" [diagnostics failed: {failure_note(e)}]").strip()
            traceback.print_exc()
        finally:
            for obj in (stepper.keep if stepper is not None else []):
                if hasattr(obj, "destroy"):
                    with contextlib.suppress(Exception):
                        obj.destroy()
            stepper = rtd = None
            release(self.s.device)
            row.seconds = time.perf_counter() - t0
        resident = (f", {torch.cuda.memory_allocated(self.s.device) / 2 ** 30:.2f} GiB still "
                    "allocated after the row" if self.s.cuda else "")
        self.log(f"   {row.status}: {fmt_k(row.tokens_per_s)} tokens/s "
                 f"({row.seconds:.0f}s{resident}) {row.note}")
        return row

    def finish(self, row: Row) -> None:
        row.tokens_per_s = row.micro_batch * row.seq_length / (row.step_ms / 1e3)
        row.tflops = row.flops_per_token * row.tokens_per_s / 1e12
        if self.ceiling:
            row.mfu = mfu(row.flops_per_token, row.tokens_per_s, self.ceiling)
        row.mfu_peak = mfu(row.flops_per_token, row.tokens_per_s, PEAK_FLOPS)

    def diagnose(self, item: Item, row: Row, stepper: Stepper, rtd) -> None:
        key = f"{row.workload} / {row.title}"
        start = 10_000
        if "families" in item.diag:
            self.profiles[f"{row.workload}|{item.impl}"] = profile_families(
                stepper, self.s, start, row.step_ms)
        if rtd is None:
            return
        model, cfg = rtd
        if "phases" in item.diag:
            self.phases[key] = phase_split(stepper, self.s, start + 100,
                                           n=1 if self.s.tiny else 3)
        if "syncs" in item.diag:
            self.syncs[key] = SyncCensus.run(stepper, start + 200, self.s.device)
        if "sampler" in item.diag:
            self.samplers[key] = sampler_cost(model, cfg, self.s, row.step_ms)

    def run_child(self, item: Item, row: Row) -> Row:
        """A torch.compile row in a child process, cut off at the deadline."""
        t0 = time.perf_counter()
        self.log(f"-- {row.workload} / {row.title} (child process, ≤ {self.left() - 10:.0f}s) ...")
        out = (Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_rtd_step_child_{os.getpid()}.json"
               ).resolve()
        cmd = [sys.executable, "-m", "bench.gpu.child", "--row",
               f"{item.workload}:{item.impl}" + (f":{item.core}" if item.core else ""),
               "--out", str(out), "--settings", self.s.to_json()]
        release(self.s.device)
        try:
            subprocess.run(cmd, cwd=REPO, timeout=max(5.0, self.left() - 10), check=False)
            child = json.loads(out.read_text())
            for k in ("status", "note", "steps", "step_ms", "peak_mem_gib"):
                setattr(row, k, child[k])
            if row.status == "ok":
                self.finish(row)
        except subprocess.TimeoutExpired:
            row.status, row.note = "timeout", "compilation did not finish before the deadline"
        except (OSError, ValueError, KeyError) as e:
            row.status, row.note = "error", f"child process: {type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(OSError):
                out.unlink()
        row.seconds = time.perf_counter() - t0
        self.log(f"   {row.status}: {fmt_k(row.tokens_per_s)} tokens/s ({row.seconds:.0f}s)")
        return row


def plan(s: Settings, workloads: list[str], skip: set[str], cores: tuple[str, ...] = ()
         ) -> list[Item]:
    """Rows in priority order: the side-by-side rows first, diagnostics after, compile last.
    With ``cores``, rtd_scale's engine row once per core its workload's attention has
    (``workloads.CORES``: "sdpa" for each, then the others named), and HF's compiled row for
    every workload (ELECTRA-large's first), not only ELECTRA-large's."""
    on = "profile" not in skip
    if cores:
        return _plan_cores(s, workloads, skip, cores, on)

    def diag(*what: str, when: bool = True) -> frozenset:
        return frozenset(what) if on and when else frozenset()

    items = []
    for w in workloads:
        large = w == "electra-large"
        items += [Item(w, "hf-eager", diag("families", when=large)),
                  Item(w, "rtd-engine", diag("families", "phases", "syncs", "sampler", when=large))]
    if "stack" not in skip:
        items += [Item("stack", "stack-hf", diag("families")),
                  Item("stack", "stack-mcore", diag("families"))]
    if "extras" not in skip:
        items += [Item(w, "rtd-autocast", diag("families", "phases", "syncs",
                                               when=w == "electra-large")) for w in workloads]
        if "electra-large" in workloads and s.zero_stage != 0:
            items.append(Item("electra-large", "rtd-engine-z0", diag("phases", "syncs")))
        if "stack" not in skip:
            items.append(Item("stack", "stack-mcore-mask"))
        if "debertav3-large" in workloads:
            items.append(Item("debertav3-large", "hf-electra-arch"))
    if "rtd-compile" not in skip and "electra-large" in workloads and not s.tiny:
        items.append(Item("electra-large", "rtd-compile", min_left_s=60))
    if "hf-compile" not in skip and "electra-large" in workloads:
        items.append(Item("electra-large", "hf-compile", min_left_s=20 if s.tiny else 75))
    return items


def _plan_cores(s: Settings, workloads: list[str], skip: set[str], cores: tuple[str, ...],
                on: bool) -> list[Item]:
    """``plan`` with ``cores``: per workload HF eager, then rtd_scale's engine per core (the
    first, ELECTRA-large's, with the kernel-family profile and the phase split); HF compiled per
    workload last, while the deadline allows."""
    items = []
    for w in workloads:
        cfg = rtd_config(WORKLOADS[w], True)
        mine = [c for c in cores if c in CORES[cfg.model.attention_type.value]]
        items.append(Item(w, "hf-eager"))
        for i, c in enumerate(mine):
            first = on and i == 0 and w == workloads[0]
            items.append(Item(w, "rtd-engine", frozenset({"families", "phases"}) if first
                              else frozenset(), core=c))
    if "hf-compile" not in skip:
        items += [Item(w, "hf-compile", min_left_s=20 if s.tiny else 75) for w in workloads]
    return items
