"""``--load`` of a checkpoint saved at another process layout, through the real ``deepspeed``
launcher and rtd_scale's layout-free state (training/checkpoint/convert.py, layout_free.py): the
resumed steps 4–6 repeat the uninterrupted run's losses, learning rate and gradient norm within
1e-5 relative, and its final fp32 weights (and, where the layout changes tensor or pipeline
parallelism, both AdamW moments) too: DP 2 ZeRO-3 ↔ DP 1 ZeRO-1, TP 2 × DP 2 ZeRO-3 → TP 1 ZeRO-0,
PP 2 ZeRO-1 → PP 1 ZeRO-2, TP 1 → TP 2 ZeRO-1, DeBERTa's layout TP 1 → TP 2 ZeRO-3; and a
masked-LM control (``rtd.objective=mlm``, DeBERTa's layout) TP 1 → TP 2 ZeRO-3; and a
ZeRO-Offload checkpoint resumed without offload at ZeRO-1, ZeRO-2 and on another rank count
(tests/multiproc/test_layout_free.py takes every pair of ds_configs/ files through the same state).
The route has a control: the converted AdamW moments zeroed, step 5 (the first update) differs.

Runs are shared: one uninterrupted run per model layout (post-LN BERT attention: TP 1 × DP 2,
ZeRO-3; DeBERTa: TP 1 × DP 1, ZeRO-1; 6 steps, checkpoints at 3 and 6) is the reference
of every pair in that layout — the uninterrupted run at the new layout too: rtd_scale's samples,
masks and sampling noise are functions of the global sample index and step, its initial weights
of (seed, parameter name) at any TP size, and its losses are normalised over the global batch,
so every step is the same at every layout within rounding (dropout 0: megatron-core's dropout
RNG depends on the TP rank) — and the source of the pairs that start from it.
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.damage import nan_into_first_float
from tests.helpers.launcher import (NO_DROPOUT, assert_close, common, cut_back, file_digests,
                                    fp32_weights, launch, scalars)

pytestmark = pytest.mark.e2e

REL = 1e-5
POST_LN = ["--layernorm-position", "post"]
DEBERTA = ["--attention-type", "disentangled", "--layernorm-position", "post"]
MLM = ["--set=rtd.objective=mlm"]


def _args(wiki_shards, save, iters, zero, extra=(), layout=POST_LN, tp=1, pp=1):
    args = common(wiki_shards, save, iters, [*NO_DROPOUT, *layout, *extra,
                                             "--tensor-model-parallel-size", str(tp),
                                             "--pipeline-model-parallel-size", str(pp)])
    args[args.index("--ds_config") + 1] = f"ds_configs/zero{zero}.json"
    return args


def _canonical(run, tag, tmp_path_factory) -> dict:
    """The layout-free training state of ``run``'s checkpoint ``tag`` (fp32 weights and both
    AdamW moments under canonical names), gathered by restarting its layout."""
    from rtd_scale.training.checkpoint.convert import write_training_state

    out = tmp_path_factory.mktemp("canonical")
    write_training_state(str(run), tag, str(out))
    return torch.load(out / "state.pt", weights_only=True)


@pytest.fixture(scope="module")
def straight(wiki_shards, tmp_path_factory):
    """(run directory, TensorBoard scalars, fp32 weights at step 6) of the uninterrupted
    post-LN run at TP 1 × DP 2, ZeRO-3."""
    run = tmp_path_factory.mktemp("layout") / "straight"
    r = launch(_args(wiki_shards, run, 6, 3), ranks=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run, scalars(str(run / "tensorboard")), fp32_weights(run, "global_step6")


@pytest.fixture(scope="module")
def offloaded(wiki_shards, tmp_path_factory):
    """The same run to step 3 with ZeRO-Offload (ds_configs/zero3_offload.json: DeepSpeed's CPU
    Adam, which counts AdamW steps in an int); its steps 1–3 are the reference's."""
    run = tmp_path_factory.mktemp("layout") / "offloaded"
    r = launch(_args(wiki_shards, run, 3, "3_offload"), ranks=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def straight_state(straight, tmp_path_factory):
    """Its layout-free state at step 6."""
    return _canonical(straight[0], "global_step6", tmp_path_factory)


@pytest.fixture(scope="module")
def deberta(wiki_shards, tmp_path_factory):
    """(run directory, scalars, layout-free state at step 6) of the uninterrupted DeBERTa-layout
    run at TP 1 × DP 1, ZeRO-1."""
    run = tmp_path_factory.mktemp("layout") / "deberta"
    r = launch(_args(wiki_shards, run, 6, 1, layout=DEBERTA), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return (run, scalars(str(run / "tensorboard")),
            _canonical(run, "global_step6", tmp_path_factory))


@pytest.fixture(scope="module")
def deberta_mlm(wiki_shards, tmp_path_factory):
    """As ``deberta``, for the masked-LM control (``rtd.objective=mlm``)."""
    run = tmp_path_factory.mktemp("layout") / "deberta_mlm"
    r = launch(_args(wiki_shards, run, 6, 1, MLM, layout=DEBERTA), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return (run, scalars(str(run / "tensorboard")),
            _canonical(run, "global_step6", tmp_path_factory))


def _assert_steps(r, run, ref: dict) -> None:
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resumed from {run} at iteration 3 (48 samples consumed)" in r.stdout
    resumed = scalars(str(run / "tensorboard"))
    assert max(resumed["loss/mlm"]) == 6 and {4, 5, 6} <= set(resumed["loss/mlm"])
    # rtd.objective=mlm logs no loss/rtd
    tags = [t for t in ("loss/mlm", "loss/rtd", "optim/lr", "optim/grad_norm") if t in ref]
    worst = {tag: max(abs(resumed[tag][s] - ref[tag][s]) / abs(ref[tag][s]) for s in (4, 5, 6))
             for tag in tags}
    print(f"{run.name}: steps 4–6, largest relative difference: "
          + ", ".join(f"{tag} {v:.2g}" for tag, v in worst.items()))
    for step in (4, 5, 6):
        for tag in tags:
            assert_close(resumed[tag][step], ref[tag][step], REL, (tag, step))


def _conversion_seconds(r, run, was: str, now: str) -> float:
    lines = [line for line in r.stdout.splitlines() if line.startswith("converted ")]
    assert len(lines) == 1, lines
    what = rf"layout-free state {re.escape(str(run))}/global_step3_canonical"
    m = re.fullmatch(rf"converted {re.escape(str(run))}/global_step3 from {re.escape(was)} to "
                     rf"{re.escape(now)} \({what}\) in (\d+\.\d) s, (\d) process(?:es)? (at its "
                     r"layout|reading its ZeRO-3 partition files), the largest (\d+\.\d\d) GB "
                     r"resident at its peak", lines[0])
    assert m, lines[0]
    # the checkpoint's own world restarted, or under ZeRO-3 one process per TP rank reading
    # the partition files (zero3_files.py); a tiny model's process is its runtime, under 2 GB
    size = {d: int(re.search(rf"{d} (\d)", was).group(1)) for d in ("TP", "PP", "DP")}
    if "ZeRO-3" in was:
        assert (int(m.group(2)), m.group(3)) == (size["TP"], "reading its ZeRO-3 partition files")
    else:
        assert (int(m.group(2)), m.group(3)) == (size["TP"] * size["PP"] * size["DP"],
                                                 "at its layout")
    assert 0.1 < float(m.group(4)) < 2.0, lines[0]
    # the one-kind-at-a-time gather's files (layout_free.write) are gone
    assert sorted(p.name for p in (run / "global_step3_canonical").iterdir()) == [
        "rtd_canonical_complete", "state.pt", "training_state.json"]
    print(f"{run.name}: conversion {was} -> {now}: {m.group(1)} s, peak {m.group(4)} GB")
    return float(m.group(1))


def _assert_continues(r, run, straight, was: str, now: str, weights_rel: float = REL) -> float:
    """The resumed run converted once, then repeated steps 4–6 and the final fp32 weights (read
    by DeepSpeed's own ``zero_to_fp32``; ``torch.allclose`` with rtol and atol × the tensor's
    largest value ``weights_rel``); returns the conversion's seconds."""
    seconds = _conversion_seconds(r, run, was, now)
    _assert_steps(r, run, straight[1])
    ref_weights = straight[2]
    weights = fp32_weights(run, "global_step6")
    assert sorted(weights) == sorted(ref_weights)
    worst = max(float((w - ref_weights[n]).abs().max() / ref_weights[n].abs().max())
                for n, w in weights.items())
    print(f"{run.name}: final fp32 weights, largest |difference| / max |reference|: {worst:.2g}")
    for name, w in weights.items():
        scale = ref_weights[name].abs().max().item()
        assert torch.allclose(w, ref_weights[name], rtol=weights_rel,
                              atol=weights_rel * scale), name
    assert not list(run.glob(".global_step3_canonical.tmp-*"))  # renamed when complete
    assert (run / "global_step3_canonical" / "rtd_canonical_complete").is_file()
    return seconds


def _max_rel(got: dict, ref: dict) -> dict[str, float]:
    """Per kind (fp32, exp_avg, exp_avg_sq): the largest |got − ref| / max|ref| over tensors."""
    out = {}
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        assert sorted(got[kind]) == sorted(ref[kind]), kind
        out[kind] = max(((got[kind][n] - ref[kind][n]).abs().max()
                         / ref[kind][n].abs().max().clamp_min(1e-30)).item() for n in ref[kind])
    return out


def _assert_state_close(run, ref_state: dict, tmp_path_factory, what: str) -> None:
    """The resumed run's final fp32 weights and both AdamW moments, merged from its own layout,
    equal the reference's as the weights of the DP pairs do (``torch.allclose`` with
    rtol REL and atol REL × the tensor's largest value)."""
    got = _canonical(run, "global_step6", tmp_path_factory)
    print(f"{what}: max |difference| / max |reference| per tensor at step 6: "
          f"{_max_rel(got, ref_state)}")
    for kind, tensors in ref_state.items():
        for name, ref in tensors.items():
            scale = ref.abs().max().item()
            assert torch.allclose(got[kind][name], ref, rtol=REL, atol=REL * scale), (kind, name)


def _assert_canonical_resume(r, run, ref, ref_state, tmp_path_factory, was, now, before):
    _conversion_seconds(r, run, was, now)
    _assert_steps(r, run, ref)
    _assert_state_close(run, ref_state, tmp_path_factory, f"{was} -> {now}")
    assert file_digests(run / "global_step3") == before  # the original is only read
    assert not list(run.glob(".global_step3_canonical.tmp-*"))  # renamed when complete
    assert (run / "global_step3_canonical" / "rtd_canonical_complete").is_file()


def _saved_at_step3(wiki_shards, run, zero: int, ranks: int, **layout) -> dict:
    """A 3-step run at ZeRO-``zero`` on ``ranks`` ranks (``tp=``/``pp=``) saving into ``run``;
    returns the digests of its global_step3, which the resume must leave as they are."""
    r = launch(_args(wiki_shards, run, 3, zero, **layout), ranks=ranks)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return file_digests(run / "global_step3")


def _zeroed_moments_part_at_step5(wiki_shards, zeroed, zero: int, ref: dict) -> None:
    """``zeroed``, a cut-back copy whose conversion's AdamW moments were zeroed, resumed at one
    rank and ZeRO-``zero``: the conversion is reused, step 4 (the restored weights) still
    matches the reference ``ref``, step 5 (the first update) no longer does: the moments, not
    the weights alone, carried the continuation."""
    r = launch(_args(wiki_shards, zeroed, 6, zero, ["--load", str(zeroed)]), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reusing the conversion made earlier" in r.stdout
    got = scalars(str(zeroed / "tensorboard"))
    assert_close(got["loss/mlm"][4], ref["loss/mlm"][4], REL, "step 4")
    assert abs(got["loss/mlm"][5] - ref["loss/mlm"][5]) > 10 * REL * abs(ref["loss/mlm"][5])


@pytest.mark.parametrize("zero,ranks", [(1, 2), (2, 2), (3, 1)])
def test_offload_checkpoint_resumes_without_offload(wiki_shards, straight, offloaded, tmp_path,
                                                    zero, ranks):
    """DP 2 ZeRO-3 with ZeRO-Offload → ZeRO-1 and ZeRO-2 on 2 ranks, ZeRO-3 on 1, none
    offloaded: torch's AdamW gets its step count as a tensor and continues; the original
    checkpoint's files stay byte-identical. Steps 1–3 ran in DeepSpeed's CPU Adam, 4–6 in
    torch's AdamW: the final weights differ from the reference's (torch's AdamW throughout) by
    the two implementations' rounding, which Adam's normalisation lifts on GDES's E_Δ (rows with
    near-zero gradients) to 7.9e-6 of its largest value here and 1.2e-5 against a run that was
    offloaded throughout (measured), so they are held to 10 × REL; the losses, lr and gradient
    norm of steps 4–6 to REL."""
    run = cut_back(offloaded, tmp_path / f"offload_to_z{zero}", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, zero, ["--load", str(run)]), ranks=ranks)
    seconds = _assert_continues(r, run, straight, "TP 1 × PP 1 × DP 2, ZeRO-3",
                                f"TP 1 × PP 1 × DP {ranks}, ZeRO-{zero}", weights_rel=10 * REL)
    assert 0.0 < seconds < 120.0
    assert file_digests(run / "global_step3") == before


def test_zero3_partition_files_read_as_its_engines_read_them(straight, straight_state,
                                                            tmp_path):
    """The reference's ZeRO-3 checkpoint (TP 1 × DP 2) read from its partition files, one
    process and no engine (zero3_files.py), equals to the bit what its restarted world of
    engines gathers (DeepSpeed's safe_get_full_fp32_param / safe_get_full_optimizer_state):
    weights, both AdamW moments, the AdamW step and the loss scaler; a parameter of odd size
    (the RTD head's bias) is padded in its partitions."""
    import json

    from rtd_scale.training.checkpoint.convert import write_training_state

    write_training_state(str(straight[0]), "global_step6", str(tmp_path), engines=True)
    engines = torch.load(tmp_path / "state.pt", weights_only=True)
    assert sorted(engines) == sorted(straight_state) == ["exp_avg", "exp_avg_sq", "fp32"]
    for kind, tensors in engines.items():
        assert tensors.keys() == straight_state[kind].keys()
        unequal = [n for n, t in tensors.items() if not torch.equal(t, straight_state[kind][n])]
        assert not unequal, (kind, unequal[:3])
    assert any(t.numel() % 2 for t in engines["fp32"].values())
    assert all(t.abs().max() > 0 for t in engines["exp_avg_sq"].values())
    info = json.loads((tmp_path / "training_state.json").read_text())
    files = tmp_path / "files"
    files.mkdir()
    write_training_state(str(straight[0]), "global_step6", str(files))
    assert json.loads((files / "training_state.json").read_text()) == info
    assert info["adam_step"] == 6.0


def test_zero3_two_ranks_resumes_at_zero1_one_rank(wiki_shards, straight, tmp_path):
    """DP 2 ZeRO-3 → DP 1 ZeRO-1; the original checkpoint's files stay byte-identical."""
    run = cut_back(straight[0], tmp_path / "z3_to_z1", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 1, ["--load", str(run)]), ranks=1)
    _assert_continues(r, run, straight, "TP 1 × PP 1 × DP 2, ZeRO-3",
                      "TP 1 × PP 1 × DP 1, ZeRO-1")
    assert file_digests(run / "global_step3") == before


def test_zero1_one_rank_resumes_at_zero3_two_ranks_exactly(wiki_shards, straight, tmp_path):
    """DP 1 ZeRO-1 (3 steps, saved at 3) → DP 2 ZeRO-3 to step 6: equals the DP 2 run."""
    run = tmp_path / "z1_to_z3"
    before = _saved_at_step3(wiki_shards, run, 1, 1)
    r = launch(_args(wiki_shards, run, 6, 3, ["--load", str(run)]), ranks=2)
    _assert_continues(r, run, straight, "TP 1 × PP 1 × DP 1, ZeRO-1",
                      "TP 1 × PP 1 × DP 2, ZeRO-3")
    assert file_digests(run / "global_step3") == before


def test_tp2_dp2_zero3_resumes_at_tp1_zero0_with_its_adam_moments(
        wiki_shards, straight, straight_state, tmp_path, tmp_path_factory):
    """TP 2 × DP 2 ZeRO-3 (3 steps, 4 ranks) → TP 1 × DP 1 ZeRO-0 to step 6: equals the
    reference, moments included. Then the same resume with the layout-free state's moments
    zeroed (reused): step 4 matches, step 5 does not."""
    run = tmp_path / "tp2_to_tp1"
    before = _saved_at_step3(wiki_shards, run, 3, 4, tp=2)
    r = launch(_args(wiki_shards, run, 6, 0, ["--load", str(run)]), ranks=1)
    _assert_canonical_resume(r, run, straight[1], straight_state, tmp_path_factory,
                             "TP 2 × PP 1 × DP 2, ZeRO-3", "TP 1 × PP 1 × DP 1, ZeRO-0", before)

    zeroed = cut_back(run, tmp_path / "zeroed_moments", 3)
    path = zeroed / "global_step3_canonical" / "state.pt"
    state = torch.load(path, weights_only=True)
    for kind in ("exp_avg", "exp_avg_sq"):
        assert len(state[kind]) > 20 and all(t.abs().max() > 0 for t in state[kind].values())
        state[kind] = {n: torch.zeros_like(t) for n, t in state[kind].items()}
    torch.save(state, path)
    _zeroed_moments_part_at_step5(wiki_shards, zeroed, 0, straight[1])

    # a partition file damaged in place (its size kept) is refused by every reading process in
    # one line naming it, not merged and not left waiting: here tensor-parallel rank 1's second
    # data-parallel file, which process 0 of the conversion never reads
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.convert import write_training_state

    damaged = cut_back(run, tmp_path / "damaged", 3)
    (bad,) = (damaged / "global_step3").glob("*zero_pp_rank_1_mp_rank_01_optim_states.pt")
    nan_into_first_float(str(bad))
    out = tmp_path / "damaged_out"
    out.mkdir()
    with pytest.raises(UserInputError) as e:
        write_training_state(str(damaged), "global_step3", str(out))
    assert str(e.value) == (
        f"{bad}: damaged: it holds 1 inf/NaN value(s) although its size matches the completion "
        "record (the loaded weights and AdamW moments hold 1); resume from an earlier "
        f"checkpoint (--load DIR/global_stepN) or delete {damaged / 'global_step3'}")
    assert not list(out.iterdir())


def test_pp2_zero1_resumes_at_pp1_zero2(wiki_shards, straight, straight_state, tmp_path,
                                        tmp_path_factory):
    """PP 2 ZeRO-1 (3 steps; stage-local layer names, the tied MLM output on the last stage;
    the pipeline step runs ZeRO-1 only) → PP 1 × DP 1 ZeRO-2 to step 6: equals the reference,
    moments included."""
    run = tmp_path / "pp2_to_pp1"
    before = _saved_at_step3(wiki_shards, run, 1, 2, pp=2)
    r = launch(_args(wiki_shards, run, 6, 2, ["--load", str(run)]), ranks=1)
    _assert_canonical_resume(r, run, straight[1], straight_state, tmp_path_factory,
                             "TP 1 × PP 2 × DP 1, ZeRO-1", "TP 1 × PP 1 × DP 1, ZeRO-2", before)


def test_tp1_resumes_at_tp2(wiki_shards, straight, straight_state, tmp_path, tmp_path_factory):
    """The reference's own checkpoint (TP 1 × DP 2 ZeRO-3) → TP 2 × DP 1 ZeRO-1 to step 6."""
    run = cut_back(straight[0], tmp_path / "tp1_to_tp2", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 1, ["--load", str(run)], tp=2), ranks=2)
    _assert_canonical_resume(r, run, straight[1], straight_state, tmp_path_factory,
                             "TP 1 × PP 1 × DP 2, ZeRO-3", "TP 2 × PP 1 × DP 1, ZeRO-1", before)


def test_deberta_tp1_resumes_at_tp2_zero3(wiki_shards, deberta, tmp_path, tmp_path_factory):
    """DeBERTa's layout (disentangled attention, its relative tables; post-LN): TP 1 ZeRO-1 →
    TP 2 × DP 1 ZeRO-3 to step 6."""
    run = cut_back(deberta[0], tmp_path / "deberta_tp1_to_tp2", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 3, ["--load", str(run)], layout=DEBERTA, tp=2),
               ranks=2)
    _assert_canonical_resume(r, run, deberta[1], deberta[2], tmp_path_factory,
                             "TP 1 × PP 1 × DP 1, ZeRO-1", "TP 2 × PP 1 × DP 1, ZeRO-3", before)


def test_masked_lm_tp1_resumes_at_tp2_zero3(wiki_shards, deberta_mlm, tmp_path,
                                           tmp_path_factory):
    """The masked-LM control (``rtd.objective=mlm``: one encoder, its tied head) in DeBERTa's
    layout: TP 1 ZeRO-1 → TP 2 × DP 1 ZeRO-3 to step 6, its weights and AdamW moments too."""
    run, ref, state = deberta_mlm
    assert "loss/rtd" not in ref and not [n for n in state["fp32"]
                                          if n.startswith("discriminator.")]
    run = cut_back(run, tmp_path / "mlm_tp1_to_tp2", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 3, ["--load", str(run), *MLM], layout=DEBERTA, tp=2),
               ranks=2)
    _assert_canonical_resume(r, run, ref, state, tmp_path_factory,
                             "TP 1 × PP 1 × DP 1, ZeRO-1", "TP 2 × PP 1 × DP 1, ZeRO-3", before)
