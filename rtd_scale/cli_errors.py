"""One-line errors for the command-line tools.

A tool's ``main`` raises :class:`UserInputError` (or lets an ``OSError`` such as a missing file or a
full disk escape); :func:`run_cli` prints ``error: <message>`` on stderr and exits with status 1,
without a traceback. Any other exception is a bug and keeps its traceback. Set
``RTD_SCALE_TRACEBACK=1`` to see the traceback of a user error too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

__all__ = ["UserInputError", "run_cli"]


class UserInputError(ValueError):
    """A problem with the user's data, files or flags, stated in one line with the fix.

    Subclasses ``ValueError`` so library callers can catch it as one.
    """


def run_cli(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; turn user errors into ``error: <message>`` on stderr and exit status 1.

    Returns the process exit status: 0 on success, 1 on a user error or ``OSError``, 130 on Ctrl-C.
    """
    try:
        main(argv)
    except (UserInputError, OSError) as e:
        if os.environ.get("RTD_SCALE_TRACEBACK") == "1":
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0
