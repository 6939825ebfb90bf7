"""Compiled against eager, per policy, and torch's budget partitioner at several budgets: measured in one process.

    python -m bench.compiled                      # tiny and llama-tiny (conf defaults: 4×256 tokens), print
    python -m bench.compiled --write-docs         # also rewrite docs/benchmarks.md's compiled-table and the README's
    python -m bench.compiled --models tiny --reps 5 --levels 0 seq_len=128    # without auto

For each model, one configuration composed as train.py composes it (precision=32-true, model.dropout=0: the budget
partitioner is refused with dropout on, and every row runs alike), and for every variant a module built from the same
seed: each per-op or block policy eager and compiled (`trainer.compile=true`: the module compiles after its policy, as
a run's setup does), and `policy=memory_budget` compiled at each `--budget`. Each is stepped twice (compilation, then
a warm step: AdamW's state and last step's gradients exist), then metered over one step as a run meters it
(`trainer.core.step.StepMeter`: the live-tensor tracker eager, the allocator's reports compiled; the whole-step peak
is `peak_total_mib`), then timed: `--reps` rounds interleaved across variants (order rotated), median step ms and
half the IQR. Ratios are compiled ÷ eager of the same policy, measured side by side here. Beside each, the
estimator's figures for the same configuration: its peaks, its predicted step time and the error.

Beside each budget the table names the fastest compiled uniform policy whose measured peak is at most that budget's.
`auto` under compile (`--levels`, 0: left out): memory levels from the compiled `none` step's estimated peak down to
below the most frugal uniform plan's (bench.planner's spacing); at each, `auto`'s compiled plan
(`trainer.estimate.compiled_plans`: each block profiled as inductor compiles it, one profile for all levels, each plan
checked compiled whole), each distinct plan a row compiled, metered and timed with the others, set beside the fastest
`memory_budget` and the fastest compiled uniform plan whose measured peaks are within the level.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench._readme import (
    BENCHMARKS_PAGE,
    ROOT,
    add_page_arguments,
    environment,
    environment_text,
    publish,
    replace_block,
)
from bench.harness import BenchError, budget_levels, random_batch, spread
from trainer import precision as precision_
from trainer.core import build
from trainer.core import step as step_
from trainer.core.schema import compose_config, describe_user_error
from trainer.errors import UserError
from trainer.formatting import MIB
from trainer.planner import PlanResult
from trainer.policies import build_policy

START, END = "<!-- compiled-table:start -->", "<!-- compiled-table:end -->"
README_START, README_END = "<!-- compiled-summary:start -->", "<!-- compiled-summary:end -->"
HEADING = "## Measured: compiled against eager, and torch's budget partitioner"
README = ROOT / "README.md"
COMMAND = "python -m bench.compiled --write-docs"
POLICIES = ("none", "selective", "op_sac", "torchtitan_sac", "full")
BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
LEVELS = 5


@dataclass
class Row:
    label: str
    policy: Any  # a policy name or config mapping
    compiled: bool
    module: Any = None
    parts: tuple[Any, ...] = ()
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


def _prepare(row: Row, overrides: Sequence[str]) -> None:
    config = compose_config([*overrides, f"trainer.compile={str(row.compiled).lower()}"])
    torch.manual_seed(config.seed)
    module = build.module(config, row.policy).train()
    module.configure_model()
    opt, sched = step_.optimizers_of(module)
    plugin = precision_.plugin("32-true", "cpu")
    vocab = int(module.adapter.head.weight.shape[0])
    x, y = random_batch(vocab, config.batch_size, config.seq_len, seed=0)
    row.module, row.parts = module, ([(x, y)], opt, sched, plugin, config.trainer.grad_clip)
    for _ in range(2):
        _step(row)
    meter = step_.StepMeter("cpu", compiled=row.compiled)
    batches, opt, sched, plugin, clip = row.parts
    step_.bare_step(module, batches, opt, sched, plugin, clip, meter=meter)
    figures = meter.end(module)
    row.activation, row.total = figures.activation_bytes, figures.total_bytes


def _estimate(rows: Sequence[Row], overrides: Sequence[str]) -> None:
    """Each row as the estimator sees it, before anything is measured: one fake session per eager/compiled, each
    row's policy measured on it, the step time predicted for this CPU at this thread count (calibrated once)."""
    from trainer.estimate import measure, open_session
    from trainer.measure.time.calibration import cpu_speed

    speed = cpu_speed()
    for compiled in (False, True):
        session = open_session(compose_config([*overrides, f"trainer.compile={str(compiled).lower()}"]), "cpu")
        try:
            for row in (r for r in rows if r.compiled == compiled):
                est = measure(session, build_policy(row.policy))
                row.est_activation, row.est_total = est.activation_bytes, est.peak_bytes
                row.est_ms = est.step_time(speed).ms
        finally:
            session.close()


