"""The estimator's compiled step (`trainer.compile=true`): the model compiled as a run compiles it, by dynamo and
inductor's own `compile_fx` (its decompositions, joint-graph passes and min-cut partitioner, so the same tensors are
saved for backward and the same ones recomputed), except that inductor generates no kernels: each forward and
backward graph it would lower runs op by op on the fake tensors, through dispatch, where the live-tensor tracker and
the op counter see every tensor the graphs make and free.

Why not inductor's kernels: they cannot run on fake tensors, and their buffers are allocated without dispatching
(the run counts those with the allocator, trainer.measure.allocations). Why the tracker may sit on the stack at
all: dynamo runs a frame eagerly under any dispatch mode (tests/test_compiled.py), except one that declares
`ignore_compile_internals`, torch's way for a mode to see compiled code's ops; the two modes here do, and are used
for nothing else.

What is approximated: inside one graph, inductor's scheduler fuses pointwise chains into kernels, reorders nodes for
peak memory and reuses buffers, so a fused kernel's intermediates never exist as tensors and lifetimes move; here
each op's output is a tensor from its op to its last use, in the graph's order. The saved set (the partitioner's)
is inductor's; a peak inside a backward graph can read above or below the run's (tests/test_compiled.py names
where, measured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.measure.memory import LiveTensorTracker
from trainer.measure.steptime import OpTrace


class GraphTracker(LiveTensorTracker):
    """The live-tensor tracker for the estimator's compiled step: dynamo runs the compiled graphs under it."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class GraphOpTrace(OpTrace):
    """The op counter for the estimator's compiled step: the graphs' ops, the partitioner's recompute included."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def run_op_by_op(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], is_inference: bool = False, **_: Any
) -> Callable[[list[Any]], Any]:
    """compile_fx's inner compiler, in place of inductor's code generation: inductor's post-grad passes as its
    inner compiler applies them (torch._inductor.compile_fx.fx_codegen_and_compile), then the graph run by
    torch.fx's Interpreter, boxed (it takes the argument list and empties it, so an input is freed at its last use,
    as inductor's generated code frees it) and freeing each value after its last use."""
    from torch._inductor import compile_fx as cfx
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = cfx.fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        cfx._recursive_post_grad_passes(gm, is_inference=is_inference)

    def run(args: list[Any]) -> Any:
        return torch.fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_model(model: torch.nn.Module, backend: Any) -> None:
    """model.compile as DecoderModule.configure_model compiles it, with `backend` (the policy's, given
    `run_op_by_op`). Dynamo's caches are emptied first: a session measures one policy after another on the same
    module, whose code objects would otherwise pile up guards until dynamo's recompile limit silently ran a frame
    eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    model.compile(backend=backend)
