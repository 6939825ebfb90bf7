"""Step time from the ops a step runs: a roofline per op, against a device's speed.

    with OpTrace() as trace:        # any step, on real or fake tensors (the estimator's)
        step()
    speed = cpu_speed()             # this CPU, calibrated once (trainer.measure.speeds), or
    speed = gpu_speed(gpu)          # a catalogue GPU (conf/gpu/): peak per dtype and bandwidth at stated efficiencies
    speed.predict(trace.work)       # -> StepTime: milliseconds, and where they go

Every op torch dispatches is one of three kinds: `matmul` (it has a FLOP formula in torch's registry, the CPU SDPA
kernels and the fused loss head included: trainer/measure/flops.py), `memory` (it moves
bytes: the bytes of every tensor it
reads and writes, from the tensors' sizes, so fake tensors serve) and `free` (views, allocations and metadata, which
move nothing). An op's time is the larger of its FLOPs at the device's matmul throughput and its bytes at the
device's bandwidth, and each op launched pays a fixed cost (dispatch, autograd's bookkeeping); a SAC context pays a
further cost per op it decides on (its policy function and cache, in Python). On a CPU these add up, one op after the
other; on a GPU the host runs ahead of the kernels, so the step takes the longer of the two sums. Offload's copies
go over the host link, on a stream of their own, hidden behind the step's compute up to its length (with prefetch;
without it they are exposed in full). FSDP2's all-gathers and reduce-scatters go over the GPU link (`Collectives`):
the first all-gather of forward and backward and the last reduce-scatter exposed, the rest hidden behind compute up
to its length, as FSDP2 prefetches; on a CPU they are not costed.

Not FlopCounterMode for the trace: it sums FLOPs per module and has no bytes or per-op record (FlopTally's reasons
apply too: trainer/measure/flops.py).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils import flop_counter as _fc

from trainer.measure.collectives import Collectives
from trainer.measure.flops import FlopTally, sac_decisions
from trainer.measure.gpus import Gpu
from trainer.measure.replay import RECIPES, recipe

log = logging.getLogger(__name__)


class OpKey(NamedTuple):
    """What one dispatched op asks of a device; a step's ops are counted by it."""

    kind: str  # matmul | memory | math | random | free
    dtype: str  # the matmul's operand dtype (fp32, bf16, ...); "" for the other kinds
    flops: int
    nbytes: int  # bytes read and written
    # The op with its arguments' dtypes, shapes and strides (trainer.measure.replay): a CPU times it as it runs
    # (trainer.measure.speeds.OpClock); "" for an op that is not replayed
    signature: str = ""


_FREE_OPS = frozenset(
    n
    for n in (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "_to_copy_meta",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "_local_scalar_dense",
        "set_",
        "resize_",
        "_unsafe_view",
        "copy_meta",
    )
)


# Memory-bound ops a CPU runs well below its streaming rate: transcendental and normalising math (per element it
# evaluates a polynomial or reduces) and random draws (dropout's masks).
_MATH_OPS = frozenset(
    n
    for n in (
        "gelu",
        "gelu_backward",
        "silu",
        "silu_backward",
        "_softmax",
        "_softmax_backward_data",
        "_log_softmax",
        "_log_softmax_backward_data",
        "exp",
        "log",
        "tanh",
        "tanh_backward",
        "sigmoid",
        "sigmoid_backward",
        "erf",
        "native_layer_norm",
        "native_layer_norm_backward",
        "_fused_rms_norm",
        "_fused_rms_norm_backward",
        "rsqrt",
        "pow",
        "sqrt",
        "sin",
        "cos",
        "nll_loss_forward",
        "nll_loss_backward",
        "linalg_vector_norm",
    )
)
_RANDOM_OPS = frozenset(
    ("bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "randn", "randn_like", "uniform_", "normal_")
)
KINDS = ("matmul", "memory", "math", "random", "free")


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, "fp32"
    )


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def causal_share(func: Any, args: Any, kwargs: Any) -> float:
    """The share of an attention kernel's counted FLOPs it really runs: torch's formulas ignore `is_causal`, while a
    causal flash or memory-efficient kernel (CUDA's and CPU's alike) skips the key blocks after each query block,
    computing the lower triangle with its diagonal, s(s + 1)/2 of s² scores. 1 for every other op."""
    schema = getattr(func, "_schema", None)
    if schema is None or "attention" not in schema.name:
        return 1.0
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return 1.0
    i = names.index("is_causal")
    causal = kwargs.get("is_causal", args[i] if i < len(args) else False)
    query = kwargs.get("query", args[names.index("query")] if "query" in names else None)
    if not causal or not isinstance(query, torch.Tensor) or query.dim() < 2:
        return 1.0
    s = query.shape[-2]
    return (s + 1) / (2 * s) if s > 0 else 1.0


