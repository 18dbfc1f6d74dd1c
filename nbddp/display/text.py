"""The panel as text, for terminals, scripts, CI logs and frontends without widgets.

On a terminal one status line is redrawn in place (carriage return); elsewhere a line is
written every ``EVERY`` seconds, never one per step. The final line always stays.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from .html import bar_text, format_number
from .state import RunState

EVERY = 5.0


class TextView:
    def __init__(self, state: RunState, stream: TextIO | None = None) -> None:
        self._state = state
        self._stream = stream or sys.stdout
        try:
            self._tty = self._stream.isatty()
        except (AttributeError, ValueError):
            self._tty = False
        self._last_line = 0.0
        self._drawn = False

    def render(self) -> None:
        now = time.monotonic()
        if not self._tty and now - self._last_line < EVERY:
            return
        line = self._line()
        if not line:
            return
        self._last_line = now
        if self._tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._write("\r" + line[:width].ljust(width))
            self._drawn = True
        else:
            self._write(line + "\n")

    def finish(self) -> None:
        state = self._state
        summary = f"nbddp: {state.status} after {state.elapsed:.1f} s " \
                  f"({state.world_size} × {state.device_name}, {state.backend})"
        metrics = _metrics(state)
        if metrics:
            summary += f" | {metrics}"
        if state.error_line:
            summary += f"\n  {state.error_line}"
        for note in state.metrics.notes:
            summary += f"\n  note: {note}"
        self._write(("\r" if self._drawn else "") + summary + "\n")

    def _line(self) -> str:
        state = self._state
        parts = [f"[nbddp {state.status}]"]
        parts += [bar_text(bar) for bar in state.snapshot_bars()]
        metrics = _metrics(state)
        if metrics:
            parts.append(metrics)
        return " | ".join(parts) if len(parts) > 1 else ""

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass


def _metrics(state: RunState) -> str:
    return " ".join(f"{k}={format_number(v)}" for k, v in dict(state.metrics.latest).items())
