"""What the user sees of a run: one state model (``state.py``), two renderers (``widget.py``
for notebooks, ``text.py`` elsewhere), and :class:`LiveDisplay`, which renders whenever the
state changed, at most ``MAX_RATE`` times a second, and once more at the end.

Any problem with the widget path falls back to text, like tqdm's notebook bar does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

from .state import RunState

MAX_RATE = 10.0  # renders per second, however fast training goes


class View(Protocol):
    def render(self) -> None: ...
    def finish(self) -> None: ...


def resolve_mode(mode: str) -> str:
    """'auto' is the widget inside a Jupyter kernel with ipywidgets, text otherwise."""
    if mode != "auto":
        return mode
    try:
        from IPython import get_ipython

        shell = get_ipython()
        import ipywidgets  # noqa: F401
    except ImportError:
        return "text"
    return "widget" if getattr(shell, "kernel", None) is not None else "text"


class LiveDisplay:
    """Drives one view from a background thread until :meth:`close`."""

    def __init__(self, state: RunState, mode: str, stop: Callable[[], None] | None,
                 blocking: bool) -> None:
        self.state = state
        self.mode = resolve_mode(mode)
        self._view: View | None = None
        if self.mode == "widget":
            try:
                from .widget import WidgetView

                self._view = WidgetView(state, stop, blocking)
            except Exception:  # no usable widget frontend: text is always possible
                self.mode = "text"
        if self.mode == "text":
            from .text import TextView

            self._view = TextView(state)
        self._closing = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if self._view is not None:
            self._thread = threading.Thread(target=self._loop, name="nbddp-display", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        state = self.state
        self._rendered = -1
        while True:
            with state.changed:
                state.changed.wait_for(self._due, timeout=1.0)  # at least 1/s: elapsed time
                if self._closing:
                    return
                self._rendered = state.version
            with contextlib.suppress(Exception):  # a display problem must never end the run
                self._view.render()
            self._closed.wait(1.0 / MAX_RATE)  # the throttle, cut short by close()

    def _due(self) -> bool:
        return self.state.version != self._rendered or self._closing

    def close(self) -> None:
        """Stop the loop and draw the final state (the static summary for the widget)."""
        with self.state.changed:
            self._closing = True
            self.state.changed.notify_all()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._view is not None:
            with contextlib.suppress(Exception):
                self._view.finish()
