"""The kernel as rank 0 of a world of 1, for the length of a one-rank launch
(``in_kernel.py``): the torchrun variables set (a launcher's own hidden), the plan's device
current, a world-size-1 process group unless the user already made one, the runtime functions
answering for the plan; and all of it undone afterwards, interrupts held back meanwhile."""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nbddp import interrupts
from nbddp.devices import is_mig
from nbddp.environment import (
    RUN_ID_VARIABLE,
    Place,
    free_port,
    is_launcher_variable,
    new_run_id,
    torchrun_env,
)
from nbddp.plan import LaunchPlan
from nbddp.worker.context import Context, installed
from nbddp.worker.rank import world


@contextmanager
def single_rank_world(plan: LaunchPlan, fn: Callable[..., Any] | None = None) -> Iterator[None]:
    """The kernel as rank 0 of a world of 1, for the length of the block. The user's own
    ``init_process_group`` is answered from its group, as a rank's is (``worker/rank/world.py``),
    also through a name bound to torch's function before the launch (in the notebook, in
    ``fn``'s module or in the user's own modules)."""
    import torch
    import torch.distributed as dist

    device = kernel_device(plan)
    local_rank = device.index or 0  # LOCAL_RANK is the index of the rank's own device
    run_id = new_run_id()
    saved: dict[str, str | None] = {}  # what the finally puts back
    made_group = False
    rebound: world.Rebound = []
    guard = None
    excepthook = sys.excepthook
    try:
        with interrupts.deferred():  # the world is built whole; the finally takes it down
            place = Place(0, local_rank, 0, 1, 1, 1)
            env = {  # free_port's socket is closed, whenever the interrupt comes
                **torchrun_env(place, "127.0.0.1", free_port(), run_id),
                RUN_ID_VARIABLE: run_id,
                **plan.env,
            }
            # A launcher's variables in the kernel (a Slurm job's, torchrun's) are hidden.
            hidden = [n for n in os.environ if is_launcher_variable(n) and n not in env]
            saved.update({name: os.environ.get(name) for name in [*env, *hidden]})
            for name in hidden:
                del os.environ[name]
            os.environ.update(env)
            if device.type == "cuda":
                # torch's guard: its way back creates no context on the GPU it returns to
                guard = torch.cuda.device(device)
                guard.__enter__()  # type: ignore[no-untyped-call]
            if dist.is_available() and not dist.is_initialized():
                # the user's own init_process_group(rank=0, world_size=1) is answered from it
                world.join(plan.backend, 0, 1, store=dist.HashStore())  # type: ignore[attr-defined]
                made_group = True
                rebound = world.answer_bound_names(_user_namespaces(fn))
        with installed(Context(rank=0, local_rank=local_rank, world_size=1, device=device)):
            yield
    finally:
        with interrupts.deferred():
            world.unbind(rebound)
            _restore(saved, made_group, guard, excepthook)


def kernel_device(plan: LaunchPlan) -> Any:
    """The device the kernel runs a one-rank launch on: the plan's GPU as the kernel's
    ``torch.cuda`` numbers it (a UUID is looked up: CUDA is about to be used anyway)."""
    import torch

    if plan.device != "cuda":
        return torch.device("cpu")
    gpu = plan.gpus[0]
    if isinstance(gpu, int):
        return torch.device("cuda", gpu)
    if is_mig(gpu):
        return torch.device("cuda", 0)  # the one slice this process's CUDA enumerates
    for index in range(torch.cuda.device_count()):
        if f"GPU-{torch.cuda.get_device_properties(index).uuid}" == gpu:
            return torch.device("cuda", index)
    raise ValueError(f"gpus=[{gpu!r}]: this kernel's CUDA does not see that GPU.")


def _user_namespaces(fn: Callable[..., Any] | None) -> list[dict[str, Any]]:
    """Where the user's code looks its names up: the notebook's, ``fn``'s module's, and the
    user's own modules' (those outside the interpreter's and its packages' directories)."""
    found: dict[int, dict[str, Any]] = {}
    main = sys.modules.get("__main__")
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)
    for namespace in (getattr(main, "__dict__", None), getattr(target, "__globals__", None)):
        if isinstance(namespace, dict):
            found[id(namespace)] = namespace
    libraries = _library_directories()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not file.startswith(libraries):
            found.setdefault(id(module.__dict__), module.__dict__)
    return list(found.values())


@functools.cache
def _library_directories() -> tuple[str, ...]:
    """The interpreter's and its packages' directories (as named and as resolved)."""
    paths = sysconfig.get_paths()
    places = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    places += [*site.getsitepackages(), site.getusersitepackages()]
    return tuple({os.path.join(p, "") for p in places + [os.path.realpath(p) for p in places]})


def _restore(
    saved: dict[str, str | None],
    made_group: bool,
    guard: Any,
    excepthook: Callable[..., Any],
) -> None:
    if made_group:
        world.leave()  # the group, if the user's destroy_process_group() left it
    if made_group and getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        # init_process_group wraps sys.excepthook to prefix "[rank0]: " and nothing unwraps
        # it: each in-kernel launch would add one more prefix to the kernel's tracebacks.
        sys.excepthook = excepthook
    if guard is not None:
        guard.__exit__(None, None, None)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
