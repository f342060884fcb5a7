"""``--config FILE``: a run's config from a file, as Megatron-LM's ``--yaml-cfg`` and torchtitan's
``--job.config_file`` start one. The file is a run's own ``config.json`` (``RunConfig.to_json``)
or YAML / JSON with the same fields, nested by section; a field it leaves out takes its preset's
value (``preset:`` in the file, else ``--preset``, else tiny). Every value is typed as ``--set``
types it (``config._typed``), so ``lr: 1e-3`` (a string to YAML 1.1) is a float. Flags given
beside ``--config`` override it (``arguments.config_from_args``).

A file gives the run, never where a run reads and writes: its ``FieldKind.LOCATION`` fields
(``config.field_kinds``: ``train.save``, ``train.load``, the exports, ``--data-digest``,
``--eval-dump-dir``, the TensorBoard and W&B directories, ``--override-data-order``) keep this
command line's values, so another run's ``config.json`` neither resumes that run (its
``train.load``) nor writes over its outputs (its ``train.export_hf``). :func:`read` returns what
it left out, for the one-line note ``arguments.config_from_args`` prints.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import RunConfig, location_fields
from rtd_scale.presets import PRESETS, preset

# the directory under train.save a field defaults to: not worth naming in the note
_DERIVED_FROM_SAVE = {"train.tensorboard_dir": "tensorboard", "monitor.wandb_save_dir": "wandb"}


def _load(path: str) -> dict[str, Any]:
    """The file's mapping: JSON for ``*.json``, YAML otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserInputError(f"--config {path}: cannot read it ({e.strerror}); pass a run's "
                             "config.json or a YAML file of its fields") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserInputError(f"--config {path}: not JSON (line {e.lineno}: {e.msg})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise UserInputError(f"--config {path}: not YAML ({where}"
                                 f"{getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"--config {path}: expected a mapping of config sections (model:, "
                             f"train:, …), got {type(data).__name__}")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values, section by section (a list is one value)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = _merge(base[key], value)
        else:
            out[key] = value
    return out


def _take_locations(data: dict[str, Any]) -> dict[str, Any]:
    """Remove the ``FieldKind.LOCATION`` fields from ``data`` (a file's nested mapping); returns
    those that name something (not None, False or empty), by dotted path, but for a directory
    the run derives from ``train.save`` anyway."""
    left: dict[str, Any] = {}
    for dotted in location_fields():
        section, name = dotted.split(".")
        values = data.get(section)
        if isinstance(values, dict) and name in values:
            value = values.pop(name)
            if value not in (None, False, "", []):
                left[dotted] = value
    save = left.get("train.save")
    for dotted, sub in _DERIVED_FROM_SAVE.items():
        if save and left.get(dotted) == os.path.join(save, sub):
            del left[dotted]
    return left


def read(path: str, preset_flag: Optional[str] = None) -> tuple[RunConfig, dict[str, Any]]:
    """The config of ``--config path`` (``preset_flag``: ``--preset`` given beside it), built
    and validated as ``RunConfig.from_dict`` builds one, without the file's
    ``FieldKind.LOCATION`` fields; and those fields' values it left out, by dotted path.

    Raises:
        UserInputError: one line naming the file and the field, and the fix.
    """
    data = _load(path)
    name = data.get("preset", preset_flag or "tiny")
    if preset_flag is not None and name != preset_flag:
        raise UserInputError(f"--config {path} names preset {name!r}, --preset {preset_flag}; "
                             "drop --preset, or change the file's preset")
    if name not in PRESETS:
        raise UserInputError(f"--config {path}: preset {name!r} is unknown; choose one of "
                             f"{', '.join(PRESETS)}")
    left_out = _take_locations(data)
    fields = _merge(preset(name).to_dict(), data)
    try:
        return RunConfig.from_dict(fields), left_out
    except UserInputError as e:
        raise UserInputError(f"--config {path}: {e}") from None


def left_out_note(path: str, left_out: dict[str, Any], cfg: RunConfig,
                  flags: dict[str, str]) -> Optional[str]:
    """The note naming the fields :func:`read` left out of ``path`` that this command line did
    not set either (their value in ``cfg`` is still the preset's), each as its flag (``flags``:
    field → flag) and value; None when there are none."""
    base = preset(cfg.preset)
    shown = []
    for dotted, value in left_out.items():
        section, name = dotted.split(".")
        if getattr(getattr(cfg, section), name) != getattr(getattr(base, section), name):
            continue  # the command line gave this run its own
        flag = flags.get(dotted)
        if flag is None:
            shown.append(f"--set {dotted}={value}")
        elif isinstance(value, bool):
            shown.append(flag)
        else:
            shown.append(f"{flag} {value}")
    if not shown:
        return None
    return (f"note: --config {path}: left out {' '.join(shown)} (where that run read and "
            "wrote); give them on this command line to use them")
