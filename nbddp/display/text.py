"""The panel as text, for terminals, scripts, CI logs and frontends without widgets.

On a terminal one status line is redrawn in place (carriage return); elsewhere a line is
written every ``EVERY`` seconds, never one per step. The final line always stays.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from nbddp.state.format import bar_text, format_number
from nbddp.state.run import RunSnapshot

EVERY = 5.0


class TextView:
    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        try:
            self._tty = self._stream.isatty()
        except (AttributeError, ValueError):
            self._tty = False
        self._last_line = 0.0
        self._drawn = False
        self._stall_shown: float | None = None

    def render(self, s: RunSnapshot) -> None:
        if s.stalled_since != self._stall_shown:
            self._stall_shown = s.stalled_since
            if s.stalled_since is not None:
                self._write(("\n" if self._drawn else "") + stall_text(s) + "\n")
                self._drawn = False
        now = time.monotonic()
        if not self._tty and now - self._last_line < EVERY:
            return
        line = status_line(s)
        if not line:
            return
        self._last_line = now
        if self._tty and s.asking:  # the terminal is the input box now: no redraws
            return
        if self._tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._write("\r" + line[:width].ljust(width))
            self._drawn = True
        else:
            self._write(line + "\n")

    def finish(self, s: RunSnapshot) -> None:
        self._write(("\r" if self._drawn else "") + summary_text(s) + "\n")

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass


def status_line(s: RunSnapshot) -> str:
    parts = [f"[nbddp {s.status}]", *(bar_text(bar) for bar in s.bars)]
    metrics = _metrics(s)
    if metrics:
        parts.append(metrics)
    if s.finishing_line:
        parts.append(s.finishing_line)
    if s.pdb_line:
        parts.append(s.pdb_line)
    parts += [note for note in s.recovery if note.startswith("stopping")]
    return " | ".join(parts) if len(parts) > 1 else ""


def stall_text(s: RunSnapshot) -> str:
    since = time.strftime("%H:%M:%S", time.localtime(s.stalled_since or time.time()))
    lines = [f"nbddp: no rank made progress since {since}; where each rank is:"]
    lines += [f"  {line}" for line in s.rollcall.splitlines()]
    lines.append("  (nothing was stopped; run.stacks() shows every frame)")
    return "\n".join(lines)


def summary_text(s: RunSnapshot) -> str:
    summary = f"nbddp: {s.status} after {s.elapsed:.1f} s ({s.where}, {s.backend})"
    metrics = _metrics(s)
    if metrics:
        summary += f" | {metrics}"
    if s.error_line:
        summary += f"\n  {s.error_line}"
    if s.warning:
        summary += f"\n  warning: {s.warning}"
    for note in (*s.recovery, *s.notes):
        summary += f"\n  note: {note}"
    return summary


def _metrics(s: RunSnapshot) -> str:
    return " ".join(f"{k}={format_number(v)}" for k, v in s.latest.items())
