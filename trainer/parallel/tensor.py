"""Tensor parallelism with sequence parallelism: Megatron's layout (Korthikanti et al. 2022), as torchtitan applies
it with torch's `parallelize_module`.

    check(adapter, t)                          # what t must divide, refused in one line before a step is taken
    apply(model, tp_mesh, sequence_parallel, loss_parallel)   # the family's plan of torch ParallelStyles, on the
                                               # tensor-parallel dimension of the run's device mesh
    fully_shard(..., shard_placement_fn=fsdp_placement)   # FSDP2 after it (a fused weight by column)
    with loss_context(model): loss = ...; loss.backward()  # the cross-entropy on logits split by vocabulary

Per layer, the attention's query/key/value and the MLP's gate/up projections are split by output column, the
attention's output and the MLP's down projection by input row, so each rank holds n_head / t heads and 1 / t of the
MLP; with sequence parallelism (on by default, as torchtitan and Megatron run it) the norms, the residual stream and
the dropouts between the blocks hold 1 / t of the sequence, the all-reduce after each block becoming a reduce-scatter
and the all-gather before the next. The plan itself is the family's (`DecoderAdapter.tensor_parallel_plan`): a
model's layout is its own data; a Hugging Face model's is transformers' own `base_model_tp_plan` (without sequence
parallelism, which those plans do not carry).

torch's `parallelize_module` does the sharding; ours adds the refusals a user can act on, and re-ties an embedding
shared with the head (parallelize_module distributes each module's parameter on its own, which would untie them).

With loss parallelism (on by default, as torchtitan runs it) a head the plan splits by vocabulary keeps its logits
split through the cross-entropy: torch's `loss_parallel` computes the softmax's max and sum across the ranks, so no
rank holds the (tokens × vocabulary) logits whole, nor their fp32 copy. Off, the logits are gathered whole on every
rank first; a plan that keeps the head whole (transformers') computes them whole on every rank.

Known limitations: loss=chunked and loss=fused read the head's weight directly and are refused, and so is
policy=memory_budget (its partitioner cannot size a split layer's process group); under trainer.compile=true each
layer compiles on its own (DecoderModule.configure_model), as torchtitan's do. Dropout on a rank's own share
draws from a stream forked per rank (Megatron's per-rank generator): every dropout with sequence parallelism, the
attention's alone without (the residual dropouts then act on whole activations every rank must keep equal).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.adapter import DecoderAdapter, adapter_for
from trainer.errors import ConfigError


def check(adapter: DecoderAdapter, t: int, *, sequence_parallel: bool, seq_len: int) -> None:
    """Refuse, in one line naming the fix, a degree `t` this model cannot be split by."""
    try:
        plan = adapter.tensor_parallel_plan(sequence_parallel)
    except ValueError as e:  # a plan the family has but cannot apply as configured (transformers': no SP)
        raise ConfigError(f"trainer.tensor_parallel={t}: {e}") from None
    if plan is None:
        raise ConfigError(
            f"trainer.tensor_parallel={t}: {type(adapter.model).__name__} has no tensor-parallel plan; use "
            "trainer.tensor_parallel=1 (FSDP2 alone), or a native family (model=gpt, model=llama), or a Hugging Face "
            "model whose config has a base_model_tp_plan"
        )
    divides = dict(adapter.tensor_parallel_divisors())
    if sequence_parallel:
        divides["seq_len"] = seq_len
    for name, n in divides.items():
        if n % t:
            raise ConfigError(
                f"trainer.tensor_parallel={t} does not divide {name}={n}; pick a degree that divides it"
                + (" (or trainer.sequence_parallel=false)" if name == "seq_len" else "")
            )


def apply(model: nn.Module, tp_mesh: Any, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `model` over `tp_mesh` with its family's plan (before FSDP2 and before compile, torchtitan's order);
    `loss_parallel`: a head the plan splits by vocabulary hands its logits on split (see `loss_context`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    adapter = adapter_for(model)
    plan = adapter.tensor_parallel_plan(sequence_parallel)
    if plan is None:  # check() refused it before the run; a caller that skipped it still gets the one line
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan; use trainer.tensor_parallel=1")
    head = adapter.head
    head_path = next(name for name, m in model.named_modules() if m is head)
    split_loss = loss_parallel and type(plan.get(head_path)) is ColwiseParallel
    if split_loss:  # torchtitan's head under loss parallelism: the logits a DTensor split by vocabulary
        plan = {**plan, head_path: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    tied = next((m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is head.weight), None)
    for path, styles in plan.items():  # a tuple: several styles on one module, their hooks in that order
        for style in styles if isinstance(styles, tuple) else (styles,):
            parallelize_module(model, tp_mesh, {path: style})
    if tied is not None and tied.weight is not head.weight:  # both split the (V, C) weight by vocabulary row, so one
        head.weight = tied.weight  # DTensor serves both again
    model.tensor_parallel_degree = tp_mesh.size()  # read by a family that calls the model differently when split
    model.loss_parallel = split_loss  # read by loss_context
    # Dropout where a rank holds its own share draws from the rank's own stream: with sequence parallelism that is
    # every dropout (the whole forward); without, the attention's alone (its heads), while the residual stream's
    # dropouts act on whole activations that every rank must keep equal.
    rank, device_type = tp_mesh.get_local_rank(), tp_mesh.device_type
    split = [model] if sequence_parallel else [adapter.attention_module(i) for i in range(adapter.n_layer)]
    for module in (m for m in split if m is not None):
        module.forward = functools.partial(_on_rank_stream, module.forward, rank, device_type)


def _seed(state: torch.Tensor, salt: bytes) -> int:
    # The generator's state read from its memory: a tensor op (numpy(), tolist()) under the estimate's fake tensors
    # would refuse a real tensor.
    data = ctypes.string_at(state.data_ptr(), state.numel())
    return int.from_bytes(hashlib.blake2b(data + salt, digest_size=8).digest(), "little") >> 1


def _on_rank_stream(forward: Callable[..., Any], rank: int, device_type: str, *args: Any, **kwargs: Any) -> Any:
    """`forward` with the random stream forked for this rank, as Megatron's per-rank generator does: its dropouts act
    on the rank's own share (its stretch of the sequence, its heads), so the ranks of a group, which share a seed,
    must not draw the same masks. The rank's seed is derived from the shared stream's state, which is then reseeded
    from it, the same on every rank; a checkpoint inside `forward` stashes the forked state it meets and its recompute
    replays the same masks. torch's DTensor RNG tracker does the like for random ops on DTensors, on CUDA alone;
    these dropouts run on plain local shards, on any device."""
    if device_type == "cpu":
        gen = torch.default_generator
    else:
        module = torch.get_device_module(device_type)
        gen = module.default_generators[module.current_device()]
    # Seeds, not torch.random.fork_rng: restoring a saved state runs an op, which fake tensors (the estimate) refuse.
    state = gen.get_state()
    gen.manual_seed(_seed(state, rank.to_bytes(4, "little")))
    try:
        return forward(*args, **kwargs)
    finally:
        gen.manual_seed(_seed(state, b"shared"))  # the shared stream moves on, alike on every rank


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """torch's `loss_parallel` for a model whose head `apply` split for it (around the loss and its backward both),
    else nothing."""
    if getattr(model, "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor whole on every rank (the loss of split logits, already the same everywhere; the logits gathered); a
    plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's `shard_placement_fn` after `apply`: a fused projection's weight, split strided by row
    (models.tensor_parallel.FusedColwise), is sharded by column (dimension 1); every other parameter by row, the
    default. FSDP2 would split each rank's rows [q_r | k_r | v_r] again by position, cutting through a part: the weight
    would train right, but its DTensor layout (so `full_tensor()`, checkpoints and gradient checks) would not."""
    from torch.distributed.tensor.placement_types import _StridedShard  # private: torch names it nowhere public

    placements = getattr(param, "placements", ())
    return Shard(1) if any(isinstance(p, _StridedShard) and p.dim == 0 for p in placements) else None
