"""Section 8: the GPU paths, on a machine that has one (else it says why nothing ran).

With 2 or more GPUs: NCCL, one rank per GPU (the default of ``device="cuda"``). With one GPU,
NCCL cannot run 2 ranks, so 2 gloo ranks share GPU 0 (``gpus=[0, 0]``): the multi-rank
paths are exercised, NCCL is not, and the report says so. Rows: launch latency of an
all_reduce on the GPU, and the small CNN's training throughput under nbddp vs a hand-written
torchrun script with the same backend and placement.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def _allreduce_on_gpu() -> float:
    import torch
    import torch.distributed as dist

    import nbddp

    t = torch.ones(1, device=nbddp.device())
    dist.all_reduce(t)
    return t.item()


def _placement(gpus: int) -> tuple[dict[str, Any], str, list[str]]:
    """Launch options, a label, and the matching torchrun arguments."""
    if gpus >= 2:
        return (
            {"device": "cuda", "gpus": [0, 1]},
            "NCCL, 2 ranks on GPUs 0 and 1",
            ["--nproc_per_node=2"],
        )
    return (
        {"device": "cuda", "gpus": [0, 0], "backend": "gloo"},
        "gloo, 2 ranks sharing GPU 0 (one GPU: NCCL not measured)",
        ["--nproc_per_node=2"],
    )


def _torchrun_rate(steps: int, backend: str, nproc: list[str]) -> float:
    script = Path(tempfile.mkdtemp()) / "train_torchrun_gpu.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
        f"from cnn import torchrun_main\ntorchrun_main({steps}, 'cuda', {backend!r})\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *nproc, str(script)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(next(x for x in out.splitlines() if x.startswith("RATE ")).split()[1])


def run(quick: bool) -> str:
    import torch

    if not torch.cuda.is_available():
        return (
            "Not measured: no GPU on this machine (`torch.cuda.is_available()` is False). "
            "On a GPU machine this section times an all_reduce launch on the GPU and the "
            "small CNN's throughput, nbddp vs torchrun, with NCCL on 2 GPUs (or gloo on "
            "`gpus=[0, 0]` with one)."
        )
    from cnn import nbddp_run

    import nbddp

    options, label, nproc = _placement(torch.cuda.device_count())
    backend = options.get("backend", "nccl")
    first_started = time.perf_counter()
    nbddp.notebook_launch(_allreduce_on_gpu, display="none", **options)
    first = time.perf_counter() - first_started
    repeated = []
    for _ in range(3 if quick else 20):
        started = time.perf_counter()
        nbddp.notebook_launch(_allreduce_on_gpu, display="none", **options)
        repeated.append(time.perf_counter() - started)

    steps, rounds = (50, 1) if quick else (300, 3)
    ours, theirs = [], []
    for _ in range(rounds):  # interleaved: both see the same machine state
        ours.append(nbddp.notebook_launch(nbddp_run, (steps,), display="none", **options))
        theirs.append(_torchrun_rate(steps, backend, nproc))
    a, b = statistics.median(ours), statistics.median(theirs)
    return "\n".join(
        [
            f"Placement: {label}; {torch.cuda.get_device_name(0)}.",
            "",
            "| row | value |",
            "| --- | ---: |",
            f"| all_reduce launch on the GPU, first (s) | {first:.3f} |",
            f"| all_reduce launch on the GPU, repeated, median (s) | "
            f"{statistics.median(repeated):.3f} |",
            f"| small CNN, hand-written torchrun, steps/s | {b:.1f} |",
            f"| small CNN, nbddp with log + progress every step, steps/s | {a:.1f} |",
            "",
            f"nbddp / torchrun: {a / b:.2f}× (target ≥ 0.98×); {rounds} interleaved rounds of "
            f"{steps} timed steps, batch 64.",
        ]
    )
