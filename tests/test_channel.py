"""The channel authenticates before it reads: a client without the key is dropped unheard."""

import os
import pickle
import socket
import struct
import tempfile
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from nbddp.channel import KernelChannel, connect


class _Boom:
    """Unpickling this creates a file: proof that someone unpickled attacker bytes."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_wrong_key_rejected_without_unpickling(tmp_path):
    accepted = []
    with tempfile.TemporaryDirectory() as private:
        channel = KernelChannel(private, lambda rank, conn: accepted.append(rank))
        try:
            marker = tmp_path / "unpickled"
            # 1. A client that skips the handshake and sends a malicious pickle straight away.
            evil = pickle.dumps(("hello", _Boom(str(marker))))
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(channel.address)
                raw.sendall(struct.pack("!i", len(evil)) + evil)
                time.sleep(0.3)
            # 2. A client with the wrong key.
            with pytest.raises(AuthenticationError):
                Client(channel.address, family="AF_UNIX", authkey=b"wrong" * 8)
            # 3. The right key gets through.
            conn = connect(channel.address, channel.authkey, rank=3)
            deadline = time.monotonic() + 5
            while not accepted and time.monotonic() < deadline:
                time.sleep(0.01)
            conn.close()
            assert accepted == [3]
            assert not marker.exists()
            assert channel.rejected >= 1
            assert oct(os.stat(channel.address).st_mode & 0o777) == "0o600"
        finally:
            channel.close()
