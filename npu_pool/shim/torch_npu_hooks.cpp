// torch_npu_hooks.cpp -- the hooks of torch_npu's NPUPluggableAllocator that a C function
// cannot be: they take or return C++ types. Built against the installed torch and torch_npu
// headers by npu_pool/cpp_hooks.py (cached), bound to the core's C entry points at load.
//
//  - malloc / free / memory fraction: malloc_hook.h (a request the core cannot serve raises
//    torch.OutOfMemoryError, a fraction or device it refuses a RuntimeError);
//  - get_device_stats: c10::CachingDeviceAllocator::DeviceStats filled from np_stats
//    (torch.npu.memory_stats() & co.; without it torch_npu's getDeviceStats returns nothing);
//    a device torch does not have raises "Invalid device argument", as torch_npu's allocator does;
//  - record_stream / erase_stream: take a c10_npu::NPUStream, whose aclrtStream the core
//    orders reuse after (erasing is a no-op: keeping the wait is always safe);
//  - synchronize: the core's device synchronisation inside torch_npu (npu_pool_set_framework_sync):
//    npuSynchronizeDevice empties torch_npu's task queue before it waits for the device, where
//    aclrtSynchronizeDevice alone would not wait for work still queued on the host.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include "torch_npu/csrc/core/npu/NPUStream.h"

#include "malloc_hook.h"
#include "npu_pool.h"

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatArray;
using c10::CachingDeviceAllocator::StatType;

struct Core : npu_pool_shim::CoreMalloc {
  int (*stats)(int, np_stats *) = nullptr;
  void (*record_stream)(void *, void *) = nullptr;
} core;

void set(Stat &s, const np_counter &c) {
  s.current = static_cast<int64_t>(c.current);
  s.peak = static_cast<int64_t>(c.peak);
  s.allocated = static_cast<int64_t>(c.allocated);
  s.freed = static_cast<int64_t>(c.freed);
}

// One StatArray: the total, and torch's small/large pools where the policy's pools are those.
void fill(StatArray &a, const np_stats &st, np_counter np_pool_stats::*field, bool small_large) {
  set(a[static_cast<size_t>(StatType::AGGREGATE)], st.total.*field);
  if (!small_large) return;
  set(a[static_cast<size_t>(StatType::SMALL_POOL)], st.pool[0].*field);
  set(a[static_cast<size_t>(StatType::LARGE_POOL)], st.pool[1].*field);
}

}  // namespace

extern "C" {

// The core's entry points (addresses from the binding); returns 0.
int npu_pool_hooks_bind(void *malloc_fn, void *free_fn, void *stats_fn, void *record_fn, void *last_error_fn,
                        void *last_code_fn, void *set_fraction_fn) {
  npu_pool_shim::bind_malloc(core, malloc_fn, free_fn, last_error_fn, last_code_fn, set_fraction_fn);
  core.stats = reinterpret_cast<int (*)(int, np_stats *)>(stats_fn);
  core.record_stream = reinterpret_cast<void (*)(void *, void *)>(record_fn);
  return 0;
}

void *npu_pool_hooks_malloc(size_t size, int device, void *stream) {
  return npu_pool_shim::malloc_or_throw(core, size, device, stream);
}

void npu_pool_hooks_free(void *ptr, size_t size, int device, void *stream) { core.free(ptr, size, device, stream); }

void npu_pool_hooks_memory_fraction(double fraction, int device) { npu_pool_shim::fraction_or_throw(core, fraction, device); }

DeviceStats npu_pool_hooks_device_stats(c10::DeviceIndex device) {
  np_stats st{};
  DeviceStats out;
  // the calling thread's error says why this device was refused
  TORCH_CHECK(core.stats(device, &st) == NP_OK, npu_pool_shim::last_error(core));
  bool small_large = std::string(st.pool[0].name) == "small" && std::string(st.pool[1].name) == "large";
  fill(out.allocation, st, &np_pool_stats::blocks, small_large);
  fill(out.segment, st, &np_pool_stats::segments, small_large);
  fill(out.active, st, &np_pool_stats::blocks, small_large);
  fill(out.allocated_bytes, st, &np_pool_stats::allocated, small_large);
  fill(out.reserved_bytes, st, &np_pool_stats::reserved, small_large);
  fill(out.active_bytes, st, &np_pool_stats::active, small_large);
  fill(out.requested_bytes, st, &np_pool_stats::requested, small_large);
  // free bytes the pool holds that empty_cache could not return: what torch calls inactive and
  // split (non-releasable)
  Stat &inactive = out.inactive_split_bytes[static_cast<size_t>(StatType::AGGREGATE)];
  inactive.current = inactive.peak = static_cast<int64_t>(st.non_releasable);
  out.num_alloc_retries = static_cast<int64_t>(st.retries);
  out.num_ooms = static_cast<int64_t>(st.ooms);
  out.num_sync_all_streams = static_cast<int64_t>(st.syncs);
  out.num_device_alloc = static_cast<int64_t>(st.device_mallocs);
  out.num_device_free = static_cast<int64_t>(st.device_frees);
  out.max_split_size = -1;  // no split limit: torch's "unset" (its SIZE_MAX, read as int64)
  return out;
}

void npu_pool_hooks_record_stream(void *ptr, c10_npu::NPUStream stream) {
  core.record_stream(ptr, stream.stream(false));
}

void npu_pool_hooks_erase_stream(void *ptr, c10_npu::NPUStream stream) {
  (void)ptr;
  (void)stream;
}

int npu_pool_hooks_synchronize(void) {
  try {
    return c10_npu::npuSynchronizeDevice(true) ? 0 : 1;
  } catch (...) {  // (its error stays with torch_npu; the core reports the synchronisation failed)
    return 1;
  }
}

}  // extern "C"
