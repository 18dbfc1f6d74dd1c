"""What the pre-warmed helper imports ahead of the ranks, and the checks that keep its forks safe.

A fork launcher's ranks start with every module the notebook imported; a rank forked by the
helper starts with what the helper imported. So the helper imports, between launches:

* what every first training step imports lazily (:data:`FIRST_STEP`): measured in a fresh
  rank, a DDP or FSDP2 model's first ``optimizer.step()`` imports ``torch._dynamo`` and ~900
  modules with it (sympy, the optimizer's compiled paths: ~0.9 s on a quiet 2-core machine);
* the modules the notebook imported, sent by the kernel after each cell and at each launch
  (``local/mirror.py``), and those a launch's ranks imported (reported as they exit).

It stays a process that is safe to fork: after each import it checks that no thread was
started (a Python thread, or a native one: ``/proc/self/task``; an OpenBLAS pool loaded with a
library is allowed, as it stops itself at each fork, and so is NVML's, which a fork leaves
behind), that neither torch's CUDA nor the CUDA driver was started (loading the driver's library
starts nothing), and that no process was started; before each fork, the cheap part again. A
module that breaks one is reported (``Unsafe``): the helper forks no more, and the kernel starts
a fresh one without that module. Some packages are never imported (:data:`NEVER`);
``NBDDP_PRELOAD_EXCLUDE`` names more (comma-separated, a package or a module), and
``NBDDP_PRELOAD=0`` stops the mirroring.

Local modules (the user's own files, outside the interpreter's libraries) are watched: when one
of their files changed since the helper imported them, a rank drops every local module before
it runs, so it imports the edited code, and the helper imports them anew once its ranks ended.

Non-goal: running anything but imports; a module that reads the environment at import sees the
kernel's (as under a fork launcher), not a launch's ``env=``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import site
import sys
import sysconfig
import threading
import types
from collections.abc import Iterable

# Imported lazily by the first step of every DDP/FSDP training loop (optimizer.step() and
# DDP's constructor import torch._dynamo); the others are named for torch versions that split
# them off.
FIRST_STEP = (
    "torch._dynamo",
    "torch.optim",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.utils.data.distributed",
    "torch.utils.serialization",
)

# Never imported by the helper, whoever asks. The kernel's own machinery (a rank never uses it,
# and some of it patches the interpreter or starts threads: debugpy, zmq, tornado); nbddp (the
# helper holds the rank's side already, the kernel's side must never reach a rank); the test
# runner; and display libraries that read, at import, the environment nbddp sets for ranks
# (matplotlib's MPLBACKEND, plotly's PLOTLY_RENDERER): imported in the helper, they would draw
# for the kernel's backend.
NEVER = frozenset(
    {
        "IPython",
        "ipykernel",
        "ipywidgets",
        "ipython_genutils",
        "jupyter_client",
        "jupyter_core",
        "jupyter_server",
        "jupyterlab",
        "notebook",
        "nbclient",
        "nbformat",
        "comm",
        "traitlets",
        "zmq",
        "tornado",
        "debugpy",
        "_pydevd_bundle",
        "_pydev_bundle",
        "pydevd",
        "prompt_toolkit",
        "jedi",
        "parso",
        "matplotlib_inline",
        "nest_asyncio",
        "pexpect",
        "ptyprocess",
        "stack_data",
        "executing",
        "asttokens",
        "pure_eval",
        "pickleshare",
        "nbddp",
        "pytest",
        "_pytest",
        "pluggy",
        "matplotlib",
        "mpl_toolkits",
        "plotly",
        "__main__",
        "__mp_main__",
    }
)
NEVER_PREFIXES = ("ipy", "jupyter", "_pydev", "pydev", "google.colab")  # kernels' families too
EXCLUDE_VARIABLE = "NBDDP_PRELOAD_EXCLUDE"
MIRROR_VARIABLE = "NBDDP_PRELOAD"


def mirroring() -> bool:
    return os.environ.get(MIRROR_VARIABLE, "1") != "0"


def user_excluded() -> set[str]:
    return {n.strip() for n in os.environ.get(EXCLUDE_VARIABLE, "").split(",") if n.strip()}


def excluded(name: str, extra: Iterable[str] = ()) -> bool:
    """``name`` is one of the never-imported, or a module of one (``a.b`` excludes ``a.b.c``)."""
    top = name.partition(".")[0]
    if top in NEVER or name.startswith(NEVER_PREFIXES):
        return True
    return any(name == e or name.startswith(e + ".") for e in extra)


def importable(name: str, module: object) -> bool:
    """Can a fresh process import ``module`` by ``name``: a real module, found under that name
    (not an alias such as ``os.path``, nor one built in memory)."""
    spec = getattr(module, "__spec__", None)
    if not isinstance(module, types.ModuleType) or spec is None or spec.name != name:
        return False
    return spec.origin is not None or spec.submodule_search_locations is not None


def tasks() -> int:
    """This process's threads, native ones included."""
    return len(os.listdir("/proc/self/task"))


