"""Metric tag names and summary keys, defined once as one table (`METRICS`: tag, summary key, reduction,
prediction): the measuring callbacks log them, the run writes them to summary.json and HParams, the report reads
them back, and the TensorBoard layout charts them. The constants below are the table's entries by name. Also how a run's
per-step values reduce to its summary figures (FROM_TAG, `reduce`), which the callback and the report share."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One measured figure under every name it goes by: its TensorBoard scalar (`tag`, one point per optimizer
    step), its summary.json key (`key`) and how a run's steps reduce to it (`reduce`: max, median, last, count), the
    run's own prediction of it (`predicted`: it also has a predicted key, tag and error key) and whether only a CUDA
    run logs it. `group` is the tag's first component, `name` the rest; a figure with no per-step reduction has a
    key the run fills itself (final_val_ppl) or none (a scalar only charted)."""

    group: str
    name: str
    key: str | None = None
    reduce: str | None = None
    predicted: bool = False
    cuda: bool = False

    @property
    def tag(self) -> str:
        return f"{self.group}/{self.name}"

    @property
    def predicted_tag(self) -> str:
        return f"{self.group}/predicted_{self.name}"

    @property
    def predicted_key(self) -> str:
        return f"predicted_{self.key}"

    @property
    def error_key(self) -> str:
        return f"{self.key.removesuffix('_mib')}_error" if self.key else ""


# The one table, in the order of the summary (FROM_TAG) and of CUDA_TAGS; `steps` counts the train loss's points.
METRICS = (
    Metric("memory", "activation_peak_mib", "activation_peak_mib", "max", predicted=True),
    Metric("memory", "peak_total_mib", "peak_total_mib", "max", predicted=True),
    Metric("memory", "peak_allocated_mib", "peak_allocated_mib", "max", cuda=True),
    Metric("memory", "peak_reserved_mib", "peak_reserved_mib", "max", predicted=True, cuda=True),
    Metric("memory", "alloc_retries", cuda=True),
    # pinned host bytes in use at most (policy=offload's copies)
    Metric("memory", "host_pinned_peak_mib", "host_pinned_peak_mib", "max", cuda=True),
    Metric("time", "step_ms", "median_step_ms", "median"),
    Metric("throughput", "tokens_per_s", "tokens_per_s", "median"),
    Metric("train", "loss", "final_train_loss", "last"),
    Metric("val", "loss", "final_val_loss", "last"),
    Metric("train", "loss", "steps", "count"),
    Metric("train", "lr"),
    Metric("train", "grad_norm"),
    Metric("val", "ppl", "final_val_ppl"),  # exp(final val loss), filled by the run
)
_BY_KEY = {m.key: m for m in METRICS if m.key}
_BY_TAG = {m.tag: m for m in METRICS}

# TensorBoard scalars, one point per optimizer step.
TRAIN_LOSS = _BY_TAG["train/loss"].tag
TRAIN_LR = _BY_TAG["train/lr"].tag
GRAD_NORM = _BY_TAG["train/grad_norm"].tag
STEP_MS = _BY_KEY["median_step_ms"].tag
TOKENS_PER_S = _BY_KEY["tokens_per_s"].tag
ACTIVATION_PEAK = _BY_KEY["activation_peak_mib"].tag
PEAK_TOTAL = _BY_KEY["peak_total_mib"].tag
PEAK_ALLOCATED = _BY_KEY["peak_allocated_mib"].tag
PEAK_RESERVED = _BY_KEY["peak_reserved_mib"].tag
ALLOC_RETRIES = _BY_TAG["memory/alloc_retries"].tag
HOST_PINNED_PEAK = _BY_KEY["host_pinned_peak_mib"].tag
VAL_LOSS = _BY_KEY["final_val_loss"].tag
VAL_PPL = _BY_KEY["final_val_ppl"].tag
# logged only where there is a CUDA device
CUDA_TAGS = tuple(m.tag for m in METRICS if m.cuda)

# policy=auto (callbacks/planner.py), logged when it plans, not per step: two scalars and the plan as text.
AUTO_BUDGET = "auto/budget_mib"
AUTO_PREDICTED_PEAK = "auto/predicted_peak_mib"
AUTO_PLAN_TEXT = "policy/auto"
AUTO_REPLAN_TEXT = "policy/auto_replan"
PLAN_TAGS = (AUTO_BUDGET, AUTO_PREDICTED_PEAK, AUTO_PLAN_TEXT, AUTO_REPLAN_TEXT)  # not per step: charted nowhere

