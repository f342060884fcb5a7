"""Names of the RTD step's phases, shared by the per-phase timers (``training/timers.py``,
``--timing-log-level``) and the step profiler's ranges (``training/profiler.py``). Torch-free, so
``model/`` and ``training/`` both read them without importing each other.

The one-stage step (STYLE rule 5): data wait → mask → generator forward → sample → discriminator
forward → backward → optimizer step. Under pipeline parallelism (``training/pipeline.py``) the
step is instead the generator pass, the hand-over of the corrupted ids, the discriminator pass
and the all-reduce of the tied gradients, then the optimizer step.
"""
from __future__ import annotations

PHASE_DATA_WAIT = "rtd/data_wait"
PHASE_MASK = "rtd/mask"
PHASE_GENERATOR_FORWARD = "rtd/generator_forward"
PHASE_SAMPLE = "rtd/sample"
PHASE_DISCRIMINATOR_FORWARD = "rtd/discriminator_forward"
PHASE_BACKWARD = "rtd/backward"
PHASE_OPTIMIZER_STEP = "rtd/optimizer_step"

ALL = (PHASE_DATA_WAIT, PHASE_MASK, PHASE_GENERATOR_FORWARD, PHASE_SAMPLE,
       PHASE_DISCRIMINATOR_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER_STEP)

# The whole forward (mask, generator forward, sample, discriminator forward and the losses):
# the coarse timers' one forward phase.
PHASE_FORWARD = "rtd/forward"

# Pipeline parallelism (training/pipeline.py, its steps 1–4): each pass is megatron-core's 1F1B
# schedule, forward and backward of one encoder over all micro-batches.
PHASE_PIPELINE_GENERATOR_PASS = "rtd/pipeline_generator_pass"
PHASE_PIPELINE_ID_HANDOVER = "rtd/pipeline_id_handover"
PHASE_PIPELINE_DISCRIMINATOR_PASS = "rtd/pipeline_discriminator_pass"
PHASE_PIPELINE_TIED_GRADIENTS = "rtd/pipeline_tied_gradients"

PIPELINE = (PHASE_PIPELINE_GENERATOR_PASS, PHASE_PIPELINE_ID_HANDOVER,
            PHASE_PIPELINE_DISCRIMINATOR_PASS, PHASE_PIPELINE_TIED_GRADIENTS)
