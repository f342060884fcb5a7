"""What a resume may change on purpose, through the real launcher, from one shared 2-step run:

* another ``--seed`` would reshuffle the data mid-epoch: refused in one line, unless
  ``--override-data-order``, which says where the new order starts;
* BERT's two-phase schedule (arXiv 1810.04805 §A.2): ``--load`` with a new ``--seq-length`` and
  ``--global-batch-size`` keeps the optimizer state and the step count, and continues at the
  same fraction of the data (``BlendedDataset.continue_after``); the modern block's context
  extension (ModernBERT) also raises the global RoPE base;
* a changed optimizer setting (``--weight-decay``, ``--adam-beta2``, ``--adam-eps``) is refused in
  one line naming both values, unless ``--override-opt_param-scheduler`` (the new values run) or
  ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's run): the optimizer's param_groups,
  the weights and ``config.json`` agree with what the log says;
* fp32 ↔ bf16 converts through the layout-free state and the losses continue;
* other training data (two documents swapped) are refused in one line naming the shard, unless
  ``--override-data-order``, which says where the new order starts.
* a shard's ``.bin`` rewritten in place with its size and mtime kept (as ``cp -p`` or
  ``rsync -t`` leave it) is other data: refused in one line naming the shard;
* another ZeRO stage at the same size continues each rank's dropout stream (the tiny preset's
  dropout 0.1): step 3 is the unchanged resume's;
* ``--config <run>/config.json`` of a resumed run that exported starts the same run again from
  step 1, to the bit, and never writes the first run's export; with ``--load``, a config file
  that changes the model is refused in one line.

The resumes that train share two rounds of one-rank launches run side by side
(``launch_together``, module fixture ``resumes``)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.env import REPO
from tests.helpers.launcher import (adam_steps, common, cut_back, fp32_weights, launch,
                                    launch_together, pretrain_error, scalars)
from tests.helpers.tools import load_tool

ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|", re.M)


@pytest.fixture(scope="module")
def two_steps(wiki_shards, tmp_path_factory):
    """A 2-step run at seq 64, global batch 16 (``common``'s), one rank; each test copies it."""
    save = tmp_path_factory.mktemp("resume_changes") / "run"
    r = launch(common(wiki_shards, save, 2, ["--eval-iters", "0"]), ranks=1)  # --seed 11
    assert r.returncode == 0, r.stderr[-3000:]
    assert (save / "latest").read_text().strip() == "global_step2"
    return save


def test_resume_with_another_seed_is_refused_unless_overridden(wiki_shards, two_steps, tmp_path,
                                                               capsys, monkeypatch):
    save = shutil.copytree(two_steps, tmp_path / "run")
    resume = common(wiki_shards, save, 3, ["--eval-iters", "0", "--load", str(save),
                                           "--seed", "4321"])  # the later --seed wins
    err = pretrain_error(capsys, resume, monkeypatch, world_size=1)
    assert err == (f"error: --load {save}: global_step2 was trained with train.seed 11, this run "
                   "has 4321 (from --seed or a --config file), which would reshuffle the data "
                   "mid-epoch (some samples read twice, others never); pass --seed 11 (a flag "
                   "overrides the file), or --override-data-order to start the new seed's order "
                   "where the run resumes")

    r = launch(resume + ["--override-data-order"], ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    note = re.search(r"^note: --override-data-order: the data order follows --seed 4321 \(the "
                     r"checkpoint's was 11\) from sample 32 on: (\S+) resumes in epoch (\d+) at "
                     r"position (\d+) of its (\d+) \(counted from 0\) of the new order, .*$",
                     r.stdout, re.M)
    assert note, r.stdout[-3000:]
    epoch, position, samples = int(note[2]), int(note[3]), int(note[4])
    assert epoch * samples + position == 32 and position < samples  # one dataset: j = k
    assert f"resumed from {save} at iteration 2 (32 samples consumed)" in r.stdout
    assert [int(m[0]) for m in ITERATION.findall(r.stdout)] == [3]


def test_second_phase_at_a_longer_sequence_and_another_batch(wiki_shards, two_steps, tmp_path):
    save = shutil.copytree(two_steps, tmp_path / "run")
    phase2 = common(wiki_shards, save, 4, ["--eval-iters", "0", "--load", str(save),
                                           "--seq-length", "128", "--global-batch-size", "8"])
    r = launch(phase2, ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    note = re.search(r"^note: --seq-length 128 \(the checkpoint's 64\): the checkpoint had read "
                     r"32 of the ([\d,]+) samples an epoch of its packing; the run continues at "
                     r"the same fraction of the data, global sample ([\d,]+) of the ([\d,]+) an "
                     r"epoch of 128-token samples \((\S+): epoch 0, position (\d+) counted from "
                     r"0\)$", r.stdout, re.M)
    assert note, r.stdout[-3000:]
    old, start, new = (int(note[i].replace(",", "")) for i in (1, 2, 3))
    assert start == 32 * new // old and int(note[5]) == start
    assert 1.8 < old / new < 2.2  # packing twice as long: about half the samples an epoch
    assert ("note: --global-batch-size 8 (the checkpoint's 16): iterations from 3 on read 8 "
            "samples each; the optimizer state, the step count and the schedule carry on"
            in r.stdout)
    assert f"resumed from {save} at iteration 2 (32 samples consumed)" in r.stdout
    # steps 3 and 4 read 8 samples each from the new position
    assert [(int(i), int(c)) for i, c in ITERATION.findall(r.stdout)] == [(3, start + 8),
                                                                          (4, start + 16)]
    # the schedule (warm-up 4 steps to 1e-3) continues at the step, not at the samples read:
    # iteration 3 is 2/4 of the way up, where 32 samples at the new batch of 8 would be 4/4
    lr = float(re.search(r"^learning rate of iteration 3: (\S+)$", r.stdout, re.M)[1])
    assert lr == pytest.approx(1e-3 * 2 / 4, rel=1e-12), lr
    # the AdamW moments came along: their step count is the run's, not the phase's
    assert adam_steps(save / "global_step2") == {2.0}
    assert adam_steps(save / "global_step4") == {4.0}


# ------------------------------------------- optimizer settings, precision, data (one fixture) ----

BF16 = ["--bf16", "--ds_config", "ds_configs/zero1.json"]  # DeepSpeed's bf16_zero_pp_rank_* files
PRECISION_REL = 5e-4


@pytest.fixture(scope="module")
def swapped_data(wiki_shards, tmp_path_factory):
    """The wiki corpus preprocessed again with its first two documents swapped (same
    documents, same counts, other order) by the real tool; returns its prefix."""
    out = tmp_path_factory.mktemp("swapped")
    lines = (REPO / "tests" / "data" / "wiki_sample.jsonl").read_text().splitlines(True)
    (out / "wiki_sample.jsonl").write_text("".join([lines[1], lines[0], *lines[2:]]))
    load_tool("preprocess_data").main(["--input", str(out / "wiki_sample.jsonl"),
                                       "--tokenizer-model", wiki_shards[0],
                                       "--output-prefix", str(out / "wiki"), "--workers", "1"])
    return str(out / "wiki_text_document")


@pytest.fixture(scope="module")
def resumes(wiki_shards, two_steps, swapped_data, tmp_path_factory):
    """Run directories and results of the resumes to step 3 of ``two_steps`` (fp32, ZeRO-3,
    saved at 2): ``same`` (nothing changed), ``checkpoint_wd`` (--weight-decay 0.5 with
    --use-checkpoint-opt_param-scheduler), ``override`` (--weight-decay 0.5 --adam-beta2 0.9
    --adam-eps 1e-3 with --override-opt_param-scheduler), ``to_bf16``
    (--bf16 at ZeRO-1), ``other_data`` (the swapped corpus with --override-data-order); ``bf16``,
    an uninterrupted bf16 ZeRO-1 run of 3 steps saved at 2, and ``to_fp32``, its checkpoint at 2
    resumed in fp32 at ZeRO-3; ``same`` also exports (``--export-hf``, its file's bytes and
    mtime kept in ``same_export``) and ``from_config`` is a run of ``same``'s config.json
    (``--config``) with ``--train-iters 4 --save-interval 2``, saving elsewhere;
    ``to_zero2``, ``two_steps`` resumed at ZeRO-2 (1 rank, as saved); and ``modern``,
    modernbert-tiny's context extension: 2 steps at 128 tokens and RoPE base 10,000 in the
    first round (``modern_phase1``, its weights at step 2 kept), then ``--load`` at 512
    tokens, global batch 4, the preset's 160,000 to step 4."""
    root = tmp_path_factory.mktemp("resumes")
    flags = {"same": ["--export-hf", str(root / "same_hf")],
             "checkpoint_wd": ["--weight-decay", "0.5",
                                           "--use-checkpoint-opt_param-scheduler"],
             "override": ["--weight-decay", "0.5", "--adam-beta2", "0.9", "--adam-eps", "1e-3",
                          "--override-opt_param-scheduler"],
             "to_bf16": BF16,
             "other_data": ["--data-path", swapped_data, "--override-data-order"]}
    runs, jobs = {}, {}
    for name, extra in flags.items():
        runs[name] = shutil.copytree(two_steps, root / name)
        jobs[name] = common(wiki_shards, runs[name], 3, ["--eval-iters", "0", "--load",
                                                          str(runs[name]), *extra])
    runs["bf16"] = root / "bf16"
    jobs["bf16"] = common(wiki_shards, runs["bf16"], 3, ["--eval-iters", "0", *BF16],
                          save_interval=2)
    runs["modern"] = root / "modern"
    modern = dict(preset="modernbert-tiny", save_interval=2)
    jobs["modern_phase1"] = common(wiki_shards, runs["modern"], 2, [
        "--eval-iters", "0", "--rotary-base", "10000"], seq_length=128, **modern)
    # to_fp32 needs bf16's checkpoint, modern its first phase: a second round, which other_data
    # shares (two cores)
    first = [n for n in jobs if n != "other_data"]
    results = dict(zip(first, launch_together([jobs[n] for n in first], timeout=600)))
    assert results["modern_phase1"].returncode == 0, results["modern_phase1"].stderr[-3000:]
    runs["modern_phase1"] = fp32_weights(runs["modern"], "global_step2")
    jobs["modern"] = common(wiki_shards, runs["modern"], 4, [
        "--eval-iters", "0", "--load", str(runs["modern"])], seq_length=512, global_batch_size=4,
        **modern)
    runs["to_fp32"] = cut_back(runs["bf16"], root / "to_fp32", 2)
    jobs["to_fp32"] = common(wiki_shards, runs["to_fp32"], 3, ["--eval-iters", "0", "--load",
                                                               str(runs["to_fp32"])])
    # the export of the resumed run (its config.json holds train.load and train.export_hf):
    # from_config, started from that file, must neither resume it nor write over this
    export = root / "same_hf" / "model.safetensors"
    runs["same_export"] = (export, export.read_bytes(), export.stat().st_mtime_ns)
    runs["from_config"] = root / "from_config"
    jobs["from_config"] = ["--config", str(runs["same"] / "config.json"),
                           "--save", str(runs["from_config"]), "--train-iters", "4",
                           "--save-interval", "2"]
    runs["to_zero2"] = shutil.copytree(two_steps, root / "to_zero2")
    jobs["to_zero2"] = common(wiki_shards, runs["to_zero2"], 3, [
        "--eval-iters", "0", "--load", str(runs["to_zero2"])], ds_config="ds_configs/zero2.json")
    second = ["other_data", "to_fp32", "from_config", "modern", "to_zero2"]
    results.update(zip(second, launch_together([jobs[n] for n in second], timeout=600)))
    for name, r in results.items():
        assert r.returncode == 0, (name, r.stdout[-2000:], r.stderr[-3000:])
    return runs, results


def test_modern_context_extension_continues_at_512_tokens_and_a_raised_rope_base(resumes):
    """ModernBERT's context extension (arXiv 2412.13663) at test size (``resumes``' ``modern``):
    the note names the raised base, the data note where the samples continue; config.json
    records the new values; the phase-2 weights are the phase-1 weights moved by two AdamW steps
    (each parameter by at most the two steps' learning rates, 5e-4 + 7.5e-4 in warm-up, where a
    fresh initialisation would be ~0.02 away), and the AdamW step count is the run's."""
    runs, results = resumes
    save, r = runs["modern"], results["modern"]
    assert f"resumed from {save} at iteration 2 (32 samples consumed)" in r.stdout
    assert ("note: --rotary-base 160000 (the checkpoint's 10000): the rotary layout has no "
            "position parameters, so the weights load as they are and the rotary angles follow "
            "the new values from the first resumed iteration (ModernBERT's context extension)"
            in r.stdout.splitlines()), r.stdout[-3000:]
    assert re.search(r"^note: --seq-length 512 \(the checkpoint's 128\): .* global sample "
                     r"[\d,]+ of the [\d,]+ an epoch of 512-token samples", r.stdout, re.M)
    assert [int(m[0]) for m in ITERATION.findall(r.stdout)] == [3, 4]
    config = json.loads((save / "config.json").read_text())
    assert (config["model"]["rotary_base"], config["data"]["seq_length"]) == (160_000.0, 512)
    phase2 = fp32_weights(save, "global_step4")
    moved = max((phase2[k] - v).abs().max().item() for k, v in runs["modern_phase1"].items())
    assert 0 < moved <= 1.3e-3, moved
    assert adam_steps(save / "global_step4") == {4.0}


def _param_groups(ckpt_dir) -> list[dict]:
    (path,) = ckpt_dir.glob("*optim_states.pt")
    states = torch.load(path, map_location="cpu", weights_only=False)
    return states["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]


def _optim_config(run) -> dict:
    return json.loads((run / "config.json").read_text())["optim"]


def test_a_changed_optimizer_setting_is_refused_in_one_line(wiki_shards, two_steps, tmp_path,
                                                            capsys, monkeypatch):
    save = shutil.copytree(two_steps, tmp_path / "run")
    resume = common(wiki_shards, save, 3, ["--eval-iters", "0", "--load", str(save)])
    tail = ("; pass --override-opt_param-scheduler to use the new values from the first resumed "
            "iteration, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    err = pretrain_error(capsys, resume + ["--weight-decay", "0.5"], monkeypatch, world_size=1)
    assert err == (f"error: --load {save}: the optimizer settings differ from the checkpoint's "
                   f"(--weight-decay 0.01 → 0.5){tail}")
    err = pretrain_error(capsys, resume + ["--adam-beta2", "0.9", "--adam-eps", "1e-3"],
                         monkeypatch, world_size=1)
    assert err == (f"error: --load {save}: the optimizer settings differ from the checkpoint's "
                   f"(--adam-beta2 0.98 → 0.9, --adam-eps 1e-06 → 0.001){tail}")
    assert not (save / "global_step3").exists()


def test_the_optimizer_runs_with_what_the_log_and_config_json_say(resumes):
    runs, results = resumes
    same = fp32_weights(runs["same"], "global_step3")
    assert _param_groups(runs["same"] / "global_step3")[0]["weight_decay"] == 0.01

    # the checkpoint's settings kept: the weights of the unchanged resume, to the bit
    assert ("note: the optimizer settings differ from the checkpoint's (--weight-decay 0.01 → "
            "0.5); --use-checkpoint-opt_param-scheduler: the checkpoint's values are kept"
            in results["checkpoint_wd"].stdout)
    assert _optim_config(runs["checkpoint_wd"])["weight_decay"] == 0.01
    assert _param_groups(runs["checkpoint_wd"] / "global_step3")[0]["weight_decay"] == 0.01
    kept = fp32_weights(runs["checkpoint_wd"], "global_step3")
    assert all(torch.equal(kept[n], w) for n, w in same.items())

    # the new settings asked for: in the optimizer, in config.json, and in the weights
    assert ("note: the optimizer settings differ from the checkpoint's (--weight-decay 0.01 → "
            "0.5, --adam-beta2 0.98 → 0.9, --adam-eps 1e-06 → 0.001); "
            "--override-opt_param-scheduler: the new values apply from the first resumed "
            "iteration" in results["override"].stdout)
    config = _optim_config(runs["override"])
    assert (config["weight_decay"], config["adam_beta2"], config["adam_eps"]) == (0.5, 0.9, 1e-3)
    groups = _param_groups(runs["override"] / "global_step3")
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]  # no decay on biases and norms
    assert all(tuple(g["betas"]) == (0.9, 0.9) and g["eps"] == 1e-3 for g in groups)
    weights = fp32_weights(runs["override"], "global_step3")
    assert any(not torch.equal(weights[n], w) for n, w in same.items())


def test_fp32_and_bf16_convert_into_each_other_and_continue(resumes):
    """Each direction converts through the layout-free state (the fp32 masters and both moments)
    and its step 3 is the uninterrupted run's in its new precision, within what steps 1–2 in
    the other precision change (measured 6.6e-5 relative); two steps of training move the loss
    by several times more (3.5e-3)."""
    runs, results = resumes
    for name, was, now, ref in (
            ("to_bf16", "ZeRO-3, fp32", "ZeRO-1, bf16", "bf16"),
            ("to_fp32", "ZeRO-1, bf16", "ZeRO-3, fp32", "same")):
        run = runs[name]
        assert (f"converted {run}/global_step2 from TP 1 × PP 1 × DP 1, {was} to TP 1 × PP 1 × "
                f"DP 1, {now} (layout-free state {run}/global_step2_canonical) in "
                in results[name].stdout), results[name].stdout[-3000:]
        got = scalars(str(run / "tensorboard"))["loss/total"]
        want = scalars(str(runs[ref] / "tensorboard"))["loss/total"]
        print(name, got, want)
        assert max(got) == 3
        assert abs(got[3] - want[3]) <= PRECISION_REL * abs(want[3]), (name, got, want)
        assert abs(want[1] - want[3]) > 4 * PRECISION_REL * abs(want[3])


def test_another_zero_stage_at_the_same_size_keeps_the_dropout_streams(resumes):
    """The tiny preset's dropout 0.1, one rank: ``two_steps`` (ZeRO-3) resumed at ZeRO-2 goes
    through the layout-free state, yet each rank continues its own dropout stream from the
    checkpoint (the same ranks in the same roles), so step 3 is the unchanged ZeRO-3 resume's
    (measured equal to the bit; reseeded dropout put L_MLM 3e-3 relative off)."""
    runs, results = resumes
    run = runs["to_zero2"]
    assert (f"converted {run}/global_step2 from TP 1 × PP 1 × DP 1, ZeRO-3 to TP 1 × PP 1 × "
            f"DP 1, ZeRO-2 (layout-free state {run}/global_step2_canonical) in "
            in results["to_zero2"].stdout), results["to_zero2"].stdout[-3000:]
    got, want = scalars(str(run / "tensorboard")), scalars(str(runs["same"] / "tensorboard"))
    for tag in ("loss/mlm", "loss/rtd", "loss/total"):
        assert sorted(got[tag]) == [1, 2, 3]
        assert got[tag][3] == pytest.approx(want[tag][3], rel=1e-6), (tag, got[tag], want[tag])


def test_a_shard_rewritten_with_its_size_and_mtime_kept_is_refused(wiki_shards, two_steps,
                                                                    tmp_path, capsys,
                                                                    monkeypatch):
    """A copy of the training shards (the same data: the checkpoint records content, not
    paths) is hashed by a first, refused, resume; then two tokens of its .bin are swapped in
    place and its times restored (``touch -r``, ``cp -p``, ``rsync -t``). ``--load`` refuses it
    in one line naming the shard, exit 2, and writes nothing."""
    save = shutil.copytree(two_steps, tmp_path / "run")
    _, prefix = wiki_shards
    data = shutil.copytree(Path(prefix).parent, tmp_path / "data",
                           ignore=shutil.ignore_patterns("index-cache"))
    copied = str(data / Path(prefix).name)
    resume = common(wiki_shards, save, 3, ["--eval-iters", "0", "--load", str(save),
                                           "--data-path", copied])
    err = pretrain_error(capsys, resume + ["--seed", "4321"], monkeypatch, world_size=1)
    assert "was trained with train.seed 11, this run has 4321" in err  # hashed, then refused

    (bin_path,) = data.glob(Path(prefix).name + "_*.bin")
    stat = bin_path.stat()
    raw = bytearray(bin_path.read_bytes())
    i = next(i for i in range(0, len(raw) - 8, 4) if raw[i:i + 4] != raw[i + 4:i + 8])
    raw[i:i + 8] = raw[i + 4:i + 8] + raw[i:i + 4]  # two 4-byte groups of ids swapped
    with open(bin_path, "r+b") as f:  # in place: the same file, the same length
        f.write(raw)
    os.utime(bin_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (bin_path.stat().st_size, bin_path.stat().st_mtime_ns) == (stat.st_size,
                                                                        stat.st_mtime_ns)
    err = pretrain_error(capsys, resume, monkeypatch, world_size=1)
    assert re.fullmatch(
        rf"error: --load {re.escape(str(save))}: global_step2 was trained on other data: shard "
        rf"{bin_path.stem} holds other data than the checkpoint's {bin_path.stem} \(its \.bin "
        r"differ: sha256 [0-9a-f]{12} → [0-9a-f]{12}\); restore the data it was trained on, or "
        r"pass --override-data-order to continue on these data, their order starting at global "
        r"sample 32 where the run resumes", err), err
    assert sorted(p.name for p in save.iterdir()) == sorted(p.name for p in two_steps.iterdir())
    assert (save / "latest").read_text().strip() == "global_step2"


def test_other_data_are_refused_in_one_line_unless_overridden(wiki_shards, two_steps,
                                                              swapped_data, resumes, tmp_path,
                                                              capsys, monkeypatch):
    save = shutil.copytree(two_steps, tmp_path / "run")
    err = pretrain_error(capsys, common(wiki_shards, save, 3, [
        "--eval-iters", "0", "--load", str(save), "--data-path", swapped_data]), monkeypatch,
        world_size=1)
    m = re.fullmatch(
        rf"error: --load {re.escape(str(save))}: global_step2 was trained on other data: shard "
        r"wiki_text_document_00000 holds other data than the checkpoint's "
        r"wiki_text_document_00000 \(its (?:\.idx and )?\.bin differ: sha256 [0-9a-f]{12} → "
        r"[0-9a-f]{12}\); restore the data it was trained on, or pass --override-data-order to "
        r"continue on these data, their order starting at global sample 32 where the run "
        r"resumes", err)
    assert m, err
    assert not (save / "global_step3").exists()

    runs, results = resumes
    out = results["other_data"].stdout
    assert f"resumed from {runs['other_data']} at iteration 2 (32 samples consumed)" in out
    note = re.search(r"^note: --override-data-order: the training data differ from the "
                     r"checkpoint's \(shard wiki_text_document_00000 holds other data .*\); the "
                     r"run reads them from global sample 32 of their order on: "
                     r"wiki_text_document resumes in epoch 0 at position 32 of its \d+ \(counted "
                     r"from 0\) of the new order$", out, re.M)
    assert note, out[-3000:]
    assert [int(m[0]) for m in ITERATION.findall(out)] == [3]


# ------------------------------------------------------------------ --config (the same run) ----

def test_a_resumed_runs_config_json_starts_the_run_afresh_and_leaves_its_export(resumes):
    """``same`` was resumed (``--load A --save A``) and exported (``--export-hf``): its
    config.json holds both. ``--config`` of it with another ``--save`` starts fresh at step 1
    (a file's train.load is no resume the user asked for), says in one note what it left out,
    and never writes the first run's export (its bytes and mtime unchanged)."""
    runs, results = resumes
    out = results["from_config"].stdout + results["from_config"].stderr
    assert [int(m[0]) for m in ITERATION.findall(results["from_config"].stdout)] == [1, 2, 3, 4]
    assert "resumed from" not in out
    same = runs["same"]
    assert (f"note: --config {same}/config.json: left out --load {same} --export-hf "
            f"{same.parent / 'same_hf'} (where that run read and wrote); give them on this "
            "command line to use them" in out.splitlines()), out[-3000:]
    export, data, mtime = runs["same_export"]
    assert export.read_bytes() == data and export.stat().st_mtime_ns == mtime
    assert not list(runs["from_config"].glob("*hf*"))
    recorded = json.loads((runs["from_config"] / "config.json").read_text())["train"]
    assert (recorded["load"], recorded["export_hf"]) == (None, None)


def test_a_run_started_from_its_own_config_json_repeats_it_to_the_bit(two_steps, resumes):
    """``--config <run>/config.json --save NEW`` and nothing else is the same run again: every
    logged loss equal to the bit, the same fp32 master weights at the last step, and the same
    config.json but for the paths under --save. The file is that of ``same``, the run's resume
    to step 3 (where that run read and wrote is left out), run to step 4 saving every 2 steps:
    its first two steps are ``two_steps``'."""
    runs, _ = resumes
    again = runs["from_config"]
    first, second = scalars(str(two_steps / "tensorboard")), scalars(str(again / "tensorboard"))
    for tag in ("loss/mlm", "loss/rtd", "loss/total", "optim/grad_norm"):
        assert sorted(first[tag]) == [1, 2] and sorted(second[tag]) == [1, 2, 3, 4], tag
        assert all(first[tag][k] == second[tag][k] for k in (1, 2)), tag
    assert first["loss/total"][1] != first["loss/total"][2]  # two steps that moved
    # negative control: the same run in bf16 (the ``bf16`` resume fixture's) differs at step 1
    bf16 = scalars(str(runs["bf16"] / "tensorboard"))
    assert bf16["loss/total"][1] != first["loss/total"][1]
    a, b = fp32_weights(two_steps, "global_step2"), fp32_weights(again, "global_step2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recorded = [json.loads((d / "config.json").read_text()) for d in (two_steps, again)]
    for d, config in zip((two_steps, again), recorded):
        assert config["train"]["save"] == str(d)
        config["train"].update(save=None, tensorboard_dir=None)
    assert (recorded[1]["train"]["train_iters"], recorded[1]["train"]["save_interval"]) == (4, 2)
    for config in recorded:
        config["train"].update(train_iters=None, save_interval=None)  # the flags beside the file
    assert recorded[0] == recorded[1]


def test_a_resume_refuses_a_config_that_changes_the_model(two_steps, tmp_path, capsys,
                                                          monkeypatch):
    """--load with a --config whose model differs from the checkpoint's: the resume rules'
    one line (checkpoint/compat.py), naming the field and both values."""
    save = shutil.copytree(two_steps, tmp_path / "run")
    config = json.loads((two_steps / "config.json").read_text())
    config["model"]["discriminator"]["num_layers"] = 2
    (tmp_path / "changed.json").write_text(json.dumps(config))
    err = pretrain_error(capsys, ["--config", str(tmp_path / "changed.json"), "--save", str(save),
                                  "--load", str(save)], monkeypatch, world_size=1)
    assert err == (f"error: --load {save}: global_step2 holds another model "
                   "(model.discriminator.num_layers 4 → 2); use the preset and overrides it was "
                   f"trained with (see {save}/config.json)")
