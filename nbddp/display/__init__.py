"""What the user sees of a run: one state model (``state.py``), two renderers (``panel.py``,
an HTML output updated in place, for Jupyter notebooks, and ``marimo_panel.py``, the same HTML
in a marimo notebook; ``text.py`` elsewhere), and
:class:`LiveDisplay`, which renders a snapshot of the state whenever it changed, at most
``MAX_RATE`` times a second (or the view's own ``max_rate``), and once more at the end.

A view that fails does not fail silently: the first error is reported once as an
``NbddpWarning`` (with its traceback under ``NBDDP_DEBUG=1``) and the text view takes over,
as tqdm's notebook bar falls back to text. ``display='widget'`` names the panel (its
name from when it was made of widgets).
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Protocol

from nbddp.display.text import TextView
from nbddp.errors import NbddpWarning
from nbddp.state.run import RunSnapshot, RunState

MAX_RATE = 10.0  # renders per second, however fast training goes


class View(Protocol):
    def render(self, snapshot: RunSnapshot) -> None: ...
    def finish(self, snapshot: RunSnapshot) -> None: ...


def resolve_mode(mode: str) -> str:
    """'auto' is the live panel inside a Jupyter kernel or a marimo notebook, text elsewhere
    (the plan has already put ``NBDDP_DISPLAY``'s choice in place of 'auto')."""
    if mode != "auto":
        return mode
    from nbddp.display.marimo_panel import in_marimo

    if in_marimo():
        return "widget"
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return "text"
    return "widget" if getattr(shell, "kernel", None) is not None else "text"


def _panel(
    first: RunSnapshot,
    stop: Callable[[], object] | None,
    blocking: bool,
    where: Callable[[], object] | None,
) -> View:
    """The live panel where this runs: a Jupyter kernel's, or a marimo notebook's."""
    from nbddp.display.marimo_panel import MarimoPanel, in_marimo

    if in_marimo():
        return MarimoPanel(first, blocking)
    from nbddp.display.panel import PanelView

    return PanelView(first, stop, blocking, where)


class LiveDisplay:
    """Drives one view from a background thread until :meth:`close`."""

    def __init__(
        self,
        state: RunState,
        mode: str,
        stop: Callable[[], object] | None,
        blocking: bool,
        where: Callable[[], object] | None = None,
    ) -> None:
        self.state = state
        self.mode = resolve_mode(mode)
        self._view: View | None = None
        self._failed: View | None = None
        if self.mode == "widget":
            try:
                self._view = _panel(state.snapshot(), stop, blocking, where)
            except Exception:  # in no notebook: text is always possible
                self.mode = "text"
        if self.mode == "text":
            self._view = TextView()
        self._closing = False
        self._rendered = -1
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        # A view whose frontend takes output from its own threads only (marimo) is also
        # finished on the loop's thread, not on the one that ends the run.
        self._finishes_in_loop = bool(getattr(self._view, "own_thread", False))
        if self._view is not None:
            make = getattr(self._view, "thread", threading.Thread)
            self._thread = make(target=self._loop, name="nbddp-display")
            self._thread.daemon = True
            self._thread.start()

    def _loop(self) -> None:
        state = self.state
        while True:
            with state.changed:
                state.changed.wait_for(self._due, timeout=1.0)  # at least 1/s: elapsed time
                if self._closing:
                    break
                self._rendered = state.version
            self._render(state.snapshot())
            rate = getattr(self._view, "max_rate", MAX_RATE)
            self._closed.wait(1.0 / rate)  # the throttle, cut short by close()
        if self._finishes_in_loop:
            self._finish(state.snapshot(final=True))

    def _due(self) -> bool:
        return self.state.version != self._rendered or self._closing

    def _render(self, snapshot: RunSnapshot) -> None:
        view = self._view
        if view is None:
            return
        try:
            view.render(snapshot)
        except Exception as exc:
            self._fall_back(view, exc)

    def _fall_back(self, view: View, exc: Exception) -> None:
        """The first error of a view: say so once, and let the text view take over."""
        if os.environ.get("NBDDP_DEBUG") == "1":
            detail = "\n" + "".join(traceback.format_exception(exc))
        else:
            detail = " (set NBDDP_DEBUG=1 for its traceback)"
        warnings.warn(
            f"nbddp's live {self.mode} view failed with {type(exc).__name__}: {exc}; the "
            f"run goes on, shown as text from now on{detail}",
            NbddpWarning,
            stacklevel=2,
        )
        self._failed = view
        self._view = None if isinstance(view, TextView) else TextView()
        self.mode = "text" if self._view is not None else "none"

    def close(self) -> None:
        """Stop the loop and draw the final state (the static summary for the widget)."""
        with self.state.changed:
            self._closing = True
            self.state.changed.notify_all()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self._finishes_in_loop:
            self._finish(self.state.snapshot(final=True))

    def _finish(self, final: RunSnapshot) -> None:
        if self._failed is not None:  # best effort: replace the stale panel by the summary
            with contextlib.suppress(Exception):
                self._failed.finish(final)
        if self._view is not None:
            try:
                self._view.finish(final)
            except Exception as exc:  # the run's outcome matters more than its summary
                self._fall_back(self._view, exc)
