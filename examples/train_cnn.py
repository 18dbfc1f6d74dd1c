"""Train a small CNN on FakeData with DDP, from a plain script, with nbddp.

    python examples/train_cnn.py --workers 2 --epochs 2 --size 2048
    python examples/train_cnn.py            # one rank per GPU, or 2 CPU ranks without GPU

No download: torchvision.datasets.FakeData makes the images.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import nbddp


class SmallCNN(torch.nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * 7 * 7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def fake_mnist(size: int, offset: int = 0) -> datasets.FakeData:
    return datasets.FakeData(
        size=size,
        image_size=(1, 28, 28),
        num_classes=10,
        transform=transforms.ToTensor(),
        random_offset=offset,
    )


def train(size: int, epochs: int, batch_size: int, lr: float) -> SmallCNN:
    model = nbddp.prepare_model(SmallCNN())
    loader = nbddp.prepare_loader(DataLoader(fake_mnist(size), batch_size=batch_size, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in nbddp.progress(range(epochs), desc="epoch"):
        for images, labels in nbddp.progress(loader, desc="batch"):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            nbddp.log(loss=loss)
        nbddp.print(f"epoch {epoch}: loss {loss.item():.3f}")
    return model


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=positive,
        default=None,
        help="ranks (default: one per GPU, or 2 on the CPU)",
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--epochs", type=positive, default=2)
    parser.add_argument("--size", type=positive, default=2048, help="training images")
    parser.add_argument("--batch-size", type=positive, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    workers = args.workers or (gpus if gpus else 2)
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    model = nbddp.notebook_launch(
        train,
        (args.size, args.epochs, args.batch_size, args.lr),
        num_workers=workers,
        device=device,
    )
    run = nbddp.last_run()
    print(
        f"done: {type(model).__name__} trained on {run.world_size} × {run.device} in "
        f"{run.duration:.1f} s; final averaged loss {run.history[-1]['loss']:.3f}"
    )


if __name__ == "__main__":
    main()
