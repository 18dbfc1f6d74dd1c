"""A rank that ended normally leaves as a Python program does: its exit work runs, bounded,
then ``os._exit``.

A normal interpreter exit joins the non-daemon threads (``concurrent.futures`` pools end
there), runs the ``atexit`` handlers (``logging.shutdown`` flushes buffered handlers,
``multiprocessing`` ends its children, W&B and MLflow finish their runs, ``tempfile`` cleans
up, and the user's own run) and leaves its child processes to end by themselves. A rank that
sent its result does the same, then sends SIGTERM to the processes it started that still run
and waits for them: all of it within ``timeout`` seconds (``JobSpec.exit_timeout``). At the
bound, a handler still running is cut short and what still runs is killed. Either way the
rank leaves with ``os._exit``, as it always did: Python's own finalization (module teardown,
NCCL's and CUDA's destructors) never runs, so nothing can hang the exit past the bound.

What went wrong (a handler that raised, one cut at the bound, a process that had to be
killed) reaches the kernel as one ``ExitReport``, which warns in the notebook.

Non-goals: the failure paths (a rank that raised is ended at once, and one that is stopped,
timed out or interrupted is ended by the kernel: none of this runs there); and the finalizers
torch registers while it is imported (its operator registry's teardown, ~6 ms for ~150 of
them), which free only this process's memory: :func:`skip_import_finalizers` drops them from
the exit before ``fn`` runs.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any, NoReturn

from nbddp.wire.frames import Connection
from nbddp.wire.messages import ExitReport
from nbddp.worker.reaping import end_descendants, process_table, signal_each
from nbddp.worker.streams import flush_output

_MARGIN = 0.5  # seconds past the bound before the watchdog acts: the main thread goes first
_WEAKREF_FILE = weakref.__file__


def skip_import_finalizers() -> None:
    """Leave torch's own finalizers registered so far out of the exit (the module's note)."""
    registry: dict[Any, Any] = getattr(weakref.finalize, "_registry", {})
    for finalizer, info in list(registry.items()):
        if (getattr(info.func, "__module__", None) or "").startswith("torch"):
            finalizer.atexit = False


def exit_normally(conn: Connection, rank: int, timeout: float) -> NoReturn:
    """Run the rank's exit work within ``timeout`` seconds, report what went wrong, and
    ``os._exit(0)``. Called on the main thread, after the rank's result was sent."""
    _Exit(conn, rank, timeout).run()


