"""Time to the first training step: nbddp beside the fork launchers, from a real Jupyter kernel.

    python benchmarks/first_step.py warm WORKLOAD [ROUNDS]
    python benchmarks/first_step.py first WORKLOAD [KERNELS] [PAUSE]
    python benchmarks/first_step.py memory

What a user waits for is not an empty launch but the first optimizer step of their training.
Each WORKLOAD is a function defined in a notebook cell, launched on 2 CPU ranks, that writes
the time of its first optimizer step on rank 0; the row is that time minus the moment the
launch was called in the kernel (and the whole launch, until it returned):

* ``ddp``: a ``nn.Linear`` under DistributedDataParallel, one SGD step (the kernel imported
  torch, and lightning and accelerate for their launchers);
* ``bert``: a tiny BERT built from a config (transformers) under DistributedDataParallel, one
  AdamW step (the kernel also imported transformers' BERT classes);
* ``hf``: HF Trainer's first step on a tiny BERT built from a config (the kernel also
  imported what the function uses from transformers, at the top of the cell, as a notebook does);
* ``lightning``: a Lightning Trainer's first step (``strategy="ddp"`` under nbddp; the fork
  baseline is Lightning's own ``strategy="ddp_notebook"``; Accelerate's launcher cannot run it:
  the Trainer refuses ``"ddp"`` in a process forked from a kernel).

Launchers: ``nbddp.notebook_launch`` (its pre-warmed helper, ``display="none"``), Lightning
Fabric's ``ddp_notebook`` and Accelerate's ``notebook_launcher`` (both fork the kernel). A plain
DDP function builds its process group if the launcher did not (Accelerate does not).

``warm``: one kernel imports everything, launches each launcher twice untimed, then ROUNDS
rounds of one launch per launcher, in rotating order, 0.3 s apart (as cells are): the same
process, the same modules, interleaved. ``first``: KERNELS fresh kernels per launcher, each
launching once, PAUSE seconds after the cell that imported the modules ended (the time a user
takes to write the next cell). ``memory``: what nbddp's helper holds once it mirrored a kernel
that imported transformers and lightning (and with ``NBDDP_PRELOAD=0``), and what a rank of an
HF Trainer's first step holds of its own (USS) and shares (RSS - USS).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

SETUP = """
import json, os, sys, tempfile, time
import torch, nbddp
import lightning
from lightning.fabric import Fabric
from accelerate import notebook_launcher
RECORDS = tempfile.mkdtemp()

def record(path):
    import time
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write(repr(time.time()))
"""

WORKLOADS = {
    "ddp": """
def first_step(path):
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    record(path)
""",
    "bert": """
from transformers import BertConfig, BertForSequenceClassification

def first_step(path):
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    model = torch.nn.parallel.DistributedDataParallel(BertForSequenceClassification(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (8, 16))
    model(input_ids=ids, labels=ids[:, 0] % 2).loss.backward()
    optimizer.step()
    record(path)
""",
    "hf": """
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments)

def first_step(path):
    import tempfile
    import torch

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                record(path)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,))
            return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long),
                    "labels": int(ids[0] % 2)}

    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
                             max_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Data(),
            callbacks=[Record()]).train()
""",
    "lightning": """
import lightning.pytorch as pl

def first_step(path, strategy="ddp"):
    import torch

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)
        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 1:
                record(path)

    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Record()])
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=8))
""",
}

LAUNCHERS = """
def launch_nbddp(path):
    nbddp.notebook_launch(first_step, args=(path,), num_workers=2, device="cpu", display="none")

def launch_fabric(path):
    Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(lambda f: first_step(path))

def launch_lightning(path):
    first_step(path, "ddp_notebook")  # the Trainer forks the kernel itself

def launch_accelerate(path):
    notebook_launcher(first_step, args=(path,), num_processes=2)

def measure(name):
    path = os.path.join(RECORDS, f"{name}-{time.monotonic_ns()}")
    started = time.time()
    globals()["launch_" + name](path)
    ended = time.time()
    with open(path) as f:
        return float(f.read()) - started, ended - started
"""

# the fork baseline of each workload
FORK = {"ddp": "fabric", "bert": "fabric", "hf": "fabric", "lightning": "lightning"}


def launchers(workload: str) -> list[str]:
    """Lightning's Trainer refuses ``strategy="ddp"`` in a process forked from a kernel (it
    sees an interactive environment): Accelerate's launcher cannot run it."""
    return ["nbddp", FORK[workload]] + (["accelerate"] if workload != "lightning" else [])


