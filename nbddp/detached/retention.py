"""How long a user's finished detached runs are kept.

A finished run is kept until ``forget()`` or for ``KEEP_DAYS`` days after its end, and the
finished runs of a user together stay under ``KEEP_GB`` GB (the oldest go first);
``NBDDP_RUNS_KEEP_DAYS`` and ``NBDDP_RUNS_KEEP_GB`` change both. A running run is never
removed. The limits are enforced whenever a detached run starts or the runs are listed.

Non-goal: what a run directory holds (``store.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

from nbddp.detached import store

KEEP_DAYS_VARIABLE = "NBDDP_RUNS_KEEP_DAYS"
KEEP_GB_VARIABLE = "NBDDP_RUNS_KEEP_GB"
KEEP_DAYS = 30.0
KEEP_GB = 10.0
ABANDONED = 60.0  # seconds after which a directory left half-made by a killed kernel goes


def keep_limits() -> tuple[float, float]:
    """(days after its end, GB of all finished runs together)."""
    return (
        _number(KEEP_DAYS_VARIABLE, KEEP_DAYS),
        _number(KEEP_GB_VARIABLE, KEEP_GB),
    )


def sweep(root: str | None = None) -> list[str]:
    """Enforce the retention limits; the ids removed."""
    root = root or store.runs_root(create=False)
    days, gigabytes = keep_limits()
    removed = []
    finished: list[tuple[float, int, store.StoredRun]] = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(store.NEW):
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > ABANDONED and not store.lock_is_held(
                    os.path.join(path, store.LOCK)
                ):
                    shutil.rmtree(path, ignore_errors=True)
            continue
        if store.ID.fullmatch(name) is None:
            continue
        run = store.StoredRun(path)
        try:
            _, ended = run.state()
        except OSError:
            continue
        if ended is None:
            continue  # running: never removed
        if now - ended > days * 86400:
            run.remove()
            removed.append(run.id)
        else:
            finished.append((ended, run.size(), run))
    total = sum(size for _, size, _ in finished)
    for _, size, run in sorted(finished, key=lambda item: item[0]):
        if total <= gigabytes * 1e9:
            break
        run.remove()
        removed.append(run.id)
        total -= size
    return removed


def _number(variable: str, default: float) -> float:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{variable}={text!r} must be a number >= 0 (the default is {default:g}).")
    return value
