"""The options of stopping well (``checkpoint_dir=``, ``keep=``, ``max_restarts=``,
``stop_grace=``) checked; the default checkpoint directory of a function or a cell (the same
at its next launch, so that ``nbddp.restore`` resumes it); and the words of a graceful stop."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

KEEP = 2  # complete checkpoints kept by default
STOP_GRACE = 60.0  # default seconds a graceful stop may take before the ranks are ended
CHECKPOINTS = "nbddp-checkpoints"  # the default checkpoint directories' parent, in the cwd


def check_stopping(
    checkpoint_dir: Any, keep: Any, max_restarts: Any, stop_grace: Any
) -> dict[str, Any]:
    """``checkpoint_dir=``, ``keep=``, ``max_restarts=``, ``stop_grace=``, checked; the
    directory made absolute (every rank, on any node, resolves it alike)."""
    if checkpoint_dir is None:
        directory = ""
    elif isinstance(checkpoint_dir, (str, os.PathLike)) and os.fspath(checkpoint_dir):
        directory = os.path.abspath(os.fspath(checkpoint_dir))
    else:
        raise ValueError(
            f"checkpoint_dir={checkpoint_dir!r} must be a directory path (a str or Path), or "
            "None for one named after the function under ./nbddp-checkpoints/."
        )
    for name, value, least in (("keep", keep, 1), ("max_restarts", max_restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be a whole number >= {least}.")
    return {
        "checkpoint_dir": directory,
        "keep": keep,
        "max_restarts": max_restarts,
        "stop_grace": check_stop_grace(stop_grace),
    }


def check_stop_grace(stop_grace: Any) -> float:
    """``stop_grace=`` checked (a launch's, or a session task's)."""
    if (
        isinstance(stop_grace, bool)
        or not isinstance(stop_grace, (int, float))
        or not (stop_grace >= 0 and math.isfinite(stop_grace))
    ):
        raise ValueError(
            f"stop_grace={stop_grace!r} must be a number of seconds >= 0 (how long a graceful "
            "stop may take before the ranks are ended; 0: never graceful)."
        )
    return float(stop_grace)


def default_checkpoint_dir(name: str) -> str:
    """``./nbddp-checkpoints/<name>``: a function's or a cell's, the same at its next launch."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name.replace("<locals>.", "")).strip("-.")
    return os.path.join(os.getcwd(), CHECKPOINTS, safe or "main")


# A library's own checkpoint, and how its next run resumes from it (the stop's warning).
RESUMES = {
    "the Hugging Face Trainer": "trainer.train(resume_from_checkpoint=True) resumes it",
    "Lightning": "trainer.fit(..., ckpt_path=<the path>) resumes it",
    "Accelerate": "accelerator.load_state(<the path>) resumes it",
}

Saved = tuple[int, str, str]  # (step, path, by): "" by is nbddp.checkpoint


def stopped_gracefully(step: int, where: str, why: str, saved: Sequence[Saved]) -> str:
    """The warning of a run that stopped gracefully: where, by what, and what was saved after
    the stop, whoever saved it (``nbddp.checkpoint``, or a trainer's own checkpoint)."""
    text = f"the run stopped gracefully at step {step} ({where}) on every rank, asked by {why}"
    text += "; the result is what the function returned then."
    if not saved:
        return text + (
            " Nothing was saved after the stop (no nbddp.checkpoint, no trainer's own "
            "checkpoint), so a next run starts from its last checkpoint, if any."
        )
    ours = [(at, path) for at, path, by in saved if not by]
    if ours:  # the last: the one nbddp.restore loads
        text += f" Its checkpoint of step {ours[-1][0]} is in {ours[-1][1]}."
    theirs: dict[str, dict[str, int]] = {}  # each library's checkpoints: {path: step}, in order
    for at, path, by in saved:
        if by:
            theirs.setdefault(by, {})[path] = at
    for by, paths in theirs.items():
        steps = set(paths.values())
        of_step = f" of step {steps.pop()}" if len(steps) == 1 and min(paths.values()) >= 0 else ""
        places = " and ".join(
            path if of_step or at < 0 else f"{path} (step {at})" for path, at in paths.items()
        )
        plural = "s" if len(paths) > 1 else ""
        text += f" {by[0].upper()}{by[1:]} saved its own checkpoint{plural}{of_step} in {places}"
        resume = RESUMES.get(by)
        text += f" ({resume})." if resume else "."
    return text


def exported_recovery(checkpoint_dir: Any, max_restarts: Any, name: str) -> dict[str, Any]:
    """An exported script's: the checkpoint directory (a launch's default for ``name``) and
    torchrun's restarts, checked (``ValueError`` says ``export:``)."""
    try:
        checked = check_stopping(checkpoint_dir, KEEP, max_restarts, STOP_GRACE)
    except ValueError as exc:
        raise ValueError(f"export: {exc}") from None
    return {
        "checkpoint_dir": checked["checkpoint_dir"] or default_checkpoint_dir(name),
        "keep": KEEP,
        "max_restarts": checked["max_restarts"],
    }
