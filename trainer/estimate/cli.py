"""`python -m trainer.estimate`: the tables printed (and written as JSON), the budget verdict, the planner's plan for
a planned policy first."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trainer import precision as precision_
from trainer.core import resolve
from trainer.core.rundir import check_writable, write_json_atomic
from trainer.core.schema import OneLineParser, compose_config, user_error_status
from trainer.errors import UserError
from trainer.estimate.advise import Advice, advise, where_the_peak_is
from trainer.estimate.config_plan import planner_plan
from trainer.estimate.fit import FitTable, fit_table
from trainer.estimate.pipeline_report import pipeline_main
from trainer.estimate.session import Estimate, Session, estimate_device, group_labels, measure, open_session
from trainer.estimate.tables import estimate_tables, quiet_policy_notices
from trainer.formatting import MIB, budget_size, flops_text, markdown_table, mib
from trainer.measure.gpus import DEFAULT_RESERVE, Gpu, Reserve, find_gpu, load_catalogue, parse_size
from trainer.measure.memory.caching_allocator import AllocatorConf
from trainer.measure.time.calibration import REFERENCE_GPU, speed_for
from trainer.measure.time.roofline import Speed, StepTime, gpu_speed
from trainer.policies import POLICIES, Plan, build_policy

MAX_WORLD = 1024  # each world size tried is a fake process group of that many ranks


def parse_bytes(text: str) -> int:
    """'40GB' (10⁹ bytes), '40GiB' (2³⁰), '40000MiB', '1.5TB', '123456' (bytes); case-insensitive."""
    return parse_size(text, "--budget")


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f}"


def _binary(n: int) -> str:
    """A GPU's memory: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / MIB:,.1f} MiB"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
    speed: Speed | None = None,
) -> str:
    """The report: the configured policy's breakdown, its FLOPs, every policy and every loss head side by side (with
    `speed`, each one's predicted step time on that device), the verdict."""
    none = table.get("none")
    base = none.flops if isinstance(none, Estimate) else est.flops
    lines = _header(session, est) + _memory(est)
    lines += [
        "",
        f"compute per optimizer step ({est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''}): "
        f"forward {flops_text(est.fwd_flops)}, backward {flops_text(est.bwd_flops)} (recompute included) "
        f"= {est.flops / base:.3f}× the FLOPs of `none`",
        "",
        _policy_table(est, table, base, budget, speed),
        "(* the configured policy; the others with their conf/policy defaults)",
    ]
    if speed is not None:
        lines += [
            f"step time predicted (not measured) for {speed.name}, by the roofline of trainer.measure.time.roofline:"
        ]
        lines += [f"  assumption: {a}" for a in speed.assumptions]
        mid, slow, fast = speed.predict_range(est.work)
        if speed.ends is not None:
            lines += [
                f"  policy={est.policy}: {mid.ms:,.0f} ms a step, {fast.ms:,.0f}-{slow.ms:,.0f} ms over the published "
                f"efficiency ranges; {mid.tokens_per_s(est.tokens):,.0f} tokens/s "
                f"({slow.tokens_per_s(est.tokens):,.0f}-{fast.tokens_per_s(est.tokens):,.0f})"
            ]
        c, tp = est.work.collectives, est.work.tensor_parallel_bytes
        if c.sent_bytes or tp:
            t = est.step_time(speed)
            what = [c.described] if c.sent_bytes else []
            if tp:
                what.append(
                    f"tensor parallel: {tp / 2**30:.2f} GiB sent per step (its all-gathers, reduce-scatters and "
                    "all-reduces), exposed in full"
                )
            lines += [
                f"  collectives: {'; '.join(what)}; {t.collective_ms:,.1f} ms on the link, "
                f"{t.exposed_collective_ms:,.1f} ms of it exposed (policy={est.policy})"
            ]
    if losses:
        config = session.config
        lines += [
            "",
            f"loss heads under policy={est.policy} (loss.chunk_tokens="
            f"{config.loss.chunk_for(config.batch_size * config.seq_len)}):",
            "",
            _loss_table(est, losses, speed),
        ]
    if budget is not None:
        ok = est.fits(budget)
        fitting = [n for n, e in table.items() if isinstance(e, Estimate) and e.fits(budget)]
        lines.append(
            f"policy={est.policy} {'fits' if ok else 'does not fit'} in {budget_size(budget)} "
            f"({budget / 2**30:,.2f} GiB): it needs {est.peak_bytes / 2**30:,.2f} GiB ({_mib(est.peak_bytes)} MiB)"
            + ("" if ok else f"; policies that fit: {', '.join(fitting) or 'none'}")
        )
    return "\n".join(lines)


