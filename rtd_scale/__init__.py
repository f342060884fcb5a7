"""rtd_scale: replaced-token-detection pretraining (ELECTRA, DeBERTaV3) on megatron-core and DeepSpeed.

Importing the package installs one import hook, :mod:`rtd_scale._lazy_fusions`: while
megatron-core's package (and DeepSpeed's Muon module) is first imported, its
``torch.compile``-decorated functions are wrapped so that they compile on first call instead of
at import. Behaviour is unchanged; every process that imports megatron-core or builds a ZeRO
engine (each rank, each test worker) starts several seconds sooner.
"""
from rtd_scale import _lazy_fusions

_lazy_fusions.install()