class Kernel:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        import os

        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env={**os.environ, **(env or {})})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 3600) -> str:
        out: list[str] = []

        def collect(msg: dict) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        if reply["content"]["status"] != "ok":
            raise RuntimeError("".join(out))
        return "".join(out)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def result(out: str) -> object:
    return json.loads(out.strip().splitlines()[-1])


def warm(workload: str, rounds: int) -> dict[str, list[list[float]]]:
    names = launchers(workload)
    kernel = Kernel()
    try:
        kernel.run(SETUP)
        kernel.run(WORKLOADS[workload] + LAUNCHERS)
        for _ in range(2):  # untimed: the kernel imports a launcher's lazy modules on its first
            kernel.run("\n".join(f"measure({n!r})" for n in names))  # and nbddp mirrors them
        out = kernel.run(
            f"names = {names!r}\ntimes = {{n: [] for n in names}}\n"
            f"for r in range({rounds}):\n"
            "    for n in names[r % len(names):] + names[:r % len(names)]:\n"
            "        time.sleep(0.3)\n"
            "        times[n].append(measure(n))\n"
            "print(json.dumps(times))"
        )
    finally:
        kernel.close()
    return result(out)  # type: ignore[return-value]


def first(workload: str, kernels: int, pause: float) -> dict[str, list[list[float]]]:
    names = launchers(workload)
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    for index in range(kernels):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            kernel = Kernel()
            try:
                kernel.run(SETUP + WORKLOADS[workload] + LAUNCHERS)
                time.sleep(pause)  # between the cells, as a user writes the next one
                times[name].append(result(kernel.run(f"print(json.dumps(measure({name!r})))")))
            finally:
                kernel.close()
    return times  # type: ignore[return-value]


MEMORY = """
import psutil
from nbddp.local import forkserver
forkserver.wait_until_preloaded(300)
helper = psutil.Process(forkserver.helper_pid())

def in_rank():
    import psutil
    first_step(os.path.join(RECORDS, "memory"))
    info = psutil.Process().memory_full_info()
    return info.rss, info.uss

rank_rss, rank_uss = nbddp.notebook_launch(in_rank, num_workers=2, device="cpu", display="none")
info = helper.memory_full_info()
print(json.dumps({"helper_rss": info.rss, "helper_uss": info.uss, "helper_pss": info.pss,
                  "modules": forkserver.warm_starter().helper.modules,
                  "rank_rss": rank_rss, "rank_uss": rank_uss}))
"""


def memory() -> dict[str, dict[str, int]]:
    """The same kernel twice: its modules mirrored, and not (``NBDDP_PRELOAD=0``: the helper
    holds torch and the first step's modules)."""
    found = {}
    for mirrored in ("1", "0"):
        kernel = Kernel({"NBDDP_PRELOAD": mirrored})
        try:
            kernel.run(SETUP + WORKLOADS["hf"] + "import lightning.pytorch")
            found["mirrored" if mirrored == "1" else "not mirrored"] = result(kernel.run(MEMORY))
        finally:
            kernel.close()
    return found  # type: ignore[return-value]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(workload: str, times: dict[str, list[list[float]]]) -> None:
    print("| workload | launcher | what | n | p50 s | p90 s | p99 s | max s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, pairs in times.items():
        for index, what in enumerate(("to first step", "whole launch")):
            values = [pair[index] for pair in pairs]
            cells = [_percentile(values, q) for q in (0.5, 0.9, 0.99)] + [max(values)]
            row = " | ".join(f"{c:.3f}" for c in cells)
            print(f"| {workload} | {name} | {what} | {len(values)} | {row} |")
    fork = FORK[workload]
    ours = [pair[0] for pair in times["nbddp"]]
    theirs = [pair[0] for pair in times[fork]]
    print(
        f"nbddp / {fork} to first step: p50 "
        f"{statistics.median(ours) / statistics.median(theirs):.2f}x, p99 "
        f"{_percentile(ours, 0.99) / _percentile(theirs, 0.99):.2f}x"
    )


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "warm":
        table(sys.argv[2], warm(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20))
    elif mode == "first":
        kernels = int(sys.argv[3]) if len(sys.argv) > 3 else 3
        pause = float(sys.argv[4]) if len(sys.argv) > 4 else 5.0
        table(sys.argv[2], first(sys.argv[2], kernels, pause))
    elif mode == "memory":
        print(json.dumps(memory()))
    else:
        raise SystemExit(__doc__)
