/* pluggable.h -- the plain C entry points that torch's pluggable allocators call
 * (torch.cuda.memory.CUDAPluggableAllocator, torch_npu's NPUPluggableAllocator),
 * exported from the same shared object as the core.
 *
 * One context per device, created on first use from the configuration set by
 * npu_pool_configure() (npu_pool.install() does it before torch calls in). The
 * hooks cannot report errors to torch: a failed malloc returns NULL, every
 * failure prints one line to stderr and is kept per device for
 * npu_pool_last_error(). Everything here is thread-safe.
 */
#ifndef NP_PLUGGABLE_H
#define NP_PLUGGABLE_H

#include <stdbool.h>
#include <stddef.h>

#include "npu_pool.h"

#define NP_MAX_DEVICES 64

/* Configuration of the contexts still to be created (NP_POLICY_*, NP_BACKEND_*,
 * fraction in (0, 1], vmm 0/1, lib_path NULL for the vendor's default library).
 * NP_ERR_STATE once a context exists, unless the configuration is unchanged. */
int npu_pool_configure(int policy, int backend, double fraction, int vmm, const char *lib_path);
/* The context of `device`, created on first use; NULL with np_last_error() set. */
np_ctx *npu_pool_device_ctx(int device);
/* Cap `device` at fraction x its memory (pending until its context exists). */
int npu_pool_set_fraction(int device, double fraction);
/* Copy the last failure message of `device` (device < 0: the calling thread's
 * np_last_error()) into buf; returns its length. */
size_t npu_pool_last_error(int device, char *buf, size_t len);
/* Destroy every context and forget the configuration: for tests and embedders,
 * never while torch holds memory from this allocator. */
void npu_pool_shutdown(void);

/* ---- torch hooks (signatures as torch 2.13 / torch_npu declare them) ------ */

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
/* set_reset_peak_status_fn (torch_npu only): void(int device) */
void npu_pool_reset_peak(int device);
/* set_record_stream_fn (CUDA): void(void* ptr, cudaStream_t stream) */
void npu_pool_record_stream(void *ptr, void *stream);

#endif
