"""Which checkpoint ``--load`` takes (completion records, fallback, explicit tags, checkpoints
from before records) and safe loading (crafted pickles), on real files in a temporary directory.
The real launcher runs of the same faults are in tests/e2e/test_checkpoint_faults.py."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint import checks, files as ckpt_files
from rtd_scale.training.checkpoint.checks import check_safe_to_load
from rtd_scale.training.checkpoint.choose import choose, split_load
from rtd_scale.training.checkpoint.files import (CheckpointReadError, SafeCheckpointEngine,
                                                 safe_load)

WORLD = 2


def make_checkpoint(run: Path, step: int, *, record: bool = True) -> Path:
    """A checkpoint directory laid out as ``checkpoint/save.py`` leaves it for 2 ranks under ZeRO-3:
    DeepSpeed's files (real torch files), both RNG files, the metadata, then the record."""
    d = run / ckpt_files.tag_for(step)
    d.mkdir(parents=True)
    for r in range(WORLD):
        torch.save({"module": {"w": torch.full((4,), float(step))}, "global_steps": step},
                   d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"exp_avg": torch.zeros(64)}},
                   d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"cpu": torch.get_rng_state()}, d / ckpt_files.rng_file(r))
    meta = {"step": step, "consumed_samples": 16 * step, "layout": {"world_size": WORLD},
            "config": {}, "record_format": ckpt_files.RECORD_FORMAT}
    (d / ckpt_files.META_FILE).write_text(json.dumps(meta))
    if record:
        ckpt_files.write_record(str(d), step)
    (run / "latest").write_text(d.name)
    return d


@pytest.fixture
def run(tmp_path) -> Path:
    """Complete checkpoints at steps 5 and 10; ``latest`` names global_step10."""
    run = tmp_path / "run"
    make_checkpoint(run, 5)
    make_checkpoint(run, 10)
    return run


def optim(run: Path, step: int, rank: int = 1) -> Path:
    return run / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_the_record_lists_every_file_with_its_size(run):
    record = json.loads((run / "global_step10" / ckpt_files.RECORD_FILE).read_text())
    files = sorted(os.listdir(run / "global_step10"))
    files.remove(ckpt_files.RECORD_FILE)
    assert sorted(record["files"]) == files and len(files) == 7
    assert record["files"]["rng_rank00001.pt"] == (run / "global_step10" /
                                                   "rng_rank00001.pt").stat().st_size
    assert record["step"] == 10 and record["bytes"] == sum(record["files"].values())


def test_the_newest_complete_checkpoint_is_taken_silently(run):
    c = choose(str(run))
    assert (c.load_dir, c.tag, c.skipped, c.notes) == (
        str(run), "global_step10", [], [])


def test_a_truncated_optimizer_state_file_falls_back_with_one_line(run):
    size = optim(run, 10).stat().st_size
    os.truncate(optim(run, 10), 100)
    c = choose(str(run))
    assert c.tag == "global_step5"
    assert c.notes == [f"note: --load {run}: skipped global_step10 (zero_pp_rank_1_mp_rank_00_"
                       f"optim_states.pt has 100 bytes, its completion record says {size}); "
                       "resuming from global_step5"]


@pytest.mark.parametrize("name", ["rng_rank00001.pt", ckpt_files.META_FILE,
                                  "zero_pp_rank_0_mp_rank_00_model_states.pt"])
def test_a_missing_file_falls_back(run, name):
    (run / "global_step10" / name).unlink()
    c = choose(str(run))
    assert c.tag == "global_step5" and c.skipped == [("global_step10", f"{name} is missing")]


def test_no_record_means_the_save_did_not_finish(run):
    (run / "global_step10" / ckpt_files.RECORD_FILE).unlink()
    c = choose(str(run))
    assert c.tag == "global_step5"
    assert c.skipped == [("global_step10", "no completion record (the save did not finish)")]


def test_a_killed_save_before_the_metadata_falls_back(run):
    """DeepSpeed's files are there, rtd_scale's RNG and metadata files and the record are not:
    the state a kill after DeepSpeed's own writes leaves."""
    for name in ("rng_rank00000.pt", "rng_rank00001.pt", ckpt_files.META_FILE,
                 ckpt_files.RECORD_FILE):
        (run / "global_step10" / name).unlink()
    c = choose(str(run))
    assert c.tag == "global_step5"
    assert "the save did not finish" in c.skipped[0][1]


