"""A run's outcome, kept on disk: its status, its error rebuilt in whichever kernel reads it,
its warnings, and rank 0's value in a file of its own.

A rank's error is kept as its parts (the rank's report and the pickled original), not as the
finished ``WorkerError``: a later kernel rebuilds it with ``errors.remote.rank_raised``, so that it
is again also an instance of the rank's own exception class where that kernel has it
(``except ValueError:`` still catches it). Other errors pickle as they are; one that will not
is kept as its text.

Non-goal: where the files are (``store.py``).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, NamedTuple

from nbddp.backend import EndStatus, Outcome
from nbddp.errors import NbddpError, WorkerError
from nbddp.errors.remote import import_class, rank_raised
from nbddp.wire import payload

RESULT = "result.pkl"


class Ending(NamedTuple):
    """The ``end`` event's argument."""

    status: EndStatus
    error: bytes | None  # encode_error's
    warning: str | None
    exit_warnings: tuple[str, ...]
    duration: float  # seconds from the launch to the end
    has_value: bool  # RESULT holds the value
    graceful: str | None = None  # stopped gracefully: at which step and why (Outcome's)


_WORKER_FIELDS = (
    "rank",
    "exitcode",
    "exc_type",
    "exc_message",
    "remote_traceback",
    "hint",
    "node",
    "summary",
)


class _WorkerParts(NamedTuple):
    fields: tuple[Any, ...]  # the WorkerError's _WORKER_FIELDS
    remote_class: str | None  # the rank's exception class, "module.Qual.Name"
    original: bytes | None  # the rank's exception, pickled


def encode_error(error: BaseException) -> bytes:
    if isinstance(error, WorkerError):
        cause = error.__cause__
        original = None
        if cause is not None:
            try:
                original = payload.dumps_exception(cause)
            except Exception:
                original = None
        remote = None
        if cause is not None:
            remote = f"{type(cause).__module__}.{type(cause).__qualname__}"
        fields = tuple(getattr(error, name) for name in _WORKER_FIELDS)
        return pickle.dumps(_WorkerParts(fields, remote, original))
    try:
        return payload.dumps(error, what="the run's error to its record", root="error")
    except Exception:
        return pickle.dumps(_Text(type(error).__name__, str(error)))


class _Text(NamedTuple):
    kind: str
    text: str


def decode_error(blob: bytes) -> BaseException:
    try:
        parts = pickle.loads(blob)
    except Exception as exc:
        return NbddpError(f"the run failed; its error cannot be rebuilt in this kernel ({exc!r})")
    if isinstance(parts, _WorkerParts):
        return _worker_error(parts)
    if isinstance(parts, _Text):
        return NbddpError(f"{parts.kind}: {parts.text}")
    if isinstance(parts, BaseException):
        return parts
    return NbddpError(f"the run failed: {parts!r}")


def _worker_error(parts: _WorkerParts) -> WorkerError:
    rank, exitcode, exc_type, message, trace, hint, node, summary = parts.fields
    original = None
    if parts.original is not None:
        try:
            original = payload.loads(parts.original)
        except Exception:
            original = None  # its class lives in a module this kernel cannot import
    if not isinstance(original, BaseException):
        original = None
    if exc_type is not None and not summary:
        remote = (
            None
            if original is not None or parts.remote_class is None
            else (import_class(parts.remote_class))
        )
        return rank_raised(rank, exc_type, message, trace, original, remote, node, hint, exitcode)
    error = WorkerError(
        rank,
        exitcode=exitcode,
        exc_type=exc_type,
        exc_message=message,
        remote_traceback=trace,
        hint=hint,
        node=node,
        summary=summary,
    )
    if original is not None:
        error.__cause__ = original
    return error


def write_value(directory: str, value: Any) -> None:
    """Rank 0's value (every rank's with ``return_all``), pickled with tensors on the CPU;
    written under a temporary name and renamed, so a reader sees all of it or none."""
    data = payload.dumps(value, what="the run's result to its record", root="result")
    temporary = os.path.join(directory, f".{RESULT}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, RESULT))


def read_outcome(directory: str, ending: Ending) -> Outcome:
    """The outcome as the run's ``Run`` reports it, in this kernel."""
    error = decode_error(ending.error) if ending.error is not None else None
    value = None
    if ending.has_value and error is None:
        try:
            with open(os.path.join(directory, RESULT), "rb") as f:
                value = payload.loads(f.read())
        except FileNotFoundError:
            error = NbddpError(
                f"the run's result is gone from {directory} (was it forgotten meanwhile?)"
            )
        except Exception as exc:
            error = NbddpError(
                f"the run's result cannot be rebuilt in this kernel: {exc!r}. Is a module it "
                "needs importable here?"
            )
            error.__cause__ = exc
    status = ending.status if error is None or ending.status != "succeeded" else "failed"
    return Outcome(
        status,
        value,
        error,
        ending.warning,
        ending.exit_warnings,
        ending.graceful,
    )
