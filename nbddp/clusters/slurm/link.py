"""The kernel's side of a Slurm allocation's node helpers: one ``srun`` step, one helper per
node, each connected back over TCP.

* The kernel listens on the address it reaches the allocation's nodes from (the source
  address of its route to them, never 0.0.0.0), on a free port, for this step only: once
  every helper has connected the listener closes.
* The key of the handshake (``wire/transport.py``: HMAC both ways before anything is
  unpickled) travels to the helpers in ``srun``'s environment, which only this user can read,
  never on a command line. The stream is authenticated, not encrypted.
* Each helper is a :class:`HelperLink`: calls are framed messages answered in any order
  (``Future`` per call), read by one thread per link; a link whose connection ends fails its
  waiting calls with :class:`~nbddp.clusters.NodeGone`.
* The step (:class:`HelperStep`) is kept for later launches and sessions; closing it closes
  the links, which ends every helper and so the step.

Non-goal: the allocation itself (``allocation.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from nbddp import interrupts
from nbddp.clusters import NodeGone
from nbddp.clusters.placement import NodeInfo
from nbddp.clusters.slurm.messages import (
    ADDRESS_VARIABLE,
    KEY_VARIABLE,
    NODES_VARIABLE,
    OUT_OF_BAND,
    NodeCall,
    NodeHello,
    NodeReply,
)
from nbddp.errors import NbddpError
from nbddp.wire.frames import Connection
from nbddp.wire.transport import AuthenticationFailed, Listener, PendingHandshake

START_WAIT = 180.0  # seconds for every node's helper to connect (srun, Python, torch)
CLOSE_WAIT = 15.0  # seconds for the step to end once its helpers were told to go


class OutOfBand(list[Any]):
    """A call's bytes, sent beside the message as they are (``Engine.share``)."""


