"""The wire between ranks and the kernel: strangers are dropped before a byte is unpickled,
frames carry buffers straight into their destination, a slow reader is fed a piece at a time."""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import socket
import struct
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import wait_until

from nbddp.wire import transport
from nbddp.wire.frames import Connection, FrameReader
from nbddp.wire.transport import HANDSHAKE_TIMEOUT, AuthenticationFailed, Listener, connect

pytestmark = pytest.mark.unit


class _Boom:
    """Unpickling this creates a file: proof that someone unpickled attacker bytes."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _serve(listener: Listener, stop: threading.Event, accepted: list) -> None:
    """The kernel's side, as the supervisor drives it: accept and handshake without blocking,
    until the test says stop."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    while not stop.is_set():
        for key, _ in selector.select(0.05):
            if key.data is None:
                pending = listener.accept()
                if pending is not None:
                    selector.register(pending, selectors.EVENT_READ, pending)
                continue
            try:
                conn = key.data.advance()
            except BlockingIOError:
                continue
            except (AuthenticationFailed, EOFError, OSError):
                listener.rejected += 1
                selector.unregister(key.fileobj)
                key.data.close()
                continue
            if conn is not None:
                selector.unregister(key.fileobj)
                conn.sock.setblocking(True)
                accepted.append(conn.recv().message)
                conn.close()
    for key in list(selector.get_map().values()):
        if key.data is not None:
            key.data.close()
    selector.close()


def test_strangers_are_dropped_unheard_and_a_silent_one_blocks_nobody(tmp_path):
    with tempfile.TemporaryDirectory() as private:
        listener = Listener(f"unix:{private}/channel.sock")
        accepted: list = []
        stop = threading.Event()
        server = threading.Thread(target=_serve, args=(listener, stop, accepted))
        server.start()
        try:
            marker = tmp_path / "unpickled"
            silent = socket.socket(socket.AF_UNIX)  # connects and never says a word
            silent.connect(listener.address[5:])
            # A client that skips the handshake and sends a malicious frame straight away.
            evil = pickle.dumps(("hello", _Boom(str(marker))))
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(listener.address[5:])
                raw.sendall(struct.pack("!IIQ", 0, 0, len(evil)) + evil + b"\0" * 64)
                raw.settimeout(10)
                with contextlib.suppress(ConnectionResetError):  # (our bytes left unread)
                    while raw.recv(4096):  # until the listener hangs up: it judged the frame
                        pass
            with pytest.raises(AuthenticationFailed):  # the wrong key
                connect(listener.address, b"wrong" * 8, timeout=2)
            started = time.monotonic()
            conn = connect(listener.address, listener.key)  # the right key gets through
            # the silent client holds up nobody: not for its handshake's timeout (10 s)
            assert time.monotonic() - started < HANDSHAKE_TIMEOUT / 2
            conn.send(("hello", 3))
            assert wait_until(lambda: accepted, timeout=30)
            conn.close()
            silent.close()
        finally:
            stop.set()
            server.join()
            listener.close()
        assert accepted == [("hello", 3)]
        assert not marker.exists()
        assert listener.rejected >= 2
        assert not os.path.exists(listener.address[5:])


def test_a_full_backlog_is_waited_out_not_a_failed_connect(tmp_path, monkeypatch):
    """A Unix socket whose backlog is full refuses a socket with a timeout at once (EAGAIN)
    rather than making it wait, as TCP would: a rank's connect tries again until the kernel's
    end accepts. (Seen: a launch failed with BlockingIOError while strangers crowded the run's
    socket on a loaded machine.)"""
    path = str(tmp_path / "channel.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(0)
    crowd = []
    while True:  # fill the backlog
        stranger = socket.socket(socket.AF_UNIX)
        stranger.setblocking(False)
        try:
            stranger.connect(path)
        except BlockingIOError:
            stranger.close()
            break
        crowd.append(stranger)
    retried = threading.Event()

    def noted_sleep(seconds: float) -> None:
        retried.set()
        time.sleep(seconds)

    monkeypatch.setattr(
        transport, "time", SimpleNamespace(monotonic=time.monotonic, sleep=noted_sleep)
    )
    accepted = []

    def kernel_end() -> None:  # busy until the rank has been refused once, then accepts all
        if retried.wait(30):
            accepted.extend(server.accept()[0] for _ in range(len(crowd) + 1))

    acceptor = threading.Thread(target=kernel_end)
    acceptor.start()
    rank = socket.socket(socket.AF_UNIX)
    rank.settimeout(10)
    try:
        transport._connect(rank, path, time.monotonic() + 60)
    finally:
        acceptor.join()
        for sock in [rank, server, *crowd, *accepted]:
            sock.close()
    assert retried.is_set() and len(accepted) == len(crowd) + 1


def test_buffers_land_in_their_destination_and_descriptors_ride_along():
    left, right = socket.socketpair()
    sender, receiver = Connection(left), Connection(right)
    data = np.arange(3_000_000, dtype=np.float64)  # 24 MB: many pieces
    fd = os.memfd_create("probe")
    os.write(fd, b"shared")
    threading.Thread(target=sender.send, args=(("big", 1), [data, b"", b"xyz"], [fd])).start()
    frame = receiver.recv()
    assert frame.message == ("big", 1)
    assert [len(b) for b in frame.buffers] == [data.nbytes, 0, 3]
    assert np.array_equal(np.frombuffer(frame.buffers[0]), data)
    assert len(frame.fds) == 1 and os.pread(frame.fds[0], 6, 0) == b"shared"
    for descriptor in (fd, *frame.fds):
        os.close(descriptor)
    sender.close()
    receiver.close()


def test_a_frame_that_lost_a_descriptor_fails_loudly_and_keeps_none():
    """The header says how many descriptors ride along; one that did not arrive (here: the
    sender announced one and sent none) is an error at once, not a missing segment later."""
    left, right = socket.socketpair()
    data = pickle.dumps(("job",), protocol=5)
    left.sendall(struct.pack("!IIQ", 0, 1, len(data)) + data)  # 0 buffers, 1 fd, the pickle
    receiver = Connection(right)
    with pytest.raises(ConnectionError, match="carried 0 of its 1 file descriptors"):
        receiver.recv(timeout=5)
    fd = os.memfd_create("probe")
    Connection(left).send(("next",), fds=[fd])  # the reader starts afresh on the next frame
    frame = receiver.recv(timeout=5)
    assert frame.message == ("next",) and len(frame.fds) == 1
    for descriptor in (fd, *frame.fds):
        os.close(descriptor)
    left.close()
    receiver.close()


def test_a_frame_read_a_piece_at_a_time_from_a_non_blocking_socket():
    left, right = socket.socketpair()
    right.setblocking(False)
    allocated: list[bytearray] = []

    def allocate(size: int) -> bytearray:
        allocated.append(bytearray(size))
        return allocated[-1]

    reader = FrameReader(allocate)
    payload = os.urandom(5_000_000)
    threading.Thread(target=Connection(left).send, args=(("result",), [payload])).start()
    frame, reads = None, 0
    while frame is None:
        try:
            frame = reader.read(right, budget=1 << 20)
        except BlockingIOError:
            time.sleep(0.001)
        reads += 1
    assert reads > 3  # it came in pieces, and the loop got control between them
    assert frame.buffers[0] is allocated[0] and bytes(frame.buffers[0]) == payload
    left.close()
    right.close()