def _header(session: Session, est: Estimate) -> list[str]:
    config, d = session.config, session.module.adapter.describe()
    lines = [
        f"model {config.model.name} ({d['family']}): {d['n_layer']} layers, n_embd {d['n_embd']}, {d['n_head']} heads "
        f"({d['n_kv_head']} key/value), vocab {d['vocab_size']}, {d['params']:,} parameters; "
        f"attention={d['attention']}, tied head={d['tied_head']}",
        f"micro-batch {config.batch_size} × {config.seq_len} tokens, accum={config.accum}, "
        f"precision={precision_.describe(est.precision, config.trainer)}, "
        f"loss={est.loss}, device={est.device} (--device cpu|cuda)",
    ]
    return lines + [f"assumption: {n}" for n in dict.fromkeys(est.notes)]


def _memory(est: Estimate) -> list[str]:
    """The configured policy's memory, part by part."""
    c = est.components
    rows = [
        ("parameters", c["parameters"], ""),
        ("buffers", c["buffers"], ""),
        ("AdamW state (exp_avg, exp_avg_sq, step)", c["optimizer_state"], ""),
        ("gradients", c["gradients"], "(last step's alive through the forward; zero_grad after it)"),
        ("activation peak of one micro-batch", est.activation_bytes, "(memory/activation_peak_mib), of which:"),
    ]
    rows += [(f"  {label}", v, "") for label, v in group_labels(est.breakdown).items()]
    rows += [
        (
            "head and loss at its largest",
            est.head_bytes,
            f"(loss={est.loss}: final norm, logits, loss)" if est.head_bytes is not None else "(compiled: no regions)",
        ),
        ("total: the step's peak", est.peak_bytes, "(memory/peak_total_mib), of which:"),
    ]
    rows += [(f"  {label}", v, "") for label, v in group_labels(est.at_step_peak).items()]
    if est.reserved_bytes is not None:
        rows.append(
            (
                "reserved by CUDA's caching allocator",
                est.reserved_bytes,
                f"(memory/peak_reserved_mib: this step replayed through its rules, one stream, {est.allocator} mode)",
            )
        )
    if est.host_pinned_bytes:
        rows.append(
            (
                "pinned host memory at most (off the device)",
                est.host_pinned_bytes,
                "(memory/host_pinned_peak_mib: offload's copies)",
            )
        )
    lines = ["", f"memory, policy={est.policy} (plan {est.plan}), MiB:"]
    lines += [f"  {label:<44}{_mib(v):>12}  {note}".rstrip() for label, v, note in rows]
    per = est.kept_per_layer
    if per:
        per_text = f"{len(per)} × {_mib(per[0])}" if len(set(per)) == 1 else " ".join(_mib(x) for x in per)
        lines.append(f"  kept from forward to backward per layer: {per_text} MiB")
    return lines


def _time_cells(e: Estimate, speed: Speed | None) -> tuple[str, ...]:
    if speed is None:
        return ()
    t = e.step_time(speed)
    return (f"{t.ms:,.1f}", f"{t.tokens_per_s(e.tokens):,.0f}")


