"""`policy=auto` across memory budgets, beside the fastest uniform policy that fits: measured peak and step time.

    python -m bench.planner                  # print the tables (the conf defaults: model=tiny, 4×256 tokens)
    python -m bench.planner --write-docs     # also rewrite docs/benchmarks.md's planner-table and planner-accuracy
    python -m bench.planner --model llama-tiny --budgets 6 --reps 3

One process, one configuration composed as train.py composes it with `policy=auto`
(`trainer.core.schema.compose_config`; precision=auto settles as a run settles it), one `DecoderModule` and one fixed
batch of random tokens (bench/harness.py):

1. Profile once, as the planning callback does at fit start: `trainer.planner.plan_model` on the module's model and
   one micro-batch, with the module's loss heads (`head_candidates`: the configured one, then policy.loss_candidates)
   and the run's optimizer, parameter groups and clipping, at a budget everything fits. `PeakModel` on that profile
   predicts every uniform plan of the treatments the planner chooses from.
2. Budgets: evenly spaced from the `none` prediction down to below the most frugal uniform plan's (at least 6). For
   each, the plan `policy=auto` would install: `solve_profile` on the same profile, with plan_model's rule for the
   loss head (the configured head when any plan fits with it, else the fastest plan with another head). Where
   nothing fits at the configured micro-batch, the row shows the smallest budget that would, and the plan
   `policy.allow_accum=true` trains instead (plan_model again: micro-batch halved, accumulation doubled, same tokens
   per step, profiled anew).
3. Every distinct plan (auto's and the uniform ones) is installed as training installs it (the `auto` policy with
   the chosen treatments, `Plan.per_block`) and measured in the same process with `trainer.core.step.bare_step`, the
   step as Lightning runs it: peak = `trainer.core.step.StepMeter`'s whole-step figure (what a run reports as
   `peak_total_mib`, the figure the budget bounds); time = median over `--reps` rounds interleaved across plans
   (order rotated), so load on a shared machine spreads over all plans alike.

`auto` under trainer.compile=true beside torch's budget partitioner is bench.compiled's.

`--write-docs` puts the tables between docs/benchmarks.md's planner-table markers, and the paragraph on how close
both step-time sources came and whether `auto` ever lost to a uniform plan (`accuracy`) between its
planner-accuracy markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench._readme import BENCHMARKS_PAGE, CACHED_SPEED_HELP, add_page_arguments, environment_text, replace_block
from bench.accuracy import WORDS, Point, rankings_text, sources_text
from bench.harness import (
    BenchError,
    Harness,
    Variant,
    bench_config,
    budget_levels,
    estimated,
    estimator_session,
    quiet_policy_notices,
    spread,
)
from trainer.core.module import param_groups
from trainer.core.schema import describe_user_error
from trainer.formatting import MIB, mib
from trainer.loss import LossConfig
from trainer.measure.time.calibration import speed_here
from trainer.planner import (
    PeakModel,
    choose,
    default_optimizer,
    head_candidates,
    plan_model,
    profile_model,
    smallest_budget_mib,
)
from trainer.policies import Plan, Policy, PolicyError, build_policy

START, END = "<!-- planner-table:start -->", "<!-- planner-table:end -->"
HEADING = "## Measured: `policy=auto` across memory budgets"
ACCURACY_START, ACCURACY_END = "<!-- planner-accuracy:start -->", "<!-- planner-accuracy:end -->"
ACCURACY_HEADING = "## How close: step time predicted vs measured"
COMMAND = "python -m bench.planner --write-docs"


def run(
    overrides: Sequence[str], n_budgets: int, reps: int, device: str = "cpu", recalibrate: bool = True
) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        config, env = bench_config(["policy=auto", "policy.budget_mib=1", *overrides], device)  # budgets: below
        auto = build_policy(config.policy)
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        raise BenchError(line) from None
    wd = config.optim.weight_decay
    configured = (config.batch_size, config.accum)
    h = Harness(config, device)
    h.warm()
    model = h.module.model
    measure = {
        "loss_fns": head_candidates(h.module, auto.cfg),
        "precision": h.precision,
        "make_optimizer": default_optimizer(wd),
        "param_groups": param_groups(model, wd),
        "grad_clip": config.trainer.grad_clip,
    }
    with quiet_policy_notices():  # the planner's two verbs, as the planning callback calls them at fit start
        prof = profile_model(model, h.batches()[0], auto, accum=config.accum, **measure)
    L = prof.n_layer
    predicted = {t: PeakModel(prof).evaluate([t] * L) for t in prof.treatments}
    budgets = budget_levels([p.peak for p in predicted.values()], n_budgets)

    variants: dict[str, Variant] = {}

    def variant(treatments: Sequence[str], loss: str, micro_batch: int) -> str:
        key = f"{Plan.per_block(treatments).describe()} loss={loss} micro-batch={micro_batch}"
        if key not in variants:
            loss_cfg = LossConfig(
                name=loss, chunk_tokens=config.loss.chunk_tokens, ignore_index=config.loss.ignore_index
            )
            variants[key] = Variant(key, _auto(auto.cfg, treatments), loss_cfg, micro_batch)
        return key

    uniform = {t: variant([t] * L, config.loss.name, config.batch_size) for t in prof.treatments}
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        row: dict[str, Any] = {"budget_mib": budget}
        result = choose(prof, int(budget * MIB), f"policy.budget_mib={budget:g}", configured)
        if result is None:
            heads = list(prof.heads.values()) or [prof]
            row["refused_below_mib"] = smallest_budget_mib(min(PeakModel(p).min_peak().peak for p in heads))
            try:
                with quiet_policy_notices():
                    accum_cfg = dataclasses.replace(auto.cfg, budget_mib=budget, allow_accum=True)
                    result = plan_model(model, h.batches()[0], accum_cfg, accum=config.accum, **measure)
            except PolicyError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
        row["result"] = result
        row["variant"] = variant(result.treatments, result.loss or config.loss.name, result.micro_batch)
        rows.append(row)

    profiles = [prof]  # the planner's profile again after each timed round: drift falls on both alike

    def again() -> None:
        with quiet_policy_notices():
            profiles.append(profile_model(model, h.batches()[0], auto, accum=config.accum, **measure))

    measured = _measure(h, variants, reps, again)
    profile_ms = {t: statistics.median(PeakModel(p).step_ms([t] * L) for p in profiles) for t in prof.treatments}
    speed = speed_here(device, recalibrate=recalibrate)  # beside the measured steps, unless --cached-speed
    session = estimator_session(config, h.device)
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
        "profile_ms": profile_ms,
        "profiles": len(profiles),
        "speed": speed.describe(),
        "profile_notes": list(prof.notes),
        "rows": rows,
        "reps": reps,
        "seconds": time.perf_counter() - t0,
    }


def _measure(
    h: Harness, variants: dict[str, Variant], reps: int, between: Callable[[], None] | None = None
) -> dict[str, dict[str, Any]]:
    """One metered step per plan (StepMeter), then timed rounds interleaved across plans (medians)."""
    measured: dict[str, dict[str, Any]] = {}
    with quiet_policy_notices():
        for key, v in variants.items():
            f = h.measure(v)
            installed = h.module.model.activation_plan
            measured[key] = {"peak": f.total_bytes, "activation": f.activation_bytes, "installed": installed}
        times = h.interleaved(variants, reps, between=between)
    for key, m in measured.items():
        m["ms"] = statistics.median(times[key]) * 1e3
        m["spread"] = spread(times[key])
    return measured


def _auto(cfg: Any, treatments: Sequence[str]) -> Callable[[], Policy]:
    """policy=auto with these treatments chosen, as the planning callback installs its plan."""

    def make() -> Policy:
        policy = build_policy(cfg)
        policy.choose(treatments)  # type: ignore[attr-defined]
        return policy

    return make


def tables(out: dict[str, Any]) -> str:
    uniform, rows = out["uniform"], out["rows"]
    configured_loss = out["config"].loss.name
    lines = [
        "| budget MiB | `auto` plan | predicted MiB | measured MiB | predicted step ms | measured step ms | "
        "fastest uniform that fits | its measured MiB | its step ms | auto ÷ uniform |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        b = row["budget_mib"]
        u = row["uniform"]
        ucells = (
            f"`{u}` | {mib(uniform[u]['peak'])} | {uniform[u]['ms']:,.0f} ±{100 * uniform[u]['spread']:.0f}%"
            if u is not None
            else "none fits | — | —"
        )
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
        ratio = f"{m['ms'] / uniform[u]['ms']:.2f}" if u is not None else "—"
        mark = "" if m["peak"] <= b * MIB else " ⚠"
        lines.append(
            f"| {b:g} | {plan} | {mib(res.solution.peak)} | {mib(m['peak'])}{mark} | {res.solution.step_ms:,.0f} | "
            f"{m['ms']:,.0f} ±{100 * m['spread']:.0f}% | {ucells} | {ratio} |"
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
            f"| `{t}` | {mib(s.peak)} | {mib(r['peak'])} | {r['ms']:,.0f} ±{100 * r['spread']:.0f}% "
            f"| {pm:,.0f} | {pm / r['ms']:.3f} | {roof:,.0f} | {roof / r['ms']:.3f} |"
        )
    order = {
        k: " < ".join(sorted(out["predicted"], key=f))
        for k, f in (
            ("measured", lambda t: uniform[t]["ms"]),
            ("profile", lambda t: out["profile_ms"][t]),
            ("roofline", lambda t: out["roofline"][t]),
        )
    }
    lines += [
        "",
        f"Ranking by step time: measured {order['measured']}; profile {order['profile']}; roofline "
        f"{order['roofline']}.",
    ]
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
    text = f"From `{command}` ({environment_text(outs[0]['env'])}): {sources_text(points)}."
    ranks = rankings_text(points)
    text += f" {ranks}." if ranks else ""
    if budgets:
        but = "" if not slower else " but one" if len(slower) == 1 else f" but {WORDS.get(len(slower), len(slower))}"
        text += (
            " `policy=auto` took a plan at most as slow as the fastest uniform plan that fits at every budget"
            f"{but}" + (f" ({'; '.join(slower)})" if slower else "") + "."
        )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (default: the conf defaults)")
    ap.add_argument("--model", help="a conf/model option (model=…)")
    ap.add_argument("--models", help="several, comma-separated (tiny,llama-tiny): one table each, in one run")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the steps run (default cpu)")
    ap.add_argument("--budgets", type=int, default=7, help="how many budgets (≥ 6)")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per plan (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    ap.add_argument("--cached-speed", action="store_true", help=CACHED_SPEED_HELP)
    add_page_arguments(
        ap,
        BENCHMARKS_PAGE,
        f"the blocks between {START} and {END} and between {ACCURACY_START} and {ACCURACY_END}",
    )
    args = ap.parse_intermixed_args(argv)
    if args.budgets < 6:
        ap.error("--budgets must be at least 6")
    if args.reps < 1:
        ap.error("--reps must be ≥ 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda: no CUDA device is visible to torch {torch.__version__}", file=sys.stderr)
        return 2
    if args.model and args.models:
        ap.error("give --model or --models, not both")
    torch.set_num_threads(args.threads)
    models = args.models.split(",") if args.models else [args.model] if args.model else [None]
    which = ["--models", args.models] if args.models else ["--model", args.model] if args.model else []
    command = f"{COMMAND} {' '.join([*which, *args.overrides])}".rstrip()
    blocks, outs = [], []
    for model in models:
        overrides = ([f"model={model}"] if model else []) + list(args.overrides)
        try:
            out = run(overrides, args.budgets, args.reps, args.device, recalibrate=not args.cached_speed)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        outs.append(out)
        text = header(out, command) + "\n\n" + tables(out)
        blocks.append(text if len(models) == 1 else f"**{model}**\n\n{text}")
    block = "\n\n".join(blocks)
    close = accuracy(outs, command)
    print(block + ("\n\n" + close if close else ""))
    if args.write_docs:
        replace_block(args.page, START, END, block, HEADING)
        if close:
            replace_block(args.page, ACCURACY_START, ACCURACY_END, close, ACCURACY_HEADING)
        print(f"\nwrote {args.page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
