/* pluggable.h -- the plain C entry points that torch's pluggable allocators call
 * (torch.cuda.memory.CUDAPluggableAllocator, torch_npu's NPUPluggableAllocator),
 * exported from the same shared object as the core.
 *
 * One context per device, created on first use from the configuration set by
 * npu_pool_configure() (npu_pool.install() does it before torch calls in). The
 * hooks cannot report errors to torch: a failed malloc returns NULL, every
 * failure is kept per device for npu_pool_last_error() and printed to stderr once
 * (a failure repeated with nothing served in between is not printed again; with
 * npu_pool_set_quiet(1) malloc failures are not printed at all: the caller raises
 * them, as npu_pool's C++ hooks do, as torch.OutOfMemoryError). After a request failed
 * for lack of memory the OOM handler, if one is set, is called outside every lock of the pool.
 * Everything here is thread-safe.
 */
#ifndef NP_PLUGGABLE_H
#define NP_PLUGGABLE_H

#include <stdbool.h>
#include <stddef.h>

#include "npu_pool.h"

/* CDEF BEGIN */
#define NP_MAX_DEVICES 64 /* devices a process's table holds (and a pool's device index is below) */
/* Configuration of the contexts still to be created (policy index, NP_BACKEND_*, fraction in
 * (0, 1], vmm 0/1, lib_path NULL for the vendor's default library, which is loaded here: one
 * that cannot be is an error now, not at the first allocation). NP_ERR_STATE once a context
 * exists, unless the configuration is unchanged. */
int npu_pool_configure(int policy, int backend, double fraction, int vmm, const char *lib_path);
/* The context of `device`, created on first use; NULL with np_last_error() set. */
np_ctx *npu_pool_device_ctx(int device);
/* The context of `device` if it exists (no creation); NULL otherwise. */
np_ctx *npu_pool_existing_ctx(int device);
/* Cap `device` at fraction x its memory (pending until its context exists). */
int npu_pool_set_fraction(int device, double fraction);
/* Keep `max_entries` events of history on `device` (-1: every device), now or when created. */
int npu_pool_set_history(int device, uint64_t max_entries);
/* Compaction (np_set_compaction) on `device` (-1: every device), now or when its context is made. */
int npu_pool_set_compaction(int device, int on);
/* The statistics of `device`: zeros (with the policy's pool names) before its first allocation. */
int npu_pool_device_stats(int device, np_stats *out);
/* Zero the accumulated figures of `device`. */
void npu_pool_reset_accumulated(int device);
/* Copy the last failure message of `device` (another thread's, if it failed last) or, with
 * device < 0, the calling thread's own (np_last_error(), with the notes its OOM handler added)
 * into buf; returns its length. */
size_t npu_pool_last_error(int device, char *buf, size_t len);
/* The NP_ERR_* code of the calling thread's latest failure (a hook that got NULL tells an
 * out-of-memory from a refusal with it). */
int npu_pool_last_code(void);
/* Add a line to `device`'s last failure message (an OOM handler's note: where its snapshot went);
 * called from the handler of a failed npu_pool_malloc, to that thread's message too. */
void npu_pool_note_error(int device, const char *note);
/* 1: failed mallocs are not printed (the caller reports them). */
void npu_pool_set_quiet(int quiet);
/* Where the policy and the fraction came from, e.g. "NPU_POOL_POLICY='expandable'" (NULL or "":
 * nowhere to name): a context whose creation fails says "(npu_pool was configured by ...)", the
 * fraction's only where no other cap was set for that device (npu_pool_set_fraction). */
void npu_pool_set_origin(const char *policy, const char *fraction);
/* Called after a request failed for lack of memory (NULL: none). */
void npu_pool_set_oom_handler(void (*handler)(int device, uint64_t size, void *stream));
/* The number of devices torch sees (npu_pool.install() and the init hook set it): statistics of
 * a device outside 0..count-1 fail with "Invalid device argument", as torch's own allocators say. */
void npu_pool_set_device_count(int count);
/* Close every context and forget the configuration: for tests and embedders, never while
 * torch holds memory from this allocator. A hook still running on a closed context fails
 * cleanly (NULL / a kept error): the closed structs are kept, never freed. */
void npu_pool_shutdown(void);

/* ---- torch hooks (signatures as torch 2.13 / torch_npu 2.13 declare them) ------ */

/* alloc_fn: void*(size_t size, int device, cudaStream_t / aclrtStream stream) */
void *npu_pool_malloc(size_t size, int device, void *stream);
/* free_fn: void(void* ptr, size_t size, int device, stream) */
void npu_pool_free(void *ptr, size_t size, int device, void *stream);
/* set_init_fn: void(int device_count) */
void npu_pool_init(int device_count);
/* set_reset_fn (CUDA, torch.cuda.empty_cache): void() */
void npu_pool_empty_cache(void);
/* set_reset_fn (torch_npu, torch.npu.empty_cache): void(bool check_error) */
void npu_pool_empty_cache_checked(bool check_error);
/* set_memory_fraction_fn: void(double fraction, int device) */
void npu_pool_memory_fraction(double fraction, int device);
/* set_reset_peak_status_fn (torch_npu): void(c10::DeviceIndex device) */
void npu_pool_reset_peak(int8_t device);
/* set_record_stream_fn (CUDA): void(void* ptr, cudaStream_t stream); torch_npu's passes an
 * NPUStream, which npu_pool's C++ hooks turn into its aclrtStream before calling this. */
void npu_pool_record_stream(void *ptr, void *stream);
/* Inside torch_npu, its task queue: an op's work reaches the device when torch_npu's own thread
 * launches it, so a synchronisation straight through ACL does not wait for work still queued
 * (memory unmapped under it: a fault on the device). `fn` (the C++ hooks' c10_npu::
 * npuSynchronizeDevice: the queue emptied, then the device synchronised; 0 when it succeeded)
 * replaces the ACL backend's device synchronisation from then on, for every device; NULL: ACL's own. */
void npu_pool_set_framework_sync(int (*fn)(void));
/* ... and its handover between streams, where that synchronisation is bound: `fn(device, waiter,
 * on)` (the C++ hooks: torch_npu's NPUEvent recorded on `on` and waited by `waiter`, both through
 * its queue) makes `waiter` wait on the device for the work queued so far on `on`, and returns
 * NP_HANDOVER_* bits (npu_pool.h): ORDERED when the reuse is ordered, and the calls it made for
 * it (failed ones too, as the pool counts its own); without ORDERED (a stream it does not know,
 * one the framework refused, a call that failed) the framework's synchronisation orders the
 * reuse. NULL: a synchronisation each. */
void npu_pool_set_framework_stream_wait(int (*fn)(int device, void *waiter, void *on));
/* CDEF END */

/* fork.c's handlers: take the table's lock before fork(), release it after (parent and child). */
void np_pluggable_fork_lock(void);
void np_pluggable_fork_unlock(void);

#endif
