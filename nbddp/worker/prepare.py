"""Make a model and a DataLoader ready for this rank, the way a DDP script would by hand.

``prepare_loader`` changes exactly these things (everything else is kept as the loader had it):

* with more than one rank, the sampler becomes a ``DistributedSampler`` over the same dataset
  (shuffling when the loader shuffled; seed 0 on every rank, so shards are disjoint), and each
  new pass over the loader moves the sampler to the next epoch: no ``set_epoch`` calls needed;
* with ``move_to_device`` and a non-CPU device, each batch (tensors inside tuples, lists, dicts,
  namedtuples; an object with its own ``.to()``, such as ``PackedSequence``, a PyG ``Batch`` or
  HF's ``BatchEncoding``, through it) arrives on ``nbddp.device()``; on a GPU the loader pins
  its batches' memory (``pin_memory=True``, unless it said otherwise with a
  ``pin_memory_device``), so that the copies overlap with the work.

Loaders over an ``IterableDataset`` cannot be sharded by a sampler: they are passed through
with a warning, and the dataset should shard itself with ``nbddp.rank()``.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from nbddp.worker import live
from nbddp.worker.context import device, rank, world_size

__all__ = ["prepare_loader", "prepare_model", "unwrap"]


def prepare_model(model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
    """Move ``model`` to this rank's device and, with more than one rank, wrap it in DDP.

    ``ddp_kwargs`` go to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``).
    """
    if isinstance(model, DistributedDataParallel):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}.")
    target = device()
    model = model.to(target)
    if world_size() == 1:
        return model
    if target.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [target.index])
        ddp_kwargs.setdefault("output_device", target.index)
    return DistributedDataParallel(model, **ddp_kwargs)


def unwrap(model: Any) -> Any:
    """The module inside a DDP (or ``torch.compile``) wrapper; anything else unchanged."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def prepare_loader(loader: DataLoader[Any], move_to_device: bool = True) -> DataLoader[Any]:
    """Shard ``loader`` across the ranks and deliver its batches on this rank's device.

    With more than one rank the loader gets a ``DistributedSampler`` (shuffling when the
    loader shuffled), keeping its other settings (``batch_size``, ``drop_last``,
    ``collate_fn``, ``num_workers``, ...), and reshuffles at each new pass by itself: no
    ``set_epoch`` call is needed. A loader that already has a ``DistributedSampler`` keeps it.
    With one rank, and on the CPU, the loader comes back as it is.

    Args:
        loader: A ``DataLoader`` over a map-style dataset. One over an ``IterableDataset``
            is not sharded (a warning says so: shard inside the dataset with
            [nbddp.rank][] and [nbddp.world_size][]).
        move_to_device: Deliver each batch (tensors, and tensors in tuples, lists and dicts)
            on [nbddp.device][].

    Raises:
        ValueError: The loader has a custom sampler or ``batch_sampler``, which cannot be
            sharded for you.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"prepare_loader expects a DataLoader, got {type(loader).__name__}.")
    if isinstance(loader, _PreparedLoader):
        return loader
    target = device() if move_to_device else None
    if target is not None and target.type == "cpu":
        target = None
    shard = world_size() > 1
    if isinstance(loader.dataset, IterableDataset):
        if shard:
            warnings.warn(
                "prepare_loader cannot shard a DataLoader over an IterableDataset: every rank "
                "will see the same data. Shard inside the dataset with nbddp.rank() and "
                "nbddp.world_size().",
                stacklevel=2,
            )
        shard = False
    if not shard and target is None:
        return loader

    sampler = loader.sampler
    if shard:
        sampler = _distributed_sampler(loader)
    return _PreparedLoader(loader, sampler=sampler, target=target)


def _distributed_sampler(loader: DataLoader[Any]) -> DistributedSampler[Any]:
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return sampler
    custom_batches = loader.batch_sampler is not None and loader.batch_size is None
    if custom_batches or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            f"prepare_loader cannot shard a DataLoader with a custom "
            f"{'batch_sampler' if custom_batches else type(sampler).__name__}. Give the "
            "DataLoader a DistributedSampler(dataset, num_replicas=nbddp.world_size(), "
            "rank=nbddp.rank()) yourself, then prepare_loader keeps it."
        )
    return DistributedSampler(
        loader.dataset,
        num_replicas=world_size(),
        rank=rank(),
        shuffle=isinstance(sampler, RandomSampler),
        seed=0,
    )


# DataLoader parameters that prepare_loader sets itself rather than copying.
_OURS = frozenset({"self", "dataset", "shuffle", "sampler", "batch_sampler"})


def _settings_of(loader: DataLoader[Any]) -> dict[str, Any]:
    """Every DataLoader setting the loader keeps, read from the loader itself, so a setting a
    future torch adds is carried over too (``shuffle`` lives in the sampler)."""
    settings: dict[str, Any] = {}
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items():
        if name in _OURS or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if hasattr(loader, name):
            settings[name] = getattr(loader, name)
    return settings


class _PreparedLoader(DataLoader[Any]):
    """A copy of the user's DataLoader with our sampler, stepping epochs and moving batches."""

    def __init__(
        self, original: DataLoader[Any], *, sampler: Any, target: torch.device | None
    ) -> None:
        settings = _settings_of(original)
        if original.batch_size is None and original.batch_sampler is not None:
            settings["batch_sampler"] = original.batch_sampler  # exclusive with these two:
            settings.pop("batch_size", None)
            settings.pop("drop_last", None)
        else:
            settings["sampler"] = sampler
        if target is not None and target.type == "cuda" and not settings.get("pin_memory_device"):
            settings["pin_memory"] = True  # so non_blocking copies overlap with the work
        super().__init__(original.dataset, **settings)
        self._target = target
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override] # batches, moved
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self._epoch)
        live.set_epoch(self._epoch)
        self._epoch += 1
        batches = super().__iter__()
        if self._target is None:
            return batches
        return (_to_device(batch, self._target) for batch in batches)


def _to_device(batch: Any, target: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(target, non_blocking=True)
    own = getattr(batch, "to", None)
    if callable(own) and not isinstance(batch, type):
        # its own move: PackedSequence keeps batch_sizes on the CPU (RNNs need it there)
        try:
            return own(target, non_blocking=True)
        except TypeError:  # a .to() that takes the device alone
            return own(target)
    if isinstance(batch, Mapping):
        moved = {k: _to_device(v, target) for k, v in batch.items()}
        try:
            same_kind = copy.copy(batch)  # a defaultdict keeps its default
            same_kind.update(moved)  # type: ignore[attr-defined]
            return same_kind
        except Exception:  # a mapping that cannot be copied or changed: a plain dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_to_device(v, target) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, target) for v in batch)
    return batch
