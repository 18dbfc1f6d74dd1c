"""Memory and time that grow with the data only as much as they must: a returned tensor costs
its own size in the kernel, and output without newlines is handled in linear time and bounded
memory. Measured in a fresh interpreter, so that the peak is this launch's alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks

PRELUDE = """\
import json, sys, time
import nbddp, torch
from nbddp.local import forkserver
forkserver.prestart(); forkserver.wait_until_ready(60)
nbddp.notebook_launch(abs, (-1,), num_workers=2, device="cpu", display="none")  # warm up

def peak():
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024
"""


def measure(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_returned_tensor_costs_its_size_in_the_kernel_not_twice():
    result = measure("""
def big(mib):
    return torch.full((mib * 2**18,), 3.0) if nbddp.rank() == 0 else None

before = peak()
value = nbddp.notebook_launch(big, (512,), num_workers=2, device="cpu", display="none")
print(json.dumps({"growth": peak() - before, "size": value.nbytes,
                  "right": bool((value[::4096] == 3.0).all())}))
""")
    assert result["right"]
    assert result["growth"] <= 1.1 * result["size"], result


@pytest.mark.slow
def test_output_without_newlines_is_linear_and_bounded():
    result = measure("""
def floods(mib):
    import os
    piece = b"x" * 65536
    for _ in range(mib * 16):
        os.write(2, piece)  # stderr, never a newline: rank 1's is not shown but its tail is kept
    if nbddp.rank() == 0:
        for _ in range(mib * 4):
            os.write(1, piece)  # rank 0's stdout, shown
    return 1

sys.stdout = open("/dev/null", "w")  # where the cell's output would go
before = peak()
started = time.monotonic()
nbddp.notebook_launch(floods, (96,), num_workers=2, device="cpu", display="none")
took = time.monotonic() - started
sys.stdout = sys.__stdout__
print(json.dumps({"growth": peak() - before, "seconds": took}))
""")
    # 2 x 96 MiB of stderr and 24 MiB of shown stdout: 0.4 s here (load 2). Quadratic took
    # 10 s and +100 MiB per 50 MiB at half this size, so about 40 s and +200 MiB at this one
    assert result["seconds"] < 8, result
    assert result["growth"] < 64 * 2**20, result
