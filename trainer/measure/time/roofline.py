"""Step time from a step's `Work` (trainer.measure.time.op_trace): a roofline per op, against a device's speed.

    speed = cpu_speed()             # this CPU, calibrated once (trainer.measure.time.calibration), or
    speed = gpu_speed(gpu)          # a catalogue GPU (conf/gpu/): peak per dtype and bandwidth at stated efficiencies
    speed.predict(work)             # -> StepTime: milliseconds, and where they go

An op's time is the larger of its FLOPs at the device's matmul throughput and its bytes at the device's bandwidth,
and each op launched pays a fixed cost (dispatch, autograd's bookkeeping); a SAC context pays a further cost per op
it decides on (its policy function and cache, in Python). On a CPU these add up, one op after the other; on a GPU the
host runs ahead of the kernels, so the step takes the longer of the two sums. Offload's copies go over the host link,
on a stream of their own, hidden behind the step's compute up to its length (with prefetch; without it they are
exposed in full). FSDP2's all-gathers and reduce-scatters go over the GPU link (`Collectives`): the first all-gather
of forward and backward and the last reduce-scatter exposed, the rest hidden behind compute up to its length, as FSDP2
prefetches. Tensor parallelism's collectives (the op trace's `collective` ops) go over the same link, exposed in full:
each sits between a layer's ops, which wait for it (torch's async TP, which overlaps them, is not modelled). On a CPU
collectives are not costed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from trainer.measure.gpus import EFFICIENCY_KEYS, Efficiency, Gpu
from trainer.measure.time.op_trace import KINDS, Work

RateCurve = tuple[tuple[float, float], ...]  # (size, rate) points, sizes ascending: FLOPs → FLOP/s, bytes → bytes/s


def _rate(curve: RateCurve, size: float) -> float:
    """The rate at `size`, interpolated log-log between the points (flat beyond the ends)."""
    sizes = [s for s, _ in curve]
    if size <= sizes[0]:
        return curve[0][1]
    if size >= sizes[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(sizes, size)
    (s0, r0), (s1, r1) = curve[i - 1], curve[i]
    f = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))


@dataclass(frozen=True)
class StepTime:
    """A predicted time and where it goes (milliseconds). `ms` = compute + host + exposed copies on a CPU; on a GPU
    the longer of the kernels (matmul + memory) and the host's dispatch, plus exposed copies and collectives."""

    ms: float
    matmul_ms: float
    memory_ms: float
    host_ms: float  # fixed per-op costs and SAC decisions
    copy_ms: float  # offload's copies, in full
    exposed_copy_ms: float
    device: str
    collective_ms: float = 0.0  # FSDP2's all-gathers and reduce-scatters, and TP's collectives, in full
    exposed_collective_ms: float = 0.0
    attention_ms: float = 0.0  # the fused attention kernels' share of matmul_ms

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / (self.ms / 1e3) if self.ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Speed:
    """A device's speed as the roofline uses it (rates in per-second units, times in seconds)."""

    name: str
    matmul: dict[str, RateCurve]  # dtype → FLOPs of one op → FLOP/s
    bandwidth: dict[str, RateCurve]  # kind (memory, math, random) → bytes of one op → bytes/s
    op_s: float  # fixed cost of every op launched
    free_s: float  # a view's or allocation's cost (host only)
    sac_s: float  # one SAC decision (host)
    host_link: float = 0.0  # bytes/s host↔device (offload's copies)
    gpu_link: float = 0.0  # bytes/s one rank sends to its peers (collectives); 0: not costed
    overlapped: bool = False  # GPU: the host runs ahead of the kernels
    assumptions: tuple[str, ...] = ()
    # This CPU's own time for a replayable op (signature, its roofline seconds) → seconds or None: the op run on
    # real tensors of its shapes (trainer.measure.time.calibration.OpClock); None: every op by the roofline
    op_clock: Any = None
    # dtype → FLOPs of one op → FLOP/s for fused attention kernels; None: the matmul curve (a CPU's)
    attention: dict[str, RateCurve] | None = None
    ends: tuple[Speed, Speed] | None = None  # the slow and fast ends of a catalogue GPU's published efficiencies

    def _matmul_rate(self, dtype: str, flops: float, kind: str = "matmul") -> float:
        curves = self.attention if kind == "attention" and self.attention else self.matmul
        curve = curves.get(dtype) or curves.get("fp32") or next(iter(curves.values()))
        return _rate(curve, flops)

    def predict_range(self, work: Work) -> tuple[StepTime, StepTime, StepTime]:
        """(middle, slow end, fast end): the prediction at the published efficiencies' middle and at each end
        (the same three where the speed has no ends: a calibrated CPU)."""
        mid = self.predict(work)
        if self.ends is None:
            return mid, mid, mid
        return mid, self.ends[0].predict(work), self.ends[1].predict(work)

    def predict(self, work: Work) -> StepTime:
        mm = mem = att = 0.0
        for (kind, dtype, flops, nbytes, signature), n in work.ops.items():
            if kind in ("free", "collective"):
                continue
            curve = self.bandwidth.get(kind) or self.bandwidth["memory"]
            t = nbytes / _rate(curve, nbytes) if nbytes else 0.0
            if kind in ("matmul", "attention"):
                t = max(flops / self._matmul_rate(dtype, flops, kind), t)
            if signature and self.op_clock is not None and (timed := self.op_clock(signature, t)) is not None:
                t = timed
            if kind in ("matmul", "attention"):
                mm += t * n
                att += t * n if kind == "attention" else 0.0
            else:
                mem += t * n
        if self.op_clock is not None:
            self.op_clock.flush()
        launched = sum(work.count(k) for k in KINDS if k != "free")
        host = launched * self.op_s + work.count("free") * self.free_s + work.sac_decisions * self.sac_s
        copy = work.host_copy_bytes / self.host_link if work.host_copy_bytes and self.host_link else 0.0
        compute = max(mm + mem, host) if self.overlapped else mm + mem + host
        exposed = max(0.0, copy - compute) if work.prefetch else copy
        c = work.collectives
        comm = c.sent_bytes / self.gpu_link if c.sent_bytes and self.gpu_link else 0.0
        first_last = c.exposed_bytes / self.gpu_link if comm else 0.0
        exposed_comm = first_last + max(0.0, comm - first_last - compute)
        # Tensor parallelism's collectives sit between a layer's ops, which wait for them: exposed in full
        tp = work.tensor_parallel_bytes / self.gpu_link if self.gpu_link else 0.0
        comm, exposed_comm = comm + tp, exposed_comm + tp
        return StepTime(
            (compute + exposed + exposed_comm) * 1e3,
            mm * 1e3,
            mem * 1e3,
            host * 1e3,
            copy * 1e3,
            exposed * 1e3,
            self.name,
            comm * 1e3,
            exposed_comm * 1e3,
            att * 1e3,
        )

    def describe(self) -> str:
        return f"{self.name}: " + "; ".join(self.assumptions)


