"""A graceful stop through each library's own controls, with real ranks: the HF Trainer stops
at a step end (``control.should_training_stop``) and saves its own ``checkpoint-N``, which
``resume_from_checkpoint`` resumes; Lightning stops (``trainer.should_stop``) and saves the
checkpoint its Slurm requeue writes, which ``ckpt_path="hpc"`` resumes; Accelerate's prepared
data loader ends its loop, and ``nbddp.checkpoint`` saves the ``Accelerator`` with its own
``save_state``."""

from __future__ import annotations

import os
import time
import warnings

import pytest
from conftest import TWO_CPU_QUIET

import nbddp
from nbddp import NbddpWarning

pytestmark = [pytest.mark.ranks, pytest.mark.slow]


def stop_when_training(run: nbddp.Run, rows: int = 2, timeout: float = 120) -> object:
    """Stop ``run`` gracefully once it logged ``rows`` rows; its value (with the warning)."""
    deadline = time.monotonic() + timeout
    while len(run.history) < rows:
        assert not run.wait(0.05) and time.monotonic() < deadline, run.status
    run.stop(graceful=True, timeout=120)
    assert run.status == "stopped"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = run.result()
    assert any("stopped gracefully" in str(w.message) for w in caught if w.category is NbddpWarning)
    return value


def hf_trainer(output_dir: str, resume: bool) -> tuple[int, int]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

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
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {
                "input_ids": ids,
                "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": 1,
            }

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        num_train_epochs=100,  # 400 steps: the stop comes first
        logging_steps=1,
        report_to="none",
        save_strategy="no",  # only the graceful stop saves
        use_cpu=True,
    )
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Data())
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer.state.global_step, trainer.state.max_steps


def test_the_hf_trainer_stops_through_its_control_and_resumes_from_its_own_checkpoint(tmp_path):
    run = nbddp.notebook_launch(hf_trainer, (str(tmp_path), False), block=False, **TWO_CPU_QUIET)
    step, total = stop_when_training(run)
    assert 0 < step < total
    assert (tmp_path / f"checkpoint-{step}").is_dir()  # the Trainer's own save, at the stop
    again = nbddp.notebook_launch(hf_trainer, (str(tmp_path), True), block=False, **TWO_CPU_QUIET)
    deadline = time.monotonic() + 120
    while not any(row.get("step", 0) > step for row in again.history):  # it resumed past it
        assert not again.wait(0.05) and time.monotonic() < deadline, again.status
    resumed, _ = stop_when_training(again)
    assert resumed > step


def lightning(root: str, resume: bool) -> tuple[int, int, bool]:
    import lightning.pytorch as pl
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: tuple, index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_epochs=200,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        log_every_n_steps=1,
        default_root_dir=root,
        enable_progress_bar=False,
    )
    model = Model()
    trainer.fit(
        model, torch.utils.data.DataLoader(data, batch_size=16), ckpt_path="hpc" if resume else None
    )
    return trainer.global_step, trainer.max_epochs * 2, trainer.should_stop


def test_lightning_stops_through_should_stop_and_resumes_from_its_hpc_checkpoint(tmp_path):
    run = nbddp.notebook_launch(lightning, (str(tmp_path), False), block=False, **TWO_CPU_QUIET)
    step, total, should_stop = stop_when_training(run, rows=3)
    assert should_stop and 0 < step < total
    [saved] = [name for name in os.listdir(tmp_path) if name.startswith("hpc_ckpt_")]
    again = nbddp.notebook_launch(lightning, (str(tmp_path), True), block=False, **TWO_CPU_QUIET)
    resumed, _, _ = stop_when_training(again, rows=3)
    assert resumed > step, (saved, step, resumed)


def accelerate_loop(epochs: int) -> tuple[int | None, int, int]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    restored = nbddp.restore({"accelerator": accelerator, "progress": {}})
    batches = 0
    for _ in range(epochs):
        for x, y in loader:  # the prepared loader ends its loop at the agreed step
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
            nbddp.log(loss=loss)
            time.sleep(0.01)
        if nbddp.stopping():
            break
    if nbddp.stopping():
        nbddp.checkpoint(
            {"accelerator": accelerator, "progress": {"batches": batches}}, step=batches
        )
    return restored, batches, accelerator.step


def test_accelerates_loader_stops_and_its_state_is_saved_by_save_state(tmp_path):
    options = {**TWO_CPU_QUIET, "checkpoint_dir": tmp_path}
    run = nbddp.notebook_launch(accelerate_loop, (1000,), block=False, **options)
    restored, batches, _ = stop_when_training(run, rows=5)
    assert restored is None and batches >= 5
    saved = tmp_path / f"step-{batches}" / "accelerate-accelerator"
    assert (saved / "model.safetensors").exists() or any(saved.iterdir())
    again = nbddp.notebook_launch(accelerate_loop, (0,), **options)
    assert again[0] == batches  # restore loaded it (load_state), and said which step
