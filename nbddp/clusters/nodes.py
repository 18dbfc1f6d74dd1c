"""A cluster node's side of a launch, whatever the engine: the helper that runs the node's ranks.

One :class:`NodeCore` per node and kernel, hosted by the engine (a Ray actor,
``ray/node.py``; a process started by ``srun``, ``slurm/node.py``) and kept for later
launches. It keeps a pre-warmed forkserver of its own (``forkserver.py``: a fresh interpreter
that imported torch), so every launch gets fresh rank processes in milliseconds, exactly as on
one machine: own session, fresh seeds, ``PR_SET_PDEATHSIG``. For each launch
(:class:`NodeStart`) it

* writes the call's out-of-band bytes into a shared memory segment of the node, mapped by its
  ranks copy-on-write;
* starts the node's ranks with the torchrun environment of their place in the cluster, and
  ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set to the interface that carries the node's
  address (unless the user set them): gloo fails whenever a hostname resolves to 127.0.0.1;
* serves them with a :class:`~nbddp.local.group.RankGroup` on a Unix socket of the node, and
  queues what they say and how they end, with their shown output, for the kernel's
  :meth:`NodeCore.poll`.

The kernel decides everything (``rules/referee.py``); the node only serves and forwards.
Non-goal: how the kernel reaches the helper (the engine's business).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbddp.environment import Place, interface_of, store_socket, worker_env
from nbddp.local.forkserver import WarmStarter
from nbddp.local.group import Environments, RankGroup
from nbddp.wire import segment as shared
from nbddp.wire.call import Call
from nbddp.wire.messages import (
    Failed,
    Output,
    Printed,
    RankEvent,
    Received,
    Result,
    Task,
    Unsendable,
)
from nbddp.wire.spec import JobSpec

_ANSWERS = (Result, Failed, Unsendable)


@dataclass(frozen=True)
class NodeStart:
    """Kernel -> node: start this node's ranks of one launch."""

    run_id: str
    places: tuple[Place, ...]  # this node's ranks
    master: tuple[str, int]  # node rank 0's address, and the port its helper listens on
    spec: JobSpec  # its paths are the kernel's; the node fills in its own
    stream: bytes  # the call's pickle (its out-of-band bytes travel beside this message)
    output: Output
    user_env: Mapping[str, str]
    gpus: tuple[int | str, ...]  # the GPU of each local rank (cuda): the helper's index, or a name


def node_places(node_rank: int, nodes: int, per_node: int) -> tuple[Place, ...]:
    """The ranks of node ``node_rank``, as torchrun places them."""
    world = nodes * per_node
    return tuple(
        Place(node_rank * per_node + local, local, node_rank, world, per_node, nodes)
        for local in range(per_node)
    )


class _Forwarder:
    """The node's judge: decides nothing, queues every event for the kernel's next poll."""

    def __init__(self, portable: Callable[[Any], Any]) -> None:
        self._events: list[RankEvent] = []
        self._changed = threading.Condition()
        self._portable = portable
        self.over = False
        self.group: RankGroup | None = None

    def event(self, event: RankEvent) -> None:
        if isinstance(event, Received) and isinstance(event.message, _ANSWERS):
            if self.group is not None:  # what the rank printed first goes first
                self.group.drain_output()
            if isinstance(event.message, Result):
                event = event._replace(buffers=[self._portable(b) for b in event.buffers])
        with self._changed:
            self._events.append(event)
            self._changed.notify_all()

    def deadline(self) -> float | None:
        return None

    def verdict(self) -> Any:
        return None

    def take(self, timeout: float) -> list[RankEvent]:
        with self._changed:
            if not self._events and not self.over:
                self._changed.wait(timeout)
            events, self._events = self._events, []
            return events

    def end(self) -> None:
        with self._changed:
            self.over = True
            self._changed.notify_all()

    def write(self, text: str) -> int:  # the ranks' shown output
        self.event(Printed(text))
        return len(text)

    def flush(self) -> None:
        pass


def as_array(buffer: Any) -> Any:
    """A result's buffer as an array that views it (no copy): what an engine can ship."""
    import numpy as np

    return np.frombuffer(buffer, dtype=np.uint8)


class _NodeRun:
    def __init__(self, group: RankGroup, forwarder: _Forwarder) -> None:
        self.group = group
        self.forwarder = forwarder
        self.thread = threading.Thread(target=self._serve, name="nbddp-node-run", daemon=True)

    def _serve(self) -> None:
        try:
            self.group.serve(self.forwarder)
        finally:
            self.forwarder.end()


