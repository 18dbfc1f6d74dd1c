"""The live panel as ipywidgets, replaced by its static HTML summary when the run ends.

The panel is shown through a display handle whose bundle holds the widget; at the end the
same handle is updated to plain HTML, so the saved notebook keeps the result where widget
state is gone (GitHub, nbviewer, after a restart). Parts are separate HTML widgets, and only
those whose markup changed are sent.
"""

from __future__ import annotations

from collections.abc import Callable

from nbddp.display.html import (
    bars_html,
    chart_svg,
    header_html,
    metrics_html,
    output_html,
    summary_html,
)
from nbddp.display.state import RunSnapshot

_PARTS = (header_html, bars_html, metrics_html, chart_svg, output_html)


class WidgetView:
    def __init__(
        self, first: RunSnapshot, stop: Callable[[], object] | None, blocking: bool
    ) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        self._html = [widgets.HTML() for _ in _PARTS]
        self._button = widgets.Button(
            description="Stop",
            icon="stop",
            button_style="danger",
            layout=widgets.Layout(width="auto"),
            tooltip=(
                "This cell is busy until the run ends: use the kernel's interrupt button "
                "(■) to stop it."
                if blocking
                else "Terminate every worker of this run"
            ),
            disabled=blocking,
        )
        if stop is not None:
            self._button.on_click(lambda _button: stop())
        header, bars, metrics, chart, output = self._html
        self._box = widgets.VBox(
            [
                widgets.HBox(
                    [header, self._button], layout=widgets.Layout(align_items="center", gap="12px")
                ),
                bars,
                widgets.HBox([metrics, chart], layout=widgets.Layout(gap="16px")),
                output,
            ]
        )
        self._box.add_class("nbddp-panel")
        self.render(first)
        bundle = self._box._repr_mimebundle_()
        bundle["text/plain"] = f"nbddp run ({first.status})"
        self._handle = display(bundle, raw=True, display_id=True)  # type: ignore[no-untyped-call]

    def render(self, s: RunSnapshot) -> None:
        for widget, part in zip(self._html, _PARTS, strict=True):
            markup = part(s)
            if widget.value != markup:
                widget.value = markup
        if s.ended:
            self._button.disabled = True

    def finish(self, s: RunSnapshot) -> None:
        try:
            self.render(s)
        finally:
            self._handle.update({"text/html": summary_html(s), "text/plain": _plain(s)}, raw=True)
            self._close()

    def _close(self) -> None:
        for widget in [*self._html, self._button, *self._box.children, self._box]:
            widget.close()


def _plain(s: RunSnapshot) -> str:
    line = f"nbddp run {s.status} in {s.elapsed:.1f} s"
    if s.error_line:
        line += f": {s.error_line}"
    return line
