"""bench.planner's compiled half: `policy=auto` under trainer.compile=true beside torch's budget partitioner
(`policy=memory_budget` at several budgets) and the compiled uniform plans, on the same model, in one process.

Memory levels run from the compiled `none` step's estimated peak down to below the most frugal uniform plan's. At
each, `auto`'s compiled plan (`trainer.estimate.compiled_plans`: each block profiled as inductor compiles it, one
profile for all levels, each plan checked compiled whole). Then every variant (the uniform plans, `memory_budget` at
each budget, each distinct `auto` plan) is a module from the same seed compiled as a run compiles it, stepped twice
(compilation, a warm step), metered over one step as a run meters it (the allocator's reports: activation peak and
`peak_total_mib`), and timed in rounds interleaved across all variants (bench.compiled's). At each level the table
sets `auto` beside the fastest `memory_budget` and the fastest uniform plan whose measured peak is within it.
model.dropout=0 throughout: `memory_budget` is refused with dropout below budget 1 on this torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.compiled import Row, _estimate, _prepare, _step
from bench.harness import BenchError, spread
from trainer.core.schema import compose_config, describe_user_error
from trainer.errors import UserError
from trainer.formatting import MIB
from trainer.planner import PlanResult

UNIFORM = ("none", "selective", "op_sac", "torchtitan_sac", "full")
BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


def run_compiled(overrides: Sequence[str], levels: int, reps: int) -> dict[str, Any]:
    import torch._dynamo.config as dynamo_config

    from trainer.estimate import compiled_plans

    t0 = time.perf_counter()
    base = [*overrides, "precision=32-true", "model.dropout=0.0"]
    rows = [Row(f"{p}", p, True) for p in UNIFORM]
    rows += [Row(f"memory_budget {b:g}", {"name": "memory_budget", "budget": b}, True) for b in BUDGETS]
    with dynamo_config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
        try:
            _estimate(rows, base)  # the estimator's figures of each: the levels come from the uniform ones
            peaks = [r.est_total for r in rows if r.label in UNIFORM]
            top, bottom = max(peaks), int(min(peaks) * 0.93)
            marks = [round((top - (top - bottom) * k / (levels - 1)) / MIB, 1) for k in range(levels)]
            auto = [*base, "trainer.compile=true", "policy=auto", f"policy.budget_mib={marks[0]}"]
            plans = compiled_plans(compose_config(auto), marks)
        except UserError as e:
            raise BenchError(f"compiled: {describe_user_error(e)}") from None
        by_plan: dict[tuple[str, ...], Row] = {}
        for result in plans.values():
            if isinstance(result, PlanResult) and result.treatments not in by_plan:
                blocks = list(result.treatments)
                by_plan[result.treatments] = Row(
                    f"auto {result.plan.describe()}", {"name": "per_block", "blocks": blocks}, True
                )
        rows += list(by_plan.values())
        for row in rows:
            try:
                _prepare(row, base)
            except UserError as e:
                raise BenchError(f"compiled {row.label}: {describe_user_error(e)}") from None
        for r in range(reps):  # interleaved, the order rotated, as bench.compiled times
            for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                t = time.perf_counter()
                _step(row)
                row.times.append(time.perf_counter() - t)
    return {
        "levels": marks,
        "plans": plans,
        "auto_rows": by_plan,
        "rows": rows,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - t0,
    }


def _cell(row: Row | None) -> str:
    if row is None:
        return "none fits | — | —"
    return f"`{row.label}` | {row.total / MIB:.1f} | {row.ms:,.0f} ±{100 * spread(row.times):.0f}%"


def compiled_table(out: dict[str, Any]) -> str:
    rows: list[Row] = out["rows"]
    budget_rows = [r for r in rows if r.label.startswith("memory_budget")]
    uniform_rows = [r for r in rows if r.label in UNIFORM]
    lines = [
        "| level MiB | `auto` plan (compiled) | est. MiB | measured MiB | step ms | fastest `memory_budget` within it "
        "| its MiB | its ms | auto ÷ it | fastest compiled uniform within it | its MiB | its ms |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    verdicts = []
    for level in out["levels"]:
        result = out["plans"][level]
        fits = [r for r in budget_rows if r.total <= level * MIB]
        partitioner = min(fits, key=lambda r: r.ms) if fits else None
        uniform = min((r for r in uniform_rows if r.total <= level * MIB), key=lambda r: r.ms, default=None)
        if not isinstance(result, PlanResult):
            lines.append(f"| {level:g} | refused: {result} | | | | {_cell(partitioner)} | — | {_cell(uniform)} |")
            continue
        a = out["auto_rows"][result.treatments]
        ratio = "—"
        if partitioner is not None:
            ratio = f"{a.ms / partitioner.ms:.2f}"
            if round(a.ms / partitioner.ms, 2) > 1:
                inside = a.ms * (1 - spread(a.times)) <= partitioner.ms * (1 + spread(partitioner.times))
                verdicts.append(
                    f"{level:g} MiB: {a.ms / partitioner.ms:.2f}×, {'inside' if inside else 'outside'} the two "
                    f"variants' noise (±{100 * spread(a.times):.0f} %, ±{100 * spread(partitioner.times):.0f} %)"
                )
        mark = "" if a.total <= level * MIB else " ⚠"
        lines.append(
            f"| {level:g} | `{result.plan.describe()}` | {result.solution.peak / MIB:.1f} | {a.total / MIB:.1f}{mark} "
            f"| {a.ms:,.0f} ±{100 * spread(a.times):.0f}% | {_cell(partitioner)} | {ratio} | {_cell(uniform)} |"
        )
    compared = sum(
        1
        for level in out["levels"]
        if isinstance(out["plans"][level], PlanResult) and any(r.total <= level * MIB for r in budget_rows)
    )
    if verdicts:
        close = (
            f"`auto` (compiled) was slower than the fastest `memory_budget` within the level at: {'; '.join(verdicts)}."
        )
    else:
        close = f"At every level where both fit ({compared}), `auto` (compiled) was at most as slow as `memory_budget`."
    lines += [
        "",
        close,
        "",
        "| variant (compiled) | act. MiB | peak MiB | est. peak MiB | step ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        est = f"{r.est_total / MIB:.1f}" if r.est_total else "—"
        lines.append(
            f"| `{r.label}` | {r.activation / MIB:.1f} | {r.total / MIB:.1f} | {est} | {r.ms:,.0f} "
            f"±{100 * spread(r.times):.0f}% |"
        )
    return "\n".join(lines)


def compiled_header(out: dict[str, Any]) -> str:
    return (
        f"Compiled ({out['seconds']:.0f} s, {out['threads']} thread(s), precision=32-true, model.dropout=0): "
        "`auto` under trainer.compile=true planned once per level (each block profiled as inductor compiles it, "
        "the plan checked compiled whole), beside torch's budget partitioner at "
        f"{', '.join(f'{b:g}' for b in BUDGETS)} and the compiled uniform plans; every variant compiled as a run "
        "compiles it, metered by the allocator's reports (`peak_total_mib`), timed over "
        f"{out['reps']} rounds interleaved across all of them (median ± half the IQR). ⚠: measured above the level."
    )
