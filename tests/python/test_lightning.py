"""A real lightning.pytorch Trainer on the CPU with memoffload.lightning's
MemoffloadCallback: a 3-layer LightningModule, a few steps, a logger that
keeps every log_metrics call."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

import lightning.pytorch as pl  # noqa: E402 - pinned in scripts/requirements-test.txt: no skip
from lightning.pytorch.loggers import Logger

import memoffload.torch as mot
from conftest import assert_arena_empty, bit_equal
from memoffload.lightning import MemoffloadCallback
from memoffload.step_log import LOGGED_KEYS

BATCHES = 3  # per epoch
STEPS = 4  # so the second epoch stops after one step


class Stack(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self(batch).square().mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def batches(batch_size: int = 16) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(BATCHES * batch_size, 64, generator=gen)
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


class Capture(Logger):
    """Keeps every (step, metrics) a Trainer logs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: List[Tuple[Optional[int], Dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def fit(module: pl.LightningModule, callbacks: list, log_every_n_steps: int) -> Capture:
    logger = Capture()
    trainer = pl.Trainer(
        max_steps=STEPS,
        log_every_n_steps=log_every_n_steps,
        logger=logger,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=batches())
    return logger


def test_lightning_trainer_offloads_and_logs_differences(daemon, caplog):
    """Offload on, every weight bit-identical to the same run without the
    callback; the logged differences (at log_every_n_steps=1 and 3, the rest
    at train end) sum to the session's counters, so a second Trainer in the
    same process starts from zero; a summary line per epoch and at the end;
    the session is the job_id= passed."""
    off = mot.get_offloader(daemon.runtime_dir, "lightning-test")
    per_step: List[int] = []
    for every in (1, 3):
        module, ref = Stack(), Stack()
        callback = MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                                      job_id="lightning-test")
        before = off.stats()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="memoffload"):
            logger = fit(module, [callback], every)
        fit(ref, [], every)
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            assert bit_equal(p, q), name
        assert callback.handle is None  # removed at train end
        assert all("forward" not in layer.__dict__ for layer in module.layers)
        off.flush()
        after = off.stats()
        assert "lightning-test" in daemon.jobs()
        ours = [(step, m) for step, m in logger.rows if "memoffload/offloaded_bytes" in m]
        # log_every_n_steps=1: steps 0..3; =3: step 2, then the last step's rest at train end.
        assert [step for step, _ in ours] == ([0, 1, 2, 3] if every == 1 else [2, 4]), ours
        for _, m in ours:
            assert sorted(m) == sorted(LOGGED_KEYS), m
            assert m["memoffload/offloaded_bytes"] > 0 and m["memoffload/skipped_share"] == 0.0, m
            assert m["memoffload/arena_held_bytes"] == 0, m
            assert m["memoffload/arena_peak_bytes"] > 0, m
        for name in ("offloaded_bytes", "prefetched_bytes", "skipped_bytes", "blocking_rpcs"):
            logged = sum(m[f"memoffload/{name}"] for _, m in ours)
            assert logged == callback.totals[f"memoffload/{name}"], (name, ours, callback.totals)
        assert callback.totals["memoffload/offloaded_bytes"] == (
            after["offloaded_bytes"] - before["offloaded_bytes"])
        if every == 1:
            per_step = [m["memoffload/offloaded_bytes"] for _, m in ours]
            assert len(set(per_step)) == 1, per_step  # the same shapes every step
        else:  # the first entry covers steps 0..2 of this Trainer only
            assert ours[0][1]["memoffload/offloaded_bytes"] == 3 * per_step[0], (ours, per_step)
        lines = [r.getMessage() for r in caplog.records if r.name == "memoffload"]
        # Each summary line, with the rank prefix when the rank is known.
        summaries = [re.match(r"(?:(?:local )?rank \d+: )?(epoch \d+|training): ", m) for m in lines]
        assert [m.group(1) for m in summaries if m] == ["epoch 0", "epoch 1", "training"], lines
        assert any(f"training: {STEPS} steps, offloaded " in m for m in lines), lines
    assert_arena_empty(daemon, off)


def test_exception_in_training_restores_the_layers(daemon):
    """A training_step that raises: the callback's on_exception unwraps the
    layers and lets go of the handle."""

    class Failing(Stack):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    module = Failing()
    callback = MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir)
    try:
        fit(module, [callback], 1)
    except RuntimeError as exc:
        assert "boom" in str(exc)
    else:
        raise AssertionError("training did not raise")
    assert callback.handle is None
    assert all("forward" not in layer.__dict__ for layer in module.layers)
    assert_arena_empty(daemon)


def test_import_memoffload_does_not_import_lightning():
    code = (
        "import sys, memoffload, memoffload.torch, memoffload.hf\n"
        "assert 'lightning' not in sys.modules, 'imported by memoffload'\n"
        "from memoffload.lightning import MemoffloadCallback\n"
        "import lightning.pytorch as pl; assert issubclass(MemoffloadCallback, pl.Callback)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lightning_checkpoints_through_the_manager_logs_its_figures_and_resumes(daemon, tmp_path):
    options = {"job_id": f"pl-{tmp_path.name}", "runtime_dir": daemon.runtime_dir,
               "node_every": 1, "durable_every": 2, "durable_dir": str(tmp_path / "durable")}
    module = Stack()
    callback = MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                                  checkpoints=options)
    logger = fit(module, [callback], log_every_n_steps=1)
    assert callback.checkpoints.restored is None
    final = callback.checkpoints.final
    assert final["memoffload/ckpt_node_step"] == STEPS and final["memoffload/ckpt_persisted_step"] == STEPS
    assert any("memoffload/ckpt_node_step" in m for _, m in logger.rows), logger.rows
    trained = {n: p.detach().clone() for n, p in module.named_parameters()}
    again = MemoffloadCallback(min_tensor_bytes=0, runtime_dir=daemon.runtime_dir,
                               checkpoints=options)
    restored = Stack()
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    fit(restored, [again, Probe()], log_every_n_steps=1)
    assert again.checkpoints.restored == STEPS
    assert all(bit_equal(seen[n], trained[n]) for n in trained)
    assert again.checkpoints.final["memoffload/ckpt_node_step"] == 2 * STEPS
