"""One status line that changes while nbddp waits before a run exists (a Slurm job in the
queue): in a notebook, one output updated in place (so a long wait is one line, not a screen
of them); elsewhere, a line on stderr per change.

Non-goal: the run's own panel (``panel.py``), which starts once there are ranks to show.
"""

from __future__ import annotations

import html
import sys
import time
from typing import Any

from nbddp.display import resolve_mode


class Notice:
    """``show(text)`` at every look: in a notebook the line is redrawn with how long it has
    waited; elsewhere only a changed text is printed."""

    def __init__(self) -> None:
        self._in_notebook = resolve_mode("auto") == "widget"
        self._handle: Any = None
        self._since = time.monotonic()
        self._last = ""

    def show(self, text: str) -> None:
        changed, self._last = text != self._last, text
        if not self._in_notebook:
            if changed:
                print(f"nbddp: {text}", file=sys.stderr, flush=True)
            return
        waited = time.monotonic() - self._since
        line = f"nbddp: {text}" + (f" ({waited:.0f} s so far)" if waited >= 1 else "")
        bundle = {
            "text/plain": line,
            "text/html": f'<div class="nbddp-notice">{html.escape(line)}</div>',
        }
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)  # type: ignore[no-untyped-call]
        else:
            self._handle.update(bundle, raw=True)
