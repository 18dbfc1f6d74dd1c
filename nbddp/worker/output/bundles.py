"""Objects as MIME bundles, found as IPython's formatters find them, without IPython: what a
rank sends for ``display(obj)``. Binary data is base64-encoded, as Jupyter keeps it.

Non-goal: IPython's type-registered printers (``for_type``) of the kernel, which a rank lacks.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

_TEXT_TYPES = ("text/", "application/json", "application/javascript", "image/svg+xml")


def format_object(
    obj: Any, include: Any = None, exclude: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``obj``'s MIME bundle and metadata, found as IPython's formatters find them:
    ``_ipython_display_`` (which displays by itself), ``_repr_mimebundle_``, the ``_repr_*_``
    methods, a matplotlib figure as a PNG, and ``repr`` for text."""
    show_itself = getattr(obj, "_ipython_display_", None)
    if callable(show_itself) and not isinstance(obj, type):
        show_itself()
        return {}, {}
    data: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    if not isinstance(obj, type):  # a class's own methods are no representation of it
        _from_mimebundle(obj, include, exclude, data, metadata)
        _from_repr_methods(obj, data, metadata)
    figure = sys.modules.get("matplotlib.figure")
    if figure is not None and isinstance(obj, figure.Figure) and "image/png" not in data:
        png = _figure_png(obj)
        if png is not None:
            data["image/png"] = png
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(obj)
        except Exception as exc:
            data["text/plain"] = f"<{type(obj).__name__} object; repr() raised {exc!r}>"
    if include:
        data = {k: v for k, v in data.items() if k in include}
    if exclude:
        data = {k: v for k, v in data.items() if k not in exclude}
    return data, metadata


def _from_mimebundle(
    obj: Any, include: Any, exclude: Any, data: dict[str, Any], metadata: dict[str, Any]
) -> None:
    """What ``obj._repr_mimebundle_`` gives (a bundle, or a bundle and its metadata)."""
    bundle = getattr(obj, "_repr_mimebundle_", None)
    if not callable(bundle):
        return
    try:
        found = bundle(include=include, exclude=exclude)
    except Exception:
        found = None
    if isinstance(found, tuple):
        found, more = found
        metadata.update(more or {})
    data.update(found or {})


def _from_repr_methods(obj: Any, data: dict[str, Any], metadata: dict[str, Any]) -> None:
    """The ``_repr_*_`` methods' values for the types the bundle does not have yet."""
    for mime, name in _REPR_METHODS.items():
        method = getattr(obj, name, None)
        if mime in data or not callable(method):
            continue
        try:
            value = method()
        except Exception:
            continue
        if isinstance(value, tuple):
            value, more = value
            metadata[mime] = more
        if value is not None:
            data[mime] = value


def _figure_png(figure: Any) -> bytes | None:
    """A matplotlib figure as the inline backend shows it (a tight PNG); None when empty."""
    import io

    if not figure.axes and not figure.lines and not figure.images:
        return None
    stream = io.BytesIO()
    figure.canvas.print_figure(stream, format="png", bbox_inches="tight")
    return stream.getvalue()


_REPR_METHODS = {
    "text/html": "_repr_html_",
    "text/markdown": "_repr_markdown_",
    "image/svg+xml": "_repr_svg_",
    "image/png": "_repr_png_",
    "image/jpeg": "_repr_jpeg_",
    "text/latex": "_repr_latex_",
    "application/json": "_repr_json_",
}


def portable(bundle: dict[str, Any]) -> dict[str, Any]:
    """A bundle as Jupyter stores it: binary data base64-encoded, JSON-able values."""
    out: dict[str, Any] = {}
    for key, value in bundle.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            if key.startswith(_TEXT_TYPES):
                out[key] = raw.decode("utf-8", "replace")
            else:
                out[key] = base64.b64encode(raw).decode("ascii")
        else:
            out[key] = value
    return out


def note(text: str) -> dict[str, Any]:
    style = "font-family:monospace;font-size:12px;color:#d97706"
    return {"text/plain": text, "text/html": f'<div style="{style}">{_escape(text)}</div>'}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
