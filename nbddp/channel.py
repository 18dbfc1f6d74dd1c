"""The authenticated wire between the workers and the kernel.

A Unix socket inside the run's private directory, guarded by a per-run random key. The stdlib's
``multiprocessing.connection`` runs an HMAC challenge both ways *before* any message is read,
so a client without the key is dropped without the kernel unpickling a byte it sent.

Messages are small tuples of plain values; user objects inside them are pickled bytes that
the kernel unpickles separately (``payload.loads``). Worker -> kernel:

    ("hello", rank)                 first message of each connection
    ("device", rank, name)          rank 0's device, for the panel's header
    ("log", rank, (first, blocks))  rows first, first + 1, ...: blocks of (epoch, keys,
                                    a list of values per key); row k of every rank is averaged
    ("progress", rank, bars)        a snapshot of rank 0's progress bars
    ("result", rank, bytes | None)  fn returned (value pickled for rank 0 / return_all)
    ("error", rank, ErrorReport)    fn raised; the rank exits non-zero next
    ("unsendable", rank, path, reason)  the return value cannot travel back

Kernel -> worker: nothing but the connection itself: when the kernel goes away the socket
closes and the worker ends itself (see ``worker/entry.py``).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener

SOCKET_NAME = "channel.sock"
_HELLO_TIMEOUT = 30.0


class KernelChannel:
    """The kernel end: accepts one authenticated connection per rank in a background thread."""

    def __init__(self, directory: str, on_connect: Callable[[int, Connection], None]) -> None:
        self.address = os.path.join(directory, SOCKET_NAME)
        self.authkey = secrets.token_bytes(32)
        self.rejected = 0  # clients that failed authentication
        self._on_connect = on_connect
        self._closing = threading.Event()
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        os.chmod(self.address, 0o600)
        self._thread = threading.Thread(target=self._accept_loop, name="nbddp-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except AuthenticationError:
                self.rejected += 1
                continue
            except (OSError, EOFError):
                continue  # a client that hung up mid-handshake, or our own wake-up in close()
            if self._closing.is_set():
                conn.close()
                break
            try:
                if not conn.poll(_HELLO_TIMEOUT):
                    raise EOFError
                kind, rank = conn.recv()
                if kind != "hello":
                    raise EOFError
            except (OSError, EOFError, ValueError, TypeError):
                conn.close()
                continue
            self._on_connect(rank, conn)

    def close(self) -> None:
        """Stop accepting and remove the socket. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        # accept() does not wake up when its socket is closed from another thread: knock once.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as knock:
                knock.settimeout(1.0)
                knock.connect(self.address)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._listener.close()


def connect(address: str, authkey: bytes, rank: int) -> Connection:
    """The worker end: authenticate and introduce ourselves."""
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(("hello", rank))
    return conn
