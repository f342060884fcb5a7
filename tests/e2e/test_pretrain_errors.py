"""Bad input to the entry point: one line naming the thing and the fix, exit 2, nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rtd_scale import arguments, cli_errors, pretrain
from tests.helpers.env import REPO, TEST_DATA
from tests.helpers.launcher import launch, pretrain_error as _error


def _args(wiki_shards, save, *extra):
    tok, prefix = wiki_shards
    return ["--ds_config", "ds_configs/zero3.json", "--data-path", prefix, "--tokenizer-model",
            tok, "--save", str(save), "--train-iters", "2", "--micro-batch-size", "4",
            "--global-batch-size", "8", *extra]


def test_ds_config_contradicting_the_flags(wiki_shards, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 3}}))
    save = tmp_path / "run"
    argv = _args(wiki_shards, save)
    argv[1] = str(cfg)
    msg = _error(capsys, argv, monkeypatch)
    assert f"--ds_config {cfg}: train_batch_size=64 contradicts --global-batch-size" in msg
    assert not save.exists()


def test_load_without_checkpoint(wiki_shards, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    save = tmp_path / "run"
    msg = _error(capsys, _args(wiki_shards, save, "--load", str(empty)), monkeypatch)
    assert f"--load {empty}: no checkpoint found" in msg and "drop --load" in msg
    assert not save.exists()


def test_tokenizer_that_does_not_match_the_shards(wiki_shards, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other"
    subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input",
                    str(TEST_DATA / "wiki_sample.jsonl"), "--vocab-size", "600",
                    "--output-prefix", str(other)], check=True, capture_output=True)
    argv = _args(wiki_shards, tmp_path / "run")
    argv[5] = str(other) + ".model"
    msg = _error(capsys, argv, monkeypatch)
    assert wiki_shards[1] in msg and "tokenizer" in msg
    assert not (tmp_path / "run").exists()


def test_missing_shards_and_bad_batch(wiki_shards, tmp_path, capsys, monkeypatch):
    argv = _args(wiki_shards, tmp_path / "run")
    argv[3] = str(tmp_path / "nope_text_document")
    assert "nope_text_document" in _error(capsys, argv, monkeypatch)
    argv = _args(wiki_shards, tmp_path / "run", "--global-batch-size", "12")
    assert "--micro-batch-size 4 does not divide the 6 samples per data-parallel rank per step " \
        "(global 12 / DP 2); micro-batch sizes that do: 1 2 3 6" in _error(capsys, argv,
                                                                           monkeypatch)


def test_launcher_reports_a_user_error_without_traceback(wiki_shards, tmp_path):
    r = launch(_args(wiki_shards, tmp_path / "run", "--load", str(tmp_path / "missing")))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    assert f"error: --load {tmp_path / 'missing'}: no such directory" in r.stderr + r.stdout
    # the config warns (2 steps × 8 samples end inside the warm-up), but the run is refused:
    # no warning about a run that never starts (test_refused_run_prints_no_config_warning)
    assert "warm-up" not in r.stderr + r.stdout


def test_launcher_prints_a_flag_error_once(wiki_shards, tmp_path):
    """An abbreviated flag through the 2-rank launcher: rank 0 prints the one line, rank 1
    exits with the same status silently, and nothing is written."""
    r = launch(_args(wiki_shards, tmp_path / "run", "--train-it", "5"))
    out = r.stderr + r.stdout
    assert r.returncode != 0
    assert [line for line in out.splitlines() if "error:" in line] == [
        "error: unrecognized arguments: --train-it 5 (did you mean --train-iters?); "
        "rtd_scale/pretrain.py --help lists every flag"], out[-3000:]
    assert "Traceback" not in out
    assert not (tmp_path / "run").exists()


def test_unresolvable_master_addr(wiki_shards, tmp_path):
    """MASTER_ADDR as the `deepspeed` launcher passes it to the ranks of one node of a
    multi-node run (`--hostfile H --no_ssh --node_rank 0 --master_addr HOST`; on one host
    without a hostfile the launcher forces 127.0.0.1): a host that does not resolve is one line
    within seconds, not c10d's "gai error" retries until the process-group timeout. The run
    itself validates, so its configuration warning comes first, as one line, once."""
    import time

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    t0 = time.monotonic()
    r = launch(_args(wiki_shards, tmp_path / "run"), timeout=540, launcher_args=(
        "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0",
        "--master_addr", "no-such-host.invalid"))
    elapsed = time.monotonic() - t0
    out = r.stderr + r.stdout
    assert r.returncode != 0
    line = ("error: MASTER_ADDR=no-such-host.invalid: the host name does not resolve (")
    assert out.count(line) == 1, out[-3000:]
    assert ("); set the launcher's --master_addr (deepspeed, torchrun) or MASTER_ADDR to the "
            "first node's host name or IP address") in out
    assert "gai error" not in out and "Traceback" not in out
    # c10d would retry the name until the process-group timeout (10 minutes by default);
    # the rest is the start-up of two ranks, minutes on a loaded 2-core CI machine
    assert elapsed < 300, elapsed
    # rtd_scale's own warnings are one line each, from rank 0 only
    assert out.count("warning: the learning-rate warm-up (") == 1, out[-3000:]
    assert "UserWarning: the learning-rate" not in out and "warnings.warn(" not in out


def test_refused_run_prints_no_config_warning(wiki_shards, tmp_path, capsys, monkeypatch,
                                              recwarn):
    """A config that warns (2 steps × 8 samples end inside the warm-up) and is then refused
    (--load of a directory that does not exist): one stderr line, the error, and no warning."""
    argv = _args(wiki_shards, tmp_path / "run", "--load", str(tmp_path / "missing"))
    with pytest.warns(UserWarning, match="the learning-rate warm-up"):  # the config does warn
        arguments.config_from_args(arguments.build_parser().parse_args(argv))
    recwarn.clear()
    msg = _error(capsys, argv, monkeypatch)
    assert msg.startswith(f"error: --load {tmp_path / 'missing'}: no such directory"), msg
    assert [str(w.message) for w in recwarn] == []
    assert not (tmp_path / "run").exists()


def test_unwritable_tensorboard_dir(wiki_shards, tmp_path, capsys, monkeypatch):
    """Refused at start with the other paths, naming the flag; --save stays unwritten. Tests run
    as root, which may write a directory whose mode forbids it, so the unwritable places are a
    path under a regular file and one under /proc."""
    f = tmp_path / "a_file"
    f.write_text("x")
    save = tmp_path / "run"
    msg = _error(capsys, _args(wiki_shards, save, "--tensorboard-dir", str(f / "tb")),
                 monkeypatch)
    assert msg == (f"error: --tensorboard-dir {f / 'tb'}: cannot be created: {f} is a file, not "
                   "a directory; pass a writable directory to --tensorboard-dir")
    assert not save.exists()
    msg = _error(capsys, _args(wiki_shards, save, "--tensorboard-dir", str(f)), monkeypatch)
    assert msg == (f"error: --tensorboard-dir {f}: exists and is not a directory; pass a "
                   "writable directory to --tensorboard-dir")
    msg = _error(capsys, _args(wiki_shards, save, "--tensorboard-dir", "/proc/rtd_scale_tb/x"),
                 monkeypatch)
    # root may write anywhere os.access says, but /proc refuses the new entry (ENOENT, which
    # must not read as a missing parent); another user is refused by its mode
    assert msg in {"error: --tensorboard-dir /proc/rtd_scale_tb/x: cannot be created: /proc is "
                   f"not writable ({why}); pass a writable directory to --tensorboard-dir"
                   for why in ("it takes no new directories", "Permission denied")}, msg
    assert not save.exists()
    # a writable one passes this check, and the probe leaves nothing behind
    ok = tmp_path / "tb_parent"
    ok.mkdir()
    cli_errors.check_writable_dir(str(ok / "tb"), "--tensorboard-dir")
    assert list(ok.iterdir()) == []


def test_unwritable_eval_dump_dir(wiki_shards, tmp_path, capsys, monkeypatch):
    """--eval-dump-dir is checked at start as --tensorboard-dir is, not at the first
    validation's torch.save; --save stays unwritten."""
    f = tmp_path / "a_file"
    f.write_text("x")
    save = tmp_path / "run"
    for dump, what in ((f, "exists and is not a directory"),
                       (f / "d", f"cannot be created: {f} is a file, not a directory")):
        msg = _error(capsys, _args(wiki_shards, save, "--eval-dump-dir", str(dump),
                                   "--eval-interval", "1", "--eval-iters", "1"), monkeypatch)
        assert msg == (f"error: --eval-dump-dir {dump}: {what}; pass a writable directory to "
                       "--eval-dump-dir")
        assert not save.exists()


