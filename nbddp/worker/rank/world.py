"""The process group nbddp makes for a rank, and the rank's own ``init_process_group`` answered
from it.

nbddp makes each rank's default process group before ``fn`` runs, on a rendezvous store it
keeps for the whole process (rank 0 hosts it). Tutorials call ``dist.init_process_group(...)``
themselves, after setting a fixed ``MASTER_PORT``. While a world is joined, that call is
answered here: when it asks for the world nbddp made (the same rank and world size) it returns
and the existing group is used, and the address it names (``MASTER_ADDR``/``MASTER_PORT``, a
``tcp://`` or ``file://`` URL) is never bound, so two runs cannot collide on a tutorial's port.
Another world is a clear error before any training. Another backend rebuilds the group on
nbddp's store (``"nccl"`` on a CPU launch keeps gloo, with a warning). After the user's
``destroy_process_group()``, the next ``init_process_group`` (or :func:`ensure_group`) builds a
fresh group on the same store under a new key prefix: nothing of nbddp's depends on the first
group surviving.

The timeout the call asks for is the group's from then on, on gloo and NCCL alike, whether the
group is rebuilt or kept: nbddp builds every group with a native timeout that never fires and
enforces the asked one itself, holding it while a person answers a prompt on any rank
(``worker/diagnosis/collective_watch.py``). An NCCL group is built bound to the rank's GPU
(``device_id``): its communicator is made at once, and ``barrier()`` knows its device.

Non-goals: groups the user makes with ``new_group`` (torch's own business), and processes that
are no nbddp rank (a script under torchrun: nothing is patched there).
"""

from __future__ import annotations

import functools
import inspect
import os
import urllib.parse
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nbddp.errors import NbddpWarning
from nbddp.worker.diagnosis import collective_watch

_ATTRIBUTE = "init_process_group"


