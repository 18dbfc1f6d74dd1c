"""``nbddp.checkpoint`` / ``nbddp.restore`` with real ranks: a resumed run ends with the
parameters of an uninterrupted one, a save cut short by a kill is never loaded, FSDP2 shards
save and load (into another world too), and what cannot be saved is said before anything is."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TWO_CPU_QUIET

import nbddp
from nbddp.errors import WorkerError
from nbddp.worker.recovery.checkpoints import COMPLETE, PARTIAL, complete_checkpoints


def train(until: int, resume: bool) -> dict[str, torch.Tensor]:
    """Deterministic DDP training on the CPU: step k's batch depends on k only."""
    torch.manual_seed(0)
    model = nbddp.prepare_model(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    progress = {"losses": []}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "log": progress}
    start = (nbddp.restore(state) or 0) if resume else 0
    for step in range(start, until):
        batch = torch.Generator().manual_seed(step * 10 + nbddp.rank())
        x = torch.randn(16, 6, generator=batch)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        progress["losses"] = [*progress["losses"], round(loss.item(), 6)]
        nbddp.checkpoint(state, step=step + 1)
    return {**nbddp.unwrap(model).state_dict(), "losses": torch.tensor(progress["losses"])}


@pytest.mark.ranks
def test_a_resumed_run_ends_with_the_parameters_of_an_uninterrupted_one(tmp_path):
    whole = nbddp.notebook_launch(
        train, (9, False), checkpoint_dir=tmp_path / "whole", **TWO_CPU_QUIET
    )
    first = nbddp.notebook_launch(
        train, (4, True), checkpoint_dir=tmp_path / "cut", **TWO_CPU_QUIET
    )
    assert len(first["losses"]) == 4
    resumed = nbddp.notebook_launch(
        train, (9, True), checkpoint_dir=tmp_path / "cut", **TWO_CPU_QUIET
    )
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name  # bit for bit, losses included
    kept = [os.path.basename(p) for _, _, p, _ in complete_checkpoints(str(tmp_path / "cut"))]
    assert kept == ["step-8", "step-9"]  # keep=2
    assert sorted(os.listdir(tmp_path / "cut")) == ["step-8", "step-9"]


@pytest.mark.ranks
def test_keep_and_the_default_directory_named_after_the_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nbddp.notebook_launch(train, (5, True), keep=3, **TWO_CPU_QUIET)
    where = tmp_path / "nbddp-checkpoints" / "train"
    assert sorted(os.listdir(where)) == ["step-3", "step-4", "step-5"]
    # the next launch of the same function finds them: nothing left to train
    assert len(nbddp.notebook_launch(train, (5, True), **TWO_CPU_QUIET)["losses"]) == 5


def save_until_killed(delay: float) -> None:
    """Saves a state whose every tensor holds its step, again and again, until a timer kills
    one rank ``delay`` seconds after the first save (SIGKILL: no cleanup of any kind)."""
    import signal
    import threading

    state = {"weights": {f"w{i}": torch.zeros(200_000) for i in range(4)}, "meta": {"step": 0}}
    for step in range(1, 10_000):
        for tensor in state["weights"].values():
            tensor.fill_(float(step))
        state["meta"]["step"] = step
        nbddp.checkpoint(state, step=step)
        if step == 1 and nbddp.rank() == int(delay * 100) % 2:  # saves go on back to back
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()


def restored() -> tuple[int | None, list[float], int]:
    state = {"weights": {f"w{i}": torch.full((200_000,), -1.0) for i in range(4)}, "meta": {}}
    step = nbddp.restore(state)
    values = sorted({float(v) for t in state["weights"].values() for v in t.unique()})
    return step, values, state["meta"].get("step", -1)


@pytest.mark.ranks
def test_a_save_cut_short_by_a_kill_is_never_loaded(tmp_path):
    options = {**TWO_CPU_QUIET, "checkpoint_dir": tmp_path}
    cut_short = 0
    for delay in (0.05, 0.12, 0.21, 0.33, 0.48, 0.61):
        with pytest.raises(WorkerError, match="SIGKILL"):
            nbddp.notebook_launch(save_until_killed, (delay,), **options)
        names = os.listdir(tmp_path)
        cut_short += any(n.startswith(PARTIAL) for n in names)
        for name in names:  # a complete one is whole; a partial one is never complete
            if name.startswith("step-"):
                assert os.path.exists(tmp_path / name / COMPLETE)
        step, values, meta = nbddp.notebook_launch(restored, **options)
        complete = complete_checkpoints(str(tmp_path))
        assert step == complete[-1][1] and values == [float(step)] and meta == step
    assert cut_short >= 2, "the kills never landed in a save: the test shows nothing"


