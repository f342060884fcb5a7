"""Names of the RTD step's phases, shared by the step profiler's ranges and the phase timers.
Torch-free, so ``model/`` and ``training/`` both read them without importing each other."""
from __future__ import annotations

# In step order (STYLE rule 5). What each covers, in the single-stage step:
MASK = "rtd/mask"  # masking and the generator's input (RTDModel.mask)
GENERATOR_FORWARD = "rtd/generator_forward"  # the generator encoder, embeddings to final norm
# the MLM head at masked positions, L_MLM and the sampled replacements (RTDModel.generator_head)
SAMPLE = "rtd/sample"
# the discriminator encoder, the RTD head, L_RTD and the weighted total (discriminator_head)
DISCRIMINATOR_FORWARD = "rtd/discriminator_forward"
BACKWARD = "rtd/backward"  # engine.backward of the micro-batch's loss
OPTIMIZER_STEP = "rtd/optimizer_step"  # engine.step (an optimizer update at the last micro-batch)

ALL = (MASK, GENERATOR_FORWARD, SAMPLE, DISCRIMINATOR_FORWARD, BACKWARD, OPTIMIZER_STEP)
