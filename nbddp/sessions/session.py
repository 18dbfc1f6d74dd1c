"""``nbddp.Session``: ranks that stay up between cells, each keeping a namespace of its own.

A launch gives every call fresh processes; a session starts its ranks once (process group
joined) and runs each ``session.run(fn)`` or ``%%ddp --session`` cell on them, so a model
loaded in one cell is trained in the next and evaluated in a third without ever leaving the
ranks. Results, errors, the live panel, Stop and timeouts are a launch's. What differs is
what a failure leaves behind: when every rank came back to idle with its process groups in
step, the session and its state survive; ranks that do not come back within ``GRACE`` seconds
(stuck in a collective waiting for a peer that failed), a rank that died, or ranks that came
back having issued different numbers of collectives (an interrupt landed inside one) are
replaced by fresh ones, and the user is told that the state on the ranks is lost.

The ranks are processes even with one rank (the namespace is theirs, not the notebook's). On a
Ray cluster (``cluster=``, or ``nbddp.set_cluster``) each node's helper keeps its ranks up for
the session, and tasks reach them through it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbddp.errors import NbddpError, WorkerError
from nbddp.errors.notices import warn_user
from nbddp.launch import check_call
from nbddp.plan import STALL_AFTER, LaunchPlan
from nbddp.planning import make_plan, with_run_options
from nbddp.recovery import STOP_GRACE
from nbddp.rules.task_referee import restart_cause, restart_note, trigger
from nbddp.run import Run, remember
from nbddp.sessions.ranks import SessionRanks
from nbddp.sessions.scripting import ScriptRuns
from nbddp.sessions.shipping import without_names
from nbddp.sessions.status import SessionStatus, session_status
from nbddp.sessions.task import SessionTask
from nbddp.wire.call import Call, dumps_call

_current: Session | None = None


def current() -> Session | None:
    """The session ``%ddp_session start`` made (used by ``%%ddp --session``)."""
    return _current


def set_current(session: Session | None) -> None:
    global _current
    _current = session


class Session(ScriptRuns):
    """Ranks that stay up between cells, each with a namespace of its own.

    ``session.run(fn, ...)`` has ``notebook_launch``'s semantics, and ``fn`` runs with the
    rank's session namespace as its globals: a global it reads resolves there first, then is
    shipped from the notebook; a global it assigns stays for later runs and cells.
    ``with nbddp.Session(...) as session:`` or ``session.close()`` ends the ranks (so do the
    kernel's exit and garbage collection). The options are [nbddp.notebook_launch][]'s, with
    the same meaning. The ranks start here, before the first task.
    """

    def __init__(
        self,
        num_workers: int | str = "auto",
        device: str = "auto",
        backend: str | None = None,
        gpus: Sequence[int | str] | None = None,
        env: Mapping[str, str] | None = None,
        cluster: Any = None,
        nodes: int | str = "auto",
        workers_per_node: int | str = "auto",
    ) -> None:
        plan = make_plan(
            num_workers=num_workers,
            device=device,
            backend=backend,
            gpus=gpus,
            env=env,
            cluster=cluster,
            nodes=nodes,
            workers_per_node=workers_per_node,
        )
        self._plan = plan
        self.world_size = plan.world_size
        """How many ranks the session has."""
        self.device = plan.device
        """Where the ranks train: "cuda" or "cpu"."""
        self.backend = plan.backend
        """The process group's backend: "nccl" or "gloo"."""
        self._holder: list[SessionRanks | None] = [None]  # what the finalizer ends
        self._closed = False
        self._active: Run | None = None
        self._restarted: str | None = None  # when and why the session last replaced its ranks
        # at kernel exit, or when the session is garbage: its ranks end
        self._finalizer = weakref.finalize(self, _close, self._holder)
        self._start_ranks()

    # -- state ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The ranks are up (idle or running a task)."""
        ranks = self._holder[0]
        return not self._closed and ranks is not None and ranks.alive

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines' addresses, in node-rank order (``("localhost",)`` on this one)."""
        ranks = self._holder[0]
        return ranks.nodes if ranks is not None else ()

    @property
    def names(self) -> frozenset[str]:
        """The names rank 0's namespace holds (as of the last task)."""
        ranks = self._holder[0]
        return ranks.names if ranks is not None else frozenset()

    def status(self) -> SessionStatus:
        """One row per rank: ``rank``, ``pid``, ``alive``, ``busy`` (None: no answer within
        2 s), ``memory`` (resident bytes), ``device_memory`` (bytes PyTorch reserved on
        its GPU; None on the CPU), ``restarted`` (when and why the session last replaced its
        ranks after a task: stuck, died, or collectives out of step; None if never) and
        ``where`` (the rank's place in a running task, else None). ``.stacks`` is the running
        task's roll-call ([nbddp.Stacks][]), or None."""
        return session_status(self.world_size, self._holder[0], self._active, self._restarted)

    # -- runs ----------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        return_all: bool = False,
        block: bool = True,
        display: str = "auto",
        output: str = "rank0",
        stall_after: float | None = STALL_AFTER,
        debug: bool = False,
        stop_grace: float = STOP_GRACE,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on every rank, in the session's namespace.

        ``fn`` runs with the rank's namespace as its globals: a global it reads resolves
        there first, then is shipped from the notebook; a ``global`` it assigns stays on the
        rank for later runs and ``%%ddp --session`` cells. The options are
        [nbddp.notebook_launch][]'s, with the same meaning. A task that checks
        [nbddp.stopping][] (or [nbddp.progress][]) stops gracefully, as a launch does: every
        rank returns at one step, the ranks keep their state, and its value is the result.

        Returns:
            Rank 0's value (every rank's with ``return_all``; a running [nbddp.Run][] with
                ``block=False``).

        Raises:
            nbddp.WorkerError: A rank raised. When every rank came back to idle, the session
                and its state survive; otherwise its ranks are restarted, and it says so.
        """
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        check_call(fn, args, kwargs)
        plan = self._options(
            timeout, display, output, return_all, block, stall_after, debug, stop_grace
        )
        ranks = self._ready_ranks()
        call = dumps_call(
            without_names(fn, ranks.names),
            tuple(args),
            dict(kwargs or {}),
            segment=self._plan.cluster is None,  # on a cluster, Ray's object store carries them
            random=ranks.first_call(),
        )
        return self._run("function", call, plan, ranks)

    def run_cell(
        self,
        source: str,
        filename: str,
        inputs: dict[str, Any],
        out_names: tuple[str, ...],
        show_last: bool,
        deletes: frozenset[str],
        **options: Any,
    ) -> Any:
        """A ``%%ddp --session`` cell (see ``worker/rank/cell.py``): its CellOutcome."""
        __tracebackhide__ = True
        from nbddp.worker.rank.cell import run_cell

        plan = self._options(
            options.get("timeout"),
            options.get("display", "auto"),
            options.get("output", "rank0"),
            False,
            True,
            options.get("stall_after", STALL_AFTER),
            options.get("debug", False),
            options.get("stop_grace", STOP_GRACE),
        )
        ranks = self._ready_ranks()
        cell_args = (source, filename, inputs, out_names, show_last, deletes)
        segment, random = self._plan.cluster is None, ranks.first_call()
        call = dumps_call(run_cell, cell_args, {}, names=inputs, segment=segment, random=random)
        return self._run("cell", call, plan, ranks)

    def pull(self, *names: str) -> dict[str, Any]:
        """Copy names from rank 0's namespace into the notebook's hands (a dict)."""
        __tracebackhide__ = True
        ranks = self._ready_ranks()
        missing = [n for n in names if n not in ranks.names]
        if missing:
            held = ", ".join(sorted(ranks.names)) or "nothing yet"
            raise NameError(
                f"rank 0 of the session has no {', '.join(map(repr, missing))} (it holds: {held})."
            )
        outcome = self.run_cell("", "<pull>", {}, tuple(names), False, frozenset(), display="none")
        if outcome.skipped:
            detail = "; ".join(
                f"{path} cannot be pickled ({reason})" for path, reason in outcome.skipped.values()
            )
            raise NbddpError(f"could not bring back {detail}.")
        return dict(outcome.values)

    def _options(
        self,
        timeout: Any,
        display: Any,
        output: Any,
        return_all: Any,
        block: Any,
        stall_after: Any = STALL_AFTER,
        debug: Any = False,
        stop_grace: Any = STOP_GRACE,
    ) -> LaunchPlan:
        return with_run_options(
            self._plan,
            timeout=timeout,
            display=display,
            output=output,
            return_all=return_all,
            block=block,
            stall_after=stall_after,
            debug=debug,
            stop_grace=stop_grace,
        )

    def _run(self, kind: str, call: Call, plan: LaunchPlan, ranks: SessionRanks) -> Any:
        __tracebackhide__ = True
        task = SessionTask(ranks, kind, call, plan)
        run = Run(plan, task, ranks.device_name)
        remember(run)
        self._active = run

        def ended(why: str | None) -> None:  # the ranks a task lost are replaced at once
            if why is not None:
                self._replace_if_lost(task, why)
            elif task.verdict is not None:
                self._replace_if_lost(task, trigger(task.verdict.outcome))

        return run.drive(plan.block, ended)

    # -- the ranks' life -----------------------------------------------------------------------

    def _start_ranks(self) -> SessionRanks:
        ranks = SessionRanks(self._plan)
        self._holder[0] = ranks
        ranks.start()
        return ranks

    def _ready_ranks(self) -> SessionRanks:
        """The ranks, up and idle: fresh ones (with a warning) if they had ended."""
        if self._closed:
            raise NbddpError("this session is closed: start a new one with nbddp.Session(...).")
        if self._active is not None and self._active.status == "running":
            raise NbddpError(
                "the session is still running a task (started with block=False): wait for "
                "it with run.wait(), or stop it with run.stop(), then run the next one."
            )
        ranks = self._holder[0]
        if ranks is not None and ranks.alive:
            return ranks
        why = (ranks.ended if ranks is not None else None) or "they never started"
        if ranks is not None and ranks.failure is not None:  # our bug: show where it was
            import traceback

            cause = ranks.failure.__cause__
            assert cause is not None
            why += "\n" + "".join(traceback.format_exception(cause)).rstrip()
        warn_user(
            f"the session's ranks had ended ({why}): starting fresh ranks; the state "
            "they held is lost."
        )
        self._restarted = f"at {time.strftime('%H:%M:%S')}: the ranks had ended ({why})"
        return self._start_ranks()

    def _replace_if_lost(self, task: SessionTask, what: str) -> None:
        """After a blocking task whose ranks were ended: fresh ranks now, and say so."""
        verdict = task.verdict
        if verdict is None or not verdict.lost:
            return
        if not (
            verdict.outcome.error is not None and isinstance(verdict.outcome.error, WorkerError)
        ):
            warn_user(restart_note(verdict, what))  # a WorkerError carries it in its message
        self._restarted = f"at {time.strftime('%H:%M:%S')}: {restart_cause(verdict, what)}"
        try:
            self._start_ranks()
        except Exception as exc:
            warn_user(f"fresh ranks could not start ({exc}); session.restart() tries again.")

    def restart(self) -> None:
        """End the ranks and start fresh ones (their state is lost)."""
        self._end_ranks()
        self._closed = False
        self._restarted = None  # the user's own restart: nothing to explain
        self._start_ranks()

    def close(self) -> None:
        """End the ranks; nothing is left running. Idempotent."""
        self._closed = True
        self._end_ranks()
        if current() is self:
            set_current(None)

    def _end_ranks(self) -> None:
        if self._active is not None and self._active.status == "running":
            self._active.stop()
        _close(self._holder)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("alive" if self.alive else "ranks ended")
        plan = self._plan
        where = f"{self.world_size} × {self.device}"
        if plan.cluster is not None:
            where = f"{plan.nodes} nodes × {plan.workers_per_node} {self.device}"
        return f"<nbddp.Session {where} ({self.backend}), {state}>"


def _close(holder: list[SessionRanks | None]) -> None:
    ranks, holder[0] = holder[0], None
    if ranks is not None:
        ranks.close()
