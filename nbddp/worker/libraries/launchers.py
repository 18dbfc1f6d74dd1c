"""A launcher started inside a rank is an error that names its caller, not N x k processes.

nbddp already runs one process per GPU with the process group initialised. A library (or the
user's code) that calls ``torch.multiprocessing.spawn`` / ``start_processes`` or torch
elastic's launcher (``torchrun``'s ``elastic_launch``) inside a rank would start its own
workers in every rank, run a second ``init_process_group`` on a port of its own, and pickle the
notebook's objects once more. Once installed, such a call raises a ``RuntimeError`` before
anything starts, naming the caller and the fix.

Non-goals: plain ``multiprocessing`` (DataLoader workers, pools) is not touched; a launcher
called after the user destroyed the process group is allowed (it no longer competes with
nbddp's ranks). Known libraries get their own treatment first (``integrations``: Catalyst's
DDP engines run in place), so they never reach this.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def install() -> None:
    """Guard ``torch.multiprocessing``'s launchers (elastic's is guarded when imported)."""
    import torch.multiprocessing

    mp: Any = torch.multiprocessing
    spawn_module: Any = sys.modules["torch.multiprocessing.spawn"]
    if getattr(spawn_module.start_processes, "_nbddp", False):
        return
    guarded = _guard(spawn_module.start_processes, "torch.multiprocessing")
    spawn_module.start_processes = guarded  # what mp.spawn calls
    mp.start_processes = guarded


def guard_elastic(module: ModuleType) -> None:
    """``torch.distributed.launcher.api``: ``elastic_launch`` (torchrun's) calls launch_agent."""
    api: Any = module
    if not getattr(api.launch_agent, "_nbddp", False):
        api.launch_agent = _guard(api.launch_agent, "torch elastic's launcher")


def _guard(original: Any, what: str) -> Any:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            called = what
            if what == "torch.multiprocessing" and sys._getframe(1).f_code.co_name != "spawn":
                called += ".start_processes"
            elif what == "torch.multiprocessing":
                called += ".spawn"  # (mp.spawn calls start_processes)
            raise RuntimeError(nested_launch_message(called, _caller()))
        return original(*args, **kwargs)

    guarded._nbddp = True  # type: ignore[attr-defined]
    return guarded


def nested_launch_message(what: str, caller: str) -> str:
    return (
        f"{caller} started {what} inside an nbddp rank, whose process group already exists: "
        "nbddp already runs one process per GPU, and this would start more processes in "
        "every rank. Pass ddp=False (or a single-device engine) to the library, or remove "
        "the launcher and call the training function directly in each rank; nothing was "
        "started."
    )


def _caller() -> str:
    """The first frame outside torch and nbddp: a library (by its package) or the user's code."""
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((torch_dir, _PACKAGE_DIR)) and "<frozen" not in filename:
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "code in this rank"
    module = str(frame.f_globals.get("__name__", ""))
    code = frame.f_code
    where = f"{os.path.basename(code.co_filename)}, line {frame.f_lineno}, in {code.co_name}"
    if module in ("__main__", "builtins") or frame.f_code.co_filename.startswith("<"):
        return f"Your code ({where})"
    return f"{module.split('.')[0]} ({module}: {where})"
