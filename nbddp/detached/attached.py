"""A kernel's view of a detached run: the backend of the ``Run`` that ``attach`` returns, and
of the one a detached launch returns.

:class:`Follow` replays the run's record up to the offset its supervisor names, then takes
every later event live from the supervisor's link, until the run's end event; a run that has
ended (or whose supervisor is gone) is replayed from its record alone. ``stop()`` and
``stacks()`` go to the supervisor over the same link; a run detached on Slurm waits for its
batch job first. (``launching.DetachedLaunch`` starts a supervisor, then follows it.)

Non-goal: the supervisor's side (``supervisor.py``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

from nbddp.backend import Finish, Outcome, RunEvents, Writable
from nbddp.detached import info as listing
from nbddp.detached import store
from nbddp.detached.batch import cancel
from nbddp.detached.link import Answer, Attached, Live, StopRun
from nbddp.detached.outcome import Ending, read_outcome
from nbddp.detached.queue import queue_state
from nbddp.detached.records import decode, last_event, read_events
from nbddp.detached.replay import apply, replay, write_quietly
from nbddp.errors import NbddpError
from nbddp.plan import DISPLAYS, LaunchPlan
from nbddp.planning import chosen_display
from nbddp.run import Run, remember
from nbddp.state.terminal import CellStream
from nbddp.wire.frames import Connection
from nbddp.wire.stacks import AskStacks
from nbddp.wire.transport import AuthenticationFailed, connect

CONNECT_WAIT = 10.0  # seconds to attach to a running supervisor
QUEUE_POLL = 1.0  # seconds between looks at a batch job waiting in Slurm's queue
START_POLL = 0.05  # seconds between looks at a supervisor that is starting


class Follow:
    """Follows the detached run kept in ``run`` (a :class:`~nbddp.backend.Backend`)."""

    nodes: tuple[str, ...] = ("localhost",)

    def __init__(self, run: store.StoredRun | None) -> None:
        self.stored = run
        self._conn: Connection | None = None
        self._events: RunEvents | None = None
        self._finish: Finish | None = None
        self._out: Writable = sys.stdout
        self._ended = threading.Event()
        self._cancelled = False  # a queued batch job was cancelled by stop()

    @property
    def id(self) -> str | None:
        return self.stored.id if self.stored is not None else None

    def start(self, events: RunEvents, finish: Finish) -> None:
        assert self.stored is not None
        self._events, self._finish = events, finish
        self._out = events.output or CellStream(sys.stdout)
        self._begin()

    def _begin(self) -> None:
        """Follow the supervisor if it listens; wait for it if it is still starting (or its
        batch job is queued); else (ended, or nobody supervises it any more) the record says
        all."""
        assert self.stored is not None
        attached = self._connect()
        if attached is not None:
            self._follow_from(*attached)
        elif self.stored.supervised():
            threading.Thread(target=self._wait, name="nbddp-waiting", daemon=True).start()
        else:
            self._replay_all()

    def _wait(self) -> None:
        """Until the supervisor listens (it is starting; on Slurm, its job may wait in the
        queue: its state is said when it changes), or nobody supervises the run any more."""
        assert self.stored is not None
        job = self.stored.job_id
        shown = ""
        while not self._ended.is_set():
            attached = self._connect()
            if attached is not None:
                self._follow_from(*attached)
                return
            if not self.stored.supervised():
                self._replay_all()
                return
            if job is not None:
                state, reason = queue_state(job)
                line = f"Slurm job {job} is {state}" + (
                    f" ({reason})" if reason and reason != "None" else ""
                )
                if state and state != "RUNNING" and line != shown:
                    shown = line
                    write_quietly(self._out, f"{line}: the run starts when Slurm runs it.\n")
            # a queue and a starting process have no event to wait on: look again shortly
            self._ended.wait(QUEUE_POLL if job is not None else START_POLL)

    def _replay_all(self) -> None:
        assert self.stored is not None
        seen = (event for event, _ in read_events(self.stored.join(store.LOG)))
        self._replayed(seen, final=True)

    def _connect(self) -> tuple[Connection, int] | None:
        assert self.stored is not None
        supervisor = self.stored.supervisor()
        if supervisor is None or not self.stored.supervised():
            return None
        try:
            conn = connect(str(supervisor["address"]), self.stored.key(), timeout=CONNECT_WAIT)
        except (OSError, EOFError, AuthenticationFailed):
            return None  # it ended meanwhile
        try:
            reply = conn.recv(timeout=CONNECT_WAIT).message
        except (OSError, EOFError):
            conn.close()
            return None
        if not isinstance(reply, Attached):
            conn.close()
            return None
        return conn, reply.offset

    def _follow_from(self, conn: Connection, offset: int) -> None:
        """Replay the record up to ``offset``; a thread takes the rest from ``conn``."""
        assert self.stored is not None
        self._conn = conn
        seen = (event for event, _ in read_events(self.stored.join(store.LOG), end=offset))
        if self._replayed(seen, final=False):
            return
        threading.Thread(target=self._follow, name="nbddp-follow", daemon=True).start()

    def _replayed(self, seen: Any, final: bool) -> bool:
        """Replay; True when the run's end was among the events (it is then finished)."""
        assert self.stored is not None and self._events is not None
        ending = replay(seen, self._events, self._out, self.stored.path)
        if ending is not None:
            self._end(ending)
            return True
        if final:
            self._lost()
            return True
        return False

    def _follow(self) -> None:
        assert self._conn is not None and self._events is not None
        try:
            while True:
                message = self._conn.recv().message
                if isinstance(message, Live):
                    event = decode(message.body)
                    if event is None:
                        continue
                    ending = apply(event, self._events, self._out)
                    if ending is not None:
                        self._end(ending)
                        return
                elif isinstance(message, Answer):
                    self._events.stacks(message.rank, message.query, message.report)
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug of ours must still end the view
            self._finished(
                Outcome("failed", error=NbddpError(f"following the run failed: {exc!r}"))
            )
            return
        finally:
            self._close()
        # the link broke without the end: the supervisor may have recorded it just before
        assert self.stored is not None
        event = last_event(self.stored.join(store.LOG), "end")
        if event is not None and isinstance(event.args[0], Ending):
            self._end(event.args[0])
        else:
            self._lost()

    def _end(self, ending: Ending) -> None:
        assert self.stored is not None
        self._finished(read_outcome(self.stored.path, ending)._replace(duration=ending.duration))

    def _lost(self) -> None:
        assert self.stored is not None
        if self._cancelled:
            self._finished(Outcome("stopped"))
            return
        job = self.stored.job_id
        how = f"Slurm job {job}" if job is not None else "it was killed, or its machine went down"
        self._finished(
            Outcome(
                "failed",
                error=NbddpError(
                    f"the supervisor of detached run {self.stored.id} ended without recording "
                    f"the run's end ({how}): its ranks ended with it. What it recorded is in "
                    f"{self.stored.path} (its own messages in supervisor.log)."
                ),
            )
        )

    def _finished(self, outcome: Outcome) -> None:
        if self._ended.is_set():
            return
        self._ended.set()
        self._close()
        if self._finish is not None:
            self._finish(outcome)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _send(self, message: Any) -> None:
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(message)

    def stop_gracefully(self, why: str) -> None:
        """Ask the supervisor for a graceful stop (a batch job still queued is cancelled)."""
        if self._conn is not None:
            self._send(StopRun(graceful=True, why=why))
            return
        self.stop()

    def stop(self) -> None:
        """Ask the supervisor to stop the run; a batch job still queued is cancelled."""
        if self._conn is not None:
            self._send(StopRun())
            return
        job = self.stored.job_id if self.stored is not None else None
        if job is not None and not self._ended.is_set():
            self._cancelled = True
            cancel(job)
            assert self.stored is not None
            if self._connect() is None:  # it never ran: the listing says stopped
                store.write_json(
                    self.stored.join(store.STATUS),
                    {"status": "stopped", "ended": True, "updated": time.time()},
                )

    def ask(self, message: AskStacks) -> None:
        self._send(message)

    def tell(self, message: Any) -> None:
        """Nothing reaches a detached run's ranks from a kernel but a stop and a roll-call:
        its supervisor refuses their prompts itself (``recorder.NO_INPUT``)."""

    def forget(self) -> None:
        """Delete the run's kept output and result (the run must have ended)."""
        if self.stored is not None:
            listing.forget(self.stored.id)


def attach(run_id: str, *, display: str = "auto") -> Run:
    """A ``nbddp.Run`` following your detached run ``run_id`` (see ``nbddp.runs()``):
    its live view shows everything so far, then goes on live; ``wait()``, ``result()``,
    ``stop()``, ``stacks()`` work as for a run launched here. Several kernels may attach to
    one run at once. ValueError for an id that is not one of your runs."""
    if display not in DISPLAYS:
        raise ValueError(f"display={display!r} is not one of {', '.join(map(repr, DISPLAYS))}.")
    stored = store.find(run_id)
    info = stored.info
    device = str(info.get("device", "cpu"))
    plan = LaunchPlan(
        world_size=int(info.get("world_size", 1)),
        device="cuda" if device == "cuda" else "cpu",
        backend="nccl" if info.get("backend") == "nccl" else "gloo",
        display=chosen_display(display),  # type: ignore[arg-type]
        output=info.get("output", "rank0"),
        block=False,
        stall_after=info.get("stall_after"),
        detach=True,
    )
    run = Run(plan, Follow(stored), "cpu" if device == "cpu" else "GPU", info.get("started"))
    remember(run)
    run.start()
    return run
