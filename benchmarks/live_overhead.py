"""What nbddp.log + nbddp.progress cost a training loop, and how fast a logged value is shown.

Each rank runs the same loop in short blocks: without anything ("plain"), again without
anything ("plain again": the A/A control that shows this machine's noise floor), reading the
loss with ``.item()`` on every step and nothing else ("read": what any logging costs at least,
and how much this machine's step time reacts to a few microseconds of Python a step), and
with ``nbddp.log`` + ``nbddp.progress`` on every step ("live"), in ABBA order over many rounds so
all see the same noise. A first round warms up and is not counted. The overhead is the median
over rounds of the ratio of the two step rates measured in the same round: pairing the blocks
of one round cancels this VM's slow drifts, which move whole rounds by several percent. The
overhead of one launch still differs from the next one's (thread placement, memory layout), so
each row is measured over several launches and shown as the median with the lowest and
highest. The loops:

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
from collections.abc import Callable

import nbddp
from nbddp.display import text as text_view
from nbddp.state.run import RunSnapshot

ROUNDS = 24
LAUNCHES = 3  # the overhead moves between launches by more than within one


def _loops(kind: str, steps: int) -> dict[str, list[float]]:
    from training_step import make_step

    sizes = {"1k": 320, "tiny": 192}  # "extreme": 16, next to no work per step
    step = make_step(kind, sizes.get(kind, 16))

    rates: dict[str, list[float]] = {"plain": [], "plain again": [], "read": [], "live": []}
    order = list(rates)
    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for mode in order if round_ % 2 == 0 else reversed(order):
            nbddp.barrier()
            started = time.perf_counter()
            if mode in ("plain", "plain again"):
                for _ in range(steps):
                    step()
            elif mode == "read":  # the least any logging does: read the value each step
                for _ in range(steps):
                    step().item()
                    time.time()
            else:
                for _ in nbddp.progress(range(steps), desc=kind):
                    loss = step()
                    nbddp.log(loss=loss, t=time.time())
            if round_:
                rates[mode].append(steps / (time.perf_counter() - started))
    return rates


def _paired(
    rates: dict[str, list[float]], mode: str, compare: Callable[[float, float], float]
) -> float:
    """Median over rounds of ``compare(plain rate, mode's rate)``, both from the same round."""
    return statistics.median(
        compare(plain, other) for plain, other in zip(rates["plain"], rates[mode], strict=True)
    )


def _slowdown(plain: float, other: float) -> float:
    """How much longer a step took than a plain one, as a fraction."""
    return plain / other - 1


def _added_time(plain: float, other: float) -> float:
    """How many seconds longer a step took than a plain one."""
    return 1 / other - 1 / plain


def _measure(kind: str, steps: int, workers: int) -> tuple[dict[str, list[float]], list[float]]:
    latencies: list[float] = []
    original = text_view.TextView.render

    seen: set[float] = set()

    def render(view: text_view.TextView, snapshot: RunSnapshot) -> None:  # record, then draw
        t = snapshot.latest.get("t")
        if t is not None and t not in seen:  # a render that shows a newly logged value
            seen.add(t)
            latencies.append(time.time() - t)
        original(view, snapshot)

    text_view.TextView.render = render  # type: ignore[method-assign]
    try:
        rates = nbddp.notebook_launch(
            _loops, (kind, steps), num_workers=workers, device="cpu", display="text"
        )
    finally:
        text_view.TextView.render = original  # type: ignore[method-assign]
    return rates, latencies


def _spread(values: list[float], unit: str = "%", scale: float = 100) -> str:
    """The median over launches, then the lowest and highest."""
    low, mid, high = min(values), statistics.median(values), max(values)
    if len(values) == 1:
        return f"{scale * mid:+.1f}{unit}"
    return f"{scale * mid:+.1f}{unit} ({scale * low:+.1f} to {scale * high:+.1f})"


def run(launches: int = LAUNCHES) -> str:
    lines = [
        f"Each row: {launches} launch(es) of {ROUNDS} rounds; the median over launches, then the "
        "lowest and highest launch.",
        "",
        "| loop | ranks | steps/s plain | with log+progress | overhead | per step "
        "| only .item() | A/A noise |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    all_latencies: list[float] = []
    for kind, steps in (("natural", 150), ("1k", 300), ("tiny", 1000), ("extreme", 10000)):
        for workers in (2, 1):
            runs = []
            for _ in range(launches):  # a launch's overhead differs from the next one's
                rates, latencies = _measure(kind, steps, workers)
                all_latencies += latencies
                runs.append(rates)
            plain = statistics.median(v for rates in runs for v in rates["plain"])
            live = statistics.median(v for rates in runs for v in rates["live"])
            where = f"{workers} (gloo workers)" if workers > 1 else "1 (in the kernel)"
            lines.append(
                f"| {kind} | {where} | {plain:,.0f} | {live:,.0f} | "
                f"{_spread([_paired(rates, 'live', _slowdown) for rates in runs])} | "
                f"{_spread([_paired(rates, 'live', _added_time) for rates in runs], ' µs', 1e6)} | "
                f"{_spread([_paired(rates, 'read', _slowdown) for rates in runs])} | "
                f"{_spread([_paired(rates, 'plain again', _slowdown) for rates in runs])} |"
            )
    if not all_latencies:
        raise RuntimeError("no render showed a logged value: did TextView.render change?")
    all_latencies.sort()
    p50 = all_latencies[len(all_latencies) // 2] * 1000
    p95 = all_latencies[int(len(all_latencies) * 0.95)] * 1000
    lines += [
        "",
        f"log → render latency over {len(all_latencies)} renders: "
        f"median {p50:.0f} ms, p95 {p95:.0f} ms (target p95 < 200 ms).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
