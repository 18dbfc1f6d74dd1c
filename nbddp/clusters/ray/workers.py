"""Ranks on a Ray cluster: the :class:`~nbddp.backend.Backend` of ``cluster=...`` launches.

Per launch:

1. one placement group reserves ``workers_per_node`` ranks' worth of resources (GPUs on
   cuda, CPUs on cpu) on each of ``nodes`` nodes (``STRICT_SPREAD``, one bundle per node);
   bundle i's node is node rank i;
2. before anything starts, every node's helper (``node.py``) says whether it can import the
   modules the call refers to, and which torch it has: a missing module is an error that says
   how to ship it, a different torch a warning;
3. the call goes to Ray's object store once (its tensors' bytes out of band) and every node
   starts its ranks with the torchrun environment of their place: ``MASTER_ADDR`` is node rank
   0's address, ``MASTER_PORT`` the port of a socket node 0's helper bound and listens on
   (rank 0 serves the rendezvous store on it: ranks of other nodes that come first wait);
4. one thread long-polls every node (``ray.wait`` on one poll per node) and feeds what they
   forward to the same :class:`~nbddp.rules.referee.Referee` a local launch has; a helper that dies
   (its node lost) is a failure of that node's ranks;
5. teardown: every node ends its ranks (TERM, grace, KILL, strays); the placement group is
   kept a few seconds for the next launch of the same shape (``RayCluster.keep_reservation``:
   Ray readies a new one made right after a removal only 0.5-1 s later), then goes;
   ``ray.kill`` is the backstop for a helper that does not answer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from nbddp.backend import Finish, Outcome, RunEvents
from nbddp.clusters.ray.cluster import RayCluster
from nbddp.environment import Place, new_run_id
from nbddp.errors import NbddpError, our_bug, warn_user
from nbddp.local.processes import TERM_GRACE
from nbddp.plan import LaunchPlan, job_spec
from nbddp.rules.referee import Referee
from nbddp.wire.call import Call
from nbddp.wire.messages import NodeLost

RESERVE_WAIT = 60.0  # seconds for the cluster to reserve the ranks' resources
_POLL = 0.05  # seconds a node's poll waits for news


class RayWorkers:
    """One launch's ranks on the nodes of a Ray cluster."""

    def __init__(self, plan: LaunchPlan, call: Call, session: bool = False) -> None:
        self.plan = plan
        self._session = session  # the ranks stay up and run tasks (a Session's)
        self._call: Call | None = call
        cluster = plan.cluster
        assert isinstance(cluster, RayCluster)
        self._cluster = cluster
        self._run_id = new_run_id()
        self._placement: Any = None
        self._shape: Any = None
        self._intact = True  # no node lost, no helper killed: the reservation can be kept
        self._node_ids: list[str] = []
        self._helpers: list[Any] = []
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
            target=self._supervise, args=(finish,), name="nbddp-ray-supervisor", daemon=True
        ).start()

    def stop(self) -> None:
        self._stop.set()

    # -- start -----------------------------------------------------------------------------

    def start_ranks(self) -> None:
        """Reserve, check and start every node's ranks (the caller tears down on failure)."""
        plan, cluster = self.plan, self._cluster
        ray = cluster.connect()
        self._reserve(ray)
        self._helpers = [cluster.helper(node) for node in self._node_ids]
        infos = [cluster.info(node) for node in self._node_ids]
        self.nodes = tuple(info["address"] for info in infos)
        call = self._call
        assert call is not None
        self._check_nodes(ray, call, infos)
        port = ray.get(self._helpers[0].store_port.remote(self._run_id))
        self._started.append(0)  # its socket is closed by its stop, whatever happens next
        per_node = plan.workers_per_node
        indices = tuple(r % per_node for r in range(plan.world_size))
        spec = job_spec(plan, self._run_id, indices, self._session)  # paths: the node's own
        import numpy as np

        data = ray.put([np.frombuffer(b, dtype=np.uint8) for b in call.buffers])
        starts = []
        for node_rank, helper in enumerate(self._helpers):
            places = [
                Place(
                    node_rank * per_node + local,
                    local,
                    node_rank,
                    plan.world_size,
                    per_node,
                    plan.nodes,
                )
                for local in range(per_node)
            ]
            starts.append(
                helper.start.remote(
                    self._run_id,
                    places,
                    (self.nodes[0], port),
                    spec,
                    call.stream,
                    data,
                    plan.output,
                    dict(plan.env),
                    tuple(range(per_node)),
                )
            )
            if node_rank:
                self._started.append(node_rank)  # all at once: the store listens already
        for pids in ray.get(starts):
            self.pids.update(pids)
        self._call = None  # every node has it: the kernel keeps no copy
        call.close()

    def _reserve(self, ray: Any) -> None:
        from ray.util import placement_group, placement_group_table

        plan = self.plan
        unit = "GPU" if plan.device == "cuda" else "CPU"
        self._shape = (plan.nodes, plan.workers_per_node, unit)
        self._placement = self._cluster.take_reservation(self._shape) or placement_group(
            [{unit: plan.workers_per_node}] * plan.nodes, strategy="STRICT_SPREAD"
        )
        deadline = time.monotonic() + RESERVE_WAIT
        ready = False  # asked of the GCS in short waits (interruptible), not by a Ray task
        while not ready and time.monotonic() < deadline:
            ready = self._placement.wait(0.5)
        if not ready:
            raise NbddpError(
                f"the cluster could not reserve {plan.workers_per_node} {unit}(s) on each of "
                f"{plan.nodes} nodes within {RESERVE_WAIT:g} s: other work holds them. Free "
                "them, or ask for fewer nodes or ranks per node."
            )
        bundles = placement_group_table(self._placement)["bundles_to_node_id"]
        self._node_ids = [bundles[index] for index in range(plan.nodes)]

    def _check_nodes(self, ray: Any, call: Call, infos: list[dict[str, Any]]) -> None:
        """What would fail deep inside a rank is said before anything starts."""
        import torch

        needs = sorted(call.needs())
        missing = ray.get([h.missing_modules.remote(needs) for h in self._helpers])
        for info, names in zip(infos, missing, strict=True):
            if names:
                raise ValueError(
                    f"the ranks need module(s) {', '.join(names)}, which node "
                    f"{info['address']} cannot import. Ship them with "
                    f"cluster=nbddp.RayCluster(runtime_env={{'py_modules': [...]}}) (modules "
                    "imported from the notebook's folder: runtime_env={'working_dir': '.'}), "
                    "or install them on every node."
                )
        for info in infos:
            if info["torch"] != torch.__version__:
                warn_user(
                    f"node {info['address']} has torch {info['torch']}, this kernel "
                    f"{torch.__version__}: what the ranks send back may not load here."
                )

    # -- the loop --------------------------------------------------------------------------

    def send_all(self, message: Any) -> None:
        for helper in self._helpers:
            helper.send_all.remote(self._run_id, message)

    def ask(self, message: Any) -> None:
        """A roll-call: each node's ranks answer, and each node dumps the ones that cannot."""
        self.send_all(message)

    def send_task(self, task: Any, call: Call) -> None:
        """A session's task to every node: the call's bytes once into the object store."""
        import numpy as np
        import ray

        data = ray.put([np.frombuffer(b, dtype=np.uint8) for b in call.buffers])
        for helper in self._helpers:
            helper.send_task.remote(self._run_id, task, data)
        call.close()

    def set_output(self, mode: Any, target: Any = None) -> None:
        """Whose output the nodes forward from now on (the kernel shows it in the task's
        target: forwarded text arrives as ``Printed`` events)."""
        for helper in self._helpers:
            helper.set_output.remote(self._run_id, mode)

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
        import ray
        from ray.exceptions import RayError

        polls = {h.poll.remote(self._run_id, _POLL): i for i, h in enumerate(self._helpers)}
        while True:
            deadline = judge.deadline()
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            ready, _ = ray.wait(list(polls), num_returns=1, timeout=wait) if polls else ([], [])
            if not polls:
                time.sleep(wait)
            for ref in ready:
                node_rank = polls.pop(ref)
                try:
                    happened, over = ray.get(ref)
                except RayError as exc:  # the helper died: its node, or it, was lost
                    self._lost(judge, node_rank, exc)
                    continue
                for event in happened:
                    judge.event(event)
                if not over:
                    helper = self._helpers[node_rank]
                    polls[helper.poll.remote(self._run_id, _POLL)] = node_rank
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
        self._cluster.forget(self._node_ids[node_rank])
        first = node_rank * per_node
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        judge.event(NodeLost(tuple(range(first, first + per_node)), address, reason))

    # -- the end ---------------------------------------------------------------------------

    def _teardown(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        from ray.util import remove_placement_group

        stops = {
            self._helpers[i].stop.remote(self._run_id): i
            for i in self._started
            if i < len(self._helpers)
        }
        if stops:
            done, pending = ray.wait(list(stops), num_returns=len(stops), timeout=TERM_GRACE + 10)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError:
                    self._intact = False
                    self._cluster.forget(self._node_ids[stops[ref]])
            for ref in pending:  # the backstop: a helper that does not answer goes
                self._intact = False
                node_rank = stops[ref]
                ray.kill(self._helpers[node_rank])
                self._cluster.forget(self._node_ids[node_rank])
        self._started.clear()
        if self._placement is not None:
            if self._intact:  # the next launch of this shape starts on it at once
                self._cluster.keep_reservation(self._shape, self._placement)
            else:
                with contextlib.suppress(RayError, GetTimeoutError):
                    remove_placement_group(self._placement)
            self._placement = None
        if self._call is not None:
            self._call.close()
            self._call = None
