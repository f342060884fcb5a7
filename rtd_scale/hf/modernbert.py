"""The modern block (rotary attention, pre-LN) → ModernBERT (``ModernBertModel`` /
``ModernBertForMaskedLM``, transformers ``models/modernbert/``, arXiv 2412.13663).

Names: ``embeddings.table`` → ``embeddings.tok_embeddings``, the embedding norm →
``embeddings.norm``; layer i's ``input_layernorm`` → ``layers.{i}.attn_norm`` (none in layer 0:
an identity in both), ``linear_qkv`` → ``attn.Wqkv`` as q | k | v blocks of heads (megatron-core's
per-head rows split by ``common.split_qkv`` and concatenated; ``ModernBertAttention`` views the
output as [.., 3, heads, d]), ``linear_proj`` → ``attn.Wo``, ``pre_mlp_layernorm`` →
``mlp_norm``, the gated ``linear_fc1`` → ``mlp.Wi`` as it is (ours is [a; g] at every TP size,
``model/weights.py``; ``ModernBertMLP``: ``input, gate = Wi(x).chunk(2)``, ``act(input) * gate``),
``linear_fc2`` → ``mlp.Wo``, ``final_layernorm`` → ``final_norm``; biases where the block has
them. Config: ``hidden_activation`` "gelu" (exact GELU: GeGLU) or "silu" (SwiGLU),
``local_attention`` = ``window_size`` (both: |i − j| ≤ window // 2), the layer pattern and the two
RoPE bases written in both majors' fields (5.x: ``layer_types``, ``rope_parameters``; 4.x:
``global_attn_every_n_layers``, ``global_rope_theta``, ``local_rope_theta``), ``norm_bias``,
``attention_bias`` = ``mlp_bias`` = ``add_bias_linear``. ModernBERT has no embedding projection
(E must equal H), LayerNorm only and a gated MLP only: export refuses the rest in one line.

MLM head → ``head.{dense, norm}`` (``classifier_bias`` true: our dense has a bias;
``classifier_activation`` "gelu") and ``decoder`` tied to the table, with ``decoder_bias``. Our
head's LayerNorm always has a bias; ``ModernBertPredictionHead``'s follows ``norm_bias``, so in a
model without norm biases the head's bias β is folded into the decoder's: W(γ·n + β) + b =
W(γ·n) + (Wβ + b), computed in fp64; import gives β = 0 and that bias (the same logits; a
foreign checkpoint without ``classifier_bias`` gives a zero dense bias). The RTD head goes to
``rtd_head.safetensors``.
"""
from __future__ import annotations

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import MLPActivation
from rtd_scale.hf.common import Adapter, ExportError, Pair, mlm_head_names

ACTIVATIONS = {MLPActivation.GEGLU: "gelu", MLPActivation.SWIGLU: "silu"}  # hidden_activation
HEAD_BIASES = ("head.dense.bias", "head.norm.bias", "decoder.bias")


def _weight_bias(ours: str, theirs: str) -> list[Pair]:
    return [Pair(f"{ours}.weight", f"{theirs}.weight"),
            Pair(f"{ours}.bias", f"{theirs}.bias", optional=True)]


def _layer_types(model, num_layers: int) -> list[str]:
    return ["sliding_attention" if model.local_layer(i + 1) else "full_attention"
            for i in range(num_layers)]


