"""The memory-budget planner behind `policy=auto`: profile one real micro-batch, choose exactly, explain.

    profile_model(model, batch, policy, ...) -> Profile      what each block keeps and needs under each treatment
    choose(profile, budget, ...)             -> PlanResult   the fastest plan whose predicted peak fits, or None
    plan_model(model, batch, cfg, ...)       -> PlanResult   both, with auto's fallbacks, or a one-line PolicyError

Inside: `peak` (what a Profile holds, the peak model of any per-block plan and its exact solver: no torch),
`profiler` (measuring a Profile through the step's own pieces and the normal install path), `explain` (the plan
as text and as a dict, the refusal) and `plan` (the verbs). The configuration-level entry (a config → a plan, on
fake tensors or real ones) is the estimator's: `trainer.estimate.plan_for_config`.
"""

from trainer.planner.choose import (
    budget_bytes,
    candidate_treatments,
    choose,
    default_optimizer,
    frugal_result,
    head_candidates,
    plan_model,
    preserved_rng,
    profile_model,
    solve_profile,
)
from trainer.planner.explain import PlanResult, describe, refusal
from trainer.planner.peak import (
    BOOKKEEPING,
    Cost,
    PeakModel,
    Profile,
    Solution,
    affine_profile,
    largest_micro_batch,
    smallest_budget_mib,
)
from trainer.planner.profiler import profile

__all__ = [
    "BOOKKEEPING",
    "Cost",
    "PeakModel",
    "PlanResult",
    "Profile",
    "Solution",
    "affine_profile",
    "budget_bytes",
    "candidate_treatments",
    "choose",
    "default_optimizer",
    "describe",
    "frugal_result",
    "head_candidates",
    "largest_micro_batch",
    "plan_model",
    "preserved_rng",
    "profile",
    "profile_model",
    "refusal",
    "smallest_budget_mib",
    "solve_profile",
]
