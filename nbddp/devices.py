"""The GPUs a launch can name, read without a CUDA context: the kernel's visible devices (by
index, UUID or MIG slice), what each rank's ``CUDA_VISIBLE_DEVICES`` and device index are, and
the NCCL release torch loads.

Names. A GPU is named by the kernel's ``torch.cuda`` index (which follows its
``CUDA_VISIBLE_DEVICES``) or by UUID (``GPU-…``, ``MIG-…``, as ``nvidia-smi -L`` prints them);
a rank's ``CUDA_VISIBLE_DEVICES`` holds the kernel's own entries for its indices (a kernel
started with ``CUDA_VISIBLE_DEVICES=2,3`` gives ``gpus=[1]`` physical GPU 3), and UUIDs as
they are. Every rank sees all the selected GPUs, in the order of their first use, and its own
device is its index there, which is its ``LOCAL_RANK``: NCCL can then use peer-to-peer copies
between the ranks' GPUs, as under torchrun. A MIG slice is different: CUDA enumerates one MIG
slice per process, so a rank on a slice sees that slice alone, as device 0.

What is read. ``CUDA_VISIBLE_DEVICES`` and, to check a UUID or count MIG slices, ``nvidia-smi
-L`` (once per kernel); NCCL's version through ``ncclGetVersion`` of the library torch has
loaded (``torch.cuda.nccl.version()`` is the header torch was built with, not the library that
runs). None of these initialises CUDA.

Non-goals: choosing GPUs (free memory, topology) and ``CUDA_DEVICE_ORDER`` (the kernel's CUDA
order is the user's; ``nvidia-smi`` numbers by PCI bus, which may differ on mixed machines).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import NamedTuple

GpuName = int | str  # a kernel index, or a UUID
MULTI_RANK_NCCL = (2, 30, 0)  # the first NCCL that runs two ranks on one GPU
MULTI_RANK_VARIABLE = "NCCL_MULTI_RANK_GPU_ENABLE"
SMI_WAIT = 10.0  # seconds nvidia-smi gets


class Gpu(NamedTuple):
    """One physical GPU, as ``nvidia-smi -L`` lists it."""

    number: int  # nvidia-smi's index (PCI bus order)
    model: str
    uuid: str
    mig: tuple[str, ...]  # its MIG slices' UUIDs, when MIG is on


def visible() -> list[str] | None:
    """The kernel's ``CUDA_VISIBLE_DEVICES`` entries, in order; None when it is unset (every
    GPU). CUDA stops at the first empty entry, and so does this."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    names = []
    for part in text.split(","):
        name = part.strip()
        if not name or name.startswith("-"):
            break
        names.append(name)
    return names


def is_mig(name: str) -> bool:
    return name.startswith("MIG-")


def is_uuid(name: object) -> bool:
    return isinstance(name, str) and name.startswith(("GPU-", "MIG-"))


def mig_slices() -> list[str]:
    """The MIG slices the kernel's ``CUDA_VISIBLE_DEVICES`` names, or, when it is unset, every
    slice ``nvidia-smi`` lists (a process's CUDA enumerates only one of them: ranks can use
    the others, each on its own)."""
    names = visible()
    if names is not None:
        return [n for n in names if is_mig(n)]
    return [uuid for gpu in inventory() or () for uuid in gpu.mig]


@functools.cache
def inventory() -> tuple[Gpu, ...] | None:
    """The machine's GPUs from ``nvidia-smi -L`` (None: no nvidia-smi, or it failed)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=SMI_WAIT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_smi(done.stdout) if done.returncode == 0 else None


_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG .*\(UUID: (MIG-[0-9a-fA-F/-]+)\)")


def parse_smi(text: str) -> tuple[Gpu, ...]:
    """``nvidia-smi -L``'s lines: ``GPU 0: NVIDIA H100 (UUID: GPU-…)``, each followed by its
    MIG slices, ``  MIG 3g.40gb Device 0: (UUID: MIG-…)``."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        head = _GPU_LINE.match(line)
        if head:
            gpus.append(Gpu(int(head.group(1)), head.group(2), head.group(3), ()))
            continue
        slice_ = _MIG_LINE.match(line)
        if slice_ and gpus:
            gpus[-1] = gpus[-1]._replace(mig=(*gpus[-1].mig, slice_.group(1)))
    return tuple(gpus)


def known_uuids() -> set[str] | None:
    """Every GPU and MIG UUID of this machine (None: unknown, no nvidia-smi)."""
    found = inventory()
    if found is None:
        return None
    return {gpu.uuid for gpu in found} | {uuid for gpu in found for uuid in gpu.mig}


def physical(gpu: GpuName) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry that names ``gpu`` for a process started from the
    kernel: its own entry for an index (or the index itself when it has none), a UUID as
    it is."""
    if isinstance(gpu, str):
        return gpu
    names = visible()
    if names is None:
        return str(gpu)
    if not 0 <= gpu < len(names):
        raise ValueError(
            f"GPU {gpu} is not in this kernel's CUDA_VISIBLE_DEVICES={','.join(names)!r}: it "
            "was changed after CUDA was initialised here (torch still counts the GPUs it saw "
            "then). Set it back, or restart the kernel and set it before anything uses CUDA."
        )
    return names[gpu]


def rank_devices(gpus: Sequence[GpuName]) -> list[tuple[str, int]]:
    """Each rank's ``CUDA_VISIBLE_DEVICES`` and the index of its own device there (its
    ``LOCAL_RANK``): every rank sees the selected GPUs, in the order of first use; a MIG
    slice is seen alone. Ranks sharing a GPU share its index."""
    names = [physical(g) for g in gpus]
    if any(is_mig(n) for n in names):
        return [(n, 0) for n in names]
    unique = list(dict.fromkeys(names))
    seen = ",".join(unique)
    return [(seen, unique.index(n)) for n in names]


def shared(gpus: Sequence[GpuName]) -> bool:
    """Whether two ranks use one GPU."""
    names = [physical(g) for g in gpus]
    return len(set(names)) < len(names)


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL release torch runs with: ``ncclGetVersion`` of the ``libnccl`` it loaded (a
    CUDA build of torch loads it on import); None when there is none."""
    path = _loaded_nccl()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        code = ctypes.c_int()
        if library.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    value = code.value  # 2.9 and later: major * 10000 + minor * 100 + patch
    if value >= 10000:
        return value // 10000, value // 100 % 100, value % 100
    return value // 1000, value // 100 % 10, value % 100


def _loaded_nccl() -> str | None:
    import torch  # noqa: F401  (a CUDA build maps libnccl when it is imported)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().rpartition(" ")[2]
                if "/libnccl" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def version_text(version: tuple[int, int, int] | None) -> str:
    return "no NCCL" if version is None else "NCCL " + ".".join(map(str, version))
