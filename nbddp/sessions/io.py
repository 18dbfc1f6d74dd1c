"""How a session reaches its ranks: on this machine one
:class:`~nbddp.local.group.RankGroup` kept for the session's life (:class:`LocalIO`); on a
cluster the engine's workers started with ``session=True``. :class:`SessionRanks`
(``ranks.py``) drives them through :class:`RanksIO` alone.
"""

from __future__ import annotations

from typing import Any, Protocol

from nbddp import interrupts
from nbddp.backend import Writable
from nbddp.local.forkserver import default_starter
from nbddp.local.processes import Starter
from nbddp.local.workers import local_group
from nbddp.plan import LaunchPlan
from nbddp.wire.call import Call
from nbddp.wire.messages import Output, Task


class RanksIO(Protocol):
    """Where a session's ranks run: this machine (:class:`LocalIO`) or a cluster
    (:class:`~nbddp.clusters.workers.ClusterWorkers` with ``session=True``)."""

    nodes: tuple[str, ...]

    @property
    def pids(self) -> dict[int, int]: ...

    def start_ranks(self) -> None: ...
    def serve(self, judge: Any) -> Any: ...
    def stop(self) -> None: ...
    def teardown(self) -> None: ...
    def send_all(self, message: Any) -> None: ...
    def send_task(self, task: Task, call: Call) -> None: ...
    def set_output(self, mode: Output, target: Writable | None = None) -> None: ...
    def drain_output(self) -> None: ...
    def wake(self) -> None: ...


class LocalIO:
    """A session's ranks on this machine: one RankGroup, served on the session's thread."""

    nodes: tuple[str, ...] = ("localhost",)

    def __init__(self, plan: LaunchPlan, starter: Starter | None = None) -> None:
        starter = starter or default_starter()
        starter.warm_up()
        with interrupts.deferred():  # the group owns what local_group opened once it returns
            self.group = local_group(plan, Call(b""), starter, session=True)

    @property
    def pids(self) -> dict[int, int]:
        return self.group.pids

    def start_ranks(self) -> None:
        self.group.start()

    def serve(self, judge: Any) -> Any:
        return self.group.run(judge)

    def stop(self) -> None:
        self.group.stop()

    def teardown(self) -> None:
        self.group.teardown()

    def send_all(self, message: Any) -> None:
        self.group.send_all(message)

    def send_task(self, task: Task, call: Call) -> None:
        self.group.send_all(task, call.fds, then=call.close)

    def set_output(self, mode: Output, target: Writable | None = None) -> None:
        self.group.set_output(mode, target)

    def drain_output(self) -> None:
        self.group.drain_output()

    def wake(self) -> None:
        self.group.wake()


def ranks_io(plan: LaunchPlan) -> RanksIO:
    if plan.cluster is None:
        return LocalIO(plan)
    from nbddp.clusters.workers import cluster_workers

    return cluster_workers(plan, Call(b""), session=True)