def _policy_table(
    est: Estimate, table: dict[str, Estimate | str], base: float, budget: int | None, speed: Speed | None = None
) -> str:
    rows = []
    timed = ("predicted step ms", "predicted tokens/s") if speed is not None else ()
    pinned = any(isinstance(e, Estimate) and e.host_pinned_bytes for e in table.values())  # offload on a CPU: none
    for name, e in table.items():
        star = " *" if name == est.policy else ""
        if isinstance(e, str):
            rows.append((f"{name}{star}", f"n/a: {e}") + ("",) * (5 + len(timed) + pinned))
            continue
        fits = "—" if budget is None else ("yes" if e.fits(budget) else "no")
        rows.append(
            (
                f"{name}{star}",
                _short(e.plan),
                _mib(e.activation_bytes),
                _mib(e.head_bytes),
                _mib(e.peak_bytes),
                f"{e.flops / base:.3f}",
                *_time_cells(e, speed),
                fits,
            )
            + ((_mib(e.host_pinned_bytes),) if pinned else ())
        )
    fits_head = f"fits {budget_size(budget)}?" if budget is not None else "fits? (no --budget)"
    header = (
        "policy",
        "plan",
        "activation peak MiB",
        "head MiB",
        "total MiB",
        "FLOPs × none",
        *timed,
        fits_head,
        *(("host pinned MiB",) if pinned else ()),
    )
    return markdown_table(header, rows, "llrrrr" + "r" * len(timed) + "l" + "r" * pinned)


def _loss_table(est: Estimate, losses: dict[str, Estimate | str], speed: Speed | None = None) -> str:
    std = losses.get("standard")
    rows = []
    for name, e in losses.items():
        star = " *" if name == est.loss else ""
        if isinstance(e, str):
            rows.append((f"{name}{star}", f"n/a: {e}", "", "", "") + ("", "") * (speed is not None))
            continue
        ratio = e.flops / std.flops if isinstance(std, Estimate) else 1.0
        rows.append(
            (
                f"{name}{star}",
                _mib(e.head_bytes),
                _mib(e.activation_bytes),
                _mib(e.peak_bytes),
                f"{ratio:.3f}",
                *_time_cells(e, speed),
            )
        )
    header = ("loss", "head MiB", "activation peak MiB", "total MiB", "FLOPs × standard")
    header += ("predicted step ms", "predicted tokens/s") if speed is not None else ()
    return markdown_table(header, rows, "lrrrrrr")


def render_advice(est: Estimate, advice: list[Advice], budget: int, overrides: Sequence[str]) -> str:
    """Where the peak is, then the priced changes: those that fit first, by compute."""
    rows = [
        (
            a.change,
            "" if a.peak_bytes is None else _mib(a.peak_bytes),
            "" if a.flops_ratio is None else f"{a.flops_ratio:.3f}",
            "yes" if a.fits else "no",
            f"`{a.command(overrides)}`" + (f" ({a.note})" if a.note else ""),
        )
        for a in advice
    ]
    header = ("change", "peak per device MiB", "FLOPs × configured", f"fits {budget_size(budget)}?", "command")
    fitting = sum(a.fits for a in advice)
    return "\n".join(
        [
            f"advice for policy={est.policy}, loss={est.loss} at {budget_size(budget)}: {where_the_peak_is(est)}",
            f"{fitting} of {len(advice)} changes fit:" if fitting else f"none of {len(advice)} changes fits alone:",
            "",
            markdown_table(header, rows, "lrrll"),
        ]
    )


def fit_times(fit: FitTable, gpus: list[Gpu]) -> dict[tuple[str, str], StepTime]:
    """Each cell that fits: its predicted step time per rank on that GPU, from the policy's estimate at the cell's
    own world size (a rank's optimizer step covers its shard, its all-gathers that world's buffers; collectives
    not costed), made where the table did not need it. A catalogue entry without tflops or bandwidth has none."""
    by_name = {g.name: g for g in gpus}
    timed = [
        c
        for c in fit.cells
        if c.world_size is not None and (g := by_name.get(c.gpu)) is not None and g.tflops and g.bandwidth
    ]
    wanted: dict[int, list[str]] = {}
    for c in timed:
        wanted.setdefault(c.world_size or 1, []).append(c.policy)
    at = {w: fit.estimate_at(w, sorted(set(names))) for w, names in wanted.items()}
    return {
        (c.gpu, c.policy): e.step_time(gpu_speed(by_name[c.gpu]))
        for c in timed
        if (e := at[c.world_size or 1].get(c.policy)) is not None
    }


