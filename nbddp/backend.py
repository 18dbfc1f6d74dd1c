"""The seam between a :class:`~nbddp.run.Run` and what executes it.

A :class:`Backend` runs the ranks somewhere (in the kernel itself, as processes on this
machine, on a cluster), reports what happens to :class:`RunEvents`, and calls ``finish``
exactly once with the :class:`Outcome`. ``Run`` knows nothing else about it, and a new place
to run ranks is a new Backend, not a branch in the launch path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

from nbddp.wire.messages import BarSnapshot, Block, Display, RankEvent
from nbddp.wire.stacks import AskStacks, StackReport


class Writable(Protocol):
    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class Judge(Protocol):
    """Decides when a rank group's loop ends; called on the loop's thread only."""

    def event(self, event: RankEvent) -> None: ...

    def deadline(self) -> float | None:
        """The next ``time.monotonic()`` at which ``verdict`` may change by itself."""

    def verdict(self) -> Any:
        """Not None once the run is over (the loop then tears down and returns it)."""


Status = Literal["starting", "running", "succeeded", "failed", "stopped"]
EndStatus = Literal["succeeded", "failed", "stopped"]


class Outcome(NamedTuple):
    status: EndStatus
    value: Any = None
    error: BaseException | None = None
    warning: str | None = None  # a run that succeeded, but not as one DDP job (rules/sync.py)
    exit_warnings: tuple[str, ...] = ()  # what went wrong in the ranks' exit handlers


class RunEvents(Protocol):
    """What a backend reports while it runs; the run's state model implements it."""

    @property
    def output(self) -> Writable | None:
        """Where the ranks' output goes (the live panel), or None: the cell's own streams."""

    def started(self) -> None:
        """Every rank is up: the run is "running"."""

    def device(self, name: str) -> None:
        """Rank 0's device, for the header (e.g. the GPU's name)."""

    def rows(self, rank: int, first: int, blocks: list[Block]) -> None:
        """Rows ``first``, ``first + 1``, ... of one rank's ``nbddp.log`` calls."""

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        """Rows only rank 0 logs (a library's tracker), taken as they are."""

    def bars(self, bars: list[BarSnapshot]) -> None:
        """A snapshot of rank 0's progress bars."""

    def display(self, message: Display) -> None:
        """A rank's rich output (a MIME bundle), for the launching cell."""

    def finishing(self, ranks: frozenset[int]) -> None:
        """The ranks that reported their result and run their exit handlers now."""

    def stacks(self, rank: int, query: int, report: StackReport) -> None:
        """A rank's answer to the roll-call ``query`` (``Backend.ask``)."""


Finish = Callable[[Outcome], None]


class Backend(Protocol):
    nodes: tuple[str, ...]  # the machines' addresses, in node-rank order (once started)

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Start the ranks. Raises (after cleaning up) if they cannot start; otherwise
        ``finish`` is called exactly once later (or before ``start`` returns, for a backend
        that runs the call in the caller's thread)."""

    def stop(self) -> None:
        """Ask for the end; ``finish`` then reports "stopped" (unless it already ended)."""

    def ask(self, message: AskStacks) -> None:
        """Send a roll-call to every rank; each answers through ``RunEvents.stacks``."""
