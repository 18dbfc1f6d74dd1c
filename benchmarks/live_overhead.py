"""What nbddp.log + nbddp.progress cost a training loop, and how fast a logged value is shown.

Each rank runs the same loop in short blocks: without anything ("plain"), again without
anything ("plain again": the A/A control that shows this machine's noise floor), and with
``nbddp.log`` + ``nbddp.progress`` on every step ("live"), in ABBA order over many rounds so
all see the same noise; the ratio of median step rates is the overhead. Three loops:

* "natural": a small MLP trained with DDP (forward, backward, all-reduce, optimizer step);
* "1k": one matrix product per step, about a thousand steps a second per rank (the
  target's regime: under 5% at 1,000+ steps/s);
* "tiny": a smaller product, five thousand or more steps a second (beyond the target);
* "extreme": next to no work per step, tens of thousands of steps a second: shows the fixed
  cost of a ``log`` + ``progress`` step, beyond any target.

Latency: rank 0 logs ``time.time()`` as a metric; the kernel's view records, at each render,
how old the newest logged timestamp is. That is the time from the ``log`` call to the render
that sends it to the frontend (the browser's own paint is not included).

Run: python benchmarks/live_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch

import nbddp
from nbddp.display import text as text_view

ROUNDS = 24


def _loops(kind: str, steps: int) -> dict[str, list[float]]:
    import torch.nn.functional as F

    torch.manual_seed(0)
    if kind == "natural":
        model = nbddp.prepare_model(torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def step() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            return loss.detach()
    elif kind in ("1k", "tiny"):
        size = 320 if kind == "1k" else 192
        a = torch.randn(size, size)

        def step() -> torch.Tensor:
            return (a @ a).sum()
    else:  # "extreme": next to no work per step
        a = torch.randn(16, 16)

        def step() -> torch.Tensor:
            return (a @ a).sum()

    rates: dict[str, list[float]] = {"plain": [], "plain again": [], "live": []}
    order = list(rates)
    for round_ in range(ROUNDS):
        for mode in order if round_ % 2 == 0 else reversed(order):
            nbddp.barrier()
            started = time.perf_counter()
            if mode != "live":
                for _ in range(steps):
                    step()
            else:
                for _ in nbddp.progress(range(steps), desc=kind):
                    loss = step()
                    nbddp.log(loss=loss, t=time.time())
            rates[mode].append(steps / (time.perf_counter() - started))
    return rates


def _measure(kind: str, steps: int, workers: int) -> tuple[dict[str, float], list[float]]:
    latencies: list[float] = []
    original = text_view.TextView.render

    seen: set[float] = set()

    def render(view: text_view.TextView) -> None:  # record, then draw as usual
        t = view._state.metrics.latest.get("t")
        if t is not None and t not in seen:  # a render that shows a newly logged value
            seen.add(t)
            latencies.append(time.time() - t)
        original(view)

    text_view.TextView.render = render  # type: ignore[method-assign]
    try:
        rates = nbddp.notebook_launch(_loops, (kind, steps), num_workers=workers,
                                      device="cpu", display="text")
    finally:
        text_view.TextView.render = original  # type: ignore[method-assign]
    return {mode: statistics.median(values) for mode, values in rates.items()}, latencies


def run() -> str:
    lines = [
        "| loop | ranks | steps/s plain | with log+progress | overhead | A/A noise |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    all_latencies: list[float] = []
    for kind, steps in (("natural", 150), ("1k", 300), ("tiny", 1000), ("extreme", 10000)):
        for workers in (2, 1):
            rates, latencies = _measure(kind, steps, workers)
            all_latencies += latencies
            plain, again, live = rates["plain"], rates["plain again"], rates["live"]
            where = f"{workers} (gloo workers)" if workers > 1 else "1 (in the kernel)"
            lines.append(f"| {kind} | {where} | {plain:,.0f} | {live:,.0f} | "
                         f"{100 * (plain - live) / plain:+.1f}% | "
                         f"{100 * (plain - again) / plain:+.1f}% |")
    all_latencies.sort()
    p50 = all_latencies[len(all_latencies) // 2] * 1000
    p95 = all_latencies[int(len(all_latencies) * 0.95)] * 1000
    lines += ["", f"log → render latency over {len(all_latencies)} renders: "
              f"median {p50:.0f} ms, p95 {p95:.0f} ms (target p95 < 200 ms)."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
