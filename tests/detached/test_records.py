"""A detached run's record (``events.log``) and its replay: whole frames only, a torn tail
ignored, offsets that split history from live, and a replay that rebuilds the same view."""

from __future__ import annotations

import contextlib
import os

import pytest
from conftest import blocks

from nbddp.backend import Outcome
from nbddp.detached import store
from nbddp.detached.outcome import Ending, decode_error, encode_error, read_outcome, write_value
from nbddp.detached.records import LogWriter, encode, last_event, read_events
from nbddp.detached.replay import replay
from nbddp.errors import LaunchTimeout, SerializationError, WorkerError
from nbddp.rules.tracker import raised
from nbddp.state.run import RunState
from nbddp.wire import payload
from nbddp.wire.messages import BarSnapshot, ErrorReport

pytestmark = pytest.mark.unit


def test_events_come_back_in_order_with_the_offset_after_each(tmp_path):
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    offsets = [log.append(encode("device", f"gpu {i}")) for i in range(5)]
    log.close()
    read = list(read_events(path))
    assert [e.args[0] for e, _ in read] == [f"gpu {i}" for i in range(5)]
    assert [offset for _, offset in read] == offsets
    # from an offset on, and up to one: history and live split exactly there
    after_second = [e.args[0] for e, _ in read_events(path, start=offsets[1])]
    assert after_second == ["gpu 2", "gpu 3", "gpu 4"]
    up_to_third = [e.args[0] for e, _ in read_events(path, end=offsets[2])]
    assert up_to_third == ["gpu 0", "gpu 1", "gpu 2"]


def test_a_torn_or_altered_frame_is_not_read(tmp_path):
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    log.append(encode("device", "whole"))
    log.close()
    with open(path, "ab") as f:  # a writer killed in the middle of a frame
        f.write(encode("device", "torn")[:7])
    assert [e.args[0] for e, _ in read_events(path)] == ["whole"]
    with open(path, "r+b") as f:  # a changed byte that still unpickles: its checksum fails
        data = f.read()
        f.seek(data.index(b"whole"))
        f.write(b"wh0le")
    assert list(read_events(path)) == []


def test_a_file_that_is_not_a_record_has_no_events(tmp_path):
    path = tmp_path / "events.log"
    path.write_bytes(b"something else entirely")
    assert list(read_events(str(path))) == []
    assert list(read_events(str(tmp_path / "missing.log"))) == []


def test_replay_rebuilds_the_view_the_live_run_had(tmp_path):
    """The same events fed live to one state and replayed from the record into another give
    the same history, bars, device and output."""
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    live = RunState(2, "cpu", "gloo", "cpu")
    calls = [
        ("started",),
        ("device", "Tesla T4"),
        ("rows", 0, 0, blocks((0, {"loss": 1.0}), (0, {"loss": 0.5}))),
        ("rows", 1, 0, blocks((0, {"loss": 3.0}), (0, {"loss": 1.5}))),
        ("bars", [BarSnapshot(1, 0, "epoch", 1, 3, 0.5, False)]),
        ("main_rows", [(7, {"lr": 0.1})]),
    ]
    for kind, *args in calls:
        getattr(live, kind)(*args)
        log.append(encode(kind, *args))
    log.append(encode("output", "line one\nline two\n"))
    log.close()
    replayed = RunState(2, "cpu", "gloo", "cpu")
    printed: list[str] = []

    class Out:
        def write(self, text: str) -> int:
            printed.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    ending = replay((e for e, _ in read_events(path)), replayed, Out(), str(tmp_path))
    assert ending is None
    assert replayed.history_rows() == live.history_rows()
    assert replayed.history_rows()[:2] == [
        {"step": 0, "epoch": 0, "loss": 2.0},
        {"step": 1, "epoch": 0, "loss": 1.0},
    ]
    snap, expected = replayed.snapshot(), live.snapshot()
    assert (snap.status, snap.device_name, snap.bars) == (
        expected.status,
        expected.device_name,
        expected.bars,
    )
    assert "".join(printed) == "line one\nline two\n"


