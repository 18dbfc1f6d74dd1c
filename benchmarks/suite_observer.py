"""A pytest plugin for ``benchmarks/suite_time.py``: each test's worker, start and end, written
as one JSON line per test to ``$NBDDP_SUITE_TIMELINE/<worker>.jsonl``. It only watches."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    started = time.time()
    try:
        return (yield)
    finally:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        record = {"id": item.nodeid, "worker": worker, "start": started, "end": time.time()}
        path = os.path.join(os.environ["NBDDP_SUITE_TIMELINE"], f"{worker}.jsonl")
        with open(path, "a") as timeline:
            timeline.write(json.dumps(record) + "\n")
