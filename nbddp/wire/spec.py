"""The job spec: what every rank needs before it can connect, written by the kernel into the
run's private directory and read once by each rank (``worker/rank/entry.py``).

Non-goal: the messages on the connection (``messages.py``).
"""

from __future__ import annotations

import json
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
    session: bool = False  # the ranks stay up and run Tasks (worker/rank/session.py)
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
