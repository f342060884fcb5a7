"""Every key of a user's DeepSpeed JSON is honoured, mapped or refused
(rtd_scale/training/ds_config.py): refusals are one line with the closest key, all problems of a
file at once; activation_checkpointing maps to megatron-core's recompute; offload and fp16
sections resolve; --fp16 and --bf16 exclude each other."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import Precision
from rtd_scale.presets import preset
from rtd_scale.arguments import build_parser, config_from_args
from rtd_scale.training import ds_config as dsc
from tests.helpers.env import REPO


def cfg_of(precision: Precision = Precision.FP32, pp: int = 1):
    cfg = preset("tiny")
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 16
    cfg.train.precision = precision
    cfg.parallel.pipeline_model_parallel_size = pp
    return cfg


def resolve(user, cfg=None, **kw):
    return dsc.resolve_ds_config(user, cfg or cfg_of(), data_parallel_size=2,
                                 gradient_accumulation_steps=2, source="x.json", **kw)


def error_of(user, cfg=None, **kw) -> str:
    with pytest.raises(UserInputError) as e:
        resolve(user, cfg, **kw)
    message = str(e.value)
    assert "\n" not in message and message.startswith("x.json: ")
    return message


def test_misspelled_top_level_key_names_the_closest_and_the_supported_keys():
    message = error_of({"zero_optimisation": {"stage": 3}})
    assert message.startswith("x.json: 'zero_optimisation' is not a DeepSpeed key "
                              "(did you mean zero_optimization?)")
    listing = message.split("supported top-level keys: ")[1].split(", ")
    assert listing == dsc.SUPPORTED
    assert {"zero_optimization", "fp16", "bf16", "activation_checkpointing",
            "gradient_clipping"} <= set(listing)
    # a misspelling of a refused DeepSpeed key still points at it
    assert "(did you mean elasticity?)" in error_of({"elastisity": {}})


@pytest.mark.parametrize("key", sorted(dsc.REFUSED))
def test_each_refused_key_is_one_line_with_what_to_use(key):
    message = error_of({key: {}})
    assert dsc.REFUSED[key] in message
    assert message.count(";") >= 1 and "supported top-level keys:" in message


def test_every_key_deepspeed_reads_is_classified():
    """DeepSpeed 0.19.8's top-level keys (deepspeed/runtime/config.py and the sections it
    builds) are each honoured, owned, mapped or refused: none is silently passed through."""
    deepspeed_keys = {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "managed_gradient_accumulation", "steps_per_print", "dump_state", "disable_python_gc",
        "disable_allgather", "communication_data_type", "seq_parallel_communication_data_type",
        "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
        "zero_optimization", "activation_checkpointing", "comms_logger", "tensorboard", "wandb",
        "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16", "bfloat16", "amp",
        "torch_autocast", "optimizer", "scheduler", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "flops_profiler", "wall_clock_breakdown",
        "memory_breakdown", "autotuning", "use_data_before_expert_parallelism", "hybrid_engine",
        "pipeline", "data_efficiency", "curriculum_learning", "checkpoint", "data_types", "aio",
        "dataloader_drop_last", "log_level", "datastates_ckpt", "weight_quantization", "compile",
        "timers", "tensor_parallel", "expert_parallel", "sequence_parallel_size", "elasticity",
        "compression_training", "quantize_training", "eigenvalue", "progressive_layer_drop",
        "sparse_attention", "sparse_gradients", "vocabulary_size", "nebula", "graph_harvesting"}
    classified = set(dsc.OWNED) | set(dsc.HONOURED) | set(dsc.MAPPED) | set(dsc.REFUSED)
    assert deepspeed_keys - classified == set()
    assert not (set(dsc.REFUSED) & (set(dsc.OWNED) | set(dsc.HONOURED) | set(dsc.MAPPED)))


def test_all_problems_of_a_file_are_reported_at_once():
    user = {
        "zero_optimisation": {"stage": 2},
        "train_batch_size": 64,
        "zero_optimization": {"stage": 2, "overlap_com": False,
                              "offload_optimizer": {"device": "cpu", "pin_memry": True},
                              "stage3_max_live_parameters": 10, "reduce_bucket_size": -1},
        "activation_checkpointing": {"cpu_checkpointing": True},
        "amp": {"enabled": True},
    }
    message = error_of(user)
    assert message.startswith("x.json: 8 problems: (1) ")
    expected = [
        "'zero_optimisation' is not a DeepSpeed key (did you mean zero_optimization?)",
        "'amp' is not supported: Apex AMP is not used; pass --bf16 or --fp16",
        "train_batch_size=64 contradicts --global-batch-size (which gives 16)",
        "zero_optimization.overlap_com: not a DeepSpeed field (did you mean overlap_comm?)",
        "zero_optimization.offload_optimizer.pin_memry: not a DeepSpeed field (did you mean "
        "pin_memory?)",
        "zero_optimization.reduce_bucket_size=-1: Input should be greater than 0",
        "zero_optimization.stage3_max_live_parameters acts only at stage 3 (this file has "
        "stage 2); remove it or set stage 3",
        "activation_checkpointing.cpu_checkpointing=true is not supported",
    ]
    for part in expected:
        assert part in message, part
    message = error_of({"zero_optimization": {"stage": 7, "overlap_com": True}})
    assert message == ("x.json: 2 problems: (1) zero_optimization.stage is 7; DeepSpeed's stages "
                       "are 0, 1, 2 and 3; (2) zero_optimization.overlap_com: not a DeepSpeed "
                       "field (did you mean overlap_comm?)")
    message = error_of({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 10,
                                              "offload_param": {"device": "cpu"}}})
    assert "(1) zero_optimization.offload_param acts only at stage 3 (this file has stage 2)" \
        in message
    assert "(2) zero_optimization.stage3_max_live_parameters acts only at stage 3" in message


def test_owned_values_may_repeat_the_flags_or_say_auto():
    ok = resolve({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": 2, "gradient_clipping": "auto",
                  "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"},
                  "steps_per_print": 50, "zero_force_ds_cpu_optimizer": False})
    assert (ok["train_batch_size"], ok["train_micro_batch_size_per_gpu"],
            ok["gradient_accumulation_steps"], ok["gradient_clipping"]) == (16, 4, 2, 1.0)
    assert ok["steps_per_print"] == 50 and ok["zero_force_ds_cpu_optimizer"] is False
    assert ok["zero_optimization"] == {"stage": 1, "reduce_bucket_size": "auto"}
    # a run directory's resolved ds_config.json resolves again to itself
    again = resolve(ok)
    assert again == ok
    pp = cfg_of(pp=2)
    resolved_pp = resolve({"zero_optimization": {"stage": 1}}, pp)
    assert resolved_pp["managed_gradient_accumulation"] is False
    assert resolve(resolved_pp, pp) == resolved_pp
    assert "managed_gradient_accumulation=false contradicts --pipeline-model-parallel-size " \
           "(which gives true)" in error_of({"managed_gradient_accumulation": False})
    assert "zero_allow_untested_optimizer=false" in error_of({"zero_allow_untested_optimizer":
                                                              False})
    assert "checkpoint.load_universal is not supported" in error_of(
        {"checkpoint": {"tag_validation": "Ignore", "load_universal": True}})
    assert resolve({"checkpoint": {"tag_validation": "Ignore"}})["checkpoint"] == {
        "tag_validation": "Ignore"}


def test_activation_checkpointing_maps_to_megatron_recompute():
    cfg = cfg_of()
    assert cfg.model.recompute_activations is False
    ok = resolve({"zero_optimization": {"stage": 1},
                  "activation_checkpointing": {"partition_activations": False,
                                               "contiguous_memory_optimization": False,
                                               "number_checkpoints": None}}, cfg)
    assert cfg.model.recompute_activations is True
    assert ok["activation_checkpointing"]["partition_activations"] is False
    again = cfg_of()  # the resolved file, passed again, maps again
    assert resolve(ok, again) == ok and again.model.recompute_activations is True
    cfg = cfg_of()
    resolve({"activation_checkpointing": {}}, cfg)
    assert cfg.model.recompute_activations is True
    # what megatron-core's recompute cannot give is refused, and the config is left alone
    cfg = cfg_of()
    message = error_of({"activation_checkpointing": {"partition_activations": True,
                                                     "number_checkpoints": 4,
                                                     "cpu_checkpoint": True}}, cfg)
    assert cfg.model.recompute_activations is False
    assert "(1) activation_checkpointing.cpu_checkpoint: not a DeepSpeed field (did you mean " \
           "cpu_checkpointing?)" in message
    assert "activation_checkpointing.number_checkpoints=4 is not supported" in message
    assert "activation_checkpointing.partition_activations=true is not supported: " \
           "megatron-core's full-layer recompute keeps each layer's input whole" in message


def test_offload_sections_resolve_and_misplaced_offload_is_refused():
    ok = resolve(json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text()))
    assert ok["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert dsc.offloads_optimizer(ok)
    ok3 = resolve(json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text()))
    assert ok3["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert dsc.offloads_optimizer(ok3)
    assert not dsc.offloads_optimizer(resolve({"zero_optimization": {"stage": 3}}))
    assert "offload_optimizer needs ZeRO stage 1, 2 or 3 (this file has stage 0)" in error_of(
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    message = error_of({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
                       cfg_of(pp=2))
    assert "offload_* with --pipeline-model-parallel-size 2 is not supported" in message
    assert "zero_optimization.cpu_offload is DeepSpeed's deprecated spelling; write " \
           "offload_optimizer instead" in error_of({"zero_optimization": {"stage": 2,
                                                                          "cpu_offload": True}})


def test_fp16_section_is_honoured_under_fp16():
    user = json.loads((REPO / "ds_configs" / "zero2_fp16.json").read_text())
    user["fp16"]["initial_scale_power"] = 12
    ok = resolve(user, cfg_of(Precision.FP16), fp16_ok=True)
    assert ok["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    assert ok["bf16"] == {"enabled": False}
    # the scaler's knobs without --fp16 would be ignored: refused
    message = error_of(user)
    assert message == ("x.json: fp16.hysteresis acts only under --fp16 (the precision is fp32); "
                       "pass --fp16 or remove the fp16 section")
    assert "fp16.enabled=true contradicts the precision (bf16); pass --fp16" in error_of(
        {"fp16": {"enabled": True}}, cfg_of(Precision.BF16))
    assert "bf16.enabled=true contradicts the precision (fp16); pass --bf16" in error_of(
        {"bf16": {"enabled": True}}, cfg_of(Precision.FP16), fp16_ok=True)
    assert "fp16.initial_scale_powr: not a DeepSpeed field (did you mean initial_scale_power?)" \
        in error_of({"fp16": {"initial_scale_powr": 8}}, cfg_of(Precision.FP16), fp16_ok=True)
    assert "--fp16 with --pipeline-model-parallel-size 2 is not supported" in error_of(
        {"zero_optimization": {"stage": 1}}, cfg_of(Precision.FP16, pp=2), fp16_ok=True)


def test_fp16_where_deepspeed_cannot_run_it_is_one_line():
    message = error_of({"zero_optimization": {"stage": 2}}, cfg_of(Precision.FP16), fp16_ok=False)
    assert message == ("x.json: --fp16: DeepSpeed runs fp16 only where the accelerator supports "
                       "it (a CUDA GPU, or a CPU with oneDNN fp16 kernels), and this machine's "
                       "does not; use --bf16 (or fp32) here")


def test_fp16_and_bf16_flags_exclude_each_other():
    base = ["--ds_config", "ds_configs/zero2_fp16.json", "--data-path", "d", "--tokenizer-model",
            "t.model"]
    assert config_from_args(build_parser().parse_args([*base, "--fp16"])).train.precision \
        is Precision.FP16
    with pytest.raises(UserInputError, match=r"^--bf16 and --fp16 contradict each other; pass "
                                             r"one of them$"):
        config_from_args(build_parser().parse_args([*base, "--fp16", "--bf16"]))


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_ds_configs_resolve(path: Path):
    precision = Precision.FP16 if "fp16" in path.name else Precision.FP32
    ok = resolve(json.loads(path.read_text()), cfg_of(precision), fp16_ok=True)
    assert ok["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert ok.get("fp16", {}).get("enabled", False) is (precision is Precision.FP16)