@pytest.mark.parametrize("content", ["", "{\"files\": {\"a\": ", "[]"])
def test_an_unreadable_record_falls_back(run, content):
    (run / "global_step10" / ckpt_files.RECORD_FILE).write_text(content)
    c = choose(str(run))
    assert c.skipped == [("global_step10", "its completion record is unreadable")]


@pytest.mark.parametrize("latest", ["", "global_step99", "garbage\n"])
def test_latest_is_not_trusted(run, latest):
    (run / "latest").write_text(latest)
    assert choose(str(run)).tag == "global_step10"
    (run / "latest").unlink()
    assert choose(str(run)).tag == "global_step10"


def test_latest_naming_a_deleted_directory_takes_the_older_complete_one(run):
    import shutil

    shutil.rmtree(run / "global_step10")
    c = choose(str(run))  # `latest` still names global_step10
    assert (c.tag, c.skipped, c.notes) == ("global_step5", [], [])


def test_latest_naming_an_older_checkpoint_is_mentioned(run):
    (run / "latest").write_text("global_step5")
    c = choose(str(run))
    assert c.tag == "global_step10"
    assert c.notes == [f"note: {run}/latest names global_step5, but global_step10 is newer and "
                       f"complete: taking global_step10 (--load {run}/global_step5 would take "
                       "global_step5)"]


def test_several_newer_damaged_checkpoints_are_named_in_one_line(run):
    make_checkpoint(run, 15, record=False)
    os.truncate(optim(run, 10, rank=0), 1)
    c = choose(str(run))
    assert c.tag == "global_step5"
    assert [t for t, _ in c.skipped] == ["global_step15", "global_step10"]
    assert len(c.notes) == 1 and "global_step15 (no completion record" in c.notes[0]


def test_nothing_complete_is_an_error_naming_each_and_why(run):
    os.truncate(optim(run, 10), 1)
    os.truncate(optim(run, 5), 1)
    with pytest.raises(UserInputError) as e:
        choose(str(run))
    msg = str(e.value)
    assert "no complete checkpoint (global_step10: zero_pp_rank_1" in msg
    assert "global_step5: zero_pp_rank_1" in msg and "\n" not in msg


def test_nothing_complete_offers_training_a_fresh_start_and_the_export_another_run(run):
    """The same refusal in each reader's words: training's --load may start fresh, an export
    (tools/export_hf.py --load) can only take another run."""
    from rtd_scale.hf.consolidate import read_run

    os.truncate(optim(run, 10), 1)
    os.truncate(optim(run, 5), 1)
    with pytest.raises(UserInputError) as e:
        choose(str(run))
    assert str(e.value).endswith("); restore one from a copy, or drop --load to start fresh")
    with pytest.raises(UserInputError) as e:
        read_run(str(run), None)
    assert str(e.value).startswith(f"--load {run}: no complete checkpoint (global_step10: ")
    assert str(e.value).endswith("); restore one from a copy, or point --load at another run's "
                                 "--save directory"), str(e.value)


def test_no_checkpoint_found_only_without_global_step_directories(tmp_path):
    (tmp_path / "latest").write_text("global_step5")
    with pytest.raises(UserInputError, match=r"no checkpoint found \(no global_step\* "
                                             r"directory\); drop --load to start fresh"):
        choose(str(tmp_path))
    with pytest.raises(UserInputError, match="no such directory"):
        choose(str(tmp_path / "nope"))


def test_an_explicit_tag_is_taken_exactly_and_newer_ones_are_mentioned(run):
    c = choose(str(run / "global_step5"))
    assert (c.load_dir, c.tag) == (str(run), "global_step5")
    assert c.notes == [f"note: resuming from global_step5; the newer global_step10 stay in "
                       f"{run}, and a later --load {run} takes the newest complete one"]
    assert split_load(str(run)) == (str(run), None)
    assert split_load(str(run / "global_step5") + "/") == (str(run), "global_step5")


def test_an_incomplete_explicit_tag_is_a_one_line_error(run):
    os.truncate(optim(run, 10), 7)
    with pytest.raises(UserInputError) as e:
        choose(str(run / "global_step10"))
    assert str(e.value) == (
        f"--load {run}/global_step10: checkpoint global_step10 is incomplete (zero_pp_rank_1_"
        f"mp_rank_00_optim_states.pt has 7 bytes, its completion record says "
        f"{optim(run, 5).stat().st_size}); complete ones there: global_step5 (--load {run} "
        "takes global_step5)")
    with pytest.raises(UserInputError, match="global_step7 does not exist"):
        choose(str(run / "global_step7"))


