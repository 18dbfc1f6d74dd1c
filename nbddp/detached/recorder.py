"""A detached run's :class:`~nbddp.backend.RunEvents`, in its supervisor: every event goes to
the run's record (``events.log``; printed text also to ``output.log``), to every kernel
attached at that moment, and to a mirror of the run's state, from which ``status.json`` (what
``nbddp.runs()`` shows) is rewritten at most once a second.

The record and the kernels are fed under one lock, so a kernel that attaches is told the
offset up to which it reads the record, and gets every later event live: nothing twice,
nothing missed.

Past ``MAX_RECORD`` bytes, printed text, rich output and bars are no longer recorded (the
metrics, the end and the result still are): a run that prints without end cannot fill the
disk. Kernels attached at the time still see everything.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from nbddp.detached import store
from nbddp.detached.link import Answer, Live, Outlet
from nbddp.detached.outcome import Ending, encode_error
from nbddp.detached.records import LogWriter, encode
from nbddp.state.format import bar_text, format_number
from nbddp.state.run import RunSnapshot, RunState
from nbddp.wire.messages import BarSnapshot, Block, Display
from nbddp.wire.prompts import LeftPdb, Prompt, Reply
from nbddp.wire.stacks import StackReport

MAX_RECORD = 2 << 30  # bytes of events.log past which only the essentials are recorded
STATUS_EVERY = 1.0  # seconds between two rewrites of status.json
NO_INPUT = (
    "a detached run has no input box (kernels come and go): debug it attached, "
    "where pdb and input() on a rank reach the notebook"
)
_ESSENTIAL = {"started", "device", "rows", "main_rows", "finishing", "end", "note"}
_ESSENTIAL |= {"checkpointed", "stopping", "restarted"}


class _Printed:
    """The ranks' output (what the pump writes) as recorded events."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def write(self, text: str) -> int:
        self._recorder.printed(text)
        return len(text)

    def flush(self) -> None:
        pass


