/* dl.c -- loading vendor libraries, binding their symbols, and the page table of
 * vendor virtual memory (one physical handle per page). */
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dl.h"

/* ---- libraries and symbols ------------------------------------------------ */

void *np_dl_open(const char *override, const char *const *names, const char *what) {
  if (override && *override) {
    void *lib = dlopen(override, RTLD_NOW | RTLD_LOCAL);
    if (!lib) np_error(NP_ERR_BACKEND, "cannot load %s from %s: %s", what, override, dlerror());
    return lib;
  }
  char tried[256] = "", why[512] = "";
  size_t used = 0;
  for (const char *const *n = names; *n; n++) {
    void *lib = dlopen(*n, RTLD_NOW | RTLD_LOCAL);
    if (lib) return lib;
    const char *e = dlerror();
    snprintf(why, sizeof why, "%s", e ? e : "unknown dlopen error");
    used += (size_t)snprintf(tried + used, used < sizeof tried ? sizeof tried - used : 0, "%s%s",
                             n == names ? "" : ", ", *n);
    if (used >= sizeof tried) used = sizeof tried - 1;
  }
  np_error(NP_ERR_BACKEND, "cannot load %s (tried %s): %s; is the vendor runtime installed and on LD_LIBRARY_PATH?",
           what, tried, why);
  return NULL;
}

void np_dl_close(void *lib) {
  if (lib) dlclose(lib);
}

const char *np_dl_path(void *lib, char *buf, size_t len) {
  struct link_map *map = NULL;
  if (lib && dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name)
    snprintf(buf, len, "%s", map->l_name);
  else
    snprintf(buf, len, "?");
  return buf;
}

int np_dl_bind(void *lib, const char *libname, const np_dl_sym *syms, size_t n, void *api, char *vmm_missing,
               size_t missing_len) {
  bool vmm_ok = true;
  if (vmm_missing && missing_len) vmm_missing[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    dlerror();
    void *fn = dlsym(lib, syms[i].name);
    memcpy((char *)api + syms[i].offset, &fn, sizeof fn); /* POSIX: function pointers round-trip through void* */
    if (fn) continue;
    if (syms[i].group == NP_DL_REQUIRED)
      return np_error(NP_ERR_BACKEND, "%s has no symbol %s: not the expected vendor library, or a version too old",
                      libname, syms[i].name);
    if (syms[i].group == NP_DL_VMM && vmm_ok) {
      vmm_ok = false;
      if (vmm_missing && missing_len) snprintf(vmm_missing, missing_len, "%s", syms[i].name);
    }
  }
  if (!vmm_ok) {
    void *none = NULL;
    for (size_t i = 0; i < n; i++)
      if (syms[i].group == NP_DL_VMM) memcpy((char *)api + syms[i].offset, &none, sizeof none);
  }
  return NP_OK;
}

/* ---- page table of vendor virtual memory ---------------------------------- */

/* Vendor failures inside a rollback must not replace the message of the failure
 * that caused it: save it, roll back, restore. */
typedef struct saved_error { char text[1024]; } saved_error;
static void save_error(saved_error *s) { snprintf(s->text, sizeof s->text, "%s", np_last_error()); }
static int restore_error(const saved_error *s, int code) { return np_error(code, "%s", s->text); }

void np_vmm_init(np_vmm *v, uint64_t page, const np_vmm_ops *ops, void *be) {
  memset(v, 0, sizeof *v);
  v->page = page;
  v->ops = ops;
  v->be = be;
}

