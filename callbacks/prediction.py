"""Every run predicts itself: at fit start, before the first step, the estimator runs this run's configuration on
fake tensors (the same code as `python -m trainer.estimate`: the module built as the run builds it, one steady
step as Lightning runs it), and summary.json carries the prediction beside the measurement with the signed error
of each (`trainer.measure.metrics.PREDICTIONS`). So every run a user makes, on any hardware, is a check of the estimate.

The policy and loss head are the ones the run trains with: under `policy=auto`, the plan its planner chose (this
callback runs after it). Each rank predicts its own share (FSDP2 shards the state across the ranks). A model the
estimator refuses (a `UserError`: e.g. an op fake tensors cannot run, named) says why in one line
(`prediction_note`) and the run goes on with the fields null; any other failure is the estimator's bug: its
traceback is logged, the note names it, and the run goes on too. The RNG is
left as it was found, so the run's dropout masks do not depend on `measure.predict`.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from trainer.formatting import MIB, one_line
from trainer.measure import metrics as M

log = logging.getLogger(__name__)


class PredictionCallback(L.Callback):
    """The estimator's figures for this run, taken at fit start; `summary(measured)` adds them and the errors."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.predicted: dict[str, float] = {}
        self.note: str | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from trainer.errors import UserError
        from trainer.estimate import measure, open_session
        from trainer.policies import build_policy

        model = getattr(pl_module, "model", pl_module)
        installed = getattr(model, "activation_policy", None) or pl_module.policy
        policy = build_policy(installed.cfg)  # its own object: the run's holds the run's state (offload's streams)
        if policy.caps.planned_first:
            policy.choose(model.activation_plan.treatments)  # the plan its planner chose for this run
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        session = None
        try:
            if getattr(pl_module, "pipeline", None) is not None:  # a pipeline rank: its own stages, on fake tensors
                self._predict_rank(trainer, pl_module)
                return
            session = open_session(self.config, pl_module.device.type)
            est = measure(session, policy, pl_module.loss_config)
        except UserError as e:  # the estimator's declared refusals (an op fake tensors cannot run, named): one line
            self.note = f"not predicted: {one_line(e)}"
            log.warning(self.note)
            return
        except Exception as e:  # anything else is the estimator's bug: said with its traceback, and the run goes on
            log.exception("the estimator failed on this run's configuration; the run goes on without its prediction")
            self.note = f"not predicted: the estimator failed ({type(e).__name__}: {one_line(e)}); traceback in the log"
            return
        finally:
            if session is not None:
                session.close()
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        self.predicted = {
            M.PREDICTED_ACTIVATION_PEAK_KEY: est.activation_bytes / MIB,
            M.PREDICTED_PEAK_TOTAL_KEY: est.peak_bytes / MIB,
        }
        if est.reserved_bytes is not None:  # a CUDA run: the caching allocator's reserve, replayed
            self.predicted[M.PREDICTED_PEAK_RESERVED_KEY] = est.reserved_bytes / MIB
        self._log(trainer, 0)

    def _predict_rank(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """This pipeline rank's steady-state step, as `python -m trainer.estimate` estimates each rank: its
        activations (the micro-batches in flight), and its total (parameters, AdamW's two states, the step's peak)."""
        from trainer.estimate.pipeline import estimate_pipeline_rank, rank_total

        figures = estimate_pipeline_rank(self.config, pl_module.pipeline, pl_module.pipeline_rank)
        self.predicted = {
            M.PREDICTED_ACTIVATION_PEAK_KEY: figures.activations / MIB,
            M.PREDICTED_PEAK_TOTAL_KEY: rank_total(figures) / MIB,
        }
        self._log(trainer, 0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer, trainer.global_step)  # the prediction as a line across the measured steps' chart

    def _log(self, trainer: L.Trainer, step: int) -> None:
        if not self.predicted:
            return
        for logger in trainer.loggers:
            logger.log_metrics({M.PREDICTED_TAGS[k]: v for k, v in self.predicted.items()}, step=step)

    def summary(self, measured: dict[str, Any]) -> dict[str, Any]:
        """The predicted figures and, for each measured figure the run has, the signed error (predicted − measured)
        / measured; nulls when there is no prediction (`measure.predict=false`, or the estimator's one-line why)."""
        if not self.predicted and self.note is None:
            return {}
        out: dict[str, Any] = {key: self.predicted.get(key) for key in M.PREDICTED_TAGS}
        for predicted, actual, error in M.PREDICTIONS:
            p, m = self.predicted.get(predicted), measured.get(actual)
            if p is not None and m:
                out[error] = (p - m) / m
            elif actual in measured:
                out[error] = None
        if self.note is not None:
            out[M.PREDICTION_NOTE] = self.note
        return out
