"""Rank output with terminal colours, as HTML for the panel and the saved summary.

Libraries colour their output (Lightning's model summary, coloured logs, rich; ipykernel sets
``FORCE_COLOR=1``, which the ranks inherit). The SGR codes become inline-styled spans: bold,
dim, italic, underline, strike-through, the 16 colours, the 256-colour palette and 24-bit
colour, foreground and background, and their resets. Every other control sequence (cursor
movement, line erasure, window titles) makes no sense in a log and is dropped. Carriage
returns were already resolved line by line (``pump.LineWindow``).

Why not a library: ``rich`` would do it, but Lightning switches its default progress bar to
rich's whenever rich is importable, for every user of nbddp; ``ansi2html`` is LGPL; nbconvert's
filter is not there where only ipykernel is. This is one escape family, parsed in one pass.
Where output goes to the cell itself (no panel), the notebook front end renders it natively.
"""

from __future__ import annotations

import functools
import html
import re

# CSI (ESC [ params final) and OSC (ESC ] ... BEL or ESC \), and lone escapes.
_ESCAPE = re.compile(r"\x1b\[([0-9;:?]*)([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")
_BASIC = ["#000000", "#cd3131", "#0dbc79", "#e5e510", "#2472c8", "#bc3fbc", "#11a8cd", "#e5e5e5"]
_BRIGHT = ["#666666", "#f14c4c", "#23d18b", "#f5f543", "#3b8eea", "#d670d6", "#29b8db", "#ffffff"]
_FLAGS = {
    1: "font-weight:bold",
    2: "opacity:0.7",
    3: "font-style:italic",
    4: "text-decoration:underline",
    9: "text-decoration:line-through",
}
_UNSET = {21: (1,), 22: (1, 2), 23: (3,), 24: (4,), 29: (9,)}


def _palette(index: int) -> str:
    """The xterm 256-colour palette."""
    if index < 8:
        return _BASIC[index]
    if index < 16:
        return _BRIGHT[index - 8]
    if index < 232:
        index -= 16
        levels = [0, 95, 135, 175, 215, 255]
        r, g, b = levels[index // 36], levels[index // 6 % 6], levels[index % 6]
        return f"#{r:02x}{g:02x}{b:02x}"
    grey = 8 + 10 * (index - 232)
    return f"#{grey:02x}{grey:02x}{grey:02x}"


class _Style:
    def __init__(self) -> None:
        self.flags: set[int] = set()
        self.colors: dict[str, str] = {}  # "color" / "background-color" -> css colour

    def apply(self, params: str) -> None:
        codes = [int(c) if c.isdigit() else 0 for c in params.replace(":", ";").split(";")]
        i = 0
        while i < len(codes):
            code = codes[i]
            if code == 0:
                self.flags.clear()
                self.colors.clear()
            elif code in _FLAGS:
                self.flags.add(code)
            elif code in _UNSET:
                self.flags.difference_update(_UNSET[code])
            elif 30 <= code <= 37 or 90 <= code <= 97:
                self.colors["color"] = (_BASIC if code < 90 else _BRIGHT)[code % 10]
            elif 40 <= code <= 47 or 100 <= code <= 107:
                self.colors["background-color"] = (_BASIC if code < 100 else _BRIGHT)[code % 10]
            elif code in (39, 49):
                self.colors.pop("color" if code == 39 else "background-color", None)
            elif code in (38, 48) and i + 1 < len(codes):
                target = "color" if code == 38 else "background-color"
                if codes[i + 1] == 5 and i + 2 < len(codes):
                    self.colors[target] = _palette(codes[i + 2] % 256)
                    i += 2
                elif codes[i + 1] == 2 and i + 4 < len(codes):
                    r, g, b = (min(255, c) for c in codes[i + 2 : i + 5])
                    self.colors[target] = f"#{r:02x}{g:02x}{b:02x}"
                    i += 4
            i += 1

    def css(self) -> str:
        parts = [_FLAGS[flag] for flag in sorted(self.flags)]
        parts += [f"{name}:{value}" for name, value in self.colors.items()]
        return ";".join(parts)


@functools.lru_cache(maxsize=8)  # the panel redraws far more often than output changes
def to_html(text: str) -> str:
    if "\x1b" not in text:
        return html.escape(text)
    style, out, position, opened = _Style(), [], 0, False
    for match in _ESCAPE.finditer(text):
        out.append(html.escape(text[position : match.start()]))
        position = match.end()
        if match.group(2) != "m":
            continue  # not a colour: dropped
        style.apply(match.group(1) or "0")
        if opened:
            out.append("</span>")
            opened = False
        css = style.css()
        if css:
            out.append(f'<span style="{css}">')
            opened = True
    out.append(html.escape(text[position:]))
    if opened:
        out.append("</span>")
    return "".join(out)


def to_text(text: str) -> str:
    """The text without its escape sequences, as a reader of plain text wants it."""
    return _ESCAPE.sub("", text) if "\x1b" in text else text