/* Index of the first range whose address is > addr. */
static size_t upper(const np_vmm *v, uintptr_t addr) {
  size_t lo = 0, hi = v->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (v->ranges[mid].addr <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* The range holding [addr, addr+size) and the index of its first page. */
static int locate(np_vmm *v, uintptr_t addr, uint64_t size, const char *op, np_vrange **out, uint64_t *first) {
  if (size == 0 || addr % v->page || size % v->page)
    return np_error(NP_ERR_INVALID, "%s of [%#lx, +%llu bytes) is not aligned to the %llu-byte page", op,
                    (unsigned long)addr, (unsigned long long)size, (unsigned long long)v->page);
  size_t i = upper(v, addr);
  np_vrange *r = i ? &v->ranges[i - 1] : NULL;
  if (!r || addr - r->addr >= r->size || size > r->size - (addr - r->addr))
    return np_error(NP_ERR_INVALID, "%s of [%#lx, +%llu bytes) lies outside every reserved range", op,
                    (unsigned long)addr, (unsigned long long)size);
  *out = r;
  *first = (addr - r->addr) / v->page;
  return NP_OK;
}

int np_vmm_add(np_vmm *v, uintptr_t addr, uint64_t size) {
  if (size == 0 || addr % v->page || size % v->page)
    return np_error(NP_ERR_INVALID, "reserved range [%#lx, +%llu bytes) is not aligned to the %llu-byte page",
                    (unsigned long)addr, (unsigned long long)size, (unsigned long long)v->page);
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 8;
    np_vrange *r = realloc(v->ranges, cap * sizeof *r);
    if (!r) return np_error(NP_ERR_HOST, "host out of memory for the page table");
    v->ranges = r;
    v->cap = cap;
  }
  uint64_t *handles = calloc(size / v->page, sizeof *handles);
  if (!handles) return np_error(NP_ERR_HOST, "host out of memory for the page table");
  size_t i = upper(v, addr);
  memmove(&v->ranges[i + 1], &v->ranges[i], (v->n - i) * sizeof *v->ranges);
  v->ranges[i] = (np_vrange){addr, size, handles};
  v->n++;
  return NP_OK;
}

/* Unmap and release one page; a page whose unmap fails stays mapped and tracked. */
static void drop_page(np_vmm *v, np_vrange *r, uint64_t p) {
  if (v->ops->unmap(v->be, r->addr + p * v->page) != NP_OK) return;
  if (v->ops->release(v->be, r->handles[p]) != NP_OK) v->leaked++;
  r->handles[p] = 0;
  v->mapped_bytes -= v->page;
}

int np_vmm_remove(np_vmm *v, uintptr_t addr, uint64_t size) {
  size_t i = upper(v, addr);
  if (i == 0 || v->ranges[i - 1].addr != addr || v->ranges[i - 1].size != size)
    return np_error(NP_ERR_INVALID, "release of [%#lx, +%llu bytes), which was never reserved", (unsigned long)addr,
                    (unsigned long long)size);
  np_vrange *r = &v->ranges[i - 1];
  for (uint64_t p = 0; p < size / v->page; p++)
    if (r->handles[p]) drop_page(v, r, p);
  free(r->handles);
  memmove(r, r + 1, (v->n - i) * sizeof *r);
  v->n--;
  return NP_OK;
}

/* Undo the first `count` pages of a map call starting at page `first`. */
static void unmap_fresh(np_vmm *v, np_vrange *r, uint64_t first, uint64_t count) {
  for (uint64_t p = first; p < first + count; p++) drop_page(v, r, p);
}

int np_vmm_map(np_vmm *v, uintptr_t addr, uint64_t size) {
  np_vrange *r;
  uint64_t first, n = size / v->page, done = 0;
  int rc = locate(v, addr, size, "map", &r, &first);
  if (rc != NP_OK) return rc;
  for (uint64_t p = first; p < first + n; p++)
    if (r->handles[p])
      return np_error(NP_ERR_STATE, "map of [%#lx, +%llu bytes): the page at %#lx is already mapped",
                      (unsigned long)addr, (unsigned long long)size, (unsigned long)(r->addr + p * v->page));
  for (; done < n; done++) {
    uint64_t h = 0;
    rc = v->ops->create(v->be, &h);
    if (rc != NP_OK) break;
    rc = v->ops->map(v->be, addr + done * v->page, h);
    if (rc != NP_OK) {
      saved_error s;
      save_error(&s);
      if (v->ops->release(v->be, h) != NP_OK) v->leaked++;
      restore_error(&s, rc);
      break;
    }
    r->handles[first + done] = h;
    v->mapped_bytes += v->page;
  }
  if (rc == NP_OK && v->ops->access) rc = v->ops->access(v->be, addr, size);
  if (rc != NP_OK) {
    saved_error s;
    save_error(&s);
    unmap_fresh(v, r, first, done);
    return restore_error(&s, rc);
  }
  return NP_OK;
}

int np_vmm_unmap(np_vmm *v, uintptr_t addr, uint64_t size) {
  np_vrange *r;
  uint64_t first, n = size / v->page, done = 0;
  int rc = locate(v, addr, size, "unmap", &r, &first);
  if (rc != NP_OK) return rc;
  for (uint64_t p = first; p < first + n; p++)
    if (!r->handles[p])
      return np_error(NP_ERR_STATE, "unmap of [%#lx, +%llu bytes): the page at %#lx is not mapped",
                      (unsigned long)addr, (unsigned long long)size, (unsigned long)(r->addr + p * v->page));
  for (; done < n; done++) {
    rc = v->ops->unmap(v->be, addr + done * v->page);
    if (rc != NP_OK) break;
  }
  if (rc != NP_OK) {
    /* Map the pages unmapped so far back with their own handles: the caller
     * keeps treating the whole range as mapped, so it must be. */
    saved_error s;
    save_error(&s);
    for (uint64_t p = first; p < first + done; p++) {
      if (v->ops->map(v->be, r->addr + p * v->page, r->handles[p]) != NP_OK) {
        if (v->ops->release(v->be, r->handles[p]) != NP_OK) v->leaked++;
        r->handles[p] = 0; /* lost: the caller may fault on this page */
        v->mapped_bytes -= v->page;
      } else if (v->ops->access) {
        v->ops->access(v->be, r->addr + p * v->page, v->page);
      }
    }
    return restore_error(&s, rc);
  }
  for (uint64_t p = first; p < first + n; p++) {
    if (v->ops->release(v->be, r->handles[p]) != NP_OK) v->leaked++;
    r->handles[p] = 0;
  }
  v->mapped_bytes -= size;
  return NP_OK;
}

void np_vmm_destroy(np_vmm *v) {
  for (size_t i = 0; i < v->n; i++) free(v->ranges[i].handles);
  free(v->ranges);
  v->ranges = NULL;
  v->n = v->cap = 0;
}
