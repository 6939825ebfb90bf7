"""Numeric guard: the gradient norm of every optimizer step, and what to do when it is not finite."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
import torch

from trainer.measure import metrics as M

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient norm; the message names the step and the last good checkpoint."""


class NumericGuard(L.Callback):
    """Logs `train/grad_norm` (before clipping) and stops — or skips the step — when it is NaN or inf.

    Runs in `on_before_optimizer_step`, after the backward of the step's last micro-batch and before clipping
    and the update, so a bad step never reaches the weights, the optimizer state or a checkpoint. A NaN or inf
    loss always shows up here: its gradients are non-finite too.
    Skipping sets every `.grad` to None: AdamW then leaves each parameter and its moments untouched (the LR
    schedule still advances, as it does in Megatron's skipped iterations).
    """

    def __init__(self, on_nonfinite: str = "stop") -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; choose stop or skip")
        self.on_nonfinite = on_nonfinite
        self.skipped_steps: list[int] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norm = grad_norm(pl_module)
        if norm is None:
            return
        step = trainer.global_step + 1  # the step being taken: the number MeasureCallback logs it under
        for logger in trainer.loggers:
            logger.log_metrics({M.GRAD_NORM: norm}, step=step)
        if math.isfinite(norm):
            return
        loss = getattr(pl_module, "last_loss", None)
        bad_loss = loss is not None and not math.isfinite(float(loss))
        what = f"loss ({float(loss)})" if bad_loss else f"gradient norm ({norm})"
        if self.on_nonfinite == "skip":
            for p in pl_module.parameters():
                p.grad = None
            self.skipped_steps.append(step)
            log.warning("skipped step %d: non-finite %s", step, what)
            return
        ckpt = _last_checkpoint(trainer)
        raise NonFiniteError(
            f"non-finite {what} at step {step}; the last good checkpoint is {ckpt or 'none (no step checkpointed yet)'}"
            "; lower optim.lr or set trainer.on_nonfinite=skip to skip such steps"
        )


def grad_norm(pl_module: L.LightningModule) -> float | None:
    """The whole model's gradient norm: the module's own where it has one (a pipeline rank holds its stages' alone,
    and sums theirs with the other ranks'), else its parameters' (None before any backward)."""
    own = getattr(pl_module, "grad_norm", None)
    if own is not None:
        return own()
    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0)) if grads else None


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    cb = trainer.checkpoint_callback
    path = getattr(cb, "last_model_path", None) or getattr(cb, "best_model_path", None)
    return str(path) if path else None
