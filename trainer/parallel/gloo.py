"""FSDP2's all-gather and reduce-scatter on gloo, settled: each returns once gloo has let go of its buffers.

Gloo runs a collective on a worker thread, which keeps its own reference to the work, and so to the input and
output buffers, for a moment after ``wait()`` has returned. When FSDP2 drops such a buffer in that moment (the
all-gather output after the copy-out, the reduce-scatter input after the reduction), the last reference goes on the
worker thread, at a time the OS scheduler picks: the free lands some ops late, at random, and a CPU run's measured
peak moves by one layer's all-gather now and then. The estimator's fake process group frees where FSDP2 drops;
settled, a gloo run frees there too, so its figures are the estimate's on every run, loaded machine or not.

Near tool: FSDP2's own ``DefaultAllGather`` / ``DefaultReduceScatter`` (what ``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter`` replace). Ours call the same collectives; they differ only in waiting, so they give up the
overlap of a prefetched all-gather with compute on CPU. NCCL (CUDA) runs keep torch's own, and so does the estimator.

Example::

    fully_shard(layer, mesh=mesh)
    settle_on_gloo(layer, mesh.get_group())

Known limitation: FSDP2's collectives only; a tensor-parallel or DDP collective on gloo keeps gloo's timing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Far longer than a release takes (microseconds); past it something else holds the buffer, and the run says so.
_RELEASE_TIMEOUT_S = 60.0
# torch's current names, or the older ones they replace (as FSDP2's own defaults call them)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _holders(t: torch.Tensor) -> tuple[int, int]:
    # The tensor's and its storage's reference counts: a collective may hold the tensor or a view of it.
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _settled(launch: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Run `launch()` (a collective with async_op=True), wait for it, and return once the references it took to
    `tensors` are gone: compared with the counts before the launch."""
    before = [_holders(t) for t in tensors]
    work = launch()
    work.wait()
    del work
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while any(
        a > b for t, counts in zip(tensors, before, strict=True) for a, b in zip(_holders(t), counts, strict=True)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"gloo kept a collective's buffers {_RELEASE_TIMEOUT_S:.0f} s after it finished; "
                "trainer=ddp runs without FSDP2's collectives"
            )
        time.sleep(0)  # lets the worker thread run: it needs the GIL only if it frees a Python object


class _Allocate:
    """FSDP2's comm interface (torch's AllGather / ReduceScatter, which no public module exports): an allocate and a
    call; FSDP2 checks nothing more of a custom comm."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # as FSDP2's default


class SettledAllGather(_Allocate):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        _settled(
            lambda: _all_gather(output_tensor, input_tensor, group=group, async_op=True),
            (output_tensor, input_tensor),
        )


class SettledReduceScatter(_Allocate):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        _settled(
            lambda: _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=True),
            (output_tensor, input_tensor),
        )


def settle_on_gloo(module: Any, group: dist.ProcessGroup) -> None:
    """Give a `fully_shard`-ed module the settled collectives when its data-parallel group runs on gloo."""
    if dist.get_backend(group) != "gloo" or not hasattr(module, "set_custom_all_gather"):
        return  # an older torch without custom comms: its gloo runs keep gloo's timing
    module.set_custom_all_gather(SettledAllGather())
    module.set_custom_reduce_scatter(SettledReduceScatter())
