"""Catalyst inside nbddp's ranks: one DDP job over those ranks, whatever engine it picks.

Catalyst starts DDP by itself: its DDP engine ``mp.spawn``s workers, sets ``MASTER_PORT``
(2112) and calls ``init_process_group``, and ``get_available_engine(ddp=True)`` picks that
engine only when a process sees several GPUs (21.x gives a single-device engine otherwise, and
then each rank trains alone on its shard). Inside a multi-rank nbddp run, through Catalyst's
own extension points (its engine classes and ``get_available_engine``), installed when
``catalyst.runners.runner`` is imported:

* ``get_available_engine`` gives the DDP engine (22.x: the Accelerate engine for this rank's
  device, which joins the existing group), whatever ``ddp=`` says: a launch of N ranks trains
  one model;
* the DDP engine's ``spawn`` calls the function in place, with this rank's local rank and the
  world size; ``setup`` / ``setup_process`` adopt the existing process group (no second
  ``init_process_group``, the environment untouched); ``cleanup`` leaves the group to nbddp;
* every rank meets the others before the run starts (``IRunner.run``), so what a rank prepares
  before training (Sapsan empties its log directory) is done before rank 0 writes there;
* rank 0's epoch metrics (Catalyst's epoch lines) go to the panel, as a logger of Catalyst's.

Catalyst's own rules stay: loggers and checkpoints on the main process, loaders sharded once
(by Catalyst, unless already sharded). Catalyst 21.x (the line Sapsan pins) and 22.x are
handled; the two differ in engine API (``setup_process`` / ``setup``).

Non-goals: XLA, DeepSpeed, fairscale and APEX engines; a single-rank run (Catalyst as usual).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from nbddp.worker import live
from nbddp.worker.context import device, local_rank


def _in_multi_rank_run() -> bool:
    import torch.distributed as dist

    return (
        live.current() is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def patch(runner_module: ModuleType) -> None:
    """``catalyst.runners.runner`` was imported: its engines, engine choice and runner."""
    engines = sys.modules["catalyst.engines.torch"]
    ddp_engine = engines.DistributedDataParallelEngine
    if "_nbddp_catalyst" in vars(ddp_engine):  # (22.x engines inherit Accelerate's mark)
        return
    legacy = hasattr(ddp_engine, "setup_process")  # 21.x; 22.x engines are Accelerators
    _patch_ddp_engine(ddp_engine, legacy)
    _patch_engine_choice(engines, legacy)
    _patch_runner(sys.modules["catalyst.core.runner"].IRunner, legacy)
    ddp_engine._nbddp_catalyst = True


# -- engines ----------------------------------------------------------------------------------


def _in_place(original: Any, replacement: Any) -> Any:
    """``replacement`` inside a multi-rank nbddp run, ``original`` elsewhere."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_multi_rank_run():
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


