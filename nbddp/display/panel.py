"""The live panel in a notebook: one HTML output, updated in place by its display id, turned
into the static summary when the run ends. Its ``text/plain`` carries the same (``plain.py``).

An HTML output updated by ``update_display_data`` is what every Jupyter frontend renders:
JupyterLab and Notebook with or without the widgets extension, VS Code, Colab, Kaggle, and a
headless run (nbclient, papermill), which applies the updates to the saved notebook, so the
file ends with the summary. No widget manager is needed for the panel to show, so a frontend
that cannot render widgets ("Loading widget...") still shows the run live.

Widgets are used only for what HTML cannot do, and only where they can work: a background run
(``block=False``) gets a Stop button and a Where? button (``run.stacks()``'s roll-call, shown in
the panel), when ipywidgets is installed, below the panel, and blanked when the run ends; the
panel also says ``run.stop()`` and ``run.stacks()`` for frontends without widgets. A blocking
run has no button: the cell is busy, the kernel's interrupt (■) stops it. Nothing the panel
needs travels by comm: where a click cannot reach the kernel (Colab's outputs of an earlier
cell), ``run.stop()`` or ``nbddp.last_run().stop()`` in any cell stops the run.

A frontend that reads only ``text/plain`` and ignores display updates (jupyter console,
jupyter_client's ``execute_interactive``) sees the panel's first draw only. So the run's end
adds one output for it: its HTML is empty (a rich frontend draws nothing) and its text is the
summary's; an update then empties it, so that a rich frontend, and the notebook it saves, keep
one summary, the panel's, where it was. A reader of updates never sees the summary twice; a
reader of no updates sees it once, at the end.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from nbddp.display.html import panel_html, summary_html
from nbddp.display.plain import panel_text
from nbddp.display.rich import CellPublisher
from nbddp.state.run import RunSnapshot

MAX_RATE = 5.0  # renders per second: each sends the whole panel (tens of kB at most)
_BLANK = {"text/html": "", "text/plain": ""}  # an output emptied: nothing to draw or to read


class PanelView:
    max_rate = MAX_RATE

    def __init__(
        self,
        first: RunSnapshot,
        stop: Callable[[], object] | None,
        blocking: bool,
        where: Callable[[], object] | None = None,
    ) -> None:
        self._cell = CellPublisher()
        if not self._cell.in_kernel:
            raise RuntimeError("the panel needs a Jupyter kernel to show in")
        self._hint = (
            "stop: the kernel's interrupt button (■)"
            if blocking
            else "stop: run.stop() or nbddp.last_run().stop() in any cell · where each rank is: "
            "run.stacks()"
        )
        self._id = f"nbddp-panel-{uuid.uuid4().hex}"
        self._last = ""
        self._cell.publish(self._bundle(first), transient={"display_id": self._id})
        self._button: Any = None
        if not blocking and stop is not None:
            self._button = _stop_button(stop, self._cell, where)

    def _bundle(self, s: RunSnapshot) -> dict[str, Any]:
        markup = panel_html(s, self._hint)
        self._last = markup
        return {"text/html": markup, "text/plain": panel_text(s, self._hint)}

    def render(self, s: RunSnapshot) -> None:
        markup = panel_html(s, self._hint)
        if markup == self._last:
            return
        self._cell.publish(self._bundle(s), transient={"display_id": self._id}, update=True)

    def finish(self, s: RunSnapshot) -> None:
        summary = panel_text(s)
        try:
            for_text_readers = {"display_id": f"{self._id}-text"}
            self._cell.publish({"text/html": "", "text/plain": summary}, transient=for_text_readers)
            self._cell.publish(_BLANK, transient=for_text_readers, update=True)
            self._cell.publish(
                {"text/html": summary_html(s), "text/plain": summary},
                transient={"display_id": self._id},
                update=True,
            )
        finally:
            if self._button is not None:
                button, self._button = self._button, None
                button.finish()


class _StopButton:
    """A Stop button below the panel; blanked (its output emptied) when the run ends."""

    def __init__(
        self, stop: Callable[[], object], cell: CellPublisher, where: Callable[[], object] | None
    ) -> None:
        import ipywidgets as widgets

        self._cell = cell
        stop_button = widgets.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            tooltip="Terminate every worker of this run",
        )
        stop_button.on_click(lambda _button: stop())
        buttons = [stop_button]
        if where is not None:  # the roll-call, asked from a thread: the kernel's stays free
            where_button = widgets.Button(
                description="Where?", icon="search", tooltip="Show where each rank is now"
            )
            where_button.on_click(lambda _b: threading.Thread(target=where, daemon=True).start())
            buttons.append(where_button)
        self._buttons = buttons
        self._widget = widgets.HBox(buttons)
        self._id = f"nbddp-stop-{uuid.uuid4().hex}"
        bundle = self._widget._repr_mimebundle_()
        bundle["text/plain"] = "(stop: run.stop())"
        self._cell.publish(bundle, transient={"display_id": self._id})

    def finish(self) -> None:
        try:
            self._cell.publish(_BLANK, transient={"display_id": self._id}, update=True)
        finally:
            for widget in (*self._buttons, self._widget):
                widget.close()


def _stop_button(
    stop: Callable[[], object], cell: CellPublisher, where: Callable[[], object] | None = None
) -> _StopButton | None:
    try:
        return _StopButton(stop, cell, where)
    except Exception:  # no ipywidgets: the panel's hint says run.stop()
        return None
