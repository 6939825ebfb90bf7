"""Memory snapshots of one chosen training step, and of an out-of-memory failure, written into the run folder.

On CUDA the allocator records its history (`torch.cuda.memory._record_memory_history`) from the start of optimizer
step k (or from fit start with `on_oom`), and `_dump_snapshot` writes

  memory_snapshot_step<k>.pickle   after step k: every allocation and free of the step, with stack traces
  memory_snapshot_oom.pickle       when the fit dies of CUDA out-of-memory (recorded since fit start)

Open either by dragging it onto https://pytorch.org/memory_viz (runs in the browser; nothing is uploaded):
"Active Memory Timeline" shows each tensor over the step, forward rising and backward falling, and a click on a
block names the line of code that allocated it. Recording stops once the step's file is written (unless `on_oom`
still needs it) and when the fit ends.

Elsewhere (CPU) there is no allocator history: one notice says so, and step k is recorded by the live-tensor tracker
instead (`LiveTensorTracker(record_timeline=True)`, the training state adopted so the curve starts at weights +
gradients + optimizer state): live bytes after every op, each op marked forward, backward or optimizer, saved as

  memory_timeline_step<k>.json     {"step", "peak_bytes", "baseline_bytes", "phases", "points": [{op_index,
                                    live_bytes, phase, op_name}, ...]}
  memory_timeline_step<k>.png      the curve, backward and optimizer shaded

Step k is `trainer.global_step` when the step starts (0-based optimizer steps, as `MeasureCallback` counts), all
its micro-batches included. With several processes each rank writes its own file (`..._rank<r>`).

It may sit anywhere in the callback list: on a step `MeasureCallback` also tracks, its tracker and this one nest
in either order (this one slips beneath the other's dispatch mode on entry and lifts it to leave).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

from trainer.core.step import training_state
from trainer.measure.memory.tracker import BACKWARD, FORWARD, OPTIMIZER, LiveTensorTracker, plot_timeline

log = logging.getLogger(__name__)


def is_cuda_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "CUDA out of memory" in str(e))


class MemorySnapshot(L.Callback):
    def __init__(
        self,
        at_step: int | None = None,
        on_oom: bool = False,
        out_dir: str | Path | None = None,
        max_entries: int = 100_000,
    ) -> None:
        if at_step is not None and at_step < 0:
            raise ValueError(f"measure.snapshot_step={at_step} must be ≥ 0 (an optimizer step) or null")
        self.at_step = at_step
        self.on_oom = on_oom
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.max_entries = max_entries  # allocator events kept (a ring buffer): ~100k covers a GPT-2 step
        self.written: list[Path] = []
        self._cuda = False
        self._noticed = False
        self._recording = False
        self._in_step = False  # step k has started and not yet finished
        self._done = False
        self._tracker: LiveTensorTracker | None = None
        self._baseline = 0
        self._optimizer_from: int | None = None  # timeline index where the optimizer part of step k starts

    @property
    def enabled(self) -> bool:
        return self.at_step is not None or self.on_oom

    # --- hooks --------------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        self._cuda = trainer.strategy.root_device.type == "cuda"
        if not self._cuda and not self._noticed:
            self._noticed = True
            instead = (
                f"recording the live-tensor timeline of step {self.at_step} instead "
                f"(memory_timeline_step{self.at_step}.json/.png)"
                if self.at_step is not None
                else "nothing is recorded for an out-of-memory failure"
            )
            log.warning(
                f"memory snapshots: CUDA allocator snapshots skipped on {trainer.strategy.root_device}; {instead}"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._cuda and self.on_oom:
            self._start_recording()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.at_step is None or self._done or self._in_step or trainer.global_step != self.at_step:
            return
        self._in_step = True
        if self._cuda:
            self._start_recording()
            return
        tracker = LiveTensorTracker(record_timeline=True, device=trainer.strategy.root_device.type)
        _enter_beneath_trackers(tracker)
        state = training_state(pl_module, trainer.optimizers)
        self._baseline = sum(tracker.adopt(tensors, label) for label, tensors in state.items())
        self._tracker = tracker
        self._optimizer_from = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._tracker is not None and self._optimizer_from is None:
            self._optimizer_from = len(self._tracker.timeline)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._in_step or trainer.global_step == self.at_step:
            return  # not the chosen step, or still accumulating its micro-batches
        self._in_step = False
        self._done = True
        if self._cuda:
            self._dump(trainer, f"memory_snapshot_step{self.at_step}")
            if not self.on_oom:
                self._stop_recording()
        else:
            self._save_timeline(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._recording and self.on_oom and is_cuda_oom(exception):
            self._dump(trainer, "memory_snapshot_oom")
        self._close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    # --- CUDA ---------------------------------------------------------------------------------------------------
    def _start_recording(self) -> None:
        if not self._recording:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
            self._recording = True

    def _stop_recording(self) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    def _dump(self, trainer: L.Trainer, stem: str) -> None:
        path = self._path(trainer, stem, ".pickle")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self.written.append(path)
        log.info(f"memory snapshot: {path} (open it at https://pytorch.org/memory_viz)")

    # --- CPU timeline -------------------------------------------------------------------------------------------
    def _save_timeline(self, trainer: L.Trainer) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        _exit_from_beneath(tracker)
        start = self._optimizer_from
        points = [
            p._replace(phase=OPTIMIZER) if start is not None and i >= start and p.phase != BACKWARD else p
            for i, p in enumerate(tracker.timeline)
        ]
        phases = {ph: sum(p.phase == ph for p in points) for ph in (FORWARD, BACKWARD, OPTIMIZER)}
        data = {
            "step": self.at_step,
            "device": str(trainer.strategy.root_device),
            "peak_bytes": tracker.peak_bytes,
            "baseline_bytes": self._baseline,
            "end_bytes": tracker.live_bytes,
            "num_ops": len(points),
            "phases": phases,
            "points": [p._asdict() for p in points],
        }
        path = self._path(trainer, f"memory_timeline_step{self.at_step}", ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        png = path.with_suffix(".png")
        plot_timeline(points, tracker.peak_bytes, png, title=f"step {self.at_step}", baseline_bytes=self._baseline)
        self.written += [path, png]
        log.info(f"memory timeline of step {self.at_step}: {path} and {png.name}")

    # --- helpers ------------------------------------------------------------------------------------------------
    def _path(self, trainer: L.Trainer, stem: str, suffix: str) -> Path:
        folder = self.out_dir if self.out_dir is not None else Path(trainer.default_root_dir)
        rank = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        return folder / f"{stem}{rank}{suffix}"

    def _close(self) -> None:
        """An unfinished step (an exception, a fit that ended first): leave no mode pushed and no recording on."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            _exit_from_beneath(tracker)
        self._in_step = False
        self._stop_recording()


def _enter_beneath_trackers(tracker: LiveTensorTracker) -> None:
    """Enter `tracker` below any LiveTensorTracker already active (e.g. MeasureCallback's on the same step).

    Lightning calls every callback's batch-start hooks in list order and their batch-end hooks in the same order,
    so two callbacks that each enter a dispatch mode on start and leave it on end would not nest. Entering beneath
    the other's tracker lets it leave first when it comes first; `_exit_from_beneath` covers the other order.
    Both trackers see every op either way: a mode forwards each op to the modes beneath it.
    """
    with contextlib.ExitStack() as lifted:
        while isinstance(_get_current_dispatch_mode(), LiveTensorTracker):
            lifted.enter_context(_pop_mode_temporarily())
        tracker.__enter__()


def _exit_from_beneath(tracker: LiveTensorTracker) -> None:
    """Leave `tracker` even if modes were pushed above it since; those are put back as they were."""
    if not any(m is tracker for m in _get_current_dispatch_mode_stack()):
        return
    with contextlib.ExitStack() as lifted:
        while _get_current_dispatch_mode() is not tracker:
            lifted.enter_context(_pop_mode_temporarily())
        tracker.__exit__(None, None, None)
