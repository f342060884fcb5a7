"""Long context: the second phase of a context extension through ``--load`` (ModernBERT, arXiv
2412.13663: 1,024 tokens at RoPE base 10,000, then 8,192 at a global base of 160,000) — accepted
for the rotary layout with one note, refused in one line where a position parameter cannot
follow (``training/checkpoint/compat.py``: ``check_positions``, ``context_note``) — and the
tiny modern model's forward at 8,192 tokens."""
from __future__ import annotations

import json

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import RunConfig
from rtd_scale.presets import preset
from rtd_scale.training.checkpoint.compat import check_compatible, context_note
from rtd_scale.training.checkpoint.files import META_FILE

LAYOUT = {"world_size": 1, "tensor_model_parallel_size": 1}


def _checkpoint(tmp_path, cfg: RunConfig) -> str:
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / META_FILE).write_text(
        json.dumps({"layout": LAYOUT, "config": cfg.to_dict()}))
    return str(tmp_path)


def _phases(name: str, first: int, second: int, **fields):
    """``name``'s config at ``first`` positions and tokens, and at ``second`` with ``fields``."""
    one, two = preset(name), preset(name)
    one.model.max_position_embeddings = one.data.seq_length = first
    two.model.max_position_embeddings = two.data.seq_length = second
    for k, v in fields.items():
        setattr(two.model, k, v)
    one.validate(), two.validate()
    return one, two


def test_the_rotary_layout_continues_at_a_longer_length_and_another_base_with_one_note(tmp_path):
    """No position parameter: a longer length, a raised global base and more declared positions
    load; the note names each change. A window change is another model."""
    one, two = _phases("modernbert-tiny", 1024, 8192)
    one.model.rotary_base = 10_000.0  # ModernBERT's first phase; the preset's is 160,000
    run = _checkpoint(tmp_path, one)
    assert check_compatible(run, "global_step4", two, LAYOUT) is not None
    assert context_note(one.model, two.model) == (
        "note: --rotary-base 160000 (the checkpoint's 10000), model.max_position_embeddings 8192 "
        "(the checkpoint's 1024): the rotary layout has no position parameters, so the weights "
        "load as they are and the rotary angles follow the new values from the first resumed "
        "iteration (ModernBERT's context extension)")
    assert context_note(one.model, one.model) is None
    bert, longer = preset("tiny"), preset("tiny")
    longer.model.max_position_embeddings = 512
    assert context_note(bert.model, longer.model) is None
    two.model.window_size = 64
    with pytest.raises(UserInputError) as e:
        check_compatible(run, "global_step4", two, LAYOUT)
    assert "holds another model (model.window_size 32 → 64)" in str(e.value)


def test_a_learned_position_table_cannot_grow_on_load(tmp_path):
    one, two = _phases("tiny", 128, 512)
    with pytest.raises(UserInputError) as e:
        check_compatible(_checkpoint(tmp_path, one), "global_step4", two, LAYOUT)
    assert str(e.value) == (
        f"--load {tmp_path}: global_step4 holds a learned position table of 128 rows, which "
        "cannot grow (model.max_position_embeddings 128 → 512) for --seq-length 512; train the "
        "first phase with model.max_position_embeddings at the longest length (BERT trains its "
        "512 rows at 128 tokens), or use --position-embedding-type rope, which has no position "
        "parameters")


def test_disentangled_buckets_refuse_a_longer_span_and_keep_a_fixed_one(tmp_path):
    """DeBERTaV3's max_relative_positions -1 spreads the log buckets over max_position_embeddings:
    refused. With the span given (the same on both sides) the buckets keep their distances."""
    one, two = _phases("debertav3-tiny", 128, 512)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with pytest.raises(UserInputError) as e:
        check_compatible(_checkpoint(tmp_path / "a", one), "global_step4", two, LAYOUT)
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"--load {tmp_path / 'a'}: global_step4 holds relative-position buckets spread over 128 "
        "positions (model.max_relative_positions -1: max_position_embeddings), whose learned rows "
        "would stand for other distances (model.max_position_embeddings 128 → 512) for "
        "--seq-length 512; train the first phase")
    one.model.max_relative_positions = two.model.max_relative_positions = 128
    assert check_compatible(_checkpoint(tmp_path / "b", one), "global_step4", two,
                            LAYOUT) is not None


def test_the_tiny_modern_model_at_4096_tokens_keeps_its_window_and_relative_positions(
        single_process_group):
    """``modernbert-tiny``'s discriminator, one sample of 4,096 tokens (8,192 takes 15 s on two
    loaded cores, the explicit [s, s] window mask's SDPA): every output finite; its first local
    layer's attention, given the same input but one token changed at position 3,000, changes
    exactly positions 3,000 ± 16 (the 32-token window); and RoPE stays relative out at positions
    8,168–8,191: 24 tokens there give the output they give at 0–23."""
    from tests.helpers.tiny_model import build

    cfg = preset("modernbert-tiny")
    cfg.model.vocab_size, cfg.data.seq_length = 300, 4096
    cfg.validate()
    disc = build(cfg, seed=1).discriminator
    s, p = 4096, 3000
    ids = torch.randint(5, 300, (1, s), generator=torch.Generator().manual_seed(0))
    ids[0, 0], ids[0, -1] = 1, 2
    seen = {}
    attention = disc.block.layers[1].self_attention  # layer 2: local
    hook = attention.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(args=args, kwargs=kwargs, out=out[0]),
        with_kwargs=True)
    with torch.no_grad():
        out = disc(ids, None)
        hook.remove()
        assert out.shape == (s, 1, 96) and torch.isfinite(out).all()
        hidden = seen["args"][0].clone() if seen["args"] else seen["kwargs"].pop("hidden_states")
        hidden[p] += 1.0
        kwargs = {k: v for k, v in seen["kwargs"].items() if k != "hidden_states"}
        changed = (attention(hidden, **kwargs)[0] - seen["out"]).abs().amax(dim=(1, 2)) > 0
        assert changed.nonzero().flatten().tolist() == list(range(p - 16, p + 17))
        short = ids[:, :24]
        far = disc(short, None, position_ids=torch.arange(8168, 8192).view(1, 24))
        torch.testing.assert_close(far, disc(short, None), atol=1e-4, rtol=1e-4)
