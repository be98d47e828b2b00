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
//    aclrtSynchronizeDevice alone would not wait for work still queued on the host;
//  - stream_wait: the core's handover between streams there (npu_pool_set_framework_stream_wait):
//    an NPUEvent recorded on one stream and waited by the other, both through that queue, so the
//    wait follows work still queued. NPUEvent takes an NPUStream, where the core has an aclrtStream:
//    the streams malloc and record_stream see are kept by their aclrtStream (a stream seen nowhere
//    else or that torch_npu refused an event on, and torch_npu's per-stream queues, leave the
//    handover to the synchronisation).
#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include "torch_npu/csrc/core/npu/NPUEvent.h"
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

// What the handovers use: the NPUStreams the core was handed, by aclrtStream (torch_npu's pool
// streams live as long as the process), and one event per device, re-recorded for every handover.
// Invariant: a stream is here only as torch_npu itself named it (current at malloc, or
// record_stream's), so an event recorded on it goes through its queue. A forked child starts with
// none (the parent's are not its own; the old ones are left, their locks perhaps held at the fork).
struct Handovers {
  std::mutex streams_mutex;
  std::unordered_map<void *, c10::Stream> streams;
  std::unordered_set<void *> refused;  // streams torch_npu refused an event on (external ones): kept no more
  std::mutex events_mutex;
  std::unordered_map<int, c10_npu::NPUEvent *> events;
};
std::atomic<Handovers *> handovers{new Handovers};  // (never destroyed: used until exit)

void forget_in_child() { handovers.store(new Handovers); }

void keep(const c10_npu::NPUStream &s) {
  Handovers *h = handovers.load();
  std::lock_guard<std::mutex> g(h->streams_mutex);
  if (!h->refused.count(s.stream(false))) h->streams.insert_or_assign(s.stream(false), s.unwrap());
}

void refuse(Handovers *h, void *stream) {
  std::lock_guard<std::mutex> g(h->streams_mutex);
  h->streams.erase(stream);
  h->refused.insert(stream);
}

// malloc's stream is the calling thread's current one (torch_npu's allocate, raw_alloc); another
// (raw_alloc_with_stream's) is not kept. Each thread asks once per stream it changes to (again
// for one it did not keep: it may be current later).
void keep_current(int device, void *stream) {
  thread_local void *seen = nullptr;
  if (stream == seen) return;
  try {
    c10_npu::NPUStream cur = c10_npu::getCurrentNPUStream(static_cast<c10::DeviceIndex>(device));
    if (cur.stream(false) == stream) {
      keep(cur);
      seen = stream;
    }
  } catch (...) {  // (not kept: a handover from it synchronises instead)
  }
}

bool lookup(Handovers *h, void *stream, int device, c10::Stream *out) {
  std::lock_guard<std::mutex> g(h->streams_mutex);
  auto it = h->streams.find(stream);
  if (it == h->streams.end() || it->second.device_index() != device) return false;
  *out = it->second;
  return true;
}

long env_number(const char *name, long unset) {  // (as torch_npu reads its settings: "" is 0)
  const char *v = std::getenv(name);
  return v ? std::strtol(v, nullptr, 10) : unset;
}

// torch_npu's PER_STREAM_QUEUE (a queue for each stream; its options are not exported, so read as
// it reads them: only with its task queue on, TASK_QUEUE_ENABLE not 0 and no
// ASCEND_LAUNCH_BLOCKING): a record could then be launched after a later re-record of the event
// on another queue, so no event is shared there.
bool per_stream_queues() {
  static const bool on = env_number("ASCEND_LAUNCH_BLOCKING", 0) == 0 && env_number("TASK_QUEUE_ENABLE", 1) != 0 &&
                         env_number("PER_STREAM_QUEUE", 0) != 0;
  return on;
}

}  // namespace

extern "C" {

// The core's entry points (addresses from the binding); returns 0.
int npu_pool_hooks_bind(void *malloc_fn, void *free_fn, void *stats_fn, void *record_fn, void *last_error_fn,
                        void *last_code_fn, void *set_fraction_fn) {
  npu_pool_shim::bind_malloc(core, malloc_fn, free_fn, last_error_fn, last_code_fn, set_fraction_fn);
  core.stats = reinterpret_cast<int (*)(int, np_stats *)>(stats_fn);
  core.record_stream = reinterpret_cast<void (*)(void *, void *)>(record_fn);
  static const int registered = pthread_atfork(nullptr, nullptr, forget_in_child);
  (void)registered;
  return 0;
}

void *npu_pool_hooks_malloc(size_t size, int device, void *stream) {
  keep_current(device, stream);
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
  keep(stream);
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

// `waiter` waits on the device for the work queued so far on `on` (see npu_pool_set_framework_stream_wait):
// the NP_HANDOVER_* bits, ORDERED unless this pair is left to the synchronisation. The core holds
// the device's lock; one event serves every wait, as a wait uses the record launched before it,
// and one queue launches both in order.
int npu_pool_hooks_stream_wait(int device, void *waiter, void *on) {
  Handovers *h = handovers.load();
  c10::Stream w(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::PrivateUse1, 0)), o = w;
  if (per_stream_queues() || !lookup(h, waiter, device, &w) || !lookup(h, on, device, &o)) return 0;
  std::lock_guard<std::mutex> g(h->events_mutex);
  c10_npu::NPUEvent *ev = nullptr;
  bool had = false, recorded = false;
  try {
    c10_npu::NPUStream ws(w), os(o);
    if (ws.isSyncLaunchStream() || os.isSyncLaunchStream()) return 0;  // (launched past the queue)
    c10_npu::NPUEvent *&slot = h->events[device];
    if (!slot) slot = new c10_npu::NPUEvent();
    ev = slot;
    had = ev->isCreated();  // (made at its first record)
    ev->record(os);         // (a stream it refuses, an external one, throws before any call)
    recorded = true;
    ev->block(ws);
    return NP_HANDOVER_ORDERED | NP_HANDOVER_RECORDED | NP_HANDOVER_WAITED | (had ? 0 : NP_HANDOVER_MADE);
  } catch (const std::exception &e) {  // its error stays with torch_npu; the synchronisation orders this reuse
    // a stream torch_npu refuses events on (external: its checkNotExternalStream says so in these words;
    // isExternalStream is not exported) is left to the synchronisation from now on; any
    // other failure is a call that failed (counted as made, as the pool counts its own), this time only
    bool refused = std::strstr(e.what(), "External NPU stream") != nullptr;
    if (refused) refuse(h, recorded ? waiter : on);
    if (!ev || (refused && !recorded)) return 0;  // (refused before any call)
    // past that check: the event made first if it was not (tried), then recorded (tried once made)
    return (had ? 0 : NP_HANDOVER_MADE) | (recorded || ev->isCreated() ? NP_HANDOVER_RECORDED : 0) |
           (recorded && !refused ? NP_HANDOVER_WAITED : 0);
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
