"""Compiled against eager, per policy, and torch's budget partitioner at several budgets: measured in one process.

    python -m bench.compiled                      # tiny and llama-tiny (conf defaults: 4×256 tokens), print
    python -m bench.compiled --write-docs         # also rewrite docs/benchmarks.md's compiled-table and the README's
    python -m bench.compiled --models tiny --reps 5 --levels 0 seq_len=128    # without auto

Every variant is a module of its own from the same seed (precision=32-true, model.dropout=0: the budget partitioner is
refused with dropout on): each policy eager and compiled, `memory_budget` compiled at each --budgets, and
`policy=auto` compiled at --levels memory levels (`trainer.estimate.compiled_plans`: one compiled profile plans every
level), each beside the estimator's figures; the header the table prints says how each is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import (
    BENCHMARKS_PAGE,
    README,
    Block,
    at_least,
    command,
    environment,
    environment_text,
    noisy,
    parser,
    publish,
    use_device,
)
from bench.harness import Harness, budget_levels, spread
from trainer.core.schema import compose_config
from trainer.core.step import StepMeter
from trainer.formatting import MIB, markdown_table
from trainer.planner import PlanResult
from trainer.policies import build_policy

TABLE = Block("compiled-table", "## Measured: compiled against eager, and torch's budget partitioner")
SUMMARY = Block("compiled-summary", "## Compiled against eager", README)
COMMAND = "python -m bench.compiled --write-docs"
POLICIES = ("none", "selective", "op_sac", "torchtitan_sac", "full")
BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


@dataclass
class Row:
    label: str
    policy: Any  # a policy name or config mapping
    compiled: bool
    h: Any = None  # its Harness
    activation: int = 0
    total: int = 0
    times: list[float] = field(default_factory=list)
    # the estimator's figures for the same configuration (fake tensors): activation and whole-step peaks, step ms
    est_activation: int = 0
    est_total: int = 0
    est_ms: float = 0.0

    @property
    def ms(self) -> float:
        return statistics.median(self.times) * 1e3

    @property
    def time_cell(self) -> str:
        return noisy(self.ms, spread(self.times))


def _config(compiled: bool, overrides: Sequence[str]) -> Any:
    return compose_config([*overrides, f"trainer.compile={str(compiled).lower()}"])


def _prepare(row: Row, overrides: Sequence[str]) -> None:
    """The variant's module built as a run's setup builds it (compiled after its policy), stepped twice (compilation,
    then a warm step: AdamW's state and last step's gradients exist), then metered over one step as a run meters it."""
    row.h = Harness(_config(row.compiled, overrides), "cpu", row.policy)
    row.h.warm(2)
    meter = StepMeter("cpu", compiled=row.compiled)
    row.h.step(meter=meter)
    figures = meter.end(row.h.module)
    row.activation, row.total = figures.activation_bytes, figures.total_bytes


def _estimate(rows: Sequence[Row], overrides: Sequence[str]) -> None:
    """Each row as the estimator sees it, before anything is measured: one fake session per eager/compiled, each
    row's policy measured on it, the step time predicted for this CPU at this thread count (calibrated once)."""
    from trainer.estimate import measure, open_session
    from trainer.measure.time.calibration import cpu_speed

    speed = cpu_speed()
    for compiled in (False, True):
        session = open_session(_config(compiled, overrides), "cpu")
        try:
            for row in (r for r in rows if r.compiled == compiled):
                est = measure(session, build_policy(row.policy))
                row.est_activation, row.est_total = est.activation_bytes, est.peak_bytes
                row.est_ms = est.step_time(speed).ms
        finally:
            session.close()


