#!/usr/bin/env python
"""Export a pretraining run to Hugging Face transformers.

    python tools/export_hf.py --load runs/base --output hf/base [--tag global_step500000] [--overwrite]

Reads the checkpoint (default: the newest complete one, as --load takes it) whatever its tensor-parallel,
pipeline-parallel and ZeRO layout: the run's recorded world is started again as local gloo
processes on CPU, each loads its own DeepSpeed files, and they gather one consolidated state
(rtd_scale/hf/consolidate.py). Writes, under a temporary name renamed when complete:

    DIR/             the discriminator (what you fine-tune): config.json, model.safetensors,
                     tokenizer files; ElectraForPreTraining (post-LayerNorm runs),
                     RobertaPreLayerNormModel + rtd_head.safetensors (pre-LayerNorm runs) or
                     DebertaV2Model + rtd_head.safetensors (--attention-type disentangled)
    DIR/generator/   the generator: ElectraForMaskedLM, RobertaPreLayerNormForMaskedLM,
                     DebertaV2ForMaskedLM or ModernBertForMaskedLM

A run of the masked-LM control (--set rtd.objective=mlm) has one model: DIR holds it as its
layout's masked-LM class (the generator's above, at the discriminator's shape, its head kept).

Both load offline with ``AutoTokenizer.from_pretrained(DIR)`` and
``AutoModel….from_pretrained(DIR)``, under transformers 4.x and 5.x. See rtd_scale/hf/adapters.py
(one module per target class) for the exact mapping. An existing export at DIR is refused unless
--overwrite, which replaces it only once the new one is complete (a failure on the way leaves the
old one as it was).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import OneLineArgumentParser, exit_process, run_cli  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, metavar="RUN",
                   help="the run directory (pretrain.py's --save)")
    p.add_argument("--tag", help="checkpoint to export, e.g. global_step1000 (default: the newest complete one, as --load takes it)")
    p.add_argument("--output", required=True, metavar="DIR", help="export directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at --output (atomically, once the new one "
                   "is complete)")
    p.add_argument("--tokenizer-model", help="the run's tokenizer, when it is no longer where "
                   "the run's config.json says")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    from rtd_scale.config import Objective
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.hf import convert
    from rtd_scale.hf.consolidate import consolidate_checkpoint, read_run
    from rtd_scale.hf.export import check_output_dir, write_export

    overwrite_flag = None if args.overwrite else "--overwrite"
    check_output_dir(args.output, "--output", overwrite_flag=overwrite_flag)
    notes: list[str] = []
    cfg, _, _, tag = read_run(args.load, args.tag, note=notes.append)
    convert.check_exportable(cfg.trained_model())  # before the ranks start: a shape HF cannot hold
    print(f"exporting {tag} from {args.load}")
    for line in notes:
        print(line)
    state, cfg, tag = consolidate_checkpoint(args.load, tag, args.tokenizer_model)
    tok = Tokenizer(cfg.data.tokenizer_model)
    masked_lm = cfg.rtd.objective is Objective.MLM  # the masked-LM control: one model
    write_export(state, cfg.trained_model(), args.output, pad_id=tok.pad_id, cls_id=tok.cls_id,
                 sep_id=tok.sep_id, tokenizer_model=cfg.data.tokenizer_model,
                 overwrite_flag=overwrite_flag, masked_lm=masked_lm)
    disc, gen = convert.class_names(cfg.trained_model())
    if masked_lm:
        print(f"exported {args.load}/{tag}: {args.output} ({gen}, the masked LM)")
        return
    print(f"exported {args.load}/{tag}: {args.output} ({disc}), "
          f"{args.output}/{convert.GENERATOR_DIR} ({gen})")


if __name__ == "__main__":
    exit_process(run_cli(main))
