"""Where a rank's threads are, as it travels to the kernel: frames, threads, the collective
the rank is in, its DataLoader workers. Also the text ``faulthandler`` writes, parsed into the
same shape: a rank whose listener thread cannot answer (its main thread holds the GIL in native
code) is dumped by :data:`STACK_SIGNAL` into a file of the run's directory.

Non-goal: grouping ranks or showing them (``nbddp/diagnosis/``); capturing (``worker/stacks``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from typing import NamedTuple

# A real-time signal nothing else uses: faulthandler dumps every thread's stack on it, from a
# C-level handler, so it works while the main thread sits in a collective or holds the GIL.
STACK_SIGNAL = signal.SIGRTMIN + 5
MAIN_MARK = "# nbddp main thread "  # the dump file's first line names the main thread


class AskStacks(NamedTuple):
    """Kernel -> rank: where are you? (``Run.stacks``). Answered by the rank's listener
    thread, even while its main thread waits in a collective."""

    query: int
    native: bool = False  # also py-spy's native frames, when it can attach


def dump_file(directory: str, rank: int, pid: int | None = None) -> str:
    """Where faulthandler writes a rank's stacks (or those of its forked child ``pid``)."""
    name = f"stacks-{rank}.txt" if pid is None else f"stacks-{rank}-{pid}.txt"
    return f"{directory}/{name}"


class StackFrame(NamedTuple):
    filename: str
    lineno: int
    function: str
    line: str  # the source text, "" when unknown
    own: bool  # one of nbddp's own frames (hidden when shown)


class ThreadStack(NamedTuple):
    name: str
    main: bool
    frames: tuple[StackFrame, ...]  # outermost first


class Collective(NamedTuple):
    """One entry of torch's flight recorder: a collective the rank entered."""

    seq: int  # the process group's collective sequence number (the same on every rank)
    op: str  # "all_reduce", "broadcast", ...
    sizes: tuple[tuple[int, ...], ...]  # the input tensors' shapes
    dtypes: tuple[str, ...]
    group: str  # the process group's name
    completed: bool | None  # None: the backend does not say (gloo)


class ChildStacks(NamedTuple):
    """A process the rank started (a DataLoader worker), as faulthandler dumped it."""

    pid: int
    threads: tuple[ThreadStack, ...]


class StackReport(NamedTuple):
    """Where one rank is right now."""

    how: str  # "asked": its listener thread answered; "signal": faulthandler's dump
    threads: tuple[ThreadStack, ...]  # the main thread first
    collectives: tuple[Collective, ...]  # the last ones it entered, newest last
    children: tuple[ChildStacks, ...]
    cpu_time: float | None  # CPU seconds of the rank and its live children, so far
    native: str  # py-spy's --native dump, "" when not asked for or not possible
    notes: tuple[str, ...]  # what is missing, and why


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str, main_ident: int | None, package_dir: str) -> list[ThreadStack]:
    """faulthandler's dump (most recent call first) as threads, outermost frame first. The
    main thread is the one named ``main_ident`` (or the one not started by threading)."""
    threads: list[tuple[int, list[StackFrame]]] = []
    for raw in text.splitlines():
        head = _THREAD.match(raw)
        if head:
            threads.append((int(head.group(2), 16), []))
            continue
        frame = _FRAME.match(raw)
        if frame and threads:
            filename = frame.group(1)
            threads[-1][1].append(
                StackFrame(
                    filename,
                    int(frame.group(2)),
                    frame.group(3),
                    "",
                    filename.startswith(package_dir),
                )
            )
    result = []
    for ident, frames in threads:
        frames.reverse()
        started = bool(frames) and frames[0].function == "_bootstrap"
        main = ident == main_ident if main_ident is not None else not started
        name = "MainThread" if main else f"thread 0x{ident:x}"
        result.append(ThreadStack(name, main, tuple(frames)))
    result.sort(key=lambda t: not t.main)
    return result


def catches_signal(pid: int) -> bool:
    """Whether ``pid`` has a handler for the dump signal (else the signal would kill it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (STACK_SIGNAL - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def read_dump(path: str, offset: int, wait: float) -> tuple[str, int | None]:
    """What faulthandler wrote to ``path`` past ``offset`` (waiting up to ``wait`` seconds for
    it to start and then to settle), and the main thread's id from the file's first line."""
    deadline = time.monotonic() + wait
    size = offset
    while time.monotonic() < deadline:
        time.sleep(0.01)
        try:
            now = os.path.getsize(path)
        except OSError:
            return "", None
        if now > offset and now == size:
            break  # it wrote, and stopped
        size = now
    try:
        with open(path, errors="replace") as f:
            first = f.readline()
            f.seek(offset)
            text = f.read()
    except OSError:
        return "", None
    main = None
    if first.startswith(MAIN_MARK):
        with contextlib.suppress(ValueError):
            main = int(first[len(MAIN_MARK) :].strip(), 16)
    return text, main


class RankStacks(NamedTuple):
    """Rank -> kernel: the answer to ``AskStacks`` (or the signal dump of a rank that could not
    answer, made by the group that serves it)."""

    rank: int
    query: int
    report: StackReport
