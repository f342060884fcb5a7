"""``--config FILE``: a run's config from a file, as Megatron-LM's ``--yaml-cfg`` and torchtitan's
``--job.config_file`` start one. The file is a run's own ``config.json`` (``RunConfig.to_json``)
or YAML / JSON with the same fields, nested by section; a field it leaves out takes its preset's
value (``preset:`` in the file, else ``--preset``, else tiny). Every value is typed as ``--set``
types it (``config._typed``), so ``lr: 1e-3`` (a string to YAML 1.1) is a float. Flags given
beside ``--config`` override it (``arguments.config_from_args``).

Paths the run derives from ``train.save`` (``<save>/tensorboard``, ``<save>/wandb``) are derived
again from the new run's ``--save``: a recorded run's config.json does not send a new run's
TensorBoard files into the old run's directory.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import RunConfig
from rtd_scale.presets import PRESETS, preset

# (section, field, the directory under train.save it defaults to)
_DERIVED_FROM_SAVE = (("train", "tensorboard_dir", "tensorboard"),
                      ("monitor", "wandb_save_dir", "wandb"))


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


def read(path: str, preset_flag: Optional[str] = None) -> RunConfig:
    """The config of ``--config path`` (``preset_flag``: ``--preset`` given beside it), built
    and validated as ``RunConfig.from_dict`` builds one.

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
    fields = _merge(preset(name).to_dict(), data)
    save = (fields.get("train") or {}).get("save")
    for section, key, sub in _DERIVED_FROM_SAVE:
        values = fields.get(section)
        if save and isinstance(values, dict) and values.get(key) == os.path.join(save, sub):
            values[key] = None  # derived again from this run's --save
    try:
        return RunConfig.from_dict(fields)
    except UserInputError as e:
        raise UserInputError(f"--config {path}: {e}") from None
