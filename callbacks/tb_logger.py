"""The run's TensorBoard logger, as a sweep reads it: the job-folder logger, its HParams entry and its Custom
Scalars layout.

What TensorBoard does with what a run writes (read in 2.21's source), and what this module writes for it:

* Runs are named by the folder that holds their event files, relative to `--logdir`. `JobTensorBoardLogger`
  writes into the job folder itself, so `tensorboard --logdir <sweep>` names each run after its job
  (`0_micro=8x1,policy=none`), not `<job>/tb`.
* Time Series sorts its cards by tag, groups them by the tag's first component (`memory/...` is group "memory"),
  orders the groups by name and opens only the first two. Lightning adds an `epoch` scalar to whatever is logged
  with `self.log` (val/loss): alone it made the first group, so the logger drops it. The HParams metric copies are
  scalars too (they must be: the HParams backend reads a metric as the last value of a scalar tag in the session's
  run); their tags come from `metrics.hparam_tag`, which should sort after every per-step group.
* HParams: the columns are the `_hparams_/experiment` summary of the first run TensorBoard reads. Its backend sorts
  the hparams by (`differs` first, then name) and the table ticks the first five (`kNumHParamsToDisplayByDefault`,
  tf-hparams-query-pane); the metrics keep the summary's order and the first five are ticked. torch's
  `summary.hparams`, which Lightning's `log_hyperparams` calls, sets no `differs` (the table opened on accum,
  attention, batch_size, dropout, loss), no display names, and ends every session as a success, OOM jobs too.
  The logger writes the three summaries from TensorBoard's own protos instead: the hparams a sweep compares
  (`SHOWN_HPARAMS`, five, so all are ticked) marked `differs`, closed sets with their domain (so the table can
  filter them), the session status from the run's status.
* Custom Scalars: charts for the device the run is on (the CUDA counters only on CUDA), every per-step tag of
  trainer/measure/metrics.py on one of them, matched exactly.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from trainer.measure import metrics as M

# --- Custom Scalars -------------------------------------------------------------------------------------------------
# category -> chart title -> tags (trainer/measure/metrics.py). One line per tag and run ("Multiline").
CHARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "memory": {
        "activation peak (MiB, live tensors of one micro-batch): measured and predicted": (
            M.ACTIVATION_PEAK,
            M.PREDICTED_ACTIVATION_PEAK,
        ),
        "whole-step peak (MiB: weights, grads, optimizer state, activations): measured and predicted": (
            M.PEAK_TOTAL,
            M.PREDICTED_PEAK_TOTAL,
        ),
        "CUDA peak allocated / reserved (MiB), and the reserve predicted": (
            M.PEAK_ALLOCATED,
            M.PEAK_RESERVED,
            M.PREDICTED_PEAK_RESERVED,
        ),
        "CUDA allocator retries": (M.ALLOC_RETRIES,),
        "pinned host memory in use at most (MiB; policy=offload's copies)": (M.HOST_PINNED_PEAK,),
    },
    "time": {
        "optimizer step (ms)": (M.STEP_MS,),
        "throughput (tokens/s)": (M.TOKENS_PER_S,),
    },
    "loss": {
        "train and val loss": (M.TRAIN_LOSS, M.VAL_LOSS),
        "val perplexity": (M.VAL_PPL,),
    },
    "optimizer": {
        "learning rate": (M.TRAIN_LR,),
        "gradient norm (before clipping)": (M.GRAD_NORM,),
    },
}


def tag_regex(tag: str) -> str:
    """Custom Scalars matches chart tags as regular expressions from the tag's start: this one matches `tag` only."""
    return f"^{re.escape(tag)}$"


def tb_layout(device_type: str | None = None) -> dict[str, dict[str, list[Any]]]:
    """The layout for a run on `device_type` ("cuda", "cpu", ...; None: every chart), in the form
    `SummaryWriter.add_custom_scalars` takes. A chart whose tags the device never logs is left out."""
    skip = set(M.CUDA_ONLY_TAGS) if device_type not in (None, "cuda") else set()
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in CHARTS.items():
        kept = {
            title: ["Multiline", [tag_regex(t) for t in tags]]
            for title, tags in charts.items()
            if not set(tags) <= skip
        }
        if kept:
            layout[category] = kept
    return layout


def write_tb_layout(writer: Any, device_type: str | None = None) -> None:
    """Write the layout into a run's events through its SummaryWriter (`TensorBoardLogger.experiment`).

    torch's and tensorboardX's SummaryWriter both have `add_custom_scalars`; anything else (a logger that is
    not TensorBoard, a non-zero rank's dummy experiment) is left alone.
    """
    add = getattr(writer, "add_custom_scalars", None)
    if callable(add):
        add(tb_layout(device_type))