def _fake_checkpoint(root, step=4, layout=None, model=None, train=None):
    from rtd_scale.presets import preset
    from rtd_scale.training.checkpoint.files import write_record

    tag = root / f"global_step{step}"
    tag.mkdir(parents=True)
    (root / "latest").write_text(f"global_step{step}")
    cfg = preset("tiny").to_dict()
    cfg["model"]["vocab_size"] = 1000
    if model:
        cfg["model"]["discriminator"].update(model)
    cfg["train"].update(train or {})
    layout = layout or {"world_size": 2, "data_parallel_size": 2, "tensor_model_parallel_size": 1,
                        "pipeline_model_parallel_size": 1, "zero_stage": 3}
    (tag / "rtd_meta.json").write_text(json.dumps(
        {"step": step, "consumed_samples": 32, "layout": layout, "config": cfg}))
    write_record(str(tag), step)  # complete, as a finished save leaves it
    return root


def test_save_into_an_existing_run_needs_load(wiki_shards, tmp_path, capsys, monkeypatch):
    run = _fake_checkpoint(tmp_path / "run")
    msg = _error(capsys, _args(wiki_shards, run), monkeypatch)
    assert f"--save {run}: already holds a run (global_step4); pass --load {run}" in msg
    assert (run / "latest").read_text() == "global_step4"  # untouched


