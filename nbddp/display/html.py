"""HTML for the panel's parts, used live by the widget and frozen into the static summary.

Each part is a pure function of a :class:`~nbddp.state.run.RunSnapshot`. The markup is
self-contained (inline styles, inline SVG charts, no scripts), so a saved notebook shows the
result on GitHub, in nbviewer and after a kernel restart, where widget state is gone.
"""

from __future__ import annotations

import html
import math
import os
import time

from nbddp.display import ansi
from nbddp.state.format import bar_text, format_duration, format_number
from nbddp.state.run import RunSnapshot

_COLORS = {
    "starting": "#6b7280",
    "running": "#2563eb",
    "succeeded": "#16a34a",
    "failed": "#dc2626",
    "stopped": "#d97706",
}
_LINE_COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#d97706", "#0891b2"]
_FONT = "font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px;"


def header_html(s: RunSnapshot) -> str:
    color = _COLORS.get(s.status, "#6b7280")
    label = {"succeeded": "done", "failed": "failed", "stopped": "stopped"}.get(s.status, s.status)
    where = f"{html.escape(s.where)} ({s.backend})"
    line = (
        f'<span style="background:{color};color:white;border-radius:3px;padding:1px 6px">'
        f"{label}</span> nbddp · {where} · {format_duration(s.elapsed)}"
    )
    if s.ended and s.status == "succeeded":
        line += f" · finished in {s.elapsed:.1f} s"
    if s.finishing_line:
        line += f" · {s.finishing_line}"
    if s.pdb_line:
        line += f' · <span class="nbddp-pdb">{html.escape(s.pdb_line)}</span>'
    if s.error_line:
        line += (
            f'<div style="color:{_COLORS["failed"]};margin-top:2px">'
            f"{html.escape(s.error_line)}</div>"
        )
    if s.warning:
        line += (
            f'<div class="nbddp-warning" style="color:{_COLORS["stopped"]};margin-top:2px">'
            f"⚠ {html.escape(s.warning)}</div>"
        )
    for note in s.recovery:  # a graceful stop under way, restarts, checkpoints
        color = _COLORS["stopped"] if note.startswith(("stopping", "restart")) else "#6b7280"
        line += (
            f'<div class="nbddp-recovery" style="color:{color};margin-top:2px">'
            f"{html.escape(note)}</div>"
        )
    return f'<div style="{_FONT}">{line}</div>'


def bars_html(s: RunSnapshot) -> str:
    if not s.bars:
        return ""
    failed = s.status in ("failed", "stopped")
    rows = []
    for bar in s.bars:
        color = _COLORS["failed"] if failed and not bar.closed else _COLORS["running"]
        if bar.closed and not failed:
            color = _COLORS["succeeded"]
        value = bar.n if bar.total else 0
        maximum = bar.total or 1
        indent = 16 * bar.level
        rows.append(
            f'<div class="nbddp-bar" style="{_FONT}margin-left:{indent}px;display:flex;'
            f'align-items:center;gap:8px">'
            f'<progress value="{value}" max="{maximum}" style="width:240px;accent-color:{color}">'
            f"</progress><span>{html.escape(bar_text(bar))}</span></div>"
        )
    return "".join(rows)


def metrics_html(s: RunSnapshot) -> str:
    if not s.latest:
        return ""
    cells = "".join(
        f'<tr><td style="padding:1px 12px 1px 0">{html.escape(name)}</td>'
        f'<td style="text-align:right">{format_number(value)}</td></tr>'
        for name, value in s.latest.items()
    )
    caption = f"averaged over {s.world_size} rank{'s' if s.world_size > 1 else ''}, step {s.step}"
    notes = "".join(f'<div style="color:#d97706">{html.escape(n)}</div>' for n in s.notes)
    return (
        f'<div style="{_FONT}color:#6b7280;white-space:nowrap">{caption}</div>'
        f'<table class="nbddp-metrics" style="{_FONT}border-collapse:collapse">'
        f'<tr><th style="text-align:left;padding-right:12px">metric</th>'
        f'<th style="text-align:right">mean</th></tr>{cells}</table>{notes}'
    )


def chart_svg(s: RunSnapshot) -> str:
    """One small line chart per metric, against step."""
    charts = [
        _line_chart(name, points, _LINE_COLORS[index % len(_LINE_COLORS)])
        for index, (name, points) in enumerate(s.series.items())
    ]
    charts = [chart for chart in charts if chart]
    if not charts:
        return ""
    return f'<div style="display:flex;flex-wrap:wrap;gap:8px">{"".join(charts)}</div>'