class Recorder:
    def __init__(self, run: store.StoredRun, world_size: int, device: str, backend: str) -> None:
        self._run = run
        self._log = LogWriter(run.join(store.LOG))
        self._text = os.open(
            run.join(store.OUTPUT), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        self._mirror = RunState(world_size, device, backend, "cpu" if device == "cpu" else "GPU")
        self._lock = threading.Lock()
        self._outlets: list[Outlet] = []
        self._queries: dict[int, tuple[Outlet, int]] = {}
        self._query_ids = itertools.count(1)
        self._capped = False
        self._failed_write: str | None = None
        self._status_at = 0.0
        self._shown = -1  # the mirror's version status.json shows
        self._skipped: set[int] = set()  # ranks told their breakpoints are skipped
        self.tell: Callable[[Reply], None] = lambda reply: None  # the backend's (supervisor)

    # -- RunEvents ---------------------------------------------------------------------------

    @property
    def output(self) -> _Printed:
        return _Printed(self)

    def started(self) -> None:
        self._record("started")
        self._mirror.started()

    def device(self, name: str) -> None:
        self._record("device", name)
        self._mirror.device(name)

    def rows(self, rank: int, first: int, blocks: list[Block]) -> None:
        self._record("rows", rank, first, blocks)
        self._mirror.rows(rank, first, blocks)

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        self._record("main_rows", rows)
        self._mirror.main_rows(rows)

    def bars(self, bars: list[BarSnapshot]) -> None:
        self._record("bars", bars)
        self._mirror.bars(bars)

    def display(self, message: Display) -> None:
        self._record("display", message)

    def finishing(self, ranks: frozenset[int]) -> None:
        self._record("finishing", ranks)
        self._mirror.finishing(ranks)

    def checkpointed(self, step: int, path: str, seconds: float, restored: bool = False) -> None:
        self._record("checkpointed", step, path, seconds, restored)
        self._mirror.checkpointed(step, path, seconds, restored)

    def stopping(self, why: str) -> None:
        self._record("stopping", why)
        self._mirror.stopping(why)

    def restarted(self, attempt: int, of: int, cause: BaseException) -> None:
        self._record("restarted", attempt, of, encode_error(cause))
        self._mirror.restarted(attempt, of, cause)

    def stacks(self, rank: int, query: int, report: StackReport) -> None:
        with self._lock:
            asked = self._queries.get(query)
        if asked is not None:
            outlet, theirs = asked
            outlet.put(Answer(rank, theirs, report))

    def printed(self, text: str) -> None:
        self._record("output", text)
        if not self._capped:
            with contextlib.suppress(OSError):
                os.write(self._text, text.encode("utf-8", "replace"))

    # -- the supervisor's ---------------------------------------------------------------------

    def prompt(self, rank: int, prompt: Prompt) -> None:
        """A rank asks for a line: nobody can answer a detached run, so it is refused at once
        (the rank skips its breakpoints, ``input()`` raises EOFError), and said once."""
        if prompt.kind != "input" and rank not in self._skipped:
            self._skipped.add(rank)
            file, line = prompt.at
            self.printed(
                f"nbddp: {'post-mortem pdb' if prompt.kind == 'post-mortem' else 'a breakpoint'}"
                f" on rank {rank} at {file}:{line} was skipped, as every later one of this run "
                f"on that rank: {NO_INPUT}.\n"
            )
        self.tell(Reply(rank, prompt.seq, None, f"nbddp: {NO_INPUT}."))

    def left_pdb(self, rank: int, left: LeftPdb | None) -> None:
        """Nothing to do: no rank of a detached run stays in pdb (:meth:`prompt`)."""

    def attach(self, outlet: Outlet, first: Callable[[int], Any]) -> None:
        """Send ``first(offset)`` and then every event after ``offset`` to ``outlet``."""
        with self._lock:
            outlet.put(first(self._log.size))
            self._outlets.append(outlet)

    def ask(self, outlet: Outlet, query: int) -> int:
        """This supervisor's id for a roll-call ``outlet`` asked as ``query``."""
        with self._lock:
            ours = next(self._query_ids)
            self._queries[ours] = (outlet, query)
            return ours

    def end(self, ending: Ending) -> None:
        """The run's final status, then its last event, synced to disk (a kernel told of the
        end finds the run ended in the listing too)."""
        self._mirror.finish(ending.status, None, ending.warning)
        self.write_status(force=True)
        self._record("end", ending)
        self._log.sync()

    def note(self, text: str) -> None:
        self._record("note", text)

    def close(self, timeout: float = 5.0) -> None:
        """Send the attached kernels what is queued for them, then end their links."""
        with self._lock:
            outlets, self._outlets = self._outlets, []
        deadline = time.monotonic() + timeout
        for outlet in outlets:
            outlet.close(max(0.0, deadline - time.monotonic()))
        self._log.close()
        with contextlib.suppress(OSError):
            os.close(self._text)

    def write_status(self, force: bool = False) -> None:
        """Rewrite ``status.json`` if the run changed since, at most once a second."""
        now = time.monotonic()
        mirror = self._mirror
        if not force and (mirror.version == self._shown or now - self._status_at < STATUS_EVERY):
            return
        self._status_at = now
        self._shown = mirror.version
        snapshot = mirror.snapshot()
        status = {
            "status": snapshot.status,
            "ended": snapshot.ended,
            "progress": progress_text(snapshot),
            "step": snapshot.step,
            "updated": time.time(),
        }
        if self._failed_write is not None:
            status["record"] = self._failed_write
        with contextlib.suppress(OSError):
            store.write_json(self._run.join(store.STATUS), status)

    def _record(self, kind: str, *args: Any) -> None:
        body = encode(kind, *args)
        with self._lock:
            self._outlets = [o for o in self._outlets if not o.gone.is_set()]
            for outlet in self._outlets:
                outlet.put(Live(body), len(body))
            if self._capped and kind not in _ESSENTIAL:
                return
            try:
                size = self._log.append(body)
            except OSError as exc:  # a full disk: the run goes on, live views too
                self._failed_write = f"recording failed: {exc}"
                return
            if size > MAX_RECORD and not self._capped:
                self._capped = True
                note = (
                    f"\n[nbddp: this run's record reached {MAX_RECORD >> 30} GiB: from here on "
                    "its output, rich output and bars are not kept, only its metrics and end]\n"
                )
                with contextlib.suppress(OSError):
                    self._log.append(encode("output", note))
                    os.write(self._text, note.encode())


def progress_text(snapshot: RunSnapshot) -> str:
    """``epoch: 2/10 · step 120: loss=0.231, acc=0.91`` (what ``nbddp.runs()`` shows)."""
    parts = []
    for bar in snapshot.bars:
        if not bar.closed or bar.level == 0:
            text = bar_text(bar)
            parts.append(text[: text.find(" [")] if " [" in text else text)
    if snapshot.latest:
        values = ", ".join(
            f"{name}={format_number(value)}" for name, value in list(snapshot.latest.items())[:4]
        )
        parts.append(f"step {snapshot.step}: {values}")
    return " · ".join(parts)
