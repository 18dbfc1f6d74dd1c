"""A child of the pre-warmed helper, from the fork to a rank running the launch script.

The helper (``forkserver.py``) forks a child ahead of a launch; the child waits on its own
socket for its ``Handoff``, then becomes a rank as a fresh interpreter would be: a session of
its own, the pipes as stdout/stderr, the rank's environment, fresh random state, and without
the local modules edited since the helper imported them. The socket stays open: as the rank
exits normally, it tells the helper which modules it imported (so the next launch's ranks
start with them).

Non-goal: anything of a previous launch: the helper never ran one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys

from nbddp.wire.frames import Connection
from nbddp.wire.helper import Handoff, Imported
from nbddp.worker.helper.leaving import leave_and_supervise
from nbddp.worker.helper.preload import drop, new_modules

_PR_SET_PDEATHSIG = 1
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # Lightning's

known: frozenset[str] = frozenset()  # the helper's modules, set by the helper before it forks
known_generation = -1  # the helper's import generation ``known`` was taken at


def fork_child(inherited: list[int], channel: socket.socket) -> int:
    """Fork a child that waits on ``channel`` for its job; its pid (in the helper)."""
    sys.stdout.flush()
    sys.stderr.flush()
    helper = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        die_with(helper)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        conn = Connection(channel)
        frame = conn.recv()  # EOFError when the helper goes (or discards us): we go too
        if frame.message.detached:  # the middle child of a detached run's supervisor
            conn.close()
            code = leave_and_supervise(frame.message.argv, frame.message.env, frame.fds)
        else:
            code = _become_rank(frame.message, frame.fds, conn)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _become_rank(job: Handoff, fds: list[int], conn: Connection) -> int:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.environ.clear()
    os.environ.update(job.env)
    drop(job.drop)
    _as_if_fresh(job.env)
    atexit.register(_report_imports, conn)  # the last exit handler to run (they run LIFO)
    import runpy

    sys.argv = list(job.argv)
    runpy.run_path(job.argv[0], run_name="__main__")
    return 0


def _report_imports(conn: Connection) -> None:
    """As the rank exits normally (``worker/rank/exiting.py`` runs the exit handlers)."""
    with contextlib.suppress(Exception):
        modules = new_modules(known) if len(sys.modules) > len(known) else []
        if modules:
            conn.send(Imported(modules, list(sys.path)))
    conn.close()


def die_with(parent: int) -> None:
    """SIGKILL when the helper dies (set before the check: no window in between)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _as_if_fresh(env: dict[str, str]) -> None:
    """What a fresh interpreter would have: its own random state and thread count, and the rank
    Lightning reads from the environment when it is imported (the helper imported it with the
    kernel's, where no rank is set)."""
    import random

    import torch

    random.seed()
    torch.seed()
    if "numpy.random" in sys.modules:  # else its first import seeds itself (and costs ~8 ms)
        sys.modules["numpy.random"].seed()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:
        rank = next((env[k] for k in _RANK_VARIABLES if env.get(k, "").isdigit()), "0")
        rank_zero.rank_zero_only.rank = int(rank)
