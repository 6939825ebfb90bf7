"""Every policy and every loss head side by side: step time, memory and FLOPs as ratios, measured and estimated.

    python -m bench.policies                                   # CPU: tiny, every policy; loss heads at vocab 32768
    python -m bench.policies --models tiny,llama-tiny --precision 32-true --write-docs  # docs/benchmarks.md's blocks
    python -m bench.policies --model micro --rounds 2 --head-vocab 4096 # a smoke run (seconds)

Positional arguments are Hydra overrides for each model of --models, as for train.py; --batch, --seq, --vocab,
--attention, --dropout and --precision are shortcuts for the overrides they name. How each figure is measured is said
by the header the table prints (bench.policies_report.header); results.csv/.json hold every figure of every row.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import functools
import gc
import json
import logging
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.common import BENCHMARKS_PAGE, ROOT, at_least, command, parser, publish, use_device
from bench.harness import (
    Harness,
    Variant,
    bench_config,
    build_module,
    estimated,
    median_ratio,
    quiet_policy_notices,
    registered_policies,
    spread,
    sync,
)
from bench.policies_report import ACCURACY, POLICY_TABLE, TABLE, accuracy, policy_table, report, targets
from trainer import CONF, estimate
from trainer.core.schema import Config, ModelConfig
from trainer.formatting import MIB
from trainer.loss import LOSSES, LossConfig
from trainer.measure.time.calibration import speed_here
from trainer.planner import PeakModel
from trainer.policies import Policy, policy_params

COMMAND = "python -m bench.policies"
HEAD_VOCAB = 32768  # a BPE vocabulary (LLaMA-2's is 32000)
# the shortcut flags (bench/gpu.sh and the docs' commands use them): each is the Hydra override it names
SHORTCUTS = {
    "batch": ("batch_size", at_least(1)),
    "seq": ("seq_len", at_least(1)),
    "vocab": ("model.vocab_size", at_least(1)),
    "attention": ("model.attention", str),
    "dropout": ("model.dropout", float),
    "precision": ("precision", str),
}


@dataclass
class RowSpec:
    kind: str  # policy | head
    key: str  # the variant it reads
    base: str  # the variant its ratios are against
    policy: str
    loss: str


@dataclass
class Section:
    """One composed configuration: one module, one batch; its variants are timed interleaved."""

    model: str
    overrides: list[str]
    config: Config
    env: dict[str, Any]
    variants: dict[str, Variant] = field(default_factory=dict)
    rows: list[RowSpec] = field(default_factory=list)
    overhead: bool = False
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.config.batch_size * self.config.seq_len * self.config.accum

    def add(self, kind: str, name: str, make: Any, loss: LossConfig, base: LossConfig) -> None:
        key = _key(name, loss)
        self.variants.setdefault(key, Variant(key, make, loss))  # a policy row and a head row may read one variant
        self.rows.append(RowSpec(kind, key, _key("none" if kind == "policy" else name, base), name, loss.name))


def _label(name: str, policy: Policy) -> str:
    params = policy_params(policy)
    shown = {k: v for k, v in params.items() if k in ("k", "pattern", "blocks") and v not in ([], None)}
    text = ", ".join(f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in shown.items())
    return name + (f" ({text.replace(chr(39), '')})" if text else "")


def _key(policy: str, loss: LossConfig) -> str:
    return f"{policy}|{loss.name}" + ("" if loss.name == "standard" else f"|{loss.chunk_tokens}")


def model_overrides(args: argparse.Namespace, model: str) -> list[str]:
    """Hydra overrides for one model: `model=<name>`, the shortcut flags, then the positional overrides."""
    out = [f"model={model}"]
    out += [f"{key}={getattr(args, flag)}" for flag, (key, _) in SHORTCUTS.items() if getattr(args, flag) is not None]
    out += list(args.overrides)
    if not any(o.startswith("seq_len=") for o in out):  # the default seq_len, capped at the model's context (micro: 64)
        # read before composing: the composed config validates the default seq_len against the context and refuses
        block = next((o.split("=", 1)[1] for o in out if o.startswith("model.block_size=")), None)
        path = CONF / "model" / f"{model}.yaml"
        if block is None and path.is_file():
            block = OmegaConf.load(path).get("block_size", ModelConfig.block_size)
        out += [f"seq_len={block}"] if block is not None and int(block) < Config.seq_len else []
    return out


def plan_sections(args: argparse.Namespace) -> list[Section]:
    sections: list[Section] = []
    only = args.policies.split(",") if args.policies else None
    if only is not None and "none" not in only:
        only.insert(0, "none")  # every ratio is against it
    for model in args.models:
        overrides = model_overrides(args, model)
        s = Section(model, overrides, *bench_config(overrides, args.device), overhead=args.overhead_steps > 0)
        runnable, s.skipped = registered_policies(s.config, only, "--policies" if only else "")
        for name, make in runnable.items():
            s.add("policy", name, make, s.config.loss, s.config.loss)
        sections.append(s)
    if not args.head_vocab:
        return sections
    head_model = (args.head_model or args.models)[0]
    base = [o for o in model_overrides(args, head_model) if not o.startswith("model.vocab_size=")]
    overrides = [*base, f"model.vocab_size={args.head_vocab}"]
    config, env = bench_config(overrides, args.device)
    s = next((x for x in sections if x.config == config), None)
    if s is None:
        s = Section(head_model, overrides, config, env)
        sections.append(s)
    tokens = config.batch_size * config.seq_len
    chunk = args.chunk_tokens or max(1, min(config.loss.chunk_tokens or tokens, tokens // 4))
    runnable, _ = registered_policies(config, args.head_policies.split(","), "--head-policies")
    for name, make in runnable.items():
        for head in LOSSES:
            try:
                loss = LossConfig(name=head, chunk_tokens=chunk, ignore_index=config.loss.ignore_index)
            except ValueError as e:  # fused needs torch ≥ 2.13: the row says so
                s.skipped[f"loss={head}"] = str(e)
                continue
            s.add("head", name, make, loss, LossConfig())
    return sections


def time_overhead(config: Config, device: torch.device, steps: int) -> dict[str, list[float]]:
    """Policy `none`: bare steps and `lightning.Trainer.fit` iterations, alternating step by step (the header says
    how). The first pair (AdamW state) is dropped, and the last bare step has no Lightning iteration after it."""
    import lightning as L

    bare, module, accum, mb = Harness(config, device), build_module(config), config.accum, config.batch_size
    x, y = bare.batch
    micro = [(x[i : i + mb], y[i : i + mb]) for i in range(0, x.shape[0], mb)]
    out: dict[str, list[float]] = {"bare": [], "lightning": []}
    stamps: list[float] = []

    class Alternate(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % accum:
                return
            sync(device)
            t0 = time.perf_counter()
            if stamps:  # the Lightning iteration that started at the last stamp ends here
                out["lightning"].append(t0 - stamps[-1])
            bare.step()  # a twin module's bare step, timed on its own
            sync(device)
            stamps.append(time.perf_counter())
            out["bare"].append(stamps[-1] - t0)

    n = steps + 2
    loader = torch.utils.data.DataLoader(micro * n, batch_size=None, shuffle=False)  # a fixed in-memory batch
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    # Lightning's per-fit banners (GPU unused, few workers, ...) say nothing here; its loggers only, restored after
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = L.Trainer(
                accelerator=device.type, devices=1, max_steps=n, precision=config.precision, callbacks=[Alternate()],
                gradient_clip_val=config.trainer.grad_clip or None, accumulate_grad_batches=accum,
                num_sanity_val_steps=0, limit_val_batches=0, **quiet,
            )  # fmt: skip
            trainer.fit(module, train_dataloaders=loader)
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    k = len(out["lightning"])
    return {"bare": out["bare"][1:k], "lightning": out["lightning"][1:k]}


def _measure(s: Section, device: torch.device, args: argparse.Namespace, phases: dict[str, float]) -> dict[str, Any]:
    """Every variant of a section on one module: its figures (one metered step), its plan, its timed rounds; then
    the estimator's figures (a failure is reported in its row, traceback on stderr, so the others still come out)."""
    t0 = time.perf_counter()
    with quiet_policy_notices():
        h = Harness(s.config, device)
        h.warm(max(1, args.warmup))
        m: dict[str, Any] = {"describe": h.describe(), "vocab": h.vocab, "figures": {}, "plans": {}, "est": {}}
        for key, v in s.variants.items():
            m["figures"][key], m["plans"][key] = h.measure(v), h.module.model.activation_plan
        phases["memory_flops"], t0 = time.perf_counter() - t0, time.perf_counter()
        # the measured source of the step-time model, as policy=auto takes it; again after each timed round, so the
        # machine's drift falls on the prediction and the steps alike (the median of them is compared)
        m["profiles"] = [h.profile()]
        again = functools.partial(lambda h: m["profiles"].append(h.profile()), h)
        m["times"] = h.interleaved(s.variants, args.rounds, args.warmup, between=again)
        phases["timed_rounds"] = time.perf_counter() - t0
    del h
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    m["speed"] = speed_here(device, recalibrate=not args.cached_speed)  # beside the measured steps
    t0, session, m["errors"] = time.perf_counter(), estimate.open_session(s.config, device.type), {}
    for key, v in s.variants.items():
        try:
            m["est"][key] = estimated(session, v)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            m["errors"][key] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    phases["estimator"] = time.perf_counter() - t0
    return m


