"""A configuration's plan: the planner run on the configured model (as a run builds it) and a random micro-batch of
the configured shape, on fake tensors (the estimator's session: a model of any size, bytes as measured, times as
the step-time model predicts them) or on real ones (the device the run would train on)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from trainer import precision as precision_
from trainer.core import build
from trainer.core.module import DecoderModule, param_groups
from trainer.core.schema import Config
from trainer.errors import PolicyError
from trainer.estimate.session import Session, measure, open_session
from trainer.formatting import MIB
from trainer.measure.time.roofline import Speed
from trainer.planner import PlanResult, choose, default_optimizer, head_candidates, plan_model, solve_profile
from trainer.policies import Plan, Policy, build_policy


def plan_module(
    config: Config, module: DecoderModule, policy: Policy, batch: Any, precision: str, speed: Speed | None = None
) -> PlanResult:
    """The planner on a built module and one micro-batch, with the run's optimizer kind, groups and clipping; on
    fake tensors its times are predicted for `speed` (default:
    trainer.measure.time.calibration.speed_for the device)."""
    policy.check(module.adapter.n_layer, module.adapter.attention)
    return plan_model(
        module.model,
        batch,
        policy,
        loss_fns=head_candidates(module, policy.cfg),
        precision=precision,
        accum=config.accum,
        make_optimizer=default_optimizer(config.optim.weight_decay),
        param_groups=param_groups(module.model, config.optim.weight_decay),
        grad_clip=config.trainer.grad_clip,
        speed=speed,
        compiled=config.trainer.compile,
    )


def plan_result_for_config(
    config: Config, device: torch.device | str | None = None, fake: bool = False, speed: Speed | None = None
) -> PlanResult:
    """`plan_model` on the configured model (seeded init, as a run builds it) and a random micro-batch of the
    configured shape (precision `auto` settled as a run settles it). `fake`: on fake tensors (the estimator's
    session), so a model of any size is planned without its memory: bytes are as measured, times are predicted
    for `speed` (trainer.measure.time.roofline). Under trainer.compile=true always on fake tensors: a compiled block is
    measured as the estimator compiles it (its generated code on fake tensors), which real tensors cannot run."""
    policy = build_policy(config.policy)
    if not policy.caps.planned_first:
        raise PolicyError(f"plan_for_config: policy={policy.cfg.name} has no planner; use policy=auto")
    if fake or config.trainer.compile:
        session = open_session(config, None if device is None else torch.device(device).type)
        with contextlib.closing(session):
            with session.active():
                for p in session.module.parameters():  # the profile measures its own state from none
                    p.grad = None
                step_precision = precision_.lightning_precision(session.precision, config.trainer)
                result = plan_module(config, session.module, policy, session.batches[0], step_precision, speed)
            return _compiled_whole(session, result) if config.trainer.compile else result
    facts = build.resolve(config, None if device is None else torch.device(device).type)
    device, chosen = torch.device(device if device is not None else facts.device), facts.precision
    cpu = torch.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        module = build.module(config, "none", hf_config=facts.hf_config)
        module = precision_.plugin(chosen, device.type).convert_module(module).to(device)
        vocab = module.adapter.head.weight.shape[0]
        g = torch.Generator().manual_seed(config.seed)
        shape = (config.batch_size, config.seq_len)
        batch = (
            torch.randint(0, vocab, shape, generator=g).to(device),
            torch.randint(0, vocab, shape, generator=g).to(device),
        )
    finally:
        torch.set_rng_state(cpu)
    return plan_module(config, module, policy, batch, chosen)


def compiled_plans(
    config: Config, budgets_mib: list[float], speed: Speed | None = None
) -> dict[float, PlanResult | str]:
    """policy=auto under trainer.compile=true at several budgets from one profile (as `plan_result_for_config` at
    each, without profiling again): {budget MiB: the plan, checked compiled whole, or the one-line refusal}."""
    session = open_session(config, None)
    out: dict[float, PlanResult | str] = {}
    with contextlib.closing(session):
        with session.active():
            for p in session.module.parameters():
                p.grad = None
            step_precision = precision_.lightning_precision(session.precision, config.trainer)
            policy = build_policy({**config.policy, "budget_mib": max(budgets_mib)})
            top = plan_module(config, session.module, policy, session.batches[0], step_precision, speed)
        configured = (top.configured_micro_batch, top.configured_accum)
        for budget in budgets_mib:
            result = choose(top.profile, int(budget * MIB), f"policy.budget_mib={budget:g}", configured)
            if result is None:
                out[budget] = f"policy auto: no plan fits policy.budget_mib={budget:g}"
                continue
            try:
                out[budget] = _compiled_whole(session, result)
            except PolicyError as e:
                out[budget] = str(e)
    return out


VERIFY_ROUNDS = 3


def _compiled_whole(session: Session, result: PlanResult) -> PlanResult:
    """A compiled plan checked against the whole model compiled. Its blocks were profiled compiled one at a time,
    but a run compiles the model whole, and inductor then schedules one block's recompute beside another's: the
    whole step can peak above the blocks' sum (measured on llama-tiny: op_sac +19 %, full +18 %). So the plan is
    estimated as the run will compile it, and while that is over the budget it is solved again with the difference
    added to the fixed memory (what a run does once it has measured), up to VERIFY_ROUNDS times; the plan that fits
    takes the whole's estimate as its predicted peak."""
    policy = build_policy(session.config.policy)
    for _ in range(VERIFY_ROUNDS):
        policy.choose(result.treatments)
        whole = measure(session, policy).peak_bytes
        excess = whole - result.solution.peak
        if whole <= result.budget or excess <= 0:
            result.notes.append(
                f"checked compiled whole: {whole / MIB:,.1f} MiB (the blocks' sum predicted "
                f"{result.solution.peak / MIB:,.1f} MiB), the plan's predicted peak"
            )
            # the run compiles the model whole: its peak is this estimate's, above or below the blocks' sum
            result.solution = dataclasses.replace(result.solution, peak=whole)
            return result
        configured = (result.configured_micro_batch, result.configured_accum)
        prof = result.profile.with_extra(result.profile.extra + excess)
        again = solve_profile(prof, result.budget, result.budget_text, configured, result.notes)
        if again is None:
            raise PolicyError(
                f"policy auto: compiled whole, the plan {result.plan.describe()} peaks at {whole / MIB:,.1f} MiB, over "
                f"{result.budget_text}, and no plan fits once the {excess / MIB:,.1f} MiB inductor adds is counted; "
                "raise the budget or train without trainer.compile"
            )
        again.notes.append(
            f"re-planned: compiled whole, {result.plan.describe()} peaked at {whole / MIB:,.1f} MiB; "
            f"{excess / MIB:,.1f} MiB added to the fixed memory"
        )
        result = again
    return result


def plan_for_config(
    config: Config, device: torch.device | str | None = None, fake: bool = False, speed: Speed | None = None
) -> tuple[Plan, str, str]:
    """What `python -m trainer.estimate policy=auto policy.budget_mib=…` prints: the plan, its loss head and its
    explanation.

    Builds the configured model and a random micro-batch of the configured shape (on CUDA when the config would
    train there, else CPU), profiles and solves exactly as training does at fit start (same function), so both
    arrive at the same plan up to timing noise between near-equal plans. Raises the one-line PolicyError when
    nothing fits.
    """
    result = plan_result_for_config(config, device, fake, speed)
    return result.plan, result.loss, result.text()


def planner_plan(config: Config, device: str, speed: Speed | None = None) -> tuple[Plan, str, str]:
    """A planned policy's plan, loss head and explanation (a PolicyError when none fits), profiled on fake tensors
    like the rest of the estimate: bytes as a run measures them, step times predicted for `speed` by the step-time
    model (a run plans on measured times, so near-equal plans may differ)."""
    return plan_for_config(config, device, fake=True, speed=speed)
