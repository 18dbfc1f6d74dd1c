"""The authenticated byte stream between a rank and the kernel: handshake and listener (the
frames on it: ``frames.py``).

* A **handshake** runs before any frame: the kernel sends a random nonce, the rank answers
  with an HMAC-SHA256 of it under the run's key plus a nonce of its own, the kernel proves the
  key back. A client without the key is dropped before the kernel unpickles a byte it sent.
* :class:`Listener` is the kernel end: a Unix socket in the run's private directory today; the
  same framing and handshake work over TCP (``tcp:host:port``) for ranks on other machines.

Non-goal: encryption. The Unix socket lives in an owner-only directory; over TCP the stream is
authenticated, not private.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from typing import Any

from nbddp.wire.frames import Connection

NONCE = 32
HANDSHAKE_TIMEOUT = 10.0


class AuthenticationFailed(ConnectionError):
    """The other end does not hold the run's key."""


def _proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed the connection")
        data += chunk
    return bytes(data)


# -- the handshake --------------------------------------------------------------------------


def _connect(sock: socket.socket, address: Any, deadline: float) -> None:
    """Connect by ``deadline``. A Unix socket whose backlog is full refuses a socket with a
    timeout at once (EAGAIN) instead of waiting as it does for TCP: the kernel's end is busy
    accepting (a loaded machine, many ranks, strangers connecting), so try again shortly."""
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def connect(address: str, key: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Connection:
    """The rank's end: connect, prove the key, check the kernel's proof."""
    sock = _socket_for(address)
    try:
        sock.settimeout(timeout)
        _connect(sock, _sockaddr(address), time.monotonic() + timeout)
        challenge = _recv_exactly(sock, NONCE)
        ours = secrets.token_bytes(NONCE)
        sock.sendall(_proof(key, b"client", challenge) + ours)
        try:
            answer = _recv_exactly(sock, NONCE)
        except EOFError:
            raise AuthenticationFailed(
                "the kernel's end closed the connection during the handshake: this is not "
                "the run's key, or the run ended"
            ) from None
        if not hmac.compare_digest(answer, _proof(key, b"server", ours)):
            raise AuthenticationFailed("the kernel's end does not hold this run's key")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Connection(sock)


class PendingHandshake:
    """The kernel's side of one handshake, driven by the supervisor loop without blocking."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self._key = key
        self._challenge = secrets.token_bytes(NONCE)
        self._answer = bytearray()
        sock.setblocking(False)
        sock.send(self._challenge)  # 32 bytes always fit a new socket's buffer

    def fileno(self) -> int:
        return self.sock.fileno()

    def advance(self) -> Connection | None:
        """Read what arrived; the connection once the client proved the key. Raises
        AuthenticationFailed or EOFError to drop it."""
        chunk = self.sock.recv(2 * NONCE - len(self._answer))
        if not chunk:
            raise EOFError("the client left during the handshake")
        self._answer += chunk
        if len(self._answer) < 2 * NONCE:
            return None
        proof, theirs = bytes(self._answer[:NONCE]), bytes(self._answer[NONCE:])
        if not hmac.compare_digest(proof, _proof(self._key, b"client", self._challenge)):
            raise AuthenticationFailed("a client without this run's key")
        self.sock.send(_proof(self._key, b"server", theirs))
        return Connection(self.sock)

    def close(self) -> None:
        self.sock.close()


class Listener:
    """Where ranks connect: ``unix:/path`` (the default, in the run's 0700 directory) or
    ``tcp:host:port``. ``accept`` never blocks; the handshake is the caller's to drive."""

    def __init__(self, address: str, key: bytes | None = None) -> None:
        self.key = key or secrets.token_bytes(32)
        self.sock = _socket_for(address)
        self.sock.bind(_sockaddr(address))
        if address.startswith("unix:"):
            os.chmod(address[5:], 0o600)
        elif address.endswith(":0"):  # tell the ranks the port the system picked
            host, port = self.sock.getsockname()[:2]
            address = f"tcp:{host}:{port}"
        self.address = address
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.rejected = 0  # clients that failed the handshake

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> PendingHandshake | None:
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None
        if sock.family == socket.AF_INET:
            _no_delay(sock)
        try:
            return PendingHandshake(sock, self.key)
        except OSError:
            sock.close()
            return None

    def close(self) -> None:
        self.sock.close()
        if self.address.startswith("unix:"):
            with contextlib.suppress(OSError):
                os.unlink(self.address[5:])


def _socket_for(address: str) -> socket.socket:
    if address.startswith("unix:"):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if address.startswith("tcp:"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _no_delay(sock)
        return sock
    raise ValueError(f"unknown channel address {address!r} (unix:/path or tcp:host:port)")


def _sockaddr(address: str) -> Any:
    if address.startswith("unix:"):
        return address[5:]
    host, port = address[4:].rsplit(":", 1)
    return (host, int(port))


def _no_delay(sock: socket.socket) -> None:
    """Send small frames at once: a frame is written in pieces (header, pickle, buffers), and
    Nagle's algorithm would hold the last piece for the peer's delayed ACK (40 ms a call)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
