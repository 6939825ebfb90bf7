"""What a step asks of a device, op by op: each op's kind, FLOPs and bytes (`Work`), recorded by `OpTrace`.

    with OpTrace() as trace:        # any step, on real or fake tensors (the estimator's)
        step()
    speed.predict(trace.work)       # -> StepTime (trainer.measure.time.roofline)

Every op torch dispatches is one of these kinds: `matmul` (it has a FLOP formula in torch's registry, the fused loss
head included: trainer/measure/time/flops.py), `attention` (SDPA's fused kernels, CPU's and CUDA's, forward and
backward: FLOP formulas too, priced at a GPU's attention efficiency), `memory`, `math` and `random` (they move
bytes: the bytes of every tensor they read and write, from the tensors' sizes, so fake tensors serve) and `free`
(views, allocations and metadata, which move nothing; FSDP2's c10d collectives too, which `Work.collectives` prices
on the link), or `collective` (a functional collective, DTensor's: tensor parallelism's all-gathers, reduce-scatters
and all-reduces, by the bytes one rank sends). A replayable op also
carries its signature (trainer.measure.time.op_replay), so a CPU can time it at its own shapes.

Near tools: torch's `FlopCounterMode` sums FLOPs per module and has no bytes or per-op record (FlopTally's reasons
apply too: trainer/measure/time/flops.py); `torch.utils._runtime_estimation` and `torch.distributed._tools.
RuntimeEstimator` estimate CUDA kernels only (a roofline from CUDA's own device properties, or benchmarks on a real
GPU), where this trace serves this CPU and every catalogue GPU alike.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils import flop_counter as _fc

from trainer.measure.time.collectives import Collectives
from trainer.measure.time.flops import FlopTally, local_shards, sac_decisions
from trainer.measure.time.op_replay import RECIPES, recipe

log = logging.getLogger(__name__)


class OpKey(NamedTuple):
    """What one dispatched op asks of a device; a step's ops are counted by it."""

    kind: str  # matmul | memory | math | random | free
    dtype: str  # the matmul's operand dtype (fp32, bf16, ...); "" for the other kinds
    flops: int
    nbytes: int  # bytes read and written
    # The op with its arguments' dtypes, shapes and strides (trainer.measure.time.op_replay): a CPU times it as it runs
    # (trainer.measure.time.calibration.OpClock); "" for an op that is not replayed
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
KINDS = ("matmul", "attention", "memory", "math", "random", "collective", "free")
# Collectives that functional (DTensor's, tensor parallelism's) ops run, by the bytes one rank sends in a ring over
# group_size ranks: an all-gather sends its output's (W−1)/W, a reduce-scatter its input's, an all-reduce twice that.
_SENT_SHARE = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}


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


_OVERWRITES = frozenset(("copy_", "_foreach_copy_", "fill_", "zero_", "_foreach_zero_"))