def fsdp_train(steps: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": optimizer}
    start = nbddp.restore(state) or 0
    for step in range(start, steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step + nbddp.rank()))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    nbddp.checkpoint(state, step=steps)
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def plain_restore() -> dict[str, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    assert nbddp.restore({"model": model}) == 6
    return dict(model.named_parameters())


@pytest.mark.ranks
def test_fsdp2_shards_save_and_restore_into_the_same_or_another_world(tmp_path):
    options = {**TWO_CPU_QUIET, "checkpoint_dir": tmp_path}
    whole = nbddp.notebook_launch(fsdp_train, (6,), **{**options, "checkpoint_dir": tmp_path / "w"})
    nbddp.notebook_launch(fsdp_train, (3,), **options)
    resumed = nbddp.notebook_launch(fsdp_train, (6,), **options)
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name
    # sharded on two ranks, loaded whole by one (in the kernel), and by three ranks
    in_kernel = nbddp.notebook_launch(plain_restore, **{**options, "num_workers": 1})
    three = nbddp.notebook_launch(plain_restore, **{**options, "num_workers": 3})
    for name in whole:
        assert torch.equal(in_kernel[name], whole[name]) and torch.equal(three[name], whole[name])


def optimizer_alone() -> None:
    model = torch.nn.Linear(2, 2)
    nbddp.checkpoint({"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}, step=1)


def not_in_place() -> None:
    nbddp.restore({"model": torch.nn.Linear(2, 2), "epoch": 3})


def missing_name(tmp: str) -> None:
    nbddp.checkpoint({"model": torch.nn.Linear(2, 2)}, step=1)
    nbddp.restore({"model": torch.nn.Linear(2, 2), "scheduler": {"x": 1}})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (optimizer_alone, "its model is not in the state"),
        (not_in_place, r"state\['epoch'\] is int, which cannot be loaded back in place"),
        (missing_name, r"has no 'scheduler': it holds 'model'"),
    ],
)
def test_what_cannot_be_saved_or_restored_is_said(tmp_path, fn, message):
    args = (str(tmp_path),) if fn is missing_name else ()
    with pytest.raises(ValueError, match=message):
        nbddp.notebook_launch(fn, args, num_workers=1, device="cpu", checkpoint_dir=tmp_path)


class Killed(BaseException):
    """SIGKILL, as far as the code under test can tell: it stops where it is."""


@pytest.mark.unit
def test_a_kill_while_an_old_checkpoint_is_pruned_leaves_no_step_missing_files(
    tmp_path, monkeypatch
):
    """A kill that lands while rank 0 deletes a checkpoint past ``keep`` (the kill test above
    found ``step-2`` without its ``nbddp.json`` under load): the old one leaves its ``step-N``
    name before any file of it goes, so every ``step-N`` left is whole."""
    import json
    import shutil

    from nbddp.worker.recovery import checkpoints

    old = tmp_path / "step-1"
    old.mkdir()
    (old / "__0_0.distcp").write_bytes(b"shard")
    (old / COMPLETE).write_text(json.dumps({"step": 1, "saved": 1.0, "names": ["model"]}))
    partial = tmp_path / f"{PARTIAL}run-1-step-2"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"shard")

    def killed_midway(path, ignore_errors=False):
        os.remove(os.path.join(path, COMPLETE))  # rmtree got this far
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    previous = checkpoints.configure(str(tmp_path), keep=1)
    try:
        with pytest.raises(Killed):
            checkpoints._complete(str(tmp_path), str(partial), str(tmp_path / "step-2"), 2, [])
    finally:
        checkpoints.configure(*previous)
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-2"]
    assert all((tmp_path / name / COMPLETE).exists() for name in steps)
    assert [c[1] for c in complete_checkpoints(str(tmp_path))] == [2]
