"""``nbddp.runs()`` and what it lists: a :class:`RunInfo` per detached run of the caller's,
read from the run directories alone (a finished or lost run has no supervisor to ask), and
``forget``.

Non-goal: attaching to a run (``attached.py``).
"""

from __future__ import annotations

import datetime
import html
from dataclasses import dataclass

from nbddp.detached import retention, store
from nbddp.state.format import format_duration

FORGET_WAIT = 10.0  # seconds for an ended run's supervisor to exit before its files go


@dataclass(frozen=True)
class RunInfo:
    """One detached run, as ``nbddp.runs()`` lists it. ``status`` is "starting" (its
    supervisor or batch job is not running its ranks yet), "running", "succeeded", "failed"
    or "stopped"; ``progress`` the latest progress bar and averaged ``nbddp.log`` row, as
    text; ``cluster`` None on this machine, else where it runs ("ray", "slurm job 1234"); ``path``
    its run directory."""

    id: str
    name: str
    status: str
    started: datetime.datetime
    world_size: int
    device: str
    progress: str
    cluster: str | None
    path: str
    ended: datetime.datetime | None = None

    def forget(self) -> None:
        """Delete this run's kept output and result (as ``Run.forget``)."""
        forget(self.id)

    @property
    def duration(self) -> float:
        end = self.ended or datetime.datetime.now().astimezone()
        return max(0.0, (end - self.started).total_seconds())

    def _row(self) -> list[str]:
        where = f"{self.world_size} × {self.device}"
        if self.cluster:
            where += f" ({self.cluster})"
        return [
            self.id,
            self.name,
            self.status,
            self.started.strftime("%Y-%m-%d %H:%M"),
            format_duration(self.duration),
            where,
            self.progress,
        ]


_HEAD = ["id", "name", "status", "started", "time", "where", "progress"]


class RunList(list[RunInfo]):
    """The list ``nbddp.runs()`` returns; shown as a table in a notebook."""

    def _repr_html_(self) -> str:
        if not self:
            return "<i>no detached runs</i>"
        head = "".join(f"<th style='text-align:left'>{h}</th>" for h in _HEAD)
        rows = "".join(
            "<tr>"
            + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in info._row())
            + "</tr>"
            for info in self
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"

    def __str__(self) -> str:
        if not self:
            return "no detached runs"
        table = [_HEAD] + [info._row() for info in self]
        widths = [max(len(row[i]) for row in table) for i in range(len(_HEAD))]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in table
        )


def info_of(run: store.StoredRun) -> RunInfo:
    info = run.info
    status, ended = run.state()
    job = run.job_id
    return RunInfo(
        id=run.id,
        name=str(info.get("name", "?")),
        status=status,
        started=store.started_at(run),
        world_size=int(info.get("world_size", 0)),
        device=str(info.get("device", "?")),
        progress=str(run.status().get("progress", "")),
        cluster=f"slurm job {job}" if job is not None else info.get("cluster"),
        path=run.path,
        ended=None if ended is None else datetime.datetime.fromtimestamp(ended).astimezone(),
    )


def runs() -> RunList:
    """Your detached runs on this machine (and, with ``NBDDP_RUNS_DIR`` on a shared
    filesystem, your cluster's), newest first. Finished runs past the retention limit are
    removed first (see ``docs/guides/detached.md``)."""
    retention.sweep()
    return RunList(info_of(run) for run in store.stored_runs())


def forget(run_id: str) -> None:
    """Delete a finished detached run's kept output and result. ValueError for a run that
    still runs (stop it first), or an id that is not one of yours."""
    run = store.find(run_id)
    _, ended = run.state()
    if ended is None:
        raise ValueError(
            f"run {run_id} is still running: stop it first (nbddp.attach({run_id!r}).stop()), "
            "then forget it."
        )
    run.wait_unsupervised(FORGET_WAIT)  # a supervisor that recorded the end is exiting
    run.remove()
