"""A launcher started inside a rank (mp.spawn, start_processes, torch elastic's launcher) is a
clear error naming its caller, before any process starts; nothing is left running (the suite's
autouse fixture checks)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import textwrap

import pytest
from conftest import TWO_CPU_QUIET

import nbddp

pytestmark = pytest.mark.ranks


def launch(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        return nbddp.notebook_launch(fn, args, **TWO_CPU_QUIET)


def _work(index: int) -> None:
    pass


def spawns(how: str) -> None:
    import torch.multiprocessing as mp

    if how == "spawn":
        mp.spawn(_work, nprocs=2)
    elif how == "start_processes":
        mp.start_processes(_work, nprocs=2, start_method="fork")
    else:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="nested")
        elastic_launch(config, _work)(0)


@pytest.mark.parametrize(
    ("how", "what"),
    [
        ("spawn", "torch.multiprocessing.spawn"),
        ("start_processes", "torch.multiprocessing.start_processes"),
        ("elastic", "torch elastic's launcher"),
    ],
)
def test_a_launcher_in_a_rank_is_an_error_naming_the_caller(how, what):
    with pytest.raises(nbddp.WorkerError) as caught:
        launch(spawns, how)
    message = str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert f"started {what} inside an nbddp rank" in message
    assert "test_nested_launch.py, line" in message and "in spawns" in message  # the caller
    assert "nbddp already runs one process per GPU" in message and "ddp=False" in message


def test_a_library_is_named_by_its_package(tmp_path, monkeypatch):
    package = tmp_path / "fancylib"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import torch.multiprocessing as mp

            def _worker(i):
                pass

            def fit(ddp=True):
                if ddp:
                    mp.spawn(_worker, nprocs=2)
                return "trained"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks adopt the notebook's sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))

    def train() -> str:
        import fancylib

        return fancylib.fit()

    named = r"fancylib \(fancylib: __init__.py, line 9, in fit"
    with pytest.raises(nbddp.WorkerError, match=named):
        launch(train)


def test_mp_spawn_outside_any_process_group_still_works():
    def alone() -> bool:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        dist.barrier()  # both ranks are connected before either tears its group down
        dist.destroy_process_group()  # the rank's group is gone: a launcher competes with none
        mp.start_processes(_work, nprocs=1, start_method="fork")
        return True

    assert launch(alone) is True