def test_load_refuses_a_layout_it_cannot_convert_or_another_model(wiki_shards, tmp_path, capsys,
                                                                   monkeypatch):
    """Another TP, PP, DP size, ZeRO stage or precision resumes (tests/e2e/test_resume_layout.py),
    except from ZeRO-0 under --fp16, whose AdamW state DeepSpeed keeps in one flat fp16
    optimizer: one line naming both layouts, both precisions and the fix. This run: TP 1 × PP 1
    × DP 2, ZeRO-3, fp32."""
    layout = {"world_size": 1, "data_parallel_size": 1, "tensor_model_parallel_size": 1,
              "pipeline_model_parallel_size": 1, "zero_stage": 0}
    run = _fake_checkpoint(tmp_path / "zero0_fp16", layout=layout, train={"precision": "fp16"})
    msg = _error(capsys, _args(wiki_shards, tmp_path / "new", "--load", str(run)), monkeypatch)
    assert msg == (f"error: --load {run}: global_step4 was saved at TP 1 × PP 1 × DP 1, ZeRO-0, "
                   "fp16, this run is TP 1 × PP 1 × DP 2, ZeRO-3, fp32: the checkpoint is ZeRO-0 "
                   "under "
                   "--fp16, whose AdamW state DeepSpeed keeps in one flat fp16 optimizer that "
                   "cannot be re-split; resume at the checkpoint's layout, or use a "
                   "ds_configs/zero1.json-style file on both runs"), msg
    run = _fake_checkpoint(tmp_path / "b", model={"num_layers": 6})
    msg = _error(capsys, _args(wiki_shards, tmp_path / "new", "--load", str(run)), monkeypatch)
    assert "holds another model (model.discriminator.num_layers 6 → 4)" in msg
    assert not (tmp_path / "new").exists()


def test_load_at_or_past_train_iters_is_nothing_to_do(wiki_shards, tmp_path, capsys,
                                                      monkeypatch):
    run = _fake_checkpoint(tmp_path / "run", step=4)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = _args(wiki_shards, run, "--load", str(run))
    argv[argv.index("--train-iters") + 1] = "4"
    assert pretrain.main(argv) == 0
    assert "nothing to do: " in capsys.readouterr().out
    assert not (run / "config.json").exists()


def test_unusable_save_and_bad_zero_stage(wiki_shards, tmp_path, capsys, monkeypatch):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert f"--save {f}: exists and is not a directory" in _error(
        capsys, _args(wiki_shards, f), monkeypatch)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    argv = _args(wiki_shards, tmp_path / "run")
    argv[1] = str(ds)
    assert "zero_optimization.stage is 7; DeepSpeed's stages are 0, 1, 2 and 3" in _error(
        capsys, argv, monkeypatch)


def test_a_pretrained_checkpoint_of_another_model_is_refused_before_save_is_made(
        wiki_shards, tmp_path, capsys, monkeypatch):
    """What config.json alone says (another attention family, no config.json at all) refuses the
    run before --save is created, where it used to be found after the model was built."""
    deberta = tmp_path / "deberta"
    deberta.mkdir()
    (deberta / "config.json").write_text(json.dumps({"model_type": "deberta-v2",
                                                     "architectures": ["DebertaV2Model"]}))
    save = tmp_path / "out" / "run"
    msg = _error(capsys, _args(wiki_shards, save, "--pretrained-checkpoint", str(deberta)),
                 monkeypatch)
    assert msg == (f"error: --pretrained-checkpoint {deberta}: a deberta-v2 checkpoint has "
                   "disentangled attention; pass --attention-type disentangled")
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _error(capsys, _args(wiki_shards, save, "--pretrained-checkpoint", str(empty)),
                 monkeypatch)
    assert msg.startswith(f"error: --pretrained-checkpoint {empty}: no config.json; pass ")
    assert not (tmp_path / "out").exists()
