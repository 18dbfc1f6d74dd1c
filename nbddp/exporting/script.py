"""The text of an exported script and of its Slurm batch file.

A script is: a docstring that says what it was exported from, how to run it and what it needs; the
source of ``runner.py`` (the only code it runs besides torch and cloudpickle); and its ending: a
function's call, or a cell's own lines between ``start_cell`` and ``finish_cell``. The batch file
starts one torchrun per node with ``srun`` and a static rendezvous on the allocation's first node;
it asks Slurm for a signal before the time limit, on which the ranks stop together at a step (and
save what the function saves), and requeues the job, whose next start resumes from the same
checkpoint directory.

Non-goal: any scheduler option a site needs (partition, account, time): ``sbatch`` takes them
on its command line, or the user adds them to the file.
"""

from __future__ import annotations

import ast
import os
import pprint
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("runner.py")


@dataclass(frozen=True)
class Layout:
    """Where the ranks run, as the exporter resolved it."""

    device: str  # "cuda" | "cpu"
    backend: str
    nodes: int
    per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def script_text(
    *,
    script: Path,
    export: dict[str, Any],
    layout: Layout,
    origin: str,
    body: str,
    shown_source: str | None,
    sbatch: Path | None,
) -> str:
    """The whole script. ``body`` ends it (a call, or the cell); ``shown_source`` is the
    function's source, quoted for the reader."""
    version = getattr(sys.modules["nbddp"], "__version__", "?")  # its package, imported first
    name = script.name
    restarts = _restarts(export.get("max_restarts", 0))
    how = [f"    torchrun --standalone{restarts} --nproc-per-node {layout.per_node} {name}"]
    if layout.nodes > 1:
        how = [
            f"    torchrun --nnodes {layout.nodes} --node-rank K{restarts} --nproc-per-node "
            f"{layout.per_node} --master-addr NODE0 --master-port 29500 {name}",
            "    (on each node K = 0.." + str(layout.nodes - 1) + ")",
        ]
    if sbatch is not None:
        how.append(f"    sbatch {sbatch.name}   (Slurm: {_shape(layout)})")
    how.append(f"    python {name}   (one process, a world of 1)")
    needs = ", ".join(f"{m} ({what})" for m, what in export["needs"].items())
    docstring = "\n".join(
        [
            f"{name}: {export['what']}, exported from {origin} by nbddp {version}.",
            "",
            "Run it with torchrun, as notebook_launch ran it "
            f"({layout.world_size} rank(s), {layout.device}, {layout.backend}):",
            *how,
            "",
            *textwrap.wrap(
                f"Every rank joins the process group, then runs {export['what']} with what "
                f"the notebook captured (in {export['payload']}, beside this file: cloudpickle, "
                f"by value). Rank 0's value is saved in {export['result']} (pickle.load it; "
                "tensors are on the CPU); --result PATH saves it elsewhere.",
                width=96,
            ),
            *textwrap.wrap(f"Needs: {needs or 'torch, cloudpickle'}.", width=96),
            *textwrap.wrap(
                f"nbddp.checkpoint saves into {export.get('checkpoint_dir')} (as in the "
                "notebook; NBDDP_CHECKPOINT_DIR=... for another); SIGTERM stops every rank "
                "together at a step boundary.",
                width=96,
            ),
        ]
    )
    parts = [
        "#!/usr/bin/env python3",
        f'"""{docstring}\n"""',
        "",
        f"_NBDDP_EXPORT = {_literal(export)}",
        "",
    ]
    if shown_source is not None:
        parts += [
            "# What the payload holds, as the notebook defined it (to read; the payload runs).",
            *("# " + line if line else "#" for line in shown_source.rstrip().splitlines()),
            "",
        ]
    parts += [_runner_source(), "", body.rstrip(), ""]
    return "\n".join(parts)


def function_body() -> str:
    return "\n".join(
        [
            'if __name__ == "__main__":',
            "    NbddpScript(_NBDDP_EXPORT, __file__, __name__).run_function()",
        ]
    )


def cell_body(source: str, label: str, shows_last: bool) -> str:
    """The cell's own lines at the script's top level, as in the notebook; its last
    expression, which the notebook shows, goes to ``_nbddp.show``."""
    if shows_last:
        source = _show_last(source)
    return "\n".join(
        [
            "_nbddp = NbddpScript(_NBDDP_EXPORT, __file__, __name__)",
            "globals().update(_nbddp.start_cell())",
            f"# ---- {label}, as written in the notebook " + "-" * 30,
            source.strip("\n"),
            f"# ---- the end of {label} " + "-" * 30,
            "_nbddp.finish_cell(globals())",
        ]
    )


