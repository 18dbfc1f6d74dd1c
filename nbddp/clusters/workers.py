"""Ranks on a cluster, any engine: the :class:`~nbddp.backend.Backend` of ``cluster=...``
launches, and a session's ranks there.

Per launch:

1. the engine reserves ``nodes`` nodes for ``workers_per_node`` ranks each (Ray: a placement
   group; Slurm: the allocation's nodes) and hands one warm node helper per node
   (``nodes.py``), in node-rank order;
2. before anything starts, every node says whether it can import the modules the call refers
   to, and which torch it has: a missing module is an error that says how to ship it, a
   different torch a warning;
3. the call's bytes go to every node once (:meth:`Engine.share`) and every node starts its
   ranks with the torchrun environment of their place (:class:`~nbddp.clusters.nodes.NodeStart`):
   ``MASTER_ADDR`` is node rank 0's address, ``MASTER_PORT`` the port of a socket node 0's
   helper bound and listens on (rank 0 serves the rendezvous store on it: ranks of other
   nodes that come first wait);
4. one thread long-polls every node and feeds what they forward to the same
   :class:`~nbddp.rules.referee.Referee` a local launch has; a helper that is gone (its node
   lost) is a failure of that node's ranks;
5. teardown: every node ends its ranks (TERM, grace, KILL, strays), the engine releases the
   reservation (or keeps it for the next launch), and a helper that does not answer is killed.

The engine (:class:`Engine`) is the only part that knows Ray or Slurm; :func:`cluster_workers`
picks it for the plan's cluster.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from nbddp.backend import Finish, Outcome, RunEvents
from nbddp.clusters import NodeGone
from nbddp.clusters.nodes import NodeStart, node_places
from nbddp.environment import new_run_id
from nbddp.errors import our_bug, warn_user
from nbddp.local.processes import TERM_GRACE
from nbddp.plan import LaunchPlan, job_spec
from nbddp.rules.referee import Referee
from nbddp.wire.call import Call
from nbddp.wire.messages import NodeLost

POLL = 0.05  # seconds a node's poll waits for news


class Engine(Protocol):
    """One launch's view of a cluster's node helpers: how the kernel reaches them."""

    ship_hint: str  # how to make a module importable on every node, for the error

    def reserve(self, plan: LaunchPlan) -> list[Any]:
        """Room for the plan's ranks: one node (a key the other calls take) per node rank."""

    def info(self, node: Any) -> dict[str, Any]:
        """What the node's helper says of its node (``NodeCore.info``)."""

    def call(self, node: Any, method: str, *args: Any) -> Any:
        """Call ``method`` of the node's helper; a pending answer for ``wait`` and ``get``."""

    def wait(self, pending: list[Any], timeout: float) -> list[Any]:
        """Those of ``pending`` answered within ``timeout`` (at least one, if any is)."""

    def get(self, pending: Any) -> Any:
        """The answer; raises :class:`NodeGone` when the helper is gone."""

    def share(self, buffers: list[Any]) -> Any:
        """The call's bytes as every node's ``start``/``send_task`` takes them (sent once)."""

    def forget(self, node: Any) -> None:
        """The helper is gone or killed: the next launch starts a new one."""

    def kill(self, node: Any) -> None:
        """End a helper that does not answer."""

    def release(self, intact: bool) -> None:
        """The launch is over: free (or keep, when ``intact``) what ``reserve`` took."""


