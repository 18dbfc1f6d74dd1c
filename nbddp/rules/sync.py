"""Did the ranks of a run train one model together? The verdict, from what each rank reported.

Each rank sends a :class:`~nbddp.wire.messages.SyncCheck` with its result (see
``nbddp/worker/diagnosis/sync_check.py``): a fingerprint of every DDP model it built, how many
collectives it ran, whether an optimizer stepped. :func:`judge` is a pure function of them
(tested by a table in ``tests/rules/test_sync_check.py``), and says in plain words what went wrong:

* a model's fingerprints differ across ranks: the ranks trained their copies independently
  (the classic: the model is wrapped in DDP, but the unwrapped module is trained);
* no rank built a DDP model nor ran a single collective, and some rank stepped an optimizer:
  each rank trained on its own.

Non-goals: a run without training (no optimizer step, no DDP model) is not judged, nor one
whose ranks ran collectives of their own with no DDP model (they may average by hand). Float
noise is no divergence: fingerprints agree within a relative ``TOLERANCE``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nbddp.wire.messages import ModelPrint, SyncCheck

TOLERANCE = 1e-5  # relative; DDP's replicas are bitwise equal, independent ones differ by far more


def judge(world_size: int, checks: Mapping[int, SyncCheck]) -> str | None:
    """The warning for a multi-rank run whose ranks did not train together, or None."""
    if world_size < 2 or len(checks) < world_size:
        return None  # a single rank, or a rank that could not report: nothing to compare
    reports = [checks[rank] for rank in range(world_size)]
    library = next(
        (_LIBRARIES[r.alone].format(n=world_size) for r in reports if r.alone in _LIBRARIES), None
    )
    diverged = _diverged_model(reports)
    if diverged is not None:
        return (
            f"ranks trained independently: the parameters of {diverged} differ across ranks "
            "at the end of the run. "
            + (
                library
                or "Was the model wrapped in DDP (nbddp.prepare_model) and trained through the "
                "wrapper, not its .module?"
            )
        )
    built_ddp = any(r.models for r in reports)
    communicated = any(r.collectives > 0 for r in reports)
    stepped = any(r.stepped for r in reports)
    if stepped and not built_ddp and not communicated:
        return (
            f"ranks trained independently: the {world_size} ranks never communicated (no DDP "
            "model, no collective), so each trained its own model and only rank 0's came "
            "back. " + (library or "Was the model wrapped in DDP (nbddp.prepare_model)?")
        )
    return None


# What a rank's library said when it ran the rank as a job of its own (SyncCheck.alone).
_LIBRARIES = {
    "accelerate": (
        "Accelerate ran each rank as a process of its own (its state: 1 process, "
        "DistributedType.NO), so accelerator.prepare() wrapped nothing in DDP. On CPU ranks it "
        "joins the job with ACCELERATE_USE_CPU=true, which nbddp sets unless env= changes it, "
        "or with Accelerator(cpu=True) (PartialState(cpu=True) when made directly)."
    ),
    "lightning": (
        "Lightning's Trainer ran each rank as a job of one device (on CPU, devices='auto' "
        "is 1), so it wrapped nothing in DDP. Give it the launch's ranks: "
        "Trainer(accelerator='cpu', devices={n}, strategy='ddp') (devices: the ranks per node "
        "on a cluster)."
    ),
}


def _diverged_model(reports: list[SyncCheck]) -> str | None:
    """The name of the first model whose fingerprints differ across ranks."""
    count = min(len(r.models) for r in reports)
    for index in range(count):
        prints = [r.models[index] for r in reports]
        if any(not _same(prints[0], other) for other in prints[1:]):
            name = prints[0].name
            return (
                f"the DDP model #{index + 1} ({name})" if count > 1 else f"the DDP model ({name})"
            )
    return None


def _same(a: ModelPrint, b: ModelPrint) -> bool:
    """Equal up to float32 rounding (the sum against the magnitude: it may cancel to ~0)."""
    if a.tensors != b.tensors:
        return False
    scale = max(abs(a.magnitude), abs(b.magnitude))
    return (
        _close(a.magnitude, b.magnitude)
        and _close(a.squares, b.squares)
        and (abs(a.total - b.total) <= TOLERANCE * scale or _close(a.total, b.total))
    )


def _close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=TOLERANCE, abs_tol=1e-12) or (math.isnan(x) and math.isnan(y))
