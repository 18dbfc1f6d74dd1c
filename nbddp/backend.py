"""The seams between a :class:`~nbddp.run.Run`, what runs its ranks, and what decides.

* A :class:`Backend` executes one run (in the kernel itself, or over :class:`Ranks`), reports
  what happens to :class:`RunEvents`, and calls ``finish`` exactly once with the
  :class:`Outcome`. ``Run`` knows nothing else about it.
* :class:`Ranks` are rank processes somewhere (this machine, a cluster's nodes): started,
  served until a :class:`Judge` decides, torn down. A launch and a session reach their ranks
  through it alone, and differ only in the judge; ``ranks.ranks_for`` picks where they run,
  so a new place to run ranks is a new ``Ranks``, not a branch in the launch or session path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

from nbddp.wire.call import Call
from nbddp.wire.messages import BarSnapshot, Block, Display, Output, RankEvent, Task
from nbddp.wire.prompts import LeftPdb, Prompt, Release, Reply
from nbddp.wire.stacks import AskStacks, StackReport

V = TypeVar("V", covariant=True)  # what a judge decides: a launch's Outcome, a session's code
T = TypeVar("T")


class Writable(Protocol):
    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class Judge(Protocol[V]):
    """Decides when the ranks' loop ends; called on the loop's thread only."""

    def event(self, event: RankEvent) -> None:
        """Something a rank said, or its end (a rank event of ``wire/messages.py``)."""

    def deadline(self) -> float | None:
        """The next ``time.monotonic()`` at which ``verdict`` may change by itself."""

    def verdict(self) -> V | None:
        """Not None once the loop is over (the loop then returns it)."""


Status = Literal["starting", "running", "succeeded", "failed", "stopped"]
EndStatus = Literal["succeeded", "failed", "stopped"]


class Outcome(NamedTuple):
    status: EndStatus
    value: Any = None
    error: BaseException | None = None
    warning: str | None = None  # a run that succeeded, but not as one DDP job (rules/sync.py)
    exit_warnings: tuple[str, ...] = ()  # what went wrong in the ranks' exit handlers
    graceful: str | None = None  # a run stopped gracefully: at which step and why (its value
    # is fn's)
    duration: float | None = None  # the run's length, when known better than here (a replay)


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

    def prompt(self, rank: int, prompt: Prompt) -> None:
        """A rank waits for a line typed in the notebook (pdb's prompt, ``input()``)."""

    def left_pdb(self, rank: int, left: LeftPdb | None) -> None:
        """A rank left pdb (None: it ended); the ranks it held may go on (``Backend.tell``)."""

    def checkpointed(self, step: int, path: str, seconds: float, restored: bool = False) -> None:
        """Rank 0 saved the checkpoint of ``step`` at ``path`` (or ``restored`` it)."""

    def stopping(self, why: str) -> None:
        """A graceful stop was asked (``why``: by what); the ranks agree on a step."""

    def restarted(self, attempt: int, of: int, cause: BaseException) -> None:
        """The whole world was restarted after ``cause`` (``attempt`` of ``of``)."""


Finish = Callable[[Outcome], None]


@runtime_checkable
class Kept(Protocol):
    """A backend whose run is kept after it ends (a detached run's directory)."""

    @property
    def id(self) -> str | None: ...

    def forget(self) -> None:
        """Delete what is kept; ValueError while the run still runs."""


class Backend(Protocol):
    """One run, from start to ``finish``: ``Run`` drives it and knows nothing else of it."""

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines' addresses, in node-rank order (once started)."""

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Start the ranks. Raises (after cleaning up) if they cannot start; otherwise
        ``finish`` is called exactly once later (or before ``start`` returns, for a backend
        that runs the call in the caller's thread)."""

    def stop(self) -> None:
        """Ask for the end; ``finish`` then reports "stopped" (unless it already ended)."""

    def stop_gracefully(self, why: str) -> None:
        """Ask every rank to stop at one step boundary (``why``: by what, for the panel and
        the warning); a run that does not check, or not within its ``stop_grace``, is ended
        at once instead, as by :meth:`stop`."""

    def ask(self, message: AskStacks) -> None:
        """Send a roll-call to every rank; each answers through ``RunEvents.stacks``."""

    def tell(self, message: Reply | Release) -> None:
        """Send to every rank that runs (a reply to a rank's prompt; a release of the ranks
        held at ``nbddp.breakpoint()``)."""


class Ranks(Protocol):
    """Rank processes somewhere, from start to teardown: every rank of a launch or of a
    session, on this machine (:class:`~nbddp.local.group.RankGroup`) or on a cluster's nodes
    (:class:`~nbddp.clusters.ranks.ClusterRanks`). Made by ``ranks.ranks_for``; making one
    opens nothing, so one that never starts needs no teardown.

    ``start``, ``serve`` and ``teardown`` are called from one thread at a time (``serve`` on a
    thread of its own); the others may be called from any thread while ``serve`` runs."""

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines' addresses, in node-rank order (``("localhost",)`` on this one; a
        cluster's once started)."""

    @property
    def pids(self) -> dict[int, int]:
        """Each started rank's process id, by rank."""

    def node_of(self, rank: int) -> str | None:
        """The address of ``rank``'s machine, for errors; None on this machine."""

    def start(self) -> None:
        """Start every rank. Waits interruptibly where it waits (for the warm helper, a
        cluster's reservation); what must happen whole happens with interrupts deferred. On
        any exception (an interrupt included) the caller calls :meth:`teardown`."""

    def serve(self, judge: Judge[T]) -> T | None:
        """Feed every rank event to ``judge`` until its verdict (returned) or :meth:`stop`
        (None), asking for the verdict after each batch of events and at the judge's
        deadline; then tear down (whatever ended it), and return."""

    def stop(self) -> None:
        """Make :meth:`serve` return None soon (the judge's verdict, if any, first)."""

    def teardown(self) -> None:
        """End every rank and everything they started, close and remove what was opened;
        the same path for every ending. Idempotent; returns when the ranks are gone."""

    def send_all(self, message: Any) -> None:
        """Send ``message`` to every rank that has its job (a rank still starting gets its
        job first, and nothing else)."""

    def send_task(self, task: Task, call: Call) -> None:
        """A session's task to every rank: ``task`` with ``call``'s bytes beside it (mapped
        by the ranks); ``call`` is closed once sent."""

    def set_output(self, mode: Output, target: Writable | None = None) -> None:
        """Whose stdout/stderr is shown from now on, and where (``target``; None: the
        cell's own streams). Before :meth:`start`: from the first rank on."""

    def drain_output(self) -> None:
        """Pass on what the ranks wrote so far (on the loop's thread: a task is over once
        every answer arrived, and what a rank printed before its answer goes first)."""

    def wake(self) -> None:
        """Make the loop ask its judge again now (the judge changed on another thread)."""
