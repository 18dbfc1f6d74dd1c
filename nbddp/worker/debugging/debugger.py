"""pdb on a rank, its prompt the notebook's input box: ``breakpoint()``, ``pdb.set_trace()``,
``torch.distributed.breakpoint()``, ``nbddp.breakpoint(rank=...)`` and, with ``debug=True``,
post-mortem at the frame that raised.

Each opens :class:`~nbddp.worker.debugging.rank_pdb.RankPdb` (its prompt ``(Pdb rank 1)``). Leaving
it (``c``) is told to the kernel, which releases the ranks held at the same ``nbddp.breakpoint()``;
``q`` asks the kernel to stop the run, and the rank waits to be ended with the others, so no rank
is left waiting in a collective (pytorch #154563). Where the kernel says there is no input box, the
breakpoint is skipped (the kernel warns, naming the rank and the line).

Nothing runs per step, and nothing is imported until a rank stops: the hooks act only when
user code calls them.

Non-goal: how the kernel asks the person (``nbddp/diagnosis/prompts.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from types import FrameType, ModuleType, TracebackType
from typing import Any

from nbddp.worker import PACKAGE_DIR
from nbddp.worker.debugging import asking
from nbddp.worker.debugging.asking import Link


def stop_here(link: Link, frame: FrameType, release: int = 0, header: str | None = None) -> None:
    """pdb in ``frame``, at its next line (or the breakpoint skipped: no input box)."""
    if link.refused:
        if release:
            link.left_pdb(release)
        return
    from nbddp.worker.debugging.rank_pdb import RankPdb

    debugger = RankPdb(link, "pdb", release, origin=asking.where(frame))
    if header is not None:
        debugger.message(header)  # shown with the first prompt
    debugger.set_trace(frame)


def breakpoint(rank: int = 0) -> None:
    """pdb on rank ``rank`` only, at the line after this call; every other rank waits here,
    in no collective (nothing times out), until that rank continues (``c``). Every rank must
    reach the call. Outside a launch, pdb as ``breakpoint()`` opens it (on rank 0)."""
    _breakpoint(rank, sys._getframe(1))


def _breakpoint(rank: int, frame: FrameType) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"nbddp.breakpoint(rank={rank!r}): rank must be an int.")
    link = asking.current()
    if link is None:
        from nbddp.worker.context import rank as own_rank

        if rank == own_rank():
            _kernel_pdb().set_trace(frame)
        return
    if not 0 <= rank < link.world_size:
        raise ValueError(
            f"nbddp.breakpoint(rank={rank}): this run's ranks are 0 to {link.world_size - 1}."
        )
    link.calls += 1
    if link.rank == rank:
        stop_here(link, frame, release=link.calls)
    else:
        link.wait_release(link.calls)


def _from_user_code(error: BaseException) -> TracebackType | None:
    """``error``'s traceback from the user's first frame: nbddp's are not theirs."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        traceback = traceback.tb_next
    return traceback


_failed_at: dict[int, tuple[BaseException, float]] = {}  # by id (exceptions take no weakref)


def failed_at(error: BaseException) -> float | None:
    """When ``error`` stopped its rank in post-mortem pdb (None: it did not); asked once,
    when the failure is reported."""
    held = _failed_at.pop(id(error), None)
    return held[1] if held is not None and held[0] is error else None


def post_mortem(error: BaseException) -> None:
    """With ``debug=True``: pdb at the frame that raised ``error``, before the rank reports it.
    An interrupt ends it (the report goes on)."""
    link = asking.current()
    if link is None or not link.debug or link.refused:
        return
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    traceback = _from_user_code(error)
    if traceback is None:
        return
    from nbddp.worker.debugging.rank_pdb import RankPdb

    _failed_at[id(error)] = (error, time.time())  # the failure's time, not pdb's end
    debugger = RankPdb(link, "post-mortem")
    debugger.message(
        f"nbddp: rank {link.rank} raised {type(error).__name__}: {error}\n"
        "Post-mortem pdb at the frame that raised; c or q lets the run fail as usual."
    )
    with contextlib.suppress(KeyboardInterrupt):
        debugger.reset()
        debugger.interaction(None, traceback)
    debugger.leave()