# Host costs on a GPU machine, per op: published ranges (seconds), and where they come from. Unlike the kernels'
# efficiencies they do not depend on the GPU.
GPU_LAUNCH_S = Efficiency(
    4.5e-6,
    10e-6,
    "an eager op's host cost: 4.5 µs for x + 1 on an i9-11900K (J. Ansel, dev-discuss.pytorch.org/t/1836, "
    "'Micro-optimizations for the most micro of benchmarks'); about 7 µs with autograd (pytorch/pytorch issue 41383); "
    "CUDA launches take 5-20 µs on the CPU side (HolisticTraceAnalysis, cuda_kernel_launch_stats)",
)
GPU_SAC_S = Efficiency(
    5e-6,
    20e-6,
    "no published measurement of a SAC policy's per-op cost: an assumption, bounded below by a Python dispatcher round "
    "trip (+2 µs for an OpOverload call, pytorch/pytorch issue 139518; 5-9 µs for a Python custom op, issue 177109)",
)
ENDS = ("slow", "mid", "fast")  # slow: every efficiency at its low end and host costs at their high end
GPU_COPY_OVERLAP = "offload copies on their own stream, hidden behind compute up to its length (prefetch on)"


def _at(e: Efficiency, end: str, lower_is_slow: bool = True) -> float:
    if end == "mid":
        return e.mid
    return e.low if (end == "slow") == lower_is_slow else e.high


