"""Rich output from a rank: what ``display()``, a matplotlib figure or a ``%%ddp`` cell's last
value would show in a notebook cell travels to the kernel as a MIME bundle (``Display``), and
the kernel shows it in the cell that launched the run.

A rank has no IPython shell, so IPython's display functions would only print a repr. Inside a
rank they are replaced, right after ``IPython.core.display_functions`` is imported (and before
the job is unpickled, so a ``display`` the job captured resolves to ours), by functions with
the same signatures: ``display``, ``update_display``, ``publish_display_data``,
``clear_output``; ``display`` is also a builtin, as IPython makes it in the kernel. Objects are
formatted as IPython's formatters do it (``_ipython_display_``, ``_repr_mimebundle_``, the
``_repr_*_`` methods, a matplotlib figure as a PNG, ``repr`` for text), without importing any
of IPython: a rank that shows nothing pays nothing.

What is shown follows ``output``: rank 0's by default, every rank's with ``output="all"``
(the kernel labels them), nobody's with ``"none"``. At most ``MAX_DISPLAYS`` new outputs per
rank and run reach the notebook (updates in place do not count), each at most
``MAX_DISPLAY_BYTES``: one note says so where the limit is reached, and later outputs are
dropped on the rank, so a loop that plots every step cannot flood the kernel or the notebook.

``clear_output()`` clears this rank's rich outputs of the run (a rank cannot clear the cell's
other outputs, the panel among them); ``clear_output(wait=True)`` then ``display(x)``, the live
plot idiom, replaces the rank's last output in place.

Non-goals: widgets (a rank has no comm to the frontend) and javascript that needs a kernel.
"""

from __future__ import annotations

import builtins
import json
import sys
import threading
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbddp.wire.messages import MAX_DISPLAY_BYTES, MAX_DISPLAYS, Display
from nbddp.worker.output.bundles import format_object, note, portable
from nbddp.worker.streams import flush_output

Send = Callable[[Display], None]


class _Publisher:
    """This rank's channel for rich output, for the current run (or session task)."""

    def __init__(self, send: Send, rank: int, output: str) -> None:
        self.send = send
        self.rank = rank
        self.shown = output == "all" or (output == "rank0" and rank == 0)
        self.count = 0  # new outputs sent this run
        self.dropped = 0
        self.since_clear: list[str] = []  # display ids of the outputs clear_output clears
        self.clear_pending = False  # clear_output(wait=True): the next display replaces
        self.lock = threading.Lock()

    def publish(
        self,
        data: dict[str, Any],
        metadata: dict[str, Any] | None,
        transient: dict[str, Any] | None,
        update: bool,
    ) -> None:
        if not self.shown or not data:
            return
        data = portable(data)
        metadata = portable(metadata or {})
        transient = dict(transient or {})
        size = len(json.dumps(data, default=str))
        if size > MAX_DISPLAY_BYTES:
            data = note(
                f"nbddp: an output of {size / 2**20:.1f} MiB from rank {self.rank} is not "
                f"shown (at most {MAX_DISPLAY_BYTES / 2**20:.0f} MiB each); save it to a file "
                "instead."
            )
            metadata = {}
        with self.lock:
            if not update:
                replaced = self._replacing()
                if replaced is not None and "display_id" not in transient:
                    transient["display_id"] = replaced
                    update = True
                else:
                    if self.count >= MAX_DISPLAYS:
                        self._drop()
                        return
                    self.count += 1
                    transient.setdefault("display_id", f"nbddp-{uuid.uuid4().hex}")
                    self.since_clear.append(transient["display_id"])
            self._send(Display(self.rank, data, metadata, transient, update))

    def _send(self, message: Display) -> None:
        flush_output()  # what the rank printed before goes before, in the cell
        _shown.clear()
        self.send(message)
        if not message.update:  # what this rank prints next must come after it
            _shown.wait(SHOWN_WAIT)

    def _replacing(self) -> str | None:
        """After ``clear_output(wait=True)``: the output the next one replaces (the others
        cleared are blanked now)."""
        if not self.clear_pending:
            return None
        self.clear_pending = False
        if not self.since_clear:
            return None
        first, *rest = self.since_clear
        self._blank(rest)
        self.since_clear = [first]
        return first

    def clear(self, wait: bool) -> None:
        with self.lock:
            if wait:
                self.clear_pending = True
                return
            self._blank(self.since_clear)
            self.since_clear = []
            self.clear_pending = False

    def _blank(self, display_ids: list[str]) -> None:
        for display_id in display_ids:
            self._send(Display(self.rank, {"text/plain": ""}, {}, {"display_id": display_id}, True))

    def _drop(self) -> None:
        self.dropped += 1
        if self.dropped == 1:
            self._send(
                Display(
                    self.rank,
                    note(
                        f"nbddp: rank {self.rank} showed {MAX_DISPLAYS} rich outputs, the most "
                        "one run shows; later ones are not shown. Update one output in place "
                        "instead (display(..., display_id=True) and its .update()), or save "
                        "figures to files."
                    ),
                    {},
                    {},
                    False,
                )
            )


_publisher: _Publisher | None = None
_shown = threading.Event()  # the kernel's Shown: the last new output went out
SHOWN_WAIT = 10.0  # seconds a display() waits for it at most (a busy kernel: order may slip)


