"""The console progress bar in optimizer steps.

Lightning's TQDMProgressBar counts micro-batches (`batch_idx + 1`) against a total that, under `max_steps`, is
`min(batches in the epoch, max_steps - global_step)`: with `accum=8 trainer.max_steps=3` it reads 3/3 after three
micro-batches, then 4/? ... 24/?. `StepProgressBar` keeps Lightning's bar (validation bar, metrics postfix, the
description a sweep's `callbacks.sweep_progress.SweepProgress` sets) and counts what the config speaks: optimizer steps,
`global_step` out of `trainer.max_steps`, over the whole run (a resumed run starts at its step). A run without
`max_steps` counts each epoch's optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm


class StepProgressBar(TQDMProgressBar):
    """TQDMProgressBar whose training bar advances once per optimizer step, out of `trainer.max_steps`."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)
        self._epoch_first_step = 0
        self._shown_step = -1

    # --- what the bar counts ------------------------------------------------------------------------------------
    def steps_total(self, trainer: L.Trainer) -> int | None:
        """Optimizer steps the bar counts to: max_steps, or without it this epoch's (None: unknown length)."""
        if trainer.max_steps > 0:
            return int(trainer.max_steps)
        batches = trainer.num_training_batches
        if batches is None or math.isinf(batches):
            return None
        return math.ceil(int(batches) / max(1, trainer.accumulate_grad_batches))  # a short last step counts

    def steps_done(self, trainer: L.Trainer) -> int:
        return trainer.global_step - (0 if trainer.max_steps > 0 else self._epoch_first_step)

    # --- Lightning's hooks --------------------------------------------------------------------------------------
    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.unit = "step"  # the rate reads step/s
        return bar

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: the run folder names the run
        return items

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.max_steps > 0:
            self._restart(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self._epoch_first_step = trainer.global_step
        if trainer.max_steps <= 0:
            self._restart(trainer)
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._shown_step:
            return  # still accumulating micro-batches
        self._shown_step = step
        bar = self.train_progress_bar
        n = self.steps_done(trainer)
        if self._should_update(n, bar.total) and not bar.disable:
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def _restart(self, trainer: L.Trainer) -> None:
        """Start the bar at the steps already done: elapsed time and step/s count from here."""
        bar = self.train_progress_bar
        self._shown_step = trainer.global_step
        if bar.disable:
            return
        done = self.steps_done(trainer)
        bar.reset()
        bar.total = self.steps_total(trainer)
        bar.initial = bar.n = bar.last_print_n = done
        bar.refresh()
