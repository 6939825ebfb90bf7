"""The measuring callback: per optimizer step, the figures a team compares policies by.

Logged to TensorBoard at each optimizer step (`global_step`; tag names in trainer/measure/metrics.py):
  train/loss                     mean loss over the step's micro-batches
  train/lr                       learning rate of the first param group
  time/step_ms                   wall time of the whole optimizer step (all micro-batches), CUDA-synchronised
  throughput/tokens_per_s        tokens of the step / step time
  memory/activation_peak_mib     on tracked steps: peak live-tensor bytes of one micro-batch's forward+backward
                                 above what was live when it began, gradient buffers excluded (any device)
  memory/peak_total_mib          the step's whole peak — weights, gradients, optimizer state, activations,
                                 transients: the allocator's peak on CUDA, the tracker's on tracked CPU steps
  memory/peak_allocated_mib, memory/peak_reserved_mib, memory/alloc_retries   (CUDA; peaks reset every step)

Under trainer.compile=true the tracked steps count what the allocator hands out (profiler memory events) instead
of live tensors: the tracker's dispatch mode would make dynamo run those steps eagerly. summary.json says which
(`memory_counted_by`).

The memory figures are taken by a `trainer.core.step.StepMeter`, the same object the estimator and the benchmarks use
over a bare step, so "estimate = run" compares like with like.

Why not Lightning's ThroughputMonitor: the summary's step time is a median over the steps after warm-up that leaves
out the steps the live-tensor tracker ran on (it costs Python work per op, so those steps are slower), and
ThroughputMonitor's rolling averages cannot leave steps out.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from trainer.core.step import StepMeter
from trainer.formatting import MIB
from trainer.measure import metrics as M
from trainer.measure.memory.tracker import cuda_memory_counters, reset_cuda_peaks

# The tags this callback logs, each optimizer step (the CUDA ones on CUDA only).
LOGGED = frozenset({M.TRAIN_LOSS, M.TRAIN_LR, M.STEP_MS, M.TOKENS_PER_S, M.ACTIVATION_PEAK, M.PEAK_TOTAL, *M.CUDA_TAGS})


class MeasureCallback(L.Callback):
    def __init__(self, warmup_steps: int = 3, activation_every_n_steps: int = 25, max_steps: int | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.activation_every_n_steps = activation_every_n_steps
        self.max_steps = max_steps
        self.records: list[dict[str, float]] = []  # one per optimizer step
        self._step_start: float | None = None
        self._step_at_start = 0
        self._micro_losses: list[torch.Tensor] = []
        self._tokens = 0
        self._meter: StepMeter | None = None
        self._window_closed = False
        self._activation_bytes: int | None = None
        self._total_bytes: int | None = None
        self._on_cuda = False
        self._compiled = False

    # --- which steps are tracked --------------------------------------------------------------------------------
    @property
    def first_tracked_step(self) -> int:
        """The first step after warm-up; in a run shorter than the warm-up, its last step (so smoke runs measure)."""
        if self.max_steps is not None:
            return min(self.warmup_steps, self.max_steps - 1)
        return self.warmup_steps

    @property
    def short_run(self) -> bool:
        """Every step is a warm-up step: the time figures include them."""
        return self.max_steps is not None and self.max_steps <= self.warmup_steps

    def _tracks(self, step: int) -> bool:
        """Track the first step after warm-up (so short runs get a figure), then every N steps."""
        n = self.activation_every_n_steps
        first = self.first_tracked_step
        return n > 0 and (step == first or (step > first and step % n == 0))

    # --- hooks --------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._on_cuda = pl_module.device.type == "cuda"
        self._compiled = bool(getattr(pl_module, "compile", False))

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
            self._window_closed = False
            if self._tracks(trainer.global_step):
                self._meter = StepMeter(device_type=pl_module.device.type, compiled=self._compiled)
                # What the step holds before it starts (weights, optimizer state, last step's gradients until
                # zero_grad frees them), so the tracker's peak is the whole step's, not only what it adds.
                self._meter.begin(pl_module, trainer.optimizers)
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
            self._stop_meter(pl_module)
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
            M.TRAIN_LOSS: float(torch.stack(self._micro_losses).float().mean()),
            M.TRAIN_LR: trainer.optimizers[0].param_groups[0]["lr"],
            M.STEP_MS: seconds * 1e3,
            M.TOKENS_PER_S: self._tokens / seconds,
        }
        if self._activation_bytes is not None:
            record[M.ACTIVATION_PEAK] = self._activation_bytes / MIB
        cuda = cuda_memory_counters(pl_module.device) if self._on_cuda else {}
        for tag in M.CUDA_TAGS:
            key = tag.split("/", 1)[1]
            if key in cuda:
                record[tag] = cuda[key]
        # The whole step's peak: the allocator's on CUDA (every step), the tracker's elsewhere (tracked steps).
        if M.PEAK_ALLOCATED in record:
            record[M.PEAK_TOTAL] = record[M.PEAK_ALLOCATED]
        elif self._total_bytes is not None:
            record[M.PEAK_TOTAL] = self._total_bytes / MIB
        # Straight to the loggers at the optimizer step: Lightning's self.log would also fire per micro-batch.
        for logger in trainer.loggers:
            logger.log_metrics(record, step=step)
        record["step"] = step
        record["tracked"] = float(self._activation_bytes is not None)
        self.records.append(record)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._meter is not None:  # leave no dispatch mode pushed behind a failed step
            meter, self._meter = self._meter, None
            meter.abort()

    # --- helpers ------------------------------------------------------------------------------------------------
    def _close_activation_window(self, pl_module: L.LightningModule) -> None:
        if self._meter is not None and not self._window_closed:
            self._meter.close_window(pl_module)
            self._window_closed = True

    def _stop_meter(self, pl_module: L.LightningModule) -> None:
        if self._meter is None:
            return
        meter, self._meter = self._meter, None
        figures = meter.end(pl_module)
        self._activation_bytes, self._total_bytes = figures.activation_bytes, figures.total_bytes

    def _sync(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize()

    def summary(self) -> dict[str, Any]:
        """The summary figures of the tags this callback logs, reduced as metrics.FROM_TAG says: times (medians)
        over the steps after warm-up with tracked steps left out, peaks over the steps after warm-up (every tracked
        step is one, unless the whole run is warm-up), the loss and the count over every step. A run no longer than
        its warm-up reports over all its steps (`time_includes_warmup`); one whose steps after warm-up were all
        tracked times those (`time_includes_tracked`: the tracker slows a step)."""
        after_warmup = [r for r in self.records if r["step"] > self.warmup_steps]
        steady = after_warmup or self.records
        untracked = [r for r in steady if not r["tracked"]]
        rows = {"median": untracked or steady, "max": steady, "last": self.records, "count": self.records}
        out: dict[str, Any] = {
            key: M.reduce([r[tag] for r in rows[how] if tag in r], how)
            for key, (tag, how) in M.FROM_TAG.items()
            if tag in LOGGED
        }
        out[M.TIME_INCLUDES_WARMUP] = bool(self.records) and not after_warmup
        out[M.TIME_INCLUDES_TRACKED] = bool(steady) and not untracked
        out[M.MEMORY_COUNTED_BY] = M.COUNTED_ALLOCATOR if self._compiled else M.COUNTED_LIVE_TENSORS
        return out
