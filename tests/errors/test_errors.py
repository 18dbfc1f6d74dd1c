"""The exception tree: messages that name the cause, warnings users actually see, errors that
survive pickling."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys

import pytest

from nbddp import LaunchTimeout, RunStopped, SerializationError, WorkerError
from nbddp.errors import describe_exit


@pytest.mark.unit
@pytest.mark.parametrize(
    ("code", "text"),
    [
        (-signal.SIGKILL, "killed by signal 9 (SIGKILL), often the out-of-memory killer"),
        (-signal.SIGSEGV, "signal 11 (SIGSEGV), a crash in native code"),
        (-signal.SIGTERM, "killed by signal 15 (SIGTERM)"),
        (-99, "killed by signal 99 (unknown signal)"),
        (0, "exited with code 0 without returning a value"),
        (3, "exited with code 3 without a Python traceback"),
        (None, "stopped without reporting a result"),
    ],
)
def test_describe_exit_names_the_signal_and_a_likely_cause(code, text):
    assert text in describe_exit(code)


@pytest.mark.ranks
def test_nbddp_warnings_are_shown_by_pythons_default_filters():
    code = (
        "import warnings\n"
        "from nbddp.errors import NbddpWarning\n"
        "warnings.warn('seen', NbddpWarning)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "NbddpWarning: seen" in done.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    "error",
    [
        WorkerError(1, exc_type="ValueError", exc_message="bad", remote_traceback="tb", node="n1"),
        SerializationError("x to the workers", "x -> lock", "TypeError: no", hint="do this"),
        LaunchTimeout(3.0),
        RunStopped(),
    ],
)
def test_errors_keep_their_fields_through_pickling(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)


class _OldIPython:
    """A shell whose traceback formatter asserts that an error has frames (IPython < 8.x)."""

    class InteractiveTB:
        tb_offset = 0

        @staticmethod
        def structured_traceback(etype, value, tb, tb_offset=None):
            assert tb is not None
            return ["with frames"]

    compile = None


@pytest.mark.unit
def test_an_error_shown_without_frames_renders_where_ipython_cannot(monkeypatch):
    """A ``%%ddp`` cell's error has no local frame; IPython 8.0 asserted one, and the failure
    inside ``_render_traceback_`` left the cell without a reply (a hang, seen on the oldest
    declared IPython by .ci/smoke.py). The error's own line must come back instead."""
    import nbddp.errors

    monkeypatch.setattr(nbddp.errors, "_ipython", _OldIPython)
    error = WorkerError(1, exitcode=1, exc_type="ZeroDivisionError", exc_message="x")
    error._local_frames = False
    lines = error._render_traceback_()
    assert any("rank 1" in line for line in lines), lines
