"""``--config FILE`` (rtd_scale/config_file.py): a run's config.json or YAML with its fields
starts a run, flags beside it override it, a bad field is one line naming the file and the
field, and a resume refuses a file that changes what a resume may not change. The run started
from its own config.json, loss for loss: tests/e2e/test_resume_changes.py."""
from __future__ import annotations

import json

import pytest

from rtd_scale.arguments import build_parser, config_from_args
from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import AttentionType, MaskStrategy, Precision, RunConfig
from rtd_scale.presets import preset

YAML = """\
preset: debertav3-tiny
data:
  data_path: [data/x_text_document]
  tokenizer_model: spm.model
rtd:
  mask_strategy: span
optim:
  lr: 5e-4          # a string to YAML 1.1, a float to the config
train:
  ds_config: ds_configs/zero1.json
  train_iters: 12
  precision: bf16
"""


def _from(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_a_yaml_file_sets_its_fields_over_its_preset_typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    cfg = _from("--config", str(path))
    want = preset("debertav3-tiny")
    assert (cfg.preset, cfg.optim.lr, cfg.train.train_iters) == ("debertav3-tiny", 5e-4, 12)
    assert type(cfg.optim.lr) is float
    assert cfg.rtd.mask_strategy is MaskStrategy.SPAN and cfg.train.precision is Precision.BF16
    assert cfg.model.attention_type is AttentionType.DISENTANGLED  # the preset's, not in the file
    assert cfg.to_dict()["model"] == want.to_dict()["model"]


def test_a_runs_own_config_json_reads_back_as_itself(tmp_path):
    """config.json (RunConfig.to_json, what a run writes) → --config → the same tree but for
    where the run writes: without --save it saves nothing (a note says so), with it the paths
    derived from --save are derived from the new run's."""
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(YAML)
    first = _from("--config", str(yaml_path), "--save", str(tmp_path / "a"))
    assert first.train.tensorboard_dir == str(tmp_path / "a" / "tensorboard")
    path = tmp_path / "config.json"
    path.write_text(first.to_json())
    with pytest.warns(UserWarning) as caught:
        unsaved = _from("--config", str(path))
    assert [str(w.message) for w in caught if "left out" in str(w.message)] == [
        f"note: --config {path}: left out --save {tmp_path / 'a'} (where that run read and "
        "wrote); give them on this command line to use them"]
    assert (unsaved.train.save, unsaved.train.tensorboard_dir) == (None, None)
    assert {**unsaved.to_dict(), "train": None} == {**first.to_dict(), "train": None}
    again = _from("--config", str(path), "--save", str(tmp_path / "b"))
    assert again.train.tensorboard_dir == str(tmp_path / "b" / "tensorboard")
    assert {**again.to_dict(), "train": None} == {**first.to_dict(), "train": None}


def test_every_config_field_names_its_kind():
    """One place says of every field whether it describes the run (a --config file gives it) or
    where one run reads and writes (never taken from a file): each leaf of the tree has a kind,
    and the locations are exactly these; a field of a mixed section without a kind fails."""
    import dataclasses

    from rtd_scale.config import FieldKind, _Section, field_kinds, location_fields

    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from (leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k])

    kinds = field_kinds()
    assert sorted(kinds) == sorted(leaves(preset("tiny").to_dict()))
    assert set(kinds.values()) == set(FieldKind)
    assert location_fields() == [
        "train.save", "train.load", "train.tensorboard_dir", "train.export", "train.export_hf",
        "train.data_digest", "train.eval_dump_dir", "train.override_data_order",
        "monitor.wandb_save_dir"]

    @dataclasses.dataclass(kw_only=True)
    class Mixed(_Section):
        KIND = None
        named: int = dataclasses.field(default=0, metadata={"kind": FieldKind.RUN})
        unnamed: int = 0

    with pytest.raises(AssertionError, match="unnamed: Mixed holds fields of both kinds"):
        field_kinds(Mixed)


