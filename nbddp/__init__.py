"""nbddp: run PyTorch DistributedDataParallel training from a Jupyter notebook.

Kernel side: :func:`notebook_launch`, :func:`spawn` (``mp.spawn``'s shape), :func:`run_script`
(a torchrun script as it is), :class:`Run`, :func:`last_run`, :class:`Session`,
:class:`RayCluster`, :class:`SlurmCluster`, :func:`set_cluster`, :func:`export`; detached runs:
:func:`runs`, :class:`RunInfo`, :func:`attach`.
Worker side (inside the launched function; each also works outside a launch as rank 0 of 1):
:func:`rank`, :func:`local_rank`, :func:`world_size`, :func:`is_main`, :func:`device`,
:func:`prepare_model`, :func:`prepare_loader`, :func:`unwrap`, :func:`print`, :func:`barrier`,
:func:`log`, :func:`progress`, :func:`stopping`, :func:`checkpoint`, :func:`restore`,
:func:`breakpoint` (pdb on one rank, the others held).

The kernel-side names are imported on first use, so a rank (or a script that only asks
``nbddp.rank()``) never loads the launcher, the display or IPython.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from nbddp.errors import (
    LaunchTimeout,
    NbddpError,
    NbddpWarning,
    RunStopped,
    SerializationError,
    WorkerError,
)
from nbddp.worker.context import barrier, device, is_main, local_rank, print, rank, world_size
from nbddp.worker.debugging.debugger import breakpoint
from nbddp.worker.live import log
from nbddp.worker.prepare import prepare_loader, prepare_model, unwrap
from nbddp.worker.progress import progress
from nbddp.worker.recovery.checkpoints import checkpoint, restore
from nbddp.worker.recovery.stopping import stopping

__all__ = [
    "LaunchTimeout",
    "NbddpError",
    "NbddpWarning",
    "RayCluster",
    "Run",
    "RunInfo",
    "RunStopped",
    "SerializationError",
    "Session",
    "SlurmCluster",
    "Stacks",
    "WorkerError",
    "attach",
    "barrier",
    "breakpoint",
    "checkpoint",
    "device",
    "export",
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
    "restore",
    "run_script",
    "runs",
    "set_cluster",
    "spawn",
    "stopping",
    "unwrap",
    "world_size",
]

__version__ = "0.2.0"

if TYPE_CHECKING:
    from nbddp.clusters.choice import set_cluster
    from nbddp.clusters.ray.cluster import RayCluster
    from nbddp.clusters.slurm.allocation import SlurmCluster
    from nbddp.detached.attached import attach
    from nbddp.detached.info import RunInfo, runs
    from nbddp.diagnosis.stacks import Stacks
    from nbddp.exporting import export
    from nbddp.launch import notebook_launch, spawn
    from nbddp.run import Run, last_run
    from nbddp.scripts import run_script
    from nbddp.sessions.session import Session

_KERNEL_SIDE = {
    "notebook_launch": "launch",
    "spawn": "launch",
    "run_script": "scripts",
    "export": "exporting",
    "Run": "run",
    "last_run": "run",
    "RayCluster": "clusters.ray.cluster",
    "SlurmCluster": "clusters.slurm.allocation",
    "set_cluster": "clusters.choice",
    "Session": "sessions.session",
    "Stacks": "diagnosis.stacks",
    "runs": "detached.info",
    "RunInfo": "detached.info",
    "attach": "detached.attached",
}


def __getattr__(name: str) -> Any:
    module = _KERNEL_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module 'nbddp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _in_a_kernel() -> bool:
    """A Jupyter kernel or an IPython shell: where the first launch should already be fast."""
    if "ipykernel" in sys.modules:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


if _in_a_kernel():  # a launch will come: be ready for it (helper, launcher, ~30 ms imports)
    from nbddp import launch as _launch
    from nbddp.local.forkserver import prestart

    prestart()
    del _launch


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext nbddp``: registers the ``%%ddp``, ``%ddp_run`` and ``%ddp_session`` magics."""
    from nbddp.notebook import run_magic
    from nbddp.notebook.magic import load_ipython_extension as load

    load(ipython)
    run_magic.load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext nbddp``: removes the ``%%ddp``, ``%ddp_run`` and ``%ddp_session`` magics."""
    from nbddp.notebook import run_magic
    from nbddp.notebook.magic import unload_ipython_extension as unload

    unload(ipython)
    run_magic.unload(ipython)