def _line_chart(
    name: str, points: list[tuple[float, float]], color: str, width: int = 260, height: int = 110
) -> str:
    points = [(x, y) for x, y in points if math.isfinite(y)]
    if len(points) < 2:
        return ""
    x0, x1 = points[0][0], points[-1][0]
    y0, y1 = min(y for _, y in points), max(y for _, y in points)
    if y1 == y0:  # a constant: a narrow band around it, not ±0.5
        pad = abs(y0) * 0.1 or 0.5
        y0, y1 = y0 - pad, y1 + pad
    left, bottom, top = 44, 16, 14
    w, h = width - left - 4, height - bottom - top
    path = " ".join(
        f"{left + (x - x0) / ((x1 - x0) or 1) * w:.1f},{top + (1 - (y - y0) / (y1 - y0)) * h:.1f}"
        for x, y in points
    )
    return (
        f'<svg class="nbddp-chart" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg" style="{_FONT}">'
        f'<text x="{left}" y="10" font-size="11">{html.escape(name)}</text>'
        f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#e5e7eb"/>'
        f'<text x="{left - 3}" y="{top + 8}" font-size="9" text-anchor="end">'
        f"{_axis(y1)}</text>"
        f'<text x="{left - 3}" y="{top + h}" font-size="9" text-anchor="end">'
        f"{_axis(y0)}</text>"
        f'<text x="{left}" y="{height - 3}" font-size="9">{int(x0)}</text>'
        f'<text x="{left + w}" y="{height - 3}" font-size="9" text-anchor="end">'
        f"step {int(x1)}</text>"
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/></svg>'
    )


def _axis(value: float) -> str:
    """A y-axis label that fits the chart's 44-pixel margin (at most ~7 characters)."""
    return f"{value:.3g}"


def output_html(s: RunSnapshot) -> str:
    """Rank 0's output: live, its last lines; in the saved summary, its first and last lines
    and, when lines between them are left out, a link to the file that holds them all."""
    if not (s.output or s.output_head):
        return ""
    dropped = (
        f'<div style="color:#6b7280">… {s.output_dropped} earlier lines not shown</div>'
        if s.output_dropped and not s.output_head
        else ""
    )
    middle = _left_out(s) if s.output_head and s.output_dropped else ""
    return (
        f'<details open><summary style="{_FONT}color:#6b7280">rank 0 output</summary>'
        f'{dropped}<pre class="nbddp-output" style="{_FONT}max-height:240px;overflow:auto;'
        f'margin:2px 0">{ansi.to_html(s.output_head)}{middle}{ansi.to_html(s.output)}</pre>'
        "</details>"
    )


def _left_out(s: RunSnapshot) -> str:
    """The line between the first and the last lines: how many are left out, and where all
    of them are (a link relative to the kernel's directory, the notebook's, when inside it)."""
    where = html.escape(s.output_file)
    relative = os.path.relpath(s.output_file) if s.output_file else ""
    if relative and not relative.startswith(".."):
        where = f'<a href="{html.escape(relative)}" target="_blank">{html.escape(relative)}</a>'
    return (
        f'<span style="color:#6b7280">… {s.output_dropped:,} lines not shown here; '
        f"all of rank 0's output: {where or 'not saved'}</span>\n"
    )


def where_html(s: RunSnapshot) -> str:
    """The roll-call: the stall banner (amber) or the answer to the Where? button."""
    if not s.rollcall:
        return ""
    pre = (
        f'<pre class="nbddp-where" style="{_FONT}margin:2px 0;white-space:pre-wrap">'
        f"{html.escape(s.rollcall)}</pre>"
    )
    if s.stalled_since is None:
        return f'<div style="{_FONT}color:#374151">{pre}</div>'
    since = time.strftime("%H:%M:%S", time.localtime(s.stalled_since))
    quiet = format_duration(max(0.0, time.time() - s.stalled_since))
    head = (
        f"No rank made progress since {since} ({quiet}): no log row, bar, output or CPU "
        "time. Where each rank is:"
    )
    tail = "" if s.ended else "Nothing was stopped: the run goes on until it ends or you stop it."
    return (
        f'<div class="nbddp-stall" style="{_FONT}background:#fffbeb;border:1px solid #f59e0b;'
        f'border-radius:4px;padding:4px 8px"><b>{html.escape(head)}</b>{pre}'
        f'<span style="color:#6b7280">{tail}</span></div>'
    )


def panel_html(s: RunSnapshot, hint: str) -> str:
    """The live panel: the summary's parts, and how to stop the run."""
    parts = [
        header_html(s),
        where_html(s),
        bars_html(s),
        metrics_html(s),
        chart_svg(s),
        output_html(s),
    ]
    body = "".join(f"<div style='margin:4px 0'>{p}</div>" for p in parts if p)
    hint_line = f'<div style="{_FONT}color:#9ca3af">{html.escape(hint)}</div>'
    style = "border-left:3px solid #2563eb;padding-left:8px"
    return f'<div class="nbddp-panel" style="{style}">{body}{hint_line}</div>'


def summary_html(s: RunSnapshot) -> str:
    """The whole panel as static HTML: what a saved notebook keeps (with the stall banner
    of a run that ended stalled)."""
    stall = where_html(s) if s.stalled_since is not None else ""
    parts = [header_html(s), stall, bars_html(s), metrics_html(s), chart_svg(s), output_html(s)]
    body = "".join(f"<div style='margin:4px 0'>{p}</div>" for p in parts if p)
    style = "border-left:3px solid #e5e7eb;padding-left:8px"
    return f'<div class="nbddp-summary" style="{style}">{body}</div>'
