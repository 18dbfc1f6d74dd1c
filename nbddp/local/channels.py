"""The kernel's end of each rank's connection on one machine: the listener, the handshakes in
flight, the connections and the rank each speaks for. Frames are read a piece at a time (a
large result holds up nothing else) and sends never block the group's loop for long.

Driven by the group's ``selectors`` loop (``group.py``), on its thread: a selector key whose
data starts with "accept", "handshake" or "conn" is handed to :meth:`Channels.ready`.
Non-goal: what a message means (the group, and its judge, decide).
"""

from __future__ import annotations

import contextlib
import selectors
import time
from collections.abc import Callable
from typing import Any

from nbddp.wire.frames import Connection
from nbddp.wire.transport import AuthenticationFailed, Listener, PendingHandshake

KINDS = ("accept", "handshake", "conn")  # the selector keys this module serves
_READ_BUDGET = 16 << 20  # bytes read from one connection before the loop looks around
_SEND_TIMEOUT = 60.0

Handle = Callable[[Connection, Any, list[Any]], None]  # a frame's message and its buffers


class Channels:
    """Every connection of one group. ``rank_of`` maps each (handshaken) connection to the
    rank it speaks for, None until the group accepts its ``Hello`` (:meth:`speaks_for`)."""

    def __init__(self, selector: selectors.BaseSelector, handle: Handle) -> None:
        self._selector = selector
        self._handle = handle
        self.listener: Listener | None = None
        self.rank_of: dict[Connection, int | None] = {}

    def listen(self, listener: Listener) -> None:
        """Serve ``listener`` (owned from now on)."""
        self.listener = listener

    def register(self) -> None:
        """Start accepting, as the group's loop begins."""
        if self.listener is not None:
            self._selector.register(self.listener, selectors.EVENT_READ, ("accept",))

    def ready(self, key: selectors.SelectorKey) -> None:
        kind = key.data[0]
        if kind == "accept":
            assert self.listener is not None
            pending = self.listener.accept()
            if pending is not None:
                self._selector.register(pending, selectors.EVENT_READ, ("handshake", pending))
        elif kind == "handshake":
            self._advance(key.data[1])
        else:
            self.read(key.data[1])

    def speaks_for(self, conn: Connection, rank: int) -> None:
        self.rank_of[conn] = rank

    def deadline(self) -> float | None:
        """When the earliest handshake in flight times out."""
        times = [
            key.data[1].deadline
            for key in self._selector.get_map().values()
            if key.data[0] == "handshake"
        ]
        return min(times) if times else None

    def expire(self) -> None:
        """Drop the handshakes whose time ran out."""
        now = time.monotonic()
        for key in list(self._selector.get_map().values()):
            if key.data[0] == "handshake" and key.data[1].deadline < now:
                self._selector.unregister(key.fileobj)
                key.data[1].close()

    def _advance(self, pending: PendingHandshake) -> None:
        try:
            conn = pending.advance()
        except BlockingIOError:
            return
        except (AuthenticationFailed, EOFError, OSError):
            assert self.listener is not None
            self.listener.rejected += 1  # read by the transport's tests
            self._selector.unregister(pending)
            pending.close()
            return
        if conn is not None:
            self._selector.modify(pending, selectors.EVENT_READ, ("conn", conn))
            self.rank_of[conn] = None

    def read(self, conn: Connection) -> None:
        """Read what the connection has; handle each complete frame; forget it at EOF."""
        try:
            while conn in self.rank_of:
                frame = conn.reader.read(conn.sock, budget=_READ_BUDGET)
                if frame is None:
                    return  # the budget is spent: the rest on the loop's next turn
                self._handle(conn, frame.message, frame.buffers)
        except BlockingIOError:
            return
        except (EOFError, OSError):
            self.forget(conn)

    def send(self, conn: Connection, message: Any, fds: list[int] | None = None) -> None:
        """Send on a connection the loop reads without blocking; drop it if that fails."""
        conn.sock.settimeout(_SEND_TIMEOUT)
        try:
            conn.send(message, fds=fds or ())
        except OSError:
            self.forget(conn)
        else:
            conn.sock.setblocking(False)

    def forget(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.reader.discard()
        self.rank_of.pop(conn, None)
        conn.close()

    def close(self) -> None:
        """Every connection and handshake, and the listener. Idempotent."""
        for conn in list(self.rank_of):
            self.forget(conn)
        for key in list(self._selector.get_map().values()):
            if key.data[0] == "handshake":
                key.data[1].close()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