class ModernBert(Adapter):
    name = "ModernBERT"
    model_type = "modernbert"
    attention_words = "rotary"
    discriminator_class = "ModernBertModel"
    generator_class = "ModernBertForMaskedLM"
    discriminator_base = ""
    generator_base = "model."
    fused_qkv = "layers.{i}.attn.Wqkv.{leaf}"
    word_table = Pair("embeddings.table.weight", "embeddings.tok_embeddings.weight")
    mlm_head_maps = (mlm_head_names("head", "norm", "decoder.bias"),)
    tied_to_table = ("decoder.weight",)
    checks_embedding_size = False  # no embedding projection: E = H
    # ModernBertModel.forward takes no token_type_ids (answerdotai/ModernBERT-base's tokenizer)
    tokenizer_inputs = ["input_ids", "attention_mask"]
    # heads a ModernBertModel read from a ModernBertFor… checkpoint leaves aside
    ignored_heads = ("head.", "decoder.", "classifier.")

    def check_exportable(self, model):
        flag = None
        if model.normalization != "LayerNorm":
            flag = (f"--normalization {model.normalization}", "LayerNorm only",
                    "--normalization LayerNorm")
        elif not model.mlp_activation.gated:
            flag = (f"model.mlp_activation {model.mlp_activation.value!r}",
                    "a gated MLP only (GeGLU, SwiGLU)", "--set model.mlp_activation=geglu or "
                    "--swiglu")
        else:
            for name in ("discriminator", "generator"):
                h = getattr(model, name).hidden_size
                if h != model.embedding_size:
                    flag = (f"model.embedding_size {model.embedding_size} != model.{name}."
                            f"hidden_size {h}", "no embedding projection",
                            "an embedding size equal to both hidden sizes")
                    break
        if flag:
            raise ExportError(f"cannot export: Hugging Face ModernBERT has {flag[1]}, but "
                              f"{flag[0]}; train with {flag[2]}")

    def hf_config(self, model, which, *, pad_id, cls_id, sep_id):
        from transformers import ModernBertConfig

        enc = getattr(model, which)
        windowed = model.window_size > 0
        every = model.global_attn_every_n_layers if windowed else 1
        window = model.window_size if windowed else model.max_position_embeddings
        bases = {"global_rope_theta": model.rotary_base,
                 "local_rope_theta": model.local_rotary_base}
        config = ModernBertConfig(
            vocab_size=model.vocab_size, hidden_size=enc.hidden_size,
            intermediate_size=enc.ffn_hidden_size, num_hidden_layers=enc.num_layers,
            num_attention_heads=enc.num_attention_heads,
            hidden_activation=ACTIVATIONS[model.mlp_activation],
            max_position_embeddings=model.max_position_embeddings,
            initializer_range=model.init_method_std, norm_eps=enc.layernorm_epsilon,
            norm_bias=model.norm_bias, attention_bias=model.add_bias_linear,
            mlp_bias=model.add_bias_linear, attention_dropout=enc.attention_dropout,
            embedding_dropout=enc.hidden_dropout, mlp_dropout=enc.hidden_dropout,
            local_attention=window, global_attn_every_n_layers=every,
            layer_types=_layer_types(model, enc.num_layers),
            rope_parameters={"full_attention": {"rope_type": "default",
                                                "rope_theta": model.rotary_base},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": model.local_rotary_base}},
            decoder_bias=True, classifier_bias=True, classifier_activation="gelu",
            pad_token_id=pad_id, bos_token_id=cls_id, eos_token_id=sep_id,
            cls_token_id=cls_id, sep_token_id=sep_id, architectures=[self.class_of(which)],
            **bases)
        # transformers 4.x reads the pattern and the bases from these fields, 5.x from
        # layer_types / rope_parameters (and drops them from its own config.json): both are
        # written (tests/e2e/test_hf_export_transformers4.py)
        for key, value in {**bases, "global_attn_every_n_layers": every}.items():
            setattr(config, key, value)
        return config

    def encoder_pairs(self, num_layers, projected):
        # no embedding projection: check_exportable refuses E ≠ H; layer 0 has no attn_norm
        pairs = _weight_bias("embeddings.norm", "embeddings.norm")
        for i in range(num_layers):
            ours, theirs = f"block.layers.{i}.", f"layers.{i}."
            if i:
                pairs += _weight_bias(ours + "input_layernorm", theirs + "attn_norm")
            for a, b in (("self_attention.linear_proj", "attn.Wo"),
                         ("pre_mlp_layernorm", "mlp_norm"), ("mlp.linear_fc1", "mlp.Wi"),
                         ("mlp.linear_fc2", "mlp.Wo")):
                pairs += _weight_bias(ours + a, theirs + b)
        return pairs + _weight_bias("block.final_layernorm", "final_norm")

    def mlm_head_to_hf(self, head, table, model):
        if not model.norm_bias:  # ModernBertPredictionHead.norm has no bias: fold it
            beta = head.pop("head.norm.bias").double()
            head["decoder.bias"] = (head["decoder.bias"].double()
                                    + table.double() @ beta).float()

    def mlm_head_from_hf(self, state, model):
        out = dict(state)
        for name in HEAD_BIASES:  # norm_bias / classifier_bias / decoder_bias false there
            if name not in out:
                out[name] = out[name.replace(".bias", ".weight")].new_zeros(
                    out[name.replace(".bias", ".weight")].shape[0])
        return out

    def check_source(self, src, model, where):
        """Refuse a ModernBertConfig whose computation is not this model's.

        Raises:
            UserInputError: one line naming the config field, both values and the fix.
        """
        c = src.config
        enc_layers = c.num_hidden_layers
        every = getattr(c, "global_attn_every_n_layers", 3)
        types = getattr(c, "layer_types", None) or [
            "sliding_attention" if i % every else "full_attention" for i in range(enc_layers)]
        rope = getattr(c, "rope_parameters", None) or {}
        bases = {kind: (rope.get(kind) or {}).get("rope_theta", getattr(c, key, None))
                 for kind, key in (("full_attention", "global_rope_theta"),
                                   ("sliding_attention", "local_rope_theta"))}
        local = "sliding_attention" in types
        act = {v: k for k, v in ACTIVATIONS.items()}.get(c.hidden_activation)
        norm_bias, linear_bias = bool(c.norm_bias), bool(c.attention_bias)
        checks = [("hidden_activation", c.hidden_activation,
                   ACTIVATIONS.get(model.mlp_activation),
                   f"--set model.mlp_activation={act.value}" if act else None),
                  ("norm_bias", norm_bias, model.norm_bias,
                   f"--set model.norm_bias={str(norm_bias).lower()}"),
                  ("attention_bias", linear_bias, model.add_bias_linear,
                   f"--set model.add_bias_linear={str(linear_bias).lower()}"),
                  ("mlp_bias", bool(c.mlp_bias), linear_bias, None),
                  ("classifier_activation", c.classifier_activation, "gelu", None),
                  ("rope_parameters[full_attention].rope_theta", bases["full_attention"],
                   model.rotary_base, f"--rotary-base {bases['full_attention']}")]
        if local:
            checks += [("local_attention", c.local_attention, model.window_size,
                        f"--window-size {c.local_attention}"),
                       ("layer_types", types, _layer_types(model, enc_layers),
                        f"--set model.global_attn_every_n_layers={every}"),
                       ("rope_parameters[sliding_attention].rope_theta",
                        bases["sliding_attention"], model.local_rotary_base,
                        f"--set model.local_rotary_base={bases['sliding_attention']}")]
        elif model.window_size > 0 and any(model.local_layer(i + 1) for i in range(enc_layers)):
            checks.append(("layer_types", types, _layer_types(model, enc_layers),
                           "--window-size -1"))
        for key, theirs, ours, fix in checks:
            if theirs != ours:
                why = (f"pass {fix}" if fix else "rtd_scale's modern block computes "
                       f"{ours!r}: pass a checkpoint with {key}={ours!r}")
                raise UserInputError(f"{where} {key} is {theirs!r} there but {ours!r} in this "
                                     f"model; {why}")


ADAPTER = ModernBert()
