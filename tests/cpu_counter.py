"""A second count of CPU memory, independent of the profiler: c10's CPU allocator wrapped by one that logs every
allocation and free it passes through (built on first use with torch's C++ extension loader, ~30 s, then cached).

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

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
c10::Allocator* inner = nullptr;
c10::DeleterFnPtr inner_delete = nullptr;
std::mutex mu;
std::unordered_map<void*, int64_t> sizes;
std::vector<std::pair<int64_t, int64_t>> log_;  // (pointer, signed bytes)
bool recording = false;

void counted_delete(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = sizes.find(p);
    if (it != sizes.end()) {
      if (recording) log_.emplace_back(reinterpret_cast<int64_t>(p), -it->second);
      sizes.erase(it);
    }
  }
  inner_delete(p);
}

// The pointer is its own context (as c10's allocator makes it), so raw_allocate keeps working.
struct Counting final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner->allocate(n);
    auto device = d.device();
    void* data = d.release_context();
    if (data != nullptr) {
      std::lock_guard<std::mutex> g(mu);
      sizes[data] = static_cast<int64_t>(n);
      if (recording) log_.emplace_back(reinterpret_cast<int64_t>(data), static_cast<int64_t>(n));
    }
    return c10::DataPtr(data, data, &counted_delete, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
Counting counting;
}  // namespace

void install() {
  if (inner == nullptr) {
    inner = c10::GetCPUAllocator();
    inner_delete = inner->raw_deleter();
    TORCH_CHECK(inner_delete != nullptr, "the CPU allocator has no raw deleter to delegate to");
  }
  c10::SetCPUAllocator(&counting, /*priority=*/100);
}
void uninstall() { if (inner != nullptr) c10::SetCPUAllocator(inner, /*priority=*/100); }
void start() { std::lock_guard<std::mutex> g(mu); log_.clear(); recording = true; }
std::vector<std::pair<int64_t, int64_t>> stop() {
  std::lock_guard<std::mutex> g(mu);
  recording = false;
  return std::move(log_);
}
int64_t length() { std::lock_guard<std::mutex> g(mu); return static_cast<int64_t>(log_.size()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("uninstall", &uninstall);
  m.def("start", &start);
  m.def("stop", &stop);
  m.def("length", &length);
}
"""


@functools.cache
def _extension() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline("trainer_cpu_counter", cpp_sources=[_SOURCE], verbose=False)


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
