/* backend.h -- where device memory comes from.
 *
 * A backend is a table of functions over one device. Plain allocation (malloc /
 * free) is mandatory; the virtual-memory group (reserve, release, map, unmap)
 * is present only where the vendor has it (granularity > 0), and lets an arena
 * reserve address space once and back it with physical pages as it grows.
 * Functions return NP_OK or an NP_ERR_* code after setting np_error().
 * Backends are not thread-safe by themselves: the context's mutex guards them.
 */
#ifndef NP_BACKEND_H
#define NP_BACKEND_H

#include "common.h"

typedef struct np_backend np_backend;

struct np_backend {
  const char *name;
  uint64_t total;        /* device memory in bytes */
  uint64_t granularity;  /* physical page size of map/unmap; 0 = no virtual-memory API */
  int (*malloc)(np_backend *be, uint64_t size, uintptr_t *out);
  int (*free)(np_backend *be, uintptr_t addr, uint64_t size);
  int (*reserve)(np_backend *be, uint64_t size, uintptr_t *out);
  int (*release)(np_backend *be, uintptr_t addr, uint64_t size);
  int (*map)(np_backend *be, uintptr_t addr, uint64_t size);
  int (*unmap)(np_backend *be, uintptr_t addr, uint64_t size);
  int (*synchronize)(np_backend *be, intptr_t stream); /* NP_STREAM_ANY: whole device */
  void (*hint_addr)(np_backend *be, uintptr_t addr);  /* optional: next malloc's address */
  /* optional: make `waiter` wait (on the device, no host sync) for work queued so far on `on`;
   * lets memory freed on one stream be reused on another, as cudaMallocAsync pools do */
  int (*stream_wait)(np_backend *be, intptr_t waiter, intptr_t on);
  /* optional: 1 if every piece of work queued on `stream` so far has finished, else 0 */
  int (*stream_idle)(np_backend *be, intptr_t stream);
  void (*destroy)(np_backend *be);
};

/* Create a backend for cfg->backend; NULL with np_error() set on failure. */
np_backend *np_backend_create(const np_config *cfg);

np_backend *np_backend_sim_create(const np_config *cfg);
np_backend *np_backend_acl_create(const np_config *cfg);
np_backend *np_backend_cuda_create(const np_config *cfg);

#endif
