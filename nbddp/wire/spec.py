"""The job spec: what every rank needs before it can connect, written by the kernel into the
run's private directory and read once by each rank (``worker/entry.py``); the bound of a
rank's exit work as the kernel's environment sets it.

Non-goal: the messages on the connection (``messages.py``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

SPEC = "spec.json"  # the JobSpec's file name in the run's private directory


@dataclass(frozen=True)
class JobSpec:
    """What every rank needs before it can connect: written once by the kernel into the run's
    private directory (``spec.json``), read once by each rank. Rank, world size and the
    rendezvous address travel as the torchrun environment variables, as torchrun sets them."""

    address: str  # the kernel's channel (a Unix socket path)
    authkey: str  # hex of the per-run key of the handshake
    run_id: str
    sys_path: tuple[str, ...]
    cwd: str
    device: str  # "cuda" or "cpu"
    device_index: tuple[int, ...]  # each rank's cuda index inside its process
    backend: str
    return_all: bool
    output: str = "rank0"  # whose output is shown: other ranks' progress bars stay silent
    logging: tuple[int, str, str | None] | None = None  # the notebook's level, format, datefmt
    session: bool = False  # the ranks stay up and run Tasks (worker/session.py)
    exit_timeout: float = 30.0  # the bound of its exit work (torchrun's SIGTERM->SIGKILL)
    debug: bool = False  # an uncaught exception stops the rank in post-mortem pdb first
    checkpoint_dir: str = ""  # nbddp.checkpoint's directory (absolute); "": the rank's default
    keep: int = 2  # how many complete checkpoints are kept

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobSpec:
        fields = json.loads(data)
        fields["sys_path"] = tuple(fields["sys_path"])
        fields["device_index"] = tuple(fields["device_index"])
        if fields.get("logging") is not None:
            fields["logging"] = tuple(fields["logging"])
        return cls(**fields)


def exit_timeout() -> float:
    """Seconds a rank that ended normally has for its exit handlers and the processes it
    started (``NBDDP_EXIT_TIMEOUT`` in the kernel's environment; 30 s, as torchrun gives its
    workers between SIGTERM and SIGKILL)."""
    text = os.environ.get("NBDDP_EXIT_TIMEOUT")
    if text is None:
        return JobSpec.exit_timeout
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(
            f"NBDDP_EXIT_TIMEOUT={text!r} in the environment must be a number of seconds >= 0 "
            f"(how long a rank's exit handlers may run; the default is {JobSpec.exit_timeout:g}): "
            "fix it with os.environ['NBDDP_EXIT_TIMEOUT'] = '30', or del it."
        )
    return seconds
