"""The panel as plain text: its ``text/plain``, at every update and at the end.

A frontend or a converter that reads only ``text/plain`` (jupyter console, jupyter_client's
``execute_interactive``, ``jupyter nbconvert --to markdown``, a saved notebook read as text)
gets what the panel shows, in the panel's order: the status line, the stall banner or the last
roll-call, the progress bars, the averaged metrics, rank 0's output (its last lines live, with
how many earlier ones are not shown; the saved summary's first and last lines at the end, with
the file that holds them all), and how to stop the run. Pure: a function of a snapshot.

Non-goal: the charts (the metrics' last values are the text's part of them) and colours
(escape sequences are dropped).
"""

from __future__ import annotations

from nbddp.display import ansi
from nbddp.display.text import stall_text
from nbddp.state.format import bar_text, format_number
from nbddp.state.run import RunSnapshot


def panel_text(s: RunSnapshot, hint: str = "") -> str:
    """Everything the panel (live, or its summary once ``s.ended``) shows, as text."""
    parts = [_status(s), _where(s), _bars(s), _metrics(s), _output(s)]
    if hint and not s.ended:
        parts.append(hint)
    return "\n".join(part for part in parts if part)


def _status(s: RunSnapshot) -> str:
    line = f"nbddp run {s.status} · {s.where} ({s.backend}) · {s.elapsed:.1f} s"
    if s.finishing_line:
        line += f" · {s.finishing_line}"
    if s.pdb_line:
        line += f" · {s.pdb_line}"
    lines = [line]
    if s.error_line:
        lines.append(f"  {s.error_line}")
    if s.warning:
        lines.append(f"  warning: {s.warning}")
    lines += [f"  {note}" for note in s.recovery]
    return "\n".join(lines)


def _where(s: RunSnapshot) -> str:
    if not s.rollcall or (s.ended and s.stalled_since is None):
        return ""
    if s.stalled_since is not None:
        return stall_text(s)
    return "\n".join(f"  {line}" for line in s.rollcall.splitlines())


def _bars(s: RunSnapshot) -> str:
    return "\n".join("  " * bar.level + bar_text(bar) for bar in s.bars)


def _metrics(s: RunSnapshot) -> str:
    if not s.latest:
        return ""
    ranks = f"{s.world_size} rank{'s' if s.world_size > 1 else ''}"
    width = max(len(name) for name in s.latest)
    lines = [f"metrics, averaged over {ranks}, step {s.step}:"]
    lines += [f"  {name:<{width}}  {format_number(value)}" for name, value in s.latest.items()]
    lines += [f"  {note}" for note in s.notes]
    return "\n".join(lines)


def _output(s: RunSnapshot) -> str:
    if not (s.output or s.output_head):
        return ""
    lines = ["rank 0 output:"]
    if s.output_dropped and not s.output_head:
        lines.append(f"… {s.output_dropped:,} earlier lines not shown")
    body = ansi.to_text(s.output_head)
    if s.output_head and s.output_dropped:
        body += (
            f"… {s.output_dropped:,} lines not shown here; all of rank 0's output: "
            f"{s.output_file or 'not saved'}\n"
        )
    body += ansi.to_text(s.output)
    lines.append(body.rstrip("\n"))
    return "\n".join(lines)
