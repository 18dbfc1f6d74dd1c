"""What the training libraries log, shown by the panel through their own extension points
(installed by ``integrations.py`` when, and if, the library is imported):

* **Hugging Face** ``Trainer``: a ``TrainerCallback`` whose ``on_log`` logs what the Trainer
  logs (``loss``, ``learning_rate``, ``grad_norm``, ``epoch``, eval metrics).
* **Lightning** ``Trainer``: a ``Logger`` added to the trainer's loggers, given what
  ``self.log(...)`` logged; with ``logger=False``, the same values at the same steps, taken
  where Lightning hands them to its loggers (adding a logger would move the trainer's
  checkpoint directory and make ``trainer.logger`` exist). A trainer that runs a rank of a
  multi-rank launch as a job of one (``Trainer()`` on CPU: one device) is told to the
  "did DDP happen?" check.
  Lightning's default progress bar becomes its tqdm one (rich's, its default when rich is
  importable, draws only a last frame where output is no terminal).
* **Accelerate**: a tracker, given what ``accelerator.log(...)`` logs.

A graceful stop (``stopping.py``) goes through each library's own controls, at a step boundary
every rank reaches together: the Trainer's step end sets ``control.should_training_stop`` and
``control.should_save`` (it saves its own ``checkpoint-N``); Lightning's batch end sets
``trainer.should_stop`` and saves the checkpoint its own Slurm requeue writes
(``hpc_ckpt_N.ckpt``, resumed by ``fit(ckpt_path="hpc")``); Accelerate's prepared data loaders
end their loop (the user's code then saves, e.g. ``nbddp.checkpoint({"accelerator": ...})``,
which is ``accelerator.save_state``).

The rule for averaging: a library that calls us on every rank (the Trainer's ``on_log``,
Lightning's loggers) logs as ``nbddp.log`` does, and row k is averaged across ranks; values
the library already reduced are equal on every rank, so their average is that value, never
reduced twice. A library that logs on the main process only (Accelerate's trackers) gives rows
that are taken as rank 0 gives them.

Non-goal: progress bars (``integrations.py``: tqdm) and Catalyst's engines
(``catalyst_engines.py``).
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from nbddp.worker import context, live
from nbddp.worker.diagnosis import sync_check
from nbddp.worker.libraries import saves
from nbddp.worker.recovery import stopping


def numbers_in(values: Mapping[str, Any]) -> dict[str, float]:
    """The values that can be charted: numbers and one-element tensors, bools left out."""
    found = {}
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, numbers.Real):
            found[str(name)] = float(value)
        elif getattr(value, "numel", None) is not None and value.numel() == 1:
            found[str(name)] = float(value.item())
    return found


def _after(cls: Any, name: str, install: Callable[[Any, dict[str, Any]], None]) -> None:
    """Make ``cls.name`` call ``install(self, kwargs)`` after itself, inside a launched rank:
    a library's extension point (callback, logger, tracker) goes on an instance."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if live.current() is not None:
            install(self, kwargs)
        return result

    setattr(cls, name, patched)
    cls._nbddp = True


