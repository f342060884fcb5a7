"""Which checkpoint ``--load`` takes: the newest one that passes the CHOOSE checks
(``checks.CHECKS``: its completion record and every file's size), whatever ``latest`` says, or
exactly the named ``DIR/global_stepN``; the export takes the same (``hf/consolidate.py``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint import checks
from rtd_scale.training.checkpoint.files import latest_tag, list_tags, step_of


@dataclass
class Choice:
    """The checkpoint ``--load`` takes, and what it passed over."""

    load_dir: str
    tag: str
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer (tag, reason)
    notes: list[str] = field(default_factory=list)  # one line each, for rank 0 to print

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)


def split_load(load: str) -> tuple[str, Optional[str]]:
    """``--load DIR`` → (DIR, None); ``--load DIR/global_stepN`` (a checkpoint directory, as
    DeepSpeed names them) → (DIR, "global_stepN")."""
    path = os.path.normpath(load)
    base = os.path.basename(path)
    if step_of(base) is not None and not list_tags(path):
        return os.path.dirname(path) or ".", base
    return load, None


# How a refusal tells training's --load to go on without a checkpoint (the export passes its own).
START_FRESH = "drop --load to start fresh"


def choose(load: str, fresh: str = START_FRESH) -> Choice:
    """The checkpoint ``--load load`` resumes from: the newest complete one in the directory
    (whatever ``latest`` says), or exactly the named ``DIR/global_stepN``. ``fresh``: what a
    refusal offers besides restoring a checkpoint.

    Raises:
        UserInputError: no such directory; no complete checkpoint (naming each one and why);
            the named checkpoint is incomplete.
    """
    load_dir, tag = split_load(load)
    if not os.path.isdir(load_dir):
        raise UserInputError(f"--load {load}: no such directory; point --load at a --save "
                             f"directory of an earlier run, or {fresh}")
    tags = list_tags(load_dir)
    verdicts = {t: checks.verdict(os.path.join(load_dir, t)) for t in tags}
    complete = [t for t in tags if verdicts[t] is None]
    if tag is not None:
        reason = verdicts.get(tag)
        more = f" and {len(complete) - 3} older" if len(complete) > 3 else ""
        better = (f"; complete ones there: {', '.join(complete[:3])}{more} (--load {load_dir} "
                  f"takes {complete[0]})" if complete else "")
        if tag not in verdicts:
            raise UserInputError(f"--load {load}: checkpoint {tag} does not exist{better}")
        if reason is not None:
            raise UserInputError(f"--load {load}: checkpoint {tag} is incomplete ({reason})"
                                 f"{better}")
        choice = Choice(load_dir, tag)
        newer = [t for t in complete if step_of(t) > step_of(tag)]
        if newer:
            choice.notes.append(
                f"note: resuming from {tag}; the newer {', '.join(newer)} stay in {load_dir}, "
                f"and a later --load {load_dir} takes the newest complete one")
    elif not tags:
        raise UserInputError(f"--load {load}: no checkpoint found (no global_step* directory); "
                             f"{fresh}")
    elif not complete:
        why = "; ".join(f"{t}: {verdicts[t]}" for t in tags[:4])
        raise UserInputError(f"--load {load}: no complete checkpoint ({why}); restore one from "
                             f"a copy, or {fresh}")
    else:
        tag = complete[0]
        choice = Choice(load_dir, tag)
        choice.skipped = [(t, verdicts[t]) for t in tags if step_of(t) > step_of(tag)]
        if choice.skipped:
            choice.notes.append(
                f"note: --load {load}: skipped " + "; ".join(
                    f"{t} ({why})" for t, why in choice.skipped) + f"; resuming from {tag}")
        named = latest_tag(load_dir)
        if named in complete and step_of(named) < step_of(tag):
            choice.notes.append(
                f"note: {load_dir}/latest names {named}, but {tag} is newer and complete: taking "
                f"{tag} (--load {os.path.join(load_dir, named)} would take {named})")
    return choice


def newest_complete(save_dir: str) -> Optional[str]:
    """The tag ``--load save_dir`` would take, or None when it would refuse (the Slurm
    launcher's question before it decides to pass ``--load``)."""
    try:
        return choose(save_dir).tag
    except UserInputError:
        return None
