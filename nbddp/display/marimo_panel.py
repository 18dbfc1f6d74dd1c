"""The live panel in a marimo notebook: the same HTML as in Jupyter, one item of the cell's
output, redrawn in place, and the static summary at the end.

marimo has no Jupyter kernel: a cell's output is marimo's own, and only marimo's threads may
write it (``mo.Thread``, made on the cell's thread, carries the cell's context; a write from
any other thread is dropped). So the live view's loop runs on a ``mo.Thread`` here, and draws
the summary there too (``own_thread``), never from the supervisor's thread that ends the run.

marimo also takes IPython's ``display(..., display_id=True)`` and ``DisplayHandle.update``
(marimo PR #4772), but its update replaces the cell's whole output, and it is marimo's thread
rule that decides what reaches the cell; the panel uses what ``mo.status.progress_bar`` uses
instead: a mutable ``mo.Html`` appended once (``mo.output.append``), its text changed and the
cell's output flushed, so other outputs of the cell stay. Where a marimo lacks that flush, the
panel replaces the cell's output (``mo.output.replace``).

The cell's output is its last expression when that is not None (marimo's rule): a cell that
ends with ``nbddp.notebook_launch(...)`` shows the result; ``result = ...`` keeps the panel.

Non-goal: a Stop button (the panel says ``run.stop()``; marimo's interrupt stops a blocking
run) and the ranks' rich output (its text is printed).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from nbddp.display.html import panel_html, summary_html
from nbddp.state.run import RunSnapshot

MAX_RATE = 5.0  # redraws per second, as the Jupyter panel


def in_marimo() -> bool:
    """Whether this runs in a marimo notebook's kernel (edit, run or export)."""
    marimo = sys.modules.get("marimo")
    if marimo is None:
        return False
    try:
        return bool(marimo.running_in_notebook())
    except Exception:  # an older or newer marimo without it: not one we know
        return False


class MarimoPanel:
    max_rate = MAX_RATE
    own_thread = True  # render and finish on the thread made by :meth:`thread`

    def __init__(self, first: RunSnapshot, blocking: bool) -> None:
        if not in_marimo():
            raise RuntimeError("the marimo panel needs a marimo notebook to show in")
        import marimo as mo

        self._mo = mo
        self._hint = (
            "stop: marimo's interrupt (■)"
            if blocking
            else "stop: run.stop() or nbddp.last_run().stop() in any cell · where each rank "
            "is: run.stacks()"
        )
        self._last = panel_html(first, self._hint)
        self._panel = mo.Html(self._last)
        mo.output.append(self._panel)
        self._flush: Callable[[], None] | None = None
        try:
            from marimo._runtime.output._output import flush

            self._flush = flush
        except ImportError:  # a marimo without it: the panel replaces the cell's output
            pass

    @staticmethod
    def thread(target: Callable[[], None], name: str) -> threading.Thread:
        """The live loop's thread: marimo's, made here on the cell's thread."""
        import marimo as mo

        thread: threading.Thread = mo.Thread(target=target, name=name, daemon=True)
        return thread

    def render(self, s: RunSnapshot) -> None:
        markup = panel_html(s, self._hint)
        if markup != self._last:
            self._draw(markup)

    def finish(self, s: RunSnapshot) -> None:
        self._draw(summary_html(s))

    def _draw(self, markup: str) -> None:
        self._last = markup
        panel: Any = self._panel
        panel._text = markup  # as mo.status.progress_bar updates itself
        if self._flush is not None:
            self._flush()
        else:
            self._mo.output.replace(panel)
