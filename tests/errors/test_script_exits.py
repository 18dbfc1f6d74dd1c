"""A script's exit code in the error the kernel raises: what a rank reports becomes
``WorkerError.exitcode`` and the first line says it (``sys.exit(3)``, ``sys.exit('message')``),
kept when the error is pickled or read back from a detached run's record; a function's failure
still has none of its own."""

from __future__ import annotations

import pickle

import pytest

from nbddp import WorkerError
from nbddp.detached.outcome import decode_error, encode_error
from nbddp.rules.tracker import raised
from nbddp.wire import payload
from nbddp.wire.messages import ErrorReport

pytestmark = pytest.mark.unit


def reported(exc: BaseException, exitcode: int | None) -> ErrorReport:
    cls = type(exc)
    return ErrorReport(
        cls.__name__,
        str(exc),
        "Traceback ...",
        payload.dumps_exception(exc),
        0.0,
        tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__),
        cls.__module__,
        exitcode=exitcode,
    )


@pytest.mark.parametrize(
    ("exc", "exitcode", "head"),
    [
        (SystemExit(3), 3, "rank 1 exited with code 3 (sys.exit(3))"),
        (SystemExit("bad config"), 1, "rank 1 exited with code 1 (sys.exit('bad config'))"),
        (ValueError("no"), 1, "rank 1 raised ValueError: no"),
        (ValueError("no"), None, "rank 1 raised ValueError: no"),  # a function's
    ],
)
def test_the_exit_code_reaches_the_error_and_stays_through_pickles_and_records(exc, exitcode, head):
    error = raised(1, reported(exc, exitcode)).error
    assert isinstance(error, WorkerError) and error.exitcode == exitcode
    assert str(error).splitlines()[0] == head
    assert isinstance(error, ValueError) == isinstance(exc, ValueError)
    for again in (pickle.loads(pickle.dumps(error)), decode_error(encode_error(error))):
        assert (again.rank, again.exitcode, str(again)) == (1, exitcode, str(error))
