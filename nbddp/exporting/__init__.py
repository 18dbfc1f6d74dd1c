"""``nbddp.export`` and ``%%ddp --export``: a launch written down as a torchrun script.

The script runs the same function (or cell) under ``torchrun --nproc-per-node N PATH`` with
the same result as ``notebook_launch``: what the notebook captured is pickled by value beside
it, and a Slurm batch file beside that runs it on several nodes. Every option is checked, and
anything that cannot be pickled is named, before any file is written.

What the script needs: torch, cloudpickle, and the modules the payload refers to by name (the
user's libraries, listed in the script and checked before it unpickles). A function or cell
that calls ``nbddp.rank()``, ``nbddp.prepare_model()``... needs nbddp importable where it
runs; only its rank side is imported there (no IPython, no widgets), and it answers from the
process group torchrun set up. ``nbddp.log`` and ``nbddp.progress`` do nothing there.

Non-goals: running the script (torchrun and Slurm do), packaging the user's own modules.
"""

from __future__ import annotations

import datetime
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbddp.exporting import pickling
from nbddp.exporting.script import Layout, cell_body, function_body, sbatch_text, script_text
from nbddp.recovery import exported_recovery

__all__ = ["export", "export_cell"]


def export(
    fn: Callable[..., Any],
    path: str | os.PathLike[str],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    num_workers: int | str = "auto",
    device: str = "auto",
    nodes: int = 1,
    sbatch: bool = True,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """Write ``fn(*args, **kwargs)`` as a script that torchrun runs with the same result as
    ``notebook_launch(fn, args, kwargs, num_workers=..., device=...)``; return the paths
    written: the script, its payload beside it, and with ``sbatch`` a Slurm batch file
    (``PATH`` with the suffix ``.sbatch``).

    ``torchrun --standalone --nproc-per-node N PATH`` runs it; rank 0's value is saved
    beside the script (``PATH`` with the suffix ``.result.pkl``). Everything is checked
    before any file is written.

    Args:
        fn: The function, as for [nbddp.notebook_launch][]: what it captures from the
            notebook is saved with it, by value.
        path: The script to write (``train.py``); its payload goes beside it.
        args: Positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        num_workers: The whole world, ``nodes`` x ranks per node; "auto": one rank per GPU
            of this machine on cuda, one per node on cpu.
        device: "auto", "cuda" or "cpu". ``device="cuda"`` may be asked for where no GPU is
            visible (a login node) when ``num_workers`` says how many ranks.
        nodes: How many nodes the Slurm batch file asks for.
        sbatch: Also write the Slurm batch file (``srun torchrun``, one per node), with
            the signal before the time limit and a requeue that resumes.
        checkpoint_dir: Where ``nbddp.checkpoint`` saves in the script (default: the
            directory ``notebook_launch(fn)`` uses, so a run there resumes the notebook's).
        max_restarts: torchrun's ``--max-restarts``: a failing rank restarts the world, and
            ``nbddp.restore`` resumes it.

    Returns:
        The paths written, script first.

    Raises:
        ValueError: An option is invalid.
        nbddp.SerializationError: Something ``fn`` needs cannot be pickled (the path to it
            is named).
    """
    if not callable(fn):
        raise ValueError(f"export: fn={fn!r} is not callable; pass the function to run.")
    if not isinstance(args, tuple):
        raise ValueError(f"export: args={args!r} must be a tuple, e.g. args=(data,).")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"export: kwargs={kwargs!r} must be a dict or None.")
    script = script_path(path)
    layout = resolve_layout(num_workers, device, nodes)
    if not isinstance(sbatch, bool):
        raise ValueError(f"export: sbatch={sbatch!r} must be True or False.")
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    recovery = exported_recovery(checkpoint_dir, max_restarts, name)
    call = (fn, args, dict(kwargs or {}))
    stream = pickling.dumps_checked(
        {"call": call, "sources": _notebook_sources()},
        what=f"{name} to {script.name}",
        pieces=pickling.call_pieces(fn, args, dict(kwargs or {})),
    )
    try:
        source: str | None = inspect.getsource(fn)
    except (OSError, TypeError):
        source = None
    written, _ = _write(
        script,
        stream,
        layout,
        export={"kind": "function", "what": f"{name}(*args, **kwargs)", **recovery},
        origin=_origin_of(fn),
        body=function_body(),
        shown_source=source,
        sbatch=sbatch,
    )
    return written