def _row(s: Section, index: int, spec: RowSpec, m: dict[str, Any]) -> dict[str, Any]:
    """One table row: a variant beside its base (none, or the standard head), measured and estimated."""
    f, t, fb, tb = m["figures"][spec.key], m["times"][spec.key], m["figures"][spec.base], m["times"][spec.base]
    e, eb, plan, v = m["est"].get(spec.key), m["est"].get(spec.base), m["plans"][spec.key], s.variants[spec.key]
    ms, policy = statistics.median(t) * 1e3, spec.kind == "policy"
    # the planner's measured-source prediction: a plan of single blocks under profiled treatments (its loss head)
    single = all(seg.stop - seg.start <= 1 for seg in plan.segments)
    profiled = policy and single and set(plan.treatments) <= set(m["profiles"][0].treatments)
    profile_ms = statistics.median(PeakModel(p).step_ms(plan.treatments) for p in m["profiles"]) if profiled else None
    head = v.loss.name if v.loss.name == "standard" else f"{v.loss.name} (chunk_tokens={v.loss.chunk_tokens})"
    row: dict[str, Any] = {
        "kind": spec.kind,
        "section": index,
        "model": s.model,
        "vocab": m["vocab"],
        "name": spec.policy if policy else f"{spec.policy}/{spec.loss}",
        "label": _label(spec.policy, v.policy) if policy else head,
        "policy": spec.policy,
        "loss": spec.loss,
        "plan": plan.describe(),
        "step_ms": ms,
        "step_spread": spread(t),
        "step_ratio": median_ratio(t, tb),
        "tokens_per_s": s.tokens / (ms / 1e3),
        "activation_mib": f.activation_bytes / MIB,
        "activation_ratio": f.activation_bytes / fb.activation_bytes,
        "head_mib": f.head_bytes / MIB,
        "head_share": f.head_bytes / f.activation_bytes,
        "peak_total_mib": f.total_bytes / MIB,
        "flops": f.flops,
        "flops_ratio": f.flops / fb.flops,
        "flops_uncounted": ",".join(f.uncounted_ops),
        "est_activation_mib": None if e is None else e.activation_bytes / MIB,
        "est_head_mib": None if e is None or e.head_bytes is None else e.head_bytes / MIB,
        "est_peak_total_mib": None if e is None else e.peak_bytes / MIB,
        "est_flops_ratio": None if e is None or eb is None else e.flops / eb.flops,
        "est_error": m["errors"].get(spec.key),
        "pred_profile_ms": profile_ms,
        "pred_roofline_ms": None if e is None else e.step_time(m["speed"]).ms,
    }
    if f.cuda_peak_allocated_bytes is not None:
        row["cuda_peak_allocated_mib"] = f.cuda_peak_allocated_bytes / MIB
    return row


