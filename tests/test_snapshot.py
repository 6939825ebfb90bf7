"""callbacks/snapshot.py: a CPU memory timeline of the chosen step, and CUDA allocator snapshots (gpu)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from callbacks.measure import MeasureCallback
from callbacks.snapshot import MemorySnapshot
from trainer.core.module import DecoderModule

MICRO = dict(family="gpt", block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1, attention="eager")


class _Batches(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 64, (n, 4, 32), generator=g)
        self.y = torch.randint(0, 64, (n, 4, 32), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def fit(callbacks: list[L.Callback], steps: int = 4, accelerator: str = "cpu", accum: int = 1) -> DecoderModule:
    L.seed_everything(0, verbose=False)
    module = DecoderModule(MICRO, "full", max_steps=steps, vocab_size=64)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accum,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(_Batches(steps * accum), batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    return module


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "snapshots skipped" in r.getMessage()]


def test_cpu_timeline_of_the_chosen_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="callbacks.snapshot")
    snap = MemorySnapshot(at_step=2, on_oom=True, out_dir=tmp_path)
    fit([snap], accum=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory_timeline_step2.json", "memory_timeline_step2.png"]
    data = json.loads((tmp_path / "memory_timeline_step2.json").read_text())
    phases = [p["phase"] for p in data["points"]]
    # Two micro-batches: forward, backward, forward, backward, then clipping + AdamW. (Lightning's bookkeeping
    # between backward and the optimizer, e.g. detaching the loss, runs outside autograd: marked forward.)
    runs = [ph for i, ph in enumerate(phases) if i == 0 or ph != phases[i - 1]]
    assert runs[:4] == ["forward", "backward", "forward", "backward"] and runs[-1] == "optimizer", runs
    assert runs.count("backward") == 2 and runs.count("optimizer") == 1, runs
    assert data["phases"]["forward"] > 0 and data["phases"]["backward"] > 0 and data["phases"]["optimizer"] > 0
    assert data["num_ops"] == len(data["points"]) and data["step"] == 2
    # The curve starts from the adopted training state and peaks above it by the step's activations.
    live = [p["live_bytes"] for p in data["points"]]
    assert data["baseline_bytes"] > 0 and max(live) == data["peak_bytes"] > data["baseline_bytes"]
    assert (tmp_path / "memory_timeline_step2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(notices(caplog)) == 1 and "step 2" in notices(caplog)[0]
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("snapshot_first", [True, False])
def test_nests_with_the_measuring_callback_on_the_same_step(tmp_path: Path, snapshot_first: bool) -> None:
    """MeasureCallback tracks step 1 too; either callback order works and its figure is unchanged."""
    alone = MeasureCallback(warmup_steps=1, activation_every_n_steps=10)
    fit([alone], steps=3)
    measure = MeasureCallback(warmup_steps=1, activation_every_n_steps=10)
    snap = MemorySnapshot(at_step=1, out_dir=tmp_path)
    fit([snap, measure] if snapshot_first else [measure, snap], steps=3)
    assert (tmp_path / "memory_timeline_step1.json").is_file()
    [tracked] = [r for r in measure.records if "memory/activation_peak_mib" in r]
    [reference] = [r for r in alone.records if "memory/activation_peak_mib" in r]
    assert tracked["step"] == reference["step"] == 2  # the record of step 1 is logged at global_step 2
    assert tracked["memory/activation_peak_mib"] == reference["memory/activation_peak_mib"]
    assert tracked["memory/peak_total_mib"] == reference["memory/peak_total_mib"]
    assert _get_current_dispatch_mode() is None


class _Boom(L.Callback):
    def __init__(self, step: int, exc: BaseException) -> None:
        self.step, self.exc = step, exc

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise self.exc


def test_cpu_failure_mid_step_leaves_no_tracker_and_no_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_cuda(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("CUDA memory history must not be touched on CPU")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", no_cuda)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", no_cuda)
    caplog.set_level(logging.WARNING, logger="callbacks.snapshot")
    with pytest.raises(MemoryError):
        fit([MemorySnapshot(at_step=1, on_oom=True, out_dir=tmp_path), _Boom(1, MemoryError("host"))])
    assert list(tmp_path.iterdir()) == []
    assert _get_current_dispatch_mode() is None
    assert len(notices(caplog)) == 1


def test_off_by_default_and_refuses_a_negative_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="callbacks.snapshot")
    fit([MemorySnapshot(at_step=None, on_oom=False, out_dir=tmp_path)], steps=2)
    assert list(tmp_path.iterdir()) == [] and notices(caplog) == []
    with pytest.raises(ValueError, match="snapshot_step"):
        MemorySnapshot(at_step=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: allocator snapshots are CUDA-only")
def test_cuda_snapshot_of_a_step_and_of_an_oom(tmp_path: Path) -> None:
    snap = MemorySnapshot(at_step=1, on_oom=True, out_dir=tmp_path)
    with pytest.raises(torch.OutOfMemoryError):
        fit([snap, _Boom(3, torch.OutOfMemoryError("CUDA out of memory (raised by the test)"))], accelerator="gpu")
    for name in ("memory_snapshot_step1.pickle", "memory_snapshot_oom.pickle"):
        with (tmp_path / name).open("rb") as f:
            snapshot = pickle.load(f)
        assert {"segments", "device_traces"} <= set(snapshot), name
        events = [e for trace in snapshot["device_traces"] for e in trace]
        assert any(e["action"] == "alloc" for e in events), name
    assert not snap._recording  # stopped after the failure
    # Recording only the chosen step: one pickle, and recording is off again afterwards.
    only = MemorySnapshot(at_step=0, out_dir=tmp_path / "step")
    fit([only], steps=2, accelerator="gpu")
    assert [p.name for p in (tmp_path / "step").iterdir()] == ["memory_snapshot_step0.pickle"]
    assert not only._recording