class NodeCore:
    """One node's helper. ``address``: the node's address (what ``MASTER_ADDR`` names when it
    is node rank 0); ``store_host``: where node rank 0 binds the rendezvous store ("": every
    address of the node)."""

    def __init__(self, address: str, store_host: str = "") -> None:
        self._address = address
        self._store_host = store_host
        self._starter = WarmStarter()
        self._starter.prestart()
        self._runs: dict[str, _NodeRun] = {}
        self._stores: dict[str, socket.socket] = {}  # bound for a launch, until its rank 0 starts

    def info(self) -> dict[str, Any]:
        import torch

        self._starter.warm_up()
        return {
            "address": self._address,
            "interface": interface_of(self._address),
            "hostname": socket.gethostname(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "pid": os.getpid(),
        }

    def store_port(self, run_id: str) -> int:
        """Bind and listen on the rendezvous store's socket for ``run_id`` (node rank 0's
        job): its port, which rank 0 serves once started here; until then the ranks of every
        node that knock wait in its backlog (``store_socket``)."""
        store = self._stores[run_id] = store_socket(host=self._store_host)
        port: int = store.getsockname()[1]
        return port

    def missing_modules(self, names: list[str]) -> list[str]:
        """The modules the call needs by name that this node cannot import."""
        missing = []
        for name in names:
            try:
                if importlib.util.find_spec(name) is None:
                    missing.append(name)
            except (ImportError, ValueError):
                missing.append(name)
        return missing

    def start(self, start: NodeStart, buffers: list[Any]) -> dict[int, int]:
        """Start this node's ranks of a launch (``buffers``: the call's out-of-band bytes);
        their pids by rank."""
        segment = shared.Segment([memoryview(b) for b in buffers]) if buffers else None
        call = Call(start.stream, segment)
        interface = interface_of(self._address)
        envs = {
            place.rank: worker_env(
                place,
                start.master[1],
                start.run_id,
                device=start.spec.device,
                gpus=start.gpus,
                user_env=start.user_env,
                master_addr=start.master[0],
                interface=interface,
            )
            for place in start.places
        }
        forwarder = _Forwarder(as_array)
        # the kernel's paths mean nothing here: the node's own (Ray's working_dir included)
        spec = dataclasses.replace(start.spec, sys_path=tuple(sys.path), cwd=os.getcwd())
        store = self._stores.pop(start.run_id, None)  # node rank 0's: rank 0 serves it
        group = RankGroup(
            [p.rank for p in start.places],
            lambda: Environments(envs, store),
            spec,
            call,
            self._starter,
            start.output,
            forwarder,
        )
        forwarder.group = group
        try:
            group.start()
        except BaseException:
            group.teardown()
            if store is not None:
                store.close()  # the group never took it
            raise
        run = self._runs[start.run_id] = _NodeRun(group, forwarder)
        run.thread.start()
        return group.pids

    def poll(self, run_id: str, timeout: float = 0.05) -> tuple[list[RankEvent], bool]:
        """What happened since the last poll (waiting up to ``timeout`` for something), and
        whether the node's part of the run is over."""
        run = self._runs.get(run_id)
        if run is None:
            return [], True
        return run.forwarder.take(timeout), run.forwarder.over

    def send_all(self, run_id: str, message: Any) -> None:
        run = self._runs.get(run_id)
        if run is not None:
            run.group.send_all(message)

    def send_task(self, run_id: str, task: Task, buffers: list[Any]) -> None:
        """A session's task to this node's ranks, its tensors in a segment they map."""
        run = self._runs.get(run_id)
        if run is None:
            return
        segment = shared.Segment([memoryview(b) for b in buffers]) if buffers else None
        call = Call(task.call, segment)
        run.group.send_all(task._replace(shared=call.layout), call.fds, then=call.close)

    def set_output(self, run_id: str, mode: Output) -> None:
        run = self._runs.get(run_id)
        if run is not None:
            run.group.set_output(mode, run.forwarder)

    def stop(self, run_id: str) -> None:
        """End the node's ranks of this launch and everything they started; returns when
        they are gone."""
        store = self._stores.pop(run_id, None)
        if store is not None:  # the launch ended before its ranks started here
            store.close()
        run = self._runs.pop(run_id, None)
        if run is not None:
            run.group.stop()
            run.thread.join()

    def stop_all(self) -> None:
        """End every launch's ranks (the helper is going)."""
        for run_id in list(self._runs) + list(self._stores):
            self.stop(run_id)

    def close(self) -> None:
        """End every launch's ranks and the forkserver (the helper is going)."""
        self.stop_all()
        helper = self._starter.helper
        if helper is not None:
            helper.close()

    def pids(self, run_id: str) -> dict[int, int]:
        run = self._runs.get(run_id)
        return run.group.pids if run is not None else {}
