"""Memory and FLOPs of a training configuration under every policy, before any GPU hour: the real model, run on
fake tensors.

    python -m trainer.estimate model=llama2-7b batch_size=8 seq_len=4096 policy=full --budget 80GB
    python -m trainer.estimate model=llama3-8b seq_len=8192 loss=chunked --json est.json
    python -m trainer.estimate policy=selective --device cuda

The same Hydra overrides as train.py compose the same config. The estimator builds the LightningModule exactly as a
run does (the model of any family, the policy installed through the decoder contract, the loss head, AdamW and its
schedule, the precision plugin's module conversion) inside `torch._subclasses.fake_tensor.FakeTensorMode`, so no
weight or activation is ever allocated, and runs one steady-state optimizer step as Lightning runs it
(`trainer.step.bare_step`: forward in Lightning's own precision context with last step's gradients alive, zero_grad,
backward, the numeric guard's norm, clipping, AdamW, the LR step) under the same `StepMeter` the measuring callback
uses. The two figures are therefore the two a run logs: `activation_bytes` = memory/activation_peak_mib and
`peak_bytes` = memory/peak_total_mib. FLOPs come from torch's FlopCounterMode over the same step.

The session (the module on fake tensors, stepped once, and `measure`) is trainer/session.py; this module makes the
tables from it and is the CLI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from trainer import step as step_
from trainer.loss import LOSSES
from trainer.memory import MIB
from trainer.policies import POLICIES, Plan, Policy, PolicyError, build_policy, resolve_plan
from trainer.rundir import write_json_atomic
from trainer.schema import CONF, Config, OneLineParser, compose_config
from trainer.session import (
    CudaKernelRules,
    Estimate,
    Session,
    estimate,
    estimate_device,
    measure,
    open_session,
)

log = logging.getLogger(__name__)


def default_policy(name: str) -> Policy:
    """A registered policy with the parameters of its conf/policy/<name>.yaml (the class defaults without one)."""
    path = CONF / "policy" / f"{name}.yaml"
    return build_policy(OmegaConf.load(path) if path.is_file() else {"name": name})


Task = tuple[str, str | None]  # (policy, loss head; None: the configured one)


def estimate_all(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
) -> dict[str, Estimate | str]:
    """Every registered policy: the configured one with its parameters, the others with their conf defaults;
    `plans` gives a policy's plan (the one a planner chose for `auto`). A policy that cannot run this model (e.g.
    policy.k > n_layer) maps to its one-line reason; `auto` without a plan is left out. `known`: the configured
    policy's estimate, already made. See `estimate_tables` for `workers`."""
    table, _ = estimate_tables(config, device, plans, autocast_cache, session, known, workers, losses=False)
    return table


def estimate_tables(
    config: Config,
    device: str | None = None,
    plans: dict[str, Plan] | None = None,
    autocast_cache: bool = False,
    session: Session | None = None,
    known: Estimate | None = None,
    workers: int = 1,
    losses: bool = True,
    policies: bool = True,
    first: Callable[[], Estimate] | None = None,
) -> tuple[dict[str, Estimate | str], dict[str, Estimate | str]]:
    """The policy table (`estimate_all`; with `policies` false, only `known`) and, with `losses`, the configured
    policy under every loss head. `first` makes the configured policy's estimate in this process once the workers
    are started (so their start-up overlaps it); it stands for `known`.

    A policy whose plan runs as one already measured (selective under fused attention, offload without a device to
    offload from: both `none`) takes that estimate under its own name. `workers` > 1 measures part of the work in
    other processes, each with a session of its own: the fake run is Python-bound, so on 2 cores the tables of a 7B
    model take about half the time."""
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy).cfg.name
    table: dict[str, Estimate | str] = {}
    heads: dict[str, Estimate | str] = {}
    tasks: list[Task] = []
    own_policy = known.policy if known is not None else configured if first is not None else None
    own_loss = known.loss if known is not None else config.loss.name if first is not None else None
    for name in POLICIES:
        if name == own_policy:
            if known is not None:
                table[name] = known
        elif not policies:
            continue
        elif name == "auto" and (plans or {}).get("auto") is None:
            table[name] = "needs a budget (policy=auto policy.budget_mib=…) to plan"
        else:
            tasks.append((name, None))
    for name in LOSSES if losses else ():
        if name == own_loss:
            if known is not None:
                heads[name] = known
        else:
            tasks.append((configured, name))
    shares = _split(tasks, workers, session, config, plans, first is not None) if workers > 1 else [tasks]
    pool = None
    futures = []
    if len(shares) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(len(shares) - 1, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(_run_tasks, config, session.device, plans, autocast_cache, t) for t in shares[1:]]
    done: dict[Task, Estimate | str] = {}
    try:
        if first is not None:
            known = first()
            table[known.policy] = known
            if losses:
                heads[known.loss] = known
        done |= _run_tasks(config, session.device, plans, autocast_cache, shares[0], session, known)
        for f in futures:
            done |= f.result()
    finally:
        if pool is not None:
            pool.shutdown()
    for (name, loss), value in done.items():
        if loss is None:
            table[name] = value
        else:
            heads[loss] = value
    return ({n: table[n] for n in POLICIES if n in table}, {n: heads[n] for n in LOSSES if n in heads})


