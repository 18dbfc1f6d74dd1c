"""nbddp quickstart: train a small model with DDP on every GPU (or 2 CPU ranks without one).

Run: python examples/quickstart.py
The same code works in a notebook cell; there the prints of rank 0 appear in the cell.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import nbddp


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_data(n: int = 2048) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def train(epochs: int = 3) -> torch.nn.Module:
    model = nbddp.prepare_model(TinyNet())
    loader = nbddp.prepare_loader(DataLoader(make_data(), batch_size=64, shuffle=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(epochs):
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        nbddp.print(
            f"epoch {epoch}: loss {total / len(loader):.4f} "
            f"({nbddp.world_size()} ranks on {nbddp.device().type})"
        )
    return model  # comes back to the caller on the CPU, DDP unwrapped


if __name__ == "__main__":
    gpus = torch.cuda.device_count()
    workers = gpus if gpus >= 1 else 2  # one per GPU; 2 gloo ranks on a CPU-only machine
    model = nbddp.notebook_launch(train, num_workers=workers, device="cuda" if gpus else "cpu")
    x, y = make_data(256)[:]
    with torch.no_grad():
        mse = torch.nn.functional.mse_loss(model(x), y).item()
    print(f"trained {type(model).__name__} back in the parent process: eval mse {mse:.4f}")
