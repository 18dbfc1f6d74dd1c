"""``nbddp.run_script``: a script as it is (a repository's ``train.py`` that ``torchrun`` runs,
or a module that ``python -m`` runs), run from a cell on every rank, with everything a launch
has: the live view, Stop, pdb, the roll-call, ``max_restarts``, detached runs, Ray and Slurm.

A script run is a launch whose function is the script (``worker/scripts.ScriptMain``): the
options are ``notebook_launch``'s, the ranks the same warm ones, and each rank runs the script
as ``__main__`` with ``sys.argv = [script, *args]``. What this module adds is what must be
settled here, before anything starts: the script is read (a missing file, an unknown module, a
``SyntaxError`` are refused here, and every rank then runs the bytes read at the call), the
arguments are strings, the options do not contradict each other. The ranks are processes even
with one worker: a script expects a process of its own (its ``sys.argv``, its module state, its
``atexit`` handlers, its ``sys.exit()``), never the kernel.

Non-goals: anything of the script's own command line beyond its arguments (``torchrun``'s
options are the launch's: ``num_workers=``, ``max_restarts=``...); running it in the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

from nbddp import interrupts
from nbddp.launch import launch_plan, notebook_launch
from nbddp.planning import make_plan
from nbddp.recovery import default_checkpoint_dir
from nbddp.worker.rank.scripts import ScriptMain

# notebook_launch's options that mean nothing for a script, and why
_NOT_FOR_SCRIPTS = {
    "return_all": "a script's ranks return no value: run_script returns 0 once every rank "
    "exited with code 0, and a rank that fails raises WorkerError (its exit code in .exitcode)",
    "kwargs": "a script takes its arguments as strings, in args= (sys.argv[1:])",
}


def run_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    module: bool = False,
    **launch_options: Any,
) -> Any:
    """Run a script as it is on every rank, as ``torchrun --nproc-per-node N script ARGS``.

    Each rank runs ``script`` as ``__main__`` in a process of its own (never in the kernel,
    even with one worker), with ``sys.argv = [script, *args]``, the torchrun environment
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), the kernel's working
    directory, and the script's directory first on ``sys.path``. The script's own
    ``init_process_group``, ``argparse``, ``if __name__ == "__main__":`` and ``sys.exit()``
    work as under torchrun. Every rank runs the script as it was read at this call; the
    modules beside it are imported as they are now (an edit since the last run is seen).

    Everything a launch has works: the live view (rank 0's output, tqdm, ``logging``,
    [nbddp.log][] and the trainers' metrics), Stop and interrupts (graceful for a script that
    checks [nbddp.stopping][] or runs a trainer nbddp knows; otherwise SIGTERM, then SIGKILL
    2 s later), ``breakpoint()`` and ``debug=True``, ``run.stacks()``, ``max_restarts`` (the
    whole world restarts and runs the script again), ``detach=True``, Ray and Slurm.

    Args:
        script: The script's path (relative to the kernel's working directory), or, with
            ``module=True``, a module's name as ``python -m`` takes it (``"pkg.train"``; a
            package runs its ``__main__``).
        args: The script's arguments, strings as on a command line (``shlex.split("--lr
            0.1")`` splits one).
        module: Run ``script`` as a module (``python -m``): the working directory is first on
            its ``sys.path``, its parent packages are imported first.
        **launch_options: [nbddp.notebook_launch][]'s options (``num_workers``, ``device``,
            ``env``, ``timeout``, ``display``, ``output``, ``block``, ``detach``,
            ``cluster``, ``max_restarts``, ``debug``...), with the same meaning; not
            ``return_all``. ``checkpoint_dir`` defaults to one named after the script.

    Returns:
        0 once every rank exited with code 0 (``sys.exit(0)`` included); the [nbddp.Run][]
            with ``block=False`` or ``detach=True`` (its ``result()`` is then 0).

    Raises:
        ValueError: A missing script or module, an argument that is not a string, an unknown
            or contradicting option (before any process starts).
        SyntaxError: The script does not compile (before any process starts).
        nbddp.WorkerError: A rank raised, or exited with a non-zero code: ``.rank``,
            ``.exitcode`` (the script's: ``sys.exit``'s, 1 for an uncaught exception) and the
            traceback in the script's own lines.
    """
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    interrupts.reached("planning")
    options = _launch_options(launch_options)
    main = script_main(script, args, module)
    if options.get("checkpoint_dir") is None:
        options["checkpoint_dir"] = default_checkpoint_dir(repr(main))
    plan = dataclasses.replace(make_plan(**options), processes=True)
    return launch_plan(main, (), {}, plan)


def script_main(script: Any, args: Any, module: Any = False, session: bool = False) -> ScriptMain:
    """What every rank runs, checked: the script read (or the module found) and its
    arguments. ``session``: for a session's ranks, which outlive the script."""
    if not isinstance(module, bool):
        raise ValueError(f"module={module!r} must be True (a module's name) or False (a file).")
    arguments = _arguments(args)
    cwd = os.getcwd()
    if module:
        name = _module_name(script)
        return ScriptMain(name, arguments, cwd, module=name, session=session)
    given, path, source = _read(script)
    return ScriptMain(given, arguments, cwd, path=path, source=source, session=session)


