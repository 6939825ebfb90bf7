"""Every policy and every loss head side by side: step time, memory and FLOPs as ratios, measured and estimated.

    python -m bench.policies                                   # CPU: tiny, every policy; loss heads at vocab 32768
    python -m bench.policies --models tiny,llama-tiny --write-docs      # docs/benchmarks.md's three blocks
    python -m bench.policies --model micro --rounds 2 --head-vocab 4096 # a smoke run (seconds)
    python -m bench.policies --device cuda --model gpt2 --batch 8 --seq 1024 --vocab 50257 --precision bf16-mixed

Positional arguments are Hydra overrides, as for train.py (`model.attention=sdpa`, `optim.lr=3e-4`); each model of
`--models` is composed with them (`trainer.core.schema.compose_config`), and `precision=auto` settles as a run settles
it (`trainer.precision.resolve`).

One process. Per configuration one module (`trainer.core.module.DecoderModule`, seeded as train.py seeds it) and one
fixed batch of random tokens (no data set is read, so any vocabulary works). Everything runs the one training step
as Lightning runs it, `trainer.core.step.bare_step` (bench/harness.py): forward in the precision plugin's context,
zero_grad after the first forward, backward, gradient norm, clipping, AdamW and LR step from
`trainer.core.step.optimizers_of`. Policies (`apply_policy`) and loss heads are switched on that one module between
steps, so no variant gets other weights or another batch.

* Policies: every registered one (`trainer.policies.POLICIES`) with its conf/policy/<name>.yaml parameters; one
  that cannot run from its conf alone is left out with its reason (`auto` needs a budget: bench/planner.py plans
  it across budgets). Ratios against `none`.
* Loss heads (`--head-vocab`, default 32768, a BPE vocabulary where the head is most of the activation memory on
  the CPU shape): `standard`, `chunked` and `fused` (loss.chunk_tokens = `--chunk-tokens`), under each of
  `--head-policies`, on the first model with model.vocab_size set; ratios against `standard` under the same
  policy. The head's share is StepMeter's `head_peak`: the most the head (final norm, logits, loss, forward and
  backward) held at once.
* Step time: after warm-up, interleaved rounds; in round r every variant of a configuration runs one step, the
  order rotated by r. Step time is the median over rounds; "× none" ("× standard") is the median over rounds of
  the per-round ratio, which pairs steps that ran close together and so cancels slow drifts of a shared machine.
* Memory: an untimed step per variant under `trainer.core.step.StepMeter`: activation peak (memory/activation_peak_mib),
  the whole step's peak (memory/peak_total_mib), the head's peak; on CUDA also the allocator's peak.
* FLOPs: `trainer.measure.time.flops.count_flops`
  over one more untimed step (forward + backward, recompute included); ops it
  has no formula for are named (a fused kernel's FLOPs it cannot see).
* est.: `trainer.estimate` (open_session + measure) for the same config, policy and head, on fake tensors.
* Framework overhead: policy `none`, the bare step against a real `lightning.Trainer.fit` of the same
  DecoderModule on a fixed in-memory batch (same precision, clipping, optimizer and schedule; no logger,
  checkpoints or progress bar), alternating step by step: a callback's `on_train_batch_start` runs one bare step of
  a twin module, then stamps the start of Lightning's iteration, which ends at the next `on_train_batch_start`.

Targets (reported, never asserted): full ≤ 1.35× none step time; selective (eager attention) ≤ 1.10×; Lightning
≤ 1.02× the bare loop; activation peak of full ≤ 1/4 of none.

`--write-docs` puts the report between docs/benchmarks.md's bench-table markers, the paragraph on how close both
step-time sources came (`policies_report.accuracy`) between its bench-accuracy markers, and the first model's plans,
activation peaks and FLOPs per policy (`policies_report.policy_table`) between its policy-table markers.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from bench._readme import BENCHMARKS_PAGE, CACHED_SPEED_HELP, ROOT, add_page_arguments, replace_block
from bench.harness import (
    BenchError,
    Harness,
    Variant,
    bench_config,
    build_module,
    estimated,
    estimator_session,
    median_ratio,
    quiet_policy_notices,
    registered_policies,
    spread,
    sync,
)
from bench.policies_report import (
    ACCURACY_END,
    ACCURACY_START,
    POLICY_TABLE_END,
    POLICY_TABLE_START,
    accuracy,
    policy_table,
    report,
    targets,
)
from trainer.core.schema import Config, ModelConfig, describe_user_error
from trainer.formatting import MIB
from trainer.loss import LOSSES, LossConfig
from trainer.measure.time.calibration import speed_here
from trainer.planner import PeakModel
from trainer.policies import Policy, policy_params

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
HEADING = "## Benchmark: step time, memory and FLOPs side by side"
ACCURACY_HEADING = "## How close: step time predicted vs measured"
POLICY_TABLE_HEADING = "## Every policy against `none`"
COMMAND = "python -m bench.policies"
CONF = ROOT / "conf"
HEAD_VOCAB = 32768  # a BPE vocabulary (LLaMA-2's is 32000)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# What runs: configurations (sections), each with its variants and the rows that read them.
# ----------------------------------------------------------------------------------------------------


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

    def add(self, key: str, variant: Variant, row: RowSpec) -> None:
        self.variants.setdefault(key, variant)  # one variant may be read by a policy row and a head row
        self.rows.append(row)


def _label(name: str, policy: Policy) -> str:
    params = policy_params(policy)
    shown = {k: v for k, v in params.items() if k in ("k", "pattern", "blocks") and v not in ([], None)}
    text = ", ".join(f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in shown.items())
    return name + (f" ({text.replace(chr(39), '')})" if text else "")


def _key(policy: str, loss: LossConfig) -> str:
    return f"{policy}|{loss.name}" + ("" if loss.name == "standard" else f"|{loss.chunk_tokens}")


def _head_label(loss: LossConfig) -> str:
    return loss.name if loss.name == "standard" else f"{loss.name} (chunk_tokens={loss.chunk_tokens})"


def model_overrides(args: argparse.Namespace, model: str) -> list[str]:
    """Hydra overrides for one model: `model=<name>`, the shortcut flags, then the positional overrides."""
    out = [f"model={model}"]
    for flag, key in (
        ("batch", "batch_size"),
        ("seq", "seq_len"),
        ("vocab", "model.vocab_size"),
        ("attention", "model.attention"),
        ("dropout", "model.dropout"),
        ("precision", "precision"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={value}")
    out += list(args.overrides)
    if not any(o.startswith("seq_len=") for o in out):
        # conf/config.yaml's seq_len, capped at the model's context (micro: 64)
        path = CONF / "model" / f"{model}.yaml"
        block = next((o.split("=", 1)[1] for o in out if o.startswith("model.block_size=")), None)
        if block is None and path.is_file():
            block = OmegaConf.load(path).get("block_size", ModelConfig.block_size)
        seq = Config.seq_len  # the dataclass holds the defaults (conf/ repeats none of them)
        if block is not None and int(block) < seq:
            out.append(f"seq_len={block}")
    return out


def _compose(overrides: list[str], device: str) -> tuple[Config, dict[str, Any]]:
    try:
        return bench_config(overrides, device)
    except Exception as e:
        line = describe_user_error(e)
        if line is None:
            raise
        raise BenchError(f"{' '.join(overrides)}: {line}") from None


def plan_sections(args: argparse.Namespace) -> list[Section]:
    sections: list[Section] = []
    only = args.policies.split(",") if args.policies else None
    if only is not None and "none" not in only:
        only.insert(0, "none")  # every ratio is against it
    for model in args.models:
        overrides = model_overrides(args, model)
        config, env = _compose(overrides, args.device)
        s = Section(model, overrides, config, env, overhead=args.overhead_steps > 0)
        runnable, s.skipped = registered_policies(config, only)
        if only is not None and s.skipped:
            name, why = next(iter(s.skipped.items()))
            raise BenchError(f"--policies {name}: {why}")
        loss = config.loss
        for name, make in runnable.items():
            key = _key(name, loss)
            s.add(key, Variant(key, make, loss), RowSpec("policy", key, _key("none", loss), name, loss.name))
        sections.append(s)
    if args.head_vocab:
        head_model = args.head_model or args.models[0]
        base = [o for o in model_overrides(args, head_model) if not o.startswith("model.vocab_size=")]
        overrides = [*base, f"model.vocab_size={args.head_vocab}"]
        config, env = _compose(overrides, args.device)
        s = next((x for x in sections if x.config == config), None)
        if s is None:
            s = Section(head_model, overrides, config, env)
            sections.append(s)
        tokens = config.batch_size * config.seq_len
        chunk = args.chunk_tokens or max(1, min(config.loss.chunk_tokens or tokens, tokens // 4))
        head_policies = args.head_policies.split(",")
        runnable, skipped = registered_policies(config, head_policies)
        if skipped:
            name, why = next(iter(skipped.items()))
            raise BenchError(f"--head-policies {name}: {why}")
        for name, make in runnable.items():
            for head in LOSSES:
                try:
                    loss = LossConfig(name=head, chunk_tokens=chunk, ignore_index=config.loss.ignore_index)
                except ValueError as e:  # fused needs torch ≥ 2.13: the row says so
                    s.skipped[f"loss={head}"] = str(e)
                    continue
                key, base = _key(name, loss), _key(name, LossConfig())
                s.add(key, Variant(key, make, loss), RowSpec("head", key, base, name, head))
    return sections


# ----------------------------------------------------------------------------------------------------
# Measurements.
# ----------------------------------------------------------------------------------------------------


class _FixedBatches(torch.utils.data.Dataset):
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i % len(self.batches)]


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's per-fit banners (GPU available but unused, few workers, ...) say nothing about the figures."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def time_overhead(config: Config, device: torch.device, steps: int) -> dict[str, list[float]]:
    """Policy `none`: bare steps and `lightning.Trainer.fit` iterations, alternating step by step.

    One fit of the configured DecoderModule over `steps + 2` optimizer steps of a fixed in-memory batch. At the
    first micro-batch of each step a callback's `on_train_batch_start` runs one bare step of a twin module (same
    seed, its own AdamW and schedule), timed on its own, then stamps the start of Lightning's iteration, which runs
    until the next step's `on_train_batch_start`: fetching and moving the batch, `training_step`, backward, clipping,
    the optimizer, the scheduler, every hook and the loop's own bookkeeping. Pairs run back to back under the same
    load. The first pair (AdamW state) is dropped, and the last bare step has no Lightning iteration after it.
    """
    import lightning as L

    bare = Harness(config, device)
    module = build_module(config)
    accum = config.accum
    x, y = bare.batch
    mb = config.batch_size
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
            bare.step()
            sync(device)
            t1 = time.perf_counter()
            out["bare"].append(t1 - t0)
            stamps.append(t1)

    n = steps + 2
    loader = torch.utils.data.DataLoader(_FixedBatches(micro, n * accum), batch_size=None, shuffle=False)
    with _quiet_lightning():
        trainer = L.Trainer(
            accelerator=device.type,
            devices=1,
            max_steps=n,
            precision=config.precision,
            gradient_clip_val=config.trainer.grad_clip or None,
            accumulate_grad_batches=accum,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[Alternate()],
        )
        trainer.fit(module, train_dataloaders=loader)
    k = len(out["lightning"])
    return {"bare": out["bare"][1:k], "lightning": out["lightning"][1:k]}


def _estimates(s: Section, device: torch.device) -> tuple[dict[str, Any], dict[str, str]]:
    """The estimator's figures per variant; a failure is reported in its row (traceback on stderr), so the measured
    figures of the others still come out."""
    session = estimator_session(s.config, device)
    out: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for key, v in s.variants.items():
        try:
            out[key] = estimated(session, v)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            errors[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return out, errors


def _measure(s: Section, device: torch.device, rounds: int, warmup: int, phases: dict[str, float]) -> dict[str, Any]:
    """Every variant of a section on one module: its figures (one metered step), its plan, its timed rounds."""
    t0 = time.perf_counter()
    with quiet_policy_notices():
        h = Harness(s.config, device)
        h.warm(max(1, warmup))
        out: dict[str, Any] = {"describe": h.describe(), "vocab": h.vocab, "figures": {}, "plans": {}}
        out["plan_objects"] = {}
        for key, v in s.variants.items():
            out["figures"][key] = h.measure(v)
            out["plans"][key] = h.module.model.activation_plan.describe()
            out["plan_objects"][key] = h.module.model.activation_plan
        phases["memory_flops"], t0 = time.perf_counter() - t0, time.perf_counter()
        # the measured source of the step-time model, as policy=auto takes it; again after each timed round, so the
        # machine's drift falls on the prediction and the steps alike (the median of them is compared)
        out["profiles"] = [h.profile()]
        again = functools.partial(lambda h: out["profiles"].append(h.profile()), h)
        out["times"] = h.interleaved(s.variants, rounds, warmup, between=again)
        phases["timed_rounds"] = time.perf_counter() - t0
    del h
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _row(
    s: Section, index: int, spec: RowSpec, m: dict[str, Any], est: dict[str, Any], est_errors: dict[str, str]
) -> dict[str, Any]:
    """One table row: a variant beside its base (none, or the standard head), measured and estimated."""
    f, t = m["figures"][spec.key], m["times"][spec.key]
    fb, tb = m["figures"][spec.base], m["times"][spec.base]
    e, eb = est.get(spec.key), est.get(spec.base)
    ms = statistics.median(t) * 1e3
    v = s.variants[spec.key]
    row: dict[str, Any] = {
        "kind": spec.kind,
        "section": index,
        "model": s.model,
        "vocab": m["vocab"],
        "name": spec.policy if spec.kind == "policy" else f"{spec.policy}/{spec.loss}",
        "label": _label(spec.policy, v.policy) if spec.kind == "policy" else _head_label(v.loss),
        "policy": spec.policy,
        "loss": spec.loss,
        "plan": m["plans"][spec.key],
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
        "est_error": est_errors.get(spec.key),
        "pred_profile_ms": _profile_ms(m, spec),
        "pred_roofline_ms": None if e is None else e.step_time(m["speed"]).ms,
    }
    if f.cuda_peak_allocated_bytes is not None:
        row["cuda_peak_allocated_mib"] = f.cuda_peak_allocated_bytes / MIB
    return row


def _profile_ms(m: dict[str, Any], spec: RowSpec) -> float | None:
    """The planner's measured-source prediction of a policy row: a plan of single blocks under profiled treatments,
    with the configured loss head (the profile's)."""
    profiles, plan = m["profiles"], m["plan_objects"][spec.key]
    if spec.kind != "policy" or any(seg.stop - seg.start > 1 for seg in plan.segments):
        return None
    if not set(plan.treatments) <= set(profiles[0].treatments):
        return None
    return statistics.median(PeakModel(p).step_ms(plan.treatments) for p in profiles)


def _overhead_row(s: Section, index: int, vocab: int, overhead: dict[str, list[float]]) -> dict[str, Any]:
    bare_ms = statistics.median(overhead["bare"]) * 1e3
    light_ms = statistics.median(overhead["lightning"]) * 1e3
    return {
        "kind": "overhead",
        "section": index,
        "model": s.model,
        "vocab": vocab,
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


def run_section(
    s: Section, index: int, device: torch.device, rounds: int, warmup: int, overhead_steps: int, recalibrate: bool
) -> dict[str, Any]:
    phases: dict[str, float] = {}
    m = _measure(s, device, rounds, warmup, phases)
    m["speed"] = speed_here(device, recalibrate=recalibrate)  # beside the measured steps, unless --cached-speed
    t0 = time.perf_counter()
    est, est_errors = _estimates(s, device)
    phases["estimator"], t0 = time.perf_counter() - t0, time.perf_counter()
    overhead = None
    if s.overhead:
        overhead = time_overhead(s.config, device, overhead_steps)
        phases["lightning_vs_bare"] = time.perf_counter() - t0
    rows = [_row(s, index, spec, m, est, est_errors) for spec in s.rows]
    if overhead is not None:
        rows.append(_overhead_row(s, index, m["vocab"], overhead))
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
    cuda = device.type == "cuda"
    rounds = args.rounds or (10 if cuda else 6)
    # On CPU the memory and FLOP steps before the timed rounds have run every variant already.
    warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    overhead = args.overhead_steps
    for s in sections:
        labels = ", ".join(dict.fromkeys(v.label for v in s.variants.values()))
        print(f"bench: {' '.join(s.overrides)} on {device}: {labels}", file=sys.stderr)
    recalibrate = not args.cached_speed
    results = [run_section(s, i, device, rounds, warmup, overhead, recalibrate) for i, s in enumerate(sections)]
    return {
        "meta": {
            **sections[0].env,
            "command": args.command,
            "models": args.models,
            "rounds": rounds,
            "warmup_rounds": warmup,
            "overhead_pairs": overhead,
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
    keys: list[str] = []
    for r in result["rows"]:
        keys += [k for k in r if k not in keys]
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in keys})
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


def _models(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    known = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = ", ".join(unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown model {what}; choose from {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=COMMAND, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every model, as for train.py")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the steps run (default cpu)")
    ap.add_argument("--model", type=_models, help="one conf/model option (default: tiny)")
    ap.add_argument("--models", type=_models, help="several, comma-separated: tiny,llama-tiny")
    ap.add_argument("--rounds", type=int, help="timed interleaved rounds (default: 6 on CPU, 10 on CUDA)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default: 0 on CPU, 2 on CUDA)")
    ap.add_argument("--overhead-steps", type=int, help="Lightning/bare step pairs (default: 8 CPU, 30 CUDA; 0: off)")
    ap.add_argument("--batch", type=int, help="micro-batch size (batch_size=…)")
    ap.add_argument("--seq", type=int, help="sequence length (seq_len=…; default: 256, at most the model's context)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (model.vocab_size=…; default: the tokenizer's, 256)")
    ap.add_argument("--attention", choices=("eager", "sdpa"), help="model.attention=… (default: the model's conf)")
    ap.add_argument("--dropout", type=float, help="model.dropout=… (default: the model's conf)")
    ap.add_argument("--precision", help="precision=… (default: the config's, auto: bf16-mixed where native)")
    ap.add_argument("--policies", help="comma-separated subset (default: every registered policy)")
    ap.add_argument("--head-vocab", type=int, default=HEAD_VOCAB, help="vocabulary of the loss-head rows (0: none)")
    ap.add_argument("--head-model", help="the model of the loss-head rows (default: the first of --models)")
    ap.add_argument("--head-policies", default="none,full", help="policies each loss head runs under (none,full)")
    ap.add_argument("--chunk-tokens", type=int, help="loss.chunk_tokens of chunked/fused (default: tokens/4, ≤ conf)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default on CPU: 1)")
    ap.add_argument("--cached-speed", action="store_true", help=CACHED_SPEED_HELP)
    ap.add_argument(
        "--out", type=Path, help="folder for results.csv/.json, table.md, accuracy.md (default runs/bench/<stamp>)"
    )
    add_page_arguments(
        ap,
        BENCHMARKS_PAGE,
        f"the blocks between {START} and {END} and between {ACCURACY_START} and {ACCURACY_END}",
    )
    args = ap.parse_intermixed_args(argv)
    args.models = list(dict.fromkeys([*(args.model or []), *(args.models or [])])) or ["tiny"]
    if args.head_model is not None:
        _models(args.head_model)
    for key in ("rounds", "batch", "seq", "vocab", "threads", "chunk_tokens"):
        v = getattr(args, key)
        if v is not None and v < 1:
            ap.error(f"--{key.replace('_', '-')} must be ≥ 1")
    if args.overhead_steps is None:
        args.overhead_steps = 30 if args.device == "cuda" else 8
    for key in ("warmup", "overhead_steps", "head_vocab"):
        v = getattr(args, key)
        if v is not None and v < 0:
            ap.error(f"--{key.replace('_', '-')} must be ≥ 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.command = command_line(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        print(
            f"error: --device cuda: no CUDA device is visible to torch {torch.__version__} ({build}); use --device cpu",
            file=sys.stderr,
        )
        return 2
    if args.threads or args.device == "cpu":
        # One thread by default on CPU: on 2 cores shared with other work, a second thread's spin-waits made a tiny
        # step 2-5x slower and far noisier. Ratios are what this benchmark reports; pass --threads to change.
        torch.set_num_threads(args.threads or 1)
    try:
        result = run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["targets"] = targets(result)
    out = args.out or ROOT / "runs" / "bench" / dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    write_outputs(result, out)
    block, close = report(result), accuracy(result)
    print(block + ("\n\n" + close if close else ""))
    print(f"\nwrote {out}/results.csv, results.json, table.md, accuracy.md", file=sys.stderr)
    if args.write_docs:
        replace_block(args.page, POLICY_TABLE_START, POLICY_TABLE_END, policy_table(result), POLICY_TABLE_HEADING)
        replace_block(args.page, START, END, block, HEADING)
        if close:
            replace_block(args.page, ACCURACY_START, ACCURACY_END, close, ACCURACY_HEADING)
        print(f"wrote {args.page} (its policy-table, bench-table and bench-accuracy blocks)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
