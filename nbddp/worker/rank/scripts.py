"""A script as it is, on a rank: what ``python train.py ARGS`` (or ``python -m pkg.train ARGS``)
would run under ``torchrun``, run by a launched rank as its function.

:class:`ScriptMain` is the launch's ``fn`` (``nbddp.run_script``, ``%ddp_run``): it travels by
reference to this module, carrying the script's bytes as the kernel read them at the call (every
rank runs the same code; a failing line is shown as it was then), its arguments and the kernel's
working directory. On the rank it runs the code in a fresh ``__main__`` module, as the
interpreter runs a script: ``__name__ == "__main__"``, ``__file__``, ``sys.argv = [script,
*args]``, the script's directory first on ``sys.path`` (the working directory for ``-m``), the
modules beside it imported anew (``script_modules.py``), the root logger as a new interpreter
has it (no handler, WARNING), and the kernel's working directory. The process group and the
torchrun environment are the launch's, so the script's own ``init_process_group`` is answered
from nbddp's group (``world.py``).

How it ends, as Python ends: returning, or ``sys.exit(0)``/``sys.exit()``, is exit code 0;
``sys.exit(n)`` is ``n``; ``sys.exit("message")`` prints the message to stderr and is 1; an
uncaught exception is 1. A non-zero code reaches the kernel with the rank's error
(``report.py``), as ``WorkerError.exitcode``.

A launched rank is the script's process: what the script left in ``sys`` stays for its exit
work (its threads, its ``atexit`` handlers). A session's rank takes ``__main__``, ``sys.argv``,
``sys.path`` and its root logger back after each run, for the next task.

Non-goals: running anything in the kernel (a script expects a process of its own); the
script's own launcher code (``mp.spawn``, ``torchrun`` inside it: ``launchers.py`` refuses
those as for any rank).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import linecache
import logging
import os
import runpy
import sys
import tokenize
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nbddp.worker.rank import report, script_modules


@dataclass(frozen=True)
class ScriptMain:
    """One script run on a rank: a file (``path``, ``source``) or a module (``module``)."""

    argv0: str  # sys.argv[0]: the script as the user named it (a module's file, once found)
    args: tuple[str, ...]  # sys.argv[1:]
    cwd: str  # the kernel's working directory at the call
    path: str = ""  # the file's absolute path ("" for a module)
    source: bytes = b""  # the file, as the kernel read it at the call
    module: str = ""  # ``python -m``'s module name ("" for a file)
    session: bool = False  # on a session's rank: the process outlives the script

    def __call__(self) -> int:
        return run(self)

    def __repr__(self) -> str:  # the run's name: the panel, runs(), a checkpoint directory
        return f"-m {self.module}" if self.module else os.path.basename(self.path)


def run(script: ScriptMain) -> int:
    """Run ``script`` as ``__main__``; 0 when it ended well (else its exception propagates,
    its exit code noted for the report)."""
    if os.path.isdir(script.cwd):  # a cluster node may lack it: the node's own then
        os.chdir(script.cwd)
    first = os.path.dirname(os.path.realpath(script.path)) if script.path else os.getcwd()
    with _as_main(script, first) as main:
        if not script.session:  # the process is the script's until it exits
            script_modules.forget_at_exit(first)
        before = set(sys.modules)
        try:
            code = _code(script, main)
            exec(code, main.__dict__)
        except SystemExit as exc:
            status = exit_status(exc.code)
            if status == 0:
                return 0
            report.note_exit(exc, status)
            raise
        except BaseException as exc:
            report.note_exit(exc, 1)
            raise
        finally:
            script_modules.remember_imports(before)
    return 0


def exit_status(code: Any) -> int:
    """The status a process ends with for ``sys.exit(code)``, as Python's own exit: None is 0,
    an int is itself (the low 8 bits, as the OS keeps them), anything else is printed to
    stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr, flush=True)
    return 1


@contextlib.contextmanager
def _as_main(script: ScriptMain, first: str) -> Iterator[types.ModuleType]:
    """A fresh ``__main__``, ``sys.argv``, ``sys.path[0]`` and root logger for the run; a
    session's rank gets its own back afterwards (its next tasks log as the notebook does)."""
    root = logging.getLogger()
    saved = (sys.modules.get("__main__"), sys.argv, list(sys.path), root.handlers[:], root.level)
    script_modules.forget_for(first)
    sys.path.insert(0, first)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = [script.argv0, *script.args]
    _fresh_logging()
    try:
        yield main
    finally:
        if script.session:
            old_main, sys.argv, sys.path[:], root.handlers[:], level = saved
            root.setLevel(level)
            if old_main is not None:
                sys.modules["__main__"] = old_main


def _code(script: ScriptMain, main: types.ModuleType) -> types.CodeType:
    """The code to run, and ``__main__``'s attributes as the interpreter sets them."""
    if script.module:  # as ``python -m``: its parent packages are imported first
        name, spec, code = runpy._get_module_details(script.module)  # type: ignore[attr-defined]
        main.__dict__.update(
            __file__=spec.origin,
            __cached__=spec.cached,
            __loader__=spec.loader,
            __package__=spec.parent,
            __spec__=spec,
        )
        sys.argv[0] = spec.origin or name
        return code  # type: ignore[no-any-return]
    main.__dict__.update(
        __file__=script.path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script.path),
        __package__=None,
        __spec__=None,
    )
    _remember_lines(script.path, script.source)
    return compile(script.source, script.path, "exec", dont_inherit=True)


def _remember_lines(path: str, source: bytes) -> None:
    """Tracebacks, pdb and the roll-call show the lines this run runs, even once the file is
    edited (an entry without a time is never checked against the file)."""
    try:
        encoding, _ = tokenize.detect_encoding(iter(source.splitlines(keepends=True)).__next__)
        text = source.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return
    linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)


def _fresh_logging() -> None:
    """The root logger as a new interpreter has it, so the script's ``basicConfig`` takes
    effect (a rank copies the notebook's configuration for a function: not a script's)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