def _run_tasks(
    config: Config,
    device: str,
    plans: dict[str, Plan] | None,
    autocast_cache: bool,
    tasks: list[Task],
    session: Session | None = None,
    known: Estimate | None = None,
) -> dict[Task, Estimate | str]:
    """Each (policy, loss head) of `tasks` on `session` (a new one in a worker process), each run measured once."""
    own = session is None
    session = session or open_session(config, device, autocast_cache)
    configured = build_policy(config.policy)
    fake_cpu = not (session.device == "cuda" and torch.cuda.is_available())
    measured: dict[tuple[str, str], Estimate] = {}
    if known is not None:
        measured[(_same_run(known.plan, fake_cpu), known.loss)] = known
    current = config.loss
    out: dict[Task, Estimate | str] = {}
    try:
        for name, loss_name in tasks:
            try:
                policy = configured if name == configured.cfg.name else default_policy(name)
                if name == "auto":
                    policy.choose((plans or {})["auto"].treatments)  # type: ignore[attr-defined]
                loss = None if loss_name is None else replace(current, name=loss_name)
                with _quiet_policy_notices():
                    policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
                    plan = resolve_plan(policy, session.module.adapter).describe()
                    key = (_same_run(plan, fake_cpu), loss_name or current.name)
                    if key in measured:
                        out[(name, loss_name)] = replace(measured[key], policy=name, plan=plan)
                        continue
                    out[(name, loss_name)] = measured[key] = measure(session, policy, loss)
            except (PolicyError, ValueError) as e:  # a policy this model refuses; a loss head this torch lacks
                out[(name, loss_name)] = str(e)
    finally:
        if own:
            session.close()
    return out


def _split(
    tasks: list[Task], workers: int, session: Session, config: Config, plans: dict[str, Plan] | None, first: bool
) -> list[list[Task]]:
    """Tasks into `workers` shares of about equal work: tasks that run the same step (one is measured, the others
    take its figures) stay together, this process also makes the configured estimate (`first`), and a worker spends
    about a step's time starting up."""
    if len(tasks) <= 2:
        return [tasks]
    fake_cpu = not (session.device == "cuda" and torch.cuda.is_available())
    configured = build_policy(config.policy)
    groups: dict[Any, list[Task]] = {}
    for name, loss in tasks:
        policy = configured if name == configured.cfg.name else default_policy(name)
        try:
            if name == "auto":
                policy.choose((plans or {})["auto"].treatments)  # type: ignore[attr-defined]
            with _quiet_policy_notices():
                policy.check(session.module.adapter.n_layer, session.module.adapter.attention)
            key: Any = (_same_run(resolve_plan(policy, session.module.adapter).describe(), fake_cpu), loss)
        except PolicyError:
            key = (name, loss)  # refused: no step, nearly free
        groups.setdefault(key, []).append((name, loss))
    shares: list[list[Task]] = [[] for _ in range(workers)]
    load = [1.0 if first else 0.0] + [1.0] * (workers - 1)
    for group in groups.values():
        i = min(range(workers), key=lambda k: load[k])
        shares[i] += group
        load[i] += 1.0
    return [s for s in shares if s] if shares[0] else [tasks]


def _same_run(plan: str, fake_cpu: bool) -> str:
    """Plans that run the same step: on CPU kernels `offload` moves nothing, so it is `none`."""
    return plan.replace(":offload", ":none") if fake_cpu else plan


@contextlib.contextmanager
def _quiet_policy_notices() -> Iterator[None]:
    """Estimating every policy must not print each one's one-time notice (e.g. offload on CPU)."""
    from trainer import policies

    logger = logging.getLogger(policies.__name__)
    level = logger.level
    said = set(policies.base._said)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        policies.base._said.intersection_update(said)  # a later real run still gets its notice


def planner_plan(config: Config, device: str) -> tuple[Plan, str, str]:
    """policy=auto: the plan, loss head and explanation trainer/planner.py chooses (a PolicyError when none fits),
    profiled on fake tensors like the rest of the estimate: bytes as a run measures them, step times ranked by
    FLOPs (a run plans on measured times, so near-equal plans may differ)."""
    from trainer.planner import plan_for_config

    return plan_for_config(config, device, fake=True)