def _overhead_row(s: Section, index: int, m: dict[str, Any], overhead: dict[str, list[float]]) -> dict[str, Any]:
    bare_ms, light_ms = (statistics.median(overhead[k]) * 1e3 for k in ("bare", "lightning"))
    return {
        "kind": "overhead",
        "section": index,
        "model": s.model,
        "vocab": m["vocab"],
        "name": "lightning_vs_bare",
        "label": "Lightning Trainer.fit vs bare loop (policy none)",
        "bare_step_ms": bare_ms,
        "bare_spread": spread(overhead["bare"]),
        "lightning_step_ms": light_ms,
        "lightning_spread": spread(overhead["lightning"]),
        "step_ms": light_ms,
        "step_ratio": median_ratio(overhead["lightning"], overhead["bare"]),
        "pairs": len(overhead["bare"]),
        "tokens_per_s": s.tokens / (light_ms / 1e3),
    }


def run_section(s: Section, index: int, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    phases: dict[str, float] = {}
    m = _measure(s, device, args, phases)
    rows = [_row(s, index, spec, m) for spec in s.rows]
    overhead = None
    if s.overhead:
        t0 = time.perf_counter()
        overhead = time_overhead(s.config, device, args.overhead_steps)
        phases["lightning_vs_bare"] = time.perf_counter() - t0
        rows.append(_overhead_row(s, index, m, overhead))
    return {
        "model": s.model,
        "overrides": s.overrides,
        "shape": m["describe"],
        "precision": s.config.precision,
        "grad_clip": s.config.trainer.grad_clip,
        "skipped": s.skipped,
        "rows": rows,
        "samples": {"step_s": m["times"], "overhead_s": overhead},
        "phase_seconds": phases,
        "speed": m["speed"].describe(),
        "profile_notes": list(m["profiles"][0].notes),
        "profiles": len(m["profiles"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = torch.device(args.device)
    sections = plan_sections(args)
    for s in sections:
        labels = ", ".join(dict.fromkeys(v.label for v in s.variants.values()))
        print(f"bench: {' '.join(s.overrides)} on {device}: {labels}", file=sys.stderr)
    results = [run_section(s, i, device, args) for i, s in enumerate(sections)]
    return {
        "meta": {
            **sections[0].env,
            "command": args.command,
            "models": args.models,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "overhead_pairs": args.overhead_steps,
            "head_vocab": args.head_vocab,
            "seconds": time.perf_counter() - t_start,
        },
        "sections": [{k: v for k, v in r.items() if k not in ("rows", "samples")} for r in results],
        "rows": [row for r in results for row in r["rows"]],
        "samples": {f"{r['model']} {' '.join(r['overrides'])}": r["samples"] for r in results},
    }


def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    keys = list(dict.fromkeys(k for r in result["rows"] for k in r))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows({k: ("" if r.get(k) is None else r[k]) for k in keys} for r in result["rows"])
    (out / "table.md").write_text(report(result) + "\n")
    (out / "accuracy.md").write_text(accuracy(result) + "\n")


def command_line(argv: list[str]) -> str:
    """The command to rerun: this one's arguments without --out/--page/--write-docs (the header adds --write-docs)
    or their former names --readme/--write-readme."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--page", "--readme"):
            skip = True
        elif not (a.startswith(("--out=", "--page=", "--readme=")) or a in ("--write-docs", "--write-readme")):
            kept.append(a)
    return " ".join([COMMAND, *kept])


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    blocks = (POLICY_TABLE, TABLE, ACCURACY)
    ap = parser(
        COMMAND, __doc__, " (each model's)", BENCHMARKS_PAGE, blocks, device=True, threads=True, cached_speed=True
    )
    # a model's name is checked where its config is composed: an unknown one is Hydra's one-line error
    ap.add_argument("--model", type=_names, help="one conf/model option (default: tiny)")
    ap.add_argument("--models", type=_names, help="several, comma-separated: tiny,llama-tiny")
    ap.add_argument("--rounds", type=at_least(1), help="timed interleaved rounds (default: 6 on CPU, 10 on CUDA)")
    ap.add_argument("--warmup", type=at_least(0), help="untimed rounds first (default: 0 on CPU, 2 on CUDA)")
    ap.add_argument("--overhead-steps", type=at_least(0), help="Lightning/bare step pairs (default: 8 CPU, 30 CUDA)")
    for flag, (key, kind) in SHORTCUTS.items():
        ap.add_argument(f"--{flag}", type=kind, help=f"{key}=… (default: the config's)")
    ap.add_argument("--policies", help="comma-separated subset (default: every registered policy)")
    ap.add_argument("--head-vocab", type=at_least(0), default=HEAD_VOCAB, help="loss-head rows' vocabulary (0: none)")
    ap.add_argument("--head-model", type=_names, help="the model of the loss-head rows (default: the first model)")
    ap.add_argument("--head-policies", default="none,full", help="policies each loss head runs under (none,full)")
    ap.add_argument("--chunk-tokens", type=at_least(1), help="loss.chunk_tokens of chunked/fused (default: tokens/4)")
    ap.add_argument("--out", type=Path, help="folder for results.csv/.json, table.md, accuracy.md (runs/bench/<stamp>)")
    args = ap.parse_intermixed_args(argv)
    args.models = list(dict.fromkeys([*(args.model or []), *(args.models or [])])) or ["tiny"]
    cuda = args.device == "cuda"
    # on CPU the memory and FLOP steps before the timed rounds have run every variant already
    defaults = {"rounds": 10 if cuda else 6, "warmup": 2 if cuda else 0, "overhead_steps": 30 if cuda else 8}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


@command
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.command = command_line(argv)
    use_device(args.device, args.threads)
    result = run(args)
    result["targets"] = targets(result)
    out = args.out or ROOT / "runs" / "bench" / dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    write_outputs(result, out)
    print(f"wrote {out}/results.csv, results.json, table.md, accuracy.md", file=sys.stderr)
    block, close = report(result), accuracy(result)
    blocks = {POLICY_TABLE: policy_table(result), TABLE: block, ACCURACY: close}
    return publish(block + ("\n\n" + close if close else ""), args, blocks)


if __name__ == "__main__":
    raise SystemExit(main())
