"""Unchanged library code, and the panel shows what the library knows: tqdm bars become panel
bars, the HF Trainer's, Lightning's and Accelerate's metrics fill run.history, the notebook's
logging setup reaches the ranks."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile

import pytest
from conftest import TWO_CPU_QUIET

import nbddp


def launch(fn, *args, **options):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        value = nbddp.notebook_launch(fn, args, **{**TWO_CPU_QUIET, **options})
    run = nbddp.last_run()
    return value, out.getvalue(), run.history, run._state.snapshot().bars


def tqdm_loops() -> int:
    import time

    from tqdm.auto import tqdm, trange

    for _ in trange(2, desc="outer"):
        for _ in tqdm(range(150), desc="inner", mininterval=0):  # 300 refreshes in all
            time.sleep(0.001)
    print("the user's own line", flush=True)
    return nbddp.rank()


@pytest.mark.ranks
@pytest.mark.parametrize("output", ["rank0", "all"])
def test_tqdm_bars_become_panel_bars_and_leave_no_text(output):
    value, text, _, bars = launch(tqdm_loops, output=output)
    assert value == 0
    assert [(b.desc, b.n, b.total, b.level) for b in bars] == [("outer", 2, 2, 0)]
    if output == "rank0":
        assert text == "the user's own line\n"  # no bar text at all
    else:  # rank 1's bars stay text, and each redraw keeps its prefix
        assert "[rank 0] the user's own line\n" in text and "[rank 1] the user's own" in text
        assert "[rank 0] inner" not in text and "[rank 1] inner:" in text
        assert "\r[rank 1] inner:" in text


def panel_counts_while_updating() -> list[int]:
    from tqdm import tqdm

    bar = tqdm(total=10, mininterval=0)
    seen = []
    for _ in range(3):
        bar.update(2)  # tqdm redraws (mininterval=0): the panel's bar follows
        seen.append(bar._nbddp_bar.n if nbddp.rank() == 0 else 0)  # rank 0's bar is shown
    bar.close()
    return seen


@pytest.mark.ranks
def test_a_tqdm_bar_updated_by_hand_is_followed_between_updates():
    assert launch(panel_counts_while_updating)[0] == [2, 4, 6]


def logs_through_logging() -> None:
    logging.getLogger("training").info("an info line from rank %d", nbddp.rank())
    logging.getLogger("training").debug("not shown at INFO")


@pytest.mark.ranks
def test_the_notebooks_logging_setup_reaches_the_ranks():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(levelname)s|%(name)s|%(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        _, text, _, _ = launch(logs_through_logging)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    assert text == "INFO|training|an info line from rank 0\n"


def hf_trainer(output_dir: str) -> int:
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainingArguments,
    )

    config = BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 128

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {
                "input_ids": ids,
                "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": int(ids[0] % 2),
            }

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        num_train_epochs=2,
        logging_steps=2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Data())
    trainer.train()
    return trainer.state.global_step


@pytest.mark.ranks
@pytest.mark.smoke
@pytest.mark.slow
def test_an_hf_trainer_fills_history_and_shows_its_bar_in_the_panel():
    with tempfile.TemporaryDirectory() as output_dir:
        steps, _, history, bars = launch(hf_trainer, output_dir)
    assert steps == 16
    losses = [row for row in history if "loss" in row]
    assert len(losses) == 8 and {"learning_rate", "grad_norm", "epoch"} <= set(losses[0])
    assert [(b.n, b.total) for b in bars] == [(16, 16)]


def lightning_trainer(root: str, logger: bool = True) -> list[str]:
    import lightning.pytorch as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: tuple, index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y) + nbddp.rank()
            self.log("train_loss", loss)
            self.log("shown_loss", loss, prog_bar=True)  # what Lightning's bar shows
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        log_every_n_steps=2,
        default_root_dir=root,
        enable_checkpointing=False,
        logger=logger,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
    return [type(each).__name__ for each in trainer.loggers]


@pytest.mark.ranks
@pytest.mark.smoke
@pytest.mark.slow
def test_a_lightning_trainer_fills_history_averaged_across_ranks():
    with tempfile.TemporaryDirectory() as root:
        loggers, _, history, bars = launch(lightning_trainer, root)
    assert loggers[-1] == "NbddpLogger" and loggers[0] != "NbddpLogger"
    rows = [row for row in history if "train_loss" in row]
    assert len(rows) == 8
    # rank 1's loss is rank 0's + 1 (different data aside): the average sits between them
    assert all(row["train_loss"] > 0.5 for row in rows)
    assert bars and bars[0].desc.startswith("Epoch") and bars[0].n == bars[0].total == 8


@pytest.mark.ranks
@pytest.mark.slow
def test_lightning_with_logger_false_fills_history_as_a_logger_would_be_filled():
    """No logger is added (it would move the checkpoint directory): what Lightning hands its
    loggers reaches the panel all the same, every ``self.log`` value (not only the bar's),
    at the logger's steps, averaged across the ranks."""
    with tempfile.TemporaryDirectory() as root:
        loggers, _, history, bars = launch(lightning_trainer, root, False)
    assert loggers == []
    rows = [row for row in history if "train_loss" in row]
    assert len(rows) == 8  # 2 epochs x 8 batches, logged every 2 steps: as with a logger
    assert all({"train_loss", "shown_loss", "epoch"} <= set(row) for row in rows)
    assert all(row["train_loss"] > 0.5 for row in rows)  # rank 1's is rank 0's + 1
    assert bars and bars[0].n == bars[0].total == 8


def lightning_default_trainer(root: str) -> str:
    import lightning.pytorch as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: tuple, index: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(nbddp.rank())
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(max_epochs=1, default_root_dir=root, logger=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
    return type(trainer.strategy).__name__


@pytest.mark.ranks
@pytest.mark.slow
def test_a_lightning_trainer_of_one_device_per_rank_is_named_by_the_verdict():
    with tempfile.TemporaryDirectory() as root, pytest.warns(nbddp.NbddpWarning):
        strategy, *_ = launch(lightning_default_trainer, root)
    assert strategy == "SingleDeviceStrategy"
    warning = nbddp.last_run().warning
    assert "Lightning's Trainer ran each rank as a job of one device" in warning
    assert "Trainer(accelerator='cpu', devices=2, strategy='ddp')" in warning
    assert "prepare_model" not in warning


def accelerate_tracker(init_trackers: bool) -> int:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if init_trackers:  # it starts every tracker, and a new list in older Accelerate versions
        accelerator.init_trackers("run")
    for step in range(4):
        accelerator.log({"loss": 1.0 / (step + 1), "note": "text"}, step=10 * step)
    return accelerator.num_processes


@pytest.mark.ranks
@pytest.mark.parametrize("init_trackers", [False, True])
def test_accelerate_logs_reach_history_as_rank_0_logs_them(init_trackers):
    processes, _, history, _ = launch(accelerate_tracker, init_trackers)
    assert processes == 2
    assert history == [{"step": 10 * s, "loss": 1.0 / (s + 1)} for s in range(4)]


# Accelerate's quicktour, as it is written: Accelerator() with no cpu=True. On CPU ranks
# Accelerate sees the job only when told (ACCELERATE_USE_CPU, as accelerate launch --cpu and
# its debug_launcher set it); otherwise each rank trains alone. Each rank starts from its own
# random model: one DDP job makes them equal (rank 0's parameters are broadcast).
QUICKTOUR = """
import torch
from accelerate import Accelerator

def quicktour():
    accelerator = Accelerator()
    torch.manual_seed(nbddp.rank())
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
    weight = accelerator.unwrap_model(model).weight.detach().clone()
    return accelerator.num_processes, str(accelerator.distributed_type), weight

def quicktour_on_ranks(**options):
    per_rank = nbddp.notebook_launch(
        quicktour, num_workers=2, device="cpu", display="none", return_all=True, **options
    )
    same = torch.equal(per_rank[0][2], per_rank[1][2])
    return [p[:2] for p in per_rank], same, nbddp.last_run().warning
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_accelerator_as_its_quicktour_writes_it_sees_the_cpu_ranks_as_one_job(kernel):
    out, reply = kernel.run(QUICKTOUR + "print('one job:', quicktour_on_ranks())")
    assert reply["status"] == "ok", out
    assert "one job: ([(2, 'DistributedType.MULTI_CPU'), (2, 'DistributedType.MULTI_CPU')], " in out
    assert "True, None)" in out, out  # the same model on both ranks, and no verdict


@pytest.mark.e2e
@pytest.mark.slow
def test_accelerate_running_each_rank_alone_is_named_by_the_verdict(kernel):
    out, reply = kernel.run(
        QUICKTOUR
        + "import warnings\n"
        + "with warnings.catch_warnings():\n"
        + "    warnings.simplefilter('ignore')\n"
        + "    print('alone:', quicktour_on_ranks(env={'ACCELERATE_USE_CPU': 'false'}))"
    )
    assert reply["status"] == "ok", out
    assert "alone: ([(1, 'DistributedType.NO'), (1, 'DistributedType.NO')], False, " in out
    assert "Accelerate ran each rank as a process of its own" in out, out
    assert "prepare_model" not in out


# Lightning's own README example, with logger=False: self.log("train_loss", loss) has no
# prog_bar=True, so it is on no progress bar; run.history gets it all the same.
LIGHTNING_README = """
import tempfile
import lightning as L

class LitAutoEncoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.ReLU())
        self.decoder = torch.nn.Sequential(torch.nn.Linear(4, 16))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x_hat = self.decoder(self.encoder(x))
        loss = torch.nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

def fit(root):
    data = torch.utils.data.TensorDataset(torch.randn(320, 16), torch.zeros(320))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, log_every_n_steps=1,
        logger=False, enable_checkpointing=False, default_root_dir=root,
    )
    trainer.fit(LitAutoEncoder(), torch.utils.data.DataLoader(data, batch_size=16))
    return trainer.global_step

with tempfile.TemporaryDirectory() as root:
    steps = nbddp.notebook_launch(fit, (root,), num_workers=2, device="cpu", display="none")
history = nbddp.last_run().history
print("logged:", steps, len([row for row in history if "train_loss" in row]))
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_lightning_logger_false_self_log_fills_run_history_in_a_notebook(kernel):
    out, reply = kernel.run(LIGHTNING_README, timeout=240)
    assert reply["status"] == "ok", out
    assert "logged: 10 10" in out, out  # 320 rows / 2 ranks / 16 a batch: a row per step
