"""FLOP counting that also sees the CPU fused attention kernel.

Stock ``FlopCounterMode`` has formulas for the CUDA SDPA kernels only. On CPU, ``scaled_dot_product_attention``
with dropout 0 dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``),
which have no formula and no decomposition, so the counter silently counts attention as 0 FLOPs and any
recompute-cost figure for attention policies comes out wrong. The CPU ops take (query, key, value, ...) and
(grad_out, query, key, value, ...) in the same positions as the CUDA flash ops, so the library's own SDPA
formulas apply unchanged.

The registration is global (it goes into torch's registry), so every ``FlopCounterMode`` in the process,
including Lightning's ``measure_flops``, counts the CPU kernel once this module is imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

_aten = torch.ops.aten


def _register_cpu_sdpa_formulas() -> None:
    # (op name, library formula): the library's formulas are already shape-wrapped by their own
    # registration, hence get_raw=True below (wrapping them again would pass out_shape twice).
    pairs = [
        ("_scaled_dot_product_flash_attention_for_cpu", getattr(_fc, "sdpa_flop", None)),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", getattr(_fc, "sdpa_backward_flop", None)),
    ]
    for name, formula in pairs:
        if formula is None or not hasattr(_aten, name):
            continue
        op = getattr(_aten, name)
        # Guarded so a module reload, or a torch that learns these ops itself, is not a duplicate
        # registration (register_flop_formula raises on duplicates).
        if op in _fc.flop_registry:
            continue
        _fc.register_flop_formula(op, get_raw=True)(formula)


_register_cpu_sdpa_formulas()


def _register_fused_linear_cross_entropy_formula() -> None:
    """torch's fused linear cross-entropy (loss=fused) is one custom op that computes the loss and both gradients in
    its forward: 2·N·C·V for the logits, 2·N·C·V for the input's gradient, 2·N·C·V for the weight's: the 6·N·C·V a
    standard head spends over its forward and backward. Without a formula the counter sees 0 FLOPs."""
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401  (defines the op)

        op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked
    except (ImportError, AttributeError, RuntimeError):
        return
    if op in _fc.flop_registry:
        return

    def formula(input_shape: Any, weight_shape: Any, *args: Any, **kwargs: Any) -> int:
        n, c = input_shape[0], input_shape[-1]
        return 6 * n * c * weight_shape[0]

    _fc.register_flop_formula(op)(formula)


_register_fused_linear_cross_entropy_formula()


def _register_grouped_mm_formula() -> None:
    """MoE experts run as one grouped matmul (`aten._grouped_mm`, transformers' default experts path), which has no
    formula: 2 · (output elements) · (contraction length). Where both operands are 2-D the groups split the
    contraction instead (the experts' weight gradient: out (G, K, N) from (K, M) · (M, N)), so each output element
    contracts over its group's share of M only."""
    op = getattr(_aten, "_grouped_mm", None)
    if op is None or op in _fc.flop_registry:
        return

    def formula(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        total = math.prod(out_shape) * a_shape[-1]
        if len(a_shape) == 2 and len(b_shape) == 2:
            total //= out_shape[0]
        return 2 * total

    _fc.register_flop_formula(op)(formula)


_register_grouped_mm_formula()


# SAC decisions made so far in this process: torch's SAC mode runs above any counting mode on the mode stack and leaves
# no mark on the ops it passes down, so op_sac's policy function counts itself
# (trainer.measure.time.roofline costs each).
# Read only through `sac_decisions()`: a name imported by value would go stale when this module is reloaded (it
# rebinds the counter), and the count would then stay 0 for its readers.
_sac_decisions = 0


def count_sac_decision() -> None:
    global _sac_decisions
    _sac_decisions += 1


def sac_decisions() -> int:
    """SAC decisions counted so far in this process."""
    return _sac_decisions


def flop_counter() -> _fc.FlopCounterMode:
    """A quiet FlopCounterMode (no table printed on exit) that knows the CPU SDPA kernels."""
    return _fc.FlopCounterMode(display=False)


def count_flops(fn: Callable[[], Any]) -> int:
    """Total FLOPs of running ``fn()``: forward, and backward too if ``fn`` calls it."""
    with flop_counter() as counter:
        fn()
    return counter.get_total_flops()


def local_shards(tree: Any) -> Any:
    """`tree` with each DTensor replaced by its local shard: what the rank's kernel reads and writes.

    A dispatch mode sees a DTensor op before DTensor runs it, with the global shapes, and does not see the local op
    it then runs (the mode is off while it handles the op); counted from those shapes, a tensor-parallel rank's
    column- and row-split matmuls would cost the whole layer's FLOPs and bytes. The shapes of the shards are the
    local op's where DTensor runs it without moving its inputs first, as the families' plans are made to."""
    return tree_map_only(DTensor, lambda t: t._local_tensor, tree)


class FlopTally(TorchDispatchMode):
    """Total FLOPs of the ops run under it, by torch's own formulas (`flop_counter.flop_registry`, the CPU SDPA
    ones above included).

    Not FlopCounterMode itself where memory is measured in the same pass: its per-module tracker registers backward
    hooks on every module's inputs and outputs, which holds them until backward, so the estimator's step measured
    under it kept 3.5× the bytes under `full` (145.7 vs 41.3 MiB at the default shape). This mode only counts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _fc.flop_registry.get(func._overloadpacket)
        if formula is not None:
            local_args, local_kwargs, local_out = local_shards((args, kwargs, out))
            self.total += formula(*local_args, **local_kwargs, out_val=local_out)
        return out
