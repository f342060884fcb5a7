"""Config validation, presets, batch arithmetic, ds_config ownership (the LR schedule:
test_schedule.py)."""
from __future__ import annotations

import json

import pytest

from rtd_scale.batch import batch_arithmetic, batch_layout, rank_share
from rtd_scale.config import ConfigError, Precision, Sharing, apply_override
from rtd_scale.presets import preset, PRESETS
from rtd_scale.training.engine import load_ds_config, resolve_ds_config


def test_presets_have_the_published_shapes():
    e_small, e_base, e_large = (preset(f"electra-{s}").model for s in ("small", "base", "large"))
    assert (e_small.discriminator.num_layers, e_small.discriminator.hidden_size) == (12, 256)
    assert e_small.embedding_size == 128 and e_small.generator.hidden_size == 64  # 1/4 width
    assert e_base.generator.hidden_size == 256  # 1/3 of 768
    assert (e_large.discriminator.num_layers, e_large.discriminator.hidden_size) == (24, 1024)
    assert e_large.generator.hidden_size == 256  # 1/4
    assert preset("electra-large").rtd.mask_prob == 0.25
    shapes = {"xsmall": (12, 384), "small": (6, 768), "base": (12, 768), "large": (24, 1024)}
    for size, (layers, hidden) in shapes.items():
        m = preset(f"debertav3-{size}").model
        assert (m.discriminator.num_layers, m.discriminator.hidden_size) == (layers, hidden)
        assert (m.generator.num_layers, m.generator.hidden_size) == (layers // 2, hidden)
        assert m.vocab_size == 128_100 and m.sharing is Sharing.GDES
    assert preset("tiny").rtd.rtd_lambda == 50.0
    assert set(PRESETS) >= {"tiny", "electra-small", "debertav3-large"}


def test_vocab_padding_is_deterministic():
    m = preset("tiny").model
    m.vocab_size = 32_003  # as tests/multiproc/test_vocab_padding.py
    assert m.padded_vocab_size(1) == 32_128
    assert m.padded_vocab_size(2) == 32_256
    assert m.padded_vocab_size(8) == 32_768
    m.vocab_size = 128_100
    assert m.padded_vocab_size(1) == 128_128


@pytest.mark.parametrize("assignment, message", [
    ("rtd.mask_prob=1.5", "rtd.mask_prob must be in [0, 1]"),
    ("rtd.mask_prob=0", "rtd.mask_prob must be > 0"),
    ("rtd.temperature=0", "rtd.temperature must be > 0"),
    ("model.discriminator.num_attention_heads=5", "divisible by model.discriminator.num_attention_heads"),
    ("data.seq_length=1000", "exceeds model.max_position_embeddings"),
    ("parallel.tensor_model_parallel_size=3", "must be divisible by --tensor-model-parallel-size"),
    ("parallel.pipeline_model_parallel_size=3", "cannot be divided evenly over"),
    ("optim.lr=-1", "optim.lr must be > 0"),
])
def test_validation_names_the_field(assignment, message):
    cfg = preset("tiny")
    apply_override(cfg, assignment)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfg.validate()


@pytest.mark.parametrize("assignments, message", [
    # tiny: discriminator 4 layers, generator 2; both 2 heads and FFN 384
    (["parallel.tensor_model_parallel_size=3"],
     "model.discriminator.num_attention_heads (2) must be divisible by "
     "--tensor-model-parallel-size (3); the sizes that divide both models' head counts and FFN "
     "sizes: 1, 2"),
    (["parallel.pipeline_model_parallel_size=3"],
     "model.discriminator.num_layers (4) cannot be divided evenly over "
     "--pipeline-model-parallel-size 3 (both models are split over the same stages); use a "
     "pipeline size that divides both layer counts (4 and 2): 1, 2"),
    (["model.generator.num_layers=3", "parallel.pipeline_model_parallel_size=2"],
     "model.generator.num_layers (3) cannot be divided evenly over "
     "--pipeline-model-parallel-size 2 (both models are split over the same stages); use a "
     "pipeline size that divides both layer counts (4 and 3): 1"),
])
def test_divisibility_errors_list_the_sizes_that_fit(assignments, message):
    cfg = preset("tiny")
    for a in assignments:
        apply_override(cfg, a)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value) == message


