"""`python -m trainer.estimate`: the tables printed (and written as JSON), the budget verdict, the planner's plan for
a planned policy first."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trainer import step as step_
from trainer.estimate.plan import planner_plan
from trainer.estimate.session import Estimate, Session, estimate_device, measure, open_session
from trainer.estimate.tables import _quiet_policy_notices, estimate_tables
from trainer.policies import Plan, build_policy
from trainer.rundir import write_json_atomic
from trainer.schema import OneLineParser, compose_config
from trainer.text import MIB, markdown_table

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'40GB' (10⁹ bytes), '40GiB' (2³⁰), '40000MiB', '1.5TB', '123456' (bytes); case-insensitive."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--budget {text!r}: write a positive size such as 40GB, 40GiB or 40000MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _size(n: int) -> str:
    """A budget as the user likely wrote it: GB (10⁹) from 1 GB up, MiB below."""
    return f"{n / 1e9:,.4g} GB" if n >= 10**9 else f"{n / MIB:,.1f} MiB"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
) -> str:
    """The report: the configured policy's breakdown, its FLOPs, every policy and every loss head side by side, the
    verdict."""
    none = table.get("none")
    base = none.flops if isinstance(none, Estimate) else est.flops
    lines = _header(session, est) + _memory(est)
    lines += [
        "",
        f"compute per optimizer step ({est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''}): "
        f"forward {_flops(est.fwd_flops)}, backward {_flops(est.bwd_flops)} (recompute included) "
        f"= {est.flops / base:.3f}× the FLOPs of `none`",
        "",
        _policy_table(est, table, base, budget),
        "(* the configured policy; the others with their conf/policy defaults)",
    ]
    if losses:
        config = session.config
        lines += [
            "",
            f"loss heads under policy={est.policy} (loss.chunk_tokens="
            f"{config.loss.chunk_for(config.batch_size * config.seq_len)}):",
            "",
            _loss_table(est, losses),
        ]
    if budget is not None:
        ok = est.fits(budget)
        fitting = [n for n, e in table.items() if isinstance(e, Estimate) and e.fits(budget)]
        lines.append(
            f"policy={est.policy} {'fits' if ok else 'does not fit'} in {_size(budget)} "
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
        f"micro-batch {config.batch_size} × {config.seq_len} tokens, accum={config.accum}, precision={est.precision}, "
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
    rows += [(f"  {label}", v, "") for label, v in _grouped(est.breakdown).items()]
    rows += [
        ("head and loss at its largest", est.head_bytes, f"(loss={est.loss}: final norm, logits, loss)"),
        ("total: the step's peak", est.peak_bytes, "(memory/peak_total_mib), of which:"),
    ]
    rows += [(f"  {label}", v, "") for label, v in _grouped(est.at_step_peak).items()]
    lines = ["", f"memory, policy={est.policy} (plan {est.plan}), MiB:"]
    lines += [f"  {label:<44}{_mib(v):>12}  {note}".rstrip() for label, v, note in rows]
    per = est.kept_per_layer
    if per:
        per_text = f"{len(per)} × {_mib(per[0])}" if len(set(per)) == 1 else " ".join(_mib(x) for x in per)
        lines.append(f"  kept from forward to backward per layer: {per_text} MiB")
    return lines


def _policy_table(est: Estimate, table: dict[str, Estimate | str], base: float, budget: int | None) -> str:
    rows = []
    for name, e in table.items():
        star = " *" if name == est.policy else ""
        if isinstance(e, str):
            rows.append((f"{name}{star}", f"n/a: {e}", "", "", "", "", ""))
            continue
        fits = "—" if budget is None else ("yes" if e.fits(budget) else "no")
        rows.append((f"{name}{star}", _short(e.plan), _mib(e.activation_bytes), _mib(e.head_bytes),
                     _mib(e.peak_bytes), f"{e.flops / base:.3f}", fits))  # fmt: skip
    fits_head = f"fits {_size(budget)}?" if budget is not None else "fits? (no --budget)"
    header = ("policy", "plan", "activation peak MiB", "head MiB", "total MiB", "FLOPs × none", fits_head)
    return markdown_table(header, rows, "llrrrrl")


def _loss_table(est: Estimate, losses: dict[str, Estimate | str]) -> str:
    std = losses.get("standard")
    rows = []
    for name, e in losses.items():
        star = " *" if name == est.loss else ""
        if isinstance(e, str):
            rows.append((f"{name}{star}", f"n/a: {e}", "", "", ""))
            continue
        ratio = e.flops / std.flops if isinstance(std, Estimate) else 1.0
        rows.append((f"{name}{star}", _mib(e.head_bytes), _mib(e.activation_bytes), _mib(e.peak_bytes), f"{ratio:.3f}"))
    header = ("loss", "head MiB", "activation peak MiB", "total MiB", "FLOPs × standard")
    return markdown_table(header, rows, "lrrrr")


def _grouped(by_label: dict[str, int]) -> dict[str, int]:
    """Labels for the report: the layers' forward bytes summed, the rest as they are."""
    out: dict[str, int] = {}
    names = {
        step_.PARAMETERS: "parameters and buffers",
        step_.OPTIMIZER_STATE: "AdamW state",
        step_.LAST_GRADIENTS: "last step's gradients",
        step_.GRADIENTS: "this step's gradients",
        step_.EMBEDDING: "embedding (forward)",
        step_.HEAD: "head and loss (forward and backward)",
        step_.BACKWARD: "backward: gradients in flight, recompute",
        step_.LATER: "later micro-batches",
        step_.OPTIMIZER: "optimizer step temporaries",
    }
    for label, v in by_label.items():
        key = "layers' forward (kept for backward)" if label.startswith("layer ") else names.get(label, label)
        out[key] = out.get(key, 0) + v
    return {k: v for k, v in out.items() if v}


