"""Checkpoint fault injection: what ``--load`` does after each way a run can die or a checkpoint
can be damaged, through the real ``deepspeed`` launcher (the ``tiny`` preset, 2 CPU ranks,
ZeRO-3, the tests' Wikipedia sample).

    python bench/faults.py                        # every fault, one row each
    python bench/faults.py --faults truncate-optim,disk-full --json rows.json

A reference run trains ``--steps`` steps uninterrupted with ``--data-digest`` (the exact losses,
sample ids and masks of every step) and a checkpoint every ``--save-interval`` steps. Each fault
then either damages a copy of that run's directory, or kills (SIGKILL, the whole launcher process
group) a fresh run at a chosen moment; then the same command with ``--load`` runs to
``--steps``. One row per fault:

- resumed from: the iteration the resumed run started at (its "resumed from" line);
- steps lost: iterations the faulted run had finished (its digest) that the resume repeats;
- bitwise equal after resume: every step the resumed run took has the reference run's digest
  line, hex-float losses included (``-`` when nothing was left to run);
- what --load said: its note about skipped checkpoints, or its error line.

Faults: ``kill-random-step`` (SIGKILL once the digest shows a random step between two saves),
``kill-during-save`` (SIGKILL once the second checkpoint's directory holds an optimizer-state
file but no completion record, a moment the test-only ``hold`` fault keeps open),
``kill-after-latest`` (SIGKILL once ``latest`` names the second checkpoint), ``truncate-{model,optim,rng,meta,record}`` (the newest checkpoint's file cut to half
its size), ``empty-latest``, ``latest-deleted-dir`` (the newest checkpoint's directory deleted,
``latest`` still naming it), ``disk-full`` (``--save`` on a tmpfs sized for one checkpoint and a
half, where mounting is permitted; the resume runs on a copy of the directory on a disk with
room, as after freeing space).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tiny_data import wiki_sample_data  # noqa: E402
from rtd_scale.launch_env import free_port  # noqa: E402

FAULTS = ("kill-random-step", "kill-during-save", "kill-after-latest", "truncate-model",
          "truncate-optim", "truncate-rng", "truncate-meta", "truncate-record", "empty-latest",
          "latest-deleted-dir", "disk-full")


def _digest(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        rows[row["step"]] = row
    return rows


class Bench:
    def __init__(self, out: Path, steps: int, save_interval: int, ranks: int, seed: int):
        self.out, self.steps, self.interval, self.ranks = out, steps, save_interval, ranks
        self.rng = random.Random(seed)
        self.data = out / "data"
        wiki_sample_data(self.data, vocab_size=1000, workers=1)

    # ------------------------------------------------------------------------ launching ----
    def command(self, save: Path, digest: Path, load: bool) -> list[str]:
        return [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(self.ranks),
                "--master_port", str(free_port()), "rtd_scale/pretrain.py",
                "--ds_config", "ds_configs/zero3.json", "--preset", "tiny",
                "--data-path", str(self.data / "wiki_text_document"),
                "--tokenizer-model", str(self.data / "spm.model"), "--save", str(save),
                "--train-iters", str(self.steps), "--seq-length", "64",
                "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
                "--lr-warmup-iters", "2", "--log-interval", "1",
                "--save-interval", str(self.interval), "--seed", "11",
                "--data-digest", str(digest), *(["--load", str(save)] if load else [])]

    def start(self, save: Path, digest: Path, load: bool, log: Path,
              faults: str = "") -> subprocess.Popen:
        """The run; ``faults``: its RTD_FAULTS (rtd_scale/training/faults.py), if any."""
        f = open(log, "w")
        env = {**os.environ, "RTD_FAULTS": faults} if faults else None
        return subprocess.Popen(self.command(save, digest, load), cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=env)

    def run(self, save: Path, digest: Path, load: bool, log: Path) -> tuple[int, str]:
        p = self.start(save, digest, load, log)
        try:
            rc = p.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        return rc, log.read_text()

    @staticmethod
    def kill_when(p: subprocess.Popen, ready, poll_s: float = 0.001,
                  timeout_s: float = 900) -> bool:
        """SIGKILL the run's whole process group (launcher and ranks) as soon as ``ready()``;
        False when the run ended first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if ready():
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return True
            if p.poll() is not None:
                return False
            time.sleep(poll_s)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return False

    # ------------------------------------------------------------------------- the rows ----
    def reference(self) -> tuple[Path, dict[int, dict]]:
        save, digest = self.out / "reference", self.out / "reference.digest.jsonl"
        if not (save / "latest").exists():
            shutil.rmtree(save, ignore_errors=True)
            digest.unlink(missing_ok=True)
            rc, log = self.run(save, digest, False, self.out / "reference.log")
            if rc != 0:
                raise SystemExit(f"reference run failed (exit {rc}):\n{log[-3000:]}")
        return save, _digest(digest)

    def resume(self, name: str, save: Path, done: int, ref: dict[int, dict]) -> dict:
        """Run ``--load save`` to the end; the row for fault ``name``."""
        digest = self.out / f"{name}.resume.digest.jsonl"
        digest.unlink(missing_ok=True)
        rc, log = self.run(save, digest, True, self.out / f"{name}.resume.log")
        said = [line.strip() for line in log.splitlines()
                if line.startswith(("note:", "warning:", "error:"))]
        m = re.search(r"resumed from .* at iteration (\d+)", log)
        nothing = re.search(r"nothing to do: .* is at iteration (\d+)", log)
        row = {"fault": name, "exit": rc, "said": " / ".join(said) or "-",
               "tracebacks": log.count("Traceback")}
        if m or nothing:
            start = int((m or nothing).group(1))
            got = _digest(digest)
            steps = list(range(start + 1, self.steps + 1))
            row.update(resumed_from=start, steps_lost=max(done - start, 0),
                       bitwise=("-" if not steps else
                                "yes" if all(got.get(s) == ref[s] for s in steps) else "no"))
        else:
            row.update(resumed_from="none", steps_lost=done, bitwise="no")
        return row

    def damaged_copy(self, name: str, ref_dir: Path) -> Path:
        save = self.out / name
        shutil.rmtree(save, ignore_errors=True)
        shutil.copytree(ref_dir, save)
        return save

    def killed_run(self, name: str, ready: Callable[[Path, Path], bool],
                   faults: str = "") -> tuple[Path, int, str]:
        """A fresh run (with RTD_FAULTS ``faults``) killed as soon as ``ready(save dir, digest
        file)``; (dir, steps done, what happened)."""
        save, digest = self.out / name, self.out / f"{name}.digest.jsonl"
        shutil.rmtree(save, ignore_errors=True)
        digest.unlink(missing_ok=True)
        p = self.start(save, digest, False, self.out / f"{name}.log", faults)
        killed = self.kill_when(p, lambda: ready(save, digest))
        done = max(_digest(digest), default=0)
        return save, done, "killed" if killed else f"ended first (exit {p.returncode})"

    def kill_fault(self, name: str, ref: dict[int, dict]) -> dict:
        """The row of a ``kill-*`` fault: a fresh run killed at the fault's moment (module
        docstring), then resumed."""
        second = f"global_step{2 * self.interval}"
        note, faults = "", ""
        if name == "kill-random-step":
            k = self.rng.randint(self.interval + 1, self.steps - 1)
            note = f" (target {k})"

            def ready(save: Path, digest: Path) -> bool:
                return k in _digest(digest)
        elif name == "kill-during-save":
            # every rank holds the save open between its files and the record (a test-only
            # fault), so the kill lands in it however busy the machine; without the hold the
            # window is milliseconds, which a starved poller can miss
            faults = f"hold=120@{2 * self.interval}:*"

            def ready(save: Path, digest: Path) -> bool:
                g = save / second
                return (g.is_dir() and any(g.glob("*optim_states.pt"))
                        and not (g / "rtd_complete.json").exists())
        elif name == "kill-after-latest":
            def ready(save: Path, digest: Path) -> bool:
                try:
                    return (save / "latest").read_text().strip() == second
                except OSError:
                    return False
        else:
            raise AssertionError(name)
        save, done, how = self.killed_run(name, ready, faults)
        if name == "kill-during-save":  # read before the resume writes one
            record = (save / second / "rtd_complete.json").exists()
            note = f"; {second} record: {'yes' if record else 'no'}"
        row = self.resume(name, save, done, ref)
        row["note"] = f"{how} after step {done}{note}"
        return row

    def fault(self, name: str, ref_dir: Path, ref: dict[int, dict]) -> dict:
        newest = ref_dir / f"global_step{self.steps}"
        if name.startswith("kill-"):
            return self.kill_fault(name, ref)
        if name.startswith("truncate-"):
            kind = name.split("-", 1)[1]
            save = self.damaged_copy(name, ref_dir)
            pattern = {"model": "*_model_states.pt", "optim": "*_optim_states.pt",
                       "rng": "rng_rank*.pt", "meta": "rtd_meta.json",
                       "record": "rtd_complete.json"}[kind]
            target = sorted((save / newest.name).glob(pattern))[-1]
            os.truncate(target, target.stat().st_size // 2)
            row = self.resume(name, save, self.steps, ref)
            row["note"] = f"{target.name} of {newest.name} cut to half"
            return row
        if name == "empty-latest":
            save = self.damaged_copy(name, ref_dir)
            (save / "latest").write_text("")
            row = self.resume(name, save, self.steps, ref)
            row["note"] = f"the newest, {newest.name}, is complete"
            return row
        if name == "latest-deleted-dir":
            save = self.damaged_copy(name, ref_dir)
            shutil.rmtree(save / newest.name)
            row = self.resume(name, save, self.steps, ref)
            row["note"] = f"latest names the deleted {newest.name}"
            return row
        if name == "disk-full":
            return self.disk_full(ref_dir, ref)
        raise SystemExit(f"--faults: unknown fault {name!r}; known: {', '.join(FAULTS)}")

    def disk_full(self, ref_dir: Path, ref: dict[int, dict]) -> dict:
        first = ref_dir / f"global_step{self.interval}"
        ckpt = sum(f.stat().st_size for f in first.iterdir())
        mnt = self.out / "disk-full.mnt"
        mnt.mkdir(exist_ok=True)
        size_kb = (ckpt + ckpt // 2 + 512 * 1024) // 1024
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return {"fault": "disk-full", "resumed_from": "skipped", "steps_lost": "-",
                    "bitwise": "-", "said": "-", "exit": "-", "tracebacks": 0,
                    "note": f"skipped: cannot mount a tmpfs here ({r.stderr.strip()})"}
        try:
            save, digest = mnt / "run", self.out / "disk-full.digest.jsonl"
            digest.unlink(missing_ok=True)
            rc, log = self.run(save, digest, False, self.out / "disk-full.log")
            errors = [line.strip() for line in log.splitlines() if line.startswith("error:")]
            done = max(_digest(digest), default=0)
            copy = self.out / "disk-full"  # after freeing space: the same directory, with room
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(save, copy)
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
        row = self.resume("disk-full", copy, done, ref)
        row["note"] = (f"tmpfs {size_kb} KiB, one checkpoint {ckpt // 1024} KiB; the run exited "
                       f"{rc} with {len(errors)} error line(s), {log.count('Traceback')} "
                       f"traceback(s): {errors[0] if errors else '-'}")
        return row


def table(rows: list[dict]) -> str:
    head = ("| fault | resumed from | steps lost | bitwise equal after resume | what --load said "
            "| notes |\n|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['resumed_from']} | {r['steps_lost']} | {r['bitwise']} "
                     f"| {r['said']} | {r.get('note', '')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated subset of: {', '.join(FAULTS)}")
    p.add_argument("--steps", type=int, default=6, help="iterations of every run")
    p.add_argument("--save-interval", type=int, default=2,
                   help="checkpoint every N iterations (the faults need steps >= 3 × N)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="picks the random kill step")
    p.add_argument("--out", default="bench_faults_out", help="working directory (kept)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"error: --faults {','.join(unknown)}: unknown; known: {', '.join(FAULTS)}",
              file=sys.stderr)
        return 1
    if args.steps < 3 * args.save_interval:
        print(f"error: --steps {args.steps}: needs at least 3 × --save-interval "
              f"({3 * args.save_interval}) for a checkpoint to fall back to", file=sys.stderr)
        return 1
    bench = Bench(Path(args.out).resolve(), args.steps, args.save_interval, args.ranks, args.seed)
    ref_dir, ref = bench.reference()
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = bench.fault(name, ref_dir, ref)
        print(f"[{time.perf_counter() - t0:.0f} s] {name}: resumed from {row['resumed_from']}, "
              f"steps lost {row['steps_lost']}, bitwise {row['bitwise']}", flush=True)
        rows.append(row)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
