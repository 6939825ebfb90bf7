"""The planner's two verbs and what they share with the run: `profile_model` (a model as the planner sees it) and
`choose` (the fastest plan under a budget, from a profile), and `plan_model`, both with the fallbacks of
`policy=auto` (another loss head, a smaller micro-batch) and its one-line refusal."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from models.adapter import adapter_for
from trainer.errors import PolicyError
from trainer.formatting import MIB
from trainer.measure.time.roofline import Speed
from trainer.planner.explain import PlanResult, refusal
from trainer.planner.peak import PeakModel, Profile
from trainer.planner.profiler import profile
from trainer.policies import Policy, build_policy

Batch = tuple[torch.Tensor, torch.Tensor]
LossFns = Mapping[str, Callable[[Batch], torch.Tensor]]


def budget_bytes(cfg: Any, device: torch.device | str) -> tuple[int, str]:
    """The configured budget in bytes and how it was given; a one-line PolicyError when it cannot be resolved."""
    given = cfg.budgets_given  # AutoConfig's
    if len(given) != 1:
        raise PolicyError(
            "policy auto: give exactly one budget: policy.budget_mib=…, policy.budget_gb=… or "
            f"policy.budget_fraction=… (got {', '.join(given) or 'none'})"
        )
    key = given[0]
    value = getattr(cfg, key)
    if key == "budget_mib":
        return int(value * MIB), f"policy.budget_mib={value:g}"
    if key == "budget_gb":
        return int(value * 1e9), f"policy.budget_gb={value:g}"
    device = torch.device(device)
    if device.type != "cuda":
        raise PolicyError(
            f"policy auto: policy.budget_fraction={value:g} is a fraction of a CUDA device's memory and this run is "
            f"on {device.type}; give policy.budget_mib=… instead"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    return int(value * total), f"policy.budget_fraction={value:g} of {total / MIB:,.0f} MiB"


def candidate_treatments(policy: Policy, attention: str, device_type: str) -> tuple[tuple[str, ...], list[str]]:
    """The configured candidates that differ on this model and device, and a note for each one dropped (each
    treatment says itself when it would change nothing: `Policy.unavailable`)."""
    notes = []
    out = []
    candidates = policy.cfg.treatment_candidates
    for t in dict.fromkeys(candidates):
        why = policy.treatment_policy(t).unavailable(attention, device_type)
        if why:
            notes.append(f"{t} left out: {why}")
            continue
        out.append(t)
    if not out:
        raise PolicyError(
            f"policy auto: no candidate treatment applies here (policy.candidates={list(candidates)}); "
            "include none, op_sac or full"
        )
    return tuple(out), notes


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Profiling draws dropout masks; training must draw the same ones as without it."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def default_optimizer(weight_decay: float = 0.1) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    return lambda groups: torch.optim.AdamW(groups, lr=0.0, weight_decay=weight_decay)


def head_candidates(module: Any, cfg: Any) -> dict[str, Callable[[Batch], torch.Tensor]]:
    """{loss head: the module's training forward under it}: the module's configured head first, then each of
    `cfg.loss_candidates` (auto's) with the same chunk size."""
    configured = module.loss_config
    names = [configured.name] + [n for n in (cfg.loss_candidates or []) if n != configured.name]
    return {name: functools.partial(module.loss_of, loss=replace(configured, name=name)) for name in names}


def profile_model(
    model: nn.Module,
    batch: Batch,
    policy: Policy,
    *,
    loss_fns: LossFns,
    precision: str,
    accum: int,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    param_groups: list[dict[str, Any]] | None = None,
    grad_clip: float = 0.0,
    resident: Sequence[torch.Tensor] = (),
    timing: bool = True,
    speed: Speed | None = None,
    compiled: bool = False,
) -> Profile:
    """The planner's view of `model` on `batch` under `policy`'s candidates (auto's config), one Profile per loss
    head in `loss_fns` (the configured head first); the RNG is left as it was found. `compiled`: the blocks as
    trainer.compile=true compiles them (fake tensors only: `profile`)."""
    treatments, notes = candidate_treatments(policy, adapter_for(model).attention, batch[0].device.type)
    with preserved_rng(batch[0].device):
        prof = profile(
            model,
            batch,
            loss_fn=loss_fns,
            precision=precision,
            make_optimizer=make_optimizer,
            param_groups=param_groups,
            accum=accum,
            treatments=treatments,
            policy=policy,
            repeats=policy.cfg.profile_repeats,
            warmup=policy.cfg.profile_warmup,
            grad_clip=grad_clip,
            timing=timing,
            resident=resident,
            speed=speed,
            compiled=compiled,
        )
    for p in prof.heads.values():
        p.notes[:0] = notes
    return prof


def solve_profile(
    prof: Profile, budget: int, budget_text: str, configured: tuple[int, int], notes: Sequence[str] = ()
) -> PlanResult | None:
    """The fastest plan of this one profile (one loss head) that fits, or None."""
    model = PeakModel(prof)
    sol = model.solve(budget)
    if sol is None:
        return None
    uniform = {t: model.evaluate([t] * prof.n_layer) for t in prof.treatments}
    return PlanResult(
        prof, budget, budget_text, sol, uniform, prof.micro_batch, prof.accum, *configured, notes=list(notes)
    )


def frugal_result(prof: Profile, budget: int, budget_text: str, configured: tuple[int, int]) -> PlanResult:
    """The least-peak plan, marked as not fitting (what a re-plan falls back to)."""
    model = PeakModel(prof)
    sol = model.min_peak()
    uniform = {t: model.evaluate([t] * prof.n_layer) for t in prof.treatments}
    return PlanResult(prof, budget, budget_text, sol, uniform, prof.micro_batch, prof.accum, *configured, fits=False)


def choose(prof: Profile, budget: int, budget_text: str, configured: tuple[int, int]) -> PlanResult | None:
    """The plan `policy=auto` takes from this profile at this budget: the configured loss head's fastest plan that
    fits; else the fastest that fits with another head (a chunked head frees the logits: "when the budget needs
    it"); else None."""
    heads = list(prof.heads.values()) or [prof]
    first = solve_profile(heads[0], budget, budget_text, configured)
    if first is not None:
        return first
    others = [r for h in heads[1:] if (r := solve_profile(h, budget, budget_text, configured))]
    if not others:
        return None
    best = min(others, key=lambda r: r.solution.step_ms)
    best.notes.append(f"loss head {best.loss}: no plan fits with the configured {heads[0].loss}")
    return best


def plan_model(model: nn.Module, batch: Batch, cfg: Any, *, accum: int, **measure: Any) -> PlanResult:
    """Profile `model` on `batch`, choose for `cfg`'s budget (auto's config) and return the plan; a one-line
    PolicyError otherwise. `measure`: `profile_model`'s keywords (loss_fns, precision, make_optimizer, ...).

    With cfg.allow_accum, when nothing fits, the micro-batch is halved (accumulation doubled, same tokens per
    step) and profiled again, as long as it halves evenly. The RNG is left as it was found.
    """
    idx, tgt = batch
    policy = build_policy(cfg) if not isinstance(cfg, Policy) else cfg
    budget, budget_text = budget_bytes(policy.cfg, idx.device)
    configured = (idx.shape[0], accum)

    def run(b: int, acc: int, timing: bool = True) -> Profile:
        return profile_model(model, (idx[:b], tgt[:b]), policy, accum=acc, timing=timing, **measure)

    b, acc = configured
    prof = first = run(b, acc)
    small: Profile | None = None
    tried: list[int] = []
    while True:
        result = choose(prof, budget, budget_text, configured)
        if result is not None:
            return result
        if not (policy.cfg.allow_accum and b % 2 == 0):
            break
        b, acc = b // 2, acc * 2
        prof = run(b, acc)
        tried.append(b)
        small = small or prof
    if small is None and first.micro_batch > 1:
        small = run(first.micro_batch // 2, accum, timing=False)  # bytes at a second size: the affine fit
    head = min(first.heads.values() or [first], key=lambda h: PeakModel(h).min_peak().peak)
    small_head = None if small is None else (small.heads.get(head.loss) or small)
    raise PolicyError(refusal(head, budget, budget_text, small_head, tried))