def mapped_libraries() -> set[str]:
    """The shared libraries this process has mapped."""
    with open("/proc/self/maps") as maps:
        return {line.rsplit(" ", 1)[-1].strip() for line in maps if ".so" in line}


def children() -> set[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return {int(pid) for pid in f.read().split()}
    except OSError:
        return set()


GPU_DEVICES = "/dev/nvidia"


def gpu_files(fd_dir: str = "/proc/self/fd") -> set[str]:
    """The GPU device files this process holds open (``/dev/nvidia*``). NVML opens them and
    starts a thread (``torch.cuda.device_count()`` and ``is_available()`` ask it), which leaves a
    fork able to use CUDA; the CUDA driver's start opens them too, which does not
    (:func:`driver_started` tells the two apart; measured on an H200: ``benchmarks/RESULTS.md``,
    #44)."""
    opened = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                target = os.readlink(os.path.join(fd_dir, fd))
                if target.startswith(GPU_DEVICES):
                    opened.add(target)
    return opened


def driver_started(libraries: Iterable[str]) -> bool:
    """Whether this process started the CUDA driver (``cuInit``), asked of the ``libcuda`` it has
    mapped by a call that needs the driver started and starts nothing: ``cuDeviceGetCount``
    answers CUDA_ERROR_NOT_INITIALIZED (3) before ``cuInit``. False without a ``libcuda``."""
    path = next((p for p in libraries if "/libcuda.so" in p), None)
    if path is None:
        return False
    try:
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)  # the mapped one: never a fresh load
        count = ctypes.c_int()
        return bool(driver.cuDeviceGetCount(ctypes.byref(count)) != _NOT_INITIALIZED)
    except (OSError, AttributeError):
        return False


_NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED


class Safety:
    """What a fork needs: no thread but the main one beyond what torch's own libraries keep (an
    OpenBLAS pool, which stops itself at each fork), no CUDA, no process started by an import."""

    def __init__(self) -> None:
        self.tasks = tasks()
        self.libraries = mapped_libraries()
        self.gpu_files = gpu_files()

    def broken(self, before: set[int] | None = None) -> str | None:
        """Why forking now would be unsafe, or None. ``before``: the helper's children before
        an import (then the slower checks run too: a process, the CUDA driver, new libraries)."""
        if threading.active_count() > 1:
            names = ", ".join(
                t.name for t in threading.enumerate() if t is not threading.main_thread()
            )
            return f"it started a thread ({names})"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "it initialised CUDA"
        now = tasks()
        if before is None:
            if now > self.tasks:
                return "a native thread was started"
            self.tasks = now  # fewer: a pool stopped at the last fork (OpenBLAS does)
            return None
        if children() - before:
            return "it started a process"
        libraries = mapped_libraries()
        if driver_started(libraries):  # libcuda merely loaded is harmless: torch 2.11 loads it
            return (
                "it started the CUDA driver (cuInit): a CUDA call at import, such as "
                "torch.cuda.init() or cupy's; a process forked after that cannot use CUDA"
            )
        added, self.libraries = libraries - self.libraries, libraries
        if now > self.tasks and not any("openblas" in path for path in added):
            opened = gpu_files() - self.gpu_files
            if not opened:
                return "it started a native thread"
            # NVML's (torch.cuda.device_count() or is_available() at import, which opened the
            # GPU): its thread is not copied into a fork, and ranks forked after it reach their
            # GPU (measured on an H200, #44)
            self.gpu_files |= opened
        self.tasks = now  # a BLAS pool or NVML it loaded: stopped or left behind at each fork
        return None


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return tuple(os.path.realpath(r) + os.sep for r in roots)


