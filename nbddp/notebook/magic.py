"""``%%ddp``: run a notebook cell on every rank, with the namespace going in and out.

    %load_ext nbddp
    %%ddp -n 2 --device cpu
    model = nbddp.prepare_model(Net())
    ...

The names the cell reads are shipped from the notebook (functions and classes by value,
modules by name); afterwards the names it assigned on rank 0 are put back (tensors on the
CPU, DDP unwrapped), and its last expression is shown like a normal cell's. With one worker
the cell runs in the kernel's own namespace, exactly like a normal cell.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbddp.errors import NbddpError, WorkerError
from nbddp.exporting import export_cell
from nbddp.launch import launch_plan
from nbddp.notebook import cell as cells
from nbddp.notebook import crossing
from nbddp.notebook.cell_errors import CellFailed, CellSyntaxError, interrupted
from nbddp.notebook.detached_magic import announce, check_detach, kept_cell
from nbddp.notebook.stopping_options import (
    checkpoint_name,
    refuse_launch_only,
    stopping_arguments,
    stopping_options,
)
from nbddp.plan import (
    BACKENDS,
    DEVICE_OPTIONS,
    DISPLAYS,
    OUTPUTS,
    STALL_AFTER,
    STALL_HELP,
    LaunchPlan,
)
from nbddp.planning import make_plan, seconds_or_none
from nbddp.worker.rank.cell import CellOutcome, run_cell

_counter = itertools.count(1)


@magics_class
class DDPMagics(Magics):
    @magic_arguments()
    @argument(
        "-n",
        "--num-workers",
        type=int,
        default=None,
        help="ranks to run (default: one per visible GPU; 1 without GPU = in the kernel)",
    )
    @argument("--device", choices=DEVICE_OPTIONS, default="auto")
    @argument(
        "--backend", choices=BACKENDS, default=None, help="default: nccl on cuda, gloo on cpu"
    )
    @argument("--timeout", type=float, default=None, help="seconds for the whole run")
    @argument("--stall-after", type=seconds_or_none, default=STALL_AFTER, help=STALL_HELP)
    @argument("--display", choices=DISPLAYS, default="auto")
    @argument("--output", choices=OUTPUTS, default="rank0", help="whose prints reach the notebook")
    @stopping_arguments
    @argument(
        "--out",
        type=str,
        default=None,
        metavar="NAME,NAME",
        help="bring back only these names (default: every name the cell assigns)",
    )
    @argument("--no-out", action="store_true", help="bring nothing back into the notebook")
    @argument(
        "--debug",
        action="store_true",
        help="an uncaught exception on a rank opens post-mortem pdb at the frame that raised "
        "(the other ranks held), in this cell's input box, before the cell fails",
    )
    @argument(
        "--session",
        action="store_true",
        help="run on the ranks of %%ddp_session start, in the namespace they keep; only "
        "--out names come back",
    )
    @argument(
        "--cluster",
        type=str,
        default=None,
        metavar="ray|ray://HOST:PORT|slurm",
        help="run on a Ray cluster or the Slurm allocation this kernel runs in (default: "
        "nbddp.set_cluster's, else this machine)",
    )
    @argument("--nodes", type=int, default=None, help="cluster nodes (default: every alive one)")
    @argument(
        "--workers-per-node",
        type=int,
        default=None,
        help="ranks per node (default: its GPUs on cuda, 1 on cpu)",
    )
    @argument(
        "--detach",
        action="store_true",
        help="run it outside this kernel: it outlives a restart; prints its id; "
        "%%ddp_attach ID shows it and brings its names back",
    )
    @argument(
        "--export",
        type=str,
        default=None,
        metavar="PATH",
        help="write the cell as a torchrun script (PATH.py, its data beside it, a Slurm "
        "batch file) instead of running it",
    )
    @cell_magic
    def ddp(self, line: str, cell: str) -> Any:
        """Run this cell as a DistributedDataParallel job, one rank per GPU (or -n gloo ranks
        on the CPU), and bring the names it assigns on rank 0 back into the notebook.

        The cell may use anything defined in earlier cells. Inside it, nbddp.rank(),
        nbddp.prepare_model(), nbddp.prepare_loader(), nbddp.log() and nbddp.progress() work
        as in notebook_launch. A failure on any rank ends every rank and raises here.
        """
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        try:
            return self._ddp(line, cell)
        except NbddpError as exc:  # the rank's traceback names the line; no echo of the cell
            exc._local_frames = False
            raise
        except KeyboardInterrupt as interrupt:
            raise interrupted(interrupt) from None

    def _ddp(self, line: str, cell: str) -> Any:
        __tracebackhide__ = True
        args = parse_argstring(self.ddp, line)
        if args.out is not None and args.no_out:
            raise UsageError("%%ddp: use either --out NAME,NAME or --no-out, not both.")
        check_detach(args)
        if args.export is not None:
            return self._export(line, cell, args)
        if args.session:
            return self._run_in_session(line, cell, args)
        try:
            plan = make_plan(
                num_workers="auto" if args.num_workers is None else args.num_workers,
                device=args.device,
                backend=args.backend,
                timeout=args.timeout,
                display=args.display,
                output=args.output,
                stall_after=args.stall_after,
                debug=args.debug,
                cluster=args.cluster,
                nodes="auto" if args.nodes is None else args.nodes,
                workers_per_node=(
                    "auto" if args.workers_per_node is None else args.workers_per_node
                ),
                **stopping_options(args, self.shell, cell),
                detach=args.detach,
            )
        except ValueError as exc:
            raise UsageError(f"%%ddp: {exc}") from None
        if plan.in_kernel:
            return self._run_in_kernel(cell, plan)
        return self._run_on_workers(line, cell, plan, args)

    def _export(self, line: str, cell: str, args: Any) -> None:
        """``%%ddp --export PATH``: write the cell as a script; nothing runs."""
        if args.session:
            raise UsageError(
                "%%ddp --export writes a script that starts its own ranks; a --session cell "
                "depends on the session's ranks and their names. Drop --session or --export."
            )
        num_workers: int | str = "auto" if args.num_workers is None else args.num_workers
        nodes = 1 if args.nodes is None else args.nodes
        if args.workers_per_node is not None:
            total = nodes * args.workers_per_node
            if args.num_workers not in (None, total):
                raise UsageError(
                    f"%%ddp --export: -n {args.num_workers} is not --nodes {nodes} x "
                    f"--workers-per-node {args.workers_per_node}; give one or the other."
                )
            num_workers = total
        _, filename, names = self._prepare_cell(line, cell)
        out_names = crossing.out_names(args, names, filename, held=frozenset())
        inputs = crossing.inputs(self._namespace, names, held=frozenset(), to=args.export)
        assert self.shell is not None
        try:
            written, command = export_cell(
                args.export,
                source=cell,
                label=f"In[{self.shell.execution_count}]",
                inputs=inputs,
                out_names=out_names,
                shows_last=cells.shows_last_value(cell),
                num_workers=num_workers,
                device=args.device,
                nodes=nodes,
                checkpoint_dir=args.checkpoint_dir,
                max_restarts=args.max_restarts,
                name=checkpoint_name(self.shell, cell),
            )
        except ValueError as exc:
            raise UsageError(f"%%ddp --export: {exc}") from None
        print(f"Wrote {', '.join(written)}.\nRun it with: {command}")

    def _run_in_kernel(self, cell: str, plan: LaunchPlan) -> None:
        shell = self.shell
        assert shell is not None  # a registered magic always has its shell

        def run_like_a_normal_cell() -> None:
            call_pdb = shell.call_pdb
            shell.call_pdb = plan.debug or call_pdb  # --debug: IPython's own post-mortem
            try:
                result = shell.run_cell(cell, store_history=False)
            finally:
                shell.call_pdb = call_pdb
            if result.error_in_exec is not None or result.error_before_exec is not None:
                raise CellFailed("the cell raised")

        try:
            launch_plan(run_like_a_normal_cell, (), {}, plan)
        except WorkerError as exc:
            if isinstance(exc.__cause__, CellFailed):
                raise exc.__cause__ from None
            raise

    def _run_on_workers(self, line: str, cell: str, plan: LaunchPlan, args: Any) -> Any:
        __tracebackhide__ = True  # IPython: show the user's frames, not ours
        source, filename, names = self._prepare_cell(line, cell)
        out_names = crossing.out_names(args, names, filename, held=frozenset())
        inputs = crossing.inputs(self._namespace, names, held=frozenset())
        kept = kept_cell(self.shell, line, cell, filename) if plan.detach else None
        outcome: Any = launch_plan(
            run_cell,
            (source, filename, inputs, out_names, cells.shows_last_value(source), names.deletes),
            {},
            plan,
            names=inputs,
            cell=kept,
        )
        if plan.detach:
            return announce(outcome)
        return crossing.bring_back(self._namespace, outcome, source, filename, session=False)

    def _run_in_session(self, line: str, cell: str, args: Any) -> Any:
        """``%%ddp --session``: the cell runs in the ranks' own namespace; names it reads come
        from there first, then from the notebook; only ``--out`` names come back."""
        __tracebackhide__ = True
        from nbddp.sessions.session import current

        placement = {
            "-n": args.num_workers,
            "--device": None if args.device == "auto" else args.device,
            "--backend": args.backend,
            "--cluster": args.cluster,
            "--nodes": args.nodes,
            "--workers-per-node": args.workers_per_node,
        }
        given = [flag for flag, value in placement.items() if value is not None]
        if given:
            raise UsageError(
                f"%%ddp --session runs on the session's ranks, so {', '.join(given)} belongs "
                "to %ddp_session start."
            )
        refuse_launch_only(args)
        session = current()
        if session is None:
            raise UsageError(
                "%%ddp --session: no session is running. Start one first: "
                "%ddp_session start -n 2 (or --device cuda for one rank per GPU)."
            )
        source, filename, names = self._prepare_cell(line, cell)
        held = session.names
        out_names = crossing.out_names(args, names, filename, held, default=())
        inputs = crossing.inputs(self._namespace, names, held)
        outcome: CellOutcome = session.run_cell(
            source,
            filename,
            inputs,
            out_names,
            cells.shows_last_value(source),
            names.deletes,
            timeout=args.timeout,
            display=args.display,
            output=args.output,
            stall_after=args.stall_after,
            debug=args.debug,
            stop_grace=args.stop_grace,
        )
        return crossing.bring_back(self._namespace, outcome, source, filename, session=True)

    @property
    def _namespace(self) -> dict[str, Any]:
        assert self.shell is not None  # a registered magic always has its shell
        return self.shell.user_ns  # type: ignore[no-any-return]

    def _prepare_cell(self, line: str, cell: str) -> tuple[str, str, cells.CellNames]:
        assert self.shell is not None
        if self.shell.transform_cell(cell) != cell:
            raise UsageError(
                "%%ddp: this cell uses IPython syntax (!command, %magic, ?help), which the "
                "ranks cannot run: they run plain Python. Move that line to a cell of its own."
            )
        source = "\n" + cell  # line 1 is the %%ddp line: the cell's line numbers hold
        filename = f"<%%ddp cell {next(_counter)}>"
        cells.register_source(filename, f"%%ddp {line}\n" + cell)
        number = _cell_number(self.shell)
        if number is not None:  # IPython then names its frames ``Cell In[n]``, as a cell's
            self.shell.compile._filename_map[filename] = number
        try:
            names = cells.analyze(source)
        except SyntaxError as exc:
            exc.filename = filename  # IPython names it Cell In[n], with the cell's own lines
            raise CellSyntaxError(exc) from None
        return source, filename, names


def _cell_number(shell: Any) -> int | None:
    """The number of the cell running this magic (``In[n]``): that of the innermost calling
    frame whose file IPython's compiler made for a cell."""
    cells = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:
        number = cells.get(frame.f_code.co_filename)
        if number is not None:
            return int(number)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def load_ipython_extension(ipython: Any) -> None:
    from nbddp.notebook.detached_magic import DetachedMagics
    from nbddp.notebook.session_magic import SessionMagics

    ipython.register_magics(DDPMagics)
    ipython.register_magics(SessionMagics)
    ipython.register_magics(DetachedMagics)


def unload_ipython_extension(ipython: Any) -> None:
    ipython.magics_manager.magics["cell"].pop("ddp", None)
    for name in ("ddp_session", "ddp_attach", "ddp_runs"):
        ipython.magics_manager.magics["line"].pop(name, None)
