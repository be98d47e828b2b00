/* backend.h -- where device memory comes from: a thin table of vendor calls over one device.
 *
 * Plain allocation (malloc / free) is mandatory. The virtual-memory group is present only
 * where the vendor has it (granularity > 0): reserve / release an address range, and the
 * calls on one physical chunk of a multiple of `granularity` bytes (create, map at an
 * address, unmap, release). A chunk is mapped whole and unmapped whole: the vendors unmap
 * whole mappings only (aclrtUnmapMem takes no size; cuMemUnmap of part of a mapping is
 * refused), and the simulated device refuses what they refuse. Everything above one chunk --
 * which chunks of a reservation are mapped, what failed and is still held -- is the core's
 * VMM layer (vmm.h), the same for every vendor.
 *
 * Every device call of the vocabulary (NP_CALL_*: memory, synchronisation, events, device
 * queries) is counted in `calls` at the one place it is made, failed calls too, so the counts
 * equal the vendor's own; the backups' copies and pinned host memory are not device calls. Vendor rules stay here: `request_align` /
 * `request_tail` pad every request (Ascend kernels may touch 32 bytes past a tensor: round up
 * to 32, add 32).
 *
 * Functions return NP_OK or an NP_ERR_* code after setting np_error(). A call that fails
 * changed nothing on the device (the vendors' contract; a page whose unmap failed is still
 * mapped). Page calls assume the backend's device is current: the VMM layer brackets them
 * with enter/leave (optional). Backends are not thread-safe by themselves: the context's
 * mutex guards them.
 */
#ifndef NP_BACKEND_H
#define NP_BACKEND_H

#include "common.h"

typedef struct np_backend np_backend;

struct np_backend {
  const char *name;
  uint64_t total;          /* device memory in bytes */
  uint64_t granularity;    /* physical page size of the page calls; 0 = no virtual-memory API */
  uint32_t request_align;  /* requests round up to a multiple of this (0: no rule) */
  uint32_t request_tail;   /* ... and get this many bytes more */
  bool simulated;          /* the simulated device: it counts what the rules' vendor would be called for */
  bool no_lookups;         /* simulated for a framework's own allocator (np_policy.framework): no device lookup */
  bool free_synchronizes;  /* `free` waits for the device by itself (cudaFree); otherwise (aclrtFree) the
                            * caller synchronises the device once before the frees of one call (memory.c) */
  uint64_t calls[NP_CALL_COUNT]; /* vendor calls made, by kind */
  int (*malloc)(np_backend *be, uint64_t size, uintptr_t *out);
  int (*free)(np_backend *be, uintptr_t addr, uint64_t size);
  int (*reserve)(np_backend *be, uint64_t size, uintptr_t *out);
  int (*release)(np_backend *be, uintptr_t addr, uint64_t size);
  /* a physical chunk of `size` bytes (a multiple of the granularity); handles are never 0 */
  int (*page_create)(np_backend *be, uint64_t size, uint64_t *handle);
  int (*page_release)(np_backend *be, uint64_t handle, uint64_t size);
  int (*page_map)(np_backend *be, uintptr_t va, uint64_t size, uint64_t handle); /* the whole chunk at va */
  int (*page_unmap)(np_backend *be, uintptr_t va, uint64_t size);               /* the whole mapping at va */
  int (*page_access)(np_backend *be, uintptr_t va, uint64_t size); /* optional: enable access to a mapped chunk */
  int (*enter)(np_backend *be, int *prev);                          /* optional: make the device current */
  void (*leave)(np_backend *be, int prev);
  int (*synchronize)(np_backend *be, intptr_t stream);              /* NP_STREAM_ANY: whole device */
  void (*hint_addr)(np_backend *be, uintptr_t addr);                /* optional: next malloc's address */
  /* optional: make `waiter` wait (on the device, no host sync) for work queued so far on `on`;
   * lets memory freed on one stream be reused on another, as cudaMallocAsync pools do */
  int (*stream_wait)(np_backend *be, intptr_t waiter, intptr_t on);
  /* optional: 1 if every piece of work queued on `stream` so far has finished, else 0 */
  int (*stream_idle)(np_backend *be, intptr_t stream);
  /* free the backend (its device memory was returned first); NP_OK, or the error of a vendor
   * object the device refused to destroy (reported, not retried: the backend is gone) */
  int (*destroy)(np_backend *be);
  /* optional, backups of paused tags: copy `size` bytes between device and host memory
   * (to_device 0: device -> host), synchronously; pinned host memory for such copies */
  int (*copy)(np_backend *be, void *dst, const void *src, uint64_t size, int to_device);
  int (*host_alloc)(np_backend *be, uint64_t size, void **out);
  void (*host_free)(np_backend *be, void *p);
  /* the device's free bytes now (a call, counted: for an out-of-memory message, not per request) */
  int (*free_bytes)(np_backend *be, uint64_t *out);
};

/* The current device of the calling thread as the vendor backends last saw or set it (-1:
 * unknown), kept per thread as torch_npu keeps it, so a request costs no aclrtGetDevice.
 * Forgotten in a forked child (np_device_cache_get answers -1 there) and by np_device_cache_set(-1).
 * A device made current behind the cache's back (a raw vendor call) is seen at the next
 * request of that thread that makes a device call only if the caller forgets the cache. */
int np_device_cache_get(void);
void np_device_cache_set(int device);
/* The same, as the simulated backend counts it (kept apart from the vendors'); np_forget_device
 * and a fork forget both. */
int np_sim_device_cache_get(void);
void np_sim_device_cache_set(int device);

/* Create a backend for cfg->backend; NULL with np_error() set on failure. */
np_backend *np_backend_create(const np_config *cfg);

np_backend *np_backend_sim_create(const np_config *cfg);
np_backend *np_backend_acl_create(const np_config *cfg);
void np_acl_set_framework_sync(int (*fn)(void)); /* npu_pool_set_framework_sync (pluggable.h) */
void np_acl_set_framework_stream_wait(int (*fn)(int, void *, void *)); /* npu_pool_set_framework_stream_wait */
/* Load and bind the vendor library a context of `backend` would use (lib_path: np_config's),
 * without a device call: a wrong library is found when the pool is configured, not at the
 * first allocation. NP_OK for the simulator. */
int np_backend_load(int backend, const char *lib_path);
int np_backend_acl_load(const char *lib_path);
int np_backend_cuda_load(const char *lib_path);
np_backend *np_backend_cuda_create(const np_config *cfg);

#endif