# The run's own prediction (callbacks/prediction.py): the estimator's figures for this configuration, taken at
# fit start, logged at the first and last step so each charts as a line beside the measured one.
PREDICTED = tuple(m for m in METRICS if m.predicted)
PREDICTED_ACTIVATION_PEAK = _BY_KEY["activation_peak_mib"].predicted_tag
PREDICTED_PEAK_TOTAL = _BY_KEY["peak_total_mib"].predicted_tag
PREDICTED_PEAK_RESERVED = _BY_KEY["peak_reserved_mib"].predicted_tag  # CUDA: the caching allocator's, replayed
CUDA_ONLY_TAGS = (*CUDA_TAGS, *(m.predicted_tag for m in PREDICTED if m.cuda))  # what a run elsewhere never logs

# summary.json keys of the run's figures (and, as hparam_tag(key), the HParams tab's metric columns)
STEPS = _BY_KEY["steps"].key
MEDIAN_STEP_MS = _BY_KEY["median_step_ms"].key
TOKENS_PER_S_KEY = _BY_KEY["tokens_per_s"].key
ACTIVATION_PEAK_KEY = _BY_KEY["activation_peak_mib"].key
PEAK_TOTAL_KEY = _BY_KEY["peak_total_mib"].key
PEAK_ALLOCATED_KEY = _BY_KEY["peak_allocated_mib"].key
PEAK_RESERVED_KEY = _BY_KEY["peak_reserved_mib"].key
HOST_PINNED_PEAK_KEY = _BY_KEY["host_pinned_peak_mib"].key
FINAL_TRAIN_LOSS = _BY_KEY["final_train_loss"].key
FINAL_VAL_LOSS = _BY_KEY["final_val_loss"].key
FINAL_VAL_PPL = _BY_KEY["final_val_ppl"].key
TIME_INCLUDES_WARMUP = "time_includes_warmup"  # the run was no longer than its warm-up: its times include it
TIME_INCLUDES_TRACKED = "time_includes_tracked"  # every step after warm-up was tracked: its times include those
AUTO = "auto"  # policy=auto's plan, predicted and measured figures (callbacks/planner.py)
PREDICTED_ACTIVATION_PEAK_KEY = _BY_KEY["activation_peak_mib"].predicted_key
PREDICTED_PEAK_TOTAL_KEY = _BY_KEY["peak_total_mib"].predicted_key
PREDICTED_PEAK_RESERVED_KEY = _BY_KEY["peak_reserved_mib"].predicted_key
PREDICTION_NOTE = "prediction_note"  # why a run has no prediction (the estimator's one line)
# How the run's memory figures were counted: the live-tensor tracker (dispatched ops) or, under torch.compile, what
# the allocator handed out
# (trainer.measure.memory.allocator_events: a dispatch mode would make dynamo run the step eagerly).
MEMORY_COUNTED_BY = "memory_counted_by"
COUNTED_LIVE_TENSORS, COUNTED_ALLOCATOR = "live tensors (eager step)", "allocator (compiled step)"
PREDICTED_TAGS = {m.predicted_key: m.predicted_tag for m in PREDICTED}
ACTIVATION_PEAK_ERROR = _BY_KEY["activation_peak_mib"].error_key
PEAK_TOTAL_ERROR = _BY_KEY["peak_total_mib"].error_key
# (predicted key, measured key, error key): the signed error (predicted − measured) / measured, where measured;
# the predicted total is also held against CUDA's allocated peak, the figure it counts beside the allocator's.
PREDICTIONS = (
    *((m.predicted_key, m.key, m.error_key) for m in PREDICTED if m.key != PEAK_RESERVED_KEY),
    (PREDICTED_PEAK_TOTAL_KEY, PEAK_ALLOCATED_KEY, _BY_KEY["peak_allocated_mib"].error_key),
    (PREDICTED_PEAK_RESERVED_KEY, PEAK_RESERVED_KEY, _BY_KEY["peak_reserved_mib"].error_key),
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
FROM_TAG = {m.key: (m.tag, m.reduce) for m in METRICS if m.key and m.reduce}


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
