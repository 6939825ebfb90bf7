"""Every policy against `none`: measured activation peak and FLOPs of one training step, as a markdown table.

    python -m bench.policy_table                  # print the table
    python -m bench.policy_table --write-readme   # also rewrite the README block between the policy-table markers

One process, one shape (the `tiny` model: L=6, d=256, 4 heads, T=256, B=4, bf16 autocast, dropout 0.1, eager
attention, byte vocabulary), CPU. Each policy runs with the parameters of its conf/policy/<name>.yaml, so the
table shows what `python train.py policy=<name>` runs. The forward runs under autocast as the trainer runs it:
Lightning's precision plugin turns autocast's weight cache off (`cache_enabled=False`), so a weight's bf16 copy
lives only as long as autograd keeps it (a plain `torch.autocast` would hold every copy to the end of the forward,
and of each recompute). Per policy, from the same initial weights and the same batch and dropout masks:

* activation peak: `LiveTensorTracker` over one forward + backward, excluding the parameters' .grad buffers
  (what the step itself keeps alive: saved activations, recompute, the SAC cache, autocast weight copies): the
  figure train.py logs as memory/activation_peak_mib;
* FLOPs: `trainer.flops.count_flops` of the same forward + backward (recompute included).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from bench._readme import README, ROOT, cpu_name, replace_block
from models.gpt import GPT, GPTConfig
from trainer.flops import count_flops
from trainer.memory import MIB, LiveTensorTracker
from trainer.policies import POLICIES, apply_policy, build_policy

START, END = "<!-- policy-table:start -->", "<!-- policy-table:end -->"
COMMAND = "python -m bench.policy_table --write-readme"

SHAPE = dict(n_layer=6, n_embd=256, n_head=4, block_size=256, vocab_size=256, dropout=0.1, attention="eager")
SEQ, BATCH = 256, 4
ORDER = ["none", "full", "selective", "sqrt", "every_k", "first_k", "op_sac", "offload", "per_block"]


def policy_configs() -> dict[str, Any]:
    """Each registered policy with the parameters of its conf/policy yaml (registry defaults where none)."""
    # `auto` plans for a memory budget: bench/planner.py measures it at a range of budgets.
    names = [n for n in ORDER if n in POLICIES] + sorted(set(POLICIES) - set(ORDER) - {"auto"})
    cfgs = {}
    for name in names:
        path = ROOT / "conf" / "policy" / f"{name}.yaml"
        cfgs[name] = OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else {"name": name}
    return cfgs


def measure(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[int, int]:
    """(activation peak bytes, FLOPs) of one bf16-autocast forward + backward, autocast as the trainer runs it."""

    def step() -> None:
        torch.manual_seed(1)  # same dropout masks for every policy
        # Lightning's bf16-mixed plugin: no autocast weight cache (see lightning/pytorch/plugins/precision/amp.py)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(idx, tgt)[1]
        loss.backward()

    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        step()
    peak = tracker.peak_bytes_excluding([p.grad for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


def run() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = GPT(GPTConfig(**SHAPE))
    base.train()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g)
    rows = []
    for name, cfg in policy_configs().items():
        model = copy.deepcopy(base)
        policy = apply_policy(model, build_policy(cfg))
        peak, flops = measure(model, idx, tgt)
        rows.append(
            dict(
                name=name,
                params=_params(cfg),
                plan=model.activation_plan.describe(),
                peak=peak,
                flops=flops,
                policy=policy,
            )
        )
    return rows


def _params(cfg: dict[str, Any]) -> str:
    shown = {k: v for k, v in cfg.items() if k in ("k", "pattern", "blocks") and v not in ([], None)}
    return ", ".join(f"{k}={v}" for k, v in shown.items()).replace("'", "")


def table(rows: list[dict[str, Any]]) -> str:
    none = next(r for r in rows if r["name"] == "none")
    lines = [
        "| policy | plan (`Plan.describe()`) | activation peak MiB | × none | GFLOP fwd+bwd | × none |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = f"`{r['name']}`" + (f" ({r['params']})" if r["params"] else "")
        lines.append(
            f"| {name} | `{r['plan']}` | {r['peak'] / MIB:.1f} | {r['peak'] / none['peak']:.2f} "
            f"| {r['flops'] / 1e9:.2f} | {r['flops'] / none['flops']:.3f} |"
        )
    return "\n".join(lines)


def header(seconds: float) -> str:
    s = SHAPE
    threads = torch.get_num_threads()
    return (
        f"Generated by `{COMMAND}` on {dt.date.today().isoformat()} (torch {torch.__version__}, "
        f"{cpu_name()}, {threads} thread{'s' if threads != 1 else ''}, {seconds:.0f} s). Shape: GPT with "
        f"L={s['n_layer']}, d={s['n_embd']}, {s['n_head']} heads, vocab {s['vocab_size']}; batch {BATCH}×{SEQ} "
        "tokens; bf16 autocast "
        "with its weight cache off, as the trainer runs it (Lightning's precision plugin: cache_enabled=False); "
        f"dropout {s['dropout']}; {s['attention']} attention; one forward + backward per policy, parameters from "
        "conf/policy/. Activation peak: live-tensor tracker, excluding gradient buffers (train.py's "
        "memory/activation_peak_mib). FLOPs: FlopCounterMode (recompute included; torch's checkpoint early stop "
        "skips each region's trailing ops that nothing saves)."
    )


def write_readme(block: str, path: Path = README) -> None:
    replace_block(path, START, END, block, "## Measured: every policy against `none`")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-readme", action="store_true", help=f"rewrite the block between {START} and {END}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run()
    block = header(time.perf_counter() - t0) + "\n\n" + table(rows)
    print(block)
    if args.write_readme:
        write_readme(block)
        print(f"\nwrote {README.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
