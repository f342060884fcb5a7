"""The real entry point through the real `deepspeed` launcher, as the end-to-end tests drive it."""
from __future__ import annotations

import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.env import PORT_TAKEN, REPO, free_port
from rtd_scale.cli_errors import EXIT_USER_ERROR

# dropout 0 in both encoders, where megatron-core's RNG policy makes dropout depend on the TP size
NO_DROPOUT = [f"--set=model.{m}.{d}=0.0" for m in ("generator", "discriminator")
              for d in ("hidden_dropout", "attention_dropout")]

TAGS = {"loss/mlm", "loss/rtd", "loss/total", "mlm/accuracy", "rtd/replaced_fraction",
        "rtd/accuracy_replaced", "rtd/accuracy_original", "optim/lr", "optim/grad_norm",
        "throughput/tokens_per_s", "embedding/avg_cosine_generator",
        "embedding/avg_cosine_discriminator", "embedding/rowwise_cosine_generator_discriminator",
        "memory/peak_gb"}


def memory_estimate_and_peak(stdout: str) -> tuple[float, float]:
    """(the ``memory per rank: estimate`` GB that pretrain.py prints at start, the summary's
    measured peak GB of the largest rank)."""
    import re

    estimate = re.search(r"^memory per rank: estimate ([0-9.]+) GB = ", stdout, re.M)
    peak = re.search(r"^  memory per rank: peak ([0-9.]+) GB \(peak resident size, largest "
                     r"rank\), estimate ([0-9.]+) GB", stdout, re.M)
    assert estimate and peak, stdout[-3000:]
    assert float(peak.group(2)) == float(estimate.group(1))  # the summary repeats the start's
    return float(estimate.group(1)), float(peak.group(1))


def _deepspeed_bin() -> str:
    return str(Path(sys.executable).with_name("deepspeed"))


