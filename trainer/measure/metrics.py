"""Metric tag names and summary keys, defined once: the measuring callbacks log them, the run writes them to
summary.json and HParams, the report reads them back, and the TensorBoard layout charts them. Also how a run's
per-step values reduce to its summary figures (FROM_TAG, `reduce`), which the callback and the report share."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# TensorBoard scalars, one point per optimizer step.
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
GRAD_NORM = "train/grad_norm"
STEP_MS = "time/step_ms"
TOKENS_PER_S = "throughput/tokens_per_s"
ACTIVATION_PEAK = "memory/activation_peak_mib"
PEAK_TOTAL = "memory/peak_total_mib"
PEAK_ALLOCATED = "memory/peak_allocated_mib"
PEAK_RESERVED = "memory/peak_reserved_mib"
ALLOC_RETRIES = "memory/alloc_retries"
HOST_PINNED_PEAK = "memory/host_pinned_peak_mib"  # pinned host bytes in use at most (policy=offload's copies)
VAL_LOSS = "val/loss"
VAL_PPL = "val/ppl"
# logged only where there is a CUDA device
CUDA_TAGS = (PEAK_ALLOCATED, PEAK_RESERVED, ALLOC_RETRIES, HOST_PINNED_PEAK)

# policy=auto (callbacks/planner.py), logged when it plans, not per step: two scalars and the plan as text.
AUTO_BUDGET = "auto/budget_mib"
AUTO_PREDICTED_PEAK = "auto/predicted_peak_mib"
AUTO_PLAN_TEXT = "policy/auto"
AUTO_REPLAN_TEXT = "policy/auto_replan"
PLAN_TAGS = (AUTO_BUDGET, AUTO_PREDICTED_PEAK, AUTO_PLAN_TEXT, AUTO_REPLAN_TEXT)  # not per step: charted nowhere

# The run's own prediction (callbacks/prediction.py): the estimator's figures for this configuration, taken at
# fit start, logged at the first and last step so each charts as a line beside the measured one.
PREDICTED_ACTIVATION_PEAK = "memory/predicted_activation_peak_mib"
PREDICTED_PEAK_TOTAL = "memory/predicted_peak_total_mib"
PREDICTED_PEAK_RESERVED = "memory/predicted_peak_reserved_mib"  # CUDA: the caching allocator's, replayed
CUDA_ONLY_TAGS = (*CUDA_TAGS, PREDICTED_PEAK_RESERVED)  # what a run elsewhere never logs

# summary.json keys of the run's figures (and, as hparam_tag(key), the HParams tab's metric columns)
STEPS = "steps"
MEDIAN_STEP_MS = "median_step_ms"
TOKENS_PER_S_KEY = "tokens_per_s"
ACTIVATION_PEAK_KEY = "activation_peak_mib"
PEAK_TOTAL_KEY = "peak_total_mib"
PEAK_ALLOCATED_KEY = "peak_allocated_mib"
PEAK_RESERVED_KEY = "peak_reserved_mib"
HOST_PINNED_PEAK_KEY = "host_pinned_peak_mib"
FINAL_TRAIN_LOSS = "final_train_loss"
FINAL_VAL_LOSS = "final_val_loss"
FINAL_VAL_PPL = "final_val_ppl"
TIME_INCLUDES_WARMUP = "time_includes_warmup"  # the run was no longer than its warm-up: its times include it
TIME_INCLUDES_TRACKED = "time_includes_tracked"  # every step after warm-up was tracked: its times include those
AUTO = "auto"  # policy=auto's plan, predicted and measured figures (callbacks/planner.py)
PREDICTED_ACTIVATION_PEAK_KEY = "predicted_activation_peak_mib"
PREDICTED_PEAK_TOTAL_KEY = "predicted_peak_total_mib"
PREDICTED_PEAK_RESERVED_KEY = "predicted_peak_reserved_mib"
PREDICTION_NOTE = "prediction_note"  # why a run has no prediction (the estimator's one line)
# How the run's memory figures were counted: the live-tensor tracker (dispatched ops) or, under torch.compile, what
# the allocator handed out
# (trainer.measure.memory.allocator_events: a dispatch mode would make dynamo run the step eagerly).
MEMORY_COUNTED_BY = "memory_counted_by"
COUNTED_LIVE_TENSORS, COUNTED_ALLOCATOR = "live tensors (eager step)", "allocator (compiled step)"
PREDICTED_TAGS = {
    PREDICTED_ACTIVATION_PEAK_KEY: PREDICTED_ACTIVATION_PEAK,
    PREDICTED_PEAK_TOTAL_KEY: PREDICTED_PEAK_TOTAL,
    PREDICTED_PEAK_RESERVED_KEY: PREDICTED_PEAK_RESERVED,
}
ACTIVATION_PEAK_ERROR = "activation_peak_error"
PEAK_TOTAL_ERROR = "peak_total_error"
# (predicted key, measured key, error key): the signed error (predicted − measured) / measured, where measured
PREDICTIONS = (
    (PREDICTED_ACTIVATION_PEAK_KEY, ACTIVATION_PEAK_KEY, ACTIVATION_PEAK_ERROR),
    (PREDICTED_PEAK_TOTAL_KEY, PEAK_TOTAL_KEY, PEAK_TOTAL_ERROR),
    (PREDICTED_PEAK_TOTAL_KEY, PEAK_ALLOCATED_KEY, "peak_allocated_error"),  # CUDA: beside the allocator's peaks
    (PREDICTED_PEAK_RESERVED_KEY, PEAK_RESERVED_KEY, "peak_reserved_error"),  # the allocator's, replayed
)
SUMMARY_FIGURES = (
    STEPS,
    ACTIVATION_PEAK_KEY,
    PEAK_TOTAL_KEY,
    PEAK_ALLOCATED_KEY,
    MEDIAN_STEP_MS,
    TOKENS_PER_S_KEY,
    FINAL_TRAIN_LOSS,
    FINAL_VAL_LOSS,
)

# What the report reads from a summary: the figures, the prediction and its errors.
REPORT_FIGURES = (
    *SUMMARY_FIGURES,
    PREDICTED_ACTIVATION_PEAK_KEY,
    ACTIVATION_PEAK_ERROR,
    PREDICTED_PEAK_TOTAL_KEY,
    PEAK_TOTAL_ERROR,
)

# summary key -> the tag it is made from and how a run's steps reduce to it (`reduce`): the measuring callback's
# summary, and the report's fallback for a job that left no summary figure
FROM_TAG = {
    ACTIVATION_PEAK_KEY: (ACTIVATION_PEAK, "max"),
    PEAK_TOTAL_KEY: (PEAK_TOTAL, "max"),
    PEAK_ALLOCATED_KEY: (PEAK_ALLOCATED, "max"),
    PEAK_RESERVED_KEY: (PEAK_RESERVED, "max"),
    HOST_PINNED_PEAK_KEY: (HOST_PINNED_PEAK, "max"),
    MEDIAN_STEP_MS: (STEP_MS, "median"),
    TOKENS_PER_S_KEY: (TOKENS_PER_S, "median"),
    FINAL_TRAIN_LOSS: (TRAIN_LOSS, "last"),
    FINAL_VAL_LOSS: (VAL_LOSS, "last"),
    STEPS: (TRAIN_LOSS, "count"),
}


def reduce(values: Sequence[float], how: str) -> float | int | None:
    """One figure of a run's per-step values, reduced as FROM_TAG says; None when there are none (a count: 0)."""
    if how == "count":
        return len(values)
    if not values:
        return None
    if how == "max":
        return max(values)
    if how == "median":
        return statistics.median(values)
    if how == "last":
        return values[-1]
    raise ValueError(f"unknown reduction {how!r}; choose max, median, last or count")


# What a sweep varies, in this order: the first keys of a run's HParams entry (TensorBoard's table shows them by
# name, those callbacks/tb_logger.SHOWN_HPARAMS marks first).
HPARAM_ORDER = ("policy", "loss", "accum", "batch_size", "precision", "model")

# The HParams tab's metric columns are scalars, so TensorBoard's Time Series shows them too, as one-point cards. It
# groups cards by a tag's first component, orders the groups by name and opens the first two: this prefix sorts
# after every per-step group above (memory, throughput, time, train, val), so those lead.
HPARAM_PREFIX = "whole_run"


def hparam_tag(key: str) -> str:
    return f"{HPARAM_PREFIX}/{key}"
