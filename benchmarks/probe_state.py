"""What a process holds that decides whether it is safe to fork for CUDA (the GPU check's
section 2 imports this into its probes): libcuda mapped, CUDA initialised by torch, its
threads, the GPU device files it holds open, and whether the CUDA driver was started, asked as
nbddp's warm helper asks (``nbddp/worker/helper/preload.py``)."""

from __future__ import annotations

import os
import sys

from nbddp.worker.helper.preload import driver_started, gpu_files, mapped_libraries


def state() -> list:
    mapped = mapped_libraries()
    torch = sys.modules.get("torch")
    initialised = bool(torch is not None and torch.cuda.is_initialized())
    return [
        any("/libcuda.so" in path for path in mapped),
        initialised,
        len(os.listdir("/proc/self/task")),
        sorted(gpu_files()),
        driver_started(mapped),
    ]