def export_cell(
    path: str,
    *,
    source: str,
    label: str,
    inputs: Mapping[str, Any],
    out_names: tuple[str, ...],
    shows_last: bool,
    num_workers: int | str = "auto",
    device: str = "auto",
    nodes: int = 1,
    checkpoint_dir: str | None = None,
    max_restarts: int = 0,
    name: str = "cell",
) -> tuple[list[str], str]:
    """``%%ddp --export PATH``: the cell's own lines in the script, the notebook names it
    reads in the payload; rank 0 saves the names it assigns (what ``%%ddp`` brings back).
    Returns the paths written and the command that runs the script here. ``name``: the
    cell's, for its default checkpoint directory."""
    script = script_path(path)
    layout = resolve_layout(num_workers, device, nodes)
    recovery = exported_recovery(checkpoint_dir, max_restarts, name)
    stream = pickling.dumps_checked(
        {"inputs": dict(inputs), "sources": _notebook_sources()},
        what=f"the cell to {script.name}",
        pieces=[(repr(n), value) for n, value in inputs.items()],
    )
    return _write(
        script,
        stream,
        layout,
        export={
            "kind": "cell",
            "what": f"the %%ddp cell {label}",
            "out_names": out_names,
            **recovery,
        },
        origin=f"{_notebook()}, {label}",
        body=cell_body(source, label, shows_last),
        shown_source=None,
        sbatch=True,
    )


