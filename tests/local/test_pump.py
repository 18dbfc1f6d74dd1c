"""The ranks' output on its way to the notebook, over real pipes: prefixes across partial
lines and carriage-return redraws, the stderr tail, and bounded memory for endless lines."""

from __future__ import annotations

import io
import os
import time

import pytest

from nbddp.local.pump import OutputPump
from nbddp.state.terminal import LineWindow

pytestmark = pytest.mark.unit


def pump_text(mode: str, writes: list[tuple[int, bytes]]) -> tuple[str, OutputPump]:
    target = io.StringIO()
    pump = OutputPump(mode, target)  # type: ignore[arg-type]
    pipes = {}
    for rank in (0, 1):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pump.add(rank, out_r, err_r)
        pipes[rank] = (out_w, err_w)
    for rank, data in writes:
        os.write(pipes[rank][0], data)
        for fd in pump.fds():
            pump.read(fd)
    for out_w, err_w in pipes.values():
        os.write(err_w, b"last words\n")
        os.close(out_w)
        os.close(err_w)
    for rank in (0, 1):
        pump.drain(rank)
    return target.getvalue(), pump


def test_whole_lines_with_their_rank_prefix_never_interleave():
    text, pump = pump_text(
        "all",
        [
            (0, b"step 1"),
            (1, b"hello\nwor"),
            (0, b" done\n"),
            (1, b"ld\n"),
            (0, b"\r 10%\r 20%\r\n"),
        ],
    )
    assert text == (
        "[rank 1] hello\n[rank 0] step 1 done\n[rank 1] world\n"
        "\r[rank 0]  10%\r[rank 0]  20%\r\n"  # each redraw keeps the prefix
        "[rank 0] last words\n[rank 1] last words\n"
    )
    assert pump.stderr_tail(1) == "last words\n"
    pump.close()


def test_rank0_output_passes_through_as_it_comes():
    text, pump = pump_text("rank0", [(0, b"a\rb"), (1, b"hidden\n"), (0, b"c\n")])
    assert text == "a\rbc\nlast words\n"  # rank 0's stdout, then its stderr
    pump.close()


def test_a_line_window_is_linear_and_bounded_without_newlines():
    window = LineWindow(keep=5, max_line=1000)
    piece = "x" * 65536
    started = time.monotonic()
    for _ in range(800):  # 50 MB in one line
        window.feed(piece)
    # linear: 0.03 s here; copying the line at each feed would take minutes
    assert time.monotonic() - started < 20
    assert len(window.open_line) == 1000
    window.feed("\n")
    assert window.lines[-1].endswith("more characters not shown]")
    for index in range(10):
        window.feed(f"line {index}\n")
    assert next(iter(window.lines)) == "line 5" and window.dropped == 6


def test_a_carriage_return_redraws_the_line_like_a_terminal():
    window = LineWindow(keep=10)
    window.feed("epoch 1\n")
    for percent in range(0, 101, 10):
        window.feed(f"\r{percent:3d}%|{'#' * (percent // 10)}")
    window.feed("\nprinted by the user\n")
    assert window.text() == "epoch 1\n100%|##########\nprinted by the user\n"
