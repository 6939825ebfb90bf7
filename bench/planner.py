"""`policy=auto` across memory budgets, beside the fastest uniform policy that fits: measured peak and step time.

    python -m bench.planner                  # print the tables (the conf defaults: model=tiny, 4×256 tokens)
    python -m bench.planner --write-docs     # also rewrite docs/benchmarks.md's planner-table and planner-accuracy
    python -m bench.planner --model llama-tiny --budgets 6 --reps 3

One profile at fit start's budget gives every prediction; each budget's plan (`solve_profile`, with plan_model's rule
for the loss head; where nothing fits, the plan `policy.allow_accum=true` trains) and every uniform plan are installed
as training installs them and measured in one process (the header the table prints says how). `auto` under
trainer.compile=true beside torch's budget partitioner is bench.compiled's.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.accuracy import WORDS, Point, paragraph
from bench.common import BENCHMARKS_PAGE, Block, at_least, command, environment_text, noisy, parser, publish, use_device
from bench.harness import Harness, Variant, bench_config, budget_levels, estimated, quiet_policy_notices, spread
from trainer.estimate import open_session
from trainer.formatting import MIB, mib
from trainer.loss import LossConfig
from trainer.measure.time.calibration import speed_here
from trainer.planner import PeakModel, choose, head_candidates, plan_model, smallest_budget_mib
from trainer.policies import Plan, Policy, PolicyError, build_policy

TABLE = Block("planner-table", "## Measured: `policy=auto` across memory budgets")
ACCURACY = Block("planner-accuracy", "## How close: step time predicted vs measured")
COMMAND = "python -m bench.planner --write-docs"


def run(
    overrides: Sequence[str], n_budgets: int, reps: int, device: str = "cpu", recalibrate: bool = True
) -> dict[str, Any]:
    t0 = time.perf_counter()
    config, env = bench_config(["policy=auto", "policy.budget_mib=1", *overrides], device)  # budgets: below
    auto = build_policy(config.policy)
    loss = config.loss
    h = Harness(config, device)
    h.warm()
    model, measure = h.module.model, h.planner_args(head_candidates(h.module, auto.cfg))
    # the planner's two verbs, as the planning callback calls them at fit start; the profile again after each timed
    # round, so drift falls on the prediction and the steps alike
    profiles = [h.profile(auto, measure["loss_fns"])]
    prof, L = profiles[0], profiles[0].n_layer
    predicted = {t: PeakModel(prof).evaluate([t] * L) for t in prof.treatments}
    variants: dict[str, Variant] = {}

    def variant(treatments: Sequence[str], head: str, micro_batch: int) -> str:
        key = f"{Plan.per_block(treatments).describe()} loss={head} micro-batch={micro_batch}"
        if key not in variants:
            loss_cfg = LossConfig(name=head, chunk_tokens=loss.chunk_tokens, ignore_index=loss.ignore_index)
            variants[key] = Variant(key, functools.partial(_auto, auto.cfg, treatments), loss_cfg, micro_batch)
        return key

    uniform = {t: variant([t] * L, loss.name, config.batch_size) for t in prof.treatments}
    rows: list[dict[str, Any]] = []
    for budget in budget_levels([p.peak for p in predicted.values()], n_budgets):
        row: dict[str, Any] = {"budget_mib": budget}
        rows.append(row)
        result = choose(prof, int(budget * MIB), f"policy.budget_mib={budget:g}", (config.batch_size, config.accum))
        if result is None:
            heads = list(prof.heads.values()) or [prof]
            row["refused_below_mib"] = smallest_budget_mib(min(PeakModel(p).min_peak().peak for p in heads))
            try:
                with quiet_policy_notices():
                    accum_cfg = dataclasses.replace(auto.cfg, budget_mib=budget, allow_accum=True)
                    result = plan_model(model, h.batches()[0], accum_cfg, **measure)
            except PolicyError as e:
                row["error"] = str(e)
                continue
        row["result"] = result
        row["variant"] = variant(result.treatments, result.loss or loss.name, result.micro_batch)
    measured = _measure(h, variants, reps, lambda: profiles.append(h.profile(auto, measure["loss_fns"])))
    speed = speed_here(device, recalibrate=recalibrate)  # beside the measured steps, unless --cached-speed
    session = open_session(config, h.device.type)
    try:
        roofline = {t: estimated(session, variants[k]).step_time(speed).ms for t, k in uniform.items()}
    finally:
        session.close()
    for row in rows:
        fits = [t for t, k in uniform.items() if measured[k]["peak"] <= row["budget_mib"] * MIB]
        row["uniform"] = min(fits, key=lambda t: measured[uniform[t]]["ms"]) if fits else None
        if "variant" in row:
            row["measured"] = measured[row["variant"]]
    return {
        "env": env,
        "shape": h.describe(),
        "config": config,
        "predicted": predicted,
        "uniform": {t: measured[k] for t, k in uniform.items()},
        "roofline": roofline,
        "profile_ms": {t: statistics.median(PeakModel(p).step_ms([t] * L) for p in profiles) for t in prof.treatments},
        "profiles": len(profiles),
        "speed": speed.describe(),
        "profile_notes": list(prof.notes),
        "rows": rows,
        "reps": reps,
        "seconds": time.perf_counter() - t0,
    }


def _measure(h: Harness, variants: dict[str, Variant], reps: int, between: Callable[[], None]) -> dict[str, Any]:
    """One metered step per plan (StepMeter), then timed rounds interleaved across plans (medians)."""
    measured: dict[str, dict[str, Any]] = {}
    with quiet_policy_notices():
        for key, v in variants.items():
            f = h.measure(v)
            measured[key] = {"peak": f.total_bytes, "activation": f.activation_bytes}
            measured[key]["installed"] = h.module.model.activation_plan
        times = h.interleaved(variants, reps, between=between)
    for key, m in measured.items():
        m["ms"], m["spread"] = statistics.median(times[key]) * 1e3, spread(times[key])
    return measured


def _auto(cfg: Any, treatments: Sequence[str]) -> Policy:
    """policy=auto with these treatments chosen, as the planning callback installs its plan."""
    policy = build_policy(cfg)
    policy.choose(treatments)  # type: ignore[attr-defined]
    return policy


def tables(out: dict[str, Any]) -> str:
    uniform, rows = out["uniform"], out["rows"]
    configured_loss = out["config"].loss.name
    lines = [
        "| budget MiB | `auto` plan | predicted MiB | measured MiB | predicted step ms | measured step ms | "
        "fastest uniform that fits | its measured MiB | its step ms | auto ÷ uniform |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        b, u = row["budget_mib"], row["uniform"]
        um = uniform.get(u)
        ucells = f"`{u}` | {mib(um['peak'])} | {noisy(um['ms'], um['spread'])}" if um else "none fits | — | —"
        if "error" in row:
            lines.append(f"| {b:g} | refused: {row['error']} | | | | | {ucells} | — |")
            continue
        res, m = row["result"], row["measured"]
        plan = f"`{Plan.per_block(res.treatments).describe()}`"
        if res.loss and res.loss != configured_loss:
            plan += f", loss={res.loss}"
        if "refused_below_mib" in row:
            plan = (
                f"refused at micro-batch {res.configured_micro_batch} (needs ≥ {row['refused_below_mib']:g} MiB); "
                f"with `allow_accum=true`: micro-batch {res.micro_batch}, accum {res.accum}, {plan}"
            )
        ratio = f"{m['ms'] / um['ms']:.2f}" if um else "—"
        mark = "" if m["peak"] <= b * MIB else " ⚠"
        lines.append(
            f"| {b:g} | {plan} | {mib(res.solution.peak)} | {mib(m['peak'])}{mark} | {res.solution.step_ms:,.0f} | "
            f"{noisy(m['ms'], m['spread'])} | {ucells} | {ratio} |"
        )
    lines += [
        "",
        "Uniform plans, predicted vs measured (profile: the planner's measured source, the median over the profile "
        f"above and {out['profiles'] - 1} more taken after each timed round; roofline: the estimator's fake-tensor "
        "step costed by `trainer.measure.time.roofline`):",
        "",
        "| policy | predicted MiB | measured MiB | measured step ms | predicted: profile | ÷ measured "
        "| predicted: roofline | ÷ measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, s in out["predicted"].items():
        r, roof, pm = uniform[t], out["roofline"][t], out["profile_ms"][t]
        lines.append(
            f"| `{t}` | {mib(s.peak)} | {mib(r['peak'])} | {noisy(r['ms'], r['spread'])} "
            f"| {pm:,.0f} | {pm / r['ms']:.3f} | {roof:,.0f} | {roof / r['ms']:.3f} |"
        )
    times = {
        "measured": {t: u["ms"] for t, u in uniform.items()},
        "profile": out["profile_ms"],
        "roofline": out["roofline"],
    }
    order = "; ".join(f"{k} {' < '.join(sorted(out['predicted'], key=ms.__getitem__))}" for k, ms in times.items())
    lines += ["", f"Ranking by step time: {order}."]
    return "\n".join(lines)


def header(out: dict[str, Any], command: str = COMMAND) -> str:
    c = out["config"]
    return (
        f"Generated by `{command}` ({environment_text(out['env'])}, {out['seconds']:.0f} s). Shape: {out['shape']}; "
        f"AdamW; clip {c.trainer.grad_clip:g}; policy=auto chooses from {', '.join(out['predicted'])}. One profile "
        "(`trainer.planner.plan_model`, as at fit start) gives every prediction; each plan is then installed as "
        "training installs it and measured in the same process by `trainer.core.step.bare_step`, the step as Lightning "
        "runs it: peak = `trainer.core.step.StepMeter`'s whole-step figure (what runs report as "
        "`peak_total_mib`), step "
        f"time = median of {out['reps']} steps interleaved across plans (± half the IQR: the run's noise). Budgets run "
        "from the `none` prediction to below the most frugal uniform plan's. ⚠: measured above the budget. Predicted "
        f"step times: the profile's (policy.profile_repeats rounds after a warm-up; {'; '.join(out['profile_notes'])}"
        f") and the roofline's, for {out['speed']}."
    )


def accuracy(outs: Sequence[dict[str, Any]], command: str = COMMAND) -> str:
    """How close the profile and the roofline came to the measured uniform plans, how each ranks them, and whether
    `policy=auto` ever took a plan slower than the fastest uniform one that fits: one paragraph over every model."""
    points, slower, budgets = [], [], 0
    for out in outs:
        model = out["config"].model.name
        for t in out["predicted"]:
            u = out["uniform"][t]
            points.append(Point(model, t, u["ms"], u["spread"], out["profile_ms"][t], out["roofline"][t]))
        for row in out["rows"]:
            u, m = row.get("uniform"), row.get("measured")
            if u is None or m is None:
                continue  # nothing uniform fits, or the planner refused: no comparison
            budgets += 1
            um = out["uniform"][u]
            ratio = m["ms"] / um["ms"]
            if round(ratio, 2) <= 1:
                continue
            inside = m["ms"] * (1 - m["spread"]) <= um["ms"] * (1 + um["spread"])
            lo, hi = sorted((round(100 * m["spread"]), round(100 * um["spread"])))
            noise = f"±{lo} %" if lo == hi else f"±{lo}–{hi} %"
            slower.append(
                f"`{model}` at {row['budget_mib']:g} MiB: {ratio:.2f}×, {'inside' if inside else 'outside'} that "
                f"row's {noise} noise"
            )
    if not points:
        return ""
    text = paragraph(command, outs[0]["env"], points)
    if budgets:
        but = "" if not slower else " but one" if len(slower) == 1 else f" but {WORDS.get(len(slower), len(slower))}"
        text += (
            " `policy=auto` took a plan at most as slow as the fastest uniform plan that fits at every budget"
            f"{but}" + (f" ({'; '.join(slower)})" if slower else "") + "."
        )
    return text


@command
def main(argv: list[str] | None = None) -> int:
    ap = parser(
        "python -m bench.planner",
        __doc__,
        " (default: the conf defaults)",
        BENCHMARKS_PAGE,
        (TABLE, ACCURACY),
        device=True,
        threads=True,
        cached_speed=True,
    )
    ap.add_argument("--model", help="a conf/model option (model=…)")
    ap.add_argument("--models", help="several, comma-separated (tiny,llama-tiny): one table each, in one run")
    ap.add_argument("--budgets", type=at_least(6), default=7, help="how many budgets (default 7)")
    ap.add_argument("--reps", type=at_least(1), default=7, help="timed steps per plan (median)")
    args = ap.parse_intermixed_args(argv)
    if args.model and args.models:
        ap.error("give --model or --models, not both")
    use_device(args.device, args.threads or 1)  # one thread on CUDA too: a steady host on a shared machine
    models = args.models.split(",") if args.models else [args.model] if args.model else [None]
    which = ["--models", args.models] if args.models else ["--model", args.model] if args.model else []
    command = f"{COMMAND} {' '.join([*which, *args.overrides])}".rstrip()
    blocks, outs = [], []
    for model in models:
        overrides = ([f"model={model}"] if model else []) + list(args.overrides)
        outs.append(run(overrides, args.budgets, args.reps, args.device, recalibrate=not args.cached_speed))
        text = header(outs[-1], command) + "\n\n" + tables(outs[-1])
        blocks.append(text if len(models) == 1 else f"**{model}**\n\n{text}")
    block, close = "\n\n".join(blocks), accuracy(outs, command)
    return publish(block + ("\n\n" + close if close else ""), args, {TABLE: block, ACCURACY: close})


if __name__ == "__main__":
    raise SystemExit(main())