def test_a_long_output_replays_its_last_lines_and_says_where_the_rest_is(tmp_path):
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    log.append(encode("output", "".join(f"line {i}\n" for i in range(5000))))
    log.close()
    printed: list[str] = []

    class Out:
        def write(self, text: str) -> int:
            printed.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    replay((e for e, _ in read_events(path)), RunState(1, "cpu", "gloo", "cpu"), Out(), "/r")
    text = "".join(printed)
    note = f"[nbddp: 4000 earlier lines of this run's output are in /r/{store.OUTPUT}]"
    assert text.startswith(note)
    assert text.endswith("line 4999\n") and "line 3999\n" not in text


def test_the_end_is_the_last_event_and_its_outcome_is_rebuilt(tmp_path):
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    write_value(str(tmp_path), {"answer": 42})
    ending = Ending("succeeded", None, "a warning", ("an exit warning",), 12.5, True)
    log.append(encode("end", ending))
    log.close()
    assert last_event(path, "end").args[0] == ending
    outcome = read_outcome(str(tmp_path), ending)
    assert outcome == Outcome("succeeded", {"answer": 42}, None, "a warning", ("an exit warning",))


def test_a_missing_result_file_fails_the_outcome_saying_why(tmp_path):
    ending = Ending("succeeded", None, None, (), 1.0, True)
    outcome = read_outcome(str(tmp_path), ending)
    assert outcome.status == "failed" and "result is gone" in str(outcome.error)


class CodeError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def test_a_ranks_error_is_rebuilt_as_its_own_class_in_the_reading_kernel():
    try:
        raise CodeError("out of patience", 7)
    except CodeError as exc:
        report = ErrorReport(
            "CodeError",
            "out of patience",
            "Traceback ...",
            payload.dumps_exception(exc),
            0.0,
            (f"{__name__}.CodeError", "builtins.Exception"),
            __name__,
        )
    failure = raised(1, report)
    rebuilt = decode_error(encode_error(failure.error))
    assert isinstance(rebuilt, WorkerError) and isinstance(rebuilt, CodeError)
    assert rebuilt.rank == 1 and rebuilt.code == 7
    assert str(rebuilt) == str(failure.error)
    assert isinstance(rebuilt.__cause__, CodeError)


def test_other_errors_travel_as_they_are_and_the_unpicklable_as_text():
    timeout = decode_error(encode_error(LaunchTimeout(5.0)))
    assert isinstance(timeout, LaunchTimeout) and timeout.timeout == 5.0
    serialization = decode_error(encode_error(SerializationError("x", "x -> lock", "nope")))
    assert isinstance(serialization, SerializationError) and serialization.path == "x -> lock"
    lock = __import__("threading").Lock()

    class Odd(Exception):
        def __reduce__(self):
            return (Odd, (lock,))

    text = decode_error(encode_error(Odd("strange")))
    assert "Odd: strange" in str(text)


def test_a_died_rank_is_rebuilt_with_its_exit_code():
    error = WorkerError(0, exitcode=-9, remote_traceback="last lines")
    rebuilt = decode_error(encode_error(error))
    assert type(rebuilt) is WorkerError and rebuilt.exitcode == -9
    assert str(rebuilt) == str(error)


def test_writes_that_fail_leave_the_record_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "events.log")
    log = LogWriter(path)
    log.append(encode("device", "before"))
    real_write = os.write
    calls = {"n": 0}

    def half_then_full(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:5])  # half a frame, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with contextlib.suppress(OSError):
        log.append(encode("device", "lost"))
    monkeypatch.setattr(os, "write", real_write)
    log.append(encode("device", "after"))
    log.close()
    assert [e.args[0] for e, _ in read_events(path)] == ["before", "after"]
