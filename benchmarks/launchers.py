"""Launch latency of a trivial all_reduce on 2 CPU ranks, one launcher per fresh process.

    python benchmarks/launchers.py METHOD REPEATS [PAUSE]
        -> prints {"first": s, "repeated": [s, ...]}; PAUSE: seconds between launches (0)

Methods: nbddp-warm, nbddp-cold, accelerate (its fork-based ``notebook_launcher``), fabric
(Lightning Fabric's fork-based ``ddp_notebook`` strategy), mp-fork (a bare
``torch.multiprocessing.start_processes(..., start_method="fork")``), mp-spawn. Each first
sleeps 3 s after its imports (so nbddp's helper, started at import in a kernel, has had the
time a user gives it between cells), then times one first launch and REPEATS more from the
same process.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _allreduce_in_group() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _accelerate_fn() -> None:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.reduce(torch.ones(1, device=accelerator.device))


def _fabric_fn(fabric: object) -> float:
    import torch

    t = torch.ones(1)
    fabric.all_reduce(t)  # type: ignore[attr-defined]
    return t.item()


def _spawn_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _allreduce_in_group()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(method: str, repeats: int, pause: float = 0.0) -> None:
    if method == "nbddp-cold":
        os.environ["NBDDP_PREWARM"] = "0"
    if method.startswith("nbddp"):
        import nbddp
        import nbddp.launch
        from nbddp.local import forkserver

        forkserver.prestart()  # is this: the helper starts at import

        def launch() -> None:
            nbddp.notebook_launch(_allreduce_in_group, num_workers=2, device="cpu", display="none")
    elif method == "accelerate":
        from accelerate import notebook_launcher

        def launch() -> None:
            notebook_launcher(_accelerate_fn, num_processes=2)
    elif method == "fabric":
        from lightning.fabric import Fabric

        def launch() -> None:
            Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(_fabric_fn)
    elif method == "mp-fork":
        import torch
        import torch.multiprocessing as mp

        torch.ones(1).sum()  # as in a kernel that used torch already

        def launch() -> None:
            mp.start_processes(_spawn_worker, args=(_free_port(),), nprocs=2, start_method="fork")
    elif method == "mp-spawn":
        import torch.multiprocessing as mp

        def launch() -> None:
            mp.spawn(_spawn_worker, args=(_free_port(),), nprocs=2)
    else:
        raise SystemExit(f"unknown method {method!r}")
    time.sleep(3)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        launch()
        times.append(time.perf_counter() - started)
        time.sleep(pause)
    print("RESULT " + json.dumps({"first": times[0], "repeated": times[1:]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
