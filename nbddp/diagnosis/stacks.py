"""``nbddp.Stacks``: where every rank is at one moment, and the roll-call that says which rank
is the odd one out.

A rank's place is its main thread's innermost frame in the user's code (a notebook cell shown
as ``Cell In[7], line 12``, as IPython's tracebacks show it; nbddp's own frames hidden) and
what it waits in there: the collective (with its flight-recorder sequence number) or the call.
Ranks in the same place form a group; the rank that never reached the collective the others
wait in, or the minority whose collective differs, is named.

Non-goal: asking the ranks (``Run.stacks``) or deciding when to ask (``stall.py``).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from nbddp.wire.stacks import Collective, StackFrame, StackReport, ThreadStack

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(
    {
        p + os.sep
        for p in (
            sysconfig.get_paths().get("stdlib", ""),
            sysconfig.get_paths().get("platstdlib", ""),
        )
        if p
    }
)
SHOWN_FRAMES = 6  # frames of each stack shown in str(), innermost last


def cell_number(filename: str) -> int | None:
    """The ``In[n]`` of a notebook cell's code (a ``%%ddp`` cell's too: the magic registers
    it), as IPython's tracebacks name it."""
    ipython = sys.modules.get("IPython")  # never imported just for this
    shell = ipython.get_ipython() if ipython is not None else None
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    number = mapping.get(filename) if isinstance(mapping, dict) else None
    return number if isinstance(number, int) else None


def _is_library(filename: str) -> bool:
    return (
        "site-packages" in filename
        or "dist-packages" in filename
        or filename.startswith(_LIBRARY_DIRS)
        or filename.startswith("<frozen")
    )


def _is_user(frame: StackFrame) -> bool:
    return not frame.own and not _is_library(frame.filename)


def location(frame: StackFrame) -> str:
    """``Cell In[7], line 12`` for notebook code, ``train.py:40`` elsewhere."""
    number = cell_number(frame.filename)
    if number is not None:
        return f"Cell In[{number}], line {frame.lineno}"
    name = frame.filename
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    else:
        library = next((d for d in _LIBRARY_DIRS if name.startswith(d)), None)
        if library is not None:
            name = name[len(library) :]
        elif name.startswith(os.getcwd() + os.sep):
            name = os.path.relpath(name)
    return f"{name}:{frame.lineno}"


def source_line(frame: StackFrame) -> str:
    return frame.line or linecache.getline(frame.filename, frame.lineno).strip()


class CodePlace(NamedTuple):
    """Where one rank's main thread is, in words."""

    at: str  # "Cell In[7], line 12"
    waits: str  # "all_reduce #41 [3]", "time.sleep(60)", "DataLoader.__next__()"
    collective: Collective | None  # the collective it waits in, when it does


def place_of(report: StackReport) -> CodePlace | None:
    main = next((t for t in report.threads if t.main), None)
    if main is None or not main.frames:
        return None
    debugging = _debugging(main.frames)
    if debugging is not None:
        return debugging
    frames = _after_own(main.frames)
    index = max((i for i, f in enumerate(frames) if _is_user(f)), default=None)
    if index is None:  # nbddp's own code (starting, between steps), or what it called
        waits = f"{frames[-1].function}()" if frames else "its own work"
        return CodePlace("nbddp's own code", waits, None)
    user = frames[index]
    inner = frames[index + 1 :]
    in_distributed = any("torch" + os.sep + "distributed" + os.sep in f.filename for f in inner)
    if in_distributed and report.collectives:
        last = report.collectives[-1]
        return CodePlace(location(user), describe(last), last)
    if in_distributed:  # the collective is unknown: name torch's function, not its wrapper
        called = [f for f in inner if "torch" + os.sep + "distributed" + os.sep in f.filename]
        return CodePlace(location(user), f"{called[-1].function}()", None)
    if inner:
        return CodePlace(location(user), f"{inner[0].function}()", None)
    return CodePlace(location(user), source_line(user) or f"{user.function}()", None)


_IN = os.path.join(os.sep, "worker", "debugging", "")  # pdb, input(), nbddp.breakpoint()
_ASKING, _BREAKPOINT = (_IN + "rank_pdb.py", _IN + "asking.py"), _IN + "debugger.py"


