"""The estimator's compiled step (`trainer.compile=true`): the model compiled as a run compiles it, by dynamo and
inductor's own `compile_fx` and `compile_fx_inner` (decompositions, joint-graph passes, the min-cut partitioner,
lowering, the scheduler's fusion and ordering, the wrapper's buffer reuse and frees), so the same tensors are saved
for backward, the same ones recomputed, and the same buffers allocated and freed in the same order. One thing is not
done: the C++ kernels inductor generated are not built. The generated wrapper runs on the fake tensors, its
allocations dispatched (so the live-tensor tracker sees each buffer made and freed) and each fused kernel replaced by
a `FusedKernel`, which computes nothing (fake tensors hold no data) and tells the op counter what the kernel reads
and writes, once per kernel, for the step-time model.

Why the tracker may sit on the stack at all: dynamo runs a frame eagerly under any dispatch mode
(tests/test_compiled.py), except one that declares `ignore_compile_internals`, torch's way for a mode to see compiled
code's ops; the two modes here do, and are used for nothing else.

Two things a run does that a fake step does not are put in: a CPU matmul's own workspace in bf16 or fp16 (oneDNN's,
from the allocator), measured once per shape on this CPU (`CpuGraphTracker`); and the autograd engine's in-place sum
of two gradients for one tensor, which on fake tensors is out of place (`GraphTracker`). What is approximated: memory
a fused C++ kernel takes inside itself (its local buffers), and 0-dim tensors torch makes from Python numbers while
it parses an op's arguments (an optimizer's scalars, a few bytes), which the allocator's count of a run sees. Lowering
is for the fake tensors' device: a CUDA estimate translated from the CPU (`session.CudaKernelRules`) takes inductor's
CPU lowering, whose fusion is close to but not Triton's.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import types
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar
from unittest import mock

import torch

from trainer.measure.memory.tracker import LiveTensorTracker, _on_storage_freed
from trainer.measure.time.op_replay import inside_bytes
from trainer.measure.time.op_trace import OpKey, OpTrace


class GraphTracker(LiveTensorTracker):
    """The live-tensor tracker for the estimator's compiled step: dynamo runs the compiled graphs under it. A
    higher-order op of the generated code (a recomputed random op run with its saved RNG state) passes through its
    dispatch whole: what it returns is counted."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (_engine_sums(func, args) and self._continues(args[0], out)):
            self._count(func, args, kwargs, out)
        return out

    def _continues(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """`new` takes over `old`'s storage, as the engine's in-place sum would have kept it: one record, no new
        bytes. False where `old`'s storage is not one the window counts."""
        window = self._window
        storage = new.untyped_storage()
        with window.lock:
            entry = window.live.get(old.untyped_storage()._cdata)
            if entry is None or entry[1] != storage.nbytes():
                return False
            del window.live[old.untyped_storage()._cdata]  # its free, when it comes, is not the record's
            record, cdata = entry[0], storage._cdata
            ref = weakref.ref(storage, lambda _r, w=window.weak_self, c=cdata, rec=record: _on_storage_freed(w, c, rec))
            window.live[cdata] = (record, entry[1], ref)
        return True


# The autograd engine sums two gradients for one tensor (its input buffer) in place when it holds the only reference
# to the first and that is a plain dense tensor, else out of place; a fake tensor is never plain, so on fakes every
# sum is out of place and its result a second buffer, which a run of real tensors does not make. A run's step counted
# by the allocator (a compiled one) sums in place; the estimate of one takes such a sum's result to continue its
# first operand's storage. Told apart from a node's own arithmetic: the node producing the gradient is a Python one
# (a compiled graph's backward) and the sum comes from the engine, outside that node's body. Approximated: where
# something else still holds the first gradient (a hook), the run sums out of place.
_IN_NODE = threading.local()


def _engine_sums(func: Any, args: Any) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    from torch.autograd.function import BackwardCFunction

    return (
        func is torch.ops.aten.add.Tensor
        and not getattr(_IN_NODE, "depth", 0)
        and isinstance(torch._C._current_autograd_node(), BackwardCFunction)
        and len(args) == 2
        and all(isinstance(a, torch.Tensor) for a in args)
        and args[0].shape == args[1].shape
        and args[0].dtype == args[1].dtype
        and not args[0]._is_view()  # a view shares its storage with its base: summed out of place
        and is_non_overlapping_and_dense_or_false(args[0])
    )


def _apply_counted(self: Any, *args: Any) -> Any:
    _IN_NODE.depth = getattr(_IN_NODE, "depth", 0) + 1
    try:
        return _NODE_APPLY(self, *args)
    finally:
        _IN_NODE.depth -= 1


class CpuGraphTracker(GraphTracker):
    """GraphTracker for an estimate of a CPU run, which a compiled run counts with the allocator: an op's own
    workspace counts too, where a CPU kernel takes one (oneDNN's for a matmul in bf16 or fp16), measured once per
    shape on this CPU (trainer.measure.time.op_replay.inside_bytes) and held for the op's duration."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator) or func._overloadpacket.__name__ not in _WORKSPACE_OPS:
            return out
        if any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args):
            workspace = inside_bytes(func, args, kwargs or {})
            if workspace:
                window = self._window
                with window.lock:
                    record = window.next_record
                    window.next_record += 1
                window.add(workspace, record)
                window.add(-workspace, record)
        return out


# CPU kernels that take a workspace of their own in reduced precision (oneDNN's matmuls)
_WORKSPACE_OPS = frozenset(("mm", "bmm", "addmm", "baddbmm"))


# The higher-order ops inductor's generated code calls around one op (a random op recomputed in backward: its forward
# saves the generator state, its recompute restores it): where that op and its arguments are.
_AROUND_ONE_OP = {"run_and_save_rng_state": 0, "run_with_rng_state": 1, "graphsafe_run_with_rng_state": 0}


class GraphOpTrace(OpTrace):
    """The op counter for the estimator's compiled step: the graphs' extern and fallback ops as dispatched, and each
    fused kernel as one op (`FusedKernel` reports to the innermost counter entered)."""

    entered: ClassVar[list[GraphOpTrace]] = []
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not isinstance(func, torch._ops.HigherOrderOperator):
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        at = _AROUND_ONE_OP.get(func.name())
        if at is None:
            raise NotImplementedError(f"the compiled estimate does not count higher-order op {func.name()}")
        self.count(args[at], args[at + 1 :], kwargs, out[1] if func.name() == "run_and_save_rng_state" else out)
        return out

    def __enter__(self) -> GraphOpTrace:
        GraphOpTrace.entered.append(self)
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        GraphOpTrace.entered.remove(self)
        super().__exit__(*exc)

    def kernel(self, key: OpKey) -> None:
        self.work.ops[key] += 1


# A kernel whose loop evaluates these runs below the streaming rate (op_trace's `math` kind, as its eager ops).
_MATH = re.compile(r"\b(exp|exp2|expm1|log|log1p|tanh|erf|erfc|sigmoid|sin|cos|sqrt|rsqrt|pow|reciprocal)\b")
_ARGUMENT = re.compile(r"(const\s+)?[\w:<>]+\s*\*\s*(\w+)")


class FusedKernel:
    """A C++ kernel inductor generated, not built. Called with the wrapper's buffers, it reports to the op counter in
    force the bytes it moves once: each tensor it reads (`in_ptr`) and writes (`out_ptr`) once, one it updates in place
    (`in_out_ptr`) twice; its intermediates never exist. Its kind is `math` when its loops evaluate a transcendental
    function, else `memory`. (A CPU kernel's reduction loops pass over their input more than once; costing those
    passes came out further from measured compiled steps than the bytes once: docs/step-time.md.)"""

    def __init__(self, source: str) -> None:
        start = source.find("kernel(")
        end = source.find(")", start)
        pointers = [name for _const, name in _ARGUMENT.findall(source[start:end])]
        # per tensor argument, in order: how many times its bytes move (scalars such as sizes are not pointers)
        self.passes = [2 if name.startswith("in_out_ptr") else 1 for name in pointers]
        self.kind = "math" if _MATH.search(source[end:]) else "memory"

    def __call__(self, *args: Any) -> None:
        if not GraphOpTrace.entered:
            return
        sizes = [(a.numel(), a.element_size()) for a in args if isinstance(a, torch.Tensor)]
        nbytes = sum(n * numel * size for n, (numel, size) in zip(self.passes, sizes, strict=False))
        GraphOpTrace.entered[-1].kernel(OpKey(self.kind, "", 0, nbytes))


def _empty_strided(device: str) -> Any:
    def empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty


def _reinterpret_tensor(t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int = 0) -> torch.Tensor:
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


# The wrapper's allocation helpers, dispatched: inductor's own make tensors in C++ without the dispatcher, so on fake
# tensors they would allocate real memory and no mode would see it.
_DISPATCHED = {
    "empty_strided_cpu": _empty_strided("cpu"),
    "empty_strided_cpu_pinned": _empty_strided("cpu"),
    "empty_strided_cuda": _empty_strided("cuda"),
    "reinterpret_tensor": _reinterpret_tensor,
}
_serial = itertools.count()


def _load_on_fakes(graph: Any, wrapper_code: Any) -> types.ModuleType:
    """GraphLowering._compile_to_module_lines in place of inductor's: the wrapper's source executed as a module of
    its own (never through PyCodeCache, whose loaded modules a real compile of the same source would reuse), its
    kernels `FusedKernel`s, its allocation helpers dispatched."""
    from torch._inductor.async_compile import AsyncCompile

    name = f"ckptlab_fake_graph_{next(_serial)}"
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    with (
        mock.patch.object(AsyncCompile, "cpp_pybinding", lambda _self, _argtypes, source: FusedKernel(source)),
        mock.patch.object(AsyncCompile, "cpp", lambda _self, source: FusedKernel(source)),
    ):
        exec(compile(wrapper_code.value, module.__file__, "exec"), module.__dict__)
    module.__dict__.update(_DISPATCHED)
    for key, value in {**graph.constants, **graph.torchbind_constants}.items():
        setattr(module, key, value)
    graph.cache_key, graph.cache_path, graph.cache_linemap = name, None, []
    return module


def _run_and_save_rng_state(op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """run_and_save_rng_state on fake tensors (a recomputed random op's forward saves the generator's state, which
    its recompute restores): the state as the CPU kernel makes it, a byte tensor of the CPU generator's size, but
    fake. torch's own fake rule returns the real generator state, which the recompute's fake kernel then refuses."""
    return torch.empty(torch.get_rng_state().numel(), dtype=torch.uint8), op(*args, **kwargs)


_NODE_APPLY = torch.autograd.function.BackwardCFunction.apply


@contextlib.contextmanager
def fake_compiled_runtime() -> Iterator[None]:
    """What compiling on fake tensors and running the result needs: torch's compile caches neither read nor written
    (a cached graph would skip the code generation replaced here and bring real kernels to fake tensors; a graph
    compiled here must never be a run's), and a fake rule for the saved RNG state of a recomputed random op."""
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch._prims.rng_prims import run_and_save_rng_state
    from torch.autograd.function import BackwardCFunction

    with (
        torch.compiler.config.patch(force_disable_caches=True),
        mock.patch.dict(registered_hop_fake_fns, {run_and_save_rng_state: _run_and_save_rng_state}),
        mock.patch.object(BackwardCFunction, "apply", _apply_counted),
        warnings.catch_warnings(),
    ):
        # dynamo says, per compiled frame, that caches being off turns its profile-guided recompiles off too
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        yield


def run_generated_code(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """compile_fx's inner compiler: inductor's own (`compile_fx_inner`), its generated module loaded on fakes.

    CPU kernels are generated scalar only (`cpp.simdlen=1`): they are never built or run, and a `FusedKernel` reads
    only its signature and the functions its loops call, which the scalar loop (generated in every case, and the
    vectorized kernel's tail) holds too; the buffers and their reuse are the scheduler's and the scalar kernel's,
    whatever the vector width. Inductor's vectorized and tiled variants of each loop nest were most of the code
    generation time of a compiled estimate."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    with (
        fake_compiled_runtime(),
        mock.patch.object(GraphLowering, "_compile_to_module_lines", _load_on_fakes),
        inductor_config.patch({"cpp.simdlen": 1}),
    ):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def compile_model(model: torch.nn.Module, backend: Any) -> None:
    """model.compile as DecoderModule.configure_model compiles it, with `backend` (the policy's, given
    `run_generated_code`). Dynamo's caches are emptied first: a session measures one policy after another on the same
    module, whose code objects would otherwise pile up guards until dynamo's recompile limit silently ran a frame
    eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    model.compile(backend=backend)
