"""How faithful a target's settings are to our plan, and what the difference costs.

For one target version: its candidates (the plans it can write for this model), the one it writes (the exact one,
or the closest), a fidelity row per element of our plan and one for the loss head, and, where a row is not exact,
the estimator's figures for our plan and the closest side by side, measured on the same session.

The closest expressible plan is the one a user can run in our plan's place: among the candidates whose whole-step
peak is no higher than ours (it fits wherever ours fits), the one with the fewest FLOPs; when none is that low, the
one with the lowest peak. PlanFigures, not a rule about treatments, decide it, because a group of blocks or an offloaded
block has no fixed place in an order of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer.errors import PolicyError
from trainer.estimate import Estimate, Session, measure
from trainer.estimate.tables import quiet_policy_notices
from trainer.export.spec import (
    APPROX,
    EXACT,
    NOT,
    TARGETS,
    Candidate,
    Element,
    ExportInput,
    ExportRefused,
    LossMap,
    Status,
    Target,
    Version,
    describe_blocks,
    elements,
    settings_line,
)
from trainer.formatting import MIB
from trainer.policies import Plan, Policy, PolicyConfig


@dataclass
class Row:
    element: str
    status: Status
    how: str


@dataclass
class PlanFigures:
    """The estimator's three figures for one plan and loss head (one optimizer step)."""

    plan: str
    loss: str
    activation_bytes: int
    peak_bytes: int
    flops: int

    @classmethod
    def of(cls, est: Estimate) -> PlanFigures:
        return cls(est.plan, est.loss, est.activation_bytes, est.peak_bytes, est.flops)


@dataclass
class TargetSettings:
    """One target version's answer: the settings it writes, their fidelity, and the figures where they differ."""

    target: Target
    version: Version
    chosen: Candidate
    loss: LossMap
    rows: list[Row]
    text: str
    ours: PlanFigures | None = None
    closest: PlanFigures | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Status:
        statuses = {r.status for r in self.rows}
        return NOT if NOT in statuses else APPROX if APPROX in statuses else EXACT


class PlanPolicy(Policy):
    """A fixed plan measured as a policy: the closest plan a target can write. Its treatments are ours (with the
    configured parameters, from `source`) or the target's own (`custom`, e.g. torchtitan's per-op policy)."""

    name = "export"

    def __init__(self, label: str, plan: Plan, source: Policy, custom: dict[str, Policy] | None = None) -> None:
        super().__init__(PolicyConfig(name=label))
        self._plan, self._source, self._custom = plan, source, dict(custom or {})

    def plan(self, n_layer: int) -> Plan:
        return self._plan

    def check(self, n_layer: int, attention: str) -> None:
        if self._plan.n_layer != n_layer:
            raise PolicyError(f"{self.cfg.name}: the plan covers {self._plan.n_layer} blocks, the model {n_layer}")

    def treatment_policy(self, name: str) -> Policy:
        return self._custom[name] if name in self._custom else self._source.treatment_policy(name)


class Measurer:
    """The session's measurements, each plan and head once. Measuring several plans prints no treatment's one-time
    notice (offload on CPU, selective under SDPA): the rows say what runs."""

    def __init__(self, session: Session, ctx: ExportInput) -> None:
        self.session, self.ctx = session, ctx
        self._done: dict[tuple[str, str, tuple[str, ...]], PlanFigures] = {}

    def ours(self) -> PlanFigures:
        return self._measure(self.ctx.policy, self.ctx.plan, self.ctx.loss.name)

    def candidate(self, c: Candidate, loss_name: str) -> PlanFigures | None:
        policy = PlanPolicy(c.label, c.plan, self.ctx.policy, c.custom)
        try:
            return self._measure(policy, c.plan, loss_name)
        except PolicyError:  # a plan this model cannot take (e.g. groups in a loop that cannot group them)
            return None

    def _measure(self, policy: Policy, plan: Plan, loss_name: str) -> PlanFigures:
        # by what runs: one plan string with another treatment config (torchtitan_sac's two versions) is another plan
        runs = tuple(sorted({repr(policy.treatment_policy(t).cfg) for t in plan.treatments}))
        key = (plan.describe(), loss_name, runs)
        if key not in self._done:
            loss = replace(self.ctx.loss, name=loss_name)
            with quiet_policy_notices():
                self._done[key] = PlanFigures.of(measure(self.session, policy, loss))
        return self._done[key]


def closest(cands: list[Candidate], ours: PlanFigures, figures: list[PlanFigures | None]) -> int:
    """The index of the closest expressible candidate (see the module's docstring)."""
    measured = [(i, f) for i, f in enumerate(figures) if f is not None]
    if not measured:
        raise ExportRefused("no plan the target can write runs on this model")
    fitting = [(i, f) for i, f in measured if f.peak_bytes <= ours.peak_bytes]
    if fitting:
        return min(fitting, key=lambda x: (x[1].flops, x[1].activation_bytes, x[0]))[0]
    return min(measured, key=lambda x: (x[1].peak_bytes, x[0]))[0]


def refuse_if_inexpressible(target: Target, ctx: ExportInput, version: Version, explicit: bool) -> None:
    """A plan no element of which the target can run, even approximately, is refused in one line naming the targets
    that can run it (the registry's)."""
    work: list[Element] = [e for e in ctx.elements if e.treatment != "none"] or ctx.elements
    if any(target.can(e, ctx, version) for e in work):
        return
    others = [
        f"--to {n}" for n, t in TARGETS.items() if n != target.name and all(t.can(e, ctx, t.versions[0]) for e in work)
    ]
    flag = f" --target-version {version.key}" if explicit else ""
    if others:
        what = (f"{', '.join(others[:-1])} or {others[-1]}" if len(others) > 1 else others[0]) + " can"
    else:
        what = "no target here can; policy=full exports to every one"
    raise ExportRefused(
        f"--to {target.name}{flag}: policy={ctx.policy.cfg.name} ({ctx.plan.describe()}) cannot be expressed: "
        f"{target.why_not(work[0], ctx, version)}; {what}"
    )


