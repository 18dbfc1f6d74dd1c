"""A rank's runtime: the services around user code, set up in one place for the three hosts
that run it (a launched rank, a session's rank and the kernel's one-rank run), so that each
host keeps only its own concern: a launch's one call and its result, a session's task loop,
the kernel's thread and its aborts.

Once per rank process (:class:`RankProcess`; the kernel installs none of it, it is the kernel's
own): the user's ``init_process_group`` answered from nbddp's group (``world.intercept``, before
any job is unpickled), the notebook's paths and logging, notebook classes in the rank's own
worker processes, its device (named to the kernel by rank 0), the libraries hooked into the
panel (before unpickling, so what the job refers to resolves to the hooked functions), Slurm's
signal asking for a graceful stop, and, once the group exists, torch's import-time finalizers
left out of the exit.

Per call (a launch's one call, each session task, the kernel's one rank), entered in this order
by :meth:`RankRuntime.call` and undone in reverse by one ``ExitStack``:

1. the notebook's cell sources, so that tracebacks show notebook lines (kept: later calls add);
2. the stopping agreement (``nbddp.stopping()``);
3. the checkpoint directory and who hears of each checkpoint;
4. the live buffer (``nbddp.log``, ``nbddp.progress``): closed on the way out, so every logged
   row reaches the kernel before the outcome;
5. rich output (``display()``, figures): finished on the way out, before the buffer closes, so
   figures left open reach the cell before the outcome;
6. questions to the person (``input()``, pdb): a rank's link to the kernel's input box, or in
   the kernel the box itself;
7. whose output the libraries' progress bars show (a session's tasks each say theirs);
8. "did DDP happen?" (a launched rank of several);
9. the rank's context (``nbddp.rank()``, ``nbddp.device()``).

The host's body runs inside, and :meth:`Call.run` turns its end into :class:`Ended`: the value,
or the failure's report. The report is taken before post-mortem pdb (``debug=True``) holds the
rank, so that the kernel's root cause stays this rank's error, not a peer's later timeout.

Non-goal: what a host does with the outcome (a launch's result and exit, a session's answer and
names, the kernel's ``Outcome``), and the process group, which each host joins its own way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any, NamedTuple

from nbddp.wire import payload
from nbddp.wire.frames import Connection
from nbddp.wire.messages import ErrorReport, Joined
from nbddp.wire.spec import JobSpec
from nbddp.wire.stopping import Checkpointed, StopRequested
from nbddp.worker import live
from nbddp.worker.context import Context, installed
from nbddp.worker.debugging import asking, debugger
from nbddp.worker.diagnosis import sync_check
from nbddp.worker.libraries import integrations
from nbddp.worker.output import rich
from nbddp.worker.rank.exiting import skip_import_finalizers
from nbddp.worker.rank.job import prepare
from nbddp.worker.rank.report import ChannelSink, error_report
from nbddp.worker.recovery import checkpoints as checkpointing
from nbddp.worker.recovery import stopping

Send = Callable[[Any], None]


class Checkpoints(NamedTuple):
    """Where a call's ``nbddp.checkpoint`` saves (None: the default outside a launch), how
    many it keeps, and who hears of each complete one."""

    directory: str | None
    keep: int
    notify: checkpointing.Notify | None = None


class Ended(NamedTuple):
    """How a call's body ended: its value, or its failure's report; ``early`` when it left
    with ``sys.exit(0)``."""

    value: Any = None
    failure: ErrorReport | None = None
    early: bool = False


class Call:
    """The services of one call, entered: the live buffer it logs into (a stop of the
    kernel's one rank sets an abort on it from another thread) and the agreement it checks."""

    def __init__(self, buffer: live.LiveBuffer, agreement: stopping.Agreement) -> None:
        self.buffer = buffer
        self.agreement = agreement

    @staticmethod
    def run(body: Callable[[], Any]) -> Ended:
        """``body()``, its failure described before post-mortem pdb (``debug=True``) may hold
        this rank at the frame that raised; ``sys.exit(0)`` is a success."""
        try:
            return Ended(body())
        except SystemExit as exc:
            if exc.code in (None, 0):
                return Ended(early=True)
            return Ended(failure=error_report(exc))
        except BaseException as exc:
            failure = error_report(exc)
            debugger.post_mortem(exc)
            return Ended(failure=failure)


class RankRuntime:
    """The per-call services of one host. ``sink`` takes the live buffer's rows and bars;
    ``send`` is a rank's channel (rich output and questions travel on it), None in the kernel,
    which shows rich output itself and asks its own input box (``asks`` of :meth:`call`)."""

    def __init__(self, rank: int, sink: live.LiveSink, send: Send | None = None) -> None:
        self.rank = rank
        self.sink = sink
        self.send = send

    @contextlib.contextmanager
    def call(
        self,
        agreement: stopping.Agreement,
        checkpoints: Checkpoints,
        *,
        sources: dict[str, tuple[Any, ...]] | None = None,
        output: str = "rank0",
        world_size: int = 1,
        task: int = 0,
        debug: bool = False,
        asks: contextlib.AbstractContextManager[Any] | None = None,
        checked: bool = False,
        context: Context | None = None,
    ) -> Iterator[Call]:
        """The per-call services, in the module's order, undone in reverse on the way out
        (what each replaced is put back: a launch nested in the kernel's one rank)."""
        with ExitStack() as undo:
            if sources is not None:
                payload.install_sources(sources)
            undo.callback(stopping.install, stopping.install(agreement))
            undo.callback(checkpointing.configure, *checkpointing.configure(*checkpoints))
            buffer = live.LiveBuffer(self.sink)
            undo.callback(live.install, live.install(buffer))
            undo.callback(buffer.close)  # every logged row reaches the kernel before the outcome
            if self.send is not None:
                undo.callback(rich.reinstate, rich.configure(self.send, self.rank, output))
                undo.callback(rich.finish)  # figures left open go to the cell, before the outcome
                link = asking.Link(self.send, self.rank, world_size, output, task, debug)
                undo.callback(asking.configure, asking.configure(link))
                undo.callback(integrations.set_output, integrations.set_output(output))
            if asks is not None:
                undo.enter_context(asks)
            if checked:
                sync_check.install()
            if context is not None:
                undo.enter_context(installed(context))
            yield Call(buffer, agreement)


class RankProcess:
    """A launched or session rank's process: its job spec, its channel, and what it installs
    once (the module's "once per rank process")."""

    def __init__(self, spec: JobSpec, rank: int, conn: Connection) -> None:
        self.spec = spec
        self.rank = rank
        self.conn = conn
        self.runtime = RankRuntime(rank, ChannelSink(conn, rank), conn.send)
        self._checkpoint_dir: str | None = spec.checkpoint_dir or None

    def prepare(self, default_checkpoints: str | None = None) -> Context:
        """Before the job is unpickled: the world answered, the notebook's paths and logging,
        the device, the libraries hooked, Slurm's signal; the context to install per call.
        ``default_checkpoints``: where checkpoints go when the plan names no directory
        (relative to the notebook's working directory, adopted here)."""
        context = prepare(self.spec, self.rank, self.conn)
        if self._checkpoint_dir is None and default_checkpoints is not None:
            self._checkpoint_dir = os.path.abspath(default_checkpoints)
        integrations.install(self.spec.output)  # before unpickling: see install()
        stopping.ask_on_signal(self._signalled)
        return context

    def joined(self) -> None:
        """The process group exists: the kernel hears so, and torch's finalizers registered
        until now (by its imports, by joining) are left out of the exit."""
        self.conn.send(Joined(self.rank))
        skip_import_finalizers()

    def checkpoints(self) -> Checkpoints:
        """This rank's checkpoints: the plan's directory (or the default), its ``keep``, and
        the kernel told of each one."""
        return Checkpoints(self._checkpoint_dir, self.spec.keep, self._checkpointed)

    def _checkpointed(
        self, step: int, path: str, seconds: float, restored: bool, by: str = ""
    ) -> None:
        self.conn.send(Checkpointed(self.rank, step, path, seconds, restored, by))

    def _signalled(self) -> None:
        self.conn.send(StopRequested(self.rank, stopping.SIGNALLED))
