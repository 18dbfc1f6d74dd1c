"""The collective timeout a rank's code asks for, enforced by nbddp on the rank: a collective
that waits longer than it fails the rank, as torchrun's would, unless a person holds a rank (in
pdb, or answering ``input()``) meanwhile.

Why not torch's own timeout. A gloo or NCCL operation's timeout is fixed when the operation
starts (``ProcessGroup`` options, read into each ``Work``): a rank that enters pdb cannot
lengthen the wait its peers have already begun, so with torch's timeout a breakpoint on one rank
kills the others after the timeout (NCCL's 10 minutes by default), and the asked timeout of a
group that already exists (nbddp makes it before ``fn``; Accelerate, Lightning and the HF
Trainer then skip their own ``init_process_group``) would be lost. So nbddp builds every group
with a native timeout that never fires in practice (:data:`NATIVE`) and this module enforces
the asked one (``init_process_group(timeout=)``, Accelerate's ``InitProcessGroupKwargs``,
Lightning's ``DDPStrategy(timeout=)``, the HF Trainer's ``ddp_timeout``; torch's default for the
backend otherwise: 30 minutes for gloo, 10 for NCCL).

How a wait is seen, on gloo and NCCL alike. torch numbers the collectives each rank issues on
each process group (the count grows when the collective is issued: DDP's own all-reduces too).
A watch thread publishes this rank's counts in the rendezvous store and reads its peers'. A
collective this rank issued that a peer has not issued cannot complete: when the oldest such
one has waited longer than the timeout, the rank fails with ``collective timed out after 3 s:
all_reduce #12 on the default group, waiting for rank 1``, its traceback the place in ``fn``
where it waits. On NCCL, where every rank may have issued a collective that still does not
complete (a transport that hangs), the flight recorder says so and the same rule applies.

A person at a prompt. Every prompt a rank asks the notebook (pdb's, ``input()``'s) is counted
in the store while it waits (:func:`held`); while any rank is held, and for a whole timeout
after the last prompt was answered, no rank fails: however long the person stays in pdb, the
peers' collectives wait for them.

The watch acts only while the rank's job runs (:func:`arm`, :func:`disarm`: from the group's
build, or a session task's start, until its outcome is reported), so a session's rank idle
between tasks, or a rank whose result is sent, never fails here.

Non-goals: groups the user makes with ``new_group(timeout=)`` keep torch's own timeout (their
counts are watched with the default group's timeout); a one-rank world (no peer to wait for).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from nbddp.worker import PACKAGE_DIR
from nbddp.worker.diagnosis import collectives

_RANK_RUNTIME = os.path.join(PACKAGE_DIR, "worker", "rank", "")
# What nbddp builds every group with: torch's own timeout must never fire before ours.
NATIVE = timedelta(days=30)
MIN_TICK, MAX_TICK = 0.05, 1.0  # seconds between two looks: a tenth of the timeout, bounded


class CollectiveTimeout(RuntimeError):
    """A collective of this rank waited longer than the timeout its code asked for."""


_asked: float | None = None  # seconds, from the rank's code; None: torch's default
_fail: Callable[[BaseException], None] | None = None
_watch: _Watch | None = None
_armed = threading.Event()
_store: Any = None  # the store every rank of the world reaches (prompts are counted there)


def configure(fail: Callable[[BaseException], None] | None) -> None:
    """What ends this rank when a collective timed out (the rank's job sets it)."""
    global _fail
    _fail = fail


def ask(timeout: Any) -> None:
    """The timeout the rank's code asked for (a ``timedelta`` or seconds); from now on."""
    global _asked
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds > 0:
        _asked = seconds


def asked() -> float | None:
    return _asked


def timeout_for(backend: str) -> float:
    """The asked timeout, else torch's default for ``backend`` (NCCL's is shorter)."""
    if _asked is not None:
        return _asked
    try:
        from torch.distributed.distributed_c10d import _get_default_timeout

        return float(_get_default_timeout(backend).total_seconds())
    except Exception:  # a torch without it: the documented defaults
        return 600.0 if "nccl" in backend else 1800.0


def arm() -> None:
    _armed.set()


def disarm() -> None:
    _armed.clear()


def start(store: Any, build: int, rank: int, world_size: int, backend: str) -> None:
    """Watch the group just built (``build``: its number, so a rebuilt group's counts are
    never compared with the last one's). A world of one has nobody to wait for."""
    global _watch, _store
    _end_watch()
    _store = store
    if world_size < 2:
        return
    watch = _Watch(store, build, rank, world_size, backend)
    watch.publish(force=True)  # before any peer reads it
    _watch = watch
    arm()
    threading.Thread(target=watch.run, name="nbddp-watch", daemon=True).start()


def stop() -> None:
    """The world is left: no watch, and the next world's code asks anew."""
    global _store, _asked
    _end_watch()
    _store = None
    disarm()
    _asked = None


def _end_watch() -> None:
    global _watch
    watch, _watch = _watch, None
    if watch is not None:
        watch.stopped.set()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """This rank waits for a person (a prompt in the notebook): no rank fails meanwhile."""
    store = _store
    if store is None:
        yield
        return
    counted = _count_held(store, 1)
    try:
        yield
    finally:
        if counted:
            _count_held(store, -1)


def _count_held(store: Any, step: int) -> bool:
    try:
        store.add("nbddp-held/now", step)
        store.add("nbddp-held/changes", 1)
    except Exception:  # the store is gone (rank 0 ended): nobody is left to wait for us
        return False
    return True


class _Watch:
    """One group's watch: this rank's counts out, the peers' in, a verdict every tick."""

    def __init__(self, store: Any, build: int, rank: int, world_size: int, backend: str) -> None:
        self.store = store
        self.prefix = f"nbddp-watch-{build}/"
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.stopped = threading.Event()
        self.published: str | None = None
        # per group: (count, when this rank was first seen at or past it), oldest first
        self.seen: dict[str, list[tuple[int, float]]] = {}
        self.changes = -1
        self.quiet_since = time.monotonic()  # the last time a person held a rank

    def run(self) -> None:
        while not self.stopped.wait(_tick(timeout_for(self.backend))):
            try:
                verdict = self.look()
            except Exception:  # a look that failed (the store went with rank 0) is no verdict
                continue
            if verdict is not None and _armed.is_set() and not self.stopped.is_set():
                fail = _fail
                if fail is not None:
                    fail(_with_main_traceback(CollectiveTimeout(verdict)))
                return

    def publish(self, force: bool = False) -> dict[str, tuple[tuple[int, ...], int]]:
        mine = _own_counts()
        text = json.dumps({name: [list(members), count] for name, (members, count) in mine.items()})
        if force or text != self.published:
            self.store.set(f"{self.prefix}{self.rank}", text)
            self.published = text
        return mine

    def look(self) -> str | None:
        """Why this rank must fail now, or None."""
        now = time.monotonic()
        mine = self.publish()
        for name, (_, count) in mine.items():
            seen = self.seen.setdefault(name, [])
            if not seen or seen[-1][0] < count:
                seen.append((count, now))
        changes = int(self.store.add("nbddp-held/changes", 0))
        if changes != self.changes or int(self.store.add("nbddp-held/now", 0)) > 0:
            self.changes, self.quiet_since = changes, now
        limit = timeout_for(self.backend)
        if now - self.quiet_since <= limit:
            return None
        keys = [f"{self.prefix}{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None  # a peer's watch has not started yet
        peers = [json.loads(bytes(v).decode()) for v in self.store.multi_get(keys)]
        for name, (members, count) in mine.items():
            verdict = self._late(name, members, count, peers, now, limit)
            if verdict is not None:
                return verdict
        return _incomplete(self.backend, limit, now - self.quiet_since)

    def _late(
        self,
        name: str,
        members: tuple[int, ...],
        count: int,
        peers: list[dict[str, Any]],
        now: float,
        limit: float,
    ) -> str | None:
        behind = {}
        for peer in members:
            entry = peers[peer].get(name) if 0 <= peer < len(peers) else None
            theirs = int(entry[1]) if entry else 0
            if theirs < count:
                behind[peer] = theirs
        seen = self.seen.get(name, [])
        if not behind:
            del seen[:-1]  # every member issued all of ours: only the newest count matters
            return None
        first_missing = min(behind.values()) + 1
        since = next((t for c, t in seen if c >= first_missing), now)
        waited = now - max(since, self.quiet_since)
        if waited <= limit:
            return None
        op = _op_name(first_missing) or "collective"
        group = "the default group" if name in ("0", "default_pg") else f"process group {name!r}"
        ranks = ", ".join(
            f"rank {peer} (it has issued {n} collective{'s' if n != 1 else ''} there)"
            for peer, n in sorted(behind.items())
        )
        return (
            f"collective timed out after {_seconds(limit)}: {op} #{first_missing} on {group}, "
            f"waiting for {ranks}. {_advice()}"
        )


def _incomplete(backend: str, limit: float, quiet: float) -> str | None:
    """NCCL: a collective every rank issued that has not completed for longer than the
    timeout (the flight recorder says which); gloo's recorder does not say."""
    if "nccl" not in backend:
        return None
    from nbddp.worker.diagnosis.stacks import flight_entries

    now_ns = time.time_ns()
    for entry in flight_entries("nccl"):
        if entry.get("state") == "completed":
            continue
        created = entry.get("time_created_ns")
        if not isinstance(created, int):
            continue
        waited = min((now_ns - created) / 1e9, quiet)
        if waited > limit:
            op = str(entry.get("profiling_name", "collective")).split(":", 1)[-1]
            seq = entry.get("collective_seq_id") or "?"
            return (
                f"collective timed out after {_seconds(limit)}: {op} #{seq} on the GPU, issued "
                f"by every rank, has not completed (state: {entry.get('state')}). "
                f"{_advice()}"
            )
    return None


def _op_name(seq: int) -> str | None:
    """The name the flight recorder gives the default group's collective number ``seq``."""
    from nbddp.worker.diagnosis.stacks import flight_entries

    for entry in flight_entries(None):
        if entry.get("collective_seq_id") == seq:
            return str(entry.get("profiling_name", "")).split(":", 1)[-1] or None
    return None


def _advice() -> str:
    told = (
        "the timeout this rank's code asked for"
        if _asked is not None
        else "torch's default timeout for this backend"
    )
    return (
        f"This is {told}; a rank in pdb or at input() holds every collective instead. To wait "
        "longer, pass a longer timeout= to init_process_group (ddp_timeout= for the HF "
        "Trainer, InitProcessGroupKwargs for Accelerate, DDPStrategy(timeout=) for Lightning)."
    )


def _seconds(limit: float) -> str:
    return f"{limit:g} s" if limit < 120 else f"{limit / 60:g} min"


def _tick(limit: float) -> float:
    return min(MAX_TICK, max(MIN_TICK, limit / 10))


def _own_counts() -> dict[str, tuple[tuple[int, ...], int]]:
    """Each process group this rank is a member of: its members and this rank's count."""
    groups = collectives.issued() or ()
    return {g.name: (g.members, g.issued) for g in groups}


def _with_main_traceback(error: BaseException) -> BaseException:
    """``error`` with the main thread's stack as its traceback, from the user's code down:
    where ``fn`` waits (nbddp's frames that called it are left out)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    names = [f.f_code.co_filename for f in frames]
    ours = [name.startswith(PACKAGE_DIR) for name in names]
    # the rank's runtime (below the helper's and the launch script's frames) calls fn
    runtime = next((i for i, n in enumerate(names) if n.startswith(_RANK_RUNTIME)), 0)
    called = next(
        (i + 1 for i in range(runtime, len(frames) - 1) if ours[i] and not ours[i + 1]), 0
    )
    tb: types.TracebackType | None = None
    for each in reversed(frames[called:]):  # innermost first: the outermost ends up first
        tb = types.TracebackType(tb, each, each.f_lasti, each.f_lineno or 0)
    return error.with_traceback(tb)
