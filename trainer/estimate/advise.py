"""What to change when a configuration does not fit its budget (and on request, `--advise`): where the step's peak
sits, then every change the estimator can price that makes it fit — each registered policy, each loss head, the
micro-batch × accum splits at the same tokens per step, `policy=auto`'s plan at the budget, and the smallest FSDP2
world size — each with its per-device peak, its compute (FLOPs × the configured) and the command to run it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainer.core.resolve import sharded_world
from trainer.core.schema import Config
from trainer.errors import UserError
from trainer.estimate.config_plan import planner_plan
from trainer.estimate.fit import fit_table
from trainer.estimate.session import Estimate, Session, group_labels, measure, open_session
from trainer.formatting import MIB
from trainer.measure.gpus import Gpu, Reserve
from trainer.measure.time.roofline import Speed
from trainer.policies import POLICIES, build_policy


@dataclass(frozen=True)
class Advice:
    change: str
    overrides: tuple[str, ...]  # what the command sets, beside the user's other overrides
    peak_bytes: int | None  # one device's whole-step peak
    flops_ratio: float | None  # FLOPs per optimizer step × the configured (per device)
    fits: bool
    note: str = ""

    def command(self, user: Sequence[str]) -> str:
        return "python train.py " + " ".join(with_overrides(user, self.overrides))

    def to_json(self, user: Sequence[str]) -> dict[str, Any]:
        return {
            "change": self.change,
            "command": self.command(user),
            "peak_bytes": self.peak_bytes,
            "flops_ratio": self.flops_ratio,
            "fits": self.fits,
            "note": self.note,
        }


def with_overrides(user: Sequence[str], changes: Sequence[str]) -> list[str]:
    """The user's overrides with `changes` in place of those they set: a new `policy=` drops the old `policy.k=2`
    with it (the parameters belong to the policy they were given for)."""
    keys = [c.split("=", 1)[0].lstrip("+~") for c in changes]
    groups = [k for k in keys if "." not in k]

    def replaced(o: str) -> bool:
        k = o.split("=", 1)[0].lstrip("+~")
        return k in keys or any(k.startswith(g + ".") for g in groups)

    return [o for o in user if not replaced(o)] + list(changes)


_PHASES = {
    "head": "in the loss head (final norm, logits and their gradient)",
    "backward": "in the backward (gradients in flight, a recomputed segment's working set)",
    "optimizer": "in the optimizer step (clipping and AdamW's temporaries beside the state)",
    "embedding": "in the embedding",
    "later micro-batches": "in a later micro-batch",
}


def where_the_peak_is(est: Estimate) -> str:
    """One line: the phase that sets the step's peak and what holds most of it then."""
    at = est.total_peak_at
    phase = (
        f"at the end of layer {at.split()[1]}'s forward (activations kept for backward)"
        if at.startswith("layer ")
        else _PHASES.get(at, f"in {at or 'the step'}")
    )
    parts = sorted(group_labels(est.at_step_peak).items(), key=lambda kv: -kv[1])
    most = ", ".join(f"{label} {v / 2**30:,.2f} GiB" for label, v in parts[:2])
    return f"the step peaks {phase} at {est.peak_bytes / 2**30:,.2f} GiB; most of it: {most}"


def advise(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int,
    max_world: int = 64,
    workers: int = 1,
    speed: Speed | None = None,
) -> list[Advice]:
    """Every priced change, those that fit first, each group ordered by compute. `speed`: the device `policy=auto`
    plans its step times for (the estimate's `--gpu`; None: the device's default, trainer.measure.time.roofline)."""
    config, base = session.config, est.flops
    rows: list[Advice] = []
    usable = session.release_group()  # the changes below open sessions of their own, FSDP2's among them
    for name, e in table.items():
        if name != est.policy and isinstance(e, Estimate):
            rows.append(_row(f"policy={name}", (f"policy={name}",), e, base, budget))
    for name, e in losses.items():
        if name != est.loss and isinstance(e, Estimate):
            rows.append(_row(f"loss={name}", (f"loss={name}",), e, base, budget))
    rows += _splits(config, session.device, base, budget)
    rows += _auto(config, session.device, usable, base, budget, speed)
    rows += _world(config, session.device, usable, est, base, budget, max_world, workers)
    return sorted(rows, key=lambda a: (not a.fits, a.flops_ratio or math.inf, a.peak_bytes or math.inf))


