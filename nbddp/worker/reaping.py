"""A process's own family: who its descendants are, how each child ended, and ending them.

Both sides use these: a rank reaps what it started before it exits (``end_descendants``), the
pre-warmed helper watches the ranks it forked, and the kernel looks for a run's strays. They
read /proc and call ``waitid``; they decide nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from typing import NamedTuple


def exit_status(pid: int) -> int | None:
    """How our child ``pid`` ended (negative: the signal), or None while it runs; not reaped."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if result is None or result.si_pid != pid:
        return None
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


def signal_each(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


class ProcessTable(NamedTuple):
    """One look at /proc: each live process of ours by parent, and when each started."""

    children: dict[int, list[int]]
    started: dict[int, float]  # time.time() of the start

    def descendants(self, roots: Iterable[int]) -> set[int]:
        found: set[int] = set()
        pending = list(roots)
        while pending:
            for child in self.children.get(pending.pop(), ()):
                if child not in found:
                    found.add(child)
                    pending.append(child)
        return found


def process_table() -> ProcessTable:
    """Our processes (same user), zombies left out: they only wait for their parent."""
    me = os.getuid()
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    ticks = os.sysconf("SC_CLK_TCK")
    table = ProcessTable({}, {})
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != me:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] == b"Z":
            continue
        pid = int(name)
        table.children.setdefault(int(fields[1]), []).append(pid)
        table.started[pid] = boot + int(fields[19]) / ticks
    return table


def end_descendants() -> None:
    """SIGKILL every descendant of this process: a rank calls it just before it exits, as the
    reaper of its own orphans (``become_subreaper``), so nothing it started outlives it."""
    try:  # the common case, cheaply: no child at all, so no descendant either
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return
    me = os.getpid()
    for _ in range(3):  # what they start meanwhile is found by the next look
        targets = process_table().descendants([me])
        if not targets:
            return
        signal_each(targets, signal.SIGKILL)


def become_subreaper(on: bool = True) -> None:
    """Orphans of this process's descendants become its children instead of init's, so that a
    process that left its session cannot leave the tree (Linux ``PR_SET_CHILD_SUBREAPER``);
    ``on=False`` lets them go up again (a detached run's supervisor is meant to leave)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
