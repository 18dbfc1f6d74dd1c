"""A detached run's supervisor's own pre-warmed helper: forked from the supervisor itself,
which has torch imported (it was forked from the kernel's helper), so it is ready at once, and
dies with the supervisor (``PR_SET_PDEATHSIG``), taking the ranks with it.

Non-goal: what the helper does (``forkserver.py``).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys

from nbddp.wire.frames import Connection
from nbddp.worker.helper.forked import die_with
from nbddp.worker.helper.server import PRELOADED, serve_on


def fork_server(keep: tuple[int, ...] = ()) -> tuple[socket.socket, int]:
    """A helper forked from this process (a detached run's supervisor, which has torch
    imported), serving on the returned socket: ready at once, it dies with this process.
    Call it before this process starts any thread; ``keep``: descriptors the helper must not
    hold (closed in it)."""
    for name in PRELOADED:
        importlib.import_module(name)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        return ours, pid
    code = 1
    try:
        die_with(parent)
        for fd in (ours.fileno(), *keep):
            os.close(fd)
        serve_on(Connection(theirs))
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