def script_path(path: Any) -> Path:
    """``PATH``: a ``.py`` file in a directory that exists (it may be overwritten)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"export: path={path!r} must be a file name such as 'train.py'.")
    script = Path(path).expanduser().absolute()
    if script.suffix != ".py":
        raise ValueError(
            f"export: path={str(path)!r} is the script torchrun runs: give it the suffix .py "
            "(e.g. 'train.py'); its data and batch file are written beside it."
        )
    if not script.parent.is_dir():
        raise ValueError(
            f"export: the directory {str(script.parent)!r} does not exist; create it first."
        )
    return script


def resolve_layout(num_workers: Any, device: Any, nodes: Any) -> Layout:
    """Device, backend, nodes and ranks per node, as ``notebook_launch`` would resolve them
    on this machine; a GPU script may be written where no GPU is visible."""
    from nbddp.plan import DEVICE_OPTIONS
    from nbddp.planning import visible_gpu_count

    if device not in DEVICE_OPTIONS:
        raise ValueError(f"export: device={device!r} is not one of 'auto', 'cuda', 'cpu'.")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"export: nodes={nodes!r} must be an int >= 1.")
    gpus = visible_gpu_count()
    resolved = "cuda" if device == "cuda" or (device == "auto" and gpus > 0) else "cpu"
    if num_workers == "auto":
        if resolved == "cuda" and gpus == 0:
            raise ValueError(
                "export: device='cuda' but this machine has no GPU to count, so "
                "num_workers='auto' cannot say how many ranks: pass num_workers= (all ranks, "
                "nodes x GPUs per node)."
            )
        per_node = gpus if resolved == "cuda" else 1
        return Layout(resolved, _backend(resolved), nodes, per_node)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(
            f"export: num_workers={num_workers!r} must be an int >= 1 (all ranks) or 'auto'."
        )
    if num_workers % nodes:
        raise ValueError(
            f"export: num_workers={num_workers} ranks do not split evenly over nodes={nodes}; "
            f"use a multiple of {nodes}."
        )
    return Layout(resolved, _backend(resolved), nodes, num_workers // nodes)


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _write(
    script: Path,
    stream: bytes,
    layout: Layout,
    *,
    export: dict[str, Any],
    origin: str,
    body: str,
    shown_source: str | None,
    sbatch: bool,
) -> tuple[list[str], str]:
    """Every file's text first, then the files, the script last (what runs the others).
    Returns the paths written and the command that runs the script on this machine."""
    payload = script.with_name(script.stem + ".pkl")
    batch = script.with_suffix(".sbatch") if sbatch else None
    needs = pickling.describe_needs(pickling.modules_needed(stream))
    literal = {
        **export,
        "payload": payload.name,
        "result": script.stem + ".result.pkl",
        "device": layout.device,
        "backend": layout.backend,
        "needs": needs,
        "paths": _own_paths(),
        "exported": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    text = script_text(
        script=script,
        export=literal,
        layout=layout,
        origin=origin,
        body=body,
        shown_source=shown_source,
        sbatch=batch,
    )
    compile(text, str(script), "exec")  # a cell that cannot stand alone fails here, not later
    written = [payload]
    _atomic_write(payload, stream)
    if batch is not None:
        job = "".join(c if c.isalnum() or c in "-_" else "_" for c in script.stem)
        text_of_batch = sbatch_text(
            script=script,
            layout=layout,
            origin=origin,
            job=job,
            checkpoint_dir=export["checkpoint_dir"],
            max_restarts=export["max_restarts"],
        )
        _atomic_write(batch, text_of_batch.encode())
        written.append(batch)
    _atomic_write(script, text.encode(), mode=0o700)  # runs as `python script.py` too
    restarts = f" --max-restarts {export['max_restarts']}" if export["max_restarts"] else ""
    command = f"torchrun --standalone{restarts} --nproc-per-node {layout.per_node} {script.name}"
    if layout.nodes > 1:
        command = f"sbatch {batch.name}" if batch is not None else command + " (on every node)"
    return [str(script), *map(str, written)], command


def _atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Owner-only, as a run's files are: the payload holds the notebook's data and code."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)  # a partial left by a killed export may have other bits
        f.write(data)
    os.replace(partial, path)


def _own_paths() -> list[str]:
    """The notebook's working directory and the module directories it added (site-packages
    and the standard library left out: the script's own Python has its own)."""
    import site
    import sysconfig

    skip = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    skip |= {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    own = [os.getcwd()]
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        if (
            os.path.isdir(real)
            and real not in skip
            and "site-packages" not in real
            and "dist-packages" not in real
            and not real.startswith(sys.base_prefix)
            and real not in own
        ):
            own.append(real)
    return own


def _notebook_sources() -> dict[str, tuple[Any, ...]]:
    from nbddp.wire.payload import notebook_sources

    return notebook_sources()


def _notebook() -> str:
    """The notebook's name as the kernel knows it (Jupyter and VS Code tell it), else the
    kernel's process."""
    shell = _shell()
    namespace = getattr(shell, "user_ns", {}) if shell is not None else {}
    for candidate in (
        namespace.get("__vsc_ipynb_file__"),
        namespace.get("__session__"),
        os.environ.get("JPY_SESSION_NAME"),
    ):
        if isinstance(candidate, str) and candidate:
            return f"the notebook {candidate}"
    if shell is not None:
        return "a notebook"
    return f"the Python program {sys.argv[0] or 'python'}"


def _origin_of(fn: Any) -> str:
    """The notebook and cell (``In[4]``) a function was defined in, when IPython knows."""
    notebook = _notebook()
    code = getattr(fn, "__code__", None)
    shell = _shell()
    if code is not None and shell is not None:
        compiler = getattr(shell, "compile", None)
        try:
            _, name = compiler.format_code_name(code.co_filename)  # type: ignore[union-attr]
            return f"{notebook}, {name}"
        except (AttributeError, TypeError):
            pass
    module = getattr(fn, "__module__", None)
    if module not in (None, "__main__"):
        return f"{notebook} (the function {module}.{fn.__qualname__})"
    return notebook


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None