def _row(change: str, overrides: tuple[str, ...], e: Estimate, base: float, budget: int, note: str = "") -> Advice:
    return Advice(change, overrides, e.peak_bytes, e.flops / base, e.peak_bytes <= budget, note)


def _splits(config: Config, device: str, base: float, budget: int) -> list[Advice]:
    """Smaller micro-batches, more of them: the same tokens per optimizer step, each estimated."""
    rows = []
    b, a = config.batch_size, config.accum
    for k in (k for k in range(2, b + 1) if b % k == 0):
        split = replace(config, batch_size=b // k, accum=a * k)
        session = open_session(split, device)
        try:
            e = measure(session, build_policy(config.policy))
        finally:
            session.close()
        change = f"micro-batch {b // k} × accum {a * k}"
        rows.append(_row(change, (f"batch_size={b // k}", f"accum={a * k}"), e, base, budget))
    return rows


def _auto(
    config: Config, device: str, session: Session | None, base: float, budget: int, speed: Speed | None = None
) -> list[Advice]:
    """policy=auto's plan at the budget, as the estimator plans it, measured on `session` (or a new one)."""
    budget_mib = math.floor(budget / MIB)
    policy = build_policy({"name": "auto", "budget_mib": budget_mib})
    planned = replace(config, policy=policy.cfg)
    overrides = ("policy=auto", f"policy.budget_mib={budget_mib}")
    try:
        plan, loss_name, _ = planner_plan(planned, device, speed)
    except UserError as e:
        return [Advice("policy=auto at the budget", overrides, None, None, False, str(e).splitlines()[0])]
    policy.choose(plan.treatments)
    loss = replace(config.loss, name=loss_name) if loss_name else None
    own = session or open_session(config, device)
    try:
        e = measure(own, policy, loss)
    finally:
        if own is not session:
            own.close()
    if loss_name and loss_name != config.loss.name:
        overrides += (f"loss={loss_name}",)
    return [_row(f"policy=auto: {plan.describe()}", overrides, e, base, budget)]


def _world(
    config: Config,
    device: str,
    session: Session | None,
    est: Estimate,
    base: float,
    budget: int,
    max_world: int,
    workers: int,
) -> list[Advice]:
    """The smallest FSDP2 world size at which one rank of the configured policy and head fits the budget."""
    name = est.policy
    if POLICIES[name].caps.planned_first or config.trainer.compile:
        # auto plans for its own budget on one device; a compiled step is estimated on one device only
        return []
    table = fit_table(
        config,
        device,
        [Gpu("budget", budget)],
        Reserve(),
        [name],
        max_world=max_world,
        workers=workers,
        session=session,
        known={sharded_world(config): {name: est}},
    )
    cell = table.cells[0]
    if cell.world_size is None:
        return [
            Advice(
                f"FSDP2 up to {max_world} ranks",
                ("trainer=fsdp2",),
                None,
                None,
                False,
                f"does not fit at ≤ {max_world} ranks",
            )
        ]
    if cell.world_size == 1:
        return []
    w = cell.world_size
    note = f"{w} GPUs; each rank runs the micro-batch, so a step takes {w}× the tokens (lower accum to keep them)"
    return [
        Advice(
            f"FSDP2 on {w} ranks",
            ("trainer=fsdp2", f"trainer.devices={w}"),
            cell.per_rank_peak_bytes,
            est.flops / base,
            True,
            note,
        )
    ]


__all__ = ["Advice", "advise", "where_the_peak_is", "with_overrides"]
