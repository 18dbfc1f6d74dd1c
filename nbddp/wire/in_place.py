"""A captured CPU tensor's memory, shared in place: the launch maps it, nothing copies it.

The first launch that captures a tensor moves its storage into shared memory the way
``Tensor.share_memory_()`` does (torch's file-descriptor sharing: an unlinked ``/dev/shm``
file, whose descriptor the storage keeps). The tensor object, its views and its values stay
what they were; only where its bytes live changes, once. Each later launch hands the ranks the
same descriptor, and they map it copy-on-write (``segment.map_buffers``): a launch costs no
copy, the machine holds one copy of the data at rest and during runs, and what a rank writes
stays its own. What the notebook writes to the tensor between launches, the next launch sees.

Left to the per-launch copy (``segment.Segment``), as before:

* a storage torch does not own (``torch.from_numpy``, ``frombuffer``, a memory-mapped file):
  moving it would silently end its sharing with the array or file it views;
* a non-contiguous view (its bytes are gathered into the copy);
* data that would take more than half of ``/dev/shm``'s free space (in a container it may be
  small; DataLoader workers use it too);
* everything, with ``NBDDP_SHARE_IN_PLACE=0``.

What changes for the user: a shared storage cannot be resized (``t.resize_(...)`` to a larger
size, or an ``out=`` that must grow it, raises "Trying to resize storage that is not
resizable"); ``t.is_shared()`` becomes True. A run started with ``block=False`` sees the
kernel's writes to the tensor made while it runs, on the pages the rank has not written itself.

Non-goal: NumPy arrays and other buffers (an array's memory cannot be moved under it: they are
copied per launch) and CUDA tensors (copied to the CPU, then per launch; sharing them through
CUDA IPC is a design, not built).
"""

from __future__ import annotations

import os
from typing import Any

ENABLE_VARIABLE = "NBDDP_SHARE_IN_PLACE"
_SHM = "/dev/shm"
_SHM_SHARE = 0.5  # of /dev/shm's free space, at most, for one storage


def enabled() -> bool:
    return os.environ.get(ENABLE_VARIABLE, "1") != "0"


def storage_file(tensor: Any) -> tuple[int, int] | None:
    """The shared memory file holding ``tensor``'s storage, as ``(descriptor, size)``, after
    moving the storage there if it was not; None when it stays where it is (see above). The
    descriptor is the storage's own: the caller duplicates it to keep it."""
    if not tensor.is_contiguous() or _pinned(tensor):
        return None
    storage = tensor.untyped_storage()
    try:
        movable = storage.resizable() and _room_for(storage.nbytes())
        if not storage.is_shared() and not movable:
            return None
        fd, size = storage._share_fd_cpu_()  # in place: the same storage, on shared pages
    except (RuntimeError, OSError, AttributeError):
        return None  # another sharing strategy, or /dev/shm refused: the copy does it
    return int(fd), int(size)


def _pinned(tensor: Any) -> bool:
    """Page-locked memory (``pin_memory()``) stays as it is: moved to ``/dev/shm`` it would be
    pageable again, and the kernel's ``non_blocking`` copies from it synchronous. Only a
    process that initialised CUDA can have pinned memory (asking elsewhere would start CUDA)."""
    import torch

    return bool(torch.cuda.is_initialized() and tensor.is_pinned())  # type: ignore[no-untyped-call]


def _room_for(nbytes: int) -> bool:
    try:
        stat = os.statvfs(_SHM)
    except OSError:
        return False
    return nbytes <= _SHM_SHARE * stat.f_bavail * stat.f_frsize