def gpu_speed(gpu: Gpu, fp32_matmul: str | None = None, end: str = "mid") -> Speed:
    """A catalogue GPU: peak TFLOP/s per dtype and bandwidth at its published efficiencies (`Gpu.efficiency_of`):
    their middle (`end="mid"`, the point estimate, carrying the two ends for its interval), or the slow or fast end.
    fp32 matmuls run as TF32 when torch's float32 matmul precision allows it (`torch.set_float32_matmul_precision`)."""
    if not gpu.tflops or not gpu.bandwidth:
        raise ValueError(f"{gpu.name}: the catalogue entry needs tflops and bandwidth to predict a step time")
    fp32_matmul = fp32_matmul or ("tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32")
    eff = {k: gpu.efficiency_of(k) for k in EFFICIENCY_KEYS}
    peaks = dict(gpu.tflops)
    if fp32_matmul in peaks:
        peaks["fp32"] = peaks[fp32_matmul]
    m = gpu.measured  # bench/calibrate.py's rates on this device: preferred, at both ends (a measurement, no range)

    def measured(rates: dict[str, float], k: str) -> float | None:
        """The measured rate for dtype `k`: fp32 as calibrate measured it on this run's fp32 path (fp32 or tf32)."""
        return rates.get(fp32_matmul if k == "fp32" else k) if m else None

    matmul = {
        k: ((1.0, measured(m.matmul, k) if m and measured(m.matmul, k) else v * 1e12 * _at(eff["matmul"], end)),)
        for k, v in peaks.items()
    }
    attention = {
        k: (
            (
                1.0,
                measured(m.attention, k) if m and measured(m.attention, k) else v * 1e12 * _at(eff["attention"], end),
            ),
        )
        for k, v in peaks.items()
    }
    bw = m.bandwidth if m and m.bandwidth else gpu.bandwidth * _at(eff["bandwidth"], end)
    launch = m.launch_s if m and m.launch_s else _at(GPU_LAUNCH_S, end, lower_is_slow=False)
    sac = _at(GPU_SAC_S, end, lower_is_slow=False)

    def share(key: str) -> str:
        e = eff[key]
        return f"{_at(e, end):.0%} (published {e.low:.0%}-{e.high:.0%})"

    datasheet = ", ".join(f"{k} {v:g}" for k, v in gpu.tflops.items())

    def rate(key: str, label: str, rates: dict[str, float]) -> str:
        if m is None or not rates:
            return f"{label} at {share(key)} of peak"
        said = ", ".join(f"{k} {v / 1e12:,.4g} TFLOP/s" for k, v in rates.items())
        return f"{label} at {said} {m.describe()}; other dtypes at {share(key)} of peak"

    speed = Speed(
        name=gpu.name,
        matmul=matmul,
        bandwidth={"memory": ((1.0, bw),)},
        op_s=launch,
        free_s=launch / 4,  # a view or an allocation: the dispatcher without a kernel launch, taken as a quarter
        sac_s=sac,
        host_link=gpu.host_link,
        gpu_link=gpu.gpu_link * _at(eff["link"], end),
        overlapped=True,
        assumptions=(
            f"{rate('matmul', 'matmul', m.matmul if m else {})} ({datasheet} TFLOP/s; fp32 matmul as {fp32_matmul})",
            rate("attention", "attention kernels", m.attention if m else {}),
            (
                f"memory-bound ops at {m.bandwidth / 1e12:.3g} TB/s {m.describe()}"
                if m and m.bandwidth
                else f"memory-bound ops at {share('bandwidth')} of {gpu.bandwidth / 1e12:g} TB/s"
            ),
            f"host {launch * 1e6:.1f} µs per op launched{' (' + m.describe() + ')' if m and m.launch_s else ''}, "
            f"{sac * 1e6:.1f} µs per SAC decision, running ahead of the kernels",
            GPU_COPY_OVERLAP + (f" at {gpu.host_link / 1e9:g} GB/s" if gpu.host_link else ""),
            (
                f"FSDP2 collectives at {share('link')} of {gpu.gpu_link / 1e9:g} GB/s per GPU (one node, ring), hidden "
                "behind compute up to its length but the forward's first all-gather and the last reduce-scatter"
                if gpu.gpu_link
                else "collectives not costed (the catalogue entry has no gpu_link)"
            ),
        ),
        attention=attention,
    )
    if end == "mid":
        return replace(speed, ends=(gpu_speed(gpu, fp32_matmul, "slow"), gpu_speed(gpu, fp32_matmul, "fast")))
    return speed


def gpu_constants(gpu: Gpu) -> list[tuple[str, Efficiency]]:
    """Every figure the GPU time model takes beyond the datasheet, with its published range and source."""
    return [*((k, gpu.efficiency_of(k)) for k in EFFICIENCY_KEYS), ("launch_s", GPU_LAUNCH_S), ("sac_s", GPU_SAC_S)]
