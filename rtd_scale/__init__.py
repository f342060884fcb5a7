"""rtd_scale: replaced-token-detection pretraining (ELECTRA, DeBERTaV3) on megatron-core and DeepSpeed.

``RTD_SCALE_LAZY_FUSIONS=1`` in the environment installs one import hook,
:mod:`rtd_scale._lazy_fusions`: megatron-core's and DeepSpeed's ``torch.compile``-decorated
fusions then compile on their first call instead of at import, so a process whose config never
calls them (a CPU run) starts several seconds sooner. The tests (``tests/conftest.py``) and the
CPU launcher (``tools/run_default.sh``) set it; without it nothing is patched and the libraries
import as they ship.
"""
import os

if os.environ.get("RTD_SCALE_LAZY_FUSIONS") == "1":
    from rtd_scale import _lazy_fusions

    _lazy_fusions.install()
