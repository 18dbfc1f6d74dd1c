"""Roll-calls in flight: each query's answers as they arrive from the ranks (on the thread
that serves them), for the thread that asked and waits.

Non-goal: sending the question (the backend's ``ask``) or reading the answers (``stacks.py``).
"""

from __future__ import annotations

import itertools
import threading
import time

from nbddp.wire.stacks import StackReport

_queries = itertools.count(1)


class Answers:
    """The answers to this run's roll-calls; thread-safe."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._open: dict[int, dict[int, StackReport]] = {}
        self._changed = threading.Condition()

    def open(self) -> int:
        query = next(_queries)
        with self._changed:
            self._open[query] = {}
        return query

    def answer(self, rank: int, query: int, report: StackReport) -> None:
        with self._changed:
            if query in self._open:
                self._open[query][rank] = report
                self._changed.notify_all()

    def wait(self, query: int, timeout: float) -> dict[int, StackReport]:
        """The answers to ``query`` once every rank gave one, or when ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._open.get(query, {})) < self._world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._open.pop(query, {})
