"""The one model of a run that every view renders: status, bars, metrics, output, outcome.

Written by the backend through the :class:`~nbddp.backend.RunEvents` methods (messages from
the ranks, their output) and read by the views only as a :class:`RunSnapshot`: a frozen copy
taken under the lock (tqdm's ``format_dict`` idea), so a view never sees a half-made change
and renders with pure functions. Every change bumps ``version`` and notifies ``changed``, so a
view renders only when something changed, at the rate it chooses.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol

from nbddp.backend import Status
from nbddp.diagnosis.answers import Answers
from nbddp.diagnosis.prompts import Prompts
from nbddp.errors.render import first_line
from nbddp.state.metrics import History, MetricsAggregator
from nbddp.state.recovery import Recovery
from nbddp.state.terminal import LineWindow
from nbddp.state.transcript import Transcript
from nbddp.wire.messages import BarSnapshot, Block, Display
from nbddp.wire.prompts import LeftPdb, Prompt
from nbddp.wire.stacks import StackReport


class RichSink(Protocol):
    """Where the ranks' rich output goes as it arrives (the launching cell:
    ``display/rich.py``'s ``RichOutputs``)."""

    def show(self, message: Display) -> None: ...


OUTPUT_LINES = 200
CHART_POINTS = 300


class ShownBar(NamedTuple):
    """A progress bar as shown: the rank's snapshot plus the smoothed rate."""

    id: int
    level: int
    desc: str | None
    n: int
    total: int | None
    elapsed: float
    closed: bool
    rate: float | None


class RunSnapshot(NamedTuple):
    """Everything a view shows, at one moment; renderers are pure functions of it."""

    status: Status
    elapsed: float
    ended: bool
    error_line: str
    world_size: int
    device: str
    backend: str
    device_name: str
    bars: tuple[ShownBar, ...]  # outermost first
    latest: dict[str, float]  # the last averaged value of each metric
    notes: tuple[str, ...]
    step: int  # the last averaged row
    series: dict[str, list[tuple[float, float]]]  # a chart's points per metric
    output: str  # the last lines of rank 0's output
    output_dropped: int  # lines not shown before them (between output_head and them, if any)
    nodes: int = 1
    warning: str = ""  # the run succeeded, but its ranks did not train one model together
    rollcall: str = ""  # the last roll-call shown in the panel ("" none)
    stalled_since: float | None = None  # time.time() of the last progress, while stalled
    finishing: tuple[int, ...] = ()  # ranks that reported and run their exit handlers
    output_head: str = ""  # the final snapshot's: the first lines of rank 0's output
    output_file: str = ""  # the final snapshot's: a file with all of it, when some is dropped
    in_pdb: tuple[int, ...] = ()  # ranks stopped in pdb
    asking: tuple[int, ...] = ()  # ranks waiting for a line typed in the notebook
    answered: bool = True  # a thread is there to ask the notebook (else: run.wait())
    recovery: tuple[str, ...] = ()  # a graceful stop under way, restarts, checkpoints

    @property
    def pdb_line(self) -> str:
        """``rank 1 in pdb`` while a rank is stopped there (or waits in ``input()``)."""
        if self.ended or not (self.in_pdb or self.asking):
            return ""
        parts = []
        if self.in_pdb:
            parts.append(f"{_ranks(self.in_pdb)} in pdb")
        inputs = [r for r in self.asking if r not in self.in_pdb]
        if inputs:
            parts.append(f"{_ranks(inputs)} waiting in input()")
        if self.asking and not self.answered:
            parts.append("run.wait() answers in its cell")
        return " · ".join(parts)

    @property
    def finishing_line(self) -> str:
        """``finishing exit handlers (ranks 0, 1)`` while the run waits on them, else ''."""
        if self.ended or not self.finishing:
            return ""
        ranks = ", ".join(str(r) for r in self.finishing)
        return f"finishing exit handlers (rank{'s' if len(self.finishing) > 1 else ''} {ranks})"

    @property
    def where(self) -> str:
        """``2 × cpu`` on one machine, ``2 nodes × 4 GPUs`` on a cluster."""
        if self.nodes > 1:
            per_node = self.world_size // self.nodes
            plural = "s" if per_node > 1 and self.device_name == "GPU" else ""
            return f"{self.nodes} nodes × {per_node} {self.device_name}{plural}"
        return f"{self.world_size} × {self.device_name}"


