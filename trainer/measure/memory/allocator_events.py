"""Counting what the allocator hands out: the step's memory under torch.compile.

The live-tensor tracker (tracker.py) is a dispatch mode, and dynamo runs a compiled frame's original Python instead of
its compiled code while any dispatch mode is pushed, so a tracked step of a compiled model is an eager step. This
recorder pushes no mode: it reads the allocator's own reports through torch.profiler's memory events
(`profile_memory=True`), which see every buffer inductor's generated code allocates, on CPU (c10's CPU allocator
reports each allocation and free while the profiler records) and on CUDA (the caching allocator's blocks).

What it records has the tracker's shape, so one replay gives the same figures: `events` of (record, signed bytes)
in the order they happened, and the `adopted` records of storages that predate the window (parameters, optimizer
state, last step's gradients), counted from the start and leaving when they are freed. The allocator does not report
the free of a block allocated before the profiler started, so an adopted storage's free is seen through a weak
reference on it, which drops a marker in the profile at that moment.

Approximated: the allocator's byte count is the request (c10's CPU allocator), not the rounded block a CUDA
allocator keeps (that is `caching_allocator.py`'s replay); an allocation made on a thread the profiler does not
follow is missed (torch's intra-op workers allocate nothing a step keeps).

Near tool: `torch.cuda.memory._record_memory_history` records the same allocations with stacks, on CUDA only; the
profiler's events serve the CPU too, where the suite checks compiled steps.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType

from trainer.measure.memory.tracker import local_tensors

_MARK = "trainer.mark:"  # a record_function name: a point in the window (free of an adopted storage, window end)


@dataclass
class Recording:
    """What one window's allocator reported, as the tracker records it (see the module docstring)."""

    events: list[tuple[int, int]] = field(default_factory=list)
    adopted: set[int] = field(default_factory=set)
    marks: dict[str, int] = field(default_factory=dict)  # marker → number of events before it
    # data pointer → record of the block alive there at each mark (to leave a mark's gradients out of a replay)
    alive_at: dict[str, dict[int, int]] = field(default_factory=dict)

    def peak(self, excluding: Iterable[int] = (), until: str | None = None, adopted: bool = True) -> int:
        """Peak live bytes over the events (up to mark `until`), leaving out `excluding` records (and the adopted
        ones when `adopted` is False)."""
        skip = set(excluding) | (set() if adopted else self.adopted)
        stop = None if until is None else self.marks[until]
        live = peak = 0
        for record, delta in self.events[:stop]:
            if record in skip:
                continue
            live += delta
            peak = max(peak, live)
        return peak

    def records_at(self, mark: str, tensors: Iterable[torch.Tensor | None]) -> set[int]:
        """The records alive under `tensors` (a DTensor's local shard) when `mark` was made (e.g. the gradients at
        the end of backward)."""
        alive = self.alive_at.get(mark, {})
        pointers = (t.untyped_storage().data_ptr() for t in local_tensors(tensors))
        return {alive[p] for p in pointers if p in alive}


class AllocatorRecorder:
    """Records the allocator's reports for one window: `start(adopted)`, `mark(name, tensors)`, `stop()`.

    `device_type` filters the reports (cpu or cuda). Meant for chosen steps: the profiler costs a little per op.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = torch.device(device_type).type
        self._profiler: Any = None
        self._adopted: list[tuple[int, int, str]] = []  # (data pointer, bytes, marker name), in adoption order
        self._refs: list[weakref.ref] = []
        self._mark_pointers: dict[str, list[int]] = {}
        self._serial = itertools.count()

    def start(self, adopted: Iterable[torch.Tensor | None] = ()) -> None:
        seen: set[int] = set()
        for t in local_tensors(adopted):
            if t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            name = f"{_MARK}free{next(self._serial)}"
            self._adopted.append((ptr, storage.nbytes(), name))
            # The callback must not hold the storage; it marks the moment the adopted bytes are given back.
            self._refs.append(weakref.ref(storage, lambda _r, n=name: self._marker(n)))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, profile_memory=True)
        self._profiler.__enter__()

    @staticmethod
    def _marker(name: str) -> None:
        with torch.profiler.record_function(name):
            pass

    def mark(self, name: str, tensors: Iterable[torch.Tensor | None] = ()) -> None:
        """A point in the window; `tensors`' blocks (e.g. the gradients) can be left out of a replay up to it."""
        self._mark_pointers[name] = [t.untyped_storage().data_ptr() for t in local_tensors(tensors)]
        self._marker(_MARK + name)

    def abort(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)
        self._refs.clear()

    def stop(self) -> Recording:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self._refs.clear()  # later frees are no longer this window's
        happened: list[tuple[int, int, Any]] = []  # (time, order seen, event)
        order = itertools.count()

        def walk(node: Any) -> None:
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                if fields.device.type == self.device_type:
                    happened.append((node.start_time_ns, next(order), ("alloc", fields.ptr, fields.alloc_size)))
            elif node.name.startswith(_MARK):
                happened.append((node.start_time_ns, next(order), ("mark", node.name.removeprefix(_MARK), 0)))
            for child in node.children:
                walk(child)

        for root in profiler.profiler.kineto_results.experimental_event_tree():
            walk(root)
        happened.sort(key=lambda h: (h[0], h[1]))

        rec = Recording()
        records = itertools.count()
        adopted_by_mark: dict[str, tuple[int, int]] = {}
        for _ptr, nbytes, name in self._adopted:
            record = next(records)
            rec.adopted.add(record)
            rec.events.append((record, nbytes))
            adopted_by_mark[name.removeprefix(_MARK)] = (record, nbytes)
        alive: dict[int, tuple[int, int]] = {}  # data pointer → (record, bytes) of blocks allocated in the window
        for _, _, (kind, key, size) in happened:
            if kind == "mark":
                if key in adopted_by_mark:  # an adopted storage given back
                    record, nbytes = adopted_by_mark.pop(key)
                    rec.events.append((record, -nbytes))
                else:
                    rec.marks[key] = len(rec.events)
                    rec.alive_at[key] = {p: alive[p][0] for p in self._mark_pointers.get(key, []) if p in alive}
            elif size > 0:
                record = next(records)
                alive[key] = (record, size)
                rec.events.append((record, size))
            elif key in alive:  # a free of a block from before the window is not reported with its size
                record, nbytes = alive.pop(key)
                rec.events.append((record, -nbytes))
        return rec