class _Exit:
    def __init__(self, conn: Connection, rank: int, timeout: float) -> None:
        self.conn = conn
        self.rank = rank
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.problems: list[str] = []
        self.stage = "threads"
        self.main = threading.get_ident()
        self.leaving = threading.Lock()
        self._unraisable = sys.unraisablehook
        self._excepthook = sys.excepthook

    def run(self) -> NoReturn:
        # not threading.Thread: its start() waits until the new thread runs (ms under load)
        _thread.start_new_thread(self._watch, ())
        # What the interpreter's exit runs first: threading's exit callbacks (executors join
        # their workers), then it waits for the non-daemon threads.
        threading._shutdown()  # type: ignore[attr-defined]
        self.stage = "handlers"
        self._run_handlers()
        flush_output()
        self.stage = "processes"
        self._end_processes()
        self._leave()

    # -- the exit handlers -----------------------------------------------------------------

    def _run_handlers(self) -> None:
        """``atexit``'s handlers, last registered first; the ones that raise are noted (and
        their tracebacks printed, as Python does)."""
        sys.unraisablehook = self._on_unraisable  # how atexit reports a handler that raised
        sys.excepthook = self._on_finalizer_error  # how weakref.finalize reports one
        try:
            atexit._run_exitfuncs()
        finally:
            sys.unraisablehook, sys.excepthook = self._unraisable, self._excepthook

    def _on_unraisable(self, unraisable: Any) -> None:
        if "atexit" in (unraisable.err_msg or ""):
            error = _exception_line(unraisable.exc_type, unraisable.exc_value)
            self.problems.append(f"the exit handler {_name(unraisable.object)} raised {error}")
        self._unraisable(unraisable)

    def _on_finalizer_error(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        frames = [frame for frame, _ in _walk(tb)]
        error = _exception_line(kind, value)
        self.problems.append(f"the exit finalizer {_handler_of(frames)} raised {error}")
        self._excepthook(kind, value, tb)

    # -- the processes it started ------------------------------------------------------------

    def _end_processes(self) -> None:
        """SIGTERM to every process this rank started that still runs; wait for them until
        the bound; kill what is left."""
        _stop_multiprocessing_helpers()
        try:  # the common case, cheaply: no child at all, so no descendant either
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        me = os.getpid()
        asked: set[int] = set()
        pause = 0.005
        while True:
            left = process_table().descendants([me])
            if not left:
                return
            signal_each(left - asked, signal.SIGTERM)  # and what they started meanwhile
            asked |= left
            if time.monotonic() >= self.deadline:
                break
            time.sleep(min(pause, max(0.0, self.deadline - time.monotonic())))
            pause = min(pause * 2, 0.1)
        self.problems.append(
            f"{_describe(left)} did not end within the {self.timeout:g} s after SIGTERM "
            "(NBDDP_EXIT_TIMEOUT): killed"
        )
        end_descendants()

    # -- the bound ---------------------------------------------------------------------------

    def _watch(self) -> None:
        """At the bound, cut the exit work short: say what was still running, end it all."""
        time.sleep(max(0.0, self.deadline + _MARGIN - time.monotonic()))
        frames = [f for f, _ in _walk_frames(sys._current_frames().get(self.main))]
        bound = f"within {self.timeout:g} s (NBDDP_EXIT_TIMEOUT)"
        if self.stage == "threads":
            names = [t.name for t in threading.enumerate() if not t.daemon and t.ident != self.main]
            self.problems.append(
                f"thread {', '.join(names) or '?'} (not a daemon) did not end {bound}: the rank "
                "ended without waiting longer, and without running its exit handlers"
            )
        elif self.stage == "handlers":
            self.problems.append(
                f"the exit handler {_handler_of(frames, waiting=True)} did not return {bound}: "
                "it was cut short, and the handlers after it did not run"
            )
        else:
            self.problems.append(f"ending the processes it started did not finish {bound}")
        left = process_table().descendants([os.getpid()])
        if left:
            self.problems.append(f"{_describe(left)} still ran at the bound: killed")
        self._leave()

    def _leave(self) -> NoReturn:
        """The end, by whichever thread comes first (the other one waits here for it)."""
        self.leaving.acquire()
        end_descendants()
        if self.problems:
            with contextlib.suppress(OSError):
                self.conn.send(ExitReport(self.rank, tuple(self.problems)))
        flush_output()
        os._exit(0)


def _stop_multiprocessing_helpers() -> None:
    """multiprocessing's resource tracker and forkserver ignore SIGTERM and end when their
    pipe from us closes, which at a normal exit happens by itself: close it the way they
    expect (their own ``_stop``), so they do not wait out the bound."""
    for module, name in (
        ("multiprocessing.resource_tracker", "_resource_tracker"),
        ("multiprocessing.forkserver", "_forkserver"),
    ):
        stop = getattr(getattr(sys.modules.get(module), name, None), "_stop", None)
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()


def _walk(tb: TracebackType | None) -> Iterable[tuple[FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _walk_frames(frame: FrameType | None) -> list[tuple[FrameType, int]]:
    """A thread's frames, outermost first."""
    frames = []
    while frame is not None:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


def _handler_of(frames: list[FrameType], waiting: bool = False) -> str:
    """The handler running in ``frames`` (outermost first): the first frame past
    ``_run_handlers`` and weakref's own (a finalizer's caller); with ``waiting``, also where it
    waits when that is deeper (``..._exit_function (waiting in ...Popen.wait)``)."""
    run_handlers = _Exit._run_handlers.__code__
    codes = [f.f_code for f in frames]
    start = codes.index(run_handlers) + 1 if run_handlers in codes else 0
    for frame in frames[start:]:
        if frame.f_code.co_filename != _WEAKREF_FILE:
            if not waiting or frame is frames[-1]:
                return _frame_name(frame)
            return f"{_frame_name(frame)} (waiting in {_frame_name(frames[-1])})"
    return "(unknown)"


def _frame_name(frame: FrameType) -> str:
    module = frame.f_globals.get("__name__")
    qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # 3.11+
    return qualname if module in (None, "__main__") else f"{module}.{qualname}"


def _name(handler: Any) -> str:
    qualname = getattr(handler, "__qualname__", None)
    if qualname is None:
        return repr(handler)
    module = getattr(handler, "__module__", None)
    return qualname if module in (None, "__main__") else f"{module}.{qualname}"


def _exception_line(kind: type[BaseException] | None, value: BaseException | None) -> str:
    name = kind.__name__ if kind is not None else "an exception"
    try:
        text = str(value).strip().splitlines()
    except Exception:
        text = []
    return f"{name}: {text[0]}" if text else name


def _describe(pids: set[int]) -> str:
    """``process wandb-core (pid 12)``, ``processes a (pid 1), b (pid 2)``."""
    named = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/comm") as f:
                named.append(f"{f.read().strip()} (pid {pid})")
        except OSError:
            named.append(f"pid {pid}")
    return ("process " if len(named) == 1 else "processes ") + ", ".join(named)
