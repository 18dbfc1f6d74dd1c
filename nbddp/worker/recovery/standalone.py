"""A graceful stop where no kernel asks: under torchrun (an exported script, ``nbddp.export``),
on SIGTERM (what torchrun forwards when it is told to end, e.g. by ``scancel`` or a
preemption) or when the stop file appears (``NBDDP_STOP_FILE``: what an exported batch file's
trap of Slurm's signal before the time limit writes).

The ranks agree through torchrun's rendezvous store instead of the kernel, with the same rule
(``stopping.py``): whichever rank hears first sets the store's ``asked`` key; every rank's
watcher thread, on hearing, raises its flag and publishes its count; each then reads every
count and agrees on one past the largest. The watcher polls the store and the file every
``POLL`` seconds; the training thread never touches either.

Unlike a launch, a stop asked before a rank first checked is not ended at once (nothing here
could): every rank stops at its first check. Non-goal: stopping a rank that never checks
(torchrun ends it, as before).
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

from nbddp.worker.recovery import stopping

POLL = 0.25  # seconds between two looks at the store and the stop file
CLOSE_WAIT = 5.0  # seconds close() waits for a look in progress: one takes milliseconds
STOP_FILE = "NBDDP_STOP_FILE"


class Watcher:
    """One rank's watch for a stop request, and its part of the agreement."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str) -> None:
        self.agreement = stopping.Agreement()
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._prefix = prefix
        self._file = os.environ.get(STOP_FILE) or None
        self._signalled = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="nbddp-stop-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """The function is over: end the watch before the interpreter does. A daemon thread
        still inside a store call while Python finalizes is unwound from C++ code, which
        aborts the process. The wait is generous: on a loaded machine a thread can go
        unscheduled for longer than a poll; only a stop's agreement, waiting for another rank,
        can hold it longer."""
        self._closed = True
        self._signalled.set()  # wakes its wait at once
        self._thread.join(timeout=CLOSE_WAIT)

    def signalled(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM: a graceful stop (torchrun's ``--shutdown-timeout`` bounds it: then
        SIGKILL). Slurm may signal a rank twice (directly, and through torchrun): once is
        enough."""
        self._signalled.set()

    def _asked(self) -> bool:
        if self._closed:
            return True
        key = f"{self._prefix}/asked"
        if self._signalled.is_set() or (self._file is not None and os.path.exists(self._file)):
            self._store.set(key, "1")
            return True
        return bool(self._store.check([key]))

    def _watch(self) -> None:
        try:
            while not self._asked():
                self._signalled.wait(POLL)
            if self._closed:
                return
            count = self.agreement.asked()
            self._store.set(f"{self._prefix}/checks/{self._rank}", str(count))
            keys = [f"{self._prefix}/checks/{r}" for r in range(self._world_size)]
            self._store.wait(keys, timedelta(days=1))
            counts = [int(self._store.get(key)) for key in keys]
        except Exception:  # the store is gone: the job is ending anyway
            return
        # A rank that has not checked yet (0) stops at its first check; one that never
        # checks is ended by torchrun, as before (no kernel here to end the run at once).
        self.agreement.agree(max(counts) + 1)


def install() -> Watcher | None:
    """Under torchrun (its store reachable at ``MASTER_ADDR:MASTER_PORT``): watch for a stop
    request, on SIGTERM or the stop file. None where there is no such world."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env and STOP_FILE not in env:
        return None
    import torch.distributed as dist

    rank, world_size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    if world_size > 1:
        store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    watcher = Watcher(store, rank, world_size, f"nbddp/stop/{attempt}")
    stopping.install(watcher.agreement)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, watcher.signalled)
    watcher.start()
    return watcher
