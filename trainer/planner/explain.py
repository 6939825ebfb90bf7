"""The planner's explanation: the chosen plan with what it was chosen from, as text and as a dict, and the one-line
refusal when no plan fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.formatting import MIB, markdown_table, mib
from trainer.planner.peak import PeakModel, Profile, Solution, affine_profile, largest_micro_batch, smallest_budget_mib
from trainer.policies import Plan

BLOCK_HEADER = (
    "block",
    "treatment",
    "kept to backward MiB",
    "kept in forward MiB",
    "transient MiB",
    "fwd ms",
    "bwd ms",
)
UNIFORM_HEADER = ("policy", "predicted peak MiB", "fits", "step ms", "× plan")


def describe(treatments: Sequence[str]) -> str:
    """A per-block plan in the policies' own words ("[0-1]:full [2-3]:none")."""
    return Plan.per_block(treatments).describe()


def _same_row(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "block"} == {k: v for k, v in b.items() if k != "block"}


@dataclass
class PlanResult:
    """The chosen plan, its prediction, and what it was chosen from."""

    profile: Profile
    budget: int
    budget_text: str
    solution: Solution
    uniform: dict[str, Solution]
    micro_batch: int
    accum: int
    configured_micro_batch: int
    configured_accum: int
    notes: list[str] = field(default_factory=list)
    fits: bool = True

    @property
    def treatments(self) -> tuple[str, ...]:
        return self.solution.treatments

    @property
    def loss(self) -> str:
        """The loss head the plan was solved with (the configured one unless only another fits)."""
        return self.profile.loss

    @property
    def plan(self) -> Plan:
        return Plan.per_block(self.treatments)

    # -- explanation ---------------------------------------------------------------------------------------------
    def table_rows(self) -> list[dict[str, Any]]:
        p = self.profile
        rows = []
        for i, t in enumerate(self.treatments):
            c = p.costs[i][t]
            rows.append(
                {
                    "block": i,
                    "treatment": t,
                    "kept_mib": c.kept / MIB,
                    "kept_in_forward_mib": c.kept_fwd / MIB,
                    "transient_mib": c.transient / MIB,
                    "fwd_ms": c.fwd_ms,
                    "bwd_ms": c.bwd_ms,
                }
            )
        return rows

    def fixed_mib(self) -> dict[str, float]:
        p = self.profile
        return {
            "params_and_buffers": p.params / MIB,
            "grads": p.grads / MIB,
            "optimizer_state": p.optimizer / MIB,
            "untracked": p.untracked / MIB,
            "replan_excess": p.extra / MIB,
        }

    def text(self) -> str:
        """Console / train.log / TensorBoard (markdown-friendly) explanation."""
        s, p = self.solution, self.profile
        head = (
            f"policy=auto: budget {mib(self.budget)} MiB ({self.budget_text}); micro-batch "
            f"{self.micro_batch}×{p.seq_len}, accum {self.accum}, {p.precision}, {p.device}"
            + (f", loss={p.loss}" if p.loss else "")
        )
        if (self.micro_batch, self.accum) != (self.configured_micro_batch, self.configured_accum):
            head += (
                f" (allow_accum: was {self.configured_micro_batch}×{p.seq_len}, accum {self.configured_accum}; "
                "same tokens per step)"
            )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            head,
            f"plan {describe(s.treatments)}: predicted peak {mib(s.peak)} MiB ({verdict}; set by {s.where}), "
            f"step {s.step_ms:,.0f} ms",
            "fixed: " + ", ".join(f"{k.replace('_', ' ')} {v:,.1f} MiB" for k, v in self.fixed_mib().items() if v > 0),
        ]
        runs: list[tuple[int, int, dict[str, Any]]] = []  # consecutive blocks with identical rows share one line
        for r in self.table_rows():
            if runs and _same_row(runs[-1][2], r):
                runs[-1] = (runs[-1][0], r["block"], runs[-1][2])
            else:
                runs.append((r["block"], r["block"], r))
        blocks = [
            [
                a if a == b else f"{a}-{b}",
                r["treatment"],
                f"{r['kept_mib']:.3f}",
                f"{r['kept_in_forward_mib']:.3f}",
                f"{r['transient_mib']:.3f}",
                f"{r['fwd_ms']:.1f}",
                f"{r['bwd_ms']:.1f}",
            ]
            for a, b, r in runs
        ]
        uniform = [
            [
                name,
                mib(u.peak),
                "yes" if u.peak <= self.budget else "no",
                f"{u.step_ms:,.0f}",
                f"{u.step_ms / s.step_ms:.2f}",
            ]
            for name, u in self.uniform.items()
        ]
        lines += [
            "",
            markdown_table(BLOCK_HEADER, blocks, "rlrrrrr"),
            "",
            "uniform policies, predicted from the same profile:",
            "",
            markdown_table(UNIFORM_HEADER, uniform, "lrlrr"),
        ]
        lines += [f"note: {n}" for n in self.notes + p.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        s = self.solution
        return {
            "budget_mib": round(self.budget / MIB, 4),
            "budget": self.budget_text,
            "plan": list(self.treatments),
            "plan_describe": describe(s.treatments),
            "loss": self.loss,
            "predicted_peak_mib": s.peak / MIB,
            "predicted_step_ms": s.step_ms,
            "peak_set_by": s.where,
            "fits": self.fits,
            "micro_batch": self.micro_batch,
            "accum": self.accum,
            "blocks": self.table_rows(),
            "fixed_mib": self.fixed_mib(),
            "runner_up": {
                name: {
                    "predicted_peak_mib": u.peak / MIB,
                    "predicted_step_ms": u.step_ms,
                    "fits": u.peak <= self.budget,
                }
                for name, u in self.uniform.items()
            },
            "candidates": list(self.profile.treatments),
            "notes": self.notes + self.profile.notes,
        }


def refusal(
    prof: Profile,
    budget: int,
    budget_text: str,
    small: Profile | None,
    tried: Sequence[int] = (),
) -> str:
    """One line: the budget is too small; the smallest budget that fits; the largest micro-batch that fits it."""
    frugal = PeakModel(prof).min_peak()
    need = smallest_budget_mib(frugal.peak)
    line = (
        f"policy auto: no plan fits {budget_text} ({mib(budget)} MiB): the most frugal plan "
        f"({describe(frugal.treatments)}) needs {need:g} MiB at micro-batch {prof.micro_batch}; "
        f"give policy.budget_mib={need:g} or more"
    )
    b = largest_micro_batch(prof, small, budget)
    if tried:
        line += f" (allow_accum tried micro-batches {', '.join(map(str, tried))})"
    if b is None:
        line += ", or a smaller model or seq_len (not even micro-batch 1 fits)"
    else:
        assert small is not None
        fits = PeakModel(affine_profile(prof, small, b)).min_peak()
        line += (
            f", or batch_size={b} (fits with {describe(fits.treatments)}; "
            "raise accum to keep the tokens per step" + ("" if tried else ", or set policy.allow_accum=true") + ")"
        )
    return line