def test_a_resumed_exporting_runs_config_json_neither_resumes_it_nor_writes_its_outputs(
        tmp_path):
    """A run resumed with --load A --save A that exported (--export-hf, --export, --data-digest,
    --eval-dump-dir, --override-data-order): its config.json started with --save C gives the
    same run, starting fresh and writing only under C; one note names what it left out as
    flags. A flag beside the file uses it again (and the note no longer names it)."""
    a = tmp_path / "A"
    outputs = ["--export-hf", f"{a}_hf", "--export", f"{a}.pt", "--data-digest", f"{a}.jsonl",
               "--eval-dump-dir", f"{a}_dumps"]
    resumed = _from("--ds_config", "z.json", "--data-path", "d", "--tokenizer-model", "t.model",
                    "--save", str(a), "--load", str(a), "--override-data-order", "--seed", "5",
                    "--wandb-project", "p", *outputs)
    path = a / "config.json"
    a.mkdir()
    path.write_text(resumed.to_json())
    c = tmp_path / "C"
    with pytest.warns(UserWarning) as caught:
        cfg = _from("--config", str(path), "--save", str(c), "--train-iters", "6")
    notes = [str(w.message) for w in caught if "left out" in str(w.message)]
    assert notes == [f"note: --config {path}: left out --load {a} --export {a}.pt --export-hf "
                     f"{a}_hf --data-digest {a}.jsonl --eval-dump-dir {a}_dumps "
                     "--override-data-order (where that run read and wrote); give them on this "
                     "command line to use them"]
    t = cfg.train
    assert (t.save, t.load, t.export, t.export_hf, t.data_digest, t.eval_dump_dir) == (
        str(c), None, None, None, None, None)
    assert not t.override_data_order
    assert (t.tensorboard_dir, cfg.monitor.wandb_save_dir) == (f"{c}/tensorboard", f"{c}/wandb")
    assert (t.seed, t.train_iters, cfg.monitor.wandb_project) == (5, 6, "p")  # the run's own

    with pytest.warns(UserWarning) as caught:
        again = _from("--config", str(path), "--save", str(c), "--load", str(a))
    assert again.train.load == str(a)
    (note,) = [str(w.message) for w in caught if "left out" in str(w.message)]
    assert "--load" not in note and f"--export-hf {a}_hf" in note


def test_flags_beside_the_file_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    cfg = _from("--config", str(path), "--lr", "1e-4", "--train-iters", "20",
                "--set", "rtd.mask_strategy=token", "--fp16")
    assert (cfg.optim.lr, cfg.train.train_iters) == (1e-4, 20)
    assert cfg.rtd.mask_strategy is MaskStrategy.TOKEN and cfg.train.precision is Precision.FP16
    assert cfg.train.ds_config == "ds_configs/zero1.json"  # the file's, no flag given


@pytest.mark.parametrize("text, message", [
    ("rtd:\n  mask_probb: 0.2\n", "rtd.mask_probb: no such field (did you mean mask_prob?); "
                                    "rtd has rtd_lambda, "),
    ("rtd:\n  zzz: 0.2\n", "rtd.zzz: no such field; rtd has rtd_lambda, "),
    ("rtd:\n  mask_prob: 1.5\n", "rtd.mask_prob must be in [0, 1], got 1.5"),
    ("train:\n  train_iters: ten\n", "train.train_iters 'ten': expected a value of type int"),
    ("model:\n  sharing: xes\n", "model.sharing 'xes': expected one of es, nes, gdes"),
    ("model: [1]\n", "model: expected a mapping of fields, got [1]"),
    ("optim:\n  lr: [1\n", "not YAML (line 3: expected ',' or ']', but got '<stream end>')"),
    ("preset: huge\n", "preset 'huge' is unknown; choose one of tiny, "),
])
def test_a_bad_field_in_the_file_is_one_line_naming_the_file_and_the_field(tmp_path, text,
                                                                             message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserInputError) as e:
        _from("--config", str(path), "--ds_config", "z.json")
    assert str(e.value).startswith(f"--config {path}: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_json_file_is_read_as_json(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train": {"ds_config": "z.json", "seed": 7},
                                "data": {"data_path": ["d"], "tokenizer_model": "t.model"}}))
    assert _from("--config", str(path)).train.seed == 7
    path.write_text('{"train": {"seed": 7,}}')
    with pytest.raises(UserInputError, match=r"^--config .*run.json: not JSON \(line 1: "):
        _from("--config", str(path))
    with pytest.raises(UserInputError, match=r"^--config .*absent.yaml: cannot read it "
                                             r"\(No such file or directory\)"):
        _from("--config", str(tmp_path / "absent.yaml"))