class RunState:
    """Everything a view shows about one run; thread-safe."""

    def __init__(
        self, world_size: int, device: str, backend: str, device_name: str, nodes: int = 1
    ) -> None:
        self.world_size = world_size
        self.nodes = nodes
        self._device = device
        self._backend = backend
        self.device_name = device_name
        self.status: Status = "starting"
        self.started_at = time.monotonic()
        self.ended: float | None = None
        self.error_line = ""
        self.warning = ""
        self._bars: dict[int, ShownBar] = {}
        self.history = History()
        self.metrics = MetricsAggregator(world_size, self.history)
        self._output = LineWindow(OUTPUT_LINES)  # what the live panel shows
        self._transcript = Transcript()  # what its saved summary keeps
        self._finishing: frozenset[int] = frozenset()
        self.panel_output = False  # the live widget shows the ranks' output
        self.rich: RichSink | None = None  # where the ranks' rich output goes (the cell)
        self.answers = Answers(world_size)  # roll-calls in flight (Run.stacks)
        self.prompts = Prompts()  # the ranks' questions to the person (pdb, input())
        self.last_progress = self.started_at  # monotonic: the last row, bar or output
        self._where = ""
        self._stalled_since: float | None = None
        self._recovery = Recovery()
        self.restarts: list[tuple[float, BaseException]] = []  # (time.time(), cause)
        self.version = 0
        self.changed = threading.Condition()

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started_at

    def _bump(self) -> None:
        """Call with ``changed`` held."""
        self.version += 1
        self.changed.notify_all()

    # -- RunEvents: what the backend reports -----------------------------------------------

    @property
    def output(self) -> _PanelStream | None:
        """The panel's output area as a stream, when the panel shows output."""
        return _PanelStream(self) if self.panel_output else None

    def started(self) -> None:
        with self.changed:
            if self.status == "starting":
                self.status = "running"
                self._bump()

    def device(self, name: str) -> None:
        with self.changed:
            self.device_name = name
            self._bump()

    def rows(self, rank: int, first: int, blocks: list[Block]) -> None:
        with self.changed:
            self.metrics.add(rank, first, blocks)
            self.last_progress = time.monotonic()
            self._bump()

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        with self.changed:
            for step, values in rows:
                self.metrics.add_main(step, values)
            self.last_progress = time.monotonic()
            self._bump()

    def bars(self, bars: list[BarSnapshot]) -> None:
        with self.changed:
            now_shown = self._bars
            for bar in bars:
                previous = now_shown.get(bar.id)
                if previous is None and bar.level == 0:  # a new outer loop: finished ones go
                    now_shown = {i: b for i, b in now_shown.items() if not b.closed}
                shown = ShownBar(*bar, rate=_rate(previous, bar))
                if bar.closed and bar.level > 0:  # like tqdm: finished inner bars go,
                    now_shown.pop(bar.id, None)  # the outermost one stays
                else:
                    now_shown[bar.id] = shown
            self._bars = now_shown
            self.last_progress = time.monotonic()
            self._bump()

    def display(self, message: Display) -> None:
        if self.rich is not None:  # published at once: not part of what the panel shows
            self.rich.show(message)

    def finishing(self, ranks: frozenset[int]) -> None:
        with self.changed:
            self._finishing = ranks
            self._bump()

    def add_output(self, text: str) -> None:
        with self.changed:
            self._output.feed(text)
            self._transcript.feed(text)
            self.last_progress = time.monotonic()
            self._bump()

    def stacks(self, rank: int, query: int, report: StackReport) -> None:
        self.answers.answer(rank, query, report)

    def prompt(self, rank: int, prompt: Prompt) -> None:
        self.prompts.asked(rank, prompt)
        with self.changed:
            self.last_progress = time.monotonic()  # a person at work is no stall
            self._bump()

    def left_pdb(self, rank: int, left: LeftPdb | None) -> None:
        self.prompts.left(rank, left)
        with self.changed:
            self.last_progress = time.monotonic()
            self._bump()

    @property
    def progress_mark(self) -> float:
        """The last progress, for the stall watch: now, while a rank is in pdb or asks."""
        if self.prompts.in_pdb or self.prompts.waiting:
            return time.monotonic()
        return self.last_progress

    # the RunEvents of stopping well (backend.py says what each means)
    def checkpointed(self, step: int, path: str, seconds: float, restored: bool = False) -> None:
        with self.changed:
            self._recovery.checkpoint(step, path, seconds, restored)
            self._bump()

    def stopping(self, why: str) -> None:
        with self.changed:
            self._recovery.stopping = why
            self._bump()

    def restarted(self, attempt: int, of: int, cause: BaseException) -> None:
        with self.changed:
            self.restarts.append((time.time(), cause))
            self._recovery.restarted(attempt, of, first_line(cause))
            self._recovery.stopping = ""
            self._bump()

    def show_where(self, text: str, stalled_since: float | None = None) -> None:
        """Show a roll-call in the panel; ``stalled_since`` (wall time): as the stall banner."""
        with self.changed:
            self._where = text
            self._stalled_since = stalled_since
            self._bump()

    def finish(
        self, status: Status, error: BaseException | None, warning: str | None = None
    ) -> None:
        with self.changed:
            self.metrics.finish()
            self.status = status
            self.ended = time.monotonic()
            if error is not None:
                self.error_line = first_line(error)
            self.warning = warning or ""
            self._transcript.close()
            self._bump()

    # -- what views read -------------------------------------------------------------------

    def snapshot(self, final: bool = False) -> RunSnapshot:
        """What the views show now; ``final``: the ended run's saved summary, with rank 0's
        whole output as far as it is kept (:class:`Transcript`), not the live window."""
        with self.changed:
            history = self.history
            output = self._transcript if final else self._output
            return RunSnapshot(
                status=self.status,
                elapsed=self.elapsed,
                ended=self.ended is not None,
                error_line=self.error_line,
                world_size=self.world_size,
                device=self._device,
                backend=self._backend,
                device_name=self.device_name,
                bars=tuple(sorted(self._bars.values(), key=lambda b: (b.level, b.id))),
                latest=dict(self.metrics.latest),
                notes=tuple(self.metrics.notes),
                step=history.steps[-1] if len(history) else 0,
                series={name: history.series(name, CHART_POINTS) for name in history.columns},
                output=output.text(),
                output_dropped=output.dropped,
                nodes=self.nodes,
                warning=self.warning,
                finishing=tuple(sorted(self._finishing)),
                in_pdb=tuple(sorted(self.prompts.in_pdb)),
                asking=self.prompts.waiting,
                answered=self.prompts.served,
                rollcall=self._where,
                stalled_since=self._stalled_since,
                output_head=self._transcript.head_text() if final else "",
                output_file=self._transcript.file if final else "",
                recovery=self._recovery.lines(self.ended is not None),
            )

    def history_rows(self) -> list[dict[str, Any]]:
        with self.changed:
            return list(self.history.rows())


class _PanelStream:
    """A file-like object whose writes land in the panel's output area."""

    def __init__(self, state: RunState) -> None:
        self._state = state

    def write(self, text: str) -> int:
        self._state.add_output(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _rate(previous: ShownBar | None, bar: BarSnapshot) -> float | None:
    """Items per second, smoothed like tqdm's (exponential moving average, 0.3)."""
    if bar.elapsed <= 0:
        return None
    overall = bar.n / bar.elapsed
    if previous is None or previous.rate is None:
        return overall
    dt = bar.elapsed - previous.elapsed
    if dt <= 0:
        return previous.rate
    recent = (bar.n - previous.n) / dt
    return 0.3 * recent + 0.7 * previous.rate


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
