"""What a rank's rich output costs the rank, measured inside rank 0 of a two-rank CPU launch
from a real Jupyter kernel (jupyter_client):

* ``display(HTML(...))``, a new output: formatted on the rank, sent, published by the kernel
  under the cell, and the kernel's ``Shown`` awaited (so later prints come after it);
* ``handle.update(HTML(...))``, an update in place (not awaited);
* ``plt.plot(...); plt.show()``: a matplotlib figure rendered to PNG and sent.

    python benchmarks/rich_output.py

Each as a distribution (p50/p90/p99/max). Target: a new output costs the rank under 5 ms at
p50 (a round trip through the kernel), an update under 1 ms: negligible next to a training
step that shows something now and then.
"""

from __future__ import annotations

import json

CELL = r"""
import time, json
import nbddp
from IPython.display import HTML

def measure():
    import matplotlib.pyplot as plt
    if nbddp.rank() != 0:
        return None
    new, update, figure = [], [], []
    for i in range(90):
        t = time.perf_counter()
        display(HTML(f"<b>{i}</b>"))
        new.append(time.perf_counter() - t)
    handle = display(HTML("<i>0</i>"), display_id=True)
    for i in range(500):
        t = time.perf_counter()
        handle.update(HTML(f"<i>{i}</i>"))
        update.append(time.perf_counter() - t)
    for i in range(8):
        t = time.perf_counter()
        plt.plot(range(100)); plt.show()
        figure.append(time.perf_counter() - t)
    return new, update, figure

result = nbddp.notebook_launch(measure, num_workers=2, device="cpu", display="none")
print("RESULT" + json.dumps(result))
"""


def _percentiles(values: list[float]) -> str:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (
        f"p50 {at(0.5):.2f} ms, p90 {at(0.9):.2f} ms, p99 {at(0.99):.2f} ms, "
        f"max {ordered[-1] * 1000:.2f} ms (n={len(ordered)})"
    )


def main() -> None:
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        printed: list[str] = []

        def collect(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        client.execute_interactive(CELL, timeout=300, output_hook=collect)
        line = next(x for x in "".join(printed).splitlines() if x.startswith("RESULT"))
        new, update, figure = json.loads(line[len("RESULT") :])
        print(f"display(HTML) new output : {_percentiles(new)}")
        print(f"handle.update(HTML)      : {_percentiles(update)}")
        print(f"plt.plot + plt.show()    : {_percentiles(figure)}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