def _debugging(frames: tuple[StackFrame, ...]) -> CodePlace | None:
    """A rank stopped in pdb, waiting in ``input()`` or held at ``nbddp.breakpoint()``, at the
    user's line that got it there (the roll-call's words for it)."""
    first = next((i for i, f in enumerate(frames) if f.own and f.filename.endswith(_ASKING)), None)
    if first is None:
        return None
    waits = "input()"
    if any(f.filename.endswith(_ASKING[0]) for f in frames[first:]):
        waits = "pdb"
    elif any(f.function == "wait_release" for f in frames[first:]):
        waits = "nbddp.breakpoint() (held until the debugged rank continues)"
    called = [f for f in frames[:first] if not f.filename.endswith(_BREAKPOINT)]
    user = [f for f in _after_own(tuple(called)) if _is_user(f)]
    return CodePlace(location(user[-1]) if user else "its failing frame (post-mortem)", waits, None)


def _after_own(frames: tuple[StackFrame, ...]) -> list[StackFrame]:
    """The frames inside the user's call: those after nbddp's last frame (which called it),
    as a traceback starts at the user's code; all of them when nbddp is not on the stack."""
    last_own = max((i for i, f in enumerate(frames) if f.own), default=-1)
    return list(frames[last_own + 1 :])


def describe(c: Collective) -> str:
    """``all_reduce (#41, [3])``: the op, its sequence number, its tensors' shapes."""
    shapes = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in c.sizes)
    return f"{c.op} (#{c.seq}" + (f", {shapes})" if shapes else ")")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Stacks:
    """Where every rank (and each of its threads) was when asked. ``str()`` is the roll-call;
    ``stacks[r]`` is rank r's report (None: it did not answer); ``odd_ones`` the ranks the
    roll-call blames."""

    def __init__(
        self,
        world_size: int,
        reports: Mapping[int, StackReport],
        taken_at: float | None = None,
        note: str = "",
    ) -> None:
        self.world_size = world_size
        self.reports: dict[int, StackReport] = dict(sorted(reports.items()))
        self.taken_at = taken_at if taken_at is not None else time.time()
        self.note = note
        self.places: dict[int, CodePlace | None] = {r: place_of(p) for r, p in self.reports.items()}
        self.groups = self._group()
        self.odd_ones, self.verdict = self._judge()

    # -- access ---------------------------------------------------------------------------

    def __getitem__(self, rank: int) -> StackReport | None:
        return self.reports.get(rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __len__(self) -> int:
        return self.world_size

    @property
    def missing(self) -> list[int]:
        """Ranks that did not answer."""
        return [r for r in range(self.world_size) if r not in self.reports]

    # -- the roll-call --------------------------------------------------------------------

    def _group(self) -> list[tuple[list[int], CodePlace | None]]:
        groups: dict[CodePlace | None, list[int]] = {}
        for rank, place in self.places.items():
            groups.setdefault(place, []).append(rank)
        return sorted(((ranks, p) for p, ranks in groups.items()), key=lambda g: (-len(g[0]), g[0]))

    def _judge(self) -> tuple[tuple[int, ...], str]:
        """Who is the odd one out, and the flight recorder's word on it."""
        groups = [(ranks, p) for ranks, p in self.groups if p is not None]
        if len(groups) < 2:
            return (), ""
        waiting = [(ranks, p) for ranks, p in groups if p.collective is not None]
        elsewhere = [r for ranks, p in groups if p.collective is None for r in ranks]
        if waiting and elsewhere:
            newest = max(p.collective.seq for _, p in waiting if p.collective is not None)
            op = next(
                p.collective.op for _, p in waiting if p.collective and p.collective.seq == newest
            )
            last = {r: self._last_seq(r) for r in elsewhere}
            behind = [r for r in elsewhere if (last[r] or 0) < newest]
            verdict = ""
            if behind:
                seen = "; ".join(self._history(r, last[r]) for r in behind)
                verdict = f"{_ranks(behind)} never entered {op} #{newest} ({seen})"
            return tuple(sorted(elsewhere)), verdict
        biggest = groups[0][0]
        majority = len(biggest) * 2 > sum(len(r) for r, _ in groups)
        odd = tuple(sorted(r for ranks, _ in groups[1:] for r in ranks)) if majority else ()
        verdict = "" if majority else "no place holds a majority of the ranks"
        if waiting and len(waiting) == len(groups):
            verdict = _collective_verdict(waiting)
        return odd, verdict

    def _history(self, rank: int, last: int | None) -> str:
        report = self.reports.get(rank)
        if report is not None and report.how != "asked":
            return f"rank {rank}'s collectives are unknown: only its stack was dumped"
        return f"rank {rank}'s last was #{last}" if last else f"rank {rank} entered none"

    def _last_seq(self, rank: int) -> int | None:
        report = self.reports.get(rank)
        return report.collectives[-1].seq if report and report.collectives else None

    def place(self, rank: int) -> str:
        """One rank's place in one line (``waits in all_reduce (#2, [3]) at Cell In[5],
        line 3``)."""
        if rank not in self.reports:
            return "did not answer"
        place = self.places.get(rank)
        if place is None:
            return "no Python stack of the main thread"
        if place.collective is not None:
            return f"waits in {place.waits} at {place.at}"
        return f"at {place.at} in {place.waits}"

    def rollcall(self) -> str:
        """The few lines that say where the ranks are, grouped, and who is the odd one out."""
        lines = []
        for ranks, place in self.groups:
            who = _ranks(ranks)
            if place is None:
                lines.append(f"{who}: no Python stack of the main thread")
            elif place.collective is not None:
                verb = "waits" if len(ranks) == 1 else "wait"
                lines.append(f"{who} {verb} in {place.waits} at {place.at}")
            else:
                verb = "is" if len(ranks) == 1 else "are"
                lines.append(f"{who} {verb} at {place.at} in {place.waits}")
        if self.missing:
            lines.append(f"{_ranks(self.missing)} did not answer")
        if self.odd_ones:
            verb = "is the odd one out" if len(self.odd_ones) == 1 else "are the odd ones out"
            lines.append(f"{_ranks(list(self.odd_ones))} {verb}")
        if self.verdict:
            lines.append(self.verdict)
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def format_rank(self, rank: int, frames: int = SHOWN_FRAMES) -> str:
        report = self.reports.get(rank)
        if report is None:
            return f"rank {rank}: no answer"
        how = "" if report.how == "asked" else " (faulthandler dump: its Python did not answer)"
        out = [f"rank {rank}{how}:"]
        for thread in report.threads:
            shown = _format_thread(thread, frames)
            if shown:
                out.append(f"  {thread.name}:")
                out += [f"    {line}" for line in shown]
        for child in report.children:
            for thread in child.threads:
                shown = _format_thread(thread, frames)
                if shown:
                    label = "DataLoader worker" if _is_loader(thread) else "child process"
                    out.append(f"  {label} (pid {child.pid}), {thread.name}:")
                    out += [f"    {line}" for line in shown]
        if report.collectives:
            out.append(
                "  last collectives: " + ", ".join(describe(c) for c in report.collectives[-3:])
            )
        out += [f"  note: {n}" for n in report.notes]
        if report.native:
            out.append("  native frames (py-spy):")
            out += [f"    {line}" for line in report.native.rstrip().splitlines()]
        return "\n".join(out)

    def __str__(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.taken_at))
        parts = [f"Where the {self.world_size} ranks were at {stamp}:", self.rollcall(), ""]
        parts += [self.format_rank(r) for r in range(self.world_size)]
        return "\n".join(parts)

    def __repr__(self) -> str:
        first = self.rollcall().splitlines()
        return f"<nbddp.Stacks of {self.world_size} ranks: {first[0] if first else 'no answer'}>"

    def _repr_pretty_(self, p: object, cycle: bool) -> None:  # IPython shows str()
        p.text(str(self))  # type: ignore[attr-defined]


