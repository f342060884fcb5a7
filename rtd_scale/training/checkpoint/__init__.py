"""Checkpoints through DeepSpeed, plus what a resumed run needs to continue exactly, and the
rules that decide which checkpoint ``--load`` takes.

Layout: ``<save>/global_step<N>/`` holds DeepSpeed's model and optimizer states (ZeRO partitions
included), one ``rng_rank<R>.pt`` per rank (that rank's generator states: dropout),
``rtd_meta.json`` (step, consumed samples, process layout, resolved config) and, written last,
the completion record ``rtd_complete.json``. ``<save>/latest`` names the newest tag for
DeepSpeed's own tools (``zero_to_fp32.py``); rtd_scale writes it after the record and never
trusts it on load.

Completeness. A checkpoint counts only when its record is there and every file it lists has the
listed size. The record is written by rank 0 after every rank has written and fsynced its files
(an all-reduce tells rank 0 they all did), and before ``latest``; a save that dies at any point
before it leaves a directory that ``--load`` skips. A checkpoint rewritten under the same tag
loses its record before its first file is touched. Sizes catch truncation and missing files, not
flipped bytes (no checksums: hashing a 100 GB checkpoint would cost minutes per save); bytes
damaged in place that load as inf or NaN are refused after loading.

Safe loading. Every file is read with ``torch.load(weights_only=True)``: rtd_scale's own and
DeepSpeed's, through a checkpoint engine installed on the DeepSpeed engine, with only the few
DeepSpeed classes its optimizer states hold allow-listed. Before anything is built, every
``.pt`` file of the chosen checkpoint is checked the same way (the pickle's globals, without
reading the tensors), so a crafted file is refused in one line on every rank instead of on the
one rank that happens to read it.

Modules, one job each:

- ``files``: names and formats of the files, reading them (``safe_load``) and writing them
  (``torch_save``, the completion record, ``latest``), the checkpoint engine DeepSpeed reads
  and writes through (``install_safe_loading``);
- ``checks``: ``CHECKS``, the one list of checks every reader runs, each with its moment;
- ``choose``: which checkpoint ``--load`` (and the export) takes, falling back to an older
  complete one;
- ``compat``: whether a checkpoint can continue this run (process layout, precision, model
  shape, seed, data);
- ``layout_free``: the layout-free training state (fp32 masters and both AdamW moments under
  canonical names), gathered from an engine and sliced into one at any layout;
- ``convert``: a checkpoint's own world restarted to read it (a ZeRO-3 one's partition files
  read without engines: ``zero3_files``): its layout-free state beside it for a resume at
  another layout or precision, its weights for the export;
- ``save``: the collective save;
- ``load``: ``take`` (choose and check before anything is built), ``load_checked`` (DeepSpeed's
  load with the checks, training's and the export's alike) and training's ``load``.

torch, DeepSpeed and megatron-core are imported where used: choosing a checkpoint needs none of
them (the Slurm launcher asks which one ``--load`` would take before it starts the ranks).
"""
