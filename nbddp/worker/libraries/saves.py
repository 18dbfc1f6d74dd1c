"""A training library's own checkpoint, told to the kernel (``checkpoints.saved_by``), so that
a graceful stop's warning names what was saved after the stop, whoever saved it:

* the Hugging Face ``Trainer``'s ``output_dir/checkpoint-N`` (its callbacks' ``on_save``, which
  follows every save: the one a graceful stop asks with ``control.should_save`` included);
* every checkpoint a Lightning ``Trainer`` writes: ``ModelCheckpoint``'s, and the one its Slurm
  requeue writes at a graceful stop (``hpc_ckpt_N.ckpt``), all through
  ``Trainer.save_checkpoint``;
* Accelerate's ``Accelerator.save_state`` (its directory), unless ``nbddp.checkpoint`` called
  it (then it is part of that checkpoint) or an HF Trainer is training (the Trainer's save).

Installed by ``trainers.py`` when the library is imported; a save outside a launch tells no one.
Non-goal: which files a library wrote (its own directory is named, as the library names it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from nbddp.worker.recovery import checkpoints

HF_TRAINER = "the Hugging Face Trainer"
LIGHTNING = "Lightning"
ACCELERATE = "Accelerate"
UNKNOWN_STEP = -1


def hf_trainer_saved(args: Any, state: Any) -> None:
    """The Trainer's ``on_save``: its ``checkpoint-<global step>`` under ``output_dir``."""
    try:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR as prefix
    except ImportError:  # a Trainer without the name: its documented folder's
        prefix = "checkpoint"
    step = int(state.global_step)
    path = os.path.join(str(args.output_dir), f"{prefix}-{step}")
    if os.path.isdir(path):  # one a hyperparameter search puts in a run's folder is not named
        checkpoints.saved_by(HF_TRAINER, step, path)


def tell_lightnings_saves(trainer: Any) -> None:
    """``Trainer.save_checkpoint(filepath, ...)`` says ``filepath`` once written."""

    def after(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _: Any) -> None:
        path = args[0] if args else kwargs.get("filepath")
        if path is not None:
            checkpoints.saved_by(LIGHTNING, int(self.global_step), os.fspath(path))

    _tell_after(trainer, "save_checkpoint", after)


def tell_accelerates_saves(accelerator: Any, training: Callable[[], bool]) -> None:
    """``Accelerator.save_state`` says the directory it returns, except while ``training()``
    (an HF Trainer, whose own save is the one to name)."""

    def after(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: Any) -> None:
        if isinstance(where, (str, os.PathLike)) and not training():
            checkpoints.saved_by(ACCELERATE, UNKNOWN_STEP, os.fspath(where))

    _tell_after(accelerator, "save_state", after)


def _tell_after(
    cls: Any, name: str, tell: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]
) -> None:
    original = getattr(cls, name, None)
    if original is None or getattr(original, "_nbddp_tells", False):
        return

    @functools.wraps(original)
    def saving(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        tell(self, args, kwargs, result)
        return result

    saving._nbddp_tells = True  # type: ignore[attr-defined]
    setattr(cls, name, saving)