def test_overrides_convert_types_and_reject_unknown():
    cfg = preset("tiny")
    apply_override(cfg, "model.sharing=nes")
    apply_override(cfg, "rtd.disallow_correct=true")
    apply_override(cfg, "train.precision=bf16")
    assert cfg.model.sharing is Sharing.NES and cfg.rtd.disallow_correct is True
    assert cfg.train.precision is Precision.BF16
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, "rtd.lamda=3")
    assert str(e.value).startswith("--set rtd.lamda: unknown field (did you mean "
                                   "rtd.rtd_lambda?); known: rtd_lambda, mask_prob, ")
    with pytest.raises(ConfigError) as e:  # a field of the sections inside, by its own name
        apply_override(cfg, "model.hiden_size=10")
    assert str(e.value).startswith("--set model.hiden_size: unknown field (did you mean "
                                   "model.discriminator.hidden_size or "
                                   "model.generator.hidden_size?); known: vocab_size, ")
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, "objective=mlm")
    assert str(e.value).startswith("--set objective: unknown field (did you mean "
                                   "rtd.objective?); known: preset, model, rtd, ")
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, "rtd.zzz=3")
    assert str(e.value).startswith("--set rtd.zzz: unknown field; known: rtd_lambda, ")
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, "trian.seed=3")
    assert str(e.value) == ("--set trian.seed: no config section 'trian' (did you mean train?); "
                            "sections: model, rtd, data, parallel, optim, train, monitor, "
                            "fault_tolerance")
    with pytest.raises(ConfigError, match="expected a value of type int"):
        apply_override(cfg, "train.train_iters=many")
    with pytest.raises(ConfigError, match="unknown; choose one of"):
        preset("bert-huge")


def test_batch_arithmetic():
    cfg = preset("tiny")
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 32
    assert batch_arithmetic(cfg, 2) == (2, 4)  # dp 2, accumulation 4
    cfg.train.global_batch_size = 30
    with pytest.raises(ConfigError, match=r"^--micro-batch-size 4 does not divide the 15 samples "
                       r"per data-parallel rank per step \(global 30 / DP 2\); micro-batch sizes "
                       r"that do: 1 3 5 15$"):
        batch_arithmetic(cfg, 2)
    cfg.train.global_batch_size = 33
    with pytest.raises(ConfigError, match=r"^--global-batch-size 33 is not divisible by the "
                       r"data-parallel size 2 \(= 2 ranks / TP 1\)"):
        batch_arithmetic(cfg, 2)
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match=r"^6 ranks are not divisible by "
                       r"--tensor-model-parallel-size 2 × --pipeline-model-parallel-size 2 "
                       r"\(model-parallel size 4\); launch a multiple of 4 ranks$"):
        batch_arithmetic(cfg, 6)


def test_batch_layout_names_the_numbers_and_what_works():
    """One arithmetic for pretrain.py, the Slurm job and tools/estimate_cost.py, in each one's
    words (the Slurm job's are pinned by tests/e2e/test_slurm.py)."""
    assert batch_layout(64, 8192, 8, tp=2, ranks_per_node=8) == (32, 32)
    assert batch_layout(1024, 8192, 8, ranks_per_node=8) == (1024, 1)
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 4 does not divide the 2 "
                       r"ranks per node: tensor-parallel groups would span nodes$"):
        batch_layout(8, 64, 1, tp=4, ranks_per_node=2)
    with pytest.raises(ConfigError) as e:  # 6 nodes × 8: the node counts that would work
        batch_layout(48, 8192, 8, ranks_per_node=8)
    assert str(e.value).endswith("change --global-batch-size or the number of ranks (node counts "
                                 "that work at 8 ranks per node: 1 2 4 8 16 32 64 128)")