def _collective_verdict(waiting: list[tuple[list[int], CodePlace]]) -> str:
    """Every rank waits in a collective, not all in the same one: say how they differ."""
    by_seq: dict[int, list[tuple[list[int], Collective]]] = {}
    for ranks, place in waiting:
        assert place.collective is not None
        by_seq.setdefault(place.collective.seq, []).append((ranks, place.collective))
    if len(by_seq) == 1:
        ((seq, entries),) = by_seq.items()
        kinds = "; ".join(f"{describe(c)} on {_ranks(r)}" for r, c in entries)
        return (
            f"collective #{seq} is not the same on every rank ({kinds}): the ranks call "
            "collectives in a different order, or with different shapes"
        )
    newest = max(by_seq)
    behind = sorted(
        r for seq, entries in by_seq.items() if seq < newest for rs, _ in entries for r in rs
    )
    return f"{_ranks(behind)} wait in an earlier collective than #{newest}: they skipped one"


def _is_loader(thread: ThreadStack) -> bool:
    return any(f.function == "_worker_loop" and "data" in f.filename for f in thread.frames)


def _format_thread(thread: ThreadStack, limit: int) -> list[str]:
    """The last ``limit`` frames that are not nbddp's, innermost last; [] for a thread with
    no code of the user's (torch's and Python's own helper threads)."""
    frames = _after_own(thread.frames)
    if not thread.main and not any(_is_user(f) for f in frames) and not _is_loader(thread):
        return []
    shown = frames[-limit:]
    lines = [] if len(shown) == len(frames) else [f"... {len(frames) - len(shown)} more"]
    for f in shown:
        text = source_line(f)
        lines.append(f"{location(f)} in {f.function}" + (f": {text}" if text else ""))
    return lines
