"""How a failed run is explained: each rank's failure, and the one root cause that is raised.

When one rank fails, its peers usually fail too, because of it: a peer waiting in a collective
reports that its connection closed. The root cause is what the user must see first, so the
choice is made by :func:`root_cause`, a pure function of the failures (tested by a table in
``tests/rules/test_tracker.py``):

1. the earliest rank that raised or died on its own (not about a lost peer);
2. else the earliest rank that ended while its peers still ran (it returned, or called
   ``sys.exit(0)``), which is what its peers' lost connections are about;
3. else the earliest failure of all.

A rank "lost a peer" when its exception is torch's ``DistError`` family (``DistBackendError``,
``DistNetworkError``, ``DistStoreError``), told by the class, not its text. Gloo still raises
some of these as a plain ``RuntimeError``; for those only, the message is matched against
gloo's own wording, as the documented last resort (:data:`PEER_LOST_WORDS`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

from nbddp.backend import Outcome
from nbddp.errors import SerializationError, WorkerError
from nbddp.errors.remote import import_class, rank_raised
from nbddp.rules.sync import judge
from nbddp.wire import payload
from nbddp.wire.messages import BEFORE_THE_TASK, ErrorReport, SyncCheck

Kind = Literal["raised", "died", "lost_peer", "ended_early"]

_PEER_CLASSES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
# The last resort: what gloo says in a plain RuntimeError when a peer went away.
PEER_LOST_WORDS = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)


class Failure(NamedTuple):
    rank: int
    time: float  # time.time() on the rank's machine when it happened
    error: BaseException
    kind: Kind


def lost_a_peer(report: ErrorReport) -> bool:
    if any(name.rsplit(".", 1)[-1] in _PEER_CLASSES for name in report.mro):
        return True
    if report.exc_type == "RuntimeError":
        message = report.message.lower()
        return any(words in message for words in PEER_LOST_WORDS)
    return False


def raised(rank: int, report: ErrorReport, node: str | None = None) -> Failure:
    """A rank's exception, rebuilt in the kernel as far as it can be."""
    original = None
    if report.exception is not None:
        try:
            original = payload.loads(report.exception)
        except Exception:
            original = None  # e.g. its class lives in a module the kernel cannot import
    if not isinstance(original, BaseException):
        original = None
    remote_class = None if original is not None else import_class(report.mro[0])
    error = rank_raised(
        rank,
        report.exc_type,
        report.message,
        report.traceback,
        original,
        remote_class,
        node,
        report.hint,
        report.exitcode,
    )
    return Failure(rank, report.time, error, "lost_peer" if lost_a_peer(report) else "raised")


def died(
    rank: int, exitcode: int | None, stderr_tail: str, when: float, node: str | None = None
) -> Failure:
    """A rank that ended without a report: a signal, ``os._exit``, a native crash."""
    trace = f"last lines of rank {rank}'s stderr:\n{stderr_tail}" if stderr_tail.strip() else ""
    error = WorkerError(rank, exitcode=exitcode, remote_traceback=trace, node=node)
    return Failure(rank, when, error, "died")


def unsendable(rank: int, path: str, reason: str, when: float) -> Failure:
    error = SerializationError(
        f"rank {rank}'s return value back to the notebook",
        path,
        reason,
        hint="Return something picklable instead: tensors, numbers, a state_dict().",
    )
    return Failure(rank, when, error, "raised")


def ended_early(rank: int, when: float, how: str, node: str | None = None) -> Failure:
    """A rank that finished while its peers still ran; an error only if they then lost it."""
    error = WorkerError(
        rank,
        exitcode=0,
        node=node,
        summary=f"rank {rank} {how} while the other ranks were still running, and they lost "
        "their connection to it",
        hint="Every rank must take part in the same collectives: end all ranks the same way, "
        "or call nbddp.barrier() before a rank returns early.",
    )
    return Failure(rank, when, error, "ended_early")


def root_cause(failures: Sequence[Failure], early: Sequence[Failure] = ()) -> Failure:
    """The failure to raise; ``early`` are the ranks that finished while peers still ran."""
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    own = [f for f in failures if f.kind in ("raised", "died")]
    if own:
        return min(own, key=lambda f: f.time)
    if early:
        return min(early, key=lambda f: f.time)
    return min(failures, key=lambda f: f.time)


# A frame line of a rank's traceback: a file's, or a notebook cell's as IPython names it.
_FRAME = re.compile(
    r'^\s*(?:File "(?P<file>[^"]+)"|(?P<cell>Cell In\[\d+\])), line (?P<line>\d+)'
    r"(?:, in (?P<function>.+))?$"
)
_NAMED = 3  # interrupted ranks named one by one; the rest are counted


