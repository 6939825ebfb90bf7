"""Calibrate a device for the GPU time model: measure, on the device this runs on, what a catalogue entry otherwise
takes from published ranges, at the model's own shapes, and write it into the entry as a `measured:` block, which
the estimator then prefers (and says so).

    python -m bench.calibrate --gpu H100-80GB --write conf/gpu/h100-80gb.yaml      # on the GPU (bench/gpu.sh)
    python -m bench.calibrate --device cpu --write /tmp/cpu.yaml model=micro        # the same code on a CPU
    python -m trainer.estimate model=llama3-8b --gpu H100-80GB                      # now priced by the measurement

Measured (each the median of its repetitions, after a warm-up; as rates, not shares of a peak, so any device,
a CPU included): the layer's GEMMs, the fused attention kernel forward and backward, a streaming copy and one small
op's launch. Not measured: the caching allocator against our replay and the collectives (the report says so).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import BenchError, command, cpu_name, parser, sync
from trainer.core.schema import compose_config
from trainer.formatting import markdown_table
from trainer.measure.gpus import find_gpu, load_catalogue, match_device
from trainer.precision import resolve

COMMAND = "python -m bench.calibrate"
DEFAULT_OVERRIDES = ("model=llama3-8b", "seq_len=4096", "batch_size=1", "precision=bf16-mixed")
START = "measured:"


def _median_s(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_gemms(config: Any) -> list[tuple[str, int, int, int, int]]:
    """(name, how many, M, K, N) of one decoder layer's forward projections at the micro-batch's tokens: LLaMA's q,
    k, v, o, gate, up and down, or GPT's fused qkv, out, fc and proj."""
    m, c = config.model, config.batch_size * config.seq_len
    d = m.n_embd
    if m.family == "llama":
        kv = (m.n_kv_head or m.n_head) * (d // m.n_head)
        hidden = m.mlp_hidden or 256 * math.ceil(int(8 * d / 3) / 256)
        return [("q, o", 2, c, d, d), ("k, v", 2, c, d, kv), ("gate, up", 2, c, d, hidden), ("down", 1, c, hidden, d)]
    return [("qkv", 1, c, d, 3 * d), ("out", 1, c, d, d), ("fc", 1, c, d, 4 * d), ("proj", 1, c, 4 * d, d)]


def measure(config: Any, device: torch.device, reps: int) -> dict[str, Any]:
    """The figures, on `device`, at `config`'s shapes and precision."""
    precision, _ = resolve(config.precision, device.type)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if "16" in precision else torch.float32
    key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    if key == "fp32" and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"  # fp32 GEMMs ran on the TF32 path: the rate a tf32 prediction takes
    out: dict[str, Any] = {"dtype": key, "gemms": []}
    flops = seconds = 0.0
    for name, count, m, k, n in layer_gemms(config):
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        s = _median_s(lambda a=a, b=b: a @ b, device, reps)
        out["gemms"].append((name, m, k, n, 2 * m * k * n / s))
        flops, seconds = flops + count * 2 * m * k * n, seconds + count * s
    out["matmul"] = flops / seconds  # the layer's GEMMs together, each as often as a layer runs it
    mc = config.model
    heads, size, t = mc.n_head, mc.n_embd // mc.n_head, config.seq_len
    q, k, v = (
        torch.randn(config.batch_size, heads, t, size, dtype=dtype, device=device, requires_grad=True) for _ in range(3)
    )

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(torch.ones_like(q))

    # torch's formulas for forward (2 products) and backward (5), at the causal share a kernel computes
    b = config.batch_size
    att_flops = 7 * 2 * b * heads * t * t * size * (t + 1) / (2 * t)
    out["attention"] = att_flops / _median_s(attention, device, reps)
    copy_bytes = (1 << 30) if device.type == "cuda" else (1 << 26)
    src, dst = (torch.empty(copy_bytes, dtype=torch.uint8, device=device) for _ in range(2))
    out["bandwidth"] = 2 * copy_bytes / _median_s(lambda: dst.copy_(src), device, reps)
    x, ops = torch.zeros(1, device=device), 1000

    def launches() -> None:
        for _ in range(ops):
            x.add_(1.0)

    out["launch_s"] = _median_s(launches, device, max(3, reps // 2)) / ops
    return out


def device_name(device: torch.device) -> str:
    cpu = f"CPU {cpu_name()}, {torch.get_num_threads()} threads"
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu


def block(figures: dict[str, Any], device: torch.device, overrides: list[str]) -> str:
    """The `measured:` block for a catalogue yaml."""
    key = figures["dtype"]
    return "\n".join(
        [
            f"{START}                # {COMMAND} {' '.join(overrides)}: preferred over the ranges above",
            f'  device: "{device_name(device)}"',
            f'  date: "{dt.date.today().isoformat()}"',
            f'  torch: "{torch.__version__}"',
            f'  shapes: "{" ".join(overrides)}"',
            f"  matmul_tflops: {{{key}: {figures['matmul'] / 1e12:.6g}}}",
            f"  attention_tflops: {{{key}: {figures['attention'] / 1e12:.6g}}}",
            f"  bandwidth: {figures['bandwidth'] / 1e12:.6g}TB/s",
            f"  launch_s: {figures['launch_s']:.3g}",
        ]
    )


def write(path: Path, text: str, base: Path | None = None) -> None:
    """`text` as the yaml's `measured:` block: one already there (block or flow style) replaced, the rest of the
    file kept (a new file starts as `base`); the result must load as a catalogue entry before it replaces the file
    (whole or not at all)."""
    source = path if path.exists() or base is None else base
    lines = source.read_text().splitlines() if source.exists() else []
    starts = [j for j, ln in enumerate(lines) if ln.startswith(START)]
    if starts:
        i = end = starts[0]
        end += 1
        while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
            end += 1
        lines = lines[:i] + lines[end:]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join([*lines, text]) + "\n")
    try:
        load_catalogue([tmp])
    except BaseException:
        tmp.unlink()
        raise
    tmp.replace(path)


def report(figures: dict[str, Any], device: torch.device, peak: dict[str, float] | None, bandwidth: float) -> str:
    key = figures["dtype"]
    rows = []
    for name, m, k, n, rate in figures["gemms"]:
        share = f"{rate / (peak[key] * 1e12):.0%}" if peak and key in peak else "—"
        rows.append((f"GEMM {name}", f"{m}×{k}×{n}", f"{rate / 1e12:,.3g} TFLOP/s", share))
    for what, rate in (("layer's GEMMs", figures["matmul"]), ("attention fwd+bwd", figures["attention"])):
        share = f"{rate / (peak[key] * 1e12):.0%}" if peak and key in peak else "—"
        rows.append((what, "", f"{rate / 1e12:,.3g} TFLOP/s", share))
    copy_share = f"{figures['bandwidth'] / bandwidth:.0%}" if bandwidth else "—"
    rows.append(("copy", "", f"{figures['bandwidth'] / 1e9:,.1f} GB/s", copy_share))
    rows.append(("one small op", "", f"{figures['launch_s'] * 1e6:.2f} µs", ""))
    table = markdown_table(("figure", "shape", "measured", "of the datasheet"), rows, "llrr")
    return (
        f"Measured on {device_name(device)}, {key}, torch {torch.__version__}:\n\n{table}\n\nNot measured: the caching "
        "allocator against our replay (a CUDA run logs peak_reserved_mib beside predicted_peak_reserved_mib), "
        "collectives (need more than one GPU)."
    )


@command
def main(argv: list[str] | None = None) -> int:
    ap = parser(COMMAND, __doc__, f" for the shapes (default: {' '.join(DEFAULT_OVERRIDES)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where one is visible, else cpu")
    ap.add_argument("--gpu", help="the catalogue entry this GPU is (for the shares of its datasheet in the report)")
    ap.add_argument("--write", metavar="YAML", help="put the figures into this catalogue yaml as its measured: block")
    ap.add_argument(
        "--write-matched",
        metavar="DIR",
        help="on a CUDA device: a copy of the conf/gpu entry its name matches, with the measured: block, into DIR "
        "(then --catalogue DIR: an entry of the same name replaces the shipped one), as bench/gpu.sh does",
    )
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of each figure (default 20)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is visible to this torch; use --device cpu")
    if args.reps < 1:
        raise BenchError(f"--reps {args.reps}: give at least 1")
    gpu = find_gpu(args.gpu) if args.gpu else None
    target, base = Path(args.write) if args.write else None, None
    if args.write_matched:
        if device.type != "cuda":
            raise BenchError("--write-matched matches a CUDA device to its catalogue entry: run it on one")
        props = torch.cuda.get_device_properties(device)
        gpu = gpu or match_device(props.name, props.total_memory)
        if gpu is None:
            raise BenchError(f"{props.name} is not in the GPU catalogue: copy an entry, name it, give --write")
        # the shipped entry stays as published; a copy in the folder carries the measurement
        target, base = Path(args.write_matched) / Path(gpu.source).name, Path(gpu.source)
    if target is not None and base is None:
        if not target.is_file():
            raise BenchError(f"--write {target}: not a catalogue entry; copy one from conf/gpu/ and name it there")
        load_catalogue([target])  # an entry that loads, before the measuring
    overrides = list(args.overrides) or list(DEFAULT_OVERRIDES)
    figures = measure(compose_config(overrides), device, args.reps)
    print(report(figures, device, gpu.tflops if gpu else None, gpu.bandwidth if gpu else 0.0))
    text = block(figures, device, overrides)
    print("\n" + text)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(target, text, base)
        print(f"\nwrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
