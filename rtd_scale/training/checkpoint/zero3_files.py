"""A ZeRO-3 checkpoint read from its files, without a DeepSpeed engine: each parameter's fp32
master weights and AdamW moments for one tensor-parallel rank, from the data-parallel ranks'
partition files.

Under ZeRO-3 every data-parallel rank's ``*zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt``
holds its partition of the fp32 masters (``fp32_flat_groups``: one flat tensor per sub-group)
and the base optimizer's state of the same flat tensors (``exp_avg``, ``exp_avg_sq``, ``step``);
the model-states file lists the parameters in the flat order (``param_shapes``), each taking
ceil(numel / DP) elements of every rank's flat tensors (DeepSpeed 0.19.8
``zero_to_fp32.zero3_partitioned_param_info``; a parameter is gathered by its ``GatheredTensor``,
across sub-group boundaries too). The files are mapped, not read (``files.safe_load(mmap=True)``):
a process holds the parameter it gathers, and the kernel pages the rest in and out.

This is what ``convert.run_world`` reads a ZeRO-3 checkpoint with: one process per
tensor-parallel rank, each with a model built on the meta device for the tensor-parallel
attributes the merge needs (``layout_free.gather_full_state``'s rules), where restarting the
checkpoint's world built a whole engine per rank, with its optimizer (at debertav3-large's
shapes, ~8.5 GB a process: more than the machine holds beside the waiting run;
bench/rehearse.py). The same values as the engine's ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``, to the bit (tests/e2e/test_resume_layout.py).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint.files import CheckpointReadError, safe_load


def optim_file(ckpt_dir: str, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's optimizer-states file of one rank (``bf16_`` in front under bf16)."""
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    bf16 = os.path.join(ckpt_dir, f"bf16_{name}")
    return bf16 if os.path.isfile(bf16) else os.path.join(ckpt_dir, name)


class Zero3Partitions:
    """Tensor-parallel rank ``tp_rank``'s whole parameters from the ``dp_size`` partition files
    of the ZeRO-3 checkpoint ``ckpt_dir``. ``flag`` names the checkpoint in the errors,
    ``earlier`` says how to take another one.

    Raises:
        UserInputError: a file missing, unreadable or holding more than tensors, or files that
            disagree with the layout they were saved at.
    """

    def __init__(self, ckpt_dir: str, tp_rank: int, dp_size: int, *, flag: str, earlier: str):
        from deepspeed.checkpoint.constants import (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT,
                                                    PARAM_SHAPES, PARTITION_COUNT)

        self.ckpt_dir, self.flag, self.earlier = ckpt_dir, flag, earlier
        states = os.path.join(ckpt_dir, f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt")
        self.paths = [optim_file(ckpt_dir, d, tp_rank) for d in range(dp_size)]
        for path in [states, *self.paths]:
            if not os.path.isfile(path):
                raise CheckpointReadError(f"{path}: missing; {earlier}")
        # DeepSpeed's flat order: its parameter groups' parameters, each group in turn
        self.shapes = {name: torch.Size(shape) for group in safe_load(states)[PARAM_SHAPES]
                       for name, shape in group.items()}
        self.optim = [safe_load(p, mmap=True)[OPTIMIZER_STATE_DICT] for p in self.paths]
        counts = {int(o[PARTITION_COUNT]) for o in self.optim}
        if counts != {dp_size}:
            raise UserInputError(f"{flag}: {ckpt_dir} holds partitions of {sorted(counts)} "
                                 f"data-parallel ranks, its metadata says {dp_size}; {earlier}")
        self.flat = {"fp32": [list(o[FP32_FLAT_GROUPS]) for o in self.optim]}
        for key in ("exp_avg", "exp_avg_sq"):
            # a sub-group without state (no step taken yet) holds zeros
            self.flat[key] = [[o["optimizer_state_dict"]["state"].get(i, {}).get(key, None)
                               for i in range(len(groups))]
                              for o, groups in zip(self.optim, self.flat["fp32"])]
            self.flat[key] = [[torch.zeros_like(f) if s is None else s
                               for s, f in zip(ranks, fp32)]
                              for ranks, fp32 in zip(self.flat[key], self.flat["fp32"])]
        sizes = [sum(t.numel() for t in groups) for groups in self.flat["fp32"]]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += self._partition(shape)
        if len(set(sizes)) != 1 or offset != sizes[0]:
            raise UserInputError(
                f"{flag}: {ckpt_dir}: its partition files hold {sizes} elements, its parameter "
                f"list {offset} a rank; {earlier}")
        self.dp_size = dp_size

    def _partition(self, shape: torch.Size) -> int:
        from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info

        return zero3_partitioned_param_info(shape.numel(), len(self.paths))[0]

    def tensor(self, name: str, key: str = "fp32") -> torch.Tensor:
        """The whole (this tensor-parallel rank's) fp32 ``key`` of parameter ``name``:
        "fp32" (the master weights), "exp_avg" or "exp_avg_sq"."""
        import numpy as np
        from deepspeed.utils.zero_to_fp32 import GatheredTensor

        shape = self.shapes[name]
        flat = self.flat[key]
        bounds = [0, *np.cumsum([t.numel() for t in flat[0]]).tolist()]
        return GatheredTensor(flat, bounds, self.offsets[name], self._partition(shape),
                              shape).contiguous().float()

    def check_fits(self, names: dict[str, torch.Size]) -> None:
        """Refuse a model (``names``: DeepSpeed's name → this rank's shape) other than the one
        the files were saved from."""
        got = {n: tuple(s) for n, s in self.shapes.items()}
        want = {n: tuple(s) for n, s in names.items()}
        if got != want:
            diff = sorted(set(got) ^ set(want)) or sorted(n for n in got if got[n] != want[n])
            raise UserInputError(
                f"{self.flag}: {self.ckpt_dir} does not fit the model its metadata describes "
                f"(first differences: {diff[:3]}); {self.earlier}")

    def check_finite(self) -> None:
        """``checks.check_finite_weights`` on the files: refuse fp32 masters or AdamW moments
        holding inf or NaN (a file damaged in place keeps its size; either would turn the
        first resumed step's update into NaN), naming the first damaged file."""
        from rtd_scale.training.checkpoint.checks import non_finite

        counts = [non_finite([self.flat[key][d] for key in self.flat])
                  for d in range(len(self.paths))]
        if not sum(counts):
            return
        path, count = next((p, n) for p, n in zip(self.paths, counts) if n)
        raise UserInputError(
            f"{path}: damaged: it holds {count} inf/NaN value(s) although its size matches the "
            "completion record (the loaded weights and AdamW moments hold "
            f"{sum(counts)}); {self.earlier} or delete {self.ckpt_dir}")

    def adam_step(self) -> float:
        """The AdamW step count the files hold (every sub-group's; 0 before the first step)."""
        steps = {float(s["step"]) for o in self.optim
                 for s in o["optimizer_state_dict"]["state"].values() if "step" in s}
        steps |= {float(g["step"]) for o in self.optim
                  for g in o["optimizer_state_dict"]["param_groups"] if "step" in g}
        if len(steps) > 1:
            raise RuntimeError(f"the optimizer's states hold different step counts "
                               f"{sorted(steps)}")
        return steps.pop() if steps else 0.0

    def loss_scaler(self) -> Optional[object]:
        """The loss scaler record the optimizer saved (DeepSpeed's ``LossScaler`` or
        ``DynamicLossScaler``)."""
        from deepspeed.checkpoint.constants import LOSS_SCALER

        return self.optim[0].get(LOSS_SCALER)
