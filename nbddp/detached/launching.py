"""A detached launch, the kernel's side: the backend of the ``Run`` that
``notebook_launch(..., detach=True)`` and ``%%ddp --detach`` return. It starts the run's
supervisor (on this machine, also for a run on Ray: ``spawn.py``; on Slurm: a batch job,
``batch.py``), then
follows it as any attached kernel does (``attached.Follow``).

Non-goal: following (``attached.py``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

from nbddp import interrupts
from nbddp.backend import Finish, RunEvents
from nbddp.clusters.ray.cluster import RayCluster
from nbddp.detached import batch, retention, store
from nbddp.detached.attached import Follow
from nbddp.detached.link import Handoff
from nbddp.detached.spawn import start_supervisor
from nbddp.local.forkserver import default_starter
from nbddp.plan import LaunchPlan
from nbddp.state.terminal import CellStream
from nbddp.wire import payload
from nbddp.wire.call import Call


class DetachedLaunch(Follow):
    """A launch whose ranks belong to a supervisor of their own: start it, then follow it."""

    def __init__(self, plan: LaunchPlan, call: Call, meta: dict[str, Any]) -> None:
        super().__init__(None)
        self._plan = plan
        self._call = call
        self._meta = meta

    def start(self, events: RunEvents, finish: Finish) -> None:
        self._events, self._finish = events, finish
        self._out = events.output or CellStream(sys.stdout)
        if self._plan.batch:  # Slurm
            self.stored = batch.submit_run(self._info(), self._plan, self._call, self._handoff(""))
            self._begin()
            return
        default_starter().warm_up()  # interruptibly, before anything exists
        retention.sweep()
        with interrupts.deferred():  # the run starts whole, or leaves nothing
            run, lock = store.create(self._info())
            self.stored = run
            try:
                conn, launched = start_supervisor(
                    run, lock, self._handoff(run.path), self._call.fds
                )
            except BaseException:
                run.remove()
                raise
            finally:
                os.close(lock)
                self._call.close()
        self._follow_from(conn, launched.offset)

    def _info(self) -> dict[str, Any]:
        plan = self._plan
        return {
            **self._meta,
            "started": time.time(),
            "world_size": plan.world_size,
            "device": plan.device,
            "backend": plan.backend,
            "output": plan.output,
            "stall_after": plan.stall_after,
            "nodes": plan.nodes,
            "host": os.uname().nodename,
            **({"cluster": "ray"} if isinstance(plan.cluster, RayCluster) else {}),
        }

    def _handoff(self, directory: str) -> Handoff:
        plan, ray, cluster = self._plan, None, self._plan.cluster
        if isinstance(cluster, RayCluster):  # the supervisor connects as its own driver
            cluster.release_reservations()  # what this kernel keeps would hold the nodes
            plan, ray = dataclasses.replace(plan, cluster=None), cluster.reachable()
        return Handoff(
            directory,
            plan,
            self._call.stream,
            self._call.layout,
            payload.notebook_sources(),
            tuple(os.path.abspath(p) if p else os.getcwd() for p in sys.path),
            os.getcwd(),
            dict(os.environ),
            ray,
        )
