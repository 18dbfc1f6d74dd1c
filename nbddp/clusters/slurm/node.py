"""A Slurm node's helper: :class:`~nbddp.clusters.nodes.NodeCore` in a process of its own.

``srun`` starts one per node of the allocation (``python -m nbddp.clusters.slurm.node``, one
task per node, ``--overlap``); each connects back to the kernel's listener, proves the key it
was given in its environment (and removes it from there, so no rank inherits it), says which
node it serves, and then serves the kernel's calls, each on a thread of its own (a poll waits,
a stop takes the ranks' grace), as a Ray actor would. When the connection ends (the kernel
closed it, exited or died) it ends every rank it started and exits: nothing outlives the
kernel, and ``srun``'s step ends with it.

Non-goal: deciding anything about a run (the kernel's referee does).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pickle
import signal
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nbddp.clusters.nodes import NodeCore
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
from nbddp.wire.transport import connect

CONCURRENCY = 16  # calls served side by side (polls, sends and stops of several runs)


def node_addresses(text: str) -> dict[str, str]:
    """``name=address,...`` as a mapping."""
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {name: address for name, address in pairs}


def _serve_call(core: NodeCore, conn: Connection, call: NodeCall, buffers: list[Any]) -> None:
    args = tuple(buffers if a == OUT_OF_BAND else a for a in call.args)
    try:
        value = getattr(core, call.method)(*args)
        reply = NodeReply(call.request, value, None)
    except BaseException as exc:  # the kernel gets it, as Ray would give a method's error
        reply = NodeReply(call.request, None, _portable_error(exc))
    with contextlib.suppress(OSError):  # the kernel is gone: the main loop sees the end
        conn.send(reply)


def _portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an NbddpError with its traceback's text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(exc)).rstrip()
        return NbddpError(f"a Slurm node's helper failed:\n{text}")


def _is_ipv4(address: str) -> bool:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return True


def main() -> int:
    # Slurm's signal before the time limit reaches every process of this step: the helper and
    # its forkserver ignore it (inherited), each rank asks for a graceful stop on it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    address = os.environ.pop(ADDRESS_VARIABLE)
    key = bytes.fromhex(os.environ.pop(KEY_VARIABLE))
    name = os.environ["SLURMD_NODENAME"]
    addresses = node_addresses(os.environ.pop(NODES_VARIABLE, ""))
    own = addresses.get(name)
    if own is None:
        print(f"nbddp: node {name} is not among {sorted(addresses)}", file=sys.stderr)
        return 2
    conn = connect(address, key)
    # the store listens where MASTER_ADDR points only (every address, for a node's name)
    core = NodeCore(own, store_host=own if _is_ipv4(own) else "")
    conn.send(NodeHello(name, os.getpid()))
    pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="nbddp-node-call")
    try:
        while True:
            try:
                frame = conn.recv()
            except (EOFError, OSError):
                return 0  # the kernel closed the connection, exited or died
            if isinstance(frame.message, NodeCall):
                pool.submit(_serve_call, core, conn, frame.message, frame.buffers)
    finally:
        core.close()
        pool.shutdown(wait=False, cancel_futures=True)
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