def render_fit_by_time(fit: FitTable, times: dict[tuple[str, str], StepTime], tokens: int) -> str:
    """The cells that fit, fastest first by predicted step time per rank."""
    by = {(c.gpu, c.policy): c for c in fit.cells}
    rows = []
    for (g, p), t in sorted(times.items(), key=lambda kv: kv[1].ms):
        w = by[(g, p)].world_size or 1
        rows.append((g, p, str(w), f"{t.ms:,.1f}", f"{t.tokens_per_s(tokens) * w:,.0f}"))
    header = ("GPU", "policy", "world size", "predicted step ms per rank", "predicted tokens/s, all ranks")
    return "\n".join(
        [
            "where it fits, fastest first (predicted, not measured: trainer.measure.time.roofline's roofline at the "
            "catalogue's peaks × the middle of each GPU's published efficiencies, listed in docs/step-time.md; "
            "collectives not costed):",
            "",
            markdown_table(header, rows, "llrrr"),
        ]
    )


def render_fit(fit: FitTable) -> str:
    """GPUs down, policies across: the smallest FSDP2 world size whose one rank fits."""
    policies = list(dict.fromkeys(c.policy for c in fit.cells))
    gpus = list(dict.fromkeys(c.gpu for c in fit.cells))
    by = {(c.gpu, c.policy): c for c in fit.cells}
    rows = []
    for g in gpus:
        first = by[(g, policies[0])]
        label = f"{g} ({_binary(first.memory_bytes)}, {_binary(first.usable_bytes)} usable)"
        cells = []
        for p in policies:
            c = by[(g, p)]
            cells.append(
                "n/a"
                if p in fit.refusals
                else "—"
                if c.world_size is None
                else f"{c.world_size}" + ("" if c.estimated else " (≤)")
            )
        rows.append((label, *cells))
    lines = [
        f"where it fits (loss={fit.loss}): the smallest FSDP2 world size at which one rank's whole-step peak fits "
        f"the GPU's memory less the reserve ({fit.reserve.describe()}); — does not fit at ≤ {fit.max_world} ranks",
        "",
        markdown_table(("GPU", *policies), rows, "l" + "r" * len(policies)),
        "",
        f"world sizes estimated directly: {', '.join(map(str, fit.worlds_estimated))}; the others lie between "
        "two estimates' bounds (trainer/estimate/fit.py)",
    ]
    lines += [f"n/a {n}: {why}" for n, why in fit.refusals.items()]
    return "\n".join(lines)


def to_json(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
    speed: Speed | None = None,
) -> dict[str, Any]:
    config = session.config

    def one(v: Estimate | str) -> dict[str, Any]:
        if not isinstance(v, Estimate):
            return {"error": v}
        doc = v.to_json() | {"fits": v.fits(budget)}
        if speed is not None:
            t, slow, fast = speed.predict_range(v.work)
            doc["predicted_step"] = t.to_json() | {
                "tokens_per_s": t.tokens_per_s(v.tokens),
                "ms_range": [fast.ms, slow.ms],  # the published efficiencies' fast and slow ends
                "tokens_per_s_range": [slow.tokens_per_s(v.tokens), fast.tokens_per_s(v.tokens)],
            }
        return doc

    return {
        "config": {
            "model": config.model.name,
            **session.module.adapter.describe(),
            "batch_size": config.batch_size,
            "seq_len": config.seq_len,
            "accum": config.accum,
            "precision": est.precision,
            "loss": asdict(config.loss),
        },
        "device": est.device,
        "assumptions": list(dict.fromkeys(est.notes)),
        "step_time_device": None if speed is None else speed.name,
        "step_time_assumptions": [] if speed is None else list(speed.assumptions),
        "budget_bytes": budget,
        "policy": est.policy,
        "fits": est.fits(budget),
        "estimate": one(est),
        "all_policies": {k: one(v) for k, v in table.items()},
        "loss_heads": {k: one(v) for k, v in losses.items()},
    }