def interrupted_note(failures: Sequence[Failure], root: Failure) -> str:
    """The ranks a session task's failure interrupted, and where each was: their part of the
    task did not finish (a name it would have set is missing on them), which the root cause
    alone does not say. Empty when it interrupted none."""
    interrupted = sorted(
        (f for f in failures if f is not root and _exc_type(f.error) == "KeyboardInterrupt"),
        key=lambda f: f.rank,
    )
    if not interrupted:
        return ""
    named = ", ".join(f"rank {f.rank}{_where_interrupted(f.error)}" for f in interrupted[:_NAMED])
    if len(interrupted) > _NAMED:
        named += f" and {len(interrupted) - _NAMED} more"
    their = "its part" if len(interrupted) == 1 else "their parts"
    return f"The failure interrupted {named}: {their} of the task did not finish."


def where(error: BaseException) -> str:
    """The last frame of a rank's traceback, as ``" at FILE:LINE in FUNCTION (CODE)"``; ""
    when it has none."""
    lines = getattr(error, "remote_traceback", "").splitlines()
    for index in range(len(lines) - 1, -1, -1):
        frame = _FRAME.match(lines[index])
        if frame is None:
            continue
        place = f" at {frame['file'] or frame['cell']}:{frame['line']}"
        if frame["function"]:
            place += f" in {frame['function']}"
        code = lines[index + 1].strip() if index + 1 < len(lines) else ""
        if code and not _FRAME.match(lines[index + 1]) and lines[index + 1].startswith("    "):
            place += f" ({code})"
        return place
    return ""


def _where_interrupted(error: BaseException) -> str:
    if getattr(error, "exc_message", "") == BEFORE_THE_TASK:
        return " before it started the task"
    return where(error)


def _exc_type(error: BaseException) -> str | None:
    return getattr(error, "exc_type", None)


class RunTracker:
    """What the ranks of one run reported, and what the run's outcome therefore is. Fed by a
    backend's loop; knows nothing of processes or sockets."""

    def __init__(self, world_size: int, return_all: bool) -> None:
        self.world_size = world_size
        self.return_all = return_all
        self.failures: list[Failure] = []
        self.exited: set[int] = set()
        self._results: dict[int, tuple[bytes | None, list[Any]]] = {}
        self._finished_at: dict[int, tuple[float, bool]] = {}
        self._checks: dict[int, SyncCheck] = {}

    def result(self, rank: int, stream: bytes | None, buffers: list[Any], early: bool) -> None:
        self._results[rank] = (stream, buffers)
        self._finished_at[rank] = (time.time(), early)

    def trained(self, rank: int, check: SyncCheck) -> None:
        """What the rank knows of its DDP models and collectives (sent before its result)."""
        self._checks[rank] = check

    @property
    def all_returned(self) -> bool:
        """Every rank reported its result and none failed: they may leave."""
        return len(self._results) == self.world_size and not self.failures

    def raised(self, rank: int, report: ErrorReport, node: str | None = None) -> None:
        self.failures.append(raised(rank, report, node))

    def unsendable(self, rank: int, path: str, reason: str) -> None:
        self.failures.append(unsendable(rank, path, reason, time.time()))

    def ended(self, rank: int, code: int | None, stderr_tail: str, node: str | None = None) -> None:
        """The rank's process ended: a failure unless it reported a result and exited 0."""
        self.exited.add(rank)
        reported = rank in self._results or any(f.rank == rank for f in self.failures)
        if code == 0 and rank in self._results:
            return
        if not reported or code == 0:
            self.failures.append(died(rank, code, stderr_tail, time.time(), node))

    def node_lost(self, ranks: Iterable[int], node: str, reason: str) -> None:
        """A node's helper died (the node was lost): each of its ranks failed with it."""
        when = time.time()
        for rank in ranks:
            if rank in self._results or any(f.rank == rank for f in self.failures):
                continue
            error = WorkerError(
                rank,
                node=node,
                summary=f"rank {rank} was lost with its node {node} ({reason})",
                hint="Ray lost the node, or the node's nbddp helper died; every rank on it ended.",
            )
            self.failures.append(Failure(rank, when, error, "died"))

    @property
    def everyone_accounted_for(self) -> bool:
        """Every rank exited or failed: no more news can come."""
        return len(self.exited | {f.rank for f in self.failures}) == self.world_size

    def root_cause(self) -> Failure:
        first = min(f.time for f in self.failures)
        early = [
            ended_early(rank, when, "called sys.exit(0)" if by_exit else "returned")
            for rank, (when, by_exit) in self._finished_at.items()
            if when < first
        ]
        return root_cause(self.failures, early)

    def collect(self) -> Outcome:
        """Every rank succeeded: rank 0's value (every rank's with ``return_all``)."""
        try:
            if self.return_all:
                value = [self._load(rank) for rank in range(self.world_size)]
            else:
                value = self._load(0)
        except Exception as exc:
            error = SerializationError(
                "rank 0's return value into the notebook",
                "result",
                repr(exc),
                hint="It arrived but cannot be rebuilt here: is a module it needs importable "
                "in the kernel?",
            )
            error.__cause__ = exc
            return Outcome("failed", error=error)
        finally:
            self._results.clear()
        return Outcome("succeeded", value, warning=judge(self.world_size, self._checks))

    def _load(self, rank: int) -> Any:
        stream, buffers = self._results[rank]
        return None if stream is None else payload.loads(stream, buffers)