def run(
    model: str,
    overrides: list[str],
    reps: int,
    budgets: list[float],
    policies: Sequence[str] = POLICIES,
    levels: int = 5,
) -> dict[str, Any]:
    import torch._dynamo.config as dynamo_config

    t0 = time.perf_counter()
    base = [f"model={model}", "precision=32-true", "model.dropout=0.0", *overrides]
    rows = [Row(f"{p} {'compiled' if c else 'eager'}", p, c) for p in policies for c in (False, True)]
    rows += [Row(f"memory_budget {b:g}", {"name": "memory_budget", "budget": b}, True) for b in budgets]
    marks: list[float] = []
    plans: dict[float, Any] = {}
    # Every variant is a module of the same classes: past dynamo's recompile limit a frame would run eagerly.
    with dynamo_config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
        _estimate(rows, base)
        if levels:
            marks, plans, auto_rows = _auto_plans(rows, base, levels)  # est.: each plan's compiled whole
            rows += auto_rows
        for row in rows:
            _prepare(row, base)
        for r in range(reps):  # interleaved, the order rotated, so a slow spell spreads over all variants
            for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                t = time.perf_counter()
                row.h.step()
                row.times.append(time.perf_counter() - t)
    config = compose_config(base)
    return {
        "model": model,
        "shape": f"`{model}`, micro-batch {config.batch_size}×{config.seq_len} tokens",
        "rows": rows,
        "policies": list(policies),
        "levels": marks,
        "plans": plans,
        "reps": reps,
        "env": environment("cpu", "32-true"),
        "seconds": time.perf_counter() - t0,
    }


def _auto_plans(
    rows: Sequence[Row], base: Sequence[str], levels: int
) -> tuple[list[float], dict[float, Any], list[Row]]:
    """`policy=auto` under compile at `levels` memory levels, evenly spaced from the largest compiled uniform
    estimate to 7 % below the smallest: one compiled profile plans every level; each distinct plan is a row
    (`per_block` with auto's treatments, as the planning callback installs it), except a uniform plan the compiled
    uniform rows already measure."""
    from trainer.estimate import compiled_plans

    compiled_uniform = [r for r in rows if r.compiled and isinstance(r.policy, str)]
    marks = budget_levels([r.est_total for r in compiled_uniform], levels)
    auto = [*base, "trainer.compile=true", "policy=auto", f"policy.budget_mib={marks[0]}"]
    plans = compiled_plans(compose_config(auto), marks)
    by_plan: dict[tuple[str, ...], Row] = {}
    for result in plans.values():
        if isinstance(result, PlanResult) and not _uniform_row(result, {r.policy for r in compiled_uniform}):
            policy = {"name": "per_block", "blocks": list(result.treatments)}
            by_plan.setdefault(result.treatments, Row(f"auto {result.plan.describe()}", policy, True))
    return marks, plans, list(by_plan.values())


def _pairs(out: dict[str, Any]) -> list[tuple[str, Row, Row]]:
    """(policy, its eager row, its compiled row) per policy compared."""
    rows = {r.label: r for r in out["rows"]}
    return [(p, rows[f"{p} eager"], rows[f"{p} compiled"]) for p in out["policies"]]