_DESCRIPTION = """\
Peak memory, FLOPs and predicted step time of a training configuration under every activation policy and loss head,
before any GPU hour: the real model and one real optimizer step, run on fake tensors (no data, no weights, no GPU
needed, any model size). The figures are the ones a run of the same overrides logs (activation peak, whole-step peak).

  python -m trainer.estimate model=llama3-8b seq_len=8192 --gpu H100-80GB
  python -m trainer.estimate model=llama2-7b batch_size=8 seq_len=4096 --budget 80GB --advise
  python -m trainer.estimate model=llama3-8b trainer=fsdp2 --fit --json est.json

--device cuda estimates for a CUDA GPU even on a machine without one: the fake tensors are CUDA tensors (on a CPU-only
machine, with CUDA's kernel choices applied by rule), and step times are predicted for --gpu (default {ref})."""


def _parser() -> OneLineParser:
    names = ", ".join(load_catalogue())
    parser = OneLineParser(prog="python -m trainer.estimate", description=_DESCRIPTION.format(ref=REFERENCE_GPU))
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, the same as for train.py (model=llama2-7b policy=full seq_len=4096)",
    )
    parser.add_argument(
        "--budget", help="device memory the step must fit in: 40GB (10⁹ bytes), 40GiB (2³⁰ bytes), 40000MiB"
    )
    parser.add_argument(
        "--alloc-conf",
        metavar="SETTINGS",
        help="the CUDA caching allocator's settings the run will have, in PYTORCH_CUDA_ALLOC_CONF's syntax "
        "(expandable_segments:True); default: this environment's PYTORCH_CUDA_ALLOC_CONF (else PYTORCH_ALLOC_CONF)",
    )
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write every figure here as JSON")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="the device the estimate is for (default: cuda if the run would train on one, else cpu); "
        "cuda needs no GPU here",
    )
    parser.add_argument(
        "--autocast-cache",
        action="store_true",
        help="model torch.autocast with its weight cache on (a bare training loop's default); train.py runs it off",
    )
    parser.add_argument(
        "--policies",
        default="all",
        choices=("all", "configured"),
        help="estimate every registered policy (all, the default) or only the configured one (faster)",
    )
    parser.add_argument(
        "--advise",
        action="store_true",
        help="with --budget: the changes that would fit it (policy, loss head, micro-batch, GPUs), each priced "
        "(shown anyway when the configuration does not fit)",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="for each catalogue GPU and policy, the smallest FSDP2 world size whose per-GPU peak fits (implies cuda)",
    )
    parser.add_argument(
        "--reserve",
        default=DEFAULT_RESERVE,
        help="with --fit: the memory each GPU keeps free for the allocator and the CUDA context "
        f"(default {DEFAULT_RESERVE})",
    )
    parser.add_argument(
        "--catalogue",
        action="append",
        metavar="PATH",
        help="more GPUs for --fit and --gpu: a yaml file or a folder of them, in conf/gpu/'s format (repeatable)",
    )
    parser.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"predict step times for this catalogue GPU (implies --device cuda; default with cuda: {REFERENCE_GPU}; "
        f"on cpu: this CPU, calibrated once). One of: {names}",
    )
    parser.add_argument("--no-time", action="store_true", help="leave the predicted step-time columns out")
    parser.add_argument(
        "--compile-vs-eager",
        action="store_true",
        help="also estimate every policy with trainer.compile flipped, and show eager and compiled side by side "
        "(activation and whole-step peaks, predicted step time)",
    )
    parser.add_argument(
        "--max-world",
        type=int,
        default=64,
        metavar="N",
        help="the largest FSDP2 world size --fit and --advise try (default 64)",
    )
    return parser


