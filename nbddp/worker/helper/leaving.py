"""A detached run's supervisor leaving the pre-warmed helper's tree, the helper's side.

The helper hands the job to a child (the "middle" one) while it is no subreaper; the middle
child forks the supervisor and exits at once, so the supervisor is adopted by init (or by the
nearest subreaper above the kernel's whole tree) and never belongs to the kernel's process
tree, its process group or its session: a kernel restart, shutdown or SIGKILL, and whatever
ends the kernel's tree, leave it running. A fork clears the parent-death signal, so nothing
ties it to the helper either. It then runs its script as ``__main__``, with its link to the
kernel as descriptor 3.

Non-goal: supervising (the script calls into the kernel side, which this side never imports).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from nbddp.wire.frames import Connection
from nbddp.wire.helper import Handoff
from nbddp.worker.reaping import become_subreaper

LINK_FD = 3  # the supervisor's link to the kernel that launched it
MIDDLE_WAIT = 10.0  # seconds the middle child may take to fork and exit


def start_supervisor(
    fork: Callable[[], tuple[int, socket.socket]],
    argv: list[str],
    env: dict[str, str],
    fds: list[int],
) -> int:
    """In the helper: a child forked now (``fork``: the helper's) forks the supervisor and
    exits at once, while the helper is no subreaper, so the supervisor is adopted above it (by
    init), outside every tree. The pid returned is the middle child's, already reaped."""
    pid, channel = fork()
    become_subreaper(False)
    try:
        Connection(channel).send(Handoff(argv, env, [], detached=True), fds=fds)
        reap_within(pid)
    finally:
        become_subreaper(True)
        channel.close()
    return pid


def leave_and_supervise(argv: list[str], env: dict[str, str], fds: list[int]) -> int:
    """In the middle child: fork the supervisor and return at once (the caller exits); in the
    supervisor: a session of its own, stdout/stderr to ``fds[0:2]``, its link ``fds[2]`` as
    descriptor 3, ``env``, then ``argv[0]`` as ``__main__``."""
    if os.fork():
        return 0
    os.setsid()
    link = os.dup(fds[2])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {devnull, *fds}:
        if fd > 2 and fd != link:
            os.close(fd)
    if link != LINK_FD:
        os.dup2(link, LINK_FD)
        os.close(link)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no terminal, no kernel: only stop() ends it
    os.environ.clear()
    os.environ.update(env)
    import runpy

    sys.argv = [argv[0], str(LINK_FD), *argv[1:]]
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def reap_within(pid: int, timeout: float = MIDDLE_WAIT) -> None:
    """Reap the middle child, which exits as soon as it forked; kill it past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.001)
