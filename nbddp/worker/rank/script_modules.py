"""The modules a script imports, as a fresh interpreter would find them: never one a previous
run or the pre-warmed helper imported before the file beside the script was edited.

A rank starts with what the helper imported (the notebook's modules, and what earlier launches'
ranks imported); a session's rank also with what its earlier tasks imported. Before a script
runs, :func:`forget_for` drops from ``sys.modules``:

* the user's own modules (outside the interpreter's libraries, not nbddp's) whose file changed
  after this process started, so the script imports the edited code (the helper also drops
  those it watches at the hand-off: ``worker/helper/preload.py``);
* the user's modules that an earlier script run of this process imported (a session's rank):
  a script's module state is fresh each time, as in a new interpreter;
* a user's module of the same name as a file or package beside the script (or, for ``-m``, in
  the working directory) that lives elsewhere: the script's directory comes first on its
  ``sys.path``, so ``import utils`` must find the ``utils.py`` beside it, not the notebook's.

A launched rank's script also leaves nothing of its own to the helper (:func:`forget_at_exit`):
what its ranks imported is reported to the helper for the next launch, and a script's
directory or modules there would shadow the notebook's own in later launches.

Python's own limits stay: a module edited within the same second as its ``__pycache__`` file
was written, without changing its size, is read from that file (as under ``torchrun``).

Non-goals: the interpreter's libraries (site-packages, the standard library) and extension
modules are never dropped: they cannot be imported twice safely, and a fresh ``torchrun``
would read the same files.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import site
import sys
import sysconfig
from collections.abc import Iterable

from nbddp.worker import PACKAGE_DIR
from nbddp.worker.helper.preload import _library_roots, drop

_SOURCES = (".py", ".pyc")
_MAINS = ("__main__", "__mp_main__")  # the rank's own launch script, never the user's module

_by_scripts: set[str] = set()  # the user's modules earlier script runs of this process imported


def local_file(module: object, roots: tuple[str, ...]) -> str | None:
    """The real path of ``module``'s source when it is one of the user's own modules (not a
    library's, not nbddp's, not an extension), else None. ``roots``: :func:`library_roots`."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not os.path.isabs(path) or not path.endswith(_SOURCES):
        return None  # no file, an extension, or a made-up name (torch.ops says "_ops.py")
    if path.startswith(roots):  # most modules: no system call (a rank holds thousands)
        return None
    real = os.path.realpath(path)
    return None if real.startswith(roots) else real


@functools.cache
def library_roots() -> tuple[str, ...]:
    """The interpreter's libraries and nbddp's own package, as named and as resolved."""
    roots = {*_library_roots(), PACKAGE_DIR, os.path.realpath(PACKAGE_DIR) + os.sep}
    paths = sysconfig.get_paths()
    named = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots.update(os.path.abspath(p) + os.sep for p in [*named, *site.getsitepackages()])
    return tuple(sorted(roots))


def forget_for(directory: str) -> list[str]:
    """Before a script whose ``sys.path[0]`` is ``directory`` runs: drop what it must import
    anew (see the module's docstring); the names dropped."""
    roots = library_roots()
    started = _started_at()
    beside = _names_in(directory)
    stale = set(_by_scripts)
    for name, module in list(sys.modules.items()):
        path = local_file(module, roots)
        if path is None or name in _MAINS:
            continue
        top = name.partition(".")[0]
        if top in beside and not path.startswith(os.path.realpath(directory) + os.sep):
            stale.add(name)  # shadowed by the file beside the script
            continue
        try:
            edited = os.stat(path).st_mtime > started
        except OSError:
            edited = True  # gone: a fresh import says so
        if edited:
            stale.add(name)
    _by_scripts.clear()
    importlib.invalidate_caches()  # a file added beside the script since the last look
    return drop(_with_submodules(stale))


def remember_imports(before: Iterable[str]) -> None:
    """After a script run: the user's modules it imported, dropped before the next run."""
    roots = library_roots()
    known = set(before)
    _by_scripts.update(
        name
        for name, module in list(sys.modules.items())
        if name not in known and name not in _MAINS and local_file(module, roots) is not None
    )


def forget_at_exit(directory: str) -> None:
    """A launched rank's script leaves the pre-warmed helper nothing of its own. As the rank
    exits (after the script's own exit handlers: they were registered later, and ``atexit``
    runs the last first), ``directory`` leaves ``sys.path`` and the user's modules the script
    imported leave ``sys.modules``; so the imports the rank reports to the helper
    (``worker/helper/forked.py``, the last handler of all) never have it import a script's module,
    nor find the notebook's modules in a script's directory."""
    atexit.register(_forget, directory)


def _forget(directory: str) -> None:
    with contextlib.suppress(ValueError):
        sys.path.remove(directory)
    drop(_with_submodules(set(_by_scripts)))
    _by_scripts.clear()


def _with_submodules(names: set[str]) -> set[str]:
    """``pkg`` dropped takes ``pkg.mod`` along: it would otherwise stay bound to the old one."""
    if not names:
        return names
    prefixes = tuple(f"{n}." for n in names)
    return names | {m for m in list(sys.modules) if m.startswith(prefixes)}


def _names_in(directory: str) -> set[str]:
    """The top-level modules ``directory`` holds (a file, or a package with its ``__init__``)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return set()
    names = {e[:-3] for e in entries if e.endswith(".py")}
    names |= {e for e in entries if os.path.isfile(os.path.join(directory, e, "__init__.py"))}
    return names - {"__main__", "nbddp"}


def _started_at() -> float:
    """When this process started (a fork's own start: a pre-warmed rank's fork, not the
    helper's), as ``time.time()``; 0 where ``/proc`` cannot say (then every user's module is
    taken as edited)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0
