// The CPU allocator wrapped by one that logs every allocation and free (tests/cpu_counter.py loads it).
// Only c10 and pybind11: torch/extension.h (all of ATen) made the first build take ~30 s.
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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
