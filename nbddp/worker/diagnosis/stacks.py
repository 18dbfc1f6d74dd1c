"""Where this rank is, when the kernel asks: every thread's Python stack, the collective it is
in (torch's flight recorder), and the stacks of the processes it forked (DataLoader workers).

Nothing runs while nothing is asked: :func:`install` registers ``faulthandler`` on
:data:`~nbddp.wire.stacks.STACK_SIGNAL` (a C-level dump into a file of the run's directory,
for a rank whose listener thread cannot get the GIL) and re-registers it in every forked child,
each into a file of its own. :func:`report` runs on the rank's listener thread when asked.

Non-goal: deciding which rank is the odd one out (the kernel's ``nbddp/diagnosis``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, TextIO

from nbddp.wire.stacks import (
    MAIN_MARK,
    STACK_SIGNAL,
    AskStacks,
    ChildStacks,
    Collective,
    RankStacks,
    StackFrame,
    StackReport,
    ThreadStack,
    catches_signal,
    dump_file,
    parse_faulthandler,
    read_dump,
)
from nbddp.worker import PACKAGE_DIR

RECENT_COLLECTIVES = 8  # flight-recorder entries sent per rank
CHILD_WAIT = 0.5  # seconds a forked child gets to write its dump
NATIVE_WAIT = 20.0  # seconds py-spy gets (reading native symbols is slow)

_installed: dict[str, Any] = {}  # the dump file (kept open) and where it is


def install(directory: str, rank: int) -> None:
    """Register the signal dump for this rank and for every process it forks later."""
    path = dump_file(directory, rank)
    _register(path)
    _installed.update(directory=directory, rank=rank)
    os.register_at_fork(after_in_child=_register_child)


def _register(path: str) -> None:
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        # Owner-only, as every file of the run's directory (it shows the user's code).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        stream: TextIO = open(fd, "a", buffering=1)  # noqa: SIM115 (kept for the process's life)
        stream.write(f"{MAIN_MARK}0x{threading.main_thread().ident or 0:x}\n")
        old = _installed.get("stream")
        _installed["stream"] = stream
        faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)
        if old is not None:
            with contextlib.suppress(OSError):
                old.close()


def _register_child() -> None:
    """In a forked child (a DataLoader worker): dump into a file of its own."""
    directory, rank = _installed.get("directory"), _installed.get("rank")
    if directory is not None and rank is not None:
        _register(dump_file(directory, rank, os.getpid()))


# -- the answer --------------------------------------------------------------------------------


def answer(conn: Any, rank: int, ask: AskStacks) -> None:
    """Answer a roll-call from a thread of its own: the listener stays free meanwhile."""

    def send() -> None:
        with contextlib.suppress(OSError, EOFError):
            conn.send(RankStacks(rank, ask.query, report(ask.native)))

    threading.Thread(target=send, name="nbddp-stacks", daemon=True).start()


def report(native: bool = False) -> StackReport:
    """Where this rank's threads are now (nbddp's own threads left out)."""
    notes: list[str] = []
    threads = current_threads({threading.get_ident()})
    collectives, note = recent_collectives()
    if note:
        notes.append(note)
    children = _children_stacks()
    cpu = _cpu_time([child.pid for child in children] + _child_pids())
    native_text = ""
    if native:
        native_text, note = native_stacks(os.getpid())
        if note:
            notes.append(note)
    return StackReport("asked", threads, collectives, children, cpu, native_text, tuple(notes))


def current_threads(
    skip: frozenset[int] | set[int] = frozenset(), only: int | None = None
) -> tuple[ThreadStack, ...]:
    """Every thread's Python stack (``sys._current_frames``), the main thread first; or only
    the thread ``only``."""
    import linecache

    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    result = []
    for ident, frame in sys._current_frames().items():
        if ident in skip or (only is not None and ident != only):
            continue
        frames = []
        current: Any = frame
        while current is not None:
            code = current.f_code
            filename = code.co_filename
            lineno = current.f_lineno or 0
            line = linecache.getline(filename, lineno).strip()
            frames.append(
                StackFrame(filename, lineno, code.co_name, line, filename.startswith(PACKAGE_DIR))
            )
            current = current.f_back
        frames.reverse()
        name = names.get(ident, f"thread 0x{ident:x}")
        if ident != main and only is None and name.startswith("nbddp-"):
            continue  # nbddp's own threads (the live flusher, the listener)
        result.append(ThreadStack(name, ident == main, tuple(frames)))
    result.sort(key=lambda t: not t.main)
    return tuple(result)


def recent_collectives() -> tuple[tuple[Collective, ...], str]:
    """The last collectives this rank entered, from torch's flight recorder; or why unknown."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return (), ""
    import torch

    c10d: Any = torch._C._distributed_c10d
    if getattr(c10d, "_dump_fr_trace", None) is None:
        return (), (
            f"which collective each rank is in is unknown: torch {torch.__version__} has no "
            "flight recorder for this backend (torch >= 2.8 has one)"
        )
    try:
        entries = flight_entries(_backend(dist), strict=True)
    except Exception as exc:
        return (), f"torch's flight recorder could not be read ({type(exc).__name__}: {exc})"
    if not entries:
        size = os.environ.get(
            "TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
        )
        if size == "0":
            return (
                (),
                "TORCH_FR_BUFFER_SIZE=0 turns torch's flight recorder off: collectives unknown",
            )
        return (), ""
    recent = []
    for entry in entries[-RECENT_COLLECTIVES:]:
        name = str(entry.get("profiling_name", "?"))
        state = entry.get("state")
        nccl = name.startswith("nccl:")
        recent.append(
            Collective(
                seq=int(entry.get("collective_seq_id") or 0),
                op=name.split(":", 1)[-1],
                sizes=tuple(tuple(int(d) for d in s) for s in entry.get("input_sizes") or ()),
                dtypes=tuple(str(d) for d in entry.get("input_dtypes") or ()),
                group=str((entry.get("process_group") or ("", ""))[-1]),
                # NCCL's recorder marks completion (its watchdog sees the GPU finish); gloo's
                # leaves every entry "scheduled"
                completed=True if state == "completed" else (False if nccl else None),
            )
        )
    return tuple(recent), ""


