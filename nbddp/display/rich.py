"""The ranks' rich output (``Display`` messages: MIME bundles) shown in the launching cell.

Made on the launching cell's thread, a :class:`RichOutputs` keeps that cell's parent header and
publishes each bundle under it from the supervisor's thread, as IPython's ``display`` would
(``display_data``, or ``update_display_data`` for an output updated in place): the cell keeps
them, the saved notebook too. With ``output="all"`` each new output is preceded by its rank's
label. Outside a Jupyter kernel the bundle's text is printed.

The kernel checks the limits the ranks keep (``MAX_DISPLAYS`` new outputs per rank and run,
``MAX_DISPLAY_BYTES`` each), so a rank cannot flood the notebook whatever it sends.

Non-goal: formatting objects (the ranks send ready bundles).
"""

from __future__ import annotations

import sys
from typing import Any

from nbddp.wire.messages import MAX_DISPLAY_BYTES, MAX_DISPLAYS, Display

_LABEL_STYLE = "font-family:monospace;font-size:12px;color:#6b7280"


class CellPublisher:
    """Display data for the cell running now, published later from any thread: ipykernel
    files a thread's output under the cell that is running then, unless told which."""

    def __init__(self) -> None:
        self.shell = _shell()
        self._publisher = getattr(self.shell, "display_pub", None)
        header = getattr(self._publisher, "parent_header", None)
        self._header = dict(header) if isinstance(header, dict) else None

    @property
    def in_kernel(self) -> bool:
        return self._publisher is not None

    def publish(
        self,
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        transient: dict[str, Any] | None = None,
        update: bool = False,
    ) -> None:
        publisher: Any = self._publisher
        token = None
        if self._header is not None and hasattr(publisher, "set_thread_parent"):
            token = publisher.set_thread_parent(self._header)  # this cell's, on any thread
        try:
            publisher.publish(
                data=data, metadata=metadata or {}, transient=transient or {}, update=update
            )
        finally:
            if token is not None:
                publisher.reset_thread_parent(token)


class RichOutputs:
    def __init__(self, output: str) -> None:
        self._labelled = output == "all"
        self._cell = CellPublisher()
        self._stdout = sys.stdout
        self._counts: dict[int, int] = {}

    def show(self, message: Display) -> None:
        """Publish one rank's bundle in the launching cell (any thread)."""
        rank = message.rank
        if not message.update:
            count = self._counts.get(rank, 0) + 1
            self._counts[rank] = count
            if count > MAX_DISPLAYS + 1:  # the rank's own note is the one beyond the limit
                return
        if sum(len(str(v)) for v in message.data.values()) > MAX_DISPLAY_BYTES + 4096:
            return
        if not self._cell.in_kernel:
            self._print(message)
            return
        if self._labelled and not message.update:
            label = f"[rank {rank}]"
            self._cell.publish(
                {"text/plain": label, "text/html": f'<div style="{_LABEL_STYLE}">{label}</div>'}
            )
        self._cell.publish(message.data, message.metadata, message.transient, message.update)

    def _print(self, message: Display) -> None:
        text = message.data.get("text/plain")
        if not text or message.update:
            return
        prefix = f"[rank {message.rank}] " if self._labelled else ""
        try:
            self._stdout.write(f"{prefix}{text}\n")
            self._stdout.flush()
        except (OSError, ValueError):
            pass


def _shell() -> Any:
    """The running Jupyter kernel's shell, or None (a script, a terminal IPython)."""
    if "IPython" not in sys.modules:
        return None
    shell = sys.modules["IPython"].get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None