def patch_transformers(module: ModuleType) -> None:
    trainer = module.Trainer
    if getattr(trainer, "_nbddp", False):
        return
    from transformers import TrainerCallback

    class NbddpCallback(TrainerCallback):
        """What the Trainer logs, on every rank, into the panel (loss is already reduced);
        a graceful stop at a step's end, with the Trainer's own save."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            _own_loops.append("the Hugging Face Trainer")  # its loader is no step boundary

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            if _own_loops:
                _own_loops.pop()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if stopping.check(int(state.global_step), "the Hugging Face Trainer"):
                control.should_training_stop = True
                control.should_save = True

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saves.hf_trainer_saved(args, state)  # named by a graceful stop's warning

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            values = numbers_in(logs or {})
            if values:
                live.log(values)

    _after(trainer, "__init__", lambda self, kwargs: self.add_callback(NbddpCallback))


def patch_lightning(module: ModuleType) -> None:
    trainer = module.Trainer
    if getattr(trainer, "_nbddp", False):
        return
    # On any machine with Slurm installed, Lightning warns at every fit that srun "is not
    # used" and advises prepending it: a false alarm here, where nbddp started the rank.
    warnings.filterwarnings(
        "ignore", message="The `srun` command is available on your system but is not used"
    )
    package = module.__name__.split(".trainer", 1)[0]  # lightning.pytorch or pytorch_lightning
    logger_base = __import__(f"{package}.loggers.logger", fromlist=["Logger"]).Logger

    class NbddpLogger(logger_base):  # type: ignore[misc, valid-type]
        """Given what ``self.log`` logged, on every rank (not rank 0 only), at the same steps."""

        @property
        def name(self) -> str:
            return "nbddp"

        @property
        def version(self) -> str:
            return "live"

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
            values = numbers_in(metrics)
            if values:
                live.log(values)

    callbacks = __import__(f"{package}.callbacks", fromlist=["TQDMProgressBar"])

    class NbddpStop(callbacks.Callback):  # type: ignore[misc, name-defined]
        """A graceful stop at a training batch's end: ``trainer.should_stop``, and the
        checkpoint Lightning's own Slurm requeue saves (when checkpointing is on)."""

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if not stopping.check(int(trainer.global_step), "Lightning"):
                return
            trainer.should_stop = True
            if trainer.checkpoint_callback is not None:
                connector = type(trainer._checkpoint_connector)
                trainer.save_checkpoint(connector.hpc_save_path(trainer.default_root_dir))

    def install(self: Any, kwargs: dict[str, Any]) -> None:
        if stopping.current() is not None:
            self.callbacks.append(NbddpStop())
        if self.loggers:  # appended: loggers[0] keeps its role (log_dir, v_num, checkpoints)
            self.loggers = [*self.loggers, NbddpLogger()]
        else:  # logger=False: what the loggers would get, without adding one
            _log_without_loggers(self, NbddpLogger())
        if self.world_size == 1 and context.world_size() > 1:
            sync_check.note_alone("lightning")
        bar = self.progress_bar_callback
        chosen = kwargs.get("callbacks") or []
        if isinstance(bar, callbacks.RichProgressBar) and bar not in chosen:
            # Lightning's default when rich is importable; a rank's output is no terminal, so
            # rich would draw its last frame only: tqdm's becomes a live panel bar instead
            self.callbacks[self.callbacks.index(bar)] = callbacks.TQDMProgressBar()

    saves.tell_lightnings_saves(trainer)
    _after(trainer, "__init__", install)


def _log_without_loggers(trainer: Any, logger: Any) -> None:
    """A trainer without loggers still gives ``logger`` what ``self.log(...)`` logged, when
    and as Lightning would give it to a logger (``log_every_n_steps``, epoch and validation
    ends; ``epoch`` added where Lightning adds it): the rows are those of a trainer with one."""
    connector: Any = getattr(trainer, "_logger_connector", None)
    original = getattr(connector, "log_metrics", None)
    if original is None:  # a Lightning without this seam: its panel shows bars only
        return

    @functools.wraps(original)
    def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
        original(metrics, step)
        if trainer.loggers or not metrics:
            return
        values = dict(metrics)
        if step is None and values.pop("step", None) is None:
            values.setdefault("epoch", trainer.current_epoch)
        logger.log_metrics(values, step)

    connector.log_metrics = log_metrics


def patch_accelerate(module: ModuleType) -> None:
    accelerator = module.Accelerator
    if getattr(accelerator, "_nbddp", False):
        return
    from accelerate.tracking import GeneralTracker

    class NbddpTracker(GeneralTracker):  # type: ignore[misc]
        """``accelerator.log`` runs on the main process only: its rows are rank 0's."""

        name = "nbddp"
        requires_logging_directory = False

        @property
        def tracker(self) -> Any:
            return self

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            buffer = live.current()
            found = numbers_in(values)
            if buffer is not None and found:
                buffer.log_main(found, step)

    def add_tracker(self: Any, kwargs: dict[str, Any]) -> None:
        if not any(isinstance(t, NbddpTracker) for t in self.trackers):
            self.trackers.append(NbddpTracker())

    saves.tell_accelerates_saves(accelerator, lambda: bool(_own_loops))
    _after(accelerator, "__init__", add_tracker)
    _after(accelerator, "init_trackers", add_tracker)  # older versions start a new list there


def patch_accelerate_loaders(module: ModuleType) -> None:
    """Accelerate's prepared data loaders end their loop at an agreed graceful stop, as
    ``nbddp.progress`` does: a check before each batch."""
    for name in ("DataLoaderShard", "DataLoaderDispatcher"):
        cls = getattr(module, name, None)
        if cls is None or getattr(cls, "_nbddp", False):
            continue
        cls.__iter__ = _stopping_at_a_batch(cls.__iter__)
        cls._nbddp = True


# The trainers whose own loop checks at its step ends (the HF Trainer's prepares its loader
# with Accelerate): while one trains, a loader's batch is no step boundary of ours.
_own_loops: list[str] = []


def _stopping_at_a_batch(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def __iter__(self: Any) -> Any:
        if stopping.current() is None or _own_loops:
            return original(self)
        return _checked(original(self))

    return __iter__


def _checked(batches: Any) -> Any:
    n = 0
    try:
        while not stopping.check(n, "Accelerate's data loader"):
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch
            n += 1
    finally:
        getattr(batches, "close", lambda: None)()  # its own end of loop (gradient state)
