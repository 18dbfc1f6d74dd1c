"""Sessions (#27): what reading a rank's collective counts costs after each task.

    python benchmarks/collectives_report.py [CALLS]

``Reporter.report`` runs on a session's rank after every task: it reads torch's sequence
number of each process group the rank is a member of (``collectives.issued``) and sends
``Issued`` only when they changed. Timed here in one process with one gloo group (world size
1, a file store), the numbers unchanged (the common case: an empty task), the message sent to a
connection that only counts: per-call p50/p90/p99/max in µs over CALLS calls (20,000 by
default) after 1,000 warm-up calls. Prints Markdown for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Any

from nbddp.worker.diagnosis.collectives import Reporter


class CountingConnection:
    """Stands in for the rank's channel: counts what would be sent."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, message: Any) -> None:
        self.sent += 1


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    import torch
    import torch.distributed as dist

    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    with tempfile.TemporaryDirectory() as folder:  # the file store removes its file itself
        store = f"file://{folder}/store"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            dist.all_reduce(torch.ones(1))  # one collective issued: a number to read
            reporter, conn = Reporter(0), CountingConnection()
            times = []
            for i in range(1_000 + calls):
                start = time.perf_counter()
                reporter.report(conn)  # type: ignore[arg-type]
                if i >= 1_000:
                    times.append(time.perf_counter() - start)
        finally:
            dist.destroy_process_group()
    assert conn.sent == 1, conn.sent  # sent once; unchanged numbers are not sent again
    cells = [statistics.median(times), _pct(times, 0.9), _pct(times, 0.99), max(times)]
    print("| `Reporter.report`, numbers unchanged (µs) | p50 | p90 | p99 | max | calls |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("| one gloo group | " + " | ".join(f"{v * 1e6:.2f}" for v in cells) + f" | {calls} |")
    print(f"\ntorch {torch.__version__}, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