def _launch_options(options: dict[str, Any]) -> dict[str, Any]:
    """``notebook_launch``'s options as given, those that cannot go together refused."""
    allowed = [
        name
        for name, p in inspect.signature(notebook_launch).parameters.items()
        if p.kind is p.KEYWORD_ONLY and name not in _NOT_FOR_SCRIPTS
    ]
    for name in options:
        if name in _NOT_FOR_SCRIPTS:
            raise ValueError(f"run_script takes no {name}=: {_NOT_FOR_SCRIPTS[name]}.")
        if name not in allowed:
            raise ValueError(
                f"run_script got an unknown option {name}=. It takes script, args=, module= "
                f"and notebook_launch's options: {', '.join(allowed)}."
            )
    if options.get("detach") is True and options.get("block") is True:
        raise ValueError(
            "detach=True returns the Run at once (the run goes on without this kernel), and "
            "block=True waits for it: drop block=True (run.wait() waits for a detached run "
            "too), or drop detach=True."
        )
    return dict(options)


def _arguments(args: Any) -> tuple[str, ...]:
    if isinstance(args, (str, bytes)):
        raise ValueError(
            f"args={args!r} must be a list of strings, one per argument as sys.argv holds "
            f"them: shlex.split({args!r}) splits a command line into one."
        )
    if not isinstance(args, Sequence):
        raise ValueError(f"args={args!r} must be a list of strings (the script's sys.argv[1:]).")
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            raise ValueError(
                f"args[{i}]={arg!r} is not a string ({type(arg).__name__}): a script's "
                f"arguments are strings, as on a command line. Pass {str(arg)!r}."
            )
    return tuple(args)


def _read(script: Any) -> tuple[str, str, bytes]:
    """The script as given, its absolute path and its bytes; it compiles."""
    if not isinstance(script, (str, os.PathLike)) or isinstance(os.fspath(script), bytes):
        raise ValueError(
            f"script={script!r} must be the path of a Python file (or, with module=True, a "
            "module's name)."
        )
    given = str(os.fspath(script))
    path = os.path.abspath(given)
    if os.path.isdir(path):
        raise ValueError(
            f"{given} is a directory: name the script in it, or run a package that has a "
            "__main__.py with module=True."
        )
    try:
        with open(path, "rb") as f:
            source = f.read()
    except FileNotFoundError:
        raise ValueError(
            f"no script {given} (looked for {path}).{_maybe_a_module(given)}"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read the script {path}: {exc.strerror or exc}.") from None
    compile(source, path, "exec", dont_inherit=True)  # a SyntaxError here, not on every rank
    return given, path, source


def _maybe_a_module(given: str) -> str:
    if not _is_module_name(given) or given.endswith(".py"):
        return ""
    with contextlib.suppress(ValueError):
        if find_module(given) is not None:
            return (
                f" {given} is a module: pass module=True (%ddp_run -m {given}) to run it as "
                "python -m does."
            )
    return ""


def _is_module_name(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _module_name(script: Any) -> str:
    text = os.fspath(script) if isinstance(script, (str, os.PathLike)) else None
    if isinstance(text, str) and (text.endswith(".py") or os.sep in text):
        raise ValueError(
            f"module=True runs a module by its name, as python -m does, and {text!r} is a "
            "file's path: drop module=True to run the file, or name the module "
            "('pkg.train' for pkg/train.py)."
        )
    if not isinstance(text, str) or not _is_module_name(text):
        raise ValueError(f"{script!r} is no module name (dotted names, as python -m takes).")
    if find_module(text) is None:
        raise ValueError(
            f"no module named {text!r} on the ranks' import path (the kernel's sys.path, its "
            "working directory first): check the name, or install its package."
        )
    return text


def find_module(name: str) -> str | None:
    """The file ``python -m name`` would run, looked up as the ranks will (the working
    directory first) without importing anything here; None when there is none. A package
    without a ``__main__`` is refused (``python -m`` cannot run it either)."""
    parts = name.split(".")
    search = [os.getcwd(), *(os.path.abspath(p) if p else os.getcwd() for p in sys.path)]
    spec = importlib.machinery.PathFinder.find_spec(parts[0], search)
    if spec is None:  # a finder of sys.meta_path (an editable install's); imports nothing
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        parent = sys.modules.get(".".join(parts[:i]))
        where = getattr(parent, "__path__", None) or (spec and spec.submodule_search_locations)
        if not where:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(where))
    if spec is None:
        return None
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main = importlib.machinery.PathFinder.find_spec(
            f"{name}.__main__", list(spec.submodule_search_locations)
        )
        if main is None:
            raise ValueError(
                f"{name} is a package without a __main__.py, which python -m {name} could not "
                "run either: name the module of it to run."
            )
        spec = main
    return spec.origin