def test_a_missing_tag_names_the_newest_three_and_counts_the_rest(tmp_path):
    run = tmp_path / "run"
    for step in (100, 200, 300, 400, 500, 600):
        make_checkpoint(run, step)
    with pytest.raises(UserInputError) as e:
        choose(str(run / "global_step999"))
    assert str(e.value) == (
        f"--load {run}/global_step999: checkpoint global_step999 does not exist; complete ones "
        f"there: global_step600, global_step500, global_step400 and 3 older (--load {run} takes "
        "global_step600)")


def test_a_checkpoint_without_its_completion_record_never_counts(tmp_path):
    """No record: the save did not finish, whatever files are there; nothing else to take is
    one line naming each checkpoint and why."""
    run = tmp_path / "run"
    make_checkpoint(run, 5, record=False)
    with pytest.raises(UserInputError) as e:
        choose(str(run))
    assert str(e.value) == (f"--load {run}: no complete checkpoint (global_step5: no completion "
                            "record (the save did not finish)); restore one from a copy, or drop "
                            "--load to start fresh")
    make_checkpoint(run, 3)
    assert choose(str(run)).tag == "global_step3"
    with pytest.raises(UserInputError, match="global_step5 is incomplete"):
        choose(str(run / "global_step5"))


def test_holds_run(tmp_path, run):
    assert ckpt_files.holds_run(str(tmp_path / "fresh")) is None
    assert ckpt_files.holds_run(str(run)) == "global_step10"
    (tmp_path / "only_latest").mkdir()
    (tmp_path / "only_latest" / "latest").write_text("")
    assert ckpt_files.holds_run(str(tmp_path / "only_latest")) == "latest"


# ------------------------------------------------------------------------ safe loading ----

class Payload:
    """Unpickling this creates the marker file (``open(marker, "w")``): code that runs."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path, zipped: bool) -> None:
    obj = {"x": Payload(marker), "module": {"w": torch.zeros(2)}}
    if not zipped:  # plain pickle has no safe form of a tensor: the payload alone
        obj = {"x": Payload(marker)}
    if zipped:
        torch.save(obj, path)  # torch's zip format, the payload in data.pkl
    else:
        with open(path, "wb") as f:  # a bare pickle (protocol 2: no frames, so the refusal
            pickle.dump(obj, f, protocol=2)  # is at the GLOBAL itself)


@pytest.mark.parametrize("zipped", [True, False], ids=["torch-zip", "bare-pickle"])
def test_the_crafted_payload_is_live(tmp_path, zipped):
    """The test's payload really runs when unpickled without weights_only."""
    marker = tmp_path / "marker"
    plant(tmp_path / "f.pt", marker, zipped)
    if zipped:
        torch.load(tmp_path / "f.pt", weights_only=False)
    else:
        with open(tmp_path / "f.pt", "rb") as f:
            pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["torch-zip", "bare-pickle"])
