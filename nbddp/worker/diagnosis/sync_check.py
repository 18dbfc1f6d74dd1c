"""Did the ranks train one model together? What this rank knows of it, for the kernel to judge.

A rank remembers every ``DistributedDataParallel`` module built in it (so every
``prepare_model`` model, the Trainer's, Lightning's and Accelerate's wrappers too: a hook on
the constructor), whether an optimizer ever stepped (a global step hook that sets a flag: a
Python call per step, well under a microsecond), and how many collectives its process groups
ran (their sequence numbers, which torch keeps anyway). When ``fn`` returns, each model's
parameters are fingerprinted (their sum, sum of magnitudes and of squares) and sent to the kernel
with the result, where
:mod:`nbddp.rules.sync` compares them across ranks.

Nothing runs per step, and no collective runs for the check: it works after the user's
``destroy_process_group()`` (the counts of destroyed groups are kept as they go) and whatever
state the group is in.

Non-goals: saying *why* ranks diverged; sharded parameters (FSDP, DTensor shards) are not
fingerprinted, since they differ across ranks by design (FSDP cannot run without its
collectives, which the count sees). Only the newest model is kept alive until ``fn`` returns
(so that a model local to ``fn`` can still be checked); an older one is fingerprinted when the
next is built and, if the user still holds it at the end, again then.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from nbddp.wire.messages import ModelPrint, SyncCheck
from nbddp.worker.diagnosis import collectives

_installed = False
_models: list[tuple[weakref.ref[Any], ModelPrint | None]] = []
_newest: Any = None  # the newest model, held until the end of fn
_stepped = False
_destroyed_collectives = 0  # collectives run by groups the user destroyed
_baseline = 0  # collectives run before fn (none, today: joining the group runs none)
_step_hook: Any = None
_alone = ""  # a library that said it runs this rank as a job of one (note_alone)


def install() -> None:
    """Start remembering, for the run that is about to call ``fn`` (idempotent hooks)."""
    global _installed, _stepped, _destroyed_collectives, _newest, _step_hook, _baseline, _alone
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _models.clear()
    _newest = None
    _stepped = False
    _alone = ""
    _destroyed_collectives = 0
    _baseline = _collectives()
    _step_hook = register_optimizer_step_pre_hook(_first_step)
    if _installed:
        return
    _installed = True
    _after_init(DistributedDataParallel, _remember)
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        global _destroyed_collectives
        _destroyed_collectives += _collectives(group)
        original(group)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _after_init(cls: Any, remember: Any) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        remember(self)

    cls.__init__ = __init__


def _remember(model: Any) -> None:
    global _newest
    if _models and _newest is not None:  # the previous one: fingerprinted now, held weakly
        ref, _ = _models[-1]
        _models[-1] = (ref, fingerprint(_newest))
    _models.append((weakref.ref(model), None))
    _newest = model


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _stepped
    _stepped = True  # (the hook cannot remove itself: torch is iterating over the hooks)


def _collectives(group: Any = None) -> int:
    """How many collectives ``group`` (every group when None) has run on this rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    c10d = dist.distributed_c10d
    groups = list(c10d._world.pg_map) if group is None else [group]
    count = 0
    for pg in groups:
        try:
            count += collectives.count(pg)
        except Exception:  # a backend that keeps no count (or a group already gone)
            continue
    return count


def fingerprint(model: Any) -> ModelPrint:
    """The sum, the sum of magnitudes and the sum of squares of the replicated parameters:
    reductions in float32 (no copy of a parameter), read back at once, added in float64."""
    import torch

    inner = getattr(model, "module", model)
    reduced = []
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "meta" or hasattr(p, "placements"):  # DTensor: sharded
                continue
            data = p.detach()
            reduced.append(
                torch.stack(
                    [
                        data.sum(dtype=torch.float32),
                        torch.linalg.vector_norm(data, 1, dtype=torch.float32),
                        torch.linalg.vector_norm(data, 2, dtype=torch.float32),
                    ]
                )
            )
        rows = torch.stack(reduced).tolist() if reduced else []
    return ModelPrint(
        type(inner).__name__,
        len(rows),
        sum(row[0] for row in rows),
        sum(row[1] for row in rows),
        sum(row[2] ** 2 for row in rows),
    )


def note_alone(library: str) -> None:
    """``library`` runs this rank of a multi-rank launch as a job of one (a Lightning
    trainer of one device): the verdict names it if the ranks then trained apart."""
    global _alone
    _alone = library


def _library_alone() -> str:
    """A library that ran this rank of a multi-rank launch as a job of one: one that said so
    (:func:`note_alone`), or Accelerate's state (``Accelerator()``, the HF Trainer's
    ``PartialState``) with one process (CPU ranks join only with ``cpu=True`` or
    ``ACCELERATE_USE_CPU``)."""
    if _alone:
        return _alone
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and shared.get("num_processes") == 1:
        return "accelerate"
    return ""


def report() -> SyncCheck | None:
    """This rank's fingerprints and counts, after ``fn`` returned; the models are let go."""
    global _newest, _step_hook
    if _step_hook is not None:
        _step_hook.remove()
        _step_hook = None
    try:
        prints = []
        for ref, earlier in _models:
            model = ref() if _newest is None or ref() is not _newest else _newest
            if model is not None:
                prints.append(fingerprint(model))
            elif earlier is not None:
                prints.append(earlier)
        ran = _collectives() + _destroyed_collectives - _baseline
        return SyncCheck(tuple(prints), ran, _stepped, _library_alone())
    except Exception:  # the check must never fail the run: the kernel then judges nothing
        return None
    finally:
        _models.clear()
        _newest = None