@dataclass
class World:
    """What nbddp made: this rank's place, its backend, and the store every group is built on."""

    rank: int
    world_size: int
    backend: str
    store: Any  # torch.distributed.Store, kept alive for the whole process
    original: Callable[..., None]  # torch's own init_process_group
    builds: int = 0

    def build(self, backend: str | None = None, **options: Any) -> None:
        """A default group on nbddp's store; each build under its own key prefix, so a group
        built after a destroy never reads the keys of the one before. It returns once every
        rank has built it: gloo can finish connecting on one rank while a peer still is, and a
        rank that destroyed the group at once (or a quick ``fn`` and a ``cleanup()``) would
        then break the peer's connecting with "Connection closed by peer"."""
        from torch.distributed.distributed_c10d import PrefixStore

        backend = backend or self.backend
        prefix = "default_pg" if self.builds == 0 else f"nbddp-{self.builds}/default_pg"
        self.builds += 1
        asked = options.pop("timeout", None)
        if asked is not None:
            collective_watch.ask(asked)
        device = _own_gpu(backend) if "device_id" not in options else None
        if device is not None:
            options["device_id"] = device
        self.original(
            backend=backend,
            store=PrefixStore(prefix, self.store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=collective_watch.NATIVE,  # the asked timeout is the watch's to enforce
            **options,
        )
        built = PrefixStore(f"nbddp-built-{self.builds}", self.store)
        if built.add("count", 1) == self.world_size:  # the last to get here tells the others
            built.set("all", "1")
        built.wait(["all"])
        collective_watch.start(self.store, self.builds, self.rank, self.world_size, backend)


_world: World | None = None


def join(backend: str, rank: int, world_size: int, store: Any = None) -> None:
    """Make this process's default group (on the torchrun environment's rendezvous unless a
    ``store`` is given) and answer the user's ``init_process_group`` from it from now on."""
    global _world
    from torch.distributed.rendezvous import rendezvous

    if store is None:
        store, rank, world_size = next(rendezvous("env://", rank, world_size))
    original = _torch_init()
    world = World(rank, world_size, backend, store, original)
    world.build()
    _world = world
    intercept()


def intercept() -> None:
    """Put the answer in torch's place. A rank does it before the job is unpickled: a
    notebook's ``from torch.distributed import init_process_group`` travels by name and then
    resolves to the answer. Until :func:`join` it calls torch's own function."""
    _install(_answer)


def leave() -> None:
    """Destroy nbddp's group (if it still exists) and give torch its own function back."""
    global _world
    import torch.distributed as dist

    world, _world = _world, None
    if world is None:
        return
    collective_watch.stop()
    _install(world.original)
    if dist.is_initialized():
        dist.destroy_process_group()


Rebound = list[tuple[dict[str, Any], str, Callable[..., None]]]


def answer_bound_names(namespaces: Iterable[dict[str, Any]]) -> Rebound:
    """Names in ``namespaces`` bound to torch's own ``init_process_group`` answer too, until
    :func:`unbind`. For the kernel's one-rank world: a notebook's ``from torch.distributed
    import init_process_group``, run before the launch, holds torch's function, and nothing
    is unpickled there to bind it anew (a rank's job is, after :func:`intercept`)."""
    world = _world
    if world is None:
        return []
    rebound: Rebound = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if value is world.original:
                namespace[name] = _answer
                rebound.append((namespace, name, world.original))
    return rebound


def unbind(rebound: Rebound) -> None:
    """Torch's function back in the names :func:`answer_bound_names` rebound (a name the
    user bound to something else meanwhile keeps it)."""
    for namespace, name, original in rebound:
        if namespace.get(name) is _answer:
            namespace[name] = original


def ensure_group() -> None:
    """The default group again, if the user destroyed it (every rank calls this at the same
    point: a session's next task, nbddp's own work after ``fn``)."""
    import torch.distributed as dist

    if _world is not None and not dist.is_initialized():
        _world.build()
    collective_watch.arm()  # a session's task starts: its collectives are watched


def _torch_init() -> Callable[..., None]:
    import torch.distributed as dist

    current: Callable[..., None] = dist.distributed_c10d.init_process_group
    return getattr(current, "__wrapped__", current) if current is _answer else current


def _install(function: Callable[..., None]) -> None:
    """Both names user code reaches torch's function by (``dist.`` and ``distributed_c10d.``;
    a notebook's ``from torch.distributed import init_process_group`` travels by name and
    resolves to it too)."""
    import torch.distributed as dist

    setattr(dist, _ATTRIBUTE, function)
    setattr(dist.distributed_c10d, _ATTRIBUTE, function)


def _wraps_torch(answer: Callable[..., None]) -> Callable[..., None]:
    import torch.distributed as dist

    return functools.wraps(dist.distributed_c10d.init_process_group)(answer)


def _answer_impl(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` in a rank: see the module's docstring."""
    __tracebackhide__ = True  # a rank's traceback ends at the user's call
    world = _world
    if world is None:  # nbddp's world has been left: torch's own
        return _torch_init()(*args, **kwargs)
    import torch.distributed as dist

    asked = inspect.signature(world.original).bind(*args, **kwargs).arguments
    error = _other_world(world, asked)
    if error is not None:
        raise error  # here, not deeper: the traceback ends at the user's call
    backend = _dist_backend(world, asked.get("backend"))
    options = {k: asked[k] for k in ("timeout", "device_id", "pg_options") if asked.get(k)}
    if dist.is_initialized():
        if backend is None or _names(backend) <= _names(dist.get_backend()):
            if "timeout" in options:  # the group nbddp made, with the timeout asked for
                collective_watch.ask(options["timeout"])
            return None
        dist.destroy_process_group()  # every rank asks for the same backend at the same point
    world.build(backend, **options)
    return None


_answer = _wraps_torch(_answer_impl)


def _dist_backend(world: World, asked: Any) -> str | None:
    """The backend to use: None keeps what exists. NCCL on a rank without a GPU cannot work,
    so the CPU launch's gloo stays (as the launch's ``device=`` said)."""
    if asked is None or str(asked).lower() in ("", "undefined"):
        return None
    backend = str(asked).lower()
    if "nccl" in backend and not _has_gpu():
        warnings.warn(
            f"init_process_group({asked!r}): NCCL needs a GPU and this rank has none, so the "
            f"launch's {world.backend} group is used. Launch with device='cuda' on a machine "
            "with GPUs to train with NCCL.",
            NbddpWarning,
            stacklevel=3,
        )
        return None
    return backend


def _names(backend: str) -> set[str]:
    """The backends a torch backend string names: ``"cpu:gloo,cuda:nccl"`` -> gloo, nccl."""
    return {part.rpartition(":")[2].strip() for part in backend.lower().split(",")}


def _own_gpu(backend: str) -> Any:
    """The GPU an NCCL group is bound to: the rank's own (set before the group is built);
    None for gloo, or where CUDA is not initialised (no GPU was set)."""
    import torch

    if "nccl" not in _names(backend) or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _other_world(world: World, asked: dict[str, Any]) -> ValueError | None:
    """The world the call asks for, read as torch would read it, must be nbddp's."""
    rank, size = _asked_place(asked)
    if (size is None or size == world.world_size) and (rank is None or rank == world.rank):
        return None
    call = f"init_process_group(rank={_shown(rank)}, world_size={_shown(size)})"
    made = (
        f"nbddp started this launch with {world.world_size} "
        f"rank{'s' if world.world_size != 1 else ''} (this is rank {world.rank}) and its "
        f"process group ({world.backend}) already exists."
    )
    if size is not None and size != world.world_size:
        return ValueError(
            f"{call} asks for a world of {size} ranks, but {made} To train on {size} ranks, "
            f"launch with num_workers={size} (nbddp.spawn(..., nprocs={size}), %%ddp -n "
            f"{size}); to train on this launch's ranks, pass world_size=nbddp.world_size()."
        )
    return ValueError(
        f"{call} asks to be rank {rank}, but {made} Pass rank=nbddp.rank(): nbddp.spawn "
        "passes each rank's local rank, as mp.spawn does, which is its global rank only on "
        "one machine."
    )


def _shown(value: int | None) -> str:
    return "?" if value is None else str(value)


def _asked_place(asked: dict[str, Any]) -> tuple[int | None, int | None]:
    """(rank, world size) the call names: its arguments, else its URL's query (``tcp://``,
    ``file://``), else the environment ``env://`` reads."""
    method = str(asked.get("init_method") or "env://")
    if method.startswith("env://"):
        named = {"rank": os.environ.get("RANK"), "world_size": os.environ.get("WORLD_SIZE")}
    else:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(method).query)
        named = {key: query.get(key, [None])[0] for key in ("rank", "world_size")}
    rank, size = asked.get("rank", -1), asked.get("world_size", -1)
    return (
        _integer(named["rank"]) if rank == -1 else rank,
        _integer(named["world_size"]) if size == -1 else size,
    )


def _integer(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None
