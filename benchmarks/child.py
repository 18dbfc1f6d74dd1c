"""What the memory benchmarks' child scripts share: each case runs in a fresh interpreter
(:func:`run_child`, which reads its ``RESULT {json}`` line), and measures the machine's memory
with :data:`MEMORY_PROBE`, pasted at the top of its script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# used(): every process's private memory and all shared memory, machine-wide (page cache and
# the kernel's own caches, which move on their own, left out; MemAvailable would count most of
# a memfd's pages as available). settled(): that level once it stops moving (the previous
# case's processes free their memory after they exited; that freeing must not count).
MEMORY_PROBE = r"""
import time

def used():
    f = {k: int(v.split()[0]) * 1024 for k, v in (x.split(":", 1) for x in open("/proc/meminfo"))}
    return f["AnonPages"] + f["Shmem"]

def settled():
    last = used()
    for _ in range(60):
        time.sleep(0.5)
        now = used()
        if abs(now - last) < 20 * 2**20:
            return now
        last = now
    return last
"""


def run_child(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``script`` in a fresh interpreter; its ``RESULT`` line, or its stderr's end raised."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env} if env is not None else None,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(done.stderr[-2000:])
    result: dict[str, float] = json.loads(line[len("RESULT ") :])
    return result
