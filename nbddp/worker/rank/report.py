"""Describe a rank's failure so the kernel can raise it well: type, message, the user's
traceback (without nbddp's own frames), and the exception itself when it pickles.

Any exception object must survive this, however broken: one whose ``__str__`` or ``__repr__``
raises still gets its type, its traceback and a placeholder message.
"""

from __future__ import annotations

import sys
import time
import traceback
import types

from nbddp.wire import payload
from nbddp.wire.frames import Connection
from nbddp.wire.messages import Bars, BarSnapshot, Block, ErrorReport, MainRows, Rows
from nbddp.worker import PACKAGE_DIR
from nbddp.worker.debugging import debugger
from nbddp.worker.diagnosis import collective_watch

_exit: tuple[BaseException, int] | None = None  # the exit code a script's failure has


def note_exit(exc: BaseException, code: int) -> None:
    """``exc`` ends a script with exit code ``code`` (``worker/rank/scripts.py``): its report says
    so. A function's failure has none of its own."""
    global _exit
    _exit = (exc, code)


def error_report(exc: BaseException) -> ErrorReport:
    """The rank's failure as the kernel gets it, stamped when it was raised: a post-mortem
    pdb that held it for minutes does not make a peer's later failure look first."""
    collective_watch.disarm()  # the job's code is over: nothing of it can time out now
    try:
        original: bytes | None = payload.dumps_exception(exc)
    except BaseException:
        original = None  # the kernel still gets its type name and traceback
    cls = type(exc)
    return ErrorReport(
        exc_type=cls.__name__,
        message=message_of(exc),
        traceback=format_user_traceback(exc),
        exception=original,
        time=debugger.failed_at(exc) or time.time(),
        mro=tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__),
        module=cls.__module__,
        hint=hint_for(exc),
        exitcode=_exit[1] if _exit is not None and _exit[0] is exc else None,
    )


_NO_GPU_HERE = (
    "This rank runs on the CPU (this launch's gloo ranks have no GPU), and this line asks for "
    "a GPU: "
)
_OR_ON_GPUS = "; or launch with device='cuda' on a machine with GPUs."
_CUDA_HINT = (
    _NO_GPU_HERE + "leave torch.cuda.set_device(...) out and move models and tensors to "
    "nbddp.device() instead of a GPU index (.to(rank), .cuda(), device=rank)" + _OR_ON_GPUS
)
_DEVICE_IDS_HINT = (
    _NO_GPU_HERE + "DDP(..., device_ids=[...]) is for a model on a GPU. Wrap it as DDP(model), "
    "without device_ids (or nbddp.prepare_model(model))" + _OR_ON_GPUS
)


def hint_for(exc: BaseException) -> str:
    """nbddp's word on a failure it recognises by where it happened, never by its message:
    a GPU-only line (``torch.cuda.set_device(rank)``, ``.to(rank)``, ``DDP(device_ids=...)``,
    the PyTorch tutorial's) in a process that has no GPU."""
    torch = sys.modules.get("torch")
    try:
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        cuda_asked = any((_module(f) + ".").startswith("torch.cuda.") for f in frames)
        device_ids = any(
            _module(f) == "torch.nn.parallel.distributed"
            and f.f_code.co_name == "__init__"
            and f.f_locals.get("device_ids")
            for f in frames
        )
        if not (cuda_asked or device_ids) or torch is None or torch.cuda.is_available():
            return ""
    except Exception:  # a hint must never hide the error itself
        return ""
    return _CUDA_HINT if cuda_asked else _DEVICE_IDS_HINT


def _module(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when that raises."""
    try:
        return str(exc)
    except BaseException as failure:
        return f"<str() of this {type(exc).__name__} raised {type(failure).__name__}>"


def format_user_traceback(exc: BaseException) -> str:
    """The traceback from the user's own code down: nbddp's frames above it are noise, and so
    is a frame that asks to be hidden (``__tracebackhide__``, as IPython reads it: nbddp's
    answer to the user's ``init_process_group``, which raises at the user's call)."""
    try:
        te = traceback.TracebackException.from_exception(exc)
        frames = list(te.stack)
        first_user = next(
            (i for i, frame in enumerate(frames) if not frame.filename.startswith(PACKAGE_DIR)), 0
        )
        hidden = _hidden(exc, len(frames))
        kept = [f for i, f in enumerate(frames) if i >= first_user and i not in hidden]
        te.stack = traceback.StackSummary.from_list(kept)
        return "".join(te.format())
    except BaseException:  # a broken __str__ breaks the last line: format it by hand
        lines = traceback.format_tb(exc.__traceback__)
        return "".join(
            [
                "Traceback (most recent call last):\n",
                *lines,
                f"{type(exc).__name__}: {message_of(exc)}\n",
            ]
        )


def _hidden(exc: BaseException, count: int) -> set[int]:
    """Which of the traceback's ``count`` frames set ``__tracebackhide__``."""
    entries = list(traceback.walk_tb(exc.__traceback__))
    if len(entries) != count:  # not the frames TracebackException saw: hide nothing
        return set()
    return {i for i, (frame, _) in enumerate(entries) if frame.f_locals.get("__tracebackhide__")}


class ChannelSink:
    """``nbddp.log`` rows and progress bars, to the kernel."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self._conn = conn
        self._rank = rank

    def rows(self, first: int, blocks: list[Block]) -> None:
        self._conn.send(Rows(self._rank, first, blocks))

    def main_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        self._conn.send(MainRows(self._rank, rows))

    def bars(self, bars: list[BarSnapshot]) -> None:
        self._conn.send(Bars(self._rank, bars))