def _extras(
    args: Any,
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
    plans: dict[str, Plan],
    gpus: list[Gpu],
    reserve: Reserve | None,
    speed: Speed | None = None,
) -> tuple[list[Advice] | None, FitTable | None]:
    """The advice (a budget not met, or --advise) and the fit table (--fit), on the open session."""
    workers = min(2, os.cpu_count() or 1)
    advice = None
    if budget is not None and (args.advise or not est.fits(budget)):
        advice = advise(session, est, table, losses, budget, args.max_world, workers, speed)
    fit = None
    if args.fit:
        assert reserve is not None
        compiled = session.config.trainer.compile
        names = [
            n
            for n, e in table.items()
            if isinstance(e, Estimate)
            or not (POLICIES[n].caps.planned_first or POLICIES[n].caps.not_estimated(compiled))
        ]
        fit = fit_table(
            session.config,
            session.device,
            gpus,
            reserve,
            names,
            plans,
            args.max_world,
            workers,
            session=session,
            known={session.world: table},
        )
    return advice, fit


def _flipped_table(config: Any, device: str, args: Any) -> dict[str, Estimate | str]:
    """Every policy of the table with trainer.compile flipped (a planned policy plans for its own setting: left
    out)."""
    trainer = dataclasses.replace(config.trainer, compile=not config.trainer.compile)
    flipped = dataclasses.replace(config, trainer=trainer)
    session = open_session(flipped, device, args.autocast_cache)
    try:
        if args.policies == "all":
            return estimate_tables(flipped, device, {}, args.autocast_cache, session=session, losses=False)[0]
        policy = build_policy(config.policy)
        if policy.caps.planned_first:
            return {}
        with quiet_policy_notices():
            return {policy.cfg.name: measure(session, policy)}
    finally:
        session.close()


