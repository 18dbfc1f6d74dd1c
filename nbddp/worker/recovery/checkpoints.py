"""``nbddp.checkpoint`` and ``nbddp.restore``: the training state saved by every rank together
with ``torch.distributed.checkpoint`` (DCP), so FSDP's shards are saved as shards, and loaded
back in place.

The run's checkpoint directory (``notebook_launch(checkpoint_dir=...)``; by default one per
function or cell under ``./nbddp-checkpoints/``, the same for the next launch) holds:

    step-120/         a complete checkpoint: DCP's files, its ``.metadata``, and ``nbddp.json``
    .partial-<run>-<n>-step-130/   one being written: never loaded

A checkpoint is written under a partial name and renamed to ``step-N`` by rank 0 once every
rank's files and DCP's metadata are written and synced: a rename is atomic, so a save cut short
by a kill leaves a partial directory that ``restore`` never sees, and that the next complete
save removes (one run writes into a directory at a time). The last ``keep`` complete
checkpoints (by the time they were saved) are kept; an older one is renamed to a partial name
before it is deleted, so a kill during the prune never leaves a ``step-N`` missing files.
Values saved on several ranks (a DDP model, a dict's plain values) are written once, rank
0's. ``restore`` loads the latest one; rank 0 chooses it and tells the others, so every rank
loads the same even on a file system whose listings lag.

Non-goal: asynchronous saves, and storage other than a file system every rank can reach
(several machines need a shared one).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from nbddp.worker.recovery import state_dicts

COMPLETE = "nbddp.json"  # written last into a checkpoint, before its rename
PARTIAL = ".partial-"
ROOT = "nbddp-checkpoints"  # the default parent, in the working directory

# (step, path, seconds, restored, by): a complete checkpoint saved (``by``: the library whose
# own save it is, "" for ours), or the one restore loaded
Notify = Callable[[int, str, float, bool, str], None]

_directory: str | None = None
_keep = 2
_notify: Notify | None = None
_saves = itertools.count()  # this process's saves: the same sequence on every rank
_inside = False  # checkpoint() runs: a library's save it calls (save_state) is part of ours


Config = tuple[str | None, int, Notify | None]


def configure(directory: str | None, keep: int = 2, notify: Notify | None = None) -> Config:
    """The run's checkpoint directory and how many to keep (a rank's runtime, the one-rank
    run, an exported script); ``notify`` hears of each complete checkpoint (rank 0's). Returns
    what it replaced (``configure(*previous)`` puts it back)."""
    global _directory, _keep, _notify
    previous = _directory, _keep, _notify
    _directory, _keep, _notify = directory, keep, notify
    return previous


def directory() -> str:
    """Where this run's checkpoints go: the launch's directory; outside a launch
    ``NBDDP_CHECKPOINT_DIR``, else ``./nbddp-checkpoints/<script name>``."""
    if _directory:
        return _directory
    chosen = os.environ.get("NBDDP_CHECKPOINT_DIR")
    if chosen:
        return os.path.abspath(chosen)
    script = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return os.path.abspath(os.path.join(ROOT, script or "main"))


def keep() -> int:
    if _directory:
        return _keep
    text = os.environ.get("NBDDP_CHECKPOINT_KEEP", "")
    return int(text) if text.isdigit() and int(text) >= 1 else _keep


def checkpoint(state: Mapping[str, Any], *, step: int) -> str:
    """Save the training state as step ``step``, on every rank together.

    Call it on every rank (it is collective). It saves with ``torch.distributed.checkpoint``,
    so an FSDP model is saved as its shards, into the run's checkpoint directory
    (``notebook_launch(checkpoint_dir=...)``; by default one named after the function or
    cell under ``./nbddp-checkpoints/``). The checkpoint is complete when this returns: it is
    written under a partial name and renamed whole, so a save cut short by a kill is never
    loaded. The last ``keep`` checkpoints stay.

    Args:
        state: ``{name: object}``: a model, an optimizer (with its model in the same state),
            an lr scheduler, any object with ``state_dict()``/``load_state_dict()``, an
            Accelerate ``Accelerator`` (its ``save_state``), or a dict of tensors and plain
            values. Values saved on several ranks are written once, rank 0's.
        step: The training step, a whole number; saving a step again replaces it.

    Returns:
        The checkpoint's directory (``.../step-N``).

    Raises:
        ValueError: ``state`` holds something that cannot be loaded back in place, or an
            optimizer without its model; ``step`` is not a whole number >= 0.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a whole number >= 0 (the training step).")
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save

    global _inside
    started = time.monotonic()
    entries = state_dicts.entries(state, loading=False)
    root = directory()
    partial = os.path.join(root, _partial_name(step))
    os.makedirs(partial, exist_ok=True)
    _inside = True
    try:
        saved = state_dicts.to_save(entries, partial)
    finally:
        _inside = False
    save(saved, checkpoint_id=partial, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    final = os.path.join(root, f"step-{step}")
    if state_dicts.rank() == 0:
        _complete(root, partial, final, step, sorted(state))
    state_dicts.barrier()  # every rank returns once the checkpoint is complete
    seconds = time.monotonic() - started
    if _notify is not None and state_dicts.rank() == 0:
        _notify(step, final, seconds, False, "")
    return final


def saved_by(library: str, step: int, path: str) -> None:
    """A library's own checkpoint, complete at ``path`` (a trainer's ``checkpoint-N``...): the
    kernel hears of rank 0's, so that a graceful stop's warning names it. One that
    :func:`checkpoint` makes (an ``Accelerator``'s ``save_state``) is part of ours, not told."""
    if _notify is not None and not _inside and state_dicts.rank() == 0:
        _notify(step, os.path.abspath(path), 0.0, False, library)


def restore(state: Mapping[str, Any]) -> int | None:
    """Load the latest complete checkpoint into ``state``, in place, on every rank.

    Call it on every rank (rank 0 picks the checkpoint and the others load the same). The
    same launch of the same function or cell finds the checkpoints of its previous launch,
    so ``start = nbddp.restore(state) or 0`` resumes a stopped or failed run. Shards load
    into another world size or sharding too.

    Args:
        state: As for [nbddp.checkpoint][]: the objects to load into. A dict's keys it lacks
            are filled from the checkpoint.

    Returns:
        The step of the checkpoint loaded, or None when there is none yet.

    Raises:
        ValueError: ``state`` names something the checkpoint does not hold.
    """
    from torch.distributed.checkpoint.state_dict_loader import load

    entries = state_dicts.entries(state, loading=True)
    root = directory()
    chosen = _agreed(latest(root) if state_dicts.rank() == 0 else None)
    if chosen is None:
        return None
    path, step, names = chosen
    missing = sorted(set(state) - set(names))
    if missing:
        raise ValueError(
            f"the checkpoint {path} has no {', '.join(map(repr, missing))}: it holds "
            f"{', '.join(map(repr, names))}. Restore the names it was saved with, or save "
            "under the new names first."
        )
    started = time.monotonic()
    loaded = state_dicts.to_load(entries, path)
    load(loaded, checkpoint_id=path)
    state_dicts.put_back(entries, loaded)
    if _notify is not None and state_dicts.rank() == 0:
        _notify(int(step), path, time.monotonic() - started, True, "")
    return int(step)


def latest(root: str) -> tuple[str, int, list[str]] | None:
    """The checkpoint ``restore`` would load: (path, step, the names it holds), or None."""
    found = complete_checkpoints(root)
    if not found:
        return None
    _, step, path, names = found[-1]
    return path, step, names


def complete_checkpoints(root: str) -> list[tuple[float, int, str, list[str]]]:
    """Every complete checkpoint under ``root``: (saved at, step, path, names), oldest first."""
    found = []
    try:
        listing = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in listing:
        if not name.startswith("step-"):
            continue
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, COMPLETE)) as f:
                record = json.load(f)
            found.append((float(record["saved"]), int(record["step"]), path, record["names"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of ours, or not complete
    return sorted(found)


def _partial_name(step: int) -> str:
    """The same on every rank: the launch's run id (or rank 0's token, under another
    launcher) and this process's count of saves."""
    run = os.environ.get("NBDDP_RUN_ID") or _agreed(os.urandom(6).hex())
    return f"{PARTIAL}{run}-{next(_saves)}-step-{step}"


def _agreed(value: Any) -> Any:
    """Rank 0's ``value``, on every rank."""
    return state_dicts.broadcast(value)


def _complete(root: str, partial: str, final: str, step: int, names: list[str]) -> None:
    """Rank 0, once every rank's files are written: mark, sync, rename, prune."""
    record = {"step": step, "saved": time.time(), "names": names}
    with open(os.path.join(partial, COMPLETE), "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    _sync_directory(partial)
    replaced = None
    if os.path.exists(final):  # the same step saved again: the new one replaces it
        replaced = partial + ".replaced"
        os.rename(final, replaced)
    os.rename(partial, final)
    _sync_directory(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for _, _, path, _ in complete_checkpoints(root)[: -keep()]:
        _remove(path)
    for name in os.listdir(root):  # saves cut short (ours is complete: none of ours is left)
        if name.startswith(PARTIAL):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _remove(path: str) -> None:
    """An old checkpoint, out of the ``step-N`` names first (a rename is atomic), then deleted:
    a kill in the middle of the delete leaves a partial name, which the next save clears,
    never a ``step-N`` with some of its files gone."""
    doomed = os.path.join(os.path.dirname(path), f"{PARTIAL}pruned-{os.path.basename(path)}")
    try:
        os.rename(path, doomed)
    except OSError:
        return  # gone already, or not ours to move
    shutil.rmtree(doomed, ignore_errors=True)


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