# -- the one rank in the kernel itself (a world of 1) ----------------------------------------

_cell: Any = None  # the launching cell's stdout, while the kernel runs the one rank


def _kernel_pdb() -> Any:
    """pdb in the kernel: ``input()`` is the input box; its output goes to the cell."""
    import pdb

    debugger = pdb.Pdb(stdout=_cell) if _cell is not None else pdb.Pdb()
    debugger.use_rawinput = True  # input(), not stdin.readline()
    debugger.prompt = "(Pdb rank 0) "
    return debugger


@contextlib.contextmanager
def in_the_kernel(cell: Any) -> Iterator[None]:
    """While the kernel runs the one rank on the cell's thread, ``breakpoint()`` opens pdb in
    the input box: ipykernel's own hook (debugpy's) does nothing unless a debugger client is
    attached, and then it is left to it."""
    global _cell
    previous, _cell = sys.breakpointhook, cell

    def hook(*args: Any, **kwargs: Any) -> Any:
        debugpy = sys.modules.get("debugpy")
        if debugpy is not None and debugpy.is_client_connected():
            return previous(*args, **kwargs)
        if os.environ.get("PYTHONBREAKPOINT") != "0":
            _kernel_pdb().set_trace(sys._getframe(1))
        return None

    sys.breakpointhook = hook
    try:
        yield
    finally:
        sys.breakpointhook, _cell = previous, None


def post_mortem_here(error: BaseException) -> None:
    """``debug=True`` for the one rank in the kernel: pdb at the frame that raised."""
    traceback = _from_user_code(error)
    if traceback is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
        debugger = _kernel_pdb()
        debugger.reset()
        debugger.interaction(None, traceback)


# -- the hooks -------------------------------------------------------------------------------


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """``breakpoint()``: PYTHONBREAKPOINT=0 still turns it off."""
    link = asking.current()
    if link is None:
        return sys.__breakpointhook__(*args, **kwargs)
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return None
    stop_here(link, sys._getframe(1))
    return None


def _patch_pdb(module: ModuleType) -> None:
    """``pdb.set_trace()`` on a rank is ``breakpoint()``."""
    original = module.set_trace
    if getattr(original, "__module__", "") == __name__:
        return

    def set_trace(*, header: str | None = None, **kwargs: Any) -> None:
        link = asking.current()
        if link is None:
            return original(header=header, **kwargs)  # type: ignore[no-any-return]
        stop_here(link, sys._getframe(1), header=header)
        return None

    set_trace.__module__ = __name__
    set_trace.__doc__ = original.__doc__
    module.set_trace = set_trace  # type: ignore[attr-defined]


def _patch_torch(module: ModuleType) -> None:
    """``torch.distributed.breakpoint(rank, skip, timeout_s)`` is ``nbddp.breakpoint``: the
    other ranks wait in no barrier (torch's reads /dev/stdin, which a rank does not have)."""
    original = getattr(module, "breakpoint", None)
    if original is None or getattr(original, "__module__", "") == __name__:
        return
    skipped = [0]

    def torch_breakpoint(rank: int = 0, skip: int = 0, timeout_s: Any = 3600) -> None:
        if asking.current() is None:
            return original(rank, skip, timeout_s)  # type: ignore[no-any-return]
        if skip > 0 and skipped[0] < skip:
            skipped[0] += 1
            return None
        _breakpoint(rank, sys._getframe(1))
        return None

    torch_breakpoint.__module__ = __name__
    torch_breakpoint.__doc__ = original.__doc__
    module.breakpoint = torch_breakpoint  # type: ignore[attr-defined]


def install() -> dict[str, Any]:
    """Make ``breakpoint()`` and ``input()`` ask the notebook now; returns the patches for
    ``pdb`` and ``torch.distributed``, applied when (if) they are imported."""
    sys.breakpointhook = _breakpointhook
    asking.install_input()
    return {"pdb": _patch_pdb, "torch.distributed": _patch_torch}
