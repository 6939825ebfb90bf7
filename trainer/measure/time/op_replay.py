"""An op as it can be run again on real tensors: its signature (the op, each tensor's dtype, shape and strides, the
other arguments as given) and the recipe that rebuilds it. The step-time model times a CPU's ops this way
(trainer.measure.time.calibration.OpClock):
a traced op, fake or real, is replayed once per signature on real tensors of its
shapes, where a roofline's rates would guess how this CPU runs that kernel at that shape.

Floating tensors are rebuilt with values in [-1, 1), integer and boolean ones with zeros (valid indices, targets and
masks), so what an op reads by value stays in range. Only torch's own (`aten`) ops are replayed, and not those
that move data between devices, read a value back to Python or resize storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Not replayed: what reads a value back, changes storage or moves between devices, and what does nothing to time.
_NOT_REPLAYED = frozenset(
    (
        "_local_scalar_dense",
        "set_",
        "resize_",
        "record_stream",
        "_to_copy",
        "copy_",
        "_copy_from",
        "item",
        "is_nonzero",
        "nonzero",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
    )
)


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def make(self) -> torch.Tensor:
        size = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) + 1
        if 0 in self.shape:
            size = 0
        base = torch.empty(size, dtype=self.dtype)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base.uniform_(-1, 1)
        else:
            base.zero_()
        return base.as_strided(self.shape, self.stride, self.offset)

    @property
    def nbytes(self) -> int:
        return max(0, self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) + 1) * (
            self.dtype.itemsize
        )

    def __str__(self) -> str:
        at = f"+{self.offset}" if self.offset else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{list(self.stride)}{at}"


@dataclass(frozen=True)
class Recipe:
    """An op and its arguments, tensors as TensorMeta: `build()` makes real arguments; `nbytes` what they hold."""

    func: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def _metas(self) -> Iterator[TensorMeta]:
        for leaf in torch.utils._pytree.tree_leaves((self.args, dict(self.kwargs))):
            if isinstance(leaf, TensorMeta):
                yield leaf

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._metas())

    def build(self) -> Callable[[], Any]:
        """The op bound to freshly made real arguments (call it to run the op once)."""

        def real(x: Any) -> Any:
            return x.make() if isinstance(x, TensorMeta) else x

        args = torch.utils._pytree.tree_map(real, self.args)
        kwargs = torch.utils._pytree.tree_map(real, dict(self.kwargs))
        return lambda: self.func(*args, **kwargs)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.is_sparse or x.layout != torch.strided:
            raise _Unreplayable
        return TensorMeta(x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
    if isinstance(x, (bool, int, float, str, type(None), torch.dtype, torch.memory_format, torch.layout)):
        return x
    if isinstance(x, torch.device):
        if x.type != "cpu":
            raise _Unreplayable
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    raise _Unreplayable


class _Unreplayable(Exception):
    pass


def recipe(func: Any, args: Any, kwargs: Any) -> tuple[str, Recipe] | None:
    """The signature and recipe of one dispatched op on CPU tensors, or None when it is not replayed."""
    if getattr(func, "namespace", "") != "aten" or func._overloadpacket.__name__ in _NOT_REPLAYED:
        return None
    if getattr(func, "is_view", False):
        return None
    try:
        margs = tuple(_meta(a) for a in args)
        mkwargs = tuple(sorted((k, _meta(v)) for k, v in kwargs.items()))
    except _Unreplayable:
        return None
    text = ", ".join([*(_text(a) for a in margs), *(f"{k}={_text(v)}" for k, v in mkwargs)])
    return f"{func}({text})", Recipe(func, margs, mkwargs)


def _text(x: Any) -> str:
    if isinstance(x, TensorMeta):
        return str(x)
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in x) + "]"
    return repr(x)


# Every recipe traced in this process, by signature: what a CPU's op clock replays.
RECIPES: dict[str, Recipe] = {}


# What an op holds inside itself (a workspace: memory it allocates and frees while it runs), by signature.
_INSIDE: dict[str, int] = {}
INSIDE_MAX_BYTES = 256 * 2**20


def inside_bytes(func: Any, args: Any, kwargs: Any) -> int:
    """The most bytes `func` holds inside itself beyond what it returns, on real CPU tensors of these shapes: its
    allocations while it runs, read from the allocator's reports (torch.profiler's memory events), less what is still
    allocated when it returns (its outputs). Measured once per signature (after a first run, which fills a kernel
    library's own caches), the RNG left as it was; 0 for an op that is not replayed or whose operands hold over
    INSIDE_MAX_BYTES (a large model's estimate is not held up by its real matmuls). An op that fails on its made-up
    operands raises, naming its signature: a workspace left out would make the estimate low without a word."""
    replayed = recipe(func, args, kwargs)
    if replayed is None or replayed[1].nbytes > INSIDE_MAX_BYTES:
        return 0
    signature, how = replayed
    if signature not in _INSIDE:
        try:
            _INSIDE[signature] = _measure_inside(how)
        except Exception as e:
            raise RuntimeError(f"measuring the workspace of {signature} on real tensors failed: {e}") from e
    return _INSIDE[signature]


def _measure_inside(how: Recipe) -> int:
    from torch._C._profiler import _EventType
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
        run = how.build()
        run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = run()
        del out
    sizes: list[tuple[int, int]] = []

    def walk(node: Any) -> None:
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return max(0, peak - live)
