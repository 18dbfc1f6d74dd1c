"""The small CNN and loop that the throughput benchmark runs under nbddp and under torchrun.

The loop is the same code in both; ``live=True`` adds nbddp.log + nbddp.progress per step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def dataset(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 1, 28, 28, generator=g)
    return TensorDataset(images, torch.randint(0, 10, (n,), generator=g))


def train_steps(
    model: torch.nn.Module, loader: DataLoader, steps: int, warmup: int = 10, live: bool = False
) -> float:
    """Steps per second over ``steps`` steps, after ``warmup`` untimed ones."""
    import nbddp

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = iter(_forever(loader))
    for _ in range(warmup):
        _step(model, optimizer, next(batches))
    started = time.perf_counter()
    if live:
        for _ in nbddp.progress(range(steps), desc="train"):
            nbddp.log(loss=_step(model, optimizer, next(batches)))
    else:
        for _ in range(steps):
            _step(model, optimizer, next(batches))
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the GPU's queued steps count too
    return steps / (time.perf_counter() - started)


def _step(model, optimizer, batch) -> torch.Tensor:
    images, labels = batch
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


class _on:
    """A loader whose batches are moved to ``device`` (what nbddp.prepare_loader does)."""

    def __init__(self, device: str, loader: DataLoader) -> None:
        self.device, self.loader, self.sampler = device, loader, loader.sampler

    def __iter__(self):
        for batch in self.loader:
            yield [t.to(self.device, non_blocking=True) for t in batch]


def _forever(loader):
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def nbddp_run(steps: int) -> float:
    """Inside notebook_launch: the nbddp way, with the live view on every step."""
    import nbddp

    model = nbddp.prepare_model(SmallCNN())
    loader = nbddp.prepare_loader(DataLoader(dataset(), batch_size=64, shuffle=True))
    return train_steps(model, loader, steps, live=True)


def torchrun_main(steps: int, device: str = "cpu", backend: str = "gloo") -> None:
    """Under torchrun: the hand-written way (``device="cuda"``: each rank on the GPU of its
    ``LOCAL_RANK``, modulo the GPUs there are, so 2 ranks can share one GPU with gloo)."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(backend)
    if device == "cuda":
        index = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        model = DistributedDataParallel(SmallCNN().cuda(), device_ids=[index])
    else:
        model = DistributedDataParallel(SmallCNN())
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = _on(device, DataLoader(data, batch_size=64, sampler=sampler))
    rate = train_steps(model, loader, steps)
    if dist.get_rank() == 0:
        print(f"RATE {rate}", flush=True)
    dist.destroy_process_group()
