"""Weights & Biases, with Megatron-LM's flags (``--wandb-project``, ``--wandb-exp-name``,
``--wandb-entity``, ``--wandb-save-dir``): the scalars TensorBoard gets, from the same logging
rank at the same steps (``metrics.MetricsLogger`` hands both the same dict), and the resolved
config (and ds_config) as the run's config.

W&B's step is the global iteration. A resumed run continues the same W&B run: the run id is kept
in ``<save>/wandb_run.json`` and read back from the ``--load`` run directory, then passed to
``wandb.init(id=…, resume="allow")``; the resumed process logs only iterations after its
checkpoint's. Iterations that a crashed run logged after its last checkpoint are logged again by
the resumed one; TensorBoard hides the old ones (``purge_step``), W&B keeps a step's first row and
ignores a step at or below the run's last (its rule that steps increase).

Offline (``WANDB_MODE=offline``, a cluster without internet): the run is written under
``<wandb_save_dir>/wandb/offline-run-*``; ``wandb sync`` uploads it later.
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Optional

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import MonitorConfig

# a run's events (a restart, a loss-spike rollback): rtd_scale/restarts.py, training/spikes.py
EVENT_PREFIXES = ("restarts/", "loss_spike/")
RUN_FILE = "wandb_run.json"  # in the run directory (--save): {"id", "project", "entity"}
INSTALL_HINT = "pip install 'rtd_scale[wandb]'"


def check_available(monitor: MonitorConfig) -> None:
    """Before anything starts: W&B asked for and the ``wandb`` package missing is one line.

    Raises:
        UserInputError: naming the flag and the extra to install.
    """
    if monitor.uses_wandb and importlib.util.find_spec("wandb") is None:
        raise UserInputError(f"--wandb-project {monitor.wandb_project}: the wandb package is not "
                             f"installed; {INSTALL_HINT} (or drop --wandb-project)")


def previous_run_id(run_dir: Optional[str]) -> Optional[str]:
    """The W&B run id recorded in ``run_dir`` (a run directory a checkpoint is loaded from)."""
    path = os.path.join(run_dir, RUN_FILE) if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return str(json.load(f)["id"])
    except (OSError, ValueError, KeyError, TypeError):
        err = UserInputError(f"{path}: not a W&B run record ({{\"id\": …}}); delete it to start "
                             "a new W&B run, or restore it to continue the old one")
        err.every_rank = True  # only the logging rank reads it
        raise err from None


class WandbLogger:
    """One W&B run, opened on the logging rank only (its ``write``/``close`` match
    ``TensorBoardLogger``'s)."""

    def __init__(self, monitor: MonitorConfig, *, config: dict[str, Any], save: Optional[str],
                 resume_dir: Optional[str]):
        """``save``: the run directory the run id is written to; ``resume_dir``: the run
        directory of the checkpoint being loaded (its recorded id is continued), or None."""
        import wandb

        run_id = previous_run_id(resume_dir)  # None: a new W&B run, W&B picks its id
        save_dir = monitor.wandb_save_dir
        os.makedirs(save_dir, exist_ok=True)
        try:
            self.run = wandb.init(project=monitor.wandb_project, entity=monitor.wandb_entity,
                                  name=monitor.wandb_exp_name, dir=save_dir, id=run_id,
                                  resume="allow", config=config)
        except Exception as e:  # wandb's own errors: no login, no network, a bad entity
            err = UserInputError(f"--wandb-project {monitor.wandb_project}: W&B could not start "
                                 f"({type(e).__name__}: {e}); run `wandb login`, or set "
                                 "WANDB_MODE=offline and `wandb sync` the run later")
            err.every_rank = True  # only the logging rank gets here
            raise err from None
        if save:
            write_atomic(os.path.join(save, RUN_FILE),
                         json.dumps({"id": self.run.id, "project": monitor.wandb_project,
                                     "entity": monitor.wandb_entity}) + "\n")

    def _event_step(self, step: int) -> int:
        """Where an event lands: its iteration, or W&B's current row where the run has passed
        it. W&B drops a row below its run's step, and an event is written at the iteration a
        run resumed from or rolled back to, which the W&B run may have logged past already."""
        return max(step, int(self.run.step or 0))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        # the step is the global iteration, as TensorBoard's; "_" tags are internal
        row = {tag: float(v) for tag, v in scalars.items() if not tag.startswith("_")}
        if row and all(tag.startswith(EVENT_PREFIXES) for tag in row):
            step = self._event_step(step)
        self.run.log(row, step=step)

    def write_text(self, tag: str, text: str, step: int) -> None:
        """An event's line (a restart's cause, a rollback) as a text value of its row, which
        W&B's run page lists; the resolved configs are the run's config (``wandb.init``)."""
        if tag.startswith(EVENT_PREFIXES):
            self.run.log({tag: text}, step=self._event_step(step))

    def close(self) -> None:
        self.run.finish()