def test_rank_share_is_batch_layouts_split():
    """The loader, the training loop and the resolved ds_config split the global batch with
    rank_share once DP is known; it agrees with batch_layout and refuses what does not divide."""
    for world, global_batch, micro, tp in ((64, 8192, 8, 2), (6, 48, 2, 1), (4, 16, 4, 1)):
        dp, gas = batch_layout(world, global_batch, micro, tp=tp)
        assert rank_share(global_batch, micro, dp) == (global_batch // dp, gas)
    assert rank_share(32, 4, 2) == (16, 4)
    for bad in ((30, 4, 2), (33, 1, 2)):  # micro does not divide 15; DP does not divide 33
        with pytest.raises(AssertionError):
            rank_share(*bad)


def test_ds_config_contradictions_are_errors(tmp_path):
    cfg = preset("tiny")
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 16
    ok = resolve_ds_config({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}, cfg,
                           data_parallel_size=2, gradient_accumulation_steps=2)
    assert ok["train_batch_size"] == 16 and ok["gradient_accumulation_steps"] == 2
    assert ok["train_micro_batch_size_per_gpu"] == 4
    assert ok["gradient_clipping"] == cfg.optim.clip_grad  # always written (DeepSpeed 0.19.8)
    assert ok["bf16"] == {"enabled": False}
    bad = [({"train_batch_size": 64}, "train_batch_size=64 contradicts --global-batch-size"),
           ({"train_micro_batch_size_per_gpu": 8}, "contradicts --micro-batch-size"),
           ({"gradient_clipping": 5.0}, "contradicts --clip-grad"),
           ({"bf16": {"enabled": True}}, "pass --bf16"),
           ({"optimizer": {"type": "Adam"}}, "defines 'optimizer'")]
    for user, message in bad:
        with pytest.raises(ValueError, match=message):
            resolve_ds_config(user, cfg, data_parallel_size=2, gradient_accumulation_steps=2,
                              source="ds_configs/x.json")
    p = tmp_path / "broken.json"
    p.write_text("{ not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_ds_config(str(p))
    with pytest.raises(ValueError, match="no such file"):
        load_ds_config(str(tmp_path / "missing.json"))


def test_resolved_config_round_trips_to_json():
    cfg = preset("debertav3-large")
    d = json.loads(cfg.to_json())
    assert d["model"]["sharing"] == "gdes" and d["rtd"]["rtd_lambda"] == 50.0
    assert d["model"]["generator"]["num_layers"] == 12


@pytest.mark.parametrize("split", ["inf,1,1", "1,nan", "abc", "0,1"])
def test_split_must_be_finite_with_a_train_share(split):
    from rtd_scale.config import DataConfig

    with pytest.raises(ConfigError, match=f"^data.split '{split}': expected up to three") as e:
        DataConfig(split=split).split_weights()
    assert str(e.value.naming({"data.split": "--split"})).startswith(f"--split (data.split) '{split}'")


@pytest.mark.parametrize("path", [["inf", "A", "1", "B"], ["nan", "A", "1", "B"], ["0.5", "A", "B"]])
def test_blend_weights_must_be_positive_and_finite(path):
    from rtd_scale.config import DataConfig

    with pytest.raises(ConfigError, match="positive WEIGHT PREFIX pairs"):
        DataConfig(data_path=path).sources()
    assert DataConfig(data_path=["3", "A", "1", "B"]).sources() == [(0.75, ["A"]), (0.25, ["B"])]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_recorded_config_reads_back_as_itself(name):
    """RunConfig.from_dict inverts to_dict (what config.json and rtd_meta.json hold), enums
    included; a field changed from the preset is read back changed."""
    from rtd_scale.config import RunConfig

    cfg = preset(name)
    cfg.train.precision, cfg.optim.adam_eps = Precision.BF16, 1e-3
    back = RunConfig.from_dict(cfg.to_dict())
    assert back.to_dict() == cfg.to_dict()
    assert back.train.precision is Precision.BF16 and back.optim.adam_eps == 1e-3
