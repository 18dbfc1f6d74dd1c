"""What ``nbddp.checkpoint`` saves of each object, and how ``nbddp.restore`` puts it back.

* a model: ``get_model_state_dict`` (DDP's ``module.`` prefix dropped, FSDP's shards as
  DTensors), loaded with ``set_model_state_dict``;
* an optimizer: ``get_optimizer_state_dict`` with the model it optimizes (found in the same
  state by its parameters), keyed by parameter names, so it loads into another sharding;
* an Accelerate ``Accelerator``: its own ``save_state`` / ``load_state``, into the checkpoint;
* anything else with ``state_dict()`` / ``load_state_dict()`` (an lr scheduler, a scaler);
* a dict of tensors and values: tensors loaded in place, values put back under their keys
  (a key the dict lacks is filled from the checkpoint: ``restore({"extra": {}})`` works).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

from nbddp.worker.context import barrier, rank

__all__ = ["barrier", "broadcast", "entries", "put_back", "rank", "to_load", "to_save"]


class Entry(NamedTuple):
    name: str
    kind: str  # "model", "optimizer", "accelerator", "stateful", "dict"
    obj: Any
    model: Any = None  # an optimizer's model


def entries(state: Any, loading: bool) -> list[Entry]:
    """``state`` checked, each value with what it is; ``ValueError`` says what cannot be."""
    import torch

    if not isinstance(state, Mapping) or not state:
        raise ValueError(
            f"state must be a non-empty dict of names to what to save, e.g. "
            f"{{'model': model, 'optimizer': optimizer}}; got {type(state).__name__}."
        )
    models = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    found = []
    for name, value in state.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"state key {name!r}: use plain names such as 'model'.")
        if isinstance(value, torch.nn.Module):
            found.append(Entry(name, "model", value))
        elif isinstance(value, torch.optim.Optimizer):
            found.append(Entry(name, "optimizer", value, _model_of(name, value, models)))
        elif _is_accelerator(value):
            found.append(Entry(name, "accelerator", value))
        elif callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)
        ):
            found.append(Entry(name, "stateful", value))
        elif isinstance(value, MutableMapping) or (isinstance(value, Mapping) and not loading):
            found.append(Entry(name, "dict", value))
        else:
            what = "an immutable mapping" if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(
                f"state[{name!r}] is {what}, which cannot be loaded back in place: pass a "
                f"model, an optimizer, an object with state_dict()/load_state_dict(), or a "
                f"dict (e.g. {{'progress': {{'epoch': epoch}}}}, read back after restore)."
            )
    return found


def _model_of(name: str, optimizer: Any, models: list[Any]) -> Any:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if params <= {id(p) for p in model.parameters()}:
            return model
    raise ValueError(
        f"state[{name!r}] is an optimizer, and its model is not in the state: its state is "
        "saved by parameter name, which needs the model. Save them together: "
        f"nbddp.checkpoint({{'model': model, {name!r}: {name}}}, step=step)."
    )


def _is_accelerator(value: Any) -> bool:
    return type(value).__module__.startswith("accelerate.") and callable(
        getattr(value, "save_state", None)
    )


def _accelerate_dir(directory: str, name: str) -> str:
    return os.path.join(directory, f"accelerate-{name}")


def to_save(found: list[Entry], directory: str) -> dict[str, Any]:
    """The state dict DCP saves; an Accelerator's state is saved by itself into
    ``directory`` here."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    saved: dict[str, Any] = {}
    for entry in found:
        if entry.kind == "model":
            saved[entry.name] = get_model_state_dict(entry.obj)
        elif entry.kind == "optimizer":
            saved[entry.name] = get_optimizer_state_dict(entry.model, entry.obj)
        elif entry.kind == "accelerator":
            entry.obj.save_state(_accelerate_dir(directory, entry.name))
        elif entry.kind == "stateful":
            saved[entry.name] = entry.obj.state_dict()
        else:
            saved[entry.name] = dict(entry.obj)
    return saved


def to_load(found: list[Entry], directory: str) -> dict[str, Any]:
    """The state dict DCP loads into (this rank's own tensors, filled in place; a dict's
    missing keys added as the checkpoint has them); an Accelerator's state is loaded by
    itself from ``directory`` here."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    loaded = to_save([e for e in found if e.kind != "accelerator"], directory)
    dicts = [e.name for e in found if e.kind == "dict"]
    if dicts:
        saved = FileSystemReader(directory).read_metadata().state_dict_metadata
        for fqn, about in saved.items():
            name, _, key = fqn.partition(".")
            if name in dicts and key and "." not in key and key not in loaded[name]:
                loaded[name][key] = _placeholder(about)
    for entry in found:
        if entry.kind == "accelerator":
            entry.obj.load_state(_accelerate_dir(directory, entry.name))
    return loaded


def _placeholder(about: Any) -> Any:
    """Where DCP loads a saved value the caller's dict lacks: a tensor of its shape, or a
    value DCP replaces."""
    import torch

    size = getattr(about, "size", None)
    if size is None:
        return None
    return torch.empty(size, dtype=about.properties.dtype)


def put_back(found: list[Entry], loaded: dict[str, Any]) -> None:
    """Hand what DCP loaded to each object."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for entry in found:
        if entry.kind == "model":
            set_model_state_dict(entry.obj, loaded[entry.name])
        elif entry.kind == "optimizer":
            set_optimizer_state_dict(entry.model, entry.obj, loaded[entry.name])
        elif entry.kind == "stateful":
            entry.obj.load_state_dict(loaded[entry.name])
        elif entry.kind == "dict":
            entry.obj.update(loaded[entry.name])


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself in a world of 1)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