def render_compile_vs_eager(
    table: dict[str, Estimate | str], other: dict[str, Estimate | str], compiled: bool, speed: Speed | None
) -> str:
    """Eager and compiled side by side, per policy estimated both ways."""
    eager, comp = (other, table) if compiled else (table, other)
    rows = []
    for name in table:
        e, c = eager.get(name), comp.get(name)
        if not (isinstance(e, Estimate) and isinstance(c, Estimate)):
            continue
        cells = [f"`{name}`", mib(e.activation_bytes), mib(c.activation_bytes), mib(e.peak_bytes), mib(c.peak_bytes)]
        if speed is not None:
            te, tc = e.step_time(speed).ms, c.step_time(speed).ms
            cells += [f"{te:,.1f}", f"{tc:,.1f}", f"{tc / te:.2f}"]
        rows.append(cells)
    head = ["policy", "activation MiB eager", "compiled", "whole-step MiB eager", "compiled"]
    if speed is not None:
        head += ["step ms eager", "compiled", "compiled ÷ eager"]
    left = [n for n in table if not (isinstance(eager.get(n), Estimate) and isinstance(comp.get(n), Estimate))]
    note = f"\n(not both ways: {', '.join(left)})" if left else ""
    return (
        "eager and compiled (trainer.compile=true), side by side:\n\n"
        + markdown_table(head, rows, "l" + "r" * (len(head) - 1))
        + note
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)  # options may come before, between or after the overrides

    try:
        budget = None if args.budget is None else parse_bytes(args.budget)
        if args.advise and budget is None:
            raise ValueError("--advise prices changes against a budget: give --budget too, e.g. --budget 80GB")
        if not 2 <= args.max_world <= MAX_WORLD:
            raise ValueError(f"--max-world {args.max_world}: give 2 to {MAX_WORLD}")
        reserve = Reserve.parse(args.reserve) if args.fit else None
        gpus = list(load_catalogue(args.catalogue).values()) if args.fit else []
        if args.alloc_conf is not None:
            AllocatorConf.parse(args.alloc_conf)  # a bad setting: one line, before any work
            # the run reads the environment; so does every session of this process and of its workers
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
        if args.gpu and args.device == "cpu":
            raise ValueError(f"--gpu {args.gpu} predicts a GPU's step time: drop --device cpu (it implies cuda)")
        if args.gpu:
            find_gpu(args.gpu, args.catalogue)  # refused here even under --no-time, which would never look it up
        if args.json_path:
            check_writable("--json", Path(args.json_path))  # before the work, not after it
    except (ValueError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session: Session | None = None
    try:
        config = compose_config(args.overrides)
        pipeline = resolve.pipeline_parallel(config)
        if pipeline is not None:
            return pipeline_main(args, config, pipeline, budget)
        policy = build_policy(config.policy)
        device = estimate_device(config, args.device or ("cuda" if args.fit or args.gpu else None))
        speed = None if args.no_time else speed_for(device, args.gpu, args.catalogue)
        plans: dict[str, Plan] = {}
        preface = ""
        if policy.caps.planned_first:
            if config.model.family != "hf":
                with quiet_policy_notices():
                    policy.check(config.model.n_layer, config.model.attention)  # a missing budget: one line, exit 2
            plan, loss_name, preface = planner_plan(config, device, speed)
            plans = {policy.cfg.name: plan}
            policy.choose(plan.treatments)
            if loss_name and loss_name != config.loss.name:
                config.loss = replace(config.loss, name=loss_name)
        session = open_session(config, device, args.autocast_cache)
        opened = session

        def configured() -> Estimate:
            with quiet_policy_notices():
                return measure(opened, policy)  # a policy this model refuses fails here, one line

        table, losses = estimate_tables(
            config,
            device,
            plans,
            args.autocast_cache,
            session=session,
            workers=min(2, os.cpu_count() or 1),
            policies=args.policies == "all",
            first=configured,
        )
        est = table[policy.cfg.name]
        assert isinstance(est, Estimate)
        advice, fit = _extras(args, session, est, table, losses, budget, plans, gpus, reserve, speed)
        other: dict[str, Estimate | str] = {}
        if args.compile_vs_eager:
            session.close()  # one fake session at a time: the other's compile resets dynamo
            other = _flipped_table(config, device, args)
    except Exception as e:
        return user_error_status(e)
    finally:
        if session is not None:
            session.close()
    if preface:
        print(preface.rstrip() + "\n")
    print(render(session, est, table, losses, budget, speed))
    if args.compile_vs_eager:
        print("\n" + render_compile_vs_eager(table, other, config.trainer.compile, speed))
    if advice is not None:
        assert budget is not None
        print("\n" + render_advice(est, advice, budget, args.overrides))
    times = fit_times(fit, gpus) if fit is not None and not args.no_time else {}
    if fit is not None:
        print("\n" + render_fit(fit))
        if times:
            print("\n" + render_fit_by_time(fit, times, est.tokens))
    if args.json_path:
        path = Path(args.json_path)
        doc = to_json(session, est, table, losses, budget, speed)
        if advice is not None:
            doc["advice"] = {"peak": where_the_peak_is(est), "rows": [a.to_json(args.overrides) for a in advice]}
        if fit is not None:
            doc["fit"] = fit.to_json()
            for cell in doc["fit"]:
                t = times.get((cell["gpu"], cell["policy"]))
                cell["predicted_step_ms"] = None if t is None else t.ms
            doc["fit_reserve"] = fit.reserve.describe()
            doc["fit_worlds_estimated"] = fit.worlds_estimated
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, doc)
        except OSError as e:
            print(
                f"error: --json {path}: cannot write it ({e.strerror or e}); the estimate is printed above",
                file=sys.stderr,
            )
            return 2
    return 0
