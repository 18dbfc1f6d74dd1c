"""A detached run's events, replayed into a kernel's view of it (any
:class:`~nbddp.backend.RunEvents`: the ``Run``'s state model) from its record or live.

Printed text is the exception: a run's whole output can be far longer than anyone reads in a
cell, so a replay shows its last ``REPLAY_LINES`` lines (before each rich output, and at the
end) and says where the rest is (``output.log``). Live text goes through as it comes.

Non-goal: reading the record (``records.py``) or the link (``attached.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from nbddp.backend import RunEvents, Writable
from nbddp.detached import store
from nbddp.detached.outcome import Ending, decode_error
from nbddp.detached.records import Event
from nbddp.state.terminal import LineWindow

REPLAY_LINES = 1000
_CALLS: tuple[str, ...] = ("started", "device", "rows", "main_rows", "bars", "display")
_CALLS += ("finishing", "checkpointed", "stopping")


def apply(event: Event, events: RunEvents, out: Writable) -> Ending | None:
    """Show one event; the run's :class:`Ending` when it is the last one."""
    kind = event.kind
    if kind == "output":
        write_quietly(out, event.args[0])
    elif kind == "end":
        ending = event.args[0]
        return ending if isinstance(ending, Ending) else None
    elif kind in _CALLS:
        getattr(events, kind)(*event.args)
    elif kind == "restarted":
        attempt, of, cause = event.args
        events.restarted(attempt, of, decode_error(cause))
    return None


def replay(
    events_seen: Iterable[Event], events: RunEvents, out: Writable, run_path: str
) -> Ending | None:
    """Show a run's recorded events; its ending if the record has one."""
    window = _Window(out, run_path)
    ending = None
    for event in events_seen:
        if event.kind == "output":
            window.feed(event.args[0])
            continue
        if event.kind == "display":
            window.flush()
        ending = apply(event, events, out) or ending
    window.flush()
    return ending


class _Window:
    """The last lines of the replayed text, written out before each rich output and at the
    end, with one note of how many lines were left out."""

    def __init__(self, out: Writable, run_path: str) -> None:
        self._out = out
        self._path = os.path.join(run_path, store.OUTPUT)
        self._lines = LineWindow(REPLAY_LINES)
        self._fed = False
        self._noted = False

    def feed(self, text: str) -> None:
        self._lines.feed(text)
        self._fed = True

    def flush(self) -> None:
        if not self._fed:
            return
        lines = self._lines
        if lines.dropped and not self._noted:
            self._noted = True
            write_quietly(
                self._out,
                f"[nbddp: {lines.dropped} earlier lines of this run's output are in "
                f"{self._path}]\n",
            )
        text = lines.text()
        if text:
            write_quietly(self._out, text if text.endswith("\n") else text + "\n")
        self._lines = LineWindow(REPLAY_LINES)
        self._fed = False


def write_quietly(out: Writable, text: str) -> None:
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass
