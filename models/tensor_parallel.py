"""A tensor-parallel style the families' plans share, beside torch's own (`torch.distributed.tensor.parallel`).

    Replicated()   the module's parameters replicated on the tensor-parallel mesh, its computation whole on every
                   rank: plain tensors in and out, DTensors inside

torch ships no style for a module that stays whole; torchtitan writes the same as `NoParallel` (for its MoE router).
Without sequence parallelism the norms are such modules, and their weights still become DTensors on the tensor-
parallel mesh: gradient-norm clipping and the fused optimizers need every parameter on one mesh (FSDP2 then puts
them all on the same 2-D mesh).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


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
