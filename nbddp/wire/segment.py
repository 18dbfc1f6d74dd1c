"""The bytes of the data a launch captures, in memory every rank maps instead of copying.

When the call is pickled, each tensor's, array's or other buffer's bytes above
``OUT_OF_BAND_MIN`` leave the pickle stream (pickle protocol 5, out of band) and are written
once into a :class:`Segment`: an anonymous shared memory file (``memfd_create``), which has no
name anywhere, is readable only through its descriptor, and is freed by the OS when the last
descriptor and mapping are gone, however the run ends (a killed kernel included). Its
descriptor rides on each rank's job message (``SCM_RIGHTS``).

Each rank maps the segment **copy-on-write** (:func:`map_buffers`): the tensors it rebuilds
view the shared pages without a copy; a rank that writes to a captured tensor gets private
copies of the pages it writes, so no other rank and not the notebook sees the change. The
kernel does not map the segment at all.

A tensor whose storage was shared in place (``in_place.py``) is not copied here: its storage's
own file rides on the message beside the segment, mapped the same way.

Non-goal: sharing what ranks create themselves; only what travels with the call.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from typing import Any

from nbddp.wire.messages import SharedLayout

OUT_OF_BAND_MIN = 64 * 1024  # smaller buffers stay in the pickle stream
_ALIGN = 64  # every buffer starts at a multiple of this (any dtype's alignment)
_WRITE_PIECE = 32 << 20  # bytes per pwrite: measured fastest into a fresh memfd


class Segment:
    """One launch's out-of-band buffers, copied into a memfd. Close it when the ranks have it
    (their mappings keep the pages) or when the launch ends."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        spans, offset = [], 0
        for buffer in buffers:
            spans.append((offset, buffer.nbytes))
            offset += -(-buffer.nbytes // _ALIGN) * _ALIGN
        self.spans = spans  # (offset, length) of each buffer
        self.size = offset
        self.fd = os.memfd_create("nbddp-data", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(self.fd, 0, max(offset, 1))  # the pages at once, not one by one
            for buffer, (start, length) in zip(buffers, spans, strict=True):
                view = buffer.cast("B")
                written = 0
                while written < length:  # pwrite releases the GIL: an interrupt gets through
                    piece = view[written : written + _WRITE_PIECE]
                    written += os.pwrite(self.fd, piece, start + written)
        except BaseException:
            self.close()
            raise

    @property
    def layout(self) -> SharedLayout:
        """The segment alone: every buffer in it (the message's one descriptor)."""
        return SharedLayout([self.size], [(0, start, length) for start, length in self.spans])

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def map_buffers(fds: Sequence[int], layout: SharedLayout) -> list[Any]:
    """A rank's view of the shared files: one writable, copy-on-write buffer per span. A
    mapping lives as long as a buffer (and the tensors rebuilt on it) does; ``fds`` (one per
    file of the layout) are closed."""
    wholes: list[memoryview | None] = []
    try:
        for fd, size in zip(fds, layout.sizes, strict=True):
            if size == 0:
                wholes.append(None)
                continue
            flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
            wholes.append(memoryview(mmap.mmap(fd, size, flags=flags, prot=prot)))
    finally:
        for fd in fds:
            os.close(fd)
    buffers: list[Any] = []
    for file, start, length in layout.spans:
        whole = wholes[file]
        buffers.append(bytearray(0) if whole is None else whole[start : start + length])
    return buffers