# --- HParams --------------------------------------------------------------------------------------------------------
# The hparams the HParams table shows without a click: what a sweep compares (metrics.HPARAM_ORDER), five because
# TensorBoard ticks five. `micro` is batch_size × accum in one column ("4x2", as conf/micro/ names them); accum and
# batch_size follow as numeric columns. TensorBoard shows them sorted by name: loss, micro, model, policy, precision.
MICRO = "micro"
SHOWN_HPARAMS = ("policy", "loss", MICRO, "precision", "model")
DESCRIPTIONS = {
    MICRO: "micro-batch size x accumulation steps (batch_size x accum)",
    "batch_size": "micro-batch size, sequences",
    "accum": "micro-batches per optimizer step",
    "status": "completed | oom | error | interrupted",
}


def micro(batch_size: int, accum: int) -> str:
    """The `micro` hparam: "4x2" for a micro-batch of 4 accumulated twice (conf/micro/4x2.yaml)."""
    return f"{batch_size}x{accum}"


SESSION_STATUS = {"completed": "STATUS_SUCCESS", "oom": "STATUS_FAILURE", "error": "STATUS_FAILURE"}
LIGHTNING_EPOCH = "epoch"  # what Lightning adds to every self.log'd batch of metrics


def closed_domains() -> dict[str, tuple[str, ...]]:
    """Hparams whose every value is known in advance, with those values: without a domain the HParams tab offers
    no filter for a string column (it lists up to nine values as ticks, more as a regular expression box)."""
    from trainer.policies import POLICIES

    return {"policy": tuple(sorted(POLICIES))}


def hparams_summaries(
    params: Mapping[str, Any],
    metric_tags: list[str],
    shown: tuple[str, ...] = SHOWN_HPARAMS,
    domains: Mapping[str, tuple[str, ...]] | None = None,
) -> list[Any]:
    """The experiment, session-start and session-end summaries of one job (tensorboard.compat.proto Summary).

    `params`: flat name -> str | int | float | bool (None is left out), its `status` the run's (completed: the
    session succeeded, oom/error: failed, else unknown); `shown`: the hparams marked `differs`, which TensorBoard
    puts first and ticks; `metric_tags`: the scalar tags of the metric columns, in column order."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    domains = closed_domains() if domains is None else domains
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    infos = []
    for name, value in params.items():
        if value is None:
            continue
        info = api_pb2.HParamInfo(name=name, description=DESCRIPTIONS.get(name, ""), differs=name in shown)
        if isinstance(value, bool):
            start.hparams[name].bool_value = value
            info.type = api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value = float(value)
            info.type = api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].string_value = str(value)
            info.type = api_pb2.DATA_TYPE_STRING
            if name in domains and str(value) in domains[name]:
                info.domain_discrete.extend(domains[name])
        infos.append(info)
    display = {tag: tag.split("/", 1)[-1] for tag in metric_tags}  # the summary key, not its prefix
    columns = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t), display_name=d) for t, d in display.items()]
    end = plugin_data_pb2.SessionEndInfo(
        status=api_pb2.Status.Value(SESSION_STATUS.get(str(params.get("status")), "STATUS_UNKNOWN")),
        end_time_secs=time.time(),
    )
    pieces = (
        (
            metadata.EXPERIMENT_TAG,
            plugin_data_pb2.HParamsPluginData(
                experiment=api_pb2.Experiment(hparam_infos=infos, metric_infos=columns, time_created_secs=time.time())
            ),
        ),
        (metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=start)),
        (metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end)),
    )
    summaries = []
    for tag, data in pieces:
        summary = Summary()
        summary.value.add(tag=tag, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR)
        summaries.append(summary)
    return summaries


class JobTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger writing into the job folder itself (so the run is named by the job), without
    Lightning's `epoch` scalar, and with an HParams entry whose first columns are what a sweep compares.

    `log_hyperparams(params, metrics)` writes the HParams entry when given metrics (the run's final figures, by
    their scalar tags); without metrics it writes nothing, as Lightning's does without a default hp_metric.
    """

    def __init__(self, run_dir: str | Path, shown: tuple[str, ...] = SHOWN_HPARAMS) -> None:
        super().__init__(save_dir=str(run_dir), name="", version="", default_hp_metric=False)
        self.shown = shown

    @rank_zero_only
    def save(self) -> None:
        """Flush the events. No hparams.yaml: Lightning writes it once, before the run's hparams exist ("{}"), and
        .hydra/config.yaml and summary.json already hold them."""
        if self._experiment is not None:
            self.experiment.flush()

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        kept = {k: v for k, v in metrics.items() if k != LIGHTNING_EPOCH}
        if kept:
            super().log_metrics(kept, step)

    @rank_zero_only
    def log_hyperparams(  # type: ignore[override]
        self, params: Mapping[str, Any], metrics: Mapping[str, Any] | None = None, step: int | None = None
    ) -> None:
        if not metrics:
            super().log_hyperparams(dict(params), metrics=None, step=step)
            return
        self.hparams.update(params)  # Lightning's record of them (no hparams.yaml: see save)
        values = {k: float(v) if v is not None else math.nan for k, v in metrics.items()}
        self.log_metrics(values, step)
        writer = self.experiment._get_file_writer()
        for summary in hparams_summaries(params, list(values), self.shown):
            writer.add_summary(summary, step)
