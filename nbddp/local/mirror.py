"""The notebook's modules, mirrored into the pre-warmed helper as the kernel imports them.

A fork launcher's ranks start with every module the notebook imported; nbddp's are forked by a
helper that is no fork of the kernel. So the kernel tells the helper what it imported: when
nbddp starts the helper, after each cell (IPython's ``post_run_cell``, in the background) and
at each launch (before its ranks are asked for, so they have it). The helper imports them
between launches (``worker/helper/preload.py`` says what it never imports and how it stays safe).
Only a notebook's (an IPython kernel or shell): a script's ranks start with what the first
training step needs and, from the second launch on, with what the first one's ranks imported.

Non-goal: what a cell defines (it travels by value with each launch), or modules built in
memory (a fresh process cannot import them).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable

from nbddp.worker.helper.preload import excluded, importable


class Mirror:
    """What one helper was told of: each module of the kernel at most once."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.lock = threading.Lock()  # one look and its sending at a time, in order

    def new_modules(self, exclude: Iterable[str]) -> list[str]:
        """The kernel's modules not seen yet that the helper may import, in import order."""
        exclude = tuple(exclude)
        modules = sys.modules.copy()  # one atomic look: another thread may be importing
        names = [
            name
            for name, module in modules.items()
            if name not in self.seen and not excluded(name, exclude) and importable(name, module)
        ]
        self.seen.update(modules)
        return names


def kernel_path() -> list[str]:
    """The kernel's import path, as a rank adopts it (its working directory for '')."""
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


_registered: list[Callable[[object], None]] = []


def _shell() -> object | None:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def in_a_notebook() -> bool:
    """This process is a Jupyter kernel or an IPython shell: it has a notebook's modules to
    mirror (a script's or a test runner's are its own business)."""
    return _shell() is not None


def after_each_cell(callback: Callable[[], None]) -> None:
    """Call ``callback`` after each cell of the IPython shell this process runs (once)."""
    shell = _shell()
    if shell is None or _registered:
        return

    def post_run_cell(result: object) -> None:
        callback()

    shell.events.register("post_run_cell", post_run_cell)  # type: ignore[attr-defined]
    _registered.append(post_run_cell)
