"""What libraries already know, shown by the panel, with no change to the user's code.

Installed in every rank before ``fn`` runs, each through the library's own extension point,
and only when (and if) the library is imported:

* **tqdm** (``tqdm``, ``tqdm.auto``, ``tqdm.notebook``, so the HF Trainer's and Lightning's
  bars too): on rank 0 a bar becomes a panel bar (count, rate, ETA; nested when nested)
  instead of text; on other ranks it is silent unless ``output="all"``.
* **Hugging Face**, **Lightning** and **Accelerate**: their own extension points give the
  panel what they log (``trainers.py``); the collective timeout each asks for is enforced
  (``timeouts.py``).

A library that is absent costs nothing: the hooks wait for an import that never comes. An
integration that fails warns once and leaves the library as it was.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import io
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from nbddp.errors import NbddpWarning
from nbddp.worker import live
from nbddp.worker.context import rank
from nbddp.worker.debugging import debugger
from nbddp.worker.libraries import catalyst_engines, launchers, timeouts, trainers
from nbddp.worker.output import rich

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


def set_output(output: str) -> str:
    """Whose output the bars of the call that starts show; returns the one it replaced."""
    global _output
    previous, _output = _output, output
    return previous


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
        "transformers.trainer": trainers.patch_transformers,
        "lightning.pytorch.trainer.trainer": trainers.patch_lightning,
        "pytorch_lightning.trainer.trainer": trainers.patch_lightning,
        "accelerate.accelerator": trainers.patch_accelerate,
        "accelerate.data_loader": trainers.patch_accelerate_loaders,
        "accelerate.state": timeouts.patch_accelerate_state,  # their collective timeouts
        **dict.fromkeys(timeouts.LIGHTNING_DISTRIBUTED, timeouts.patch_lightning_distributed),
        "torch.distributed.launcher.api": launchers.guard_elastic,
        "IPython.core.display_functions": rich.install(),  # display() into the cell
        "catalyst.runners.runner": catalyst_engines.patch,
        **debugger.install(),  # breakpoint(), pdb.set_trace(), input(): the input box
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