@pytest.mark.parametrize("kind", ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                  "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                  "rng_rank00001.pt"])
def test_a_crafted_pickle_is_refused_and_never_runs(run, tmp_path, kind, zipped):
    marker = tmp_path / "marker"
    path = run / "global_step10" / kind
    plant(path, marker, zipped)
    for load in (lambda: check_safe_to_load(str(path.parent)),  # before anything is built
                 lambda: safe_load(str(path)),  # rtd_scale's own loads
                 lambda: SafeCheckpointEngine(None).load(str(path), "cpu")):  # DeepSpeed's
        with pytest.raises(UserInputError) as e:
            load()
        assert str(e.value).startswith(f"{path}: refused to load: it holds Python objects "
                                       "other than tensors")
        assert "(GLOBAL io.open)" in str(e.value)
        assert "\n" not in str(e.value)
    assert not marker.exists()


def test_deepspeeds_record_classes_load_under_weights_only(tmp_path):
    """The allow-list: the classes DeepSpeed 0.19.8 puts into ZeRO optimizer states."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
             "param_slice_mappings": [{"w": fragment_address(numel=4, start=8)}],
             "exp_avg": torch.arange(3.0)}
    torch.save(state, tmp_path / "optim_states.pt")
    with pytest.raises(pickle.UnpicklingError):  # torch alone refuses them
        torch.load(tmp_path / "optim_states.pt", weights_only=True)
    check_safe_to_load(str(tmp_path))
    back = safe_load(str(tmp_path / "optim_states.pt"))
    assert back["zero_stage"] is ZeroStageEnum.weights
    assert back["loss_scaler"].cur_scale == 1.0
    assert back["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=8)
    assert torch.equal(back["exp_avg"], torch.arange(3.0))


def test_a_truncated_file_is_a_one_line_error_naming_it(tmp_path):
    torch.save({"w": torch.zeros(1000)}, tmp_path / "a.pt")
    os.truncate(tmp_path / "a.pt", 300)
    with pytest.raises(CheckpointReadError) as e:
        safe_load(str(tmp_path / "a.pt"))
    assert str(e.value).startswith(f"{tmp_path / 'a.pt'}: unreadable (")
    assert "\n" not in str(e.value) and e.value.every_rank


def test_one_list_of_checks_each_with_its_moment():
    """The checks every reader runs (training's --load, the export, the layout-free load), in
    the order they run."""
    M = checks.Moment
    assert [(c.name, c.moment) for c in checks.CHECKS] == [
        ("complete", M.CHOOSE), ("safe_pickles", M.BEFORE_BUILD), ("weights_only", M.LOAD),
        ("files_found", M.AFTER_LOAD), ("finite_weights", M.AFTER_LOAD)]


class _LoadedEngine:
    """What the AFTER_LOAD checks read of a DeepSpeed engine: its module, device and checkpoint
    engine (here rtd_scale's real one, over no DeepSpeed engine)."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")
        self.checkpoint_engine = SafeCheckpointEngine(None)


def test_non_finite_loaded_weights_name_the_damaged_file_read(tmp_path):
    """A NaN in the loaded weights: the line names the file it came from among those read (the
    other file is intact), both counts, and the fix in the reader's words."""
    module = torch.nn.Linear(2, 2)
    healthy, damaged = tmp_path / "a_model_states.pt", tmp_path / "b_optim_states.pt"
    torch.save({"module": {"w": torch.ones(3)}}, healthy)
    torch.save({"fp32": [torch.tensor([1.0, float("nan"), float("inf")])], "step": 3}, damaged)
    engine = _LoadedEngine(module)
    for path in (healthy, damaged):
        engine.checkpoint_engine.load(str(path), "cpu")
    with torch.no_grad():
        module.weight[0, 0] = float("nan")
    with pytest.raises(UserInputError) as e:
        checks.run(checks.Moment.AFTER_LOAD, engine=engine, ckpt_dir=str(tmp_path),
                   loaded=str(tmp_path), flag="--load run", earlier="export an earlier one")
    assert str(e.value) == (
        f"{damaged}: damaged: it holds 2 inf/NaN value(s) although its size matches the "
        f"completion record (the loaded weights hold 1); export an earlier one or delete "
        f"{tmp_path}")


def test_non_finite_weights_without_a_damaged_file_name_the_checkpoint(tmp_path):
    module = torch.nn.Linear(2, 2)
    with torch.no_grad():
        module.bias[:] = float("inf")
    with pytest.raises(UserInputError) as e:
        checks.check_finite_weights(_LoadedEngine(module), str(tmp_path))
    assert str(e.value) == (
        f"{tmp_path}: the loaded weights hold 2 inf/NaN value(s): a file of this checkpoint is "
        "damaged although its size matches the completion record; resume from an earlier "
        f"checkpoint (--load DIR/global_stepN) or delete {tmp_path}")
    checks.check_finite_weights(_LoadedEngine(torch.nn.Linear(2, 2)), str(tmp_path))  # finite


def test_a_load_that_found_no_files_is_one_line():
    with pytest.raises(UserInputError) as e:
        checks.run(checks.Moment.AFTER_LOAD, engine=_LoadedEngine(torch.nn.Linear(2, 2)),
                   ckpt_dir="run/global_step3", loaded=None, flag="--load run")
    assert str(e.value) == "--load run: DeepSpeed could not load global_step3"


def test_a_failed_save_names_the_newest_complete_checkpoint_before_it(tmp_path):
    """What a full disk's one line names (training/checkpoint/save.py; the real disk through the
    launcher: tests/e2e/test_checkpoint_faults.py): the newest complete checkpoint other than
    the failed one, skipping one without its record."""
    from rtd_scale.training.checkpoint.save import _previous_complete

    run = tmp_path / "run"
    make_checkpoint(run, 1)
    make_checkpoint(run, 2, record=False)
    make_checkpoint(run, 3)
    assert _previous_complete(str(run), "global_step3") == "global_step1"
    assert _previous_complete(str(run), "global_step4") == "global_step3"
