"""Ranks on a cluster, any engine: the :class:`~nbddp.backend.Ranks` of ``cluster=...``
launches and sessions.

1. the engine reserves ``nodes`` nodes for ``workers_per_node`` ranks each (Ray: a placement
   group; Slurm: the allocation's nodes) and hands one warm node helper per node
   (``nodes.py``), in node-rank order;
2. before anything starts, every node says whether it can import the modules the call refers
   to, and which torch it has: a missing module is an error that says how to ship it, a
   different torch a warning;
3. the call's bytes go to every node once (``Engine.share``) and every node starts its ranks
   with the torchrun environment of their place (:class:`~nbddp.clusters.nodes.NodeStart`):
   ``MASTER_ADDR`` is node rank 0's address, ``MASTER_PORT`` the port of a socket node 0's
   helper bound and listens on (rank 0 serves the rendezvous store on it: ranks of other
   nodes that come first wait);
4. :meth:`ClusterRanks.serve` long-polls every node and feeds what they forward to the judge
   (a launch's referee, a session's judge); a helper that is gone (its node lost) is a
   ``NodeLost`` of that node's ranks;
5. teardown: every node ends its ranks (TERM, grace, KILL, strays), the engine releases the
   reservation (or keeps it for the next launch), and a helper that does not answer is killed.

The engine (``engine.py``) is the only part that knows Ray or Slurm; :func:`cluster_ranks`
picks it for the plan's cluster.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TypeVar

from nbddp.backend import Judge, Writable
from nbddp.clusters import NodeGone
from nbddp.clusters.engine import Answer, Engine, NodeClient, wait
from nbddp.clusters.nodes import NodeStart, node_places
from nbddp.environment import new_run_id
from nbddp.errors.notices import warn_user
from nbddp.local.processes import TERM_GRACE
from nbddp.plan import LaunchPlan, job_spec
from nbddp.wire.call import Call
from nbddp.wire.messages import NodeLost, Output, RankEvent, Task

POLL = 0.05  # seconds a node's poll waits for news

T = TypeVar("T")


class ClusterRanks:
    """The ranks of one launch (``session=True``: a session's, which stay up and run tasks)
    on the nodes of a cluster."""

    def __init__(self, plan: LaunchPlan, call: Call, engine: Engine, session: bool = False):
        self.plan = plan
        self._session = session
        self._call: Call | None = call
        self._engine = engine
        self._run_id = new_run_id()
        self._reserved = False
        self._intact = True  # no node lost, no helper killed: the reservation can be kept
        self._clients: list[NodeClient] = []
        self.nodes: tuple[str, ...] = ()
        self._started: list[int] = []  # node ranks whose ranks were started
        self._stop = threading.Event()
        self.pids: dict[int, int] = {}

    def node_of(self, rank: int) -> str | None:
        return self.nodes[rank // self.plan.workers_per_node]

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Reserve, check and start every node's ranks; interruptible throughout (the caller
        tears down on any exception)."""
        plan, engine = self.plan, self._engine
        self._reserved = True
        self._clients = [NodeClient(engine, node, self._run_id) for node in engine.reserve(plan)]
        infos = [engine.info(client.node) for client in self._clients]
        self.nodes = tuple(info["address"] for info in infos)
        call = self._call
        assert call is not None
        self._check_nodes(call, infos)
        port = self._clients[0].store_port().get()
        self._started.append(0)  # its socket is closed by its stop, whatever happens next
        per_node = plan.workers_per_node
        indices = tuple(r % per_node for r in range(plan.world_size))
        spec = job_spec(plan, self._run_id, indices, self._session)  # paths: the node's own
        shared = engine.share(call.buffers)
        starts = []
        for node_rank, client in enumerate(self._clients):
            start = NodeStart(
                self._run_id,
                node_places(node_rank, plan.nodes, per_node),
                (self.nodes[0], port),
                spec,
                call.stream,
                plan.output,
                dict(plan.env),
                engine.gpus(node_rank) or tuple(range(per_node)),
            )
            starts.append(client.start(start, shared))
            if node_rank:
                self._started.append(node_rank)  # all at once: the store listens already
        for pending in starts:
            self.pids.update(pending.get())
        self._call = None  # every node has it: the kernel keeps no copy
        call.close()

    def _check_nodes(self, call: Call, infos: list[dict[str, Any]]) -> None:
        """What would fail deep inside a rank is said before anything starts."""
        import torch

        needs = sorted(call.needs())
        asked = [client.missing_modules(needs) for client in self._clients]
        for info, pending in zip(infos, asked, strict=True):
            names = pending.get()
            if names:
                raise ValueError(
                    f"the ranks need module(s) {', '.join(names)}, which node "
                    f"{info['address']} cannot import. {self._engine.ship_hint}"
                )
        for info in infos:
            if info["torch"] != torch.__version__:
                warn_user(
                    f"node {info['address']} has torch {info['torch']}, this kernel "
                    f"{torch.__version__}: what the ranks send back may not load here."
                )

    # -- from any thread -------------------------------------------------------------------

    def send_all(self, message: Any) -> None:
        """To every node's ranks (a roll-call: each node dumps the ranks that cannot answer)."""
        for client in self._clients:
            client.send_all(message)

    def send_task(self, task: Task, call: Call) -> None:
        """A session's task to every node: the call's bytes shared once."""
        shared = self._engine.share(call.buffers)
        for client in self._clients:
            client.send_task(task, shared)
        call.close()

    def set_output(self, mode: Output, target: Writable | None = None) -> None:
        """Whose output the nodes forward from now on (it arrives as ``Printed`` events, which
        the judge shows: ``target`` is the judge's business here)."""
        for client in self._clients:
            client.set_output(mode)

    def drain_output(self) -> None:
        """Nothing to do here: a node passes on a rank's output before its answer."""

    def wake(self) -> None:
        """Nothing to do here: the poll loop asks its judge at least every 0.2 s."""

    def stop(self) -> None:
        self._stop.set()

    # -- the loop --------------------------------------------------------------------------

    def serve(self, judge: Judge[T]) -> T | None:
        """Poll the nodes, feeding ``judge``, until its verdict (returned) or ``stop`` (None);
        tears down."""
        try:
            return self._watch(judge)
        finally:
            self.teardown()

    def _watch(self, judge: Judge[T]) -> T | None:
        polls: dict[Answer[tuple[list[RankEvent], bool]], int] = {
            client.poll(POLL): i for i, client in enumerate(self._clients)
        }
        while True:
            deadline = judge.deadline()
            timeout = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            ready = wait(self._engine, list(polls), timeout) if polls else []
            if not polls:
                time.sleep(timeout)
            for answer in ready:
                node_rank = polls.pop(answer)
                try:
                    happened, over = answer.get()
                except NodeGone as exc:  # the helper died: its node, or it, was lost
                    self._lost(judge, node_rank, exc)
                    continue
                for event in happened:
                    judge.event(event)
                if not over:
                    polls[self._clients[node_rank].poll(POLL)] = node_rank
            verdict = judge.verdict()
            if verdict is not None:
                return verdict
            if self._stop.is_set():
                return None

    def _lost(self, judge: Judge[Any], node_rank: int, error: Exception) -> None:
        per_node = self.plan.workers_per_node
        self._intact = False
        self._engine.forget(self._clients[node_rank].node)
        first = node_rank * per_node
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        judge.event(NodeLost(tuple(range(first, first + per_node)), self.nodes[node_rank], reason))

    # -- the end ---------------------------------------------------------------------------

    def teardown(self) -> None:
        """Every started node ends its ranks (a helper that does not answer is killed), then
        the reservation is released. Idempotent."""
        engine = self._engine
        stops = {self._clients[i].stop(): i for i in self._started if i < len(self._clients)}
        if stops:
            deadline = time.monotonic() + TERM_GRACE + 10
            waiting = list(stops)
            while waiting and time.monotonic() < deadline:
                for answer in wait(engine, waiting, deadline - time.monotonic()):
                    waiting.remove(answer)
                    try:
                        answer.get()
                    except NodeGone:
                        self._intact = False
                        engine.forget(self._clients[stops[answer]].node)
            for answer in waiting:  # the backstop: a helper that does not answer goes
                self._intact = False
                node = self._clients[stops[answer]].node
                engine.kill(node)
                engine.forget(node)
        self._started.clear()
        if self._reserved:
            self._reserved = False
            engine.release(self._intact)
        if self._call is not None:
            self._call.close()
            self._call = None


def cluster_ranks(plan: LaunchPlan, call: Call, session: bool = False) -> ClusterRanks:
    """The ranks of a launch (``session``: a session's) on ``plan.cluster``, with its engine."""
    from nbddp.clusters.ray.cluster import RayCluster
    from nbddp.clusters.slurm.allocation import SlurmCluster

    engine: Engine
    if isinstance(plan.cluster, RayCluster):
        from nbddp.clusters.ray.engine import RayEngine

        engine = RayEngine(plan.cluster)
    elif isinstance(plan.cluster, SlurmCluster):
        from nbddp.clusters.slurm.engine import SlurmEngine

        engine = SlurmEngine(plan.cluster)
    else:  # ranks.ranks_for runs a plan without a cluster on this machine
        raise TypeError(f"no engine for cluster={plan.cluster!r}")
    return ClusterRanks(plan, call, engine, session)
