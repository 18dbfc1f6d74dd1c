"""A rank's standard streams: what it printed pushed to its pipes before anything that must
come after it (a rich output, a prompt, the outcome, the exit)."""

from __future__ import annotations

import contextlib
import sys


def flush_output() -> None:
    """Push what the rank printed to its pipes (a closed or broken stream is no error)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