def moved_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """The bytes an op reads and writes: each input tensor once (`x * x` reads x once), what it returns, and what it
    writes in place without returning (`_foreach_add_` returns nothing). A gather reads only the rows it gathers:
    an embedding lookup its ids' rows of the table, `nll_loss` one log-probability per target."""
    name = func._overloadpacket.__name__
    reads: dict[int, int] = {}
    for t in _tensors((args, kwargs)):
        reads.setdefault(id(t), _nbytes(t))
    if name == "embedding" and len(args) >= 2 and isinstance(args[0], torch.Tensor):
        weight, ids = args[0], args[1]
        reads[id(weight)] = ids.numel() * weight.shape[-1] * weight.element_size()
    elif name in ("nll_loss_forward", "nll_loss2d_forward") and isinstance(args[1], torch.Tensor):
        logp, target = args[0], args[1]
        reads[id(logp)] = target.numel() * logp.element_size()
    writes = {id(t): _nbytes(t) for t in _tensors(out)}
    schema = getattr(func, "_schema", None)
    if schema is not None:  # in-place writes: counted as written too, returned or not
        for arg, value in zip(schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in _tensors(value):
                    writes.setdefault(id(t), _nbytes(t))
    return sum(reads.values()) + sum(writes.values())


def classify(func: Any, args: Any, kwargs: Any, out: Any, flops: int) -> OpKey:
    """One dispatched op as (kind, dtype, FLOPs, bytes read and written)."""
    packet = func._overloadpacket
    if flops:
        inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        dtype = _dtype_key(inputs[0].dtype) if inputs else "fp32"
        return OpKey("matmul", dtype, int(flops), moved_bytes(func, args, kwargs, out))
    if getattr(func, "is_view", False) or packet.__name__ in _FREE_OPS:
        return OpKey("free", "", 0, 0)
    kind = "math" if packet.__name__ in _MATH_OPS else "random" if packet.__name__ in _RANDOM_OPS else "memory"
    return OpKey(kind, "", 0, moved_bytes(func, args, kwargs, out))


@dataclass
class Work:
    """What a step asks of a device: its ops, aggregated by (kind, dtype, FLOPs, bytes), the SAC decisions made,
    offload's host copies (bytes, both ways) and FSDP2's collectives."""

    ops: Counter[OpKey] = field(default_factory=Counter)
    sac_decisions: int = 0
    host_copy_bytes: int = 0
    prefetch: bool = True  # offload's copies overlap the compute
    collectives: Collectives = field(default_factory=Collectives)

    def count(self, kind: str) -> int:
        return sum(n for k, n in self.ops.items() if k.kind == kind)

    @property
    def flops(self) -> int:
        """The FLOPs the kernels run, as the time model costs them: causal attention at its computed share, so below
        the FLOPs figures (torch's count) wherever attention is causal."""
        return sum(k.flops * n for k, n in self.ops.items())

    @property
    def bytes_moved(self) -> int:
        return sum(k.nbytes * n for k, n in self.ops.items())

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": {k: self.count(k) for k in KINDS},
            "flops": self.flops,
            "bytes": self.bytes_moved,
            "sac_decisions": self.sac_decisions,
            "host_copy_bytes": self.host_copy_bytes,
            "collective_bytes": self.collectives.sent_bytes,
        }


