"""bench/gpu_rtd_step.py's pieces, by what they time (the command and its flags:
``bench/gpu_rtd_step.py``):

- ``workloads``: the run's settings, the workloads and their rtd_scale configs, the row titles;
- ``timing``: a row, a step (``Stepper``), the clocks, the matmul ceiling, the timed steps and
  the phase split (``training/timers.py``'s ``PhaseTimers``);
- ``rtd_rows``: rtd_scale's rows — ``training/step.py``'s ``train_step`` in a DeepSpeed engine,
  the same model without DeepSpeed — and the layer stacks alone;
- ``hf_rows``: the Hugging Face reference RTD step (models and loss: ``bench/common.py``);
- ``census``: where the time goes — torch.profiler by kernel family, the host-sync census, the
  masking's and sampler's own cost;
- ``run``: the planned rows, each under its budget and the run's deadline, failures reported;
- ``child``: one row in a process of its own (``python -m bench.gpu.child``), for the
  ``torch.compile`` rows that the deadline may have to cut off;
- ``report``: the tables and the header.
"""
