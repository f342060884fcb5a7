"""RTD pretraining entry point.

    deepspeed rtd_scale/pretrain.py --ds_config ds_configs/zero3.json --preset tiny \
        --data-path data/sample/shards_text_document --tokenizer-model data/sample/spm.model \
        --save runs/tiny --train-iters 300 ...

Flags follow Megatron-LM's names where one exists (``arguments.py``). Order of work: parse →
config (preset or ``--config``, flags, ``--set``; ``arguments.config_from_args``) → every check that
can fail on user input (config, ds_config, tokenizer vs shards, ``--load``, the output paths;
``prepare.py``) → the configuration's warnings (held until then, so a refused run prints only
its error) → distributed start (MASTER_ADDR resolved first) → model → DeepSpeed engine →
resolved config and ds_config written into the run directory → train → test split
(``--test-data-path``) → summary (``run.py``'s phases). A user error prints one line
``error: <what> — <fix>`` and exits 2 (``cli_errors.EXIT_USER_ERROR``, argparse's status for a
bad command line) before anything is written; a crash exits otherwise (1 for a Python
exception, 128 + N for signal N), which is what slurm/lib/pretrain_job.sh and
tools/supervise.py restart (``rtd_scale/restarts.py``). A native crash (SIGSEGV, SIGBUS, SIGABRT,
SIGFPE, SIGILL) prints the Python stack of every thread first (``faulthandler``).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Sequence

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script (``deepspeed rtd_scale/pretrain.py``): import the package, not its folder.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from rtd_scale import launch_env  # noqa: E402
from rtd_scale.arguments import build_parser, config_from_args  # noqa: E402
from rtd_scale.cli_errors import (EXIT_USER_ERROR, HeldWarnings, UserInputError,  # noqa: E402
                                  exit_process, one_line_warnings, wait_for_rank0_line)
from rtd_scale.run import run  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    # library noise that says nothing about the run
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="megatron")
    import signal

    from rtd_scale.training.signals import DEFAULT_SIGNALS, StopRequest

    rank = 0
    try:
        rank = launch_env.read().rank
        # every rank parses the same flags: a flag error is rank 0's one line, the other ranks
        # exit with the same status silently
        # (tests/e2e/test_pretrain_errors.py::test_launcher_prints_a_flag_error_once)
        args = build_parser(quiet=rank != 0).parse_args(argv)
        # entered first: a signal during start-up or load counts too (training/signals.py)
        signums = [*DEFAULT_SIGNALS, *([getattr(signal, args.exit_signal)]
                                       if args.exit_signal_handler else [])]
        if rank != 0:  # every rank would repeat the same configuration warnings
            warnings.simplefilter("ignore", UserWarning)
        # config warnings wait until the whole run is validated: a refused run prints only its
        # error line (tests/e2e/test_pretrain_errors.py::test_refused_run_prints_no_config_warning)
        with HeldWarnings() as held, StopRequest(signums) as stop:
            cfg = config_from_args(args)
            run(cfg, stop=stop, validated=held.release)
    except (UserInputError, OSError) as e:  # user errors; bugs keep their traceback
        if os.environ.get("RTD_SCALE_TRACEBACK") == "1":
            raise
        # a lost connection, a timeout or a taken port is the moment's fault, not the input's:
        # status 1, which a supervisor restarts
        transient = isinstance(e, (ConnectionError, TimeoutError)) or getattr(
            e, "restartable", False)
        if rank == 0 or getattr(e, "every_rank", False):  # a file only that rank reads
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        elif not transient:  # rank 0's line, the same input: let it out before a launcher
            wait_for_rank0_line()  # stops every rank
        return 1 if transient else EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()  # a native crash prints every thread's Python stack to stderr
    one_line_warnings()  # as a program only: a caller of main() keeps its own warning display
    exit_process(main())