def _backend(dist: Any) -> str:
    try:
        return str(dist.get_backend())
    except Exception:  # the default group went meanwhile
        return ""


def flight_entries(backend: str | None, strict: bool = False) -> list[dict[str, Any]]:
    """torch's flight-recorder entries for ``backend``, oldest first. torch keeps two
    recorders: gloo's (``_dump_fr_trace``, the CPU one) and NCCL's (``_dump_nccl_trace``, which
    records CUDA events and completion); a ``cpu:gloo,cuda:nccl`` group writes to both, and
    ``None`` reads whichever the current default group uses. ``strict``: a dump that fails
    raises (else: no entries)."""
    import torch

    c10d: Any = torch._C._distributed_c10d
    if backend is None:
        dist = sys.modules.get("torch.distributed")
        backend = _backend(dist) if dist is not None and dist.is_initialized() else ""
    names = {part.rpartition(":")[2].strip() for part in backend.lower().split(",")}
    dumps = [
        getattr(c10d, dump, None)
        for dump, wanted in (("_dump_fr_trace", "gloo"), ("_dump_nccl_trace", "nccl"))
        if wanted in names
    ]
    entries: list[dict[str, Any]] = []
    for dump in dumps:
        if dump is None:
            continue
        try:
            trace = pickle.loads(
                dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            )
        except Exception:
            if strict:
                raise
            continue
        found = trace.get("entries", []) if isinstance(trace, dict) else []
        entries += [e for e in found if isinstance(e, dict)]
    if len(dumps) > 1:
        entries.sort(key=lambda e: e.get("time_created_ns") or 0)
    return entries


# -- processes the rank forked -----------------------------------------------------------------


def _child_pids(pid: int | None = None) -> list[int]:
    pid = pid or os.getpid()
    children: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
    return children


def _children_stacks() -> tuple[ChildStacks, ...]:
    directory, rank = _installed.get("directory"), _installed.get("rank")
    if directory is None or rank is None:
        return ()
    pending = {}
    for pid in _child_pids():
        path = dump_file(directory, rank, pid)
        if not os.path.exists(path) or not catches_signal(pid):
            continue
        try:
            offset = os.path.getsize(path)
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        pending[pid] = (path, offset)
    found = []
    for pid, (path, offset) in pending.items():
        text, main = read_dump(path, offset, CHILD_WAIT)
        if text:
            threads = parse_faulthandler(text, main, PACKAGE_DIR)
            found.append(ChildStacks(pid, tuple(threads)))
    return tuple(found)


def _cpu_time(children: list[int]) -> float:
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in set(children):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def native_stacks(pid: int) -> tuple[str, str]:
    """py-spy's dump with native frames, or why there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = beside if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if spy is None:
        return "", "native frames: py-spy is not installed (pip install py-spy)"
    try:
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=NATIVE_WAIT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", f"native frames: py-spy failed ({type(exc).__name__})"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
        if "ermission" in why or "ptrace" in why.lower():
            why += (
                " (py-spy needs ptrace: CAP_SYS_PTRACE in a container, or "
                "kernel.yama.ptrace_scope=0)"
            )
        return "", f"native frames: py-spy could not attach: {why}"
    return done.stdout, ""
