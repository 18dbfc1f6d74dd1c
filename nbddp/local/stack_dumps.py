"""Ranks that do not answer a roll-call are dumped by a signal.

A rank answers a roll-call from its listener thread, which needs the GIL; a main thread that
holds it inside native code (a C extension, a long regex) leaves it mute. After
``ANSWER_WAIT`` seconds such a rank is sent :data:`~nbddp.wire.stacks.STACK_SIGNAL`: its
``faulthandler`` writes every thread's stack into the run's directory, read ``DUMP_WAIT``
seconds later and passed on as the rank's answer. Runs on a group's loop thread, wherever the
group is (this machine, or a cluster node), and never blocks it.

Non-goal: answering for ranks that did answer, or reading the stacks (``nbddp/diagnosis``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from nbddp.wire.stacks import (
    STACK_SIGNAL,
    RankStacks,
    StackReport,
    catches_signal,
    dump_file,
    parse_faulthandler,
    read_dump,
)

ANSWER_WAIT = 1.0  # seconds a rank's listener gets before the signal
DUMP_WAIT = 0.3  # seconds faulthandler gets to write

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class SignalDumps:
    """One group's roll-calls: who answered, who gets the signal, whose dump is due."""

    def __init__(
        self, directory: Callable[[], str | None], pids: Callable[[], dict[int, int]]
    ) -> None:
        self._directory = directory
        self._pids = pids
        # query -> rank -> (when to act, file offset; None before the signal)
        self._pending: dict[int, dict[int, tuple[float, int | None]]] = {}

    def asked(self, query: int, ranks: list[int]) -> None:
        due = time.monotonic() + ANSWER_WAIT
        self._pending[query] = {rank: (due, None) for rank in ranks}

    def answered(self, rank: int, query: int) -> None:
        self._pending.get(query, {}).pop(rank, None)

    def deadline(self) -> float | None:
        times = [due for ranks in self._pending.values() for due, _ in ranks.values()]
        return min(times) if times else None

    def due(self) -> list[RankStacks]:
        """Signal the ranks whose time to answer passed; the dumps that are ready."""
        now = time.monotonic()
        ready = []
        directory = self._directory()
        pids = self._pids()
        for query, ranks in list(self._pending.items()):
            for rank, (when, offset) in list(ranks.items()):
                if when > now:
                    continue
                path = dump_file(directory, rank) if directory else None
                if offset is None and path is not None and rank in pids:
                    with contextlib.suppress(OSError):
                        start = os.path.getsize(path)
                        if catches_signal(pids[rank]):
                            os.kill(pids[rank], STACK_SIGNAL)
                            ranks[rank] = (now + DUMP_WAIT, start)
                            continue
                del ranks[rank]
                ready.append(RankStacks(rank, query, self._read(path, offset, pids.get(rank))))
            if not ranks:
                del self._pending[query]
        return ready

    def _read(self, path: str | None, offset: int | None, pid: int | None) -> StackReport:
        text, main = read_dump(path, offset, 0.0) if path and offset is not None else ("", None)
        threads = tuple(parse_faulthandler(text, main, _PACKAGE_DIR)) if text else ()
        why = (
            f"its listener thread did not answer within {ANSWER_WAIT:g} s (is the main thread "
            "holding the GIL in native code?): "
        )
        why += "stacks from faulthandler, collective unknown" if threads else "no stack either"
        return StackReport("signal", threads, (), (), _cpu_of(pid), "", (why,))


def _cpu_of(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