def _patch_ddp_engine(cls: Any, legacy: bool) -> None:
    import torch.distributed as dist

    def spawn(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not legacy:
            return fn(local_rank(), dist.get_world_size())
        _adopt_group_21(self)
        try:
            return fn(local_rank(), dist.get_world_size())
        finally:
            # 21.x closes the stage's loggers in the spawned copy of the runner, and its
            # parent's stay untouched; here the stage ran on the runner itself, so what it
            # closed must not be flushed again at the experiment's end
            runner = getattr(fn, "__self__", None)
            if runner is not None and isinstance(getattr(runner, "loggers", None), dict):
                runner.loggers = {}

    def setup_process(self: Any, rank: int = -1, world_size: int = 1) -> None:  # 21.x
        _adopt_group_21(self)
        self._rank = dist.get_rank()
        self._device = str(device())

    def setup(self: Any, local_rank: int, world_size: int) -> None:  # 22.x
        from catalyst.core.engine import Engine

        kwargs = dict(self._kwargs)
        if device().type == "cpu":
            kwargs.setdefault("cpu", True)
        Engine.__init__(self, *self._args, **kwargs)  # Accelerate joins the existing group

    def cleanup(self: Any) -> None:
        dist.barrier()  # the group is nbddp's: it outlives the Catalyst run

    cls.spawn = _in_place(cls.spawn, spawn)
    if legacy:
        cls.setup_process = _in_place(cls.setup_process, setup_process)
        cls.cleanup_process = _in_place(cls.cleanup_process, cleanup)
    else:
        cls.setup = _in_place(cls.setup, setup)
        cls.cleanup = _in_place(cls.cleanup, cleanup)


def _adopt_group_21(engine: Any) -> None:
    """A 21.x DDP engine made for nbddp's group: its world, backend and device."""
    import torch.distributed as dist

    engine._world_size = dist.get_world_size()
    engine.num_local_workers = 1
    engine._backend = dist.get_backend()
    engine.process_group_kwargs.update(backend=engine._backend, world_size=engine._world_size)
    if device().type == "cpu":
        engine.ddp_kwargs.setdefault("device_ids", None)  # DDP on the CPU takes no device


def _patch_engine_choice(engines: ModuleType, legacy: bool) -> None:
    utils = sys.modules["catalyst.utils.torch"]
    original = utils.get_available_engine

    @functools.wraps(original)
    def get_available_engine(*args: Any, **kwargs: Any) -> Any:
        if not _in_multi_rank_run():
            return original(*args, **kwargs)
        fp16 = bool(kwargs.get("fp16", False))
        if legacy:
            if kwargs.get("amp") or kwargs.get("apex"):
                return original(*args, **{**kwargs, "ddp": True})
            return engines.DistributedDataParallelEngine()
        precision = {"mixed_precision": "fp16"} if fp16 else {}
        if kwargs.get("cpu") or device().type == "cpu":
            return engines.CPUEngine(**precision)
        return engines.GPUEngine(**precision)  # an Accelerator: it joins nbddp's group

    get_available_engine._nbddp = True  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):  # where it was imported by name
        if (
            name.startswith("catalyst")
            and getattr(module, "get_available_engine", None) is original
        ):
            module.get_available_engine = get_available_engine  # type: ignore[attr-defined]


# -- runner -----------------------------------------------------------------------------------


def _patch_runner(runner: Any, legacy: bool) -> None:
    import torch.distributed as dist
    from catalyst.core.logger import ILogger

    class NbddpLogger(ILogger):  # type: ignore[misc]
        """Catalyst's epoch metrics, as rank 0 logs them (the main process's loggers)."""

        def __init__(self) -> None:
            pass  # (21.x's ILogger takes no arguments, 22.x's takes flags with defaults)

        def log_metrics(self, metrics: Any, scope: Any = None, *args: Any, **kwargs: Any) -> None:
            buffer = live.current()
            if scope != "epoch" or buffer is None or not isinstance(metrics, Mapping):
                return
            runner = args[0] if args else kwargs.get("runner")
            step = kwargs.get("global_epoch_step", getattr(runner, "epoch_step", None))
            values = _flatten(metrics)
            if values:
                buffer.log_main(values, step if isinstance(step, int) else None)

    start = "on_stage_start" if legacy else "on_experiment_start"
    original_start = getattr(runner, start)

    @functools.wraps(original_start)
    def on_start(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_start(self, *args, **kwargs)
        main = getattr(self.engine, "is_master_process", None)
        if main is None:
            main = getattr(self.engine, "is_main_process", True)
        if live.current() is not None and main and isinstance(self.loggers, dict):
            self.loggers["_nbddp"] = NbddpLogger()
        return result

    setattr(runner, start, on_start)

    original_run = runner.run

    @functools.wraps(original_run)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_multi_rank_run():
            dist.barrier()  # what each rank prepared (a log directory emptied) is done
        return original_run(self, *args, **kwargs)

    runner.run = run


def _flatten(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{"train": {"loss": 0.1}, "_epoch_": {"lr": 0.01}}`` -> ``train/loss``, ``lr``: the
    numbers only (Catalyst's metrics are floats; bools and anything else are left out)."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        inner = value if isinstance(value, Mapping) else {"": value}
        prefix = "" if str(key).startswith("_") else str(key)
        for name, number in inner.items():
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                flat["/".join(part for part in (prefix, str(name)) if part)] = float(number)
    return flat