def launch(args: list[str], ranks: int = 2, timeout: int = 300,
           launcher_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus RANKS --master_port FREE [launcher_args] rtd_scale/pretrain.py
    ARGS`` from the repository root.

    A port found free can be taken by another process of the suite before rank 0 listens on it
    (two pytest-xdist workers launch side by side); a run refused for that alone, before its
    process group started (rtd_scale/distributed.py's one line), is launched again on another
    port, up to PORT_TRIES times."""
    tries = 1 if "--master_port" in launcher_args else PORT_TRIES  # the caller's own port: once
    for _ in range(tries):
        cmd = [_deepspeed_bin(), "--num_gpus", str(ranks), "--master_port", str(free_port()),
               *launcher_args, "rtd_scale/pretrain.py", *args]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else {**os.environ, **env})
        if r.returncode == 0 or not PORT_TAKEN.search(r.stderr):
            break
    return r


PORT_TRIES = 3


def launch_together(jobs: list[list[str]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """One-rank ``launch`` of each ARGS in ``jobs``, all at once, the machine's cores shared
    among them (OMP_NUM_THREADS): tiny models do not use a second core, so two one-thread runs
    on two cores finish in about the time of one. A run refused because its port was taken
    before rank 0 listened (``launch``'s rule) is launched again, with the others so refused,
    up to PORT_TRIES times."""
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // len(jobs)))}
    out: list[subprocess.CompletedProcess | None] = [None] * len(jobs)
    todo = list(range(len(jobs)))
    for _ in range(PORT_TRIES):
        procs = [subprocess.Popen([_deepspeed_bin(), "--num_gpus", "1", "--master_port",
                                   str(free_port()), "rtd_scale/pretrain.py", *jobs[i]],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
                 for i in todo]
        for proc, i in zip(procs, todo):
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            out[i] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        todo = [i for i in todo if out[i].returncode != 0 and PORT_TAKEN.search(out[i].stderr)]
        if not todo:
            break
    return out


# a line of DeepSpeed's logger (its launcher's too): "[2026-12-05 12:09:37,335] [INFO] [file:line:fn] …"
_LOGGER_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] ")


def repeated_lines(r: subprocess.CompletedProcess) -> dict[str, int]:
    """Lines of a run's stdout and stderr together that appear more than once, with their
    counts; blank lines and the libraries' logger lines (DeepSpeed and its launcher log once
    per process, under their own time stamps) left out. A line rtd_scale prints on every rank
    shows up here."""
    lines = [line for line in (r.stdout + "\n" + r.stderr).splitlines()
             if line.strip() and not _LOGGER_LINE.match(line)]
    return {line: n for line, n in collections.Counter(lines).items() if n > 1}


def scalars(tb_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def assert_resume_continues(args, straight: dict, ranks: int, save_dir, straight_dir) -> None:
    """``args(iters, extra)`` gives the launch arguments. The uninterrupted run in
    ``straight_dir`` saved at step 5 on its way (``--save-interval 5``): a copy of its directory
    cut back to that checkpoint is resumed with ``--load`` to step 10, and steps 6–10 must repeat
    ``straight``'s losses (its TensorBoard scalars) bitwise (TensorBoard stores float32)."""
    shutil.copytree(straight_dir, save_dir)
    for later in save_dir.glob("global_step*"):
        if int(later.name[len("global_step"):]) > 5:
            shutil.rmtree(later)
    (save_dir / "latest").write_text("global_step5")
    shutil.rmtree(save_dir / "tensorboard")
    r = launch(args(10, ["--load", str(save_dir)]), ranks=ranks)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {save_dir} at iteration 5" in r.stdout, r.stdout[-3000:]
    resumed = scalars(str(save_dir / "tensorboard"))
    assert sorted(resumed["loss/mlm"]) == [6, 7, 8, 9, 10]
    for step in range(6, 11):
        for tag in ("loss/mlm", "loss/rtd"):
            assert resumed[tag][step] == straight[tag][step], (tag, step)


def cut_back(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of ``run_dir`` as it stood after its checkpoint at ``step``: later checkpoints,
    the TensorBoard events and ``latest`` brought back; returns ``copy``."""
    shutil.copytree(run_dir, copy)
    for later in copy.glob("global_step*"):
        if later.name[len("global_step"):].isdigit() and int(later.name[len("global_step"):]) > step:
            shutil.rmtree(later)
    shutil.rmtree(copy / "tensorboard", ignore_errors=True)
    (copy / "latest").write_text(f"global_step{step}")
    return copy


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fp32_weights(run_dir: Path, tag: str) -> dict:
    """The checkpoint's fp32 master weights by parameter name, merged from its ZeRO partitions
    by DeepSpeed's own ``zero_to_fp32`` (any stage, any data-parallel size)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir), tag=tag)


def adam_steps(ckpt_dir: Path) -> set[float]:
    """The AdamW step count of every parameter group in a ZeRO checkpoint's optimizer state
    (every rank's partition file)."""
    import torch

    steps: set[float] = set()
    for path in sorted(ckpt_dir.glob("*optim_states.pt")):
        states = torch.load(path, map_location="cpu", weights_only=False)
        states = states["optimizer_state_dict"]["optimizer_state_dict"]
        steps |= {float(s["step"]) for s in states["state"].values()}
    return steps


def assert_close(a: float, b: float, rel: float, what) -> None:
    assert abs(a - b) <= rel * max(abs(a), abs(b)), (what, a, b)


def common(wiki_shards, save: Path, iters: int, extra=(), **flags) -> list[str]:
    """pretrain.py's arguments for a tiny run of ``iters`` steps on ``wiki_shards`` (tokenizer,
    shard prefix) saving to ``save``, then ``extra``. ``flags`` give a flag below another value,
    or drop it with None (the preset's value then holds): ``ds_config="ds_configs/zero1.json"``,
    ``micro_batch_size=2`` (``--micro-batch-size 2``), ``save_interval=None``."""
    tok, prefix = wiki_shards
    values = {"ds_config": "ds_configs/zero3.json", "preset": "tiny", "data_path": prefix,
              "tokenizer_model": tok, "save": save, "train_iters": iters, "seq_length": 64,
              "micro_batch_size": 4, "global_batch_size": 16, "lr": "1e-3", "lr_warmup_iters": 4,
              "log_interval": 1, "save_interval": 3, "seed": 11}
    unknown = flags.keys() - values.keys()
    assert not unknown, f"common() sets no {sorted(unknown)}: pass them in extra"
    args = []
    for name, value in {**values, **flags}.items():
        if value is not None:  # --ds_config is DeepSpeed's spelling, the rest are ours
            args += ["--" + (name if name == "ds_config" else name.replace("_", "-")), str(value)]
    return [*args, *extra]


def pretrain_error(capsys, argv, monkeypatch, world_size: int = 2) -> str:
    """pretrain.main's one-line error for ``argv`` (run in-process as one rank of ``world_size``)."""
    from rtd_scale import pretrain

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert pretrain.main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