def route_source(address: str) -> str:
    """This machine's address on its route to ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        source: str = probe.getsockname()[0]
        return source


def listen_address(nodes: Sequence[NodeInfo]) -> str:
    """Where the helpers can reach the kernel: the source address of its routes to the
    nodes (loopback only when every node is this machine)."""
    sources = [route_source(n.address) for n in nodes]
    outward = [s for s in sources if not s.startswith("127.")]
    return (outward or sources)[0]


class HelperLink:
    """One node's helper, connected: its calls, answered by its reader thread."""

    def __init__(self, conn: Connection, hello: NodeHello) -> None:
        self.conn = conn
        self.node = hello.node
        self.pid = hello.pid
        self.info: dict[str, Any] | None = None
        self.gone: str | None = None  # why the connection ended, once it has
        self._requests = itertools.count(1)
        self._waiting: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read, name=f"nbddp-slurm-{self.node}", daemon=True
        )
        self._reader.start()

    def call(self, method: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        buffers: list[Any] = []
        sent = []
        for arg in args:
            if isinstance(arg, OutOfBand):
                buffers, arg = list(arg), OUT_OF_BAND
            sent.append(arg)
        with self._lock:
            if self.gone is not None:
                future.set_exception(
                    NodeGone(f"the helper of node {self.node} is gone ({self.gone})")
                )
                return future
            request = next(self._requests)
            self._waiting[request] = future
        try:
            self.conn.send(NodeCall(request, method, tuple(sent)), buffers)
        except OSError as exc:
            self._end(f"{type(exc).__name__}: {exc}")
        return future

    def _read(self) -> None:
        why = "the connection ended"
        try:
            while True:
                frame = self.conn.recv()
                reply = frame.message
                if not isinstance(reply, NodeReply):
                    continue
                with self._lock:
                    future = self._waiting.pop(reply.request, None)
                if future is None:
                    continue
                if reply.error is not None:
                    future.set_exception(reply.error)
                else:
                    future.set_result(reply.value)
        except (EOFError, OSError) as exc:
            why = f"its connection ended ({type(exc).__name__})"
        except BaseException as exc:  # a reply that cannot be read: the link is unusable
            why = f"{type(exc).__name__}: {exc}"
        self._end(why)

    def _end(self, why: str) -> None:
        with self._lock:
            if self.gone is None:
                self.gone = why
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(NodeGone(f"the helper of node {self.node} is gone ({why})"))

    def close(self) -> None:
        """End the connection: the helper ends its ranks and exits."""
        self._end("closed by the kernel")
        self.conn.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(5)


class HelperStep:
    """The helpers of an allocation's nodes: one ``srun`` step, connected back. Raises
    NbddpError (after ending what started) when a helper does not come."""

    def __init__(self, job_id: str, nodes: Sequence[NodeInfo]) -> None:
        self.job_id = job_id
        self.nodes = list(nodes)
        self.links: dict[str, HelperLink] = {}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (srun's and the helpers' output)
        self._srun: subprocess.Popen[bytes] | None = None
        listener = Listener(f"tcp:{listen_address(nodes)}:0")
        try:
            with interrupts.deferred():  # a started srun is owned by this step
                self._srun = subprocess.Popen(
                    self._command(),
                    env=self._environment(listener),
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the notebook's interrupt is not srun's
                )
            self._connect(listener)
            for link in self.links.values():
                link.info = self._info(link)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _command(self) -> list[str]:
        count = str(len(self.nodes))
        command = ["srun", f"--jobid={self.job_id}", "--overlap", f"--nodes={count}"]
        command += [f"--ntasks={count}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
        command += [f"--nodelist={','.join(n.id for n in self.nodes)}", "--job-name=nbddp"]
        # the ranks the helper forks stay in its step's cgroup and CPU set: it takes every CPU
        # the job holds on its node (steps overlap), or all GPU ranks would share one core
        cpus = max(1, min((int(n.cpus) for n in self.nodes), default=1))
        command += [f"--cpus-per-task={cpus}", "--mem=0"]
        gpus = min((int(n.gpus) for n in self.nodes), default=0)
        if gpus:  # the helpers (and so the ranks) see the node's GPUs the job holds
            command.append(f"--gpus-per-node={gpus}")
        return [*command, sys.executable, "-m", "nbddp.clusters.slurm.node"]

    def _environment(self, listener: Listener) -> dict[str, str]:
        env = dict(os.environ)
        env[ADDRESS_VARIABLE] = listener.address
        env[KEY_VARIABLE] = listener.key.hex()
        env[NODES_VARIABLE] = ",".join(f"{n.id}={n.address}" for n in self.nodes)
        return env

    def _connect(self, listener: Listener) -> None:
        deadline = time.monotonic() + START_WAIT
        pending: list[PendingHandshake] = []
        hellos: list[Connection] = []
        while len(self.links) < len(self.nodes):
            if time.monotonic() > deadline:
                raise NbddpError(
                    self._failure(f"not every node's helper connected in {START_WAIT:g} s")
                )
            assert self._srun is not None
            if self._srun.poll() is not None:
                raise NbddpError(self._failure(f"srun ended (exit status {self._srun.returncode})"))
            waiting: list[Any] = [listener, *pending, *hellos]
            ready, _, _ = select.select(waiting, [], [], 0.2)
            for item in ready:
                if item is listener:
                    handshake = listener.accept()
                    if handshake is not None:
                        pending.append(handshake)
                elif isinstance(item, PendingHandshake):
                    try:
                        conn = item.advance()
                    except (AuthenticationFailed, EOFError, OSError):
                        pending.remove(item)
                        item.close()
                        continue
                    if conn is not None:
                        pending.remove(item)
                        conn.sock.setblocking(True)
                        hellos.append(conn)
                elif isinstance(item, Connection):
                    hellos.remove(item)
                    hello = item.recv(timeout=10).message
                    if isinstance(hello, NodeHello) and hello.node not in self.links:
                        self.links[hello.node] = HelperLink(item, hello)
                    else:
                        item.close()
        for item in pending:
            item.close()

    def _info(self, link: HelperLink) -> dict[str, Any]:
        info: dict[str, Any] = link.call("info").result(START_WAIT)  # warms its forkserver
        return info

    def _failure(self, what: str) -> str:
        self._log.seek(0)
        tail = self._log.read()[-3000:].decode(errors="replace").strip()
        command = shlex.join(self._command())
        return (
            f"the node helpers of Slurm job {self.job_id} did not start: {what}.\n"
            f"command: {command}\n{tail or '(no output)'}"
        )

    @property
    def alive(self) -> bool:
        return (
            self._srun is not None
            and self._srun.poll() is None
            and all(link.gone is None for link in self.links.values())
        )

    def close(self) -> None:
        """End every helper (each ends its ranks) and the step; bounded."""
        for link in self.links.values():
            link.close()
        srun = self._srun
        if srun is not None:
            try:
                srun.wait(CLOSE_WAIT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    srun.terminate()  # srun signals every task of the step
                try:
                    srun.wait(CLOSE_WAIT)
                except subprocess.TimeoutExpired:
                    srun.kill()
                    srun.wait()
        self._log.close()
