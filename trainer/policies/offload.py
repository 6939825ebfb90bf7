"""Offload: saved activations to pinned host memory in forward, back in backward, on side CUDA streams."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class HostLedger:
    """Pinned host bytes an estimate's offload holds: now and at most. Under fake tensors on the CPU standing for a
    CUDA device (the estimator's `--device cuda`) nothing can be copied to a host, so the offloader frees the device
    tensor, counts its bytes here and brings back an empty one of the same layout when backward asks: the device
    and the host hold what they would on the GPU, at the same moments; only the values (which fake tensors lack)
    are not moved."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.copied = 0  # bytes sent to the host (each comes back once: the copies move twice this)

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.copied += nbytes
        self.peak = max(self.peak, self.now)

    def release(self, nbytes: int) -> None:
        self.now -= nbytes


_LEDGER: contextvars.ContextVar[HostLedger | None] = contextvars.ContextVar("offload_ledger", default=None)


@contextlib.contextmanager
def offload_to_ledger(ledger: HostLedger) -> Iterator[HostLedger]:
    """Within: offload treats every tensor as a device tensor and its host copies as `ledger`'s bytes."""
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)


class ActivationOffloader:
    """Moves saved activations to pinned host memory in forward and back in backward (torchtune's pattern).

    Device→host copies run on a side stream after an event from the compute stream, so forward compute is not
    blocked; in backward, the first unpack of a block's tensors starts host→device copies of the block before
    it (prefetch), which then overlap this block's backward. `torch.autograd.graph.save_on_cpu` is the
    synchronous version of this; it cannot overlap. Tensors not on CUDA, below `min_bytes`, or parameters
    are left where they are, which makes the whole thing a no-op on CPU.
    """

    def __init__(self, min_bytes: int, prefetch: bool) -> None:
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self._stash: dict[int, list[_Offloaded]] = {}
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.bytes_offloaded = 0  # cumulative, for the tests and the log

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def run(self, segment: int, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or (x.device.type != "cuda" and _LEDGER.get() is None):
            return fn(x)
        self._stash[segment] = []  # entries of an earlier forward left here are fetched one by one in _unpack
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, segment), functools.partial(self._unpack, segment)
        ):
            return fn(x)

    def _pack(self, segment: int, t: torch.Tensor) -> Any:
        ledger = _LEDGER.get()
        if (t.device.type != "cuda" and ledger is None) or t.nbytes < self.min_bytes or _is_parameter(t):
            return t
        if is_traceable_wrapper_subclass(t):  # a DTensor (tensor parallelism's norms under SP): a wrapper with no
            return t  # bytes of its own to copy; it stays, the plain tensors around it move
        if ledger is not None:
            return self._pack_to_ledger(segment, t, ledger)
        d2h, _ = self._side_streams()
        d2h.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(d2h):
            # Its strides too (a transposed weight view, a permuted head split): the tensor comes back as it went.
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            # The allocator must not hand t's memory to a new tensor before the copy has read it.
            t.record_stream(d2h)
            done = torch.cuda.Event()
            done.record(d2h)
        self.bytes_offloaded += t.nbytes
        entry = _Offloaded(host=host, device=t.device, copied=done)
        self._stash.setdefault(segment, []).append(entry)
        return entry

    def _pack_to_ledger(self, segment: int, t: torch.Tensor, ledger: HostLedger) -> _Offloaded:
        """The estimate's pack: the bytes go to the ledger (until autograd drops the entry), the tensor is freed."""
        entry = _Offloaded(host=None, device=t.device, copied=None, layout=(t.shape, t.stride(), t.dtype))
        ledger.add(t.nbytes)
        weakref.finalize(entry, ledger.release, t.nbytes)
        self.bytes_offloaded += t.nbytes
        self._stash.setdefault(segment, []).append(entry)
        return entry

    def _unpack(self, segment: int, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.on_device is None:
            self._bring_back(segment)
        if packed.on_device is None:
            # Not in the stash: a second forward of this segment (e.g. two micro-batches before one backward)
            # replaced the stash entry. Bring this tensor back on its own rather than fail.
            self._fetch([packed])
        if self.prefetch and segment - 1 in self._stash:
            self._bring_back(segment - 1)
        if packed.layout is not None:  # the estimate's: no streams
            assert packed.on_device is not None
            return packed.on_device
        compute = torch.cuda.current_stream(packed.device)
        compute.wait_event(packed.arrived)  # type: ignore[arg-type]
        t = packed.on_device
        assert t is not None
        t.record_stream(compute)
        return t

    def _bring_back(self, segment: int) -> None:
        self._fetch(self._stash.pop(segment, []))

    def _fetch(self, entries: list[_Offloaded]) -> None:
        for e in entries:
            if e.on_device is None and e.layout is not None:
                shape, stride, dtype = e.layout
                e.on_device = torch.empty_strided(shape, stride, dtype=dtype, device=e.device)
        entries = [e for e in entries if e.on_device is None]
        if not entries:
            return
        _, h2d = self._side_streams()
        for e in entries:
            h2d.wait_event(e.copied)
            with torch.cuda.stream(h2d):
                e.on_device = e.host.to(e.device, non_blocking=True)
                e.arrived = torch.cuda.Event()
                e.arrived.record(h2d)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (Linear saves `weight.t()`): its bytes stay on the device anyway."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


@dataclass(eq=False)  # weakly referenced (the ledger's release), compared by identity
class _Offloaded:
    host: torch.Tensor | None
    device: torch.device
    copied: Any
    on_device: torch.Tensor | None = None
    arrived: Any = None
    layout: tuple[torch.Size, tuple[int, ...], torch.dtype] | None = None  # an estimate's: no host copy
