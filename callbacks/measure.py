"""The measuring callback: per optimizer step, the figures a team compares policies by.

Logged to TensorBoard at each optimizer step (`global_step`):
  train/loss                     mean loss over the step's micro-batches
  train/lr                       learning rate of the first param group
  time/step_ms                   wall time of the whole optimizer step (all micro-batches), CUDA-synchronised
  throughput/tokens_per_s        tokens of the step / step time
  memory/activation_peak_mib     on tracked steps: peak live-tensor bytes of one micro-batch's forward+backward
                                 above what was live when it began, gradient buffers excluded (any device)
  memory/peak_total_mib          the step's whole peak — weights, gradients, optimizer state, activations,
                                 transients: the allocator's peak on CUDA, the tracker's on tracked CPU steps
  memory/peak_allocated_mib, memory/peak_reserved_mib, memory/alloc_retries   (CUDA; peaks reset every step)

Why not Lightning's ThroughputMonitor: it times single batches, not optimizer steps made of `accum` micro-batches,
and fixes its own tag names; the arithmetic here is one division. DeviceStatsMonitor is added beside this
callback when `measure.device_stats=true`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch

from trainer.memory import MIB, LiveTensorTracker, cuda_memory_counters, reset_cuda_peaks


def training_state(pl_module: L.LightningModule, trainer: L.Trainer) -> list[torch.Tensor]:
    """Every tensor a training step holds before it starts: parameters, buffers, gradients, optimizer state."""
    tensors: list[torch.Tensor] = [*pl_module.parameters(), *pl_module.buffers()]
    tensors += [p.grad for p in pl_module.parameters() if p.grad is not None]
    for opt in trainer.optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


class MeasureCallback(L.Callback):
    def __init__(self, warmup_steps: int = 3, activation_every_n_steps: int = 25) -> None:
        self.warmup_steps = warmup_steps
        self.activation_every_n_steps = activation_every_n_steps
        self.records: list[dict[str, float]] = []  # one per optimizer step
        self._step_start: float | None = None
        self._step_at_start = 0
        self._micro_losses: list[torch.Tensor] = []
        self._tokens = 0
        self._tracker: LiveTensorTracker | None = None
        self._activation_bytes: int | None = None
        self._total_bytes: int | None = None
        self._on_cuda = False

    # --- which steps are tracked --------------------------------------------------------------------------------
    def _tracks(self, step: int) -> bool:
        """Track the first step after warm-up (so short runs get a figure), then every N steps."""
        n = self.activation_every_n_steps
        return n > 0 and (step == self.warmup_steps or (step > self.warmup_steps and step % n == 0))

    # --- hooks --------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._on_cuda = pl_module.device.type == "cuda"

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_start is None:  # first micro-batch of an optimizer step
            self._sync()
            reset_cuda_peaks(pl_module.device)
            self._step_start = time.perf_counter()
            self._step_at_start = trainer.global_step
            self._micro_losses, self._tokens = [], 0
            self._activation_bytes = self._total_bytes = None
            if self._tracks(trainer.global_step):
                self._tracker = LiveTensorTracker(device=pl_module.device.type)
                self._tracker.__enter__()
                # What the step holds before it starts (weights, optimizer state, last step's gradients until
                # zero_grad frees them), so the tracker's peak is the whole step's, not only what it adds.
                self._tracker.adopt(training_state(pl_module, trainer))
        self._tokens += batch[0].numel()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._close_activation_window(pl_module)  # before clipping and the update

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The activation figure is the first micro-batch's forward+backward; the tracker keeps running through the
        # step's other micro-batches and the update, for the whole step's total.
        self._close_activation_window(pl_module)
        if trainer.global_step != self._step_at_start:
            self._stop_tracker()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning divides the loss by accumulate_grad_batches before returning it; undo that. Kept as a tensor:
        # reading it now would make the host wait for the device after every micro-batch.
        self._micro_losses.append(loss.detach() * trainer.accumulate_grad_batches)
        if trainer.global_step == self._step_at_start:
            return  # still accumulating
        self._sync()
        assert self._step_start is not None
        seconds = time.perf_counter() - self._step_start
        self._step_start = None
        step = trainer.global_step
        record: dict[str, float] = {
            "train/loss": float(torch.stack(self._micro_losses).float().mean()),
            "train/lr": trainer.optimizers[0].param_groups[0]["lr"],
            "time/step_ms": seconds * 1e3,
            "throughput/tokens_per_s": self._tokens / seconds,
        }
        if self._activation_bytes is not None:
            record["memory/activation_peak_mib"] = self._activation_bytes / MIB
        cuda = cuda_memory_counters(pl_module.device) if self._on_cuda else {}
        for key in ("peak_allocated_mib", "peak_reserved_mib", "alloc_retries"):
            if key in cuda:
                record[f"memory/{key}"] = cuda[key]
        # The whole step's peak: the allocator's on CUDA (every step), the tracker's elsewhere (tracked steps).
        if "peak_allocated_mib" in cuda:
            record["memory/peak_total_mib"] = cuda["peak_allocated_mib"]
        elif self._total_bytes is not None:
            record["memory/peak_total_mib"] = self._total_bytes / MIB
        # Straight to the loggers at the optimizer step: Lightning's self.log would also fire per micro-batch.
        for logger in trainer.loggers:
            logger.log_metrics(record, step=step)
        record["step"] = step
        record["tracked"] = float(self._activation_bytes is not None)
        self.records.append(record)

    # --- helpers ------------------------------------------------------------------------------------------------
    def _close_activation_window(self, pl_module: L.LightningModule) -> None:
        if self._tracker is not None and self._activation_bytes is None:
            grads = [p.grad for p in pl_module.parameters()]
            self._activation_bytes = self._tracker.peak_bytes_excluding(grads, until=self._tracker.mark())

    def _stop_tracker(self) -> None:
        if self._tracker is None:
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        self._total_bytes = tracker.peak_bytes

    def _sync(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize()

    def summary(self) -> dict[str, Any]:
        """Medians over the steps after warm-up; tracked steps are left out of the time figures."""
        steady = [r for r in self.records if r["step"] > self.warmup_steps] or self.records
        timed = [r for r in steady if not r["tracked"]] or steady

        def median(key: str, rows: list[dict[str, float]]) -> float | None:
            values = [r[key] for r in rows if key in r]
            return statistics.median(values) if values else None

        activation = [r["memory/activation_peak_mib"] for r in self.records if "memory/activation_peak_mib" in r]
        return {
            "steps": len(self.records),
            "median_step_ms": median("time/step_ms", timed),
            "tokens_per_s": median("throughput/tokens_per_s", timed),
            "peak_allocated_mib": max(
                (r["memory/peak_allocated_mib"] for r in steady if "memory/peak_allocated_mib" in r), default=None
            ),
            "peak_reserved_mib": max(
                (r["memory/peak_reserved_mib"] for r in steady if "memory/peak_reserved_mib" in r), default=None
            ),
            "activation_peak_mib": max(activation) if activation else None,
            "peak_total_mib": max(
                (r["memory/peak_total_mib"] for r in steady if "memory/peak_total_mib" in r), default=None
            ),
            "final_train_loss": self.records[-1]["train/loss"] if self.records else None,
        }
