"""Tensor-parallel styles the families' plans share, beside torch's own (`torch.distributed.tensor.parallel`).

    Replicated()          the module's parameters replicated on the tensor-parallel mesh, its computation whole on
                          every rank: plain tensors in and out, DTensors inside
    FusedColwise(parts)   torch's ColwiseParallel for a Linear whose output is `parts` projections side by side
                          (GPT-2's fused query/key/value): each rank holds its share of every part, in order
    megatron_plan(...)    Megatron's layout for a decoder, from the names of its modules: the plan a family hands
                          `parallelize_module` (a family's plan is its data)

torch ships no style for a module that stays whole; torchtitan writes the same as `NoParallel` (for its MoE router).
Without sequence parallelism the norms are such modules, and their weights still become DTensors on the tensor-
parallel mesh: gradient-norm clipping and the fused optimizers need every parameter on one mesh (FSDP2 then puts
them all on the same 2-D mesh).

A fused projection's weight stacks its parts by output row, [q | k | v]; ColwiseParallel's contiguous split would
give rank 0 all of q and part of k. Megatron stores the fused weight interleaved by head group instead, which would
change the model's parameters (and GPT-2's checkpoints); FusedColwise keeps them and distributes the weight with
DTensor's strided placement (`_StridedShard`, the one FSDP2 uses over a tensor-parallel shard), so each rank's local
output is [q_r | k_r | v_r] and `full_tensor()`, checkpoints and FSDP2 all see the unsplit layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


class Replicated(ParallelStyle):
    """Replicate a module's parameters on the mesh and run it whole on every rank (its inputs and outputs plain)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def inputs_in(mod: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_out(mod: nn.Module, output: Any, mesh: Any) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, None, inputs_in, output_out)


class FusedColwise(ColwiseParallel):
    """ColwiseParallel for a Linear computing `parts` projections at once: every part split by output column, so
    each rank's output is its share of each part, side by side (the caller splits it in `parts` equal chunks)."""

    def __init__(self, parts: int, input_layouts: Any = None) -> None:
        super().__init__(input_layouts=input_layouts)  # the output: always this rank's local share
        self.parts = parts

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: torch.Tensor, device_mesh: Any
    ) -> Any:
        # Already each rank's share of every part (strided as the weight is; local where a bias was added):
        # ColwiseParallel's redistribution to a contiguous Shard(-1) would move columns between the ranks and give
        # rank 0 the whole first part.
        return outputs.to_local() if use_local_output and isinstance(outputs, DTensor) else outputs

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        for param_name, param in module.named_parameters():
            # The bias whole on every rank: a 1-D strided shard, which FSDP2 would split again by position, is no
            # layout a DTensor can describe (the weight, 2-D, FSDP2 splits by column instead).
            placement = _StridedShard(0, split_factor=self.parts) if param.ndim == 2 else Replicate()
            dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if getattr(module, "bias", None) is not None:
            module.forward = functools.partial(_fused_linear, module, self.parts)
        return module


def _fused_linear(module: nn.Linear, parts: int, x: DTensor) -> torch.Tensor:
    """The Linear's forward with its whole bias viewed as (parts, n) and split by its second dimension (this rank's
    share of every part, laid out as the output's columns) and added to the local output. DTensor's own linear
    would slice the bias inside the op and hand the whole bias a strided gradient, which FSDP2 must then gather by a
    path torch cannot run on fake tensors (so the estimator could not); given the bias strided, it replicates the
    whole computation instead."""
    bias = module.bias.view(parts, -1).redistribute(placements=[Shard(1)]).to_local().reshape(-1)
    return F.linear(x, module.weight).to_local() + bias


def megatron_plan(
    sequence_parallel: bool,
    *,
    embedding: str,
    head: str,
    final_norm: str,
    layers: str,
    norms: tuple[str, ...],
    blocks: dict[str, int],
    colwise: tuple[str, ...],
    rowwise: tuple[str, ...],
    fused: dict[str, int] | None = None,
    positions: str | None = None,
) -> dict[str, Any]:
    """Megatron's split of a decoder as torchtitan writes it for its LLaMA, from the family's module names.

    Per layer (`layers`.*): the `colwise` projections split by output column (`fused` ones part by part), the
    `rowwise` ones by input row, so each rank holds its share of the heads and of the MLP. With sequence parallelism
    the embedding's output (`positions`: a position table added to it, its rows for this rank's stretch), the
    `norms`, the final norm and the residual stream are sharded by sequence (dimension 1), and each of `blocks` (the
    modules whose first input the projections need whole, mapped to how many other inputs they take, left plain)
    all-gathers it; without, the norms and the position table run whole on every rank. The head splits by
    vocabulary and gathers its logits whole (tensor.apply turns that into loss parallelism). A module given a tuple
    takes its styles in order.

        megatron_plan(sp, embedding="model.embed_tokens", head="lm_head", final_norm="model.norm",
                      layers="model.layers", norms=("input_layernorm", "post_attention_layernorm"),
                      blocks={"self_attn": 2, "mlp": 0}, colwise=("self_attn.q_proj", ...), rowwise=(...))
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        head: ColwiseParallel(output_layouts=Replicate()),
    }
    layer: dict[str, Any] = {name: ColwiseParallel() for name in colwise}
    layer |= {name: FusedColwise(parts) for name, parts in (fused or {}).items()}
    layer |= {name: RowwiseParallel(output_layouts=seq) for name in rowwise}
    if sequence_parallel:
        if positions is not None:  # (T, C): this rank's rows, as the embedding's output
            plan[positions] = (
                Replicated(),
                PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
            )
        # The final hidden states gathered whole where the norm ends, as (B, T, C): the loss flattens them to
        # (B·T, C) before the head, and a sequence-sharded tensor flattened so is only expressible strided.
        plan[final_norm] = (
            SequenceParallel(),
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False),
        )
        layer |= {name: SequenceParallel() for name in norms}
        layer |= {
            name: PrepareModuleInput(
                input_layouts=(Shard(1), *[None] * others), desired_input_layouts=(Replicate(), *[None] * others)
            )
            for name, others in blocks.items()
        }
    else:  # the norms (and a position table) whole on every rank, their weights replicated on the mesh
        plan[final_norm] = Replicated()
        if positions is not None:
            plan[positions] = Replicated()
        layer |= {name: Replicated() for name in norms}
    plan |= {f"{layers}.*.{name}": style for name, style in layer.items()}
    return plan