def _step(row: Row) -> None:
    batches, opt, sched, plugin, clip = row.parts
    step_.bare_step(row.module, batches, opt, sched, plugin, clip)


def run(
    model: str,
    overrides: Sequence[str],
    reps: int,
    budgets: Sequence[float],
    policies: Sequence[str] = POLICIES,
    levels: int = LEVELS,
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
        try:
            _estimate(rows, base)
            if levels:
                marks, plans, auto_rows = _auto_plans(rows, base, levels)  # est.: each plan's compiled whole
                rows += auto_rows
        except UserError as e:
            raise BenchError(f"estimate: {describe_user_error(e)}") from None
        for row in rows:
            try:
                _prepare(row, base)
            except UserError as e:
                raise BenchError(f"{row.label}: {describe_user_error(e)}") from None
        for r in range(reps):  # interleaved, the order rotated, so a slow spell spreads over all variants
            for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                t = time.perf_counter()
                _step(row)
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
    uniform = {r.policy for r in compiled_uniform}
    marks = budget_levels([r.est_total for r in compiled_uniform], levels)
    auto = [*base, "trainer.compile=true", "policy=auto", f"policy.budget_mib={marks[0]}"]
    plans = compiled_plans(compose_config(auto), marks)
    by_plan: dict[tuple[str, ...], Row] = {}
    for result in plans.values():
        if not isinstance(result, PlanResult) or _uniform_row(result, uniform):
            continue
        if result.treatments not in by_plan:
            policy = {"name": "per_block", "blocks": list(result.treatments)}
            by_plan[result.treatments] = Row(f"auto {result.plan.describe()}", policy, True)
    return marks, plans, list(by_plan.values())


def table(out: dict[str, Any]) -> str:
    rows: dict[str, Row] = {r.label: r for r in out["rows"]}
    lines = [
        "| policy | eager act. MiB | compiled act. MiB | ÷ | eager peak MiB | compiled peak MiB | ÷ "
        "| eager step ms | compiled step ms | ÷ |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in out["policies"]:
        e, c = rows[f"{p} eager"], rows[f"{p} compiled"]
        lines.append(
            f"| `{p}` | {e.activation / MIB:.2f} | {c.activation / MIB:.2f} | {c.activation / e.activation:.2f} "
            f"| {e.total / MIB:.2f} | {c.total / MIB:.2f} | {c.total / e.total:.2f} "
            f"| {e.ms:,.0f} ±{100 * spread(e.times):.0f}% | {c.ms:,.0f} ±{100 * spread(c.times):.0f}% "
            f"| {c.ms / e.ms:.2f} |"
        )
    lines += ["", *_predicted(out)]
    uniform = [rows[f"{p} compiled"] for p in out["policies"]]
    lines += [
        "",
        "| `memory_budget` (compiled) | act. MiB | peak MiB | step ms | fastest compiled uniform policy at most that "
        "peak | its peak MiB | its step ms | budget ÷ uniform |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in out["rows"]:
        if not r.label.startswith("memory_budget"):
            continue
        fits = [u for u in uniform if u.total <= r.total]
        best = min(fits, key=lambda u: u.ms) if fits else None
        them = (
            f"`{best.label.split()[0]}` | {best.total / MIB:.2f} | {best.ms:,.0f} ±{100 * spread(best.times):.0f}% "
            f"| {r.ms / best.ms:.2f}"
            if best
            else "none fits | — | — | —"
        )
        lines.append(
            f"| {r.label.split()[1]} | {r.activation / MIB:.2f} | {r.total / MIB:.2f} "
            f"| {r.ms:,.0f} ±{100 * spread(r.times):.0f}% | {them} |"
        )
    if out["levels"]:
        lines += ["", *_levels(out)]
    return "\n".join(lines)


def _uniform_row(result: PlanResult, uniform: set[str]) -> str | None:
    """The compiled uniform row's label where auto's plan is one treatment on every block that a row measures."""
    treatments = set(result.treatments)
    return f"{result.treatments[0]} compiled" if len(treatments) == 1 and treatments <= uniform else None


def _cell(row: Row | None) -> str:
    if row is None:
        return "none fits | — | —"
    name = row.label.removesuffix(" compiled")
    return f"`{name}` | {row.total / MIB:.1f} | {row.ms:,.0f} ±{100 * spread(row.times):.0f}%"


def _levels(out: dict[str, Any]) -> list[str]:
    """`auto` under compile at each memory level beside the fastest `memory_budget` and the fastest compiled uniform
    plan whose measured peaks are within it, and a sentence on whether `auto` was ever the slower."""
    rows: dict[str, Row] = {r.label: r for r in out["rows"]}
    budget_rows = [r for r in out["rows"] if r.label.startswith("memory_budget")]
    uniform_rows = [rows[f"{p} compiled"] for p in out["policies"]]
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
    if verdicts:
        close = (
            f"`auto` (compiled) was slower than the fastest `memory_budget` within the level at: {'; '.join(verdicts)}."
        )
    else:
        close = f"At every level where both fit ({compared}), `auto` (compiled) was at most as slow as `memory_budget`."
    above = any(" ⚠ |" in line for line in lines)
    return [*lines, "", close + (" ⚠: measured above the level." if above else "")]


def _predicted(out: dict[str, Any]) -> list[str]:
    """The estimator beside the measurement: each step's predicted time and its error, the compiled step's estimated
    whole-step peak and its error, compiled ÷ eager predicted and measured, and the rankings by time."""
    rows: dict[str, Row] = {r.label: r for r in out["rows"]}

    def err(predicted: float, measured: float) -> str:
        return f"{100 * (predicted / measured - 1):+.0f}%" if measured else "—"

    lines = [
        "| policy | eager ms: predicted (error) | compiled ms: predicted (error) | compiled ÷ eager: predicted "
        "| measured | compiled peak MiB: estimated (error) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in out["policies"]:
        e, c = rows[f"{p} eager"], rows[f"{p} compiled"]
        lines.append(
            f"| `{p}` | {e.est_ms:,.0f} ({err(e.est_ms, e.ms)}) | {c.est_ms:,.0f} ({err(c.est_ms, c.ms)}) "
            f"| {c.est_ms / e.est_ms:.2f} | {c.ms / e.ms:.2f} | {c.est_total / MIB:.2f} ({err(c.est_total, c.total)}) |"
        )
    for mode in ("eager", "compiled"):
        ranked = [rows[f"{p} {mode}"] for p in out["policies"]]
        by = {
            k: " < ".join(f"`{r.label.split()[0]}`" for r in sorted(ranked, key=key))
            for k, key in (("predicted", lambda r: r.est_ms), ("measured", lambda r: r.ms))
        }
        same = "the same order" if by["predicted"] == by["measured"] else "not the same order"
        lines.append(
            f"\n{mode.capitalize()}, fastest first: predicted {by['predicted']}; measured {by['measured']} ({same})."
        )
    return lines


def summary(outs: Sequence[dict[str, Any]], command: str) -> str:
    """The README's block: compiled ÷ eager per policy and model (activation peak, whole-step peak, step time, all
    measured) and the compiled step's predicted time beside its measured one."""
    lines = [
        f"Generated by `{command}` ({environment_text(outs[0]['env'])}; the whole tables in "
        "[benchmarks](docs/benchmarks.md#measured-compiled-against-eager-and-torchs-budget-partitioner)). Compiled ÷ "
        "eager, measured in one process; the compiled step's predicted time (`trainer.estimate`) against its measured:",
        "",
        "| model | policy | activation peak | whole-step peak | step time | compiled step: predicted ÷ measured |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for out in outs:
        rows: dict[str, Row] = {r.label: r for r in out["rows"]}
        for p in out["policies"]:
            e, c = rows[f"{p} eager"], rows[f"{p} compiled"]
            lines.append(
                f"| `{out['model']}` | `{p}` | {c.activation / e.activation:.2f} | {c.total / e.total:.2f} "
                f"| {c.ms / e.ms:.2f} | {c.est_ms / c.ms:.2f} |"
            )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compiled", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (seq_len=128)")
    ap.add_argument("--models", default="tiny,llama-tiny", help="conf/model options, comma-separated")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per variant (median)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="the policies compared eager and compiled")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS), help="memory_budget's budgets")
    ap.add_argument("--levels", type=int, default=LEVELS, help="memory levels `auto` plans at (0: no auto rows)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    add_page_arguments(ap, BENCHMARKS_PAGE, f"the block between {START} and {END}")
    args = ap.parse_intermixed_args(argv)
    if args.reps < 1:
        ap.error("--reps must be ≥ 1")
    if args.levels == 1 or args.levels < 0:
        ap.error("--levels must be 0 (no auto rows) or at least 2")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets {args.budgets!r}: give numbers in [0, 1], comma-separated")
    torch.set_num_threads(args.threads)
    command = f"{COMMAND} {' '.join(args.overrides)}".rstrip()
    outs = []
    for model in args.models.split(","):
        try:
            outs.append(run(model, args.overrides, args.reps, budgets, args.policies.split(","), args.levels))
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    block = header(outs, command) + "\n\n" + "\n\n".join(f"**{o['shape']}**\n\n{table(o)}" for o in outs)
    publish(args, block, START, END, HEADING)
    if args.write_docs:
        replace_block(README, README_START, README_END, summary(outs, command), "## Compiled against eager")
        print(f"wrote {README}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
