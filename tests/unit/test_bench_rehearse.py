"""bench/rehearse.py gives each layout the preset's real table: Megatron-LM pads the vocabulary
to a multiple of --make-vocab-size-divisible-by × TP, so the rehearsal's TP 2 layouts once
trained DeBERTaV3-large with 256,256 rows (two tables of 262M parameters), where its estimate
counted 128,128 — a rank OOM-killed at 9.5 GB against a layout chosen at 9.6 GB."""
from __future__ import annotations

import sys

from tests.helpers.env import REPO

sys.path.insert(0, str(REPO / "bench"))
import rehearse  # noqa: E402


def test_the_table_keeps_its_rows_at_every_layout():
    from rtd_scale.presets import preset

    for name, rows in (("debertav3-large", 128128), ("electra-large", 30592),
                       ("modernbert-large", 50432)):
        assert preset(name).model.padded_vocab_size(1) == rows
        for _, _, flags in rehearse.LAYOUTS:
            flag = rehearse.table_flags(rows, flags)
            tp = 2 if "--tensor-model-parallel-size" in flags else 1
            assert flag[0] == "--make-vocab-size-divisible-by"
            # the run pads the sample tokenizer's 8,000 pieces to one multiple of flag × TP
            assert int(flag[1]) * tp == rows, (name, flags)
    assert rehearse.table_flags(128128, ["--tensor-model-parallel-size", "2"]) == [
        "--make-vocab-size-divisible-by", "64064"]
