"""The collective timeout a library asks for, where it would otherwise be lost.

Accelerate (and through it the HF Trainer's ``ddp_timeout``) and Lightning call
``init_process_group(timeout=...)`` only when no process group exists; in a rank nbddp made the
group before ``fn``, so they skip the call and their timeout with it. Each is hooked where it
receives the timeout (Accelerate's ``PartialState``, which ``InitProcessGroupKwargs`` and
``TrainingArguments`` reach; Lightning's ``_init_dist_connection``, which every strategy calls
with its ``timeout=``), and hands it to the collective watch, which enforces it
(``worker/diagnosis/collective_watch.py``).

Non-goal: any other option of theirs (the group nbddp made is theirs, as it is).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbddp.worker.diagnosis import collective_watch

LIGHTNING_DISTRIBUTED = (
    "lightning_fabric.utilities.distributed",
    "lightning.fabric.utilities.distributed",
)


def patch_accelerate_state(module: ModuleType) -> None:
    """``PartialState(timeout=...)``: the first one made (its state is shared) asks it."""
    cls = module.PartialState
    if getattr(cls.__init__, "_nbddp", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        timeout = kwargs.get("timeout")
        if timeout is not None and not getattr(cls, "_shared_state", None):
            collective_watch.ask(timeout)
        original(self, *args, **kwargs)

    __init__._nbddp = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def patch_lightning_distributed(module: ModuleType) -> None:
    """``_init_dist_connection(..., timeout=...)``, also where a strategy module imported it
    by name before this hook ran (a notebook that imported Lightning before the launch)."""
    original = module._init_dist_connection
    if getattr(original, "_nbddp", False):
        return
    patched = _asking_timeout(original)
    module._init_dist_connection = patched  # type: ignore[attr-defined]
    for name, other in list(sys.modules.items()):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric") and (
            getattr(other, "_init_dist_connection", None) is original
        ):
            other._init_dist_connection = patched  # type: ignore[attr-defined]


def _asking_timeout(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_dist_connection(*args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        if timeout is not None:
            collective_watch.ask(timeout)
        return original(*args, **kwargs)

    init_dist_connection._nbddp = True  # type: ignore[attr-defined]
    return init_dist_connection
