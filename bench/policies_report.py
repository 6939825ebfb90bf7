"""bench.policies' report, from the rows it measured: the header that says how they were measured, the side-by-side
tables, the targets, the paragraph on how close both step-time sources came, and every policy against `none`."""

from __future__ import annotations

from typing import Any

from bench.accuracy import Point, paragraph
from bench.common import Block, environment_text, joined, noisy

TABLE = Block("bench-table", "## Benchmark: step time, memory and FLOPs side by side")
ACCURACY = Block("bench-accuracy", "## How close: step time predicted vs measured")
POLICY_TABLE = Block("policy-table", "## Every policy against `none`")
SOURCE_TARGETS = {"profile": 0.05, "roofline": 0.15}  # a step-time source's target: within this of measured
TARGETS = (  # (target, row, its figure, limit, format) per model: reported, never asserted
    ("full step time ≤ 1.35× none", "full", "step_ratio", 1.35, ".2f"),
    ("selective (eager attention) step time ≤ 1.10× none", "selective", "step_ratio", 1.10, ".2f"),
    ("Lightning ≤ 1.02× bare loop", "lightning_vs_bare", "step_ratio", 1.02, ".3f"),
    ("activation peak of full ≤ 1/4 of none", "full", "activation_ratio", 0.25, ".3f"),
)
UNIFORM = ("none", "selective", "op_sac", "full")


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


