"""``%ddp_session``: start, stop, restart, inspect the notebook's session, and pull names back.

%ddp_session start -n 2 --device cpu
%%ddp --session
model = Net().to(nbddp.device())        # stays on the ranks
%ddp_session pull model                  # rank 0's copy into the notebook
%ddp_session status
%ddp_session stop
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from nbddp.plan import BACKENDS, DEVICE_OPTIONS
from nbddp.sessions.session import Session, current, set_current

_USAGE = (
    "%ddp_session start [-n N] [--device auto|cuda|cpu] [--backend nccl|gloo] "
    "[--gpus 0,1] [--cluster ray|slurm] | stop | restart | status | pull NAME[,NAME...]"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a UsageError in the cell, not SystemExit
        raise UsageError(f"%ddp_session start: {message}. Usage: {_USAGE}")


def _start_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%ddp_session start", add_help=False)
    parser.add_argument("-n", "--num-workers", type=int, default=None)
    parser.add_argument("--device", choices=DEVICE_OPTIONS, default="auto")
    parser.add_argument("--backend", choices=BACKENDS, default=None)
    parser.add_argument("--gpus", type=str, default=None)
    parser.add_argument("--cluster", type=str, default=None)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--workers-per-node", type=int, default=None)
    return parser


@magics_class
class SessionMagics(Magics):
    @line_magic
    def ddp_session(self, line: str) -> Any:
        """Ranks that stay up between cells: ``start [-n N --device ...]``, ``stop``,
        ``restart``, ``status``, ``pull NAME[,NAME]``. Then ``%%ddp --session`` cells run on
        them, in a namespace each rank keeps."""
        words = shlex.split(line)
        if not words:
            raise UsageError(f"usage: {_USAGE}")
        command, rest = words[0], words[1:]
        if command == "start":
            return self._start(rest)
        if command in ("stop", "restart", "status"):
            if rest:
                raise UsageError(f"%ddp_session {command} takes no arguments.")
            session = _the_session(command)
            if command == "stop":
                session.close()
                print(f"stopped {session}")
            elif command == "restart":
                session.restart()
                print(f"restarted: {session} (its namespace is empty)")
            else:
                print(status_table(session))
            return None
        if command == "pull":
            names = [n.strip() for n in ",".join(rest).split(",") if n.strip()]
            if not names:
                raise UsageError("%ddp_session pull NAME[,NAME...]: which names?")
            values = _the_session("pull").pull(*names)
            assert self.shell is not None
            self.shell.user_ns.update(values)
            return None
        raise UsageError(f"%ddp_session: unknown command {command!r}. Usage: {_USAGE}")

    def _start(self, words: list[str]) -> None:
        args = _start_parser().parse_args(words)
        running = current()
        if running is not None and running.alive:
            raise UsageError(
                f"a session is running already ({running}): %ddp_session stop first, or "
                "%ddp_session restart for fresh ranks."
            )
        gpus = None
        if args.gpus is not None:
            try:
                gpus = [
                    g if g.startswith(("GPU-", "MIG-")) else int(g) for g in args.gpus.split(",")
                ]
            except ValueError:
                raise UsageError(
                    f"--gpus {args.gpus}: give GPU indices or UUIDs, e.g. --gpus 0,1"
                ) from None
        try:
            session = Session(
                num_workers="auto" if args.num_workers is None else args.num_workers,
                device=args.device,
                backend=args.backend,
                gpus=gpus,
                cluster=args.cluster,
                nodes="auto" if args.nodes is None else args.nodes,
                workers_per_node="auto" if args.workers_per_node is None else args.workers_per_node,
            )
        except ValueError as exc:
            raise UsageError(f"%ddp_session start: {exc}") from None
        set_current(session)
        print(f"started {session}")


def _the_session(command: str) -> Session:
    session = current()
    if session is None:
        raise UsageError(
            f"%ddp_session {command}: no session is running. Start one with "
            "%ddp_session start -n 2 (or --device cuda for one rank per GPU)."
        )
    return session


def status_table(session: Session) -> str:
    rows = session.status()
    lines = [repr(session)]
    if not rows:
        return lines[0]
    lines.append(f"{'rank':>4}  {'pid':>7}  {'state':<8}  {'memory':>10}  {'GPU memory':>10}")
    for row in rows:
        if not row["alive"]:
            state = "ended"
        elif row["busy"] is None:
            state = "no reply"
        else:
            state = "busy" if row["busy"] else "idle"
        lines.append(
            f"{row['rank']:>4}  {row['pid'] or '-':>7}  {state:<8}  "
            f"{_size(row['memory']):>10}  {_size(row['device_memory']):>10}"
        )
    if rows[0]["restarted"]:
        lines.append(f"ranks restarted {rows[0]['restarted']}; the state they held was lost")
    if rows.stacks is not None:
        lines += ["", "The running task:", rows.stacks.rollcall()]
    return "\n".join(lines)


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"
