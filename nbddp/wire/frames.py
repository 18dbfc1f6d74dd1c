"""Frames on a byte stream between a rank and the kernel (``transport.py`` makes the stream).

A **frame** is one pickled message plus out-of-band buffers (pickle protocol 5): a header, the
pickle, then each buffer's bytes. The sender writes a tensor's bytes straight from its memory;
:class:`FrameReader` reads each buffer straight into its destination (``recv_into``), never
through an intermediate copy, and can be fed from a non-blocking socket a piece at a time, so
the kernel's one loop serves every rank while a large result arrives and can stop it midway.
File descriptors (a shared memory segment) can ride on a frame; the header counts them, and
a frame that lost one fails loudly.

Non-goal: who may connect (the handshake, ``transport.py``).
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from nbddp.wire import unpickling

_HEAD = struct.Struct("!IIQ")  # buffers, fds, pickle length
_SIZE = struct.Struct("!Q")
_MAX_FDS = 253  # Linux's most per message (SCM_MAX_FD)
_PIECE = 1 << 20  # bytes read per recv into a buffer
_MAPPED = 1 << 20  # buffers this large arrive into a mapping of their own


class Frame(NamedTuple):
    message: Any
    buffers: list[Any]  # each a writable buffer filled by recv_into
    fds: list[int]


def allocate_buffer(size: int) -> bytearray | mmap.mmap:
    """Memory for an arriving buffer. A large one is an anonymous mapping: its pages are
    zero and untouched until the socket fills them, so nothing is written twice and the
    reading thread holds the GIL for no page-zeroing memset (which would delay even the
    main thread's KeyboardInterrupt)."""
    return bytearray(size) if size < _MAPPED else mmap.mmap(-1, size)


class Connection:
    """One end of an authenticated connection; ``send`` is safe from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.reader = FrameReader()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any, buffers: Sequence[Any] = (), fds: Sequence[int] = ()) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        data = pickle.dumps(message, protocol=5)
        head = _HEAD.pack(len(views), len(fds), len(data))
        head += b"".join(_SIZE.pack(v.nbytes) for v in views)
        with self._send_lock:
            if fds:
                self.sock.sendmsg(
                    [head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            else:
                self.sock.sendall(head)
            self.sock.sendall(data)
            for view in views:  # straight from the object's memory
                self.sock.sendall(view)

    def recv(self, timeout: float | None = None) -> Frame:
        """Block until one whole frame arrived (EOFError when the other end closed)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                frame = self.reader.read(self.sock)
                if frame is not None:
                    return frame
        finally:
            self.sock.settimeout(None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class FrameReader:
    """Parses frames from a socket a piece at a time; buffers land in their destination.

    ``allocate(size)`` makes the destination of each out-of-band buffer (default:
    :func:`allocate_buffer`, whose memory becomes the tensor's when the value is unpickled).
    """

    def __init__(self, allocate: Callable[[int], Any] | None = None) -> None:
        allocate = allocate or allocate_buffer
        self._allocate = allocate
        self._reset()

    def _reset(self) -> None:
        self._part = bytearray()  # the header, sizes and pickle as they arrive
        self._need = _HEAD.size
        self._stage = "head"
        self._sizes: list[int] = []
        self._fds: list[int] = []
        self._expect_fds = 0
        self._pickle_length = 0
        self._pickle = b""
        self._buffers: list[Any] = []
        self._view: memoryview | None = None
        self._filled = 0

    def read(self, sock: socket.socket, budget: int = 1 << 62) -> Frame | None:
        """Read at most about ``budget`` bytes; return a frame once one is complete. Raises
        EOFError at the end of the stream, BlockingIOError when a non-blocking socket has
        nothing more."""
        while budget > 0:
            if self._stage == "buffer":
                assert self._view is not None
                want = min(len(self._view) - self._filled, _PIECE)
                got = sock.recv_into(self._view[self._filled :], want)
                if not got:
                    raise EOFError("the other end closed the connection mid-frame")
                self._filled += got
                budget -= got
                if self._filled == len(self._view):
                    self._next_buffer()
            else:
                want = self._need - len(self._part)
                if self._stage == "head" and not self._part:
                    chunk = self._recv_head(sock, want)
                else:
                    chunk = sock.recv(want)
                if not chunk:
                    raise EOFError("the other end closed the connection")
                self._part += chunk
                budget -= len(chunk)
                if len(self._part) == self._need:
                    self._advance()
            if self._stage == "done":
                self._check_descriptors()
                frame = Frame(
                    unpickling.loads(self._pickle, self._buffers), self._buffers, self._fds
                )
                self._reset()
                return frame
        return None

    def _check_descriptors(self) -> None:
        """A frame that lost a file descriptor on the way (the receiver's ancillary room was
        short, or it came over TCP) fails here, loudly, instead of as a missing segment or
        store much later."""
        if len(self._fds) == self._expect_fds:
            return
        got, expected = len(self._fds), self._expect_fds
        self.discard()
        raise ConnectionError(
            f"a frame carried {got} of its {expected} file descriptors: the connection is "
            "unusable (descriptors travel over Unix sockets only, at most "
            f"{_MAX_FDS} per frame)"
        )

    def _recv_head(self, sock: socket.socket, want: int) -> bytes:
        """The first bytes of a frame, with the descriptors that may ride on them."""
        if sock.family != socket.AF_UNIX:
            return sock.recv(want)
        data, ancillary, _, _ = sock.recvmsg(want, socket.CMSG_SPACE(_MAX_FDS * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        return data

    def _advance(self) -> None:
        if self._stage == "head":
            count, self._expect_fds, length = _HEAD.unpack(self._part)
            self._stage, self._need = "sizes", count * _SIZE.size
            self._pickle_length = length
            self._part = bytearray()
            if self._need == 0:
                self._advance()
        elif self._stage == "sizes":
            self._sizes = [s for (s,) in _SIZE.iter_unpack(self._part)]
            self._stage, self._need = "pickle", self._pickle_length
            self._part = bytearray()
            if self._need == 0:
                self._advance()
        elif self._stage == "pickle":
            self._pickle = bytes(self._part)
            self._part = bytearray()
            self._stage = "buffer"
            self._next_buffer()

    def _next_buffer(self) -> None:
        """Move on to the next buffer that has bytes to read, or finish the frame."""
        if self._view is not None:
            self._view.release()
            self._view = None
        while len(self._buffers) < len(self._sizes):
            size = self._sizes[len(self._buffers)]
            buffer = self._allocate(size)
            self._buffers.append(buffer)
            if size:
                self._view = memoryview(buffer).cast("B")
                self._filled = 0
                return
        self._stage = "done"

    def discard(self) -> None:
        """Drop a partly read frame (the connection is being closed)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._view is not None:
            self._view.release()
        self._reset()