class ClusterWorkers:
    """One launch's ranks on the nodes of a cluster (``session=True``: a session's, which stay
    up and run tasks)."""

    def __init__(self, plan: LaunchPlan, call: Call, engine: Engine, session: bool = False):
        self.plan = plan
        self._session = session
        self._call: Call | None = call
        self._engine = engine
        self._run_id = new_run_id()
        self._reserved = False
        self._intact = True  # no node lost, no helper killed: the reservation can be kept
        self._nodes: list[Any] = []
        self.nodes: tuple[str, ...] = ()
        self._started: list[int] = []  # node ranks whose ranks were started
        self._referee: Referee | None = None
        self._stop = threading.Event()
        self.pids: dict[int, int] = {}

    # -- the Backend protocol --------------------------------------------------------------

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Reserve, check, start every node's ranks and the poller; cleans up on failure.
        Interruptible throughout: an interrupt ends whatever had started."""
        try:
            self.start_ranks()
        except BaseException:
            self._teardown()
            raise
        plan = self.plan
        self._referee = Referee(
            plan.world_size,
            plan.return_all,
            plan.timeout,
            events,
            broadcast=self.send_all,
            started_groups=plan.nodes,
            node_of=lambda rank: self.nodes[rank // plan.workers_per_node],
            exit_timeout=plan.exit_timeout,
        )
        threading.Thread(
            target=self._supervise, args=(finish,), name="nbddp-cluster-supervisor", daemon=True
        ).start()

    def stop(self) -> None:
        self._stop.set()

    # -- start -----------------------------------------------------------------------------

    def start_ranks(self) -> None:
        """Reserve, check and start every node's ranks (the caller tears down on failure)."""
        plan, engine = self.plan, self._engine
        self._reserved = True
        self._nodes = engine.reserve(plan)
        infos = [engine.info(node) for node in self._nodes]
        self.nodes = tuple(info["address"] for info in infos)
        call = self._call
        assert call is not None
        self._check_nodes(call, infos)
        port = engine.get(engine.call(self._nodes[0], "store_port", self._run_id))
        self._started.append(0)  # its socket is closed by its stop, whatever happens next
        per_node = plan.workers_per_node
        indices = tuple(r % per_node for r in range(plan.world_size))
        spec = job_spec(plan, self._run_id, indices, self._session)  # paths: the node's own
        data = engine.share(call.buffers)
        starts = []
        for node_rank, node in enumerate(self._nodes):
            start = NodeStart(
                self._run_id,
                node_places(node_rank, plan.nodes, per_node),
                (self.nodes[0], port),
                spec,
                call.stream,
                plan.output,
                dict(plan.env),
                tuple(range(per_node)),
            )
            starts.append(engine.call(node, "start", start, data))
            if node_rank:
                self._started.append(node_rank)  # all at once: the store listens already
        for pending in starts:
            self.pids.update(engine.get(pending))
        self._call = None  # every node has it: the kernel keeps no copy
        call.close()

    def _check_nodes(self, call: Call, infos: list[dict[str, Any]]) -> None:
        """What would fail deep inside a rank is said before anything starts."""
        import torch

        engine = self._engine
        needs = sorted(call.needs())
        asked = [engine.call(node, "missing_modules", needs) for node in self._nodes]
        for info, pending in zip(infos, asked, strict=True):
            names = engine.get(pending)
            if names:
                raise ValueError(
                    f"the ranks need module(s) {', '.join(names)}, which node "
                    f"{info['address']} cannot import. {engine.ship_hint}"
                )
        for info in infos:
            if info["torch"] != torch.__version__:
                warn_user(
                    f"node {info['address']} has torch {info['torch']}, this kernel "
                    f"{torch.__version__}: what the ranks send back may not load here."
                )

    # -- the loop --------------------------------------------------------------------------

    def send_all(self, message: Any) -> None:
        for node in self._nodes:
            self._engine.call(node, "send_all", self._run_id, message)

    def ask(self, message: Any) -> None:
        """A roll-call: each node's ranks answer, and each node dumps the ones that cannot."""
        self.send_all(message)

    def send_task(self, task: Any, call: Call) -> None:
        """A session's task to every node: the call's bytes shared once."""
        data = self._engine.share(call.buffers)
        for node in self._nodes:
            self._engine.call(node, "send_task", self._run_id, task, data)
        call.close()

    def set_output(self, mode: Any, target: Any = None) -> None:
        """Whose output the nodes forward from now on (the kernel shows it in the task's
        target: forwarded text arrives as ``Printed`` events)."""
        for node in self._nodes:
            self._engine.call(node, "set_output", self._run_id, mode)

    def drain_output(self) -> None:
        """Nothing to do here: a node passes on a rank's output before its answer."""

    def wake(self) -> None:
        """Nothing to do here: the poll loop looks at its judge at least every 0.2 s."""

    def serve(self, judge: Any) -> Any:
        """Poll the nodes, feeding ``judge``, until its verdict (returned) or ``stop`` (None);
        tears down. A session's loop."""
        try:
            return self._watch(judge, on_stop=None)
        finally:
            self._teardown()

    def teardown(self) -> None:
        self._teardown()

    def _supervise(self, finish: Finish) -> None:
        result = Outcome("failed")
        referee = self._referee
        assert referee is not None
        try:
            result = self._watch(referee, on_stop=referee.stop)
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            result = Outcome("failed", error=our_bug("cluster supervisor", exc))
        finally:
            self._teardown()
            finish(result)

    def _watch(self, judge: Any, on_stop: Any) -> Any:
        """``on_stop``: how a stop reaches the judge (None: the loop just ends)."""
        engine = self._engine
        polls = {
            engine.call(node, "poll", self._run_id, POLL): i for i, node in enumerate(self._nodes)
        }
        while True:
            deadline = judge.deadline()
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            ready = engine.wait(list(polls), wait) if polls else []
            if not polls:
                time.sleep(wait)
            for pending in ready:
                node_rank = polls.pop(pending)
                try:
                    happened, over = engine.get(pending)
                except NodeGone as exc:  # the helper died: its node, or it, was lost
                    self._lost(judge, node_rank, exc)
                    continue
                for event in happened:
                    judge.event(event)
                if not over:
                    node = self._nodes[node_rank]
                    polls[engine.call(node, "poll", self._run_id, POLL)] = node_rank
            if self._stop.is_set():
                if on_stop is None:
                    return None
                on_stop()
            verdict = judge.verdict()
            if verdict is not None:
                return verdict

    def _lost(self, judge: Any, node_rank: int, error: Exception) -> None:
        per_node = self.plan.workers_per_node
        address = self.nodes[node_rank]
        self._intact = False
        self._engine.forget(self._nodes[node_rank])
        first = node_rank * per_node
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        judge.event(NodeLost(tuple(range(first, first + per_node)), address, reason))

    # -- the end ---------------------------------------------------------------------------

    def _teardown(self) -> None:
        engine = self._engine
        stops = {
            engine.call(self._nodes[i], "stop", self._run_id): i
            for i in self._started
            if i < len(self._nodes)
        }
        if stops:
            deadline = time.monotonic() + TERM_GRACE + 10
            waiting = list(stops)
            while waiting and time.monotonic() < deadline:
                for pending in engine.wait(waiting, deadline - time.monotonic()):
                    waiting.remove(pending)
                    try:
                        engine.get(pending)
                    except NodeGone:
                        self._intact = False
                        engine.forget(self._nodes[stops[pending]])
            for pending in waiting:  # the backstop: a helper that does not answer goes
                self._intact = False
                node = self._nodes[stops[pending]]
                engine.kill(node)
                engine.forget(node)
        self._started.clear()
        if self._reserved:
            self._reserved = False
            engine.release(self._intact)
        if self._call is not None:
            self._call.close()
            self._call = None


def cluster_workers(plan: LaunchPlan, call: Call, session: bool = False) -> ClusterWorkers:
    """The backend of a launch (``session``: a session's ranks) on ``plan.cluster``, with its
    engine."""
    from nbddp.clusters.ray.cluster import RayCluster

    engine: Engine
    if isinstance(plan.cluster, RayCluster):
        from nbddp.clusters.ray.workers import RayEngine

        engine = RayEngine(plan.cluster)
    else:
        from nbddp.clusters.slurm.workers import SlurmEngine

        engine = SlurmEngine(plan.cluster)
    return ClusterWorkers(plan, call, engine, session)