def table(out: dict[str, Any]) -> str:
    lines = [
        "| policy | eager act. MiB | compiled act. MiB | ÷ | eager peak MiB | compiled peak MiB | ÷ "
        "| eager step ms | compiled step ms | ÷ |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, e, c in _pairs(out):
        lines.append(
            f"| `{p}` | {e.activation / MIB:.2f} | {c.activation / MIB:.2f} | {c.activation / e.activation:.2f} "
            f"| {e.total / MIB:.2f} | {c.total / MIB:.2f} | {c.total / e.total:.2f} "
            f"| {e.time_cell} | {c.time_cell} | {c.ms / e.ms:.2f} |"
        )
    lines += ["", *_predicted(out)]
    uniform = [c for _, _, c in _pairs(out)]
    lines += [
        "",
        "| `memory_budget` (compiled) | act. MiB | peak MiB | step ms | fastest compiled uniform policy at most that "
        "peak | its peak MiB | its step ms | budget ÷ uniform |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in (r for r in out["rows"] if r.label.startswith("memory_budget")):
        best = min((u for u in uniform if u.total <= r.total), key=lambda u: u.ms, default=None)
        them = "none fits | — | — | —"
        if best:
            them = f"`{best.label.split()[0]}` | {best.total / MIB:.2f} | {best.time_cell} | {r.ms / best.ms:.2f}"
        lines.append(
            f"| {r.label.split()[1]} | {r.activation / MIB:.2f} | {r.total / MIB:.2f} | {r.time_cell} | {them} |"
        )
    return "\n".join(lines + (["", *_levels(out)] if out["levels"] else []))


def _uniform_row(result: PlanResult, uniform: set[str]) -> str | None:
    """The compiled uniform row's label where auto's plan is one treatment on every block that a row measures."""
    treatments = set(result.treatments)
    return f"{result.treatments[0]} compiled" if len(treatments) == 1 and treatments <= uniform else None


def _cell(row: Row | None) -> str:
    if row is None:
        return "none fits | — | —"
    return f"`{row.label.removesuffix(' compiled')}` | {row.total / MIB:.1f} | {row.time_cell}"


def _levels(out: dict[str, Any]) -> list[str]:
    """`auto` under compile at each memory level beside the fastest `memory_budget` and the fastest compiled uniform
    plan whose measured peaks are within it, and a sentence on whether `auto` was ever the slower."""
    rows: dict[str, Row] = {r.label: r for r in out["rows"]}
    budget_rows = [r for r in out["rows"] if r.label.startswith("memory_budget")]
    uniform_rows = [c for _, _, c in _pairs(out)]
    lines = [
        "| level MiB | `auto` plan (compiled) | est. MiB | measured MiB | step ms | fastest `memory_budget` within it "
        "| its MiB | its ms | auto ÷ it | fastest compiled uniform within it | its MiB | its ms |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    verdicts, compared = [], 0
    for level in out["levels"]:
        result = out["plans"][level]
        partitioner = min((r for r in budget_rows if r.total <= level * MIB), key=lambda r: r.ms, default=None)
        uniform = min((r for r in uniform_rows if r.total <= level * MIB), key=lambda r: r.ms, default=None)
        if not isinstance(result, PlanResult):
            lines.append(f"| {level:g} | refused: {result} | | | | {_cell(partitioner)} | — | {_cell(uniform)} |")
            continue
        a = rows[_uniform_row(result, set(out["policies"])) or f"auto {result.plan.describe()}"]
        ratio = "—"
        if partitioner is not None:
            compared += 1
            ratio = f"{a.ms / partitioner.ms:.2f}"
            if round(a.ms / partitioner.ms, 2) > 1:
                sa, sp = spread(a.times), spread(partitioner.times)
                inside = "inside" if a.ms * (1 - sa) <= partitioner.ms * (1 + sp) else "outside"
                verdicts.append(
                    f"{level:g} MiB: {a.ms / partitioner.ms:.2f}×, {inside} the two variants' noise "
                    f"(±{100 * sa:.0f} %, ±{100 * sp:.0f} %)"
                )
        mark = "" if a.total <= level * MIB else " ⚠"
        lines.append(
            f"| {level:g} | `{result.plan.describe()}` | {result.solution.peak / MIB:.1f} | {a.total / MIB:.1f}{mark} "
            f"| {a.time_cell} | {_cell(partitioner)} | {ratio} | {_cell(uniform)} |"
        )
    close = f"At every level where both fit ({compared}), `auto` (compiled) was at most as slow as `memory_budget`."
    if verdicts:
        close = (
            f"`auto` (compiled) was slower than the fastest `memory_budget` within the level at: {'; '.join(verdicts)}."
        )
    above = any(" ⚠ |" in line for line in lines)
    return [*lines, "", close + (" ⚠: measured above the level." if above else "")]


def _predicted(out: dict[str, Any]) -> list[str]:
    """The estimator beside the measurement: each step's predicted time and its error, the compiled step's estimated
    whole-step peak and its error, compiled ÷ eager predicted and measured, and the rankings by time."""

    def err(predicted: float, measured: float) -> str:
        return f"{100 * (predicted / measured - 1):+.0f}%" if measured else "—"

    lines = [
        "| policy | eager ms: predicted (error) | compiled ms: predicted (error) | compiled ÷ eager: predicted "
        "| measured | compiled peak MiB: estimated (error) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p, e, c in _pairs(out):
        lines.append(
            f"| `{p}` | {e.est_ms:,.0f} ({err(e.est_ms, e.ms)}) | {c.est_ms:,.0f} ({err(c.est_ms, c.ms)}) "
            f"| {c.est_ms / e.est_ms:.2f} | {c.ms / e.ms:.2f} | {c.est_total / MIB:.2f} ({err(c.est_total, c.total)}) |"
        )
    for mode, ranked in (("eager", [e for _, e, _ in _pairs(out)]), ("compiled", [c for _, _, c in _pairs(out)])):
        predicted, measured = (
            " < ".join(f"`{r.label.split()[0]}`" for r in sorted(ranked, key=key))
            for key in (lambda r: r.est_ms, lambda r: r.ms)
        )
        same = "the same order" if predicted == measured else "not the same order"
        lines.append(f"\n{mode.capitalize()}, fastest first: predicted {predicted}; measured {measured} ({same}).")
    return lines


def summary(outs: Sequence[dict[str, Any]], command: str) -> str:
    """The README's block: compiled ÷ eager per policy and model (activation peak, whole-step peak, step time, all
    measured) and the compiled step's predicted time beside its measured one."""
    head = ("model", "policy", "activation peak", "whole-step peak", "step time", "compiled step: predicted ÷ measured")
    rows = [
        [f"`{o['model']}`", f"`{p}`"]
        + [f"{x:.2f}" for x in (c.activation / e.activation, c.total / e.total, c.ms / e.ms, c.est_ms / c.ms)]
        for o in outs
        for p, e, c in _pairs(o)
    ]
    return (
        f"Generated by `{command}` ({environment_text(outs[0]['env'])}; the whole tables in "
        "[benchmarks](docs/benchmarks.md#measured-compiled-against-eager-and-torchs-budget-partitioner)). Compiled ÷ "
        "eager, measured in one process; the compiled step's predicted time (`trainer.estimate`) against its measured:"
        "\n\n" + markdown_table(head, rows, "llrrrr")
    )


def header(outs: Sequence[dict[str, Any]], command: str) -> str:
    seconds = sum(o["seconds"] for o in outs)
    return (
        f"Generated by `{command}` ({environment_text(outs[0]['env'])}, {seconds:.0f} s). Each variant a module from "
        "the same seed, stepped twice (compilation, a warm step), metered over one step as a run meters it "
        "(activation peak and whole-step peak, `peak_total_mib`: the live-tensor tracker eager, the allocator's "
        "reports "
        f"compiled), then timed over {outs[0]['reps']} rounds interleaved across variants (median ± half the IQR). "
        "model.dropout=0 throughout (`memory_budget` is refused with dropout below budget 1 on this torch). Beside "
        "each budget stands the fastest compiled uniform policy that fits. `auto` under trainer.compile=true is "
        "planned once per memory level (each block profiled as inductor compiles it, the plan checked compiled "
        "whole: est. MiB) and each of its plans compiled, metered and timed with the rest."
    )


@command
def _budgets(text: str) -> list[float]:
    """--budgets: numbers, comma-separated; anything else one argparse error line, not a traceback."""
    try:
        return [float(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: give numbers in [0, 1], comma-separated") from None


def main(argv: list[str] | None = None) -> int:
    ap = parser("python -m bench.compiled", __doc__, " (seq_len=128)", BENCHMARKS_PAGE, (TABLE, SUMMARY), threads=True)
    ap.add_argument("--models", default="tiny,llama-tiny", help="conf/model options, comma-separated")
    ap.add_argument("--reps", type=at_least(1), default=7, help="timed steps per variant (median)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="the policies compared eager and compiled")
    budgets = ",".join(f"{b:g}" for b in BUDGETS)
    ap.add_argument(
        "--budgets", type=_budgets, default=budgets, help="memory_budget's budgets in [0, 1], comma-separated"
    )
    ap.add_argument("--levels", type=int, default=5, help="memory levels `auto` plans at (0: no auto rows, else ≥ 2)")
    args = ap.parse_intermixed_args(argv)
    if args.levels == 1 or args.levels < 0:
        ap.error("--levels must be 0 (no auto rows) or at least 2")
    use_device("cpu", args.threads)
    command = f"{COMMAND} {' '.join(args.overrides)}".rstrip()
    budgets, policies = args.budgets, args.policies.split(",")
    outs = [run(m, args.overrides, args.reps, budgets, policies, args.levels) for m in args.models.split(",")]
    block = header(outs, command) + "\n\n" + "\n\n".join(f"**{o['shape']}**\n\n{table(o)}" for o in outs)
    return publish(block, args, {TABLE: block, SUMMARY: summary(outs, command)})


if __name__ == "__main__":
    raise SystemExit(main())
