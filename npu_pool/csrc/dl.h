/* dl.h -- what the vendor backends (acl, cuda) share: loading a vendor library
 * at run time, binding its symbols into a table of function pointers, and the
 * page table that lets any page-aligned sub-range of a mapping be unmapped.
 *
 * Nothing here links against a vendor: libraries are dlopen'ed by name (or by
 * the np_config.lib_path override) and every failure is an NP_ERR_* code with
 * np_error() naming the library, the symbol or the vendor call.
 */
#ifndef NP_DL_H
#define NP_DL_H

#include "common.h"

/* ---- libraries and symbols ------------------------------------------------ */

enum { NP_DL_REQUIRED = 0, NP_DL_OPTIONAL = 1, NP_DL_VMM = 2 };

/* One symbol to bind: its name, where its pointer goes in the api table, and its
 * group (required, optional, or part of the all-or-nothing virtual-memory group). */
typedef struct np_dl_sym {
  const char *name;
  size_t offset;
  int group;
} np_dl_sym;

/* Entry for a table whose fields are named after the vendor functions. */
#define NP_DL_SYM(api_t, fn, group) {#fn, offsetof(api_t, fn), group}

/* Open `override` if set, else the first of the NULL-terminated `names` that loads.
 * `what` names the library in the error ("the Ascend runtime (ACL)"). */
void *np_dl_open(const char *override, const char *const *names, const char *what);
void np_dl_close(void *lib);
/* The path a handle was loaded from (for messages); "?" if unknown. */
const char *np_dl_path(void *lib, char *buf, size_t len);

/* Bind every symbol of `syms` into `api`. A missing required symbol is an error;
 * a missing optional one stays NULL; a missing VMM symbol clears the whole VMM
 * group and writes its name to `vmm_missing` (if not NULL; "" when complete). */
int np_dl_bind(void *lib, const char *libname, const np_dl_sym *syms, size_t n, void *api, char *vmm_missing,
               size_t missing_len);

/* ---- page table of vendor virtual memory ---------------------------------- */

/* Vendor calls on one page of `page` bytes; each returns NP_OK or NP_ERR_*. */
typedef struct np_vmm_ops {
  int (*create)(void *be, uint64_t *handle);               /* allocate one physical page */
  int (*release)(void *be, uint64_t handle);               /* free it (unmapped) */
  int (*map)(void *be, uintptr_t va, uint64_t handle);     /* map it at va */
  int (*unmap)(void *be, uintptr_t va);                    /* unmap the page at va */
  int (*access)(void *be, uintptr_t va, uint64_t size);    /* optional: enable access to a mapped run */
} np_vmm_ops;

/* A reserved address range and the physical handle behind each of its pages.
 * Invariant: handles[i] != 0 exactly when page i is mapped (vendors never hand
 * out handle 0); mapped_bytes = page x (number of non-zero handles, all ranges). */
typedef struct np_vrange {
  uintptr_t addr;
  uint64_t size;
  uint64_t *handles;
} np_vrange;

/* Every reservation of one backend, sorted by address and pairwise disjoint. */
typedef struct np_vmm {
  uint64_t page;
  const np_vmm_ops *ops;
  void *be;
  np_vrange *ranges;
  size_t n, cap;
  uint64_t mapped_bytes;
  uint64_t leaked;          /* pages whose release failed after a successful unmap */
} np_vmm;

void np_vmm_init(np_vmm *v, uint64_t page, const np_vmm_ops *ops, void *be);
/* Track a range the vendor has just reserved. */
int np_vmm_add(np_vmm *v, uintptr_t addr, uint64_t size);
/* Stop tracking a range before the vendor releases it; unmaps what is still mapped. */
int np_vmm_remove(np_vmm *v, uintptr_t addr, uint64_t size);
/* Map fresh pages under [addr, addr+size) (page-aligned, inside one range, all
 * unmapped). All or nothing: on failure no page of the call stays mapped. */
int np_vmm_map(np_vmm *v, uintptr_t addr, uint64_t size);
/* Unmap the mapped pages [addr, addr+size) and release their handles. On a vendor
 * failure the pages unmapped so far are mapped back, so the range stays whole. */
int np_vmm_unmap(np_vmm *v, uintptr_t addr, uint64_t size);
/* Free the tables; every range must have been removed (the backend releases them). */
void np_vmm_destroy(np_vmm *v);

#endif
