"""`policy=auto` across memory budgets, beside the fastest uniform policy that fits: measured peak and step time.

    python -m bench.planner                  # print the tables
    python -m bench.planner --write-readme   # also rewrite the README block between the planner-table markers

One process, the default CPU shape (conf/config.yaml: model=tiny, batch 4 × 256 tokens, bf16-mixed, AdamW, grad
clip 1.0), CPU:

1. Profile once, as the planning callback does at fit start (`trainer.planner.profile`), and predict every uniform
   policy's peak.
2. Budgets: evenly spaced from the `none` prediction down to below `full`'s (at least 6). For each, the plan
   `policy=auto` would install (the same solver on that profile). Below `full` nothing fits at micro-batch 4: the
   row shows the refusal's smallest budget and the plan `policy.allow_accum=true` trains instead (micro-batch
   halved, accumulation doubled, same tokens per step; profiled again by `plan_model`).
3. Every distinct plan (auto's and the uniform ones) is measured in the same process with a training step as
   Lightning runs it (autocast without weight cache, forward, zero_grad, backward, gradient norm, clipping, AdamW):
   peak = LiveTensorTracker over the step with the training state adopted, the figure the measuring callback
   reports as `peak_total_mib`; time = median over repetitions interleaved across plans (round-robin), so load
   on a shared machine spreads over all plans alike.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench._readme import README, ROOT, cpu_name, replace_block
from models.gpt import GPT, GPTConfig
from trainer import planner
from trainer.memory import MIB, LiveTensorTracker
from trainer.module import param_groups
from trainer.planner import PeakModel, describe_treatments, solve_profile
from trainer.policies import PolicyError, apply_policy, build_policy

START, END = "<!-- planner-table:start -->", "<!-- planner-table:end -->"
COMMAND = "python -m bench.planner --write-readme"
UNIFORM = ("none", "selective", "op_sac", "full")


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.schema import register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return validate(hydra_compose("config", overrides=overrides))


def build(config: Any) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    values = {f: getattr(config.model, f) for f in GPTConfig.__dataclass_fields__}
    values["vocab_size"] = values["vocab_size"] or 256  # the default byte tokenizer
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(**values))
    g = torch.Generator().manual_seed(config.seed)
    shape = (config.batch_size, config.seq_len)
    batch = (
        torch.randint(0, values["vocab_size"], shape, generator=g),
        torch.randint(0, values["vocab_size"], shape, generator=g),
    )
    return model, batch


class Runner:
    """One plan on its own copy of the model and optimizer: a training step as Lightning runs it."""

    def __init__(
        self, base: GPT, treatments: tuple[str, ...], batch: tuple[torch.Tensor, torch.Tensor], micro: int, config: Any
    ) -> None:
        self.model = copy.deepcopy(base)
        apply_policy(self.model, {"name": "per_block", "blocks": list(treatments)})
        self.model.train()
        self.opt = torch.optim.AdamW(param_groups(self.model, config.optim.weight_decay), lr=config.optim.lr)
        idx, tgt = batch
        self.micro = [(idx[i : i + micro], tgt[i : i + micro]) for i in range(0, idx.shape[0], micro)]
        self.clip = config.trainer.grad_clip
        self.times: list[float] = []
        self.peak: int | None = None

    def step(self) -> None:
        accum = len(self.micro)
        for k, (idx, tgt) in enumerate(self.micro):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = self.model(idx, tgt)[1]
            if k == 0:
                self.opt.zero_grad(set_to_none=True)
            (loss / accum).backward()
        params = list(self.model.parameters())
        torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.opt.step()

    def timed(self) -> None:
        t0 = time.perf_counter()
        self.step()
        self.times.append((time.perf_counter() - t0) * 1e3)

    def tracked(self) -> None:
        with LiveTensorTracker() as tracker:
            tracker.adopt(self._state())  # a temporary list: last step's gradients still die at zero_grad
            self.step()
        self.peak = tracker.peak_bytes

    def _state(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        state = [*params, *self.model.buffers(), *(p.grad for p in params if p.grad is not None)]
        return state + [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    @property
    def ms(self) -> float:
        return statistics.median(self.times)


def run(n_budgets: int, reps: int) -> dict[str, Any]:
    config = compose(["policy=auto", "policy.budget_mib=1"])
    base, batch = build(config)
    cfg = build_policy(config.policy).cfg
    B = config.batch_size
    prof = planner.profile(
        copy.deepcopy(base),
        batch,
        precision=config.precision,
        make_optimizer=planner.default_optimizer(config.optim.weight_decay),
        param_groups=None,
        accum=config.accum,
        treatments=UNIFORM,
        policy_cfg=cfg,
        repeats=cfg.profile_repeats,
        grad_clip=config.trainer.grad_clip,
    )
    model = PeakModel(prof)
    L = prof.n_layer
    predicted = {t: model.evaluate([t] * L) for t in UNIFORM}
    top = predicted["none"].peak
    bottom = int(predicted["full"].peak * 0.93)
    budgets = [round((top - (top - bottom) * k / (n_budgets - 1)) / MIB, 1) for k in range(n_budgets)]
    budgets[0] = planner.smallest_budget_mib(top)
    runners: dict[tuple[tuple[str, ...], int], Runner] = {}

    def runner(treatments: tuple[str, ...], micro: int) -> Runner:
        key = (treatments, micro)
        if key not in runners:
            runners[key] = Runner(base, treatments, batch, micro, config)
        return runners[key]

    for t in UNIFORM:
        runner((t,) * L, B)
    rows = []
    for budget in budgets:
        row: dict[str, Any] = {"budget": budget}
        result = solve_profile(prof, int(budget * MIB), f"policy.budget_mib={budget:g}", (B, config.accum))
        if result is None:
            row["refused"] = planner.smallest_budget_mib(model.min_peak().peak)
            cfg_accum = build_policy({**_plain(config.policy), "budget_mib": budget, "allow_accum": True}).cfg
            try:
                result = planner.plan_model(
                    copy.deepcopy(base),
                    batch,
                    cfg_accum,
                    precision=config.precision,
                    accum=config.accum,
                    make_optimizer=planner.default_optimizer(config.optim.weight_decay),
                    grad_clip=config.trainer.grad_clip,
                )
            except PolicyError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
        row["result"] = result
        row["runner"] = runner(result.treatments, result.micro_batch)
        rows.append(row)
    # measure: one warm-up step each (creates gradients and optimizer state), one tracked step, then timed steps
    # round-robin over the plans
    for r in runners.values():
        r.step()
        r.tracked()
    for _ in range(reps):
        for r in runners.values():
            r.timed()
    uniform = {t: runners[((t,) * L, B)] for t in UNIFORM}
    for row in rows:
        fits = [t for t in UNIFORM if uniform[t].peak is not None and uniform[t].peak <= row["budget"] * MIB]
        row["uniform"] = min(fits, key=lambda t: uniform[t].ms) if fits else None
    return {"config": config, "prof": prof, "predicted": predicted, "uniform": uniform, "rows": rows}


def _plain(node: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(node)) if not isinstance(node, dict) else dict(node)  # type: ignore[arg-type]


def tables(out: dict[str, Any]) -> str:
    uniform, rows = out["uniform"], out["rows"]
    lines = [
        "| budget MiB | `auto` plan | predicted MiB | measured MiB | step ms | fastest uniform that fits | "
        "its measured MiB | its step ms | auto ÷ uniform |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        b = row["budget"]
        u = row["uniform"]
        ucells = f"`{u}` | {uniform[u].peak / MIB:.1f} | {uniform[u].ms:,.0f}" if u is not None else "none fits | — | —"
        if "error" in row:
            lines.append(f"| {b:.1f} | refused: {row['error']} | | | | {ucells} | — |")
            continue
        res, r = row["result"], row["runner"]
        plan = f"`{describe_treatments(res.treatments)}`"
        if "refused" in row:
            plan = (
                f"refused at micro-batch {res.configured_micro_batch} (needs ≥ {row['refused']:g} MiB); with "
                f"`allow_accum=true`: micro-batch {res.micro_batch}, accum {res.accum}, {plan}"
            )
        ratio = f"{r.ms / uniform[u].ms:.2f}" if u is not None else "—"
        mark = "" if r.peak <= b * MIB else " ⚠"
        lines.append(
            f"| {b:.1f} | {plan} | {res.solution.peak / MIB:.1f} | {r.peak / MIB:.1f}{mark} | {r.ms:,.0f} | "
            f"{ucells} | {ratio} |"
        )
    lines += [
        "",
        "Uniform policies, predicted from the one profile vs measured:",
        "",
        "| policy | predicted MiB | measured MiB | predicted step ms | measured step ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, s in out["predicted"].items():
        r = uniform[t]
        lines.append(f"| `{t}` | {s.peak / MIB:.1f} | {r.peak / MIB:.1f} | {s.step_ms:,.0f} | {r.ms:,.0f} |")
    return "\n".join(lines)


def header(out: dict[str, Any], seconds: float, reps: int) -> str:
    c = out["config"]
    m = c.model
    return (
        f"Generated by `{COMMAND}` on {dt.date.today().isoformat()} (torch {torch.__version__}, {cpu_name()}, "
        f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}, {seconds:.0f} s). Shape: the "
        f"conf defaults, GPT L={m.n_layer}, d={m.n_embd}, {m.n_head} heads, {m.attention} attention, dropout "
        f"{m.dropout}, vocab 256; micro-batch {c.batch_size}×{c.seq_len}; {c.precision}; AdamW; clip "
        f"{c.trainer.grad_clip:g}. One profile (as at fit start) gives every prediction; each plan is then measured "
        "in the same process by a training step as Lightning runs it: peak = live-tensor tracker with the training "
        "state adopted (what runs report as `peak_total_mib`), step time = median of "
        f"{reps} steps interleaved across plans. Budgets run from the `none` prediction to below `full`'s."
    )


def write_readme(block: str, path: Path = README) -> None:
    replace_block(path, START, END, block, "## Measured: `policy=auto` across memory budgets")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-readme", action="store_true", help=f"rewrite the block between {START} and {END}")
    ap.add_argument("--budgets", type=int, default=7, help="how many budgets (≥ 6)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per plan (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    args = ap.parse_args(argv)
    if args.budgets < 6:
        ap.error("--budgets must be at least 6")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = run(args.budgets, args.reps)
    block = header(out, time.perf_counter() - t0, args.reps) + "\n\n" + tables(out)
    print(block)
    if args.write_readme:
        write_readme(block)
        print(f"\nwrote {README.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