def _show_last(source: str) -> str:
    tree = ast.parse(source)
    last = tree.body[-1]
    assert isinstance(last, ast.Expr) and last.end_lineno is not None
    lines = source.splitlines()
    start, end = last.lineno - 1, last.end_lineno - 1
    end_col = last.end_col_offset or len(lines[end])
    lines[end] = lines[end][:end_col] + ")" + lines[end][end_col:]
    lines[start] = (
        lines[start][: last.col_offset] + "_nbddp.show(" + lines[start][last.col_offset :]
    )
    return "\n".join(lines)


def sbatch_text(
    *,
    script: Path,
    layout: Layout,
    origin: str,
    job: str,
    checkpoint_dir: str,
    max_restarts: int = 0,
    stop_lead: int = 120,
) -> str:
    """One torchrun per node (``srun``), a static rendezvous on the first node's address; the
    signal ``stop_lead`` seconds before the time limit becomes a graceful stop and a requeue
    (Slurm sends it up to a minute early or late: the lead leaves the stop time to save)."""
    python = shlex.quote(sys.executable)
    gpus = [f"#SBATCH --gpus-per-node={layout.per_node}"] if layout.device == "cuda" else []
    if layout.per_node > 1:  # torchrun's ranks share its task's CPUs: one each at least
        gpus.append(f"#SBATCH --cpus-per-task={layout.per_node}")
    torchrun = (
        f'exec "$PYTHON" -m torch.distributed.run --nnodes={layout.nodes} '
        '--node-rank="$SLURM_NODEID" '
        f"--nproc-per-node={layout.per_node}{_restarts(max_restarts, '=')} "
        '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" '
        f"{shlex.quote(str(script))}"
    )
    return "\n".join(
        [
            "#!/bin/bash",
            f"# {script.with_suffix('.sbatch').name}: runs {script.name} ({origin}) on Slurm,",
            f"# {_shape(layout)}: one torchrun per node, the rendezvous on the first node.",
            "# Site options (partition, account, time) go on sbatch's command line or below.",
            f"#SBATCH --job-name={job}",
            f"#SBATCH --nodes={layout.nodes}",
            "#SBATCH --ntasks-per-node=1",
            *gpus,
            f"#SBATCH --output={job}-%j.out",
            "#SBATCH --open-mode=append  # a requeued job's output follows the first's",
            f"#SBATCH --signal=B:USR1@{stop_lead}  # before the time limit: stop well, requeue",
            "#SBATCH --requeue",
            "",
            "set -euo pipefail",
            f"cd {shlex.quote(os.getcwd())}  # the notebook's directory: relative paths hold",
            "# the notebook's Python (NBDDP_PYTHON=... sbatch ... for another)",
            f"PYTHON=${{NBDDP_PYTHON:-{python}}}",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "# the first node's address as Slurm knows it (its name may not resolve elsewhere)",
            'addr=$(scontrol show node "$head" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
            'export MASTER_ADDR="${addr:-$head}"',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            "export PYTHON",
            "# where nbddp.checkpoint saves, as in the notebook: a requeued job resumes from it",
            f"export NBDDP_CHECKPOINT_DIR=${{NBDDP_CHECKPOINT_DIR:-{shlex.quote(checkpoint_dir)}}}",
            'mkdir -p "$NBDDP_CHECKPOINT_DIR"',
            'export NBDDP_STOP_FILE="$NBDDP_CHECKPOINT_DIR/.stop-$SLURM_JOB_ID"',
            'rm -f "$NBDDP_STOP_FILE" "$NBDDP_STOP_FILE.stopped"',
            "# Slurm's signal before the time limit: every rank stops at the same step",
            "trap 'touch \"$NBDDP_STOP_FILE\"' USR1",
            "# a failing node ends the job (torchrun alone would let the other nodes wait)",
            f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(torchrun)} &",
            "ranks=$!",
            "status=0",
            'while kill -0 "$ranks" 2>/dev/null; do  # a trapped signal interrupts wait',
            '    wait "$ranks" && status=0 || status=$?',
            "done",
            'rm -f "$NBDDP_STOP_FILE"',
            'if [ -e "$NBDDP_STOP_FILE.stopped" ]; then  # stopped before its end: go on later',
            '    rm -f "$NBDDP_STOP_FILE.stopped"',
            '    echo "nbddp: stopped at a step boundary before the time limit; requeued"',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "fi",
            'exit "$status"',
            "",
        ]
    )


def _restarts(max_restarts: int, joiner: str = " ") -> str:
    """torchrun's option: a failing rank restarts the whole world up to N times."""
    return f" --max-restarts{joiner}{max_restarts}" if max_restarts else ""


def _shape(layout: Layout) -> str:
    unit = "GPU(s)" if layout.device == "cuda" else "CPU rank(s)"
    return f"{layout.nodes} node(s) x {layout.per_node} {unit}"


def _runner_source() -> str:
    text = RUNNER.read_text()
    return text[text.index("from typing import Any") :].rstrip()


def _literal(value: Any) -> str:
    text = pprint.pformat(value, width=88, sort_dicts=False)
    ast.literal_eval(text)  # what the script reads back is exactly this
    return text
