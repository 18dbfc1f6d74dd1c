"""nbddp: run PyTorch DistributedDataParallel training from a Jupyter notebook.

Kernel side: :func:`notebook_launch`, :class:`Run`, :func:`last_run`.
Worker side (inside the launched function; each also works outside a launch as rank 0 of 1):
:func:`rank`, :func:`local_rank`, :func:`world_size`, :func:`is_main`, :func:`device`,
:func:`prepare_model`, :func:`prepare_loader`, :func:`unwrap`, :func:`print`, :func:`barrier`,
:func:`log`, :func:`progress`.
"""

import contextlib

from .errors import LaunchTimeout, NbddpError, SerializationError, WorkerError
from .launch import notebook_launch
from .run import Run, last_run
from .worker.context import barrier, device, is_main, local_rank, print, rank, world_size
from .worker.live import log, progress
from .worker.prepare import prepare_loader, prepare_model, unwrap

__version__ = "0.1.0"


def _prestart_warm_workers() -> None:
    """Get the pre-warmed worker helper going now, so the first launch is fast already."""
    from .warm import prestart
    from .workers import ColdStarter

    with contextlib.suppress(OSError):  # then launches start cold; nothing else changes
        prestart(ColdStarter())


_prestart_warm_workers()


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext nbddp``: registers the ``%%ddp`` cell magic."""
    from .magic import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    from .magic import unload_ipython_extension as unload

    unload(ipython)

__all__ = [
    "LaunchTimeout",
    "NbddpError",
    "Run",
    "SerializationError",
    "WorkerError",
    "barrier",
    "device",
    "is_main",
    "last_run",
    "local_rank",
    "log",
    "notebook_launch",
    "prepare_loader",
    "prepare_model",
    "print",
    "progress",
    "rank",
    "unwrap",
    "world_size",
]
