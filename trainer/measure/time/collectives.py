"""FSDP2's collectives in one optimizer step, as bytes on the GPU link: what the step-time model
(trainer/measure/time/roofline.py) prices on a catalogue GPU's `gpu_link`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Collectives:
    """FSDP2's traffic in one optimizer step, as the bytes one rank sends over the GPU link (a ring all-gather or
    reduce-scatter of N bytes over W ranks sends N·(W−1)/W from each). `exposed`: what no compute can hide, the
    first all-gather of the forward, the backward's first if its unit was resharded after the forward, and the last
    reduce-scatter; the rest runs on FSDP2's own streams while the neighbouring layer computes (it prefetches the
    next all-gather), hidden up to the compute's length. The counts and whole sizes (all-gathers' outputs,
    reduce-scatters' inputs) are what a run's collectives are checked against."""

    sent_bytes: int = 0
    exposed_bytes: int = 0
    world: int = 1
    described: str = ""
    all_gathers: int = 0
    all_gathered_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scattered_bytes: int = 0

    @classmethod
    def fsdp2(
        cls,
        units: list[int],
        root: int,
        world: int,
        param_bytes: int,
        reduce_bytes: int,
        micro_batches: int,
        resharded: list[bool] | None = None,
    ) -> Collectives:
        """`units`: each sharded layer's parameter count (in forward order), `root`: the root's own (embedding, final
        norm, head), each all-gathered in `param_bytes` per value and its gradient reduce-scattered in
        `reduce_bytes`; `resharded`: whether each layer frees its gathered parameters after the forward (FSDP2's
        reshard_after_forward; all of them when not given). Per micro-batch: every unit all-gathered for the
        forward, the resharded layers again for the backward (the root keeps its own), every unit's gradient
        reduce-scattered (FSDP2 reduces at each backward unless told not to sync)."""
        if world <= 1 or not units:
            return cls()
        resharded = [True] * len(units) if resharded is None else resharded
        share = (world - 1) / world
        regathered = [n for n, again in zip(units, resharded, strict=True) if again]
        forward = (sum(units) + root) * param_bytes
        backward = sum(regathered) * param_bytes
        reduce = (sum(units) + root) * reduce_bytes
        first_backward = units[-1] * param_bytes if resharded[-1] else 0
        exposed = (root + units[0]) * param_bytes + first_backward + (root + units[0]) * reduce_bytes
        sent = int((forward + backward + reduce) * share) * micro_batches
        what = (
            f"FSDP2 over {world} ranks: per micro-batch {forward / 2**30:.2f} GiB all-gathered for the forward, "
            f"{backward / 2**30:.2f} GiB for the backward, {reduce / 2**30:.2f} GiB of gradients reduce-scattered"
        )
        return cls(
            sent,
            int(exposed * share) * micro_batches,
            world,
            what,
            all_gathers=(len(units) + 1 + len(regathered)) * micro_batches,
            all_gathered_bytes=(forward + backward) * micro_batches,
            reduce_scatters=(len(units) + 1) * micro_batches,
            reduce_scattered_bytes=reduce * micro_batches,
        )
