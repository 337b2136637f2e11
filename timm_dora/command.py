"""What the command lines (``timm-dora``, ``timm-dora-train``) do with an error: print it as one line
and exit with status 1, not a traceback. ``TIMM_DORA_DEBUG=1`` shows the traceback instead."""
from __future__ import annotations

import os
import sys
from typing import Callable

__all__ = ["one_line_errors"]

PLAIN = (ValueError, TypeError, OSError, RuntimeError)  # their message says it all


def one_line_errors(prog: str, run: Callable[[], int]) -> int:
    """``run()``, or its exception as ``prog: error: message`` on stderr (one line) and status 1."""
    try:
        return run()
    except Exception as e:
        if os.environ.get("TIMM_DORA_DEBUG"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, PLAIN):
            message = f"{type(e).__name__}: {message}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
