"""What libraries already know, shown by the panel, with no change to the user's code.

Installed in every rank before ``fn`` runs, each through the library's own extension point,
and only when (and if) the library is imported:

* **tqdm** (``tqdm``, ``tqdm.auto``, ``tqdm.notebook``, so the HF Trainer's and Lightning's
  bars too): on rank 0 a bar becomes a panel bar (count, rate, ETA; nested when nested)
  instead of text; on other ranks it is silent unless ``output="all"``.
* **Hugging Face** ``Trainer``: a ``TrainerCallback`` whose ``on_log`` logs what the Trainer
  logs (``loss``, ``learning_rate``, ``grad_norm``, ``epoch``, eval metrics).
* **Lightning** ``Trainer``: a ``Logger`` added to the trainer's loggers, given what
  ``self.log(...)`` logged; with ``logger=False``, a ``Callback`` giving what Lightning's own
  progress bar shows (``trainer.progress_bar_metrics``), since adding a logger would move the
  trainer's checkpoint directory.
  Lightning's default progress bar becomes its tqdm one (rich's, its default when rich is
  importable, draws only a last frame where output is no terminal).
* **Accelerate**: a tracker, given what ``accelerator.log(...)`` logs.

The rule for averaging: a library that calls us on every rank (the Trainer's ``on_log``,
Lightning's loggers) logs as ``nbddp.log`` does, and row k is averaged across ranks; values
the library already reduced are equal on every rank, so their average is that value, never
reduced twice. A library that logs on the main process only (Accelerate's trackers) gives rows
that are taken as rank 0 gives them.

A library that is absent costs nothing: the hooks wait for an import that never comes. An
integration that fails warns once and leaves the library as it was.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import io
import numbers
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from nbddp.errors import NbddpWarning
from nbddp.worker import catalyst_engines, launchers, live, rich
from nbddp.worker.context import rank

Patch = Callable[[ModuleType], None]
_NULL = io.StringIO()  # where a bar shown by the panel writes its text: nowhere


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a module is imported (``sys.meta_path``)."""

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Patch) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(self._patch, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real one
        return getattr(self._loader, name)


def _apply(patch: Patch, module: ModuleType) -> None:
    try:
        patch(module)
    except Exception as exc:  # the user's import must never fail because of us
        warnings.warn(
            f"nbddp could not hook into {module.__name__} ({type(exc).__name__}: {exc}); "
            "it works as usual, without its progress or metrics in the panel.",
            NbddpWarning,
            stacklevel=2,
        )


_output = "rank0"  # whose output the current run shows (a session's tasks each say theirs)


def set_output(output: str) -> None:
    global _output
    _output = output


def install(output: str) -> None:
    """Hook the libraries into this rank's panel (``output``: whose output is shown), and
    guard the launchers that must not start inside a rank (``launchers``). Called before the
    job is unpickled: a function it refers to (IPython's ``display``) resolves to the hooked
    one."""
    set_output(output)
    launchers.install()
    patches: dict[str, Patch] = {
        "tqdm.std": _patch_tqdm,
        "tqdm.notebook": _use_plain_tqdm,
        "transformers.trainer": _patch_transformers,
        "lightning.pytorch.trainer.trainer": _patch_lightning,
        "pytorch_lightning.trainer.trainer": _patch_lightning,
        "accelerate.accelerator": _patch_accelerate,
        "torch.distributed.launcher.api": launchers.guard_elastic,
        "IPython.core.display_functions": rich.install(),  # display() into the cell
        "catalyst.runners.runner": catalyst_engines.patch,
    }
    for name, patch in patches.items():
        if name in sys.modules:  # imported already (a library the job itself imported)
            _apply(patch, sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(patches))


# -- tqdm -------------------------------------------------------------------------------------


def _patch_tqdm(module: ModuleType) -> None:
    cls = module.tqdm
    if getattr(cls, "_nbddp", False):
        return
    original_init, original_close = cls.__init__, cls.close
    # update() is not wrapped: it calls refresh() whenever tqdm itself would redraw, so the
    # panel bar is as fresh as tqdm's own, and a training step pays nothing extra
    mirrored = {name: getattr(cls, name) for name in ("refresh", "reset")}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        buffer = live.current()
        shows = buffer is not None and rank() == 0
        if buffer is not None and (shows or _output != "all") and not kwargs.get("disable"):
            kwargs["file"] = _NULL  # the panel shows it (rank 0), or nobody does
            kwargs["disable"] = False  # (None would disable it: the null file is no tty)
        original_init(self, *args, **kwargs)
        if shows and buffer is not None and not self.disable:
            self._nbddp_bar = buffer.open_bar(_desc(self), _total(self))
            self._nbddp_buffer = buffer

    def close(self: Any) -> None:
        bar = self.__dict__.pop("_nbddp_bar", None)
        if bar is not None:
            _mirror(self, bar)
            self._nbddp_buffer.close_bar(bar)
        original_close(self)

    def mirroring(method: Callable[..., Any]) -> Callable[..., Any]:
        def mirrored_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            bar = self.__dict__.get("_nbddp_bar")
            if bar is not None:
                _mirror(self, bar)
                self._nbddp_buffer.bars_dirty = True
            return result

        return mirrored_method

    cls.__init__ = __init__
    cls.close = close
    for name, method in mirrored.items():
        setattr(cls, name, mirroring(method))
    cls._nbddp = True


def _mirror(bar_of_tqdm: Any, bar: Any) -> None:
    bar.n = int(bar_of_tqdm.n)
    bar.total = _total(bar_of_tqdm)
    bar.desc = _desc(bar_of_tqdm)


def _desc(bar: Any) -> str | None:
    desc = str(getattr(bar, "desc", "") or "").rstrip(": ")
    return desc or None


def _total(bar: Any) -> int | None:
    total: Any = getattr(bar, "total", None)
    return int(total) if isinstance(total, (int, float)) and total > 0 else None


def _use_plain_tqdm(module: ModuleType) -> None:
    """A rank has no notebook front end: its notebook bars are plain tqdm bars (shown by
    the panel on rank 0)."""
    import tqdm.std

    module.tqdm = tqdm.std.tqdm  # type: ignore[attr-defined]
    module.trange = tqdm.std.trange  # type: ignore[attr-defined]


# -- metrics ----------------------------------------------------------------------------------


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


def _patch_transformers(module: ModuleType) -> None:
    trainer = module.Trainer
    if getattr(trainer, "_nbddp", False):
        return
    from transformers import TrainerCallback

    class NbddpCallback(TrainerCallback):
        """What the Trainer logs, on every rank, into the panel (loss is already reduced)."""

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            values = numbers_in(logs or {})
            if values:
                live.log(values)

    _after(trainer, "__init__", lambda self, kwargs: self.add_callback(NbddpCallback))


def _patch_lightning(module: ModuleType) -> None:
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

    class NbddpBarMetrics(callbacks.Callback):  # type: ignore[misc, name-defined]
        """With ``logger=False``: what Lightning's own progress bar shows
        (``trainer.progress_bar_metrics``, the ``prog_bar=True`` values), after every
        training batch and validation, on every rank (the same number of rows on each)."""

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._log(trainer)

        def on_validation_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if not trainer.sanity_checking:
                self._log(trainer)

        @staticmethod
        def _log(trainer: Any) -> None:
            values = numbers_in(trainer.progress_bar_metrics)
            values.pop("v_num", None)  # the logger's version, not a metric
            if values:
                live.log(values)

    def install(self: Any, kwargs: dict[str, Any]) -> None:
        if self.loggers:  # appended: loggers[0] keeps its role (log_dir, v_num, checkpoints)
            self.loggers = [*self.loggers, NbddpLogger()]
        else:  # logger=False: no logger is added (it would move the checkpoint directory)
            self.callbacks.append(NbddpBarMetrics())
        bar = self.progress_bar_callback
        chosen = kwargs.get("callbacks") or []
        if isinstance(bar, callbacks.RichProgressBar) and bar not in chosen:
            # Lightning's default when rich is importable; a rank's output is no terminal, so
            # rich would draw its last frame only: tqdm's becomes a live panel bar instead
            self.callbacks[self.callbacks.index(bar)] = callbacks.TQDMProgressBar()

    _after(trainer, "__init__", install)


def _patch_accelerate(module: ModuleType) -> None:
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

    _after(accelerator, "__init__", add_tracker)
    _after(accelerator, "init_trackers", add_tracker)  # older versions start a new list there
