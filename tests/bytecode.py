"""nbddp's bytecode, compiled once before the run (a pytest plugin).

A run starts some 550 Python processes that import nbddp: warm helpers, kernels, cold ranks,
Ray and Slurm nodes, exported scripts. Where ``PYTHONDONTWRITEBYTECODE`` is set (this sandbox
sets it for every process), none of them writes nbddp's bytecode, so each compiles nbddp's
sources anew: 0.1-0.2 s of CPU a process, a minute or more of the suite's CPU. The controller
compiles them once, where Python keeps bytecode when it may write it (``__pycache__`` beside
each source, ignored by git); each process checks a file's bytecode against its source, as
always, so an edited module is compiled anew.

``PYTHONPYCACHEPREFIX`` would keep the tree untouched, but a process given it looks there for
every module's bytecode, torch's too: measured, an import of nbddp then took 3.0 s of CPU, not
1.4. Nothing is done where Python writes bytecode anyway, or where a prefix is set.
"""

from __future__ import annotations

import compileall
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nbddp"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled it
        return
    if sys.dont_write_bytecode and sys.pycache_prefix is None:
        compileall.compile_dir(PACKAGE, quiet=1)
