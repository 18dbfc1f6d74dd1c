"""``nbddp.run_script`` with real ranks and real scripts: a script runs as ``__main__`` with its
``sys.argv``, the torchrun environment, the kernel's working directory and its own
``init_process_group`` and ``logging``; its exit code and traceback (in its own lines) reach the
kernel; edits between runs are seen; Stop, a graceful stop, the roll-call and ``nbddp.log``
work; the PyTorch examples' ``multigpu_torchrun.py`` resumes from its snapshot after a
``max_restarts`` restart; Accelerate's own ``test_script`` passes as a module."""

from __future__ import annotations

import json
import logging
import os
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import nbddp
from nbddp import NbddpWarning, WorkerError

pytestmark = pytest.mark.ranks
TWO = {"num_workers": 2, "device": "cpu", "display": "none"}
TUTORIAL = Path(__file__).parent / "_scripts" / "ddp_tutorial_series" / "multigpu_torchrun.py"

FACTS = """\
import json, logging, os, sys
import torch
import torch.distributed as dist
from torch.distributed import init_process_group
import beside  # a module next to the script

logging.basicConfig(level=logging.INFO, format="LOGGED %(message)s")


def main(out):
    init_process_group(backend="gloo")  # answered with nbddp's group
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    logging.info("rank %d logs", dist.get_rank())
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    facts = {
        "name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(),
        "path0": sys.path[0], "pid": os.getpid(), "sum": total.item(), "beside": beside.VALUE,
        "env": {k: os.environ[k] for k in names},
    }
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(facts, f)
    print(f"rank {dist.get_rank()} is done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    main(parser.parse_args().out)
"""