def shown() -> None:
    """The kernel's ``Shown`` arrived (called by the rank's listening thread)."""
    _shown.set()


def configure(send: Send | None, rank: int = 0, output: str = "rank0") -> _Publisher | None:
    """Start (or, with ``send=None``, end) a run's rich output on this rank; returns what it
    replaced (for :func:`reinstate`)."""
    return reinstate(_Publisher(send, rank, output) if send is not None else None)


def reinstate(publisher: _Publisher | None) -> _Publisher | None:
    """Make ``publisher`` (one :func:`configure` returned) this rank's again."""
    global _publisher
    previous, _publisher = _publisher, publisher
    return previous


def install() -> Callable[[ModuleType], None]:
    """Make the display functions this module's in this rank: the builtin now, IPython's
    once it is imported (the returned patch, for the import hook)."""
    builtins.display = display  # type: ignore[attr-defined]
    module = sys.modules.get("IPython.core.display_functions")
    if module is not None:
        patch_ipython(module)
    return patch_ipython


def patch_ipython(module: ModuleType) -> None:
    """``IPython.core.display_functions``' functions become ours (IPython's other modules
    and ``DisplayHandle`` look them up there)."""
    module.display = display  # type: ignore[attr-defined]
    module.update_display = update_display  # type: ignore[attr-defined]
    module.publish_display_data = publish_display_data  # type: ignore[attr-defined]
    module.clear_output = clear_output  # type: ignore[attr-defined]


# -- the functions user code calls -------------------------------------------------------------


def publish_display_data(
    data: dict[str, Any],
    metadata: dict[str, Any] | None = None,
    source: Any = None,
    *,
    transient: dict[str, Any] | None = None,
    update: bool = False,
    **kwargs: Any,
) -> None:
    """IPython's ``publish_display_data``, to the kernel."""
    if _publisher is not None:
        _publisher.publish(data, metadata, transient, update)


def display(
    *objs: Any,
    include: Any = None,
    exclude: Any = None,
    metadata: dict[str, Any] | None = None,
    transient: dict[str, Any] | None = None,
    display_id: Any = None,
    raw: bool = False,
    clear: bool = False,
    update: bool = False,
    **kwargs: Any,
) -> Any:
    """IPython's ``display``, in a rank: the objects' MIME bundles go to the notebook cell."""
    transient = dict(transient or {})
    if display_id:
        if display_id is True:
            display_id = uuid.uuid4().hex
        transient["display_id"] = display_id
    if update and "display_id" not in transient:
        raise TypeError("display_id required for update_display")
    if not objs and display_id:
        objs, raw = ({},), True  # an empty output, to be updated later
    if clear:
        clear_output(wait=True)
    for obj in objs:
        if raw:
            publish_display_data(obj, metadata, transient=transient, update=update)
            continue
        data, found_metadata = format_object(obj, include, exclude)
        if data:
            publish_display_data(
                data, {**found_metadata, **(metadata or {})}, transient=transient, update=update
            )
    if display_id:
        return _handle(display_id)
    return None


def update_display(obj: Any, *, display_id: str, **kwargs: Any) -> None:
    """IPython's ``update_display``: replace the output shown with ``display_id``."""
    kwargs["update"] = True
    display(obj, display_id=display_id, **kwargs)


def clear_output(wait: bool = False) -> None:
    """Clear this rank's rich outputs of the run (``wait``: when the next one comes)."""
    if _publisher is not None:
        _publisher.clear(wait)


def show_value(value: Any) -> None:
    """A ``%%ddp`` cell's last value that cannot travel back, shown from here."""
    if value is not None:
        display(value)


def _handle(display_id: str) -> Any:
    """IPython's ``DisplayHandle`` when the job uses IPython (its methods call ours)."""
    ipython_display = sys.modules.get("IPython.display")
    if ipython_display is None:
        return _Handle(display_id)
    return ipython_display.DisplayHandle(display_id)


class _Handle:
    """A display handle without IPython: ``display``/``update`` an output by its id."""

    def __init__(self, display_id: str) -> None:
        self.display_id = display_id

    def display(self, obj: Any, **kwargs: Any) -> None:
        display(obj, display_id=self.display_id, **kwargs)

    def update(self, obj: Any, **kwargs: Any) -> None:
        update_display(obj, display_id=self.display_id, **kwargs)


# -- matplotlib --------------------------------------------------------------------------------


def show_figures() -> None:
    """Show every open pyplot figure, then close them, as the inline backend's ``show``."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    from matplotlib._pylab_helpers import Gcf

    try:
        if _publisher is not None and _publisher.shown:
            for manager in Gcf.get_all_fig_managers():
                display(manager.canvas.figure)
    finally:
        pyplot.close("all")


def finish() -> None:
    """The end of a run (or a session task) on this rank: figures still open are shown, as
    the inline backend shows them at the end of a cell, when nbddp's backend is in use."""
    try:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and pyplot.get_backend() == BACKEND:
            show_figures()
    finally:
        configure(None)


BACKEND = "module://nbddp.worker.output.figures"  # the ranks' matplotlib backend (figures.py)
