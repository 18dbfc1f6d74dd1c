"""What the one-rank run in the kernel returns, on the CPU: the in-kernel counterpart of the
transfer pickler (``payload.py``), which moves every tensor of a multi-rank run's value while
pickling it. Here nothing is pickled, and nothing already on the CPU is copied.

Non-goal: objects that are not containers, tensors or modules (returned as they are).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any


def cpu_copy(torch: Any, tensor: Any) -> Any:
    cpu = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(cpu, requires_grad=tensor.requires_grad)
    return cpu.requires_grad_(tensor.requires_grad) if cpu.is_floating_point() else cpu


def to_cpu(value: Any) -> Any:
    """In-kernel counterpart of the transfer pickler, for the fallback: what comes back from
    the one rank is on the CPU, as a multi-rank run's is, with no copy of what already is.
    Walks dicts (an ``OrderedDict``: a ``state_dict()``; HF's ``ModelOutput``), lists, tuples
    (namedtuples too) and dataclasses, copying a container only where something inside it
    moved; unwraps DDP; a module on a GPU comes back as a CPU copy (the user's own model stays
    where it is, its optimizer's state with it). Other objects are returned as they are."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    return _to_cpu(torch, value, {}, 0)


_DEEPEST = 100  # containers nested deeper are returned as they are


def _to_cpu(torch: Any, value: Any, done: dict[int, Any], depth: int) -> Any:
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        value = value.module
    if isinstance(value, torch.nn.Module):
        return _module_on_cpu(torch, value)
    if isinstance(value, torch.Tensor):
        return cpu_copy(torch, value) if value.device.type not in ("cpu", "meta") else value
    if depth > _DEEPEST or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return value
    done[id(value)] = value  # a cycle comes back as it was
    moved = _moved_container(torch, value, done, depth + 1)
    done[id(value)] = moved
    return moved


def _moved_container(torch: Any, value: Any, done: dict[int, Any], depth: int) -> Any:
    """``value`` with what it holds on the CPU: the same object when nothing moved."""
    if isinstance(value, dict):
        entries = {key: _to_cpu(torch, item, done, depth) for key, item in value.items()}
        if all(entries[key] is item for key, item in value.items()):
            return value
        if type(value) is dict:
            return entries
        same_kind = _copied(value)  # OrderedDict, defaultdict, ModelOutput: their own class
        if same_kind is None:
            return value
        for key, item in entries.items():
            same_kind[key] = item
        return same_kind
    if isinstance(value, (list, tuple)):
        items = [_to_cpu(torch, item, done, depth) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        try:
            if hasattr(value, "_fields"):  # a namedtuple
                return type(value)(*items)
            return type(value)(items)
        except Exception:  # a sequence type that is not built from its items
            return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        moved = {name: _to_cpu(torch, item, done, depth) for name, item in fields.items()}
        if all(moved[name] is item for name, item in fields.items()):
            return value
        same_kind = _copied(value)
        if same_kind is None:
            return value
        for name, item in moved.items():
            object.__setattr__(same_kind, name, item)  # a frozen one too
        return same_kind
    return value


def _copied(value: Any) -> Any:
    try:
        return copy.copy(value)
    except Exception:
        return None


def _module_on_cpu(torch: Any, module: Any) -> Any:
    """``module`` when it is on the CPU already; else a copy on the CPU, made without a second
    copy of its GPU tensors: each parameter and buffer is copied to the CPU directly."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device.type in ("cpu", "meta") for t in tensors):
        return module
    memo = {id(t): cpu_copy(torch, t) for t in tensors if t.device.type not in ("cpu", "meta")}
    return copy.deepcopy(module, memo)
