"""A model's predicted step time per policy on catalogue GPUs: the estimator's own figures, as markdown tables.

    python -m bench.step_time_table               # print them: LLaMA-3-8B, 1 × 4096 tokens, H100-80GB and L4-24GB
    python -m bench.step_time_table --write-docs  # also rewrite the block between the step-time-table markers
    python -m bench.step_time_table --gpus H100-80GB,A100-80GB model=llama3-1b   # other GPUs, Hydra overrides

What `python -m trainer.estimate model=llama3-8b seq_len=4096 batch_size=1 --gpu H100-80GB` (then `--gpu L4-24GB`)
prints, made by the estimator's library in one process: one fake-tensor session for `--device cuda`
(`trainer.estimate.open_session`), every registered policy with its conf/policy defaults on it
(`trainer.estimate.estimate_all`, in two processes), and each estimate's traced work costed by the roofline
(`trainer.measure.time.roofline`) for each GPU. Fake tensors throughout: no GPU and no memory, on a CPU in well under
a minute on two cores. Nothing is timed here, so the figures repeat on any machine with the same torch.

The first table is the docs' (policy, plan, FLOPs × none, each GPU's step ms and tokens/s); the second says where
each GPU's time goes (`predicted_step` of the estimator's `--json`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench._readme import STEP_TIME_PAGE, add_page_arguments, cpu_name, error_status, publish, replace_block
from trainer.core.schema import compose_config
from trainer.estimate import Estimate, estimate_all, open_session
from trainer.estimate.tables import quiet_policy_notices
from trainer.formatting import markdown_table
from trainer.measure.gpus import EFFICIENCY_KEYS, Gpu, find_gpu, load_catalogue
from trainer.measure.time.roofline import GPU_LAUNCH_S, GPU_SAC_S, StepTime, gpu_speed

START, END = "<!-- step-time-table:start -->", "<!-- step-time-table:end -->"
CONSTANTS_START, CONSTANTS_END = "<!-- gpu-constants:start -->", "<!-- gpu-constants:end -->"
CONSTANTS_HEADING = "## Every constant and its source"
HEADING = "## Predicted step time per policy"
COMMAND = "python -m bench.step_time_table"
OVERRIDES = ("model=llama3-8b", "seq_len=4096", "batch_size=1")  # what docs/step-time.md names
GPUS = ("H100-80GB", "L4-24GB")
PLAN_WIDTH = 32  # a plan cell's characters, as the estimator shortens it


def _short(text: str, width: int = PLAN_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.0f} GiB"


def run(overrides: Sequence[str], gpus: Sequence[str], workers: int = 2) -> dict[str, Any]:
    """Every policy's estimate for `--device cuda`, and each one's predicted step on each GPU."""
    t0 = time.perf_counter()
    config = compose_config(list(overrides))
    found: list[Gpu] = [find_gpu(name) for name in gpus]
    speeds = {g.name: gpu_speed(g) for g in found}
    session = open_session(config, "cuda")
    describe = session.module.adapter.describe()
    try:
        with quiet_policy_notices():
            table = estimate_all(config, "cuda", session=session, workers=workers)
    finally:
        session.close()
    estimates = {n: e for n, e in table.items() if isinstance(e, Estimate)}
    if "none" not in estimates:
        raise ValueError(f"policy none did not run: {table.get('none')}")
    times = {(n, g): e.step_time(s) for n, e in estimates.items() for g, s in speeds.items()}
    return {
        "where": where(),
        "config": config,
        "overrides": list(overrides),
        "describe": describe,
        "gpus": found,
        "estimates": estimates,
        "left_out": {n: e for n, e in table.items() if isinstance(e, str)},
        "times": times,
        "seconds": time.perf_counter() - t0,
    }


def where() -> str:
    """Where the table was made: the date, torch and this CPU (the figures do not depend on it: fake tensors)."""
    threads = torch.get_num_threads()
    return (
        f"{dt.date.today().isoformat()}, torch {torch.__version__}, on CPU {cpu_name()}, "
        f"{threads} thread{'s' if threads != 1 else ''}"
    )


def header(out: dict[str, Any], command: str) -> str:
    c, d, none = out["config"], out["describe"], out["estimates"]["none"]
    s = none.components
    state = s["parameters"] + s["buffers"] + s["gradients"] + s["optimizer_state"]
    held = [g.name for g in out["gpus"] if none.peak_bytes <= g.memory_bytes]
    names = _and([g.name for g in out["gpus"]])
    first, *rest = [f"--gpu {g.name}" for g in out["gpus"]]
    then = "".join(f", then `{flag}`" for flag in rest)
    if held:
        holds = f"Under `none` the step's peak is {_gib(none.peak_bytes)}: {', '.join(held)} hold it."
    else:
        holds = (
            f"{'Neither GPU' if len(out['gpus']) == 2 else 'No GPU here'} holds this step ({_gib(none.peak_bytes)} "
            f"under `none`: the training state alone is {_gib(state)}): these are the times of one rank's compute, "
            "what `--fit`'s fastest-first list ranks."
        )
    left = "".join(f" Not in the table: `{n}` ({why.rstrip('.')})." for n, why in out["left_out"].items())
    return (
        f"Generated by `{command} --write-docs` ({out['where']}, {out['seconds']:.0f} s), with the "
        f"estimator's library: the figures of `python -m trainer.estimate {' '.join(out['overrides'])} {first}`{then}. "
        f"`{c.model.name}` ({d['family']}: L={d['n_layer']}, d={d['n_embd']}, {d['n_head']} heads ({d['n_kv_head']} "
        f"key/value), vocab {d['vocab_size']}, {d['params']:,} parameters) at {c.batch_size} × {c.seq_len} tokens, "
        f"accum {c.accum}, {none.precision}, AdamW, the {none.loss} head; every policy with its conf/policy "
        f"defaults, predicted on {names} by the roofline (`trainer.measure.time.roofline`). {holds}{left}"
    )


def tables(out: dict[str, Any]) -> str:
    estimates: dict[str, Estimate] = out["estimates"]
    times: dict[tuple[str, str], StepTime] = out["times"]
    gpus = [g.name for g in out["gpus"]]
    base = estimates["none"].flops
    head = ["policy", "plan", "FLOPs × none"]
    for g in gpus:
        head += [f"{g} step ms", "tokens/s"]
    rows = []
    for name, e in estimates.items():
        cells: list[object] = [f"`{name}`", _short(e.plan), f"{e.flops / base:.3f}"]
        for g in gpus:
            t = times[(name, g)]
            cells += [f"{t.ms:,.0f}", f"{t.tokens_per_s(e.tokens):,.0f}"]
        rows.append(cells)
    first = markdown_table(head, rows, "llr" + "rr" * len(gpus))
    head = ["policy"]
    for g in gpus:
        head += [f"{g}: matmul ms", "memory-bound ms", "host ms", "copies ms (exposed)"]
    rows = []
    for name in estimates:
        cells = [f"`{name}`"]
        for g in gpus:
            t = times[(name, g)]
            cells += [f"{t.matmul_ms:,.0f}", f"{t.memory_ms:,.0f}", f"{t.host_ms:,.0f}"]
            cells.append(f"{t.copy_ms:,.0f} ({t.exposed_copy_ms:,.0f})" if t.copy_ms else "—")
        rows.append(cells)
    second = markdown_table(head, rows, "l" + "rrrr" * len(gpus))
    return f"{first}\n\nWhere the time goes (each GPU's `predicted_step` in `--json`):\n\n{second}"


def constants() -> str:
    """Every figure the GPU time model takes beyond the catalogue's datasheet figures: each GPU's published
    efficiency ranges (conf/gpu/*.yaml) and the host costs (trainer/measure/time/roofline.py), with their sources."""
    gpus = load_catalogue()
    rows: list[list[object]] = []
    for gpu in gpus.values():
        for key in EFFICIENCY_KEYS:
            e = gpu.efficiency_of(key)
            if e.source.startswith("as "):
                source = e.source.split(":", 1)[0]  # inherited: named, its source given in that GPU's row
            elif e.source.startswith("no published figure"):
                source = "none published: the widest range of the GPUs above and below that have one"
            else:
                source = " ".join(e.source.split())
            rows.append([gpu.name, key, f"{e.low:.2f}-{e.high:.2f}", source])
    for key, e in (("host per op launched", GPU_LAUNCH_S), ("host per SAC decision", GPU_SAC_S)):
        rows.append(["every GPU", key, f"{e.low * 1e6:g}-{e.high * 1e6:g} µs", " ".join(e.source.split())])
    return (
        f"Generated by `{COMMAND} --write-docs` from conf/gpu/*.yaml and trainer/measure/time/roofline.py. A step "
        "time is predicted at the middle of every range, and its interval at both ends (the slow end: every "
        "efficiency low, the host costs high):\n\n" + markdown_table(("GPU", "figure", "range", "source"), rows, "llrl")
    )


def render(out: dict[str, Any], command: str = COMMAND) -> str:
    return header(out, command) + "\n\n" + tables(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "overrides",
        nargs="*",
        help=f"Hydra overrides, as for train.py (default: {' '.join(OVERRIDES)}); given ones replace the default",
    )
    ap.add_argument(
        "--gpus", default=",".join(GPUS), help=f"catalogue GPUs, comma-separated (default {','.join(GPUS)})"
    )
    ap.add_argument(
        "--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes the estimates run in (default 2)"
    )
    add_page_arguments(ap, STEP_TIME_PAGE, f"the block between {START} and {END}")
    args = ap.parse_intermixed_args(argv)
    if args.workers < 1:
        ap.error("--workers must be ≥ 1")
    overrides = list(args.overrides) or list(OVERRIDES)
    gpus = [g for g in args.gpus.split(",") if g]
    try:
        out = run(overrides, gpus, args.workers)
    except Exception as e:
        return error_status(e)
    extra = [f"--gpus {args.gpus}"] if gpus != list(GPUS) else []
    command = " ".join([COMMAND, *extra, *args.overrides])
    block = render(out, command)
    if args.write_docs:
        replace_block(args.page, CONSTANTS_START, CONSTANTS_END, constants(), CONSTANTS_HEADING)
    return publish(args, block, START, END, HEADING)


if __name__ == "__main__":
    raise SystemExit(main())
