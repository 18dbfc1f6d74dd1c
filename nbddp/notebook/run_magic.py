"""``%ddp_run``: a script as it is, on every rank, from a line of the notebook, as
``torchrun --nproc-per-node N script.py ARGS`` would run it from a terminal.

    %ddp_run -n 2 --device cpu train.py --epochs 3 --lr 0.1
    %ddp_run -n 2 -m pkg.train --epochs 3

The options before the script are nbddp's (``%%ddp``'s, and ``--env NAME=VALUE``); everything
after the script (or ``-m MODULE``) is the script's own ``sys.argv[1:]``. The line is split as
a shell splits one (quotes group, ``{expr}`` and ``$name`` are the notebook's values, as in any
line magic). ``--session`` runs it on the ranks of ``%ddp_session start``.

Non-goal: the run itself (``nbddp/scripts.py``, ``sessions/scripting.py``).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from nbddp.errors import NbddpError
from nbddp.notebook.cell_errors import CellSyntaxError, interrupted
from nbddp.plan import (
    BACKENDS,
    DEVICE_OPTIONS,
    DISPLAYS,
    OUTPUTS,
    STALL_AFTER,
    STALL_HELP,
)
from nbddp.planning import seconds_or_none
from nbddp.recovery import KEEP, STOP_GRACE
from nbddp.scripts import run_script


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a UsageError in the cell, not SystemExit
        raise UsageError(f"%ddp_run: {message}.\n{self.format_usage()}")


def parser() -> argparse.ArgumentParser:
    """``%ddp_run``'s options: ``%%ddp``'s, ``--env``, ``-m``; then the script and its own."""
    p = _Parser(prog="%ddp_run", add_help=False)
    add = p.add_argument
    add(
        "-n",
        "--num-workers",
        type=int,
        default=None,
        help="ranks to run (default: one per visible GPU; 1 without, in a process of its own)",
    )
    add("--device", choices=DEVICE_OPTIONS, default="auto", help="where the ranks train")
    add("--backend", choices=BACKENDS, default=None, help="default: nccl on cuda, gloo on cpu")
    add("--timeout", type=float, default=None, help="seconds for the whole run")
    add("--stall-after", type=seconds_or_none, default=STALL_AFTER, help=STALL_HELP)
    add("--display", choices=DISPLAYS, default="auto", help="the live view")
    add("--output", choices=OUTPUTS, default="rank0", help="whose prints reach the notebook")
    add(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the ranks (repeat it for more)",
    )
    add(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="where nbddp.checkpoint saves "
        "(default: one named after the script under ./nbddp-checkpoints/)",
    )
    add("--keep", type=int, default=KEEP, help="complete checkpoints kept")
    add(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank after a failure, up to N times (the script runs again)",
    )
    add("--stop-grace", type=float, default=STOP_GRACE, help="seconds a graceful stop may take")
    add("--debug", action="store_true", help="post-mortem pdb at the frame that raised")
    add("--session", action="store_true", help="run on the ranks of %%ddp_session start")
    add("--cluster", default=None, metavar="ray|ray://HOST:PORT|slurm", help="a cluster")
    add("--nodes", type=int, default=None, help="cluster nodes (default: every alive one)")
    add("--workers-per-node", type=int, default=None, help="ranks per node")
    add("--detach", action="store_true", help="run it outside this kernel; prints its id")
    add("-m", "--module", action="store_true", help="SCRIPT is a module, run as python -m does")
    add("script", help="the script's path (with -m: a module's name)")
    add("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


@magics_class
class RunMagics(Magics):
    @line_magic
    def ddp_run(self, line: str) -> Any:
        """Run a script as it is on every rank, as torchrun runs it: %ddp_run [OPTIONS]
        script.py [ARGS...], or %ddp_run [OPTIONS] -m package.module [ARGS...].

        Each rank runs the script as __main__ with sys.argv = [script, *ARGS], the torchrun
        environment and this notebook's working directory; the script's own
        init_process_group, argparse and sys.exit() work as under torchrun. The live view,
        Stop, pdb and the roll-call are a launch's. A rank that fails, or exits with a
        non-zero code, raises WorkerError here.
        """
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        try:
            return self._run(line)
        except NbddpError as exc:  # the rank's traceback names the script's lines
            exc._local_frames = False
            raise
        except KeyboardInterrupt as interrupt:
            raise interrupted(interrupt) from None

    def _run(self, line: str) -> Any:
        __tracebackhide__ = True
        try:
            argv = shlex.split(line)
        except ValueError as exc:  # an unclosed quote
            raise UsageError(f"%ddp_run: {exc} in {line!r}") from None
        args = parser().parse_args(argv)
        env = _environment(args.env)
        try:
            if args.session:
                return self._in_session(args, env)
            run = run_script(
                args.script,
                args.args,
                module=args.module,
                num_workers="auto" if args.num_workers is None else args.num_workers,
                device=args.device,
                backend=args.backend,
                timeout=args.timeout,
                display=args.display,
                output=args.output,
                env=env,
                stall_after=args.stall_after,
                debug=args.debug,
                cluster=args.cluster,
                nodes="auto" if args.nodes is None else args.nodes,
                workers_per_node="auto" if args.workers_per_node is None else args.workers_per_node,
                checkpoint_dir=args.checkpoint_dir,
                keep=args.keep,
                max_restarts=args.max_restarts,
                stop_grace=args.stop_grace,
                detach=args.detach,
            )
        except ValueError as exc:
            raise UsageError(f"%ddp_run: {exc}") from None
        except SyntaxError as exc:  # the script's line and caret, as IPython shows a cell's
            raise CellSyntaxError(exc) from None
        if args.detach:
            print(
                f"Detached run {run.id}: it goes on if this kernel stops. %ddp_attach {run.id} "
                f"(or nbddp.attach({run.id!r})) follows it."
            )
        return None  # 0: every rank exited with code 0 (a failure raised)

    def _in_session(self, args: Any, env: dict[str, str] | None) -> None:
        __tracebackhide__ = True
        from nbddp.sessions.session import current

        launch_only = {
            "-n": args.num_workers is not None,
            "--device": args.device != "auto",
            "--backend": args.backend is not None,
            "--cluster": args.cluster is not None,
            "--nodes": args.nodes is not None,
            "--workers-per-node": args.workers_per_node is not None,
            "--env": env is not None,
            "--checkpoint-dir": args.checkpoint_dir is not None,
            "--keep": args.keep != KEEP,
            "--max-restarts": args.max_restarts != 0,
            "--detach": args.detach,
        }
        given = [flag for flag, there in launch_only.items() if there]
        if given:
            raise UsageError(
                f"%ddp_run --session runs on the session's ranks as they are, so "
                f"{', '.join(given)} cannot apply (where and how ranks start belongs to "
                "%ddp_session start; restarts, checkpoints and --detach to a launch): drop "
                f"{'it' if len(given) == 1 else 'them'}, or drop --session."
            )
        session = current()
        if session is None:
            raise UsageError(
                "%ddp_run --session: no session is running. Start one first: "
                "%ddp_session start -n 2 (or run the script without --session)."
            )
        session.run_script(
            args.script,
            args.args,
            module=args.module,
            timeout=args.timeout,
            display=args.display,
            output=args.output,
            stall_after=args.stall_after,
            debug=args.debug,
            stop_grace=args.stop_grace,
        )


def _environment(pairs: list[str]) -> dict[str, str] | None:
    """``--env NAME=VALUE ...`` as ``env=``; None when none was given."""
    env = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise UsageError(f"%ddp_run: --env {pair!r} must be NAME=VALUE (e.g. --env SEED=1).")
        env[name] = value
    return env or None


def load(ipython: Any) -> None:
    ipython.register_magics(RunMagics)


def unload(ipython: Any) -> None:
    ipython.magics_manager.magics["line"].pop("ddp_run", None)


RunMagics.ddp_run.__doc__ = (RunMagics.ddp_run.__doc__ or "") + "\n" + parser().format_help()
