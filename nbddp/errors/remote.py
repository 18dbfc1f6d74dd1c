"""A rank's exception, rebuilt in the kernel: the error raised there is a
:class:`~nbddp.errors.WorkerError` that is also an instance of the rank's own exception class
where the kernel has that class, so ``except ValueError:`` around a launch catches a rank's
``ValueError``.

Non-goal: choosing which rank's error is raised (``rules/tracker.py``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from nbddp.errors import NbddpError, WorkerError


def rank_raised(
    rank: int,
    exc_type: str,
    message: str,
    traceback: str,
    original: BaseException | None,
    remote_class: type | None = None,
    node: str | None = None,
    hint: str = "",
    exitcode: int | None = None,
) -> WorkerError:
    """The error for a rank that raised: also an instance of the remote exception's class
    when that class is an ``Exception`` the kernel has (so ``except ValueError:`` around a
    launch catches a rank's ValueError), a plain WorkerError otherwise. ``exitcode``: the
    script's, when a script's rank raised (``worker/rank/scripts.py``)."""
    remote_class = type(original) if original is not None else remote_class
    combined = combined_class(remote_class) if remote_class is not None else None
    fields: dict[str, Any] = {"exc_type": exc_type, "exc_message": message, "hint": hint}
    fields.update(remote_traceback=traceback, node=node, exitcode=exitcode)
    error: WorkerError
    if combined is not None:
        try:
            error = Exception.__new__(combined)
            if original is not None:  # what the user's __init__ set, e.g. error.code
                error.__dict__.update(getattr(original, "__dict__", {}))
            WorkerError.__init__(error, rank, **fields)
        except Exception:  # a class whose instances cannot be made this way
            combined = None
    if combined is None:
        error = WorkerError(rank, **fields)
    if original is not None:
        error.__cause__ = original
        let_go_of_frames(original)
    return error


def let_go_of_frames(original: BaseException) -> None:
    """A live exception (the one-rank run's, raised in the kernel itself) keeps ``fn``'s frames
    through its traceback, and with them its locals: the model, the optimizer, the batch. The
    kernel keeps the raised error (IPython's ``sys.last_value``), so its GPU memory would stay
    taken until the next error, and a retry with a smaller batch would run out of memory again.
    Its traceback is text by now (``traceback=``): the frames' locals go, and the memory
    torch's allocator held for them goes back to the GPU."""
    seen: set[int] = set()
    error: BaseException | None = original
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            try:
                frame.clear()
            except RuntimeError:  # a frame still running (the kernel's own) is left as it is
                pass
            else:  # Python < 3.13 keeps a dict of the locals once read (a hint looked at
                frame.f_locals  # noqa: B018  them): reading it again drops what clear() did
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_COMBINED: dict[type, type[WorkerError] | None] = {}


def combined_class(remote: type) -> type[WorkerError] | None:
    """``WorkerError`` and ``remote`` in one class, or None where they cannot be combined:
    BaseException-only types (KeyboardInterrupt, SystemExit), nbddp's own errors, and classes
    whose instance layout conflicts (OSError, SyntaxError, ...)."""
    if not isinstance(remote, type) or not issubclass(remote, Exception):
        return None
    if issubclass(remote, NbddpError) or remote in (Exception, RuntimeError):
        return None
    if remote not in _COMBINED:
        try:
            _COMBINED[remote] = type(  # a WorkerError subclass
                "WorkerError",  # what IPython shows: the rank's class is in the message
                (WorkerError, remote),
                {
                    "__module__": "nbddp.errors",
                    "__qualname__": f"WorkerError[{remote.__name__}]",
                    "__str__": WorkerError.__str__,
                    "__repr__": WorkerError.__repr__,
                    "__reduce__": WorkerError.__reduce__,
                    "__init__": WorkerError.__init__,
                },
            )
        except TypeError:  # layout or method-order conflict
            _COMBINED[remote] = None
    return _COMBINED[remote]


def import_class(qualified: str) -> type | None:
    """The class ``module.Qual.Name`` when the kernel can import it without side effects it
    had not already paid (only modules already imported are looked at)."""
    module_name, _, qualname = qualified.rpartition(".")
    while module_name and module_name not in sys.modules:
        module_name, _, head = module_name.rpartition(".")
        qualname = f"{head}.{qualname}"
    if not module_name:
        return None
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found if isinstance(found, type) else None
