"""A second count of CPU memory, independent of the profiler: c10's CPU allocator wrapped by one that logs every
allocation and free it passes through (cpu_counter.cpp, built on first use with torch's C++ extension loader,
then cached).

It exists to check `allocations.AllocatorRecorder` (the profiler's memory events) on compiled steps, where no
dispatch mode can count: the two see the same allocator from two sides, the profiler through the reports c10
makes to it, this one by being the allocator every CPU tensor (and every buffer inductor's code makes) comes from.
Blocks allocated before `install()` are not its own, so their frees pass it by; install it before the model exists.

Not for runs: it replaces the process's CPU allocator (delegating to it) for as long as it is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from trainer.measure.memory.allocator_events import Recording
from trainer.measure.memory.tracker import local_tensors


@functools.cache
def _extension() -> Any:
    from pathlib import Path

    from torch.utils.cpp_extension import load

    # `load`, not `load_inline`: the latter prepends torch/extension.h, whose parse was most of a ~30 s first build.
    return load("trainer_cpu_counter", sources=[str(Path(__file__).with_suffix(".cpp"))], verbose=False)


class CpuAllocationCounter:
    """Logs the CPU allocator's traffic over a window, as a Recording (trainer.measure.memory.allocator_events)
    with the same replay:

    counter.install()                       before the model is built
    counter.start(adopted)                  the training state, as StepMeter adopts it
    counter.mark("window_end")              e.g. after the first backward
    recording = counter.stop(marks_pointers={"window_end": [gradient pointers]})
    """

    def __init__(self) -> None:
        self.ext = _extension()
        self._adopted: list[tuple[int, int]] = []
        self._marks: dict[str, int] = {}

    def install(self) -> None:
        self.ext.install()

    def uninstall(self) -> None:
        self.ext.uninstall()

    def start(self, adopted: Iterable[torch.Tensor | None] = ()) -> None:
        seen: dict[int, int] = {}
        for t in local_tensors(adopted):
            if t.device.type == "cpu" and t.untyped_storage().nbytes():
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        self._adopted = list(seen.items())
        self._marks = {}
        self.ext.start()

    def mark(self, name: str) -> None:
        self._marks[name] = int(self.ext.length())

    def stop(self, mark_pointers: dict[str, Iterable[int]] | None = None) -> Recording:
        log = self.ext.stop()
        rec = Recording()
        n = 0
        adopted: dict[int, tuple[int, int]] = {}
        for ptr, nbytes in self._adopted:
            rec.adopted.add(n)
            rec.events.append((n, nbytes))
            adopted[ptr] = (n, nbytes)
            n += 1
        alive: dict[int, int] = {}
        want = {k: set(v) for k, v in (mark_pointers or {}).items()}
        at = {index: name for name, index in self._marks.items()}
        for i, (ptr, delta) in enumerate([*log, (0, 0)]):
            if i in at:
                rec.marks[at[i]] = len(rec.events)
                rec.alive_at[at[i]] = {p: alive[p] for p in want.get(at[i], ()) if p in alive}
            if delta > 0:
                alive[ptr] = n
                rec.events.append((n, delta))
                n += 1
            elif delta < 0 and ptr in alive:
                rec.events.append((alive.pop(ptr), delta))
            elif delta < 0 and ptr in adopted:
                record, nbytes = adopted.pop(ptr)
                rec.events.append((record, -nbytes))
        return rec
