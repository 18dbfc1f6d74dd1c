"""What Slurm's queue says of a detached run's batch job (``squeue``).

Non-goal: submitting it (``batch.py``).
"""

from __future__ import annotations

from nbddp.clusters.slurm.commands import ENDED, SlurmCommandError, job_state


def job_in_queue(job_id: str) -> bool:
    """Whether the batch job still pends or runs. When Slurm cannot be asked, it is taken as
    still there (nothing of it is removed on a guess)."""
    return queue_state(job_id)[0] != ""


def queue_state(job_id: str) -> tuple[str, str]:
    """The job's state and reason; ("", "") once it left the queue (or ended)."""
    try:
        state, reason = job_state(job_id)
    except SlurmCommandError as exc:
        return "UNKNOWN", str(exc)
    return ("", "") if not state or state in ENDED else (state, reason)
