"""Numbers, durations and progress bars as text, shared by the HTML and the text views."""

from __future__ import annotations

import math

from nbddp.state.run import ShownBar


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_number(value: float) -> str:
    if value == 0 or math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    return f"{value:.4g}" if 1e-3 <= magnitude < 1e5 else f"{value:.3e}"


def bar_text(bar: ShownBar) -> str:
    """tqdm's format: ``desc  40%  4/10 [00:02<00:03, 2.00 it/s]``."""
    n, total, rate = bar.n, bar.total, bar.rate
    parts = [bar.desc + ":" if bar.desc else ""]
    if total:
        parts.append(f"{100 * n / total:3.0f}%")
        parts.append(f"{n}/{total}")
    else:
        parts.append(f"{n}")
    timing = format_duration(bar.elapsed)
    if total and rate:
        timing += f"<{format_duration(max(0, total - n) / rate)}"
    if rate:
        timing += f", {rate:.2f} it/s" if rate >= 1 else f", {1 / rate:.2f} s/it"
    parts.append(f"[{timing}]")
    return " ".join(p for p in parts if p)
