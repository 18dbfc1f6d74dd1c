"""The ranks' matplotlib backend (``MPLBACKEND=module://nbddp.worker.output.figures``, set for ranks
launched from a notebook whose matplotlib would use the inline backend): Agg for drawing, and
a ``show()`` that sends each open figure to the notebook cell as a PNG and closes it, as the
inline backend does in a kernel. Figures left open when the run (or ``%%ddp`` cell) ends are
shown then (``rich.finish``).

Non-goal: interactive figures (ipympl's widget backend needs a frontend connection).
"""

from __future__ import annotations

from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg

from nbddp.worker.output import rich

FigureCanvas = FigureCanvasAgg


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show()``: every open figure into the cell, then closed."""
    rich.show_figures()