def to_json(
    session: Session,
    est: Estimate,
    table: dict[str, Estimate | str],
    losses: dict[str, Estimate | str],
    budget: int | None,
) -> dict[str, Any]:
    config = session.config

    def one(v: Estimate | str) -> dict[str, Any]:
        return v.to_json() | {"fits": v.fits(budget)} if isinstance(v, Estimate) else {"error": v}

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
        "budget_bytes": budget,
        "policy": est.policy,
        "fits": est.fits(budget),
        "estimate": est.to_json(),
        "all_policies": {k: one(v) for k, v in table.items()},
        "loss_heads": {k: one(v) for k, v in losses.items()},
    }


def _check_writable(path: Path) -> None:
    """--json PATH: a file that can be written (its folder made if missing); a one-line ValueError otherwise."""
    if path.is_dir():
        raise ValueError(f"--json {path} is a folder; give a file path such as {path / 'estimate.json'}")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise ValueError(f"--json {path}: cannot write under {folder}; give a path in a writable folder")


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m trainer.estimate",
        description="Memory and FLOPs of a training configuration under every activation policy and loss head, from "
        "the real model on fake tensors: no data, no weights, no GPU.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (model=llama2-7b policy=full)")
    parser.add_argument("--budget", help="device memory to fit in: 40GB (10⁹ bytes), 40GiB, 40000MiB")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write the estimate here as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if the run would use one, else cpu")
    parser.add_argument(
        "--autocast-cache",
        action="store_true",
        help="model torch.autocast with its weight cache on (a bare loop's default); train.py runs it off",
    )
    parser.add_argument("--policies", default="all", choices=("all", "configured"),
                        help="'all' (default: every registered policy) or 'configured'")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)  # options may come before, between or after the overrides

    from trainer.schema import describe_user_error

    try:
        budget = None if args.budget is None else parse_bytes(args.budget)
        if args.json_path:
            _check_writable(Path(args.json_path))  # before the work, not after it
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session: Session | None = None
    try:
        config = compose_config(args.overrides)
        policy = build_policy(config.policy)
        device = estimate_device(config, args.device)
        plans: dict[str, Plan] = {}
        preface = ""
        if policy.planned_first:
            if config.model.family != "hf":
                with _quiet_policy_notices():
                    policy.check(config.model.n_layer, config.model.attention)  # a missing budget: one line, exit 2
            plan, loss_name, preface = planner_plan(config, device)
            plans = {policy.cfg.name: plan}
            policy.choose(plan.treatments)
            if loss_name and loss_name != config.loss.name:
                config.loss = replace(config.loss, name=loss_name)
        session = open_session(config, device, args.autocast_cache)
        opened = session

        def configured() -> Estimate:
            with _quiet_policy_notices():
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
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        if session is not None:
            session.close()
    if preface:
        print(preface.rstrip() + "\n")
    print(render(session, est, table, losses, budget))
    if args.json_path:
        path = Path(args.json_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, to_json(session, est, table, losses, budget))
        except OSError as e:
            print(f"error: --json {path}: cannot write it ({e.strerror or e}); the estimate is printed above",
                  file=sys.stderr)  # fmt: skip
            return 2
    return 0