# ----------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------

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
    config, module = session.config, session.module
    d = module.adapter.describe()
    none = table.get("none")
    base = none.flops if isinstance(none, Estimate) else est.flops
    lines = [
        f"model {config.model.name} ({d['family']}): {d['n_layer']} layers, n_embd {d['n_embd']}, {d['n_head']} heads "
        f"({d['n_kv_head']} key/value), vocab {d['vocab_size']}, {d['params']:,} parameters; "
        f"attention={d['attention']}, tied head={d['tied_head']}",
        f"micro-batch {config.batch_size} × {config.seq_len} tokens, accum={config.accum}, precision={est.precision}, "
        f"loss={est.loss}, device={est.device} (--device cpu|cuda)",
    ]
    lines += [f"assumption: {n}" for n in dict.fromkeys(est.notes)]
    c = est.components
    lines += ["", f"memory, policy={est.policy} (plan {est.plan}), MiB:"]
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
    lines += [f"  {label:<44}{_mib(v):>12}  {note}".rstrip() for label, v, note in rows]
    per = est.kept_per_layer
    if per:
        per_text = f"{len(per)} × {_mib(per[0])}" if len(set(per)) == 1 else " ".join(_mib(x) for x in per)
        lines.append(f"  kept from forward to backward per layer: {per_text} MiB")
    lines += [
        "",
        f"compute per optimizer step ({est.micro_batches} micro-batch{'es' if est.micro_batches > 1 else ''}): "
        f"forward {_flops(est.fwd_flops)}, backward {_flops(est.bwd_flops)} (recompute included) "
        f"= {est.flops / base:.3f}× the FLOPs of `none`",
        "",
    ]
    fits_head = f"fits {_size(budget)}?" if budget is not None else "fits? (no --budget)"
    lines += [
        f"| policy | plan | activation peak MiB | head MiB | total MiB | FLOPs × none | {fits_head} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, e in table.items():
        star = " *" if name == est.policy else ""
        if isinstance(e, str):
            lines.append(f"| {name}{star} | n/a: {e} | | | | | |")
            continue
        fits = "—" if budget is None else ("yes" if e.fits(budget) else "no")
        lines.append(
            f"| {name}{star} | {_short(e.plan)} | {_mib(e.activation_bytes)} | {_mib(e.head_bytes)} | "
            f"{_mib(e.peak_bytes)} | {e.flops / base:.3f} | {fits} |"
        )
    lines.append("(* the configured policy; the others with their conf/policy defaults)")
    if losses:
        std = losses.get("standard")
        lines += [
            "",
            f"loss heads under policy={est.policy} (loss.chunk_tokens="
            f"{config.loss.chunk_for(config.batch_size * config.seq_len)}):",
            "",
            "| loss | head MiB | activation peak MiB | total MiB | FLOPs × standard |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, e in losses.items():
            star = " *" if name == est.loss else ""
            if isinstance(e, str):
                lines.append(f"| {name}{star} | n/a: {e} | | | |")
                continue
            ratio = e.flops / std.flops if isinstance(std, Estimate) else 1.0
            lines.append(
                f"| {name}{star} | {_mib(e.head_bytes)} | {_mib(e.activation_bytes)} | {_mib(e.peak_bytes)} | "
                f"{ratio:.3f} |"
            )
    if budget is not None:
        ok = est.fits(budget)
        fitting = [n for n, e in table.items() if isinstance(e, Estimate) and e.fits(budget)]
        lines.append(
            f"policy={est.policy} {'fits' if ok else 'does not fit'} in {_size(budget)} "
            f"({budget / 2**30:,.2f} GiB): it needs {est.peak_bytes / 2**30:,.2f} GiB ({_mib(est.peak_bytes)} MiB)"
            + ("" if ok else f"; policies that fit: {', '.join(fitting) or 'none'}")
        )
    return "\n".join(lines)


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


def main(argv: Sequence[str] | None = None) -> int:
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
        if policy.cfg.name == "auto":
            if config.model.family != "hf":
                with _quiet_policy_notices():
                    policy.check(config.model.n_layer, config.model.attention)  # a missing budget: one line, exit 2
            plan, loss_name, preface = planner_plan(config, device)
            plans = {"auto": plan}
            policy.choose(plan.treatments)  # type: ignore[attr-defined]
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


__all__ = ["CudaKernelRules", "Estimate", "Session", "estimate", "estimate_all", "main", "measure", "open_session"]


if __name__ == "__main__":
    sys.exit(main())