def moved_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """The bytes an op reads and writes: each input tensor once (`x * x` reads x once), what it returns, and what it
    writes in place without returning (`_foreach_add_` returns nothing); an `out=` tensor, or what a copy or fill
    overwrites, is written, not read. A gather reads only the rows it gathers: an embedding lookup its ids' rows of
    the table, `nll_loss` one log-probability per target."""
    name = func._overloadpacket.__name__
    schema = getattr(func, "_schema", None)
    if getattr(func, "namespace", "") == "fsdp" and name == "all_gather_copy_in":
        # FSDP2's copy-in: its shards copied into this rank's slice of the all-gather buffer, which is made outside
        # and handed in (the other ranks' slices arrive over the link): read the shards, write the slice.
        return 2 * sum(_nbytes(t) for t in _tensors(args[0]))
    # Written, not read: `out=` arguments (FSDP2's copy-out and reduce-scatter input, any `.out` variant) and what a
    # copy or fill overwrites (FSDP2's cast of its shards into the all-gather inputs: `_foreach_copy_`)
    written_only = {
        id(t)
        for arg in (schema.arguments if schema is not None else ())
        if arg.is_out
        for t in _tensors(kwargs.get(arg.name))
    }
    if name in _OVERWRITES and args:
        written_only.update(id(t) for t in _tensors(args[0]))
    reads: dict[int, int] = {}
    for t in _tensors((args, kwargs)):
        if id(t) not in written_only:
            reads.setdefault(id(t), _nbytes(t))
    if name == "embedding" and len(args) >= 2 and isinstance(args[0], torch.Tensor):
        weight, ids = args[0], args[1]
        reads[id(weight)] = ids.numel() * weight.shape[-1] * weight.element_size()
    elif name in ("nll_loss_forward", "nll_loss2d_forward") and isinstance(args[1], torch.Tensor):
        logp, target = args[0], args[1]
        reads[id(logp)] = target.numel() * logp.element_size()
    writes = {id(t): _nbytes(t) for t in _tensors(out)}
    writes.update({i: _nbytes(t) for t in _tensors((args, kwargs)) if (i := id(t)) in written_only})
    if schema is not None:  # in-place writes: counted as written too, returned or not
        for arg, value in zip(schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in _tensors(value):
                    writes.setdefault(id(t), _nbytes(t))
    return sum(reads.values()) + sum(writes.values())


def sent_bytes(func: Any, args: Any, out: Any) -> int:
    """The bytes one rank sends over the link for a functional collective (0 for its wait)."""
    import torch.distributed as dist

    name = func._overloadpacket.__name__
    if name not in _SENT_SHARE:
        return 0
    group = dist.distributed_c10d._resolve_process_group(args[-1])
    world = group.size()
    moved = _nbytes(out) if name == "all_gather_into_tensor" else _nbytes(args[0])
    return _SENT_SHARE[name] * moved * (world - 1) // world


def classify(func: Any, args: Any, kwargs: Any, out: Any, flops: int) -> OpKey:
    """One dispatched op as (kind, dtype, FLOPs, bytes read and written; a collective's: bytes sent)."""
    packet = func._overloadpacket
    namespace = getattr(func, "namespace", "")
    if namespace == "_c10d_functional":  # DTensor's collectives: the link, not memory
        sent = sent_bytes(func, args, out)
        return OpKey("collective", "", 0, sent) if sent else OpKey("free", "", 0, 0)
    if namespace == "c10d":
        # FSDP2's all-gathers and reduce-scatters (c10d's in-place ops) go over the link too, and are priced there
        # once, from the sharding (Work.collectives: Collectives.fsdp2); as memory they would be charged twice.
        return OpKey("free", "", 0, 0)
    if flops:
        inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        dtype = _dtype_key(inputs[0].dtype) if inputs else "fp32"
        kind = "attention" if "attention" in packet.__name__ else "matmul"  # SDPA's fused kernels, forward and backward
        return OpKey(kind, dtype, int(flops), moved_bytes(func, args, kwargs, out))
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
        """Bytes the kernels read and write in device memory (collectives' bytes go over the link instead)."""
        return sum(k.nbytes * n for k, n in self.ops.items() if k.kind != "collective")

    @property
    def tensor_parallel_bytes(self) -> int:
        """Bytes one rank sends in the step's functional collectives (tensor parallelism's)."""
        return sum(k.nbytes * n for k, n in self.ops.items() if k.kind == "collective")

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": {k: self.count(k) for k in KINDS},
            "flops": self.flops,
            "bytes": self.bytes_moved,
            "sac_decisions": self.sac_decisions,
            "host_copy_bytes": self.host_copy_bytes,
            "collective_bytes": self.collectives.sent_bytes + self.tensor_parallel_bytes,
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
        """One op run: its FLOPs (torch's count) and its kind, FLOPs and bytes for the time model (a DTensor op's on
        the rank's shards)."""
        args, kwargs, out = local_shards((args, kwargs, out))
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
    """`fn()` and the Work it did; `counter`: the op counter (a compiled step's: trainer.measure.fake.compiled)."""
    with counter() as t:
        out = fn()
    return out, t.work