def rows(target: Target, ctx: ExportInput, version: Version, chosen: Candidate, loss: LossMap) -> list[Row]:
    """A fidelity row per element of our plan, split where the chosen candidate runs its blocks differently, and one
    for the loss head."""
    parts = [part for e in ctx.elements for part in _parts(e, chosen.does)]
    out = _merged([(part, _row(target, ctx, version, chosen.does, part)) for part in parts])
    out.append(Row(f"loss head: {ctx.loss_text}", loss.status, loss.how))
    return out


def _merged(found: list[tuple[Element, Row]]) -> list[Row]:
    """Rows that say the same of the same treatment, one row naming all their blocks ("blocks 1, 3, 5: full")."""
    groups: dict[tuple[str, int, str, str], list[Element]] = {}
    for part, row in found:
        groups.setdefault((part.treatment, part.group, row.status, row.how), []).append(part)
    out = []
    for (treatment, group, status, how), parts in groups.items():
        whole = Element(parts[0].start, parts[-1].stop, treatment, group)
        if all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False)):
            out.append(Row(whole.label(), status, how))
            continue
        spans = ", ".join(str(p.start) if p.stop - p.start == 1 else f"{p.start}-{p.stop - 1}" for p in parts)
        out.append(Row(f"blocks {spans}: {whole.what()}", status, how))
    return out


def _parts(e: Element, runs: Plan) -> list[Element]:
    """Our element cut where the candidate's own elements begin or end inside it."""
    cuts = sorted({e.start, e.stop} | {x for f in elements(runs) for x in (f.start, f.stop) if e.start < x < e.stop})
    return [Element(a, b, e.treatment, e.group) for a, b in zip(cuts, cuts[1:], strict=False)]


def _row(target: Target, ctx: ExportInput, version: Version, runs: Plan, e: Element) -> Row:
    ours = [(s.start, s.stop) for s in ctx.plan.segments if s.start < e.stop and s.stop > e.start]
    theirs = [s for s in runs.segments if s.start < e.stop and s.stop > e.start]
    same = ours == [(s.start, s.stop) for s in theirs]
    kinds = {s.treatment for s in theirs}
    found: tuple[Status, str] | None = None
    if same and kinds == {e.treatment}:
        found = target.fidelity(e, ctx, version)
    elif same and len(kinds) == 1 and (text := target.similar(e, next(iter(kinds)), ctx, version)):
        found = (APPROX, text)
    if found is None:
        why = target.why_not(e, ctx, version)
        found = (NOT, f"{why}; the closest plan runs them as {describe_blocks(runs, e.blocks)}")
    return Row(e.label(), *found)


def export_form(
    target: Target, ctx: ExportInput, version: Version, measurer: Measurer, explicit: bool
) -> TargetSettings:
    """One target version's settings for our plan, their fidelity and, where they differ, the figures.

    The candidate written: the one that runs our plan as it is, else the closest (module docstring) among those that
    run every element at least approximately, else among all."""
    refuse_if_inexpressible(target, ctx, version, explicit)
    cands = target.candidates(ctx, version)
    loss = target.loss(ctx, version)
    same = [c for c in cands if c.does == ctx.plan]
    pool = same[:1] or [c for c in cands if all(r.status != NOT for r in rows(target, ctx, version, c, loss)[:-1])]
    pool = pool or cands
    chosen = pool[0]
    form_rows = rows(target, ctx, version, chosen, loss)
    ours = closest_figures = None
    notes: list[str] = []
    if len(pool) == 1 and chosen.plan == ctx.plan and not chosen.custom and loss.closest == ctx.loss.name:
        if not all(r.status == EXACT for r in form_rows):
            notes.append("it runs our plan and head as they are measured here, so its bytes and FLOPs are ours")
    elif not all(r.status == EXACT for r in form_rows):
        ours = measurer.ours()
        figures = [measurer.candidate(c, loss.closest) for c in pool]
        chosen = pool[closest(pool, ours, figures)]
        closest_figures = figures[pool.index(chosen)]
        form_rows = rows(target, ctx, version, chosen, loss)
        if closest_figures is not None and closest_figures.peak_bytes > ours.peak_bytes:
            others = [c for c in cands if c not in pool]
            notes += _fitting_alternative(target, ctx, version, loss, measurer, others, ours)
    text = target.render(chosen, loss, ctx, version)
    return TargetSettings(target, version, chosen, loss, form_rows, text, ours, closest_figures, notes + chosen.notes)


def _fitting_alternative(
    target: Target,
    ctx: ExportInput,
    version: Version,
    loss: LossMap,
    measurer: Measurer,
    others: list[Candidate],
    ours: PlanFigures,
) -> list[str]:
    """Where the closest faithful plan peaks above ours: the cheapest other plan the target can write that does fit,
    as a note (it runs some element another way)."""
    fitting = [(f, c) for c in others if (f := measurer.candidate(c, loss.closest)) and f.peak_bytes <= ours.peak_bytes]
    if not fitting:
        return []
    f, c = min(fitting, key=lambda x: x[0].flops)
    settings = settings_line(target.render(c, loss, ctx, version))
    return [
        f"the closest peaks above ours; {c.label} ({settings}) fits: whole-step peak {f.peak_bytes / MIB:,.2f} "
        f"MiB, {f.flops / ours.flops:.3f}× our FLOPs, running {f.plan}"
    ]