class Preloader:
    """The helper's imports: the names asked for, in order, each imported once, and the local
    modules they brought in, watched for edits."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.asked: dict[str, None] = {}  # every name asked for, in order (re-queued on edits)
        self.failed: set[str] = set()
        self.exclude: set[str] = user_excluded()
        self.local: dict[str, tuple[str, int, int]] = {}  # name -> file, mtime_ns, size
        self._roots = _library_roots()

    def ask(self, names: Iterable[str], exclude: Iterable[str] = ()) -> None:
        self.exclude.update(exclude)
        for name in names:
            if name not in self.asked and not excluded(name, self.exclude):
                self.asked[name] = None
                self.pending.append(name)

    def adopt_paths(self, paths: Iterable[str]) -> None:
        """The notebook's import path, as a rank adopts it (``worker/rank/job.py``)."""
        for entry in reversed(list(paths)):
            if entry not in sys.path:
                sys.path.insert(1, entry)

    def next_import(self) -> str | None:
        """The next name that needs an import (skipping those already in), or None."""
        while self.pending:
            name = self.pending[0]
            if name in sys.modules or name in self.failed or excluded(name, self.exclude):
                self.pending.pop(0)
                continue
            return name
        return None

    def load(self, name: str) -> None:
        """Import ``name`` (the one :meth:`next_import` gave); a module that fails is skipped."""
        self.pending.remove(name)
        before = set(sys.modules)
        try:
            importlib.import_module(name)
        except BaseException:  # ImportError, or anything its import raised (even SystemExit)
            self.failed.add(name)
        for new in set(sys.modules) - before:
            self._watch(new)

    def _watch(self, name: str) -> None:
        path = getattr(sys.modules.get(name), "__file__", None)
        if not path or name.partition(".")[0] == "nbddp":
            return
        real = os.path.realpath(path)
        if real.startswith(self._roots):
            return
        try:
            stat = os.stat(real)
        except OSError:
            return
        self.local[name] = (real, stat.st_mtime_ns, stat.st_size)

    def edited(self) -> bool:
        """Whether a local module's file changed since the helper imported it."""
        for path, mtime, size in self.local.values():
            try:
                stat = os.stat(path)
            except OSError:
                return True
            if (stat.st_mtime_ns, stat.st_size) != (mtime, size):
                return True
        return False

    def forget_local(self) -> list[str]:
        """Drop every local module from this process (after an edit), and ask for the names
        that brought them in again; the names dropped."""
        dropped = drop(self.local)
        self.local.clear()
        self.pending.extend(n for n in self.asked if n in dropped)
        return dropped


def drop(names: Iterable[str]) -> list[str]:
    """Forget modules, so the next import reads their files anew."""
    dropped = [name for name in names if sys.modules.pop(name, None) is not None]
    for name in dropped:  # ``import pkg.mod`` binds ``mod`` on its package, which may stay
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and isinstance(
            getattr(sys.modules[parent], child, None), types.ModuleType
        ):
            delattr(sys.modules[parent], child)
    return dropped


def new_modules(known: frozenset[str]) -> list[str]:
    """What this process imported beyond ``known`` and a fresh process could import by name."""
    return [
        name
        for name, module in list(sys.modules.items())
        if name not in known and not excluded(name) and importable(name, module)
    ]
