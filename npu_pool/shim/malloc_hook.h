// malloc_hook.h -- the malloc and free hooks both torch shims export (torch_cuda_hooks.cpp,
// torch_npu_hooks.cpp): the core's npu_pool_malloc / npu_pool_free, with a request the core
// cannot serve thrown as c10::OutOfMemoryError carrying the pool's explanation
// (torch.OutOfMemoryError in Python). A plain C hook can only return NULL, and torch's pluggable
// allocators do not check: torch_npu fails later with "Get data_ptr failed", CUDA hands out a
// tensor without storage that fails at first use ("data is not allocated yet"), and
// torch.empty() succeeds. Any other refusal (a closed pool, a forked child, no configuration)
// is a plain c10::Error (RuntimeError), but a request past any device's memory (NP_MAX_REQUEST),
// which torch's own allocators refuse as out of memory. The memory-fraction hook is here too: a
// C one can only print a fraction or device the core refuses, and the caller of
// set_per_process_memory_fraction would believe the cap was set; this one raises.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "npu_pool.h"

namespace npu_pool_shim {
namespace {  // internal to each shim: nothing here is exported beside its extern "C" hooks

// The core's entry points the hooks call (addresses from the binding, set once at load).
struct CoreMalloc {
  void *(*malloc)(size_t, int, void *) = nullptr;
  void (*free)(void *, size_t, int, void *) = nullptr;
  size_t (*last_error)(int, char *, size_t) = nullptr;
  int (*last_code)() = nullptr;
  int (*set_fraction)(int, double) = nullptr;
};

inline void bind_malloc(CoreMalloc &c, void *malloc_fn, void *free_fn, void *last_error_fn, void *last_code_fn,
                        void *set_fraction_fn) {
  c.malloc = reinterpret_cast<void *(*)(size_t, int, void *)>(malloc_fn);
  c.free = reinterpret_cast<void (*)(void *, size_t, int, void *)>(free_fn);
  c.last_error = reinterpret_cast<size_t (*)(int, char *, size_t)>(last_error_fn);
  c.last_code = reinterpret_cast<int (*)()>(last_code_fn);
  c.set_fraction = reinterpret_cast<int (*)(int, double)>(set_fraction_fn);
}

// This thread's last error (an out-of-memory explanation can run past a kilobyte: the request,
// the pool's figures, the snapshot written).
inline std::string last_error(const CoreMalloc &c) {
  char msg[4096] = "";
  c.last_error(-1, msg, sizeof msg);
  return msg;
}

inline void *malloc_or_throw(const CoreMalloc &c, size_t size, int device, void *stream) {
  void *p = c.malloc(size, device, stream);
  if (p || size == 0) return p;
  int code = c.last_code();  // this thread's: set by the failed call just made
  std::string msg = last_error(c);  // this thread's too: another may have failed on the device since
  TORCH_CHECK_WITH(OutOfMemoryError, code != NP_ERR_OOM && size <= NP_MAX_REQUEST, "npu_pool: ", msg);
  TORCH_CHECK(false, "npu_pool: ", msg);
  return nullptr;
}

inline void fraction_or_throw(const CoreMalloc &c, double fraction, int device) {
  TORCH_CHECK(c.set_fraction(device, fraction) == NP_OK, "npu_pool: ", last_error(c));
}

}  // namespace
}  // namespace npu_pool_shim