class OpTrace(FlopTally):
    """FlopTally that also records every op's kind, FLOPs and bytes (`work`), and the SAC decisions made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.work = Work()
        self._sac0 = 0

    def __enter__(self) -> OpTrace:
        self._sac0 = sac_decisions()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        self.work.sac_decisions += sac_decisions() - self._sac0
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", "") == "prim":  # metadata queries (fake tensors ask prim.device), not ops run
            return out
        self.count(func, args, kwargs, out)
        return out

    def count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """One op run: its FLOPs (torch's count) and its kind, FLOPs and bytes for the time model."""
        formula = _fc.flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        self.total += flops  # the FLOPs figures keep torch's convention (causal attention counted whole)
        key = classify(func, args, kwargs, out, int(flops * causal_share(func, args, kwargs)))
        if key.kind != "free" and (replayed := recipe(func, args, kwargs)) is not None:
            signature, how = replayed
            RECIPES.setdefault(signature, how)
            key = key._replace(signature=signature)
        self.work.ops[key] += 1


def trace(fn: Callable[[], Any], counter: type[OpTrace] = OpTrace) -> tuple[Any, Work]:
    """`fn()` and the Work it did; `counter`: the op counter (a compiled step's: trainer.measure.fake_compile)."""
    with counter() as t:
        out = fn()
    return out, t.work


# ----------------------------------------------------------------------------------------------------
# Speeds.
# ----------------------------------------------------------------------------------------------------

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
    collective_ms: float = 0.0  # FSDP2's all-gathers and reduce-scatters, in full
    exposed_collective_ms: float = 0.0

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
    # real tensors of its shapes (trainer.measure.speeds.OpClock); None: every op by the roofline
    op_clock: Any = None

    def _matmul_rate(self, dtype: str, flops: float) -> float:
        curve = self.matmul.get(dtype) or self.matmul.get("fp32") or next(iter(self.matmul.values()))
        return _rate(curve, flops)

    def predict(self, work: Work) -> StepTime:
        mm = mem = 0.0
        for (kind, dtype, flops, nbytes, signature), n in work.ops.items():
            if kind == "free":
                continue
            curve = self.bandwidth.get(kind) or self.bandwidth["memory"]
            t = nbytes / _rate(curve, nbytes) if nbytes else 0.0
            if kind == "matmul":
                t = max(flops / self._matmul_rate(dtype, flops), t)
            if signature and self.op_clock is not None and (timed := self.op_clock(signature, t)) is not None:
                t = timed
            if kind == "matmul":
                mm += t * n
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
        )

    def describe(self) -> str:
        return f"{self.name}: " + "; ".join(self.assumptions)


# GPU efficiencies: what a dense kernel reaches of the datasheet peak. Large GEMMs reach 60-75 % of peak and
# streaming kernels 80-90 % of bandwidth; the step's smaller ops reach less, which the per-op launch floor covers.
GPU_MATMUL_EFFICIENCY = 0.6
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_LAUNCH_S = 5e-6  # host-side cost of one eager op (Python, dispatcher, launch)
GPU_SAC_S = 20e-6  # one SAC decision: torch's Python dispatch mode, per op
# What NCCL's ring collectives reach of the link's per-direction datasheet rate (its "bus bandwidth")
GPU_LINK_EFFICIENCY = 0.8
GPU_COPY_OVERLAP = "offload copies on their own stream, hidden behind compute up to its length (prefetch on)"


def gpu_speed(gpu: Gpu, fp32_matmul: str | None = None) -> Speed:
    """A catalogue GPU: peak TFLOP/s per dtype and bandwidth at the stated efficiencies; fp32 matmuls run as TF32
    when torch's float32 matmul precision allows it (`torch.set_float32_matmul_precision`)."""
    if not gpu.tflops or not gpu.bandwidth:
        raise ValueError(f"{gpu.name}: the catalogue entry needs tflops and bandwidth to predict a step time")
    fp32_matmul = fp32_matmul or ("tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32")
    rates = {k: v * 1e12 * GPU_MATMUL_EFFICIENCY for k, v in gpu.tflops.items()}
    if fp32_matmul in rates:
        rates["fp32"] = rates[fp32_matmul]
    matmul = {k: ((1.0, r),) for k, r in rates.items()}
    bw = gpu.bandwidth * GPU_BANDWIDTH_EFFICIENCY
    return Speed(
        name=gpu.name,
        matmul=matmul,
        bandwidth={"memory": ((1.0, bw),)},
        op_s=GPU_LAUNCH_S,
        free_s=GPU_LAUNCH_S / 4,
        sac_s=GPU_SAC_S,
        host_link=gpu.host_link,
        gpu_link=gpu.gpu_link * GPU_LINK_EFFICIENCY,
        overlapped=True,
        assumptions=(
            f"matmul at {GPU_MATMUL_EFFICIENCY:.0%} of peak ({', '.join(f'{k} {v:g}' for k, v in gpu.tflops.items())}"
            f" TFLOP/s; fp32 matmul as {fp32_matmul})",
            f"memory-bound ops at {GPU_BANDWIDTH_EFFICIENCY:.0%} of {gpu.bandwidth / 1e12:g} TB/s",
            f"host {GPU_LAUNCH_S * 1e6:g} µs per op launched, {GPU_SAC_S * 1e6:g} µs per SAC decision, running ahead"
            " of the kernels",
            GPU_COPY_OVERLAP + (f" at {gpu.host_link / 1e9:g} GB/s" if gpu.host_link else ""),
            (
                f"FSDP2 collectives at {GPU_LINK_EFFICIENCY:.0%} of {gpu.gpu_link / 1e9:g} GB/s per GPU (one node, "
                "ring), hidden behind compute up to its length but the first all-gather of forward and backward and "
                "the last reduce-scatter"
                if gpu.gpu_link
                else "collectives not costed (the catalogue entry has no gpu_link)"
            ),
        ),
    )
