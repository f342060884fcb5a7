"""One rule for every optimizer setting on ``--load`` (training/engine.py
``resolve_resume_optimizer``): a difference from the checkpoint's is refused in one line naming
both values, unless ``--override-opt_param-scheduler`` (the flags' values) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint's, copied into the config); and after
the load the optimizer runs with what the config says (checkpoint/load.py
``apply_hyperparameters``). The launches are in tests/e2e/test_resume_changes.py."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import OptimConfig
from rtd_scale.training.checkpoint.load import apply_hyperparameters
from rtd_scale.training.engine import RESUME_FIELDS, resolve_resume_optimizer


def _saved(**changes) -> dict:
    return {**dataclasses.asdict(OptimConfig()), **changes}


def test_every_optimizer_field_is_compared():
    """A field added to OptimConfig falls under the rule (or is one of the two flags)."""
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    assert fields - set(RESUME_FIELDS) == {"override_opt_param_scheduler",
                                           "use_checkpoint_opt_param_scheduler"}


@pytest.mark.parametrize("changes,line", [
    ({"weight_decay": 0.5}, "--weight-decay 0.01 → 0.5"),
    ({"adam_beta2": 0.9, "adam_eps": 1e-3}, "--adam-beta2 0.98 → 0.9, --adam-eps 1e-06 → 0.001"),
    ({"adam_beta1": 0.8, "clip_grad": 0.5}, "--adam-beta1 0.9 → 0.8, --clip-grad 1 → 0.5"),
])
def test_a_changed_optimizer_setting_is_one_line_naming_both_values(changes, line):
    optim = dataclasses.replace(OptimConfig(), **changes)
    with pytest.raises(UserInputError) as e:
        resolve_resume_optimizer(optim, _saved(), source="runs/x")
    assert str(e.value) == (
        f"--load runs/x: the optimizer settings differ from the checkpoint's ({line}); pass "
        "--override-opt_param-scheduler to use the new values from the first resumed "
        "iteration, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def test_nothing_changed_is_no_note_and_fields_the_checkpoint_lacks_are_not_compared():
    assert resolve_resume_optimizer(OptimConfig(), _saved(), source="runs/x") is None
    older = {k: v for k, v in _saved().items() if k not in ("adam_eps", "clip_grad")}
    optim = dataclasses.replace(OptimConfig(), adam_eps=1e-3, clip_grad=0.5)
    assert resolve_resume_optimizer(optim, older, source="runs/x") is None


def test_a_schedule_change_keeps_its_words():
    optim = dataclasses.replace(OptimConfig(), lr=5e-4)
    with pytest.raises(UserInputError, match=r"the learning-rate schedule differs from the "
                                             r"checkpoint's \(--lr 0.0001 → 0.0005\)"):
        resolve_resume_optimizer(optim, _saved(), source="runs/x")


def test_override_keeps_the_flags_and_use_checkpoint_takes_the_checkpoints():
    new = dict(weight_decay=0.5, adam_beta2=0.9, adam_eps=1e-3)
    optim = dataclasses.replace(OptimConfig(), override_opt_param_scheduler=True, **new)
    note = resolve_resume_optimizer(optim, _saved(), source="runs/x")
    assert note.startswith("note: the optimizer settings differ from the checkpoint's "
                           "(--weight-decay 0.01 → 0.5, ")
    assert note.endswith("--override-opt_param-scheduler: the new values apply from the first "
                         "resumed iteration")
    assert (optim.weight_decay, optim.adam_beta2, optim.adam_eps) == (0.5, 0.9, 1e-3)

    optim = dataclasses.replace(OptimConfig(), use_checkpoint_opt_param_scheduler=True, **new)
    note = resolve_resume_optimizer(optim, _saved(), source="runs/x")
    assert note.endswith("--use-checkpoint-opt_param-scheduler: the checkpoint's values are "
                         "kept")
    assert (optim.weight_decay, optim.adam_beta2, optim.adam_eps) == (0.01, 0.98, 1e-6)


def test_after_a_load_the_optimizer_runs_with_the_configs_betas_and_eps():
    """torch's load_state_dict brings back the checkpoint's betas and eps; apply_hyperparameters
    puts this run's into every group (the schedule then sets lr and weight decay)."""
    p = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([p], betas=(0.9, 0.98), eps=1e-6)
    p.grad = torch.ones(3)
    saved.step()
    opt = torch.optim.AdamW([p], betas=(0.5, 0.5), eps=1.0)
    opt.load_state_dict(saved.state_dict())
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)  # what the load alone leaves
    optim = dataclasses.replace(OptimConfig(), adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-3)
    apply_hyperparameters(SimpleNamespace(optimizer=opt, lr_scheduler=None), optim)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["eps"] == 1e-3