def test_preset_beside_a_file_that_names_another_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    with pytest.raises(UserInputError, match=r"names preset 'debertav3-tiny', --preset tiny; "
                                             "drop --preset"):
        _from("--config", str(path), "--preset", "tiny")


def _checkpoint_of_yaml(tmp_path) -> RunConfig:
    """``YAML``'s config, and a checkpoint tmp_path/run/global_step2 whose metadata holds it."""
    from rtd_scale.training.checkpoint.files import META_FILE

    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(YAML)
    saved = _from("--config", str(yaml_path))
    tag = tmp_path / "run" / "global_step2"
    tag.mkdir(parents=True)
    (tag / META_FILE).write_text(json.dumps({"layout": {"world_size": 1},
                                             "config": saved.to_dict()}))
    return saved


def test_a_resume_refuses_a_config_that_changes_the_model_in_one_line(tmp_path):
    """The resume rules (checkpoint/compat.py check_compatible, the same that refuse flags) refuse
    a --config whose model differs from the checkpoint's: one line, the field, old → new."""
    from rtd_scale.training.checkpoint.compat import check_compatible

    saved = _checkpoint_of_yaml(tmp_path)
    changed = tmp_path / "changed.yaml"
    changed.write_text(YAML + "model:\n  discriminator:\n    num_layers: 2\n")
    cfg = _from("--config", str(changed), "--load", str(tmp_path / "run"))
    check_compatible(str(tmp_path / "run"), "global_step2", saved, {"world_size": 1})
    with pytest.raises(UserInputError) as e:
        check_compatible(str(tmp_path / "run"), "global_step2", cfg, {"world_size": 1})
    assert str(e.value) == (
        f"--load {tmp_path / 'run'}: global_step2 holds another model "
        "(model.discriminator.num_layers 4 → 2); use the preset and overrides it was trained "
        f"with (see {tmp_path / 'run'}/config.json)")


def test_a_resume_refuses_a_config_files_seed_without_calling_it_a_flag(tmp_path):
    """A --config file whose train.seed differs from the checkpoint's: the refusal names the
    field and both places it may have come from (a file has no --seed), and the flag that
    fixes it; that flag beside the file passes."""
    from rtd_scale.training.checkpoint.compat import check_compatible

    saved = _checkpoint_of_yaml(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(YAML.replace("train:\n", "train:\n  seed: 99\n", 1))
    cfg = _from("--config", str(other), "--load", str(tmp_path / "run"))
    assert cfg.train.seed == 99 and saved.train.seed != 99
    with pytest.raises(UserInputError) as e:
        check_compatible(str(tmp_path / "run"), "global_step2", cfg, {"world_size": 1})
    assert str(e.value).startswith(
        f"--load {tmp_path / 'run'}: global_step2 was trained with train.seed "
        f"{saved.train.seed}, this run has 99 (from --seed or a --config file), "), str(e.value)
    assert f"pass --seed {saved.train.seed} (a flag overrides the file)" in str(e.value)
    fixed = _from("--config", str(other), "--seed", str(saved.train.seed),
                  "--load", str(tmp_path / "run"))
    assert check_compatible(str(tmp_path / "run"), "global_step2", fixed, {"world_size": 1})


def test_a_recorded_config_reads_back_without_its_warnings():
    """A checkpoint's or a run's recorded config was warned about when that run started:
    reading it back (a resume's checks, an export) says nothing; validating it again does."""
    import warnings

    cfg = preset("tiny")
    cfg.train.train_iters = 6  # the tiny preset's 30 warm-up steps never end
    with pytest.warns(UserWarning, match="peak learning rate is never reached"):
        cfg.validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = RunConfig.from_dict(cfg.to_dict())
    assert back.to_dict() == cfg.to_dict()
