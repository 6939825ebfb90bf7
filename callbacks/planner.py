"""`policy=auto` in a run: plan at fit start, explain, verify against the measured peak, re-plan once if over.

At `on_fit_start` (the model is on its device, the optimizer exists, the train loader is not built yet) the
callback takes the first micro-batch the datamodule would serve, profiles and solves (trainer/planner/), installs
the plan with `apply_policy` (per-block treatments under the hood) and logs the explanation: to the console, as
TensorBoard text (`policy/auto`) with two scalars (`auto/budget_mib`, `auto/predicted_peak_mib`), and as a dict
for summary.json (`summary()`). With `policy.allow_accum=true` and a halved micro-batch, it sets the datamodule's
batch size and the trainer's accumulation (and validation interval, counted in micro-batches) before the loaders
are built, so the run trains the same tokens per step.

After the first measured steady step (MeasureCallback's `memory/peak_total_mib`, step ≥ 2: last step's gradients
and the optimizer state exist) it compares measured with predicted. Over the budget: it re-plans ONCE with the
measured excess added to the fixed memory, installs the new plan and says so; if even that cannot fit, it keeps
the most frugal plan and says that. Profiling leaves the RNG as it found it, so dropout masks, and therefore
losses and gradients, are the same as under any other policy.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import lightning as L
import torch

from callbacks.measure import MeasureCallback
from trainer.formatting import MIB
from trainer.loss import LossConfig
from trainer.measure import metrics as M
from trainer.planner import (
    PeakModel,
    PlanResult,
    default_optimizer,
    describe,
    frugal_result,
    head_candidates,
    plan_model,
    solve_profile,
)
from trainer.policies import Policy, PolicyError, apply_policy

log = logging.getLogger(__name__)

STEADY_STEP = 2  # the first optimizer step whose start has last step's gradients and the optimizer state


class AutoPlanCallback(L.Callback):
    """Plans `policy=auto` at fit start, logs the plan, verifies it, re-plans once; the auto policy brings it
    (its `brings`, made by `policy.callbacks()`). `policy`: the one it plans (None: the auto policy installed on
    the model it meets).
    A no-op for other policies."""

    def __init__(self, policy: Policy | None = None, config: Any = None) -> None:
        self.policy = policy
        self.config = config  # the run's; needed to plan a compiled run (on the estimator's fake tensors)
        self.result: PlanResult | None = None
        self.replanned = False
        self.first_plan: dict[str, Any] | None = None
        self.measured_before_replan_mib: float | None = None
        self.measured_mib: list[float] = []  # peak_total_mib of steady measured steps under the current plan
        self.step_ms: list[float] = []
        self._seen = 0
        self._verified = False
        self._model: torch.nn.Module | None = None

    # --- planning -------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = getattr(pl_module, "model", pl_module)
        policy = getattr(model, "activation_policy", None)
        if policy is None or policy.cfg.name != "auto" or (self.policy is not None and policy is not self.policy):
            return
        if any(c is not self and isinstance(c, AutoPlanCallback) and c.result is not None for c in trainer.callbacks):
            return  # another planner in this Trainer planned this model first
        self._model = model
        if getattr(pl_module, "_compiled", False):
            result = self._plan_compiled(pl_module)
        else:
            result = self._plan(trainer, pl_module, model, policy)
        result = self._agree_across_ranks(trainer, result)
        if (result.micro_batch, result.accum) != (result.configured_micro_batch, result.configured_accum):
            self._change_micro_batch(trainer, result)
        self.result = result
        self.first_plan = result.to_dict()
        policy.choose(result.treatments)
        apply_policy(model, policy)
        self._use_loss(pl_module, result)
        self._explain(trainer, result, tag=M.AUTO_PLAN_TEXT)

    def _plan_compiled(self, pl_module: L.LightningModule) -> PlanResult:
        """Under trainer.compile=true: the plan the estimator makes for this run's configuration, each block profiled
        as inductor compiles it, on fake tensors (a dispatch mode cannot watch a real compiled block: dynamo would run
        it eagerly), its times predicted for this device (trainer.measure.time.calibration.speed_here)."""
        if self.config is None:
            raise PolicyError(
                "policy auto under trainer.compile=true plans from the run's configuration; build its callbacks with "
                "policy.callbacks(config)"
            )
        from trainer.estimate import plan_result_for_config
        from trainer.measure.time.calibration import speed_here

        return plan_result_for_config(self.config, pl_module.device, fake=True, speed=speed_here(pl_module.device))

    def _plan(
        self, trainer: L.Trainer, pl_module: L.LightningModule, model: torch.nn.Module, policy: Policy
    ) -> PlanResult:
        """The plan from a profile of the real model on the first micro-batch the datamodule would serve."""
        batch = self._first_batch(trainer, pl_module)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        make_optimizer = (lambda groups: type(optimizer)(groups)) if optimizer is not None else default_optimizer()
        return plan_model(
            model,
            batch,
            policy,
            loss_fns=head_candidates(pl_module, policy.cfg),
            precision=str(trainer.precision),
            accum=trainer.accumulate_grad_batches,
            make_optimizer=make_optimizer,
            param_groups=optimizer.param_groups if optimizer is not None else None,
            grad_clip=float(trainer.gradient_clip_val or 0.0),
            # a resumed run's optimizer state, already on the device (the profile measures its own)
            resident=[
                v for o in trainer.optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)
            ],
        )

    @staticmethod
    def _use_loss(pl_module: L.LightningModule, result: PlanResult) -> None:
        """Train with the loss head the plan was solved with (another one only when the configured does not fit)."""
        current = pl_module.loss_config
        if result.loss and result.loss != current.name:
            pl_module.loss_config = LossConfig(result.loss, current.chunk_tokens, current.ignore_index)

    @staticmethod
    def _first_batch(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[torch.Tensor, torch.Tensor]:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "train_dataloader"):
            raise PolicyError("policy auto needs a datamodule to draw its profiling micro-batch from")
        # A fresh loader with its own seeded generator: the global RNG and the training loader are untouched.
        idx, tgt = next(iter(dm.train_dataloader()))
        return idx.to(pl_module.device), tgt.to(pl_module.device)

    @staticmethod
    def _agree_across_ranks(trainer: L.Trainer, result: PlanResult) -> PlanResult:
        """Timings differ per process; every rank runs rank 0's plan (predicted on its own profile)."""
        if trainer.world_size == 1:
            return result
        chosen, loss = trainer.strategy.broadcast((list(result.treatments), result.loss), src=0)
        if loss != result.loss:
            result.profile = result.profile.heads.get(loss, result.profile)
        if tuple(chosen) != result.treatments or loss != result.loss:
            result.solution = PeakModel(result.profile).evaluate(chosen)
        return result

    @staticmethod
    def _change_micro_batch(trainer: L.Trainer, result: PlanResult) -> None:
        factor = result.accum // result.configured_accum
        dm = trainer.datamodule
        dm.batch_size = result.micro_batch
        trainer.accumulate_grad_batches = result.accum
        if isinstance(trainer.val_check_interval, int):
            trainer.val_check_interval *= factor

    # --- explaining -----------------------------------------------------------------------------------------------
    def _explain(self, trainer: L.Trainer, result: PlanResult, tag: str, preface: str = "") -> None:
        text = (preface + "\n" if preface else "") + result.text()
        if not trainer.is_global_zero:
            return
        for line in text.splitlines():
            log.info(line)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                # TensorBoard renders text as markdown: keep line breaks outside the tables.
                experiment.add_text(tag, _markdown(text), global_step=trainer.global_step)
            logger.log_metrics(
                {M.AUTO_BUDGET: result.budget / MIB, M.AUTO_PREDICTED_PEAK: result.solution.peak / MIB},
                step=trainer.global_step,
            )

    # --- verifying ------------------------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.result is None:
            return
        measure = next((c for c in trainer.callbacks if isinstance(c, MeasureCallback)), None)
        if measure is None:
            return
        fresh = measure.records[self._seen :]
        self._seen = len(measure.records)
        for record in fresh:
            if record["step"] < STEADY_STEP:
                continue
            if not record.get("tracked") and M.STEP_MS in record:
                self.step_ms.append(record[M.STEP_MS])
            value = record.get(M.PEAK_TOTAL)
            if value is None:
                continue
            if not self._verified:
                self._verified = True
                if value * MIB > self.result.budget and not self.replanned:
                    self._replan(trainer, value)
                    continue
            self.measured_mib.append(value)

    def _replan(self, trainer: L.Trainer, measured_mib: float) -> None:
        assert self.result is not None and self._model is not None
        old = self.result
        excess = int(measured_mib * MIB) - old.solution.peak
        prof = old.profile.with_extra(old.profile.extra + max(0, excess))
        configured = (old.configured_micro_batch, old.configured_accum)
        new = solve_profile(prof, old.budget, old.budget_text, configured, old.notes)
        fits = new is not None
        if new is None:
            new = frugal_result(prof, old.budget, old.budget_text, configured)
        new.notes = list(old.notes)
        self.result = new
        self.replanned = True
        self.measured_before_replan_mib = measured_mib
        self.step_ms.clear()
        policy = self._model.activation_policy
        policy.choose(new.treatments)
        apply_policy(self._model, policy)
        preface = (
            f"policy=auto: measured peak {measured_mib:,.1f} MiB is over the budget {old.budget / MIB:,.1f} MiB "
            f"(predicted {old.solution.peak / MIB:,.1f} MiB for {describe(old.solution.treatments)}); re-planned once "
            "with the "
            f"excess {max(0, excess) / MIB:,.1f} MiB added to the fixed memory"
            + ("" if fits else "; even so nothing fits: running the most frugal plan")
        )
        if not fits:
            log.error(preface)
        self._explain(trainer, new, tag=M.AUTO_REPLAN_TEXT, preface=preface)

    # --- the summary ----------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """{"auto": {...}} for summary.json (empty for other policies)."""
        if self.result is None:
            return {}
        out = self.result.to_dict()
        out.update(
            {
                "measured_peak_mib": max(self.measured_mib) if self.measured_mib else None,
                "measured_step_ms": statistics.median(self.step_ms) if self.step_ms else None,
                "replanned": self.replanned,
            }
        )
        if self.replanned:
            out["measured_before_replan_mib"] = self.measured_before_replan_mib
            out["first_plan"] = (
                {k: self.first_plan[k] for k in ("plan", "predicted_peak_mib", "predicted_step_ms")}
                if self.first_plan
                else None
            )
        return {M.AUTO: out}


def _markdown(text: str) -> str:
    """Console text → TensorBoard markdown: plain lines become paragraphs, table lines stay together."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("|") or not line:
            out.append(line)
        else:
            out.append(line + "  ")
    return "\n".join(out)