def table(result: dict[str, Any]) -> str:
    rows = {kind: [r for r in result["rows"] if r["kind"] == kind] for kind in ("policy", "head", "overhead")}
    lines: list[str] = []

    def flops(r: dict[str, Any]) -> str:
        return (
            f"{r['flops_ratio']:.3f}" + (" †" if r["flops_uncounted"] else "") + f" | {_f(r['est_flops_ratio'], '.3f')}"
        )

    def peaks(r: dict[str, Any]) -> str:
        return f"{r['peak_total_mib']:.1f} | {_f(r['est_peak_total_mib'], '.1f')}"

    if rows["policy"]:
        lines += [
            "| model | policy | step ms | × none | tokens/s | activation MiB | est. | est./meas. | peak total MiB "
            "| est. | FLOPs × none | est. |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows["policy"]:
            act, est = r["activation_mib"], r["est_activation_mib"]
            lines.append(
                f"| {r['model']} | `{r['label']}` | {noisy(r['step_ms'], r['step_spread'], '.1f')} "
                f"| {r['step_ratio']:.2f} | {r['tokens_per_s']:,.0f} | {act:.1f} | {_f(est, '.1f')} "
                f"| {_f(_ratio(est, act), '.2f')} | {peaks(r)} | {flops(r)} |"
            )
    if rows["head"]:
        lines += [""] if lines else []
        lines += [
            "| model (vocab) | policy | loss head | step ms | × standard | activation MiB | est. | head MiB | est. "
            "| head share | peak total MiB | est. | FLOPs × standard | est. |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows["head"]:
            lines.append(
                f"| {r['model']} ({r['vocab']}) | `{r['policy']}` | `{r['label']}` "
                f"| {noisy(r['step_ms'], r['step_spread'], '.1f')} | {r['step_ratio']:.2f} | {r['activation_mib']:.1f} "
                f"| {_f(r['est_activation_mib'], '.1f')} | {r['head_mib']:.1f} | {_f(r['est_head_mib'], '.1f')} "
                f"| {100 * r['head_share']:.0f}% | {peaks(r)} | {flops(r)} |"
            )
    lines += _time_table(rows["policy"])
    uncounted = sorted(
        {op for r in result["rows"] if r.get("flops_uncounted") for op in r["flops_uncounted"].split(",")}
    )
    if uncounted:
        lines += [
            "",
            f"† FlopCounterMode has no formula for {', '.join(f'`{o}`' for o in uncounted)}: the FLOPs "
            "inside it are not counted (measured or estimated).",
        ]
    if rows["overhead"]:
        lines += ["", "| model | loop (policy `none`) | step ms | × bare |", "|---|---|---:|---:|"]
    for o in rows["overhead"]:
        lines += [
            f"| {o['model']} | bare loop (`trainer.core.step.bare_step`) | "
            f"{noisy(o['bare_step_ms'], o['bare_spread'], '.1f')} | 1.00 |",
            f"| {o['model']} | Lightning `Trainer.fit` | {noisy(o['lightning_step_ms'], o['lightning_spread'], '.1f')} "
            f"| {o['step_ratio']:.3f} |",
        ]
    return "\n".join(lines)


def _time_table(rows: list[dict[str, Any]]) -> list[str]:
    """Step time predicted beside measured: the planner's profile (the measured source) and the estimator's roofline
    (the predicted source, fake tensors), each ÷ the measured median."""
    rows = [r for r in rows if r.get("pred_roofline_ms") is not None or r.get("pred_profile_ms") is not None]
    out = [
        "",
        "| model | policy | measured step ms | predicted: profile | ÷ measured | predicted: roofline | ÷ measured "
        "| time × none | FLOPs × none |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prof, roof, ms = r.get("pred_profile_ms"), r.get("pred_roofline_ms"), r["step_ms"]
        out.append(
            f"| {r['model']} | `{r['label']}` | {noisy(ms, r['step_spread'], '.1f')} | {_f(prof, ',.1f')} "
            f"| {_f(_ratio(prof, ms), '.3f')} | {_f(roof, ',.1f')} | {_f(_ratio(roof, ms), '.3f')} "
            f"| {r['step_ratio']:.2f} | {r['flops_ratio']:.3f} |"
        )
    return out if rows else []


def _target(model: str, what: str, value: float | None, limit: float, fmt: str, note: str = "") -> dict[str, Any]:
    return {
        "model": model,
        "target": what,
        "value": value,
        "limit": limit,
        "met": None if value is None or note else value <= limit,  # a note: the target does not apply
        "shown": "n/a" if value is None else format(value, fmt),
        "note": note,
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, section in enumerate(result["sections"]):
        by = {r["name"]: r for r in result["rows"] if r["section"] == i and r["kind"] in ("policy", "overhead")}
        if "none" not in by:
            continue  # a section of loss heads only
        model = section["model"]

        sel = by.get("selective")
        sdpa = sel is not None and "selective" not in sel["plan"]  # its plan says what it amounts to here
        for what, name, key, limit, fmt in TARGETS:
            note = (
                "not this run: sdpa attention, where selective stores like none" if name == "selective" and sdpa else ""
            )
            out.append(_target(model, what, by[name][key] if name in by else None, limit, fmt, note))
        for name in (n for n in UNIFORM if n in by):
            for source, limit in SOURCE_TARGETS.items():
                what = f"{name}: {source}-predicted step time within {100 * limit:g} % of measured"
                out.append(_target(model, what, _error(by[name], f"pred_{source}_ms"), limit, ".1%"))
        if "full" in by:
            full = by["full"]
            gap = abs(full["step_ratio"] - full["flops_ratio"]) / full["flops_ratio"]
            out.append(_target(model, "full: time × none within 3 % of its FLOPs × none", gap, 0.03, ".1%"))
    return out


def _error(r: dict[str, Any], key: str) -> float | None:
    v = r.get(key)
    return None if v is None else abs(v / r["step_ms"] - 1)


def targets_text(items: list[dict[str, Any]]) -> str:
    lines = ["Targets (reported, not asserted):", ""]
    for t in items:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"- {t['model']}: {t['target']}: {t['shown']} — {verdict}{note}")
    return "\n".join(lines)


def header(result: dict[str, Any]) -> str:
    m = result["meta"]
    shapes = "; ".join(f"{s['shape']}" for s in result["sections"])
    fwd = "autocast forward (no weight cache)" if m["precision"].endswith("-mixed") else f"{m['precision']} forward"
    clip = result["sections"][0]["grad_clip"]
    skipped = {k: v for s in result["sections"] for k, v in s["skipped"].items()}
    not_run = "".join(f" Not run: `{k}` ({v.rstrip('.')})." for k, v in skipped.items())
    heads = [r for r in result["rows"] if r["kind"] == "head"]
    head_text = ""
    if heads:
        head_text = (
            f" Loss heads at vocab {heads[0]['vocab']} on `{heads[0]['model']}`: ratios against `standard` under the "
            "same policy; head MiB = the most the head (final norm, logits, loss; forward and backward) held at once "
            "(StepMeter's head_peak), head share = head MiB / activation MiB."
        )
    peak = "; CUDA: the live-tensor figure (the allocator's peak is in results.csv)" if m["device"] == "cuda" else ""
    return (
        f"Generated by `{m['command']} --write-docs` ({environment_text(m)}, {m['seconds']:.0f} s). "
        f"Shapes: {shapes}. One process; per configuration one `DecoderModule` (seeded as train.py seeds it) and one "
        "fixed batch of random tokens. Every variant runs `trainer.core.step.bare_step`, the step as Lightning runs it "
        f"({fwd}, zero_grad after the first forward, backward, clip {clip:g}, AdamW, LR step), in {m['rounds']} "
        f"interleaved rounds (order rotated) after {m['warmup_rounds']} warm-up; medians (± half the IQR); "
        "× = median of per-round ratios. Activation and peak total: `trainer.core.step.StepMeter` (a run's "
        f"memory/activation_peak_mib and memory/peak_total_mib{peak}). FLOPs: "
        "`trainer.measure.time.flops.count_flops` over the "
        "step (recompute included). est.: `trainer.estimate` for the same config on fake tensors."
        + head_text
        + " Lightning: one `Trainer.fit` of the same `DecoderModule` on a fixed in-memory batch (no logger, "
        "checkpoints or progress bar), each iteration timed from one `on_train_batch_start` to the next, alternating "
        f"with a bare step of a twin module run from that hook; median of per-pair ratios over {m['overhead_pairs']} "
        f"pairs. Step time predicted: profile = the planner's measured source (`trainer.planner.profile_model` on "
        "the same module, as policy=auto takes it at fit start: block times scaled to the whole stack's; "
        "`PeakModel.step_ms` of the plan; the median over a profile before the timed rounds and one after each); "
        "roofline = the predicted source (the estimator's fake-tensor step costed "
        f"by `trainer.measure.time.roofline` for {result['sections'][0].get('speed', 'this device')}).{not_run}"
    )


def accuracy(result: dict[str, Any]) -> str:
    """How close the profile and the roofline came to the measured steps of the uniform policies, how each ranks
    them, and what `full` costs against its FLOPs: one paragraph ('' without a uniform policy row)."""
    rows = [r for r in result["rows"] if r["kind"] == "policy" and r["name"] in UNIFORM]
    fields = ("model", "name", "step_ms", "step_spread", "pred_profile_ms", "pred_roofline_ms")
    points = [Point(*(r[k] for k in fields)) for r in rows]
    if not points:
        return ""
    text = paragraph(result["meta"]["command"], result["meta"], points, SOURCE_TARGETS)
    fulls = [r for r in rows if r["name"] == "full"]
    if fulls:
        first, *rest = fulls
        costs = [
            f"{first['step_ratio']:.2f}× `none` on `{first['model']}` against {first['flops_ratio']:.2f}× its FLOPs"
        ]
        costs += [f"{r['step_ratio']:.2f}× on `{r['model']}` against {r['flops_ratio']:.2f}×" for r in rest]
        text += f" `full` costs {joined(costs)}."
    return text


def report(result: dict[str, Any]) -> str:
    """The header, the tables and the targets (how each source ranks the policies is `accuracy`'s paragraph)."""
    return header(result) + "\n\n" + table(result) + "\n\n" + targets_text(result["targets"])


def policy_table(result: dict[str, Any]) -> str:
    """Every policy against `none` on the first model: its plan, activation peak and FLOPs, from the rows the
    side-by-side table shows (the same steps, not measured again)."""
    m, section = result["meta"], result["sections"][0]
    rows = [r for r in result["rows"] if r["section"] == 0 and r["kind"] == "policy"]
    none = next(r for r in rows if r["name"] == "none")
    lines = [
        f"From `{m['command']} --write-docs` ({environment_text(m)}), the first shape of the side-by-side table "
        f"below: {section['shape']}. Per policy (parameters from conf/policy/) its plan (`Plan.describe()`), the "
        "activation peak (`trainer.core.step.StepMeter`: a run's memory/activation_peak_mib, gradient buffers and the "
        "training state left out) and the FLOPs of one step (`trainer.measure.time.flops.count_flops`, recompute "
        "included; torch's checkpoint early stop skips each region's trailing ops that nothing saves).",
        "",
        "| policy | plan (`Plan.describe()`) | activation peak MiB | × none | GFLOP fwd+bwd | × none |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name, _, params = r["label"].partition(" ")
        lines.append(
            f"| `{name}`{' ' + params if params else ''} | `{r['plan']}` | {r['activation_mib']:.1f} "
            f"| {r['activation_mib'] / none['activation_mib']:.2f} | {r['flops'] / 1e9:.2f} "
            f"| {r['flops'] / none['flops']:.3f} |"
        )
    return "\n".join(lines)