EXITS = """\
import argparse, sys
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=-1)
parser.add_argument("--how", choices=["exit", "raise", "say"], default="exit")
parser.add_argument("--code", type=int, default=0)
args = parser.parse_args()
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == args.rank:
    if args.how == "exit":
        sys.exit(args.code)
    if args.how == "raise":
        raise ValueError("this rank gives up")
    sys.exit("bad config")
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture
def notebook_logging():
    """The notebook configured logging (a rank copies it for a function, never a script)."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("NOTEBOOK %(message)s"))
    level, handlers = root.level, root.handlers[:]
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_script_runs_as_main_with_its_argv_environment_and_the_kernels_directory(
    tmp_path, monkeypatch, capfd, notebook_logging
):
    script = write(tmp_path / "proj" / "train.py", FACTS)
    write(tmp_path / "proj" / "beside.py", "VALUE = 'beside'\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    out = str(tmp_path / "facts")
    assert nbddp.run_script("../proj/train.py", ["--out", out], **TWO) == 0
    printed = "".join(capfd.readouterr())
    facts = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank, seen in enumerate(facts):
        assert seen["name"] == "__main__" and seen["file"] == str(script)
        assert seen["argv"] == ["../proj/train.py", "--out", out]  # as given, as python does
        assert seen["cwd"] == str(tmp_path / "work")  # the kernel's, not the script's
        assert seen["path0"] == str(script.parent)  # imports beside the script work
        assert seen["beside"] == "beside" and seen["sum"] == 3.0
        assert seen["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert seen["pid"] != os.getpid()
    assert "rank 0 is done" in printed and "rank 1 is done" not in printed  # rank 0's output
    assert "LOGGED rank 0 logs" in printed  # the script's own basicConfig took effect
    assert "NOTEBOOK" not in printed


def test_one_worker_runs_the_script_in_a_process_of_its_own(tmp_path, capfd):
    script = write(
        tmp_path / "alone.py",
        """\
        import os, sys
        print("pid", os.getpid(), "world", os.environ["WORLD_SIZE"], flush=True)
        sys.exit(0)
        """,
    )
    assert nbddp.run_script(script, num_workers=1, device="cpu", display="none") == 0
    printed = capfd.readouterr().out
    assert "world 1" in printed and f"pid {os.getpid()} " not in printed


@pytest.mark.parametrize(
    ("argv", "rank", "exitcode", "line", "head"),
    [
        (["--rank", "1", "--code", "3"], 1, 3, "sys.exit(args.code)", "exited with code 3"),
        (["--rank", "0", "--how", "raise"], 0, 1, "raise ValueError", "raised ValueError"),
        (["--rank", "1", "--how", "say"], 1, 1, 'sys.exit("bad config")', "sys.exit('bad conf"),
    ],
    ids=["sys.exit(3)", "an exception", "sys.exit(message)"],
)
def test_a_failing_script_raises_with_its_rank_exit_code_and_own_lines(
    tmp_path, argv, rank, exitcode, line, head
):
    script = write(tmp_path / "exits.py", EXITS)
    with pytest.raises(WorkerError) as info:
        nbddp.run_script(script, argv, **TWO)
    error = info.value
    assert (error.rank, error.exitcode) == (rank, exitcode)
    assert head in str(error).splitlines()[0]
    trace = error.remote_traceback
    assert f'File "{script}", line {line_of(script, line)}, in <module>' in trace
    assert line in trace and "<string>" not in trace and "nbddp" not in trace
    if exitcode == 1 and "raise" in line:
        assert isinstance(error, ValueError)  # ``except ValueError`` catches it, as for fn


def test_exit_zero_on_a_rank_and_an_argparse_error(tmp_path, capfd):
    script = write(tmp_path / "exits.py", EXITS)
    assert nbddp.run_script(script, ["--rank", "1", "--code", "0"], **TWO) == 0
    with pytest.raises(WorkerError) as info:
        nbddp.run_script(script, ["--how", "nope"], **TWO)
    assert info.value.exitcode == 2  # argparse's
    assert "invalid choice: 'nope'" in capfd.readouterr().err  # rank 0's usage message


def test_a_module_runs_as_python_m_runs_it(tmp_path, monkeypatch):
    write(tmp_path / "mypkg" / "__init__.py", "IMPORTED = True\n")
    write(
        tmp_path / "mypkg" / "train.py",
        """\
        import json, os, sys
        from . import IMPORTED
        out = sys.argv[1]
        with open(out + os.environ["RANK"], "w") as f:
            json.dump([__name__, __package__, __spec__.name, sys.argv, sys.path[0]], f)
        """,
    )
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "seen")
    assert nbddp.run_script("mypkg.train", [out], module=True, **TWO) == 0
    name, package, spec, argv, first = json.loads(Path(out + "1").read_text())
    assert (name, package, spec) == ("__main__", "mypkg", "mypkg.train")
    assert argv == [str(tmp_path / "mypkg" / "train.py"), out]  # python -m: the file's path
    assert first == str(tmp_path)  # the working directory, first


def test_each_run_sees_the_script_and_the_modules_beside_it_as_they_are_now(tmp_path, capfd):
    script = write(
        tmp_path / "edited.py",
        "import beside\nprint('run', beside.VALUE, flush=True)\n",
    )
    write(tmp_path / "beside.py", "VALUE = 'first'\n")
    assert nbddp.run_script(script, **TWO) == 0
    assert "run first" in capfd.readouterr().out
    # the helper now holds ``beside`` (the ranks reported it); an edit, a new module
    write(tmp_path / "beside.py", "VALUE = 'second, edited'\n")
    write(tmp_path / "added.py", "VALUE = 'added'\n")
    write(script, "import beside, added\nprint('run', beside.VALUE, added.VALUE, flush=True)\n")
    assert nbddp.run_script(script, **TWO) == 0
    assert "run second, edited added" in capfd.readouterr().out


LOOPS = """\
import os, signal, sys, time
import nbddp

ready, seen = sys.argv[1], sys.argv[2]


def on_sigterm(signum, frame):  # what a torchrun script does to save on its way out
    open(seen + os.environ["RANK"], "w").close()
    sys.exit(143)


signal.signal(signal.SIGTERM, on_sigterm)
checks = len(sys.argv) > 3
for step in range(10**6):
    if checks and nbddp.stopping():
        print("stopped at", step, flush=True)
        break
    nbddp.log(step=float(step))
    if step == 5:
        open(ready + os.environ["RANK"], "w").close()
    time.sleep(0.01)
"""


def test_a_script_that_checks_stops_gracefully_and_logs_its_rows(tmp_path):
    script = write(tmp_path / "loops.py", LOOPS)
    argv = [str(tmp_path / "r"), str(tmp_path / "t"), "--checks"]
    run = nbddp.run_script(script, argv, block=False, **TWO)
    wait_for(tmp_path / "r1", run)
    while len(run.history) < 5:
        time.sleep(0.02)
    assert run.stop(graceful=True) and run.status == "stopped"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run.result() == 0
    assert any(issubclass(w.category, NbddpWarning) for w in caught)
    assert [row["step"] for row in run.history[:3]] == [0.0, 1.0, 2.0]
    assert not list(tmp_path.glob("t*"))  # no SIGTERM: it stopped by itself


def test_stop_sends_a_script_that_never_checks_torchruns_sigterm_and_the_roll_call_names_its_line(
    tmp_path,
):
    script = write(tmp_path / "loops.py", LOOPS)
    run = nbddp.run_script(script, [str(tmp_path / "r"), str(tmp_path / "t")], block=False, **TWO)
    wait_for(tmp_path / "r0", run)
    wait_for(tmp_path / "r1", run)
    try:
        where = str(run.stacks())
    finally:
        assert run.stop() and run.status == "stopped"
    assert f"{script}:{line_of(script, 'time.sleep(0.01)')} in <module>" in where, where
    assert sorted(p.name for p in tmp_path.glob("t*")) == ["t0", "t1"]  # its handler ran


def wait_for(path: Path, run: nbddp.Run, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert not run.wait(0.02) and time.monotonic() < deadline, run.status


@pytest.mark.slow
def test_the_pytorch_tutorials_script_resumes_from_its_snapshot_after_a_restart(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.chdir(tmp_path)  # its snapshot.pt goes to the working directory
    failed = tmp_path / "failed-once"
    assert (
        nbddp.run_script(
            TUTORIAL,
            ["4", "1", "--batch_size", "64"],  # 4 epochs, a snapshot after each
            max_restarts=1,
            env={"FAIL_ONCE": str(failed)},
            **TWO,
        )
        == 0
    )
    printed = capfd.readouterr().out
    assert failed.exists()
    (_, cause), *more = nbddp.last_run().restarts
    assert not more and cause.rank == 1 and "fails once" in str(cause)
    assert "Resuming training from snapshot at Epoch 1" in printed  # after the restart
    assert printed.count("[GPU0] Epoch 3") == 1
    assert torch.load(tmp_path / "snapshot.pt")["EPOCHS_RUN"] == 3


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_accelerates_own_test_script_passes_as_a_module(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    module = "accelerate.test_utils.scripts.test_script"
    env = {"ACCELERATE_USE_CPU": "1"}
    assert nbddp.run_script(module, module=True, env=env, **TWO) == 0
    printed = capfd.readouterr().out
    for part in ("**Training integration test**", "**Test reinstantiated state**"):
        assert part in printed


LIGHTNING = """\
import argparse
import lightning.pytorch as pl
import torch


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = pl.Trainer(max_epochs=10_000, accelerator="cpu", devices=2, strategy="ddp",
                         log_every_n_steps=2, default_root_dir=args.root,
                         enable_checkpointing=False, logger=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
    print("fit returned at epoch", trainer.current_epoch, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lightning_script_fills_the_panel_and_stops_gracefully_through_its_trainer(
    tmp_path, capfd
):
    script = write(tmp_path / "fit.py", LIGHTNING)
    run = nbddp.run_script(script, ["--root", str(tmp_path)], block=False, **TWO)
    deadline = time.monotonic() + 240
    while len([row for row in run.history if "train_loss" in row]) < 4:
        assert not run.wait(0.05) and time.monotonic() < deadline, run.status
    bars = run._state.snapshot().bars  # Lightning's tqdm bar, as a panel bar
    assert bars and bars[0].desc.startswith("Epoch")
    assert run.stop(graceful=True) and run.status == "stopped"
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert run.result() == 0
    assert "fit returned at epoch" in capfd.readouterr().out  # the trainer's own stop


def imports_beside() -> str:
    import beside

    return beside.VALUE


def test_a_script_teaches_the_warm_helper_nothing_of_its_own_directory(tmp_path, monkeypatch):
    """A rank tells the helper what it imported, for the next launch: a script's modules and
    its directory must not be among them, or the notebook's own ``beside`` would be shadowed."""
    script = write(tmp_path / "proj" / "uses.py", "import beside\nprint(beside.VALUE)\n")
    write(tmp_path / "proj" / "beside.py", "VALUE = 'the script\\'s'\n")
    write(tmp_path / "notebook" / "beside.py", "VALUE = 'the notebook\\'s'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "notebook"))
    for _ in range(3):  # the helper imports between launches what the last one's ranks used
        assert nbddp.run_script(script, **TWO) == 0
        time.sleep(0.5)
    assert nbddp.notebook_launch(imports_beside, **TWO) == "the notebook's"


def test_the_verdict_says_when_a_scripts_ranks_trained_apart(tmp_path):
    script = write(
        tmp_path / "apart.py",
        """\
        import torch
        model = torch.nn.Linear(4, 1)  # never wrapped in DDP: each rank trains its own
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        """,
    )
    with pytest.warns(NbddpWarning, match="ranks trained independently"):
        assert nbddp.run_script(script, **TWO) == 0


@pytest.mark.slow
def test_a_scripts_own_classes_reach_its_spawned_dataloader_workers(tmp_path, capfd):
    """A spawned worker imports the script as ``__mp_main__`` from its ``__file__``, as under
    torchrun, and finds the script's ``Dataset`` there."""
    script = write(
        tmp_path / "loads.py",
        """\
        import torch
        from torch.utils.data import DataLoader, Dataset


        class Squares(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.tensor(float(i * i))


        if __name__ == "__main__":
            loader = DataLoader(Squares(), batch_size=2, num_workers=1,
                                multiprocessing_context="spawn")
            print("batches", [b.tolist() for b in loader], flush=True)
        """,
    )
    assert nbddp.run_script(script, **TWO) == 0
    assert "batches [[0.0, 1.0], [4.0, 9.0]]" in capfd.readouterr().out
