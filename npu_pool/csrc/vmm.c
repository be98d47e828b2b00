/* vmm.c -- chunks of reservations over the backend's chunk calls (see vmm.h). Nothing here
 * accounts: the range calls in memory.c do, from what these functions report. */
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "vmm.h"

static int enter(np_backend *be, int *prev) {
  *prev = -1;
  return be->enter ? be->enter(be, prev) : NP_OK;
}

static void leave(np_backend *be, int prev) {
  if (be->leave) be->leave(be, prev);
}

/* A page table of n entries: anonymous memory straight from the kernel, zero until written. Not
 * calloc: a reservation is twice the device (a simulated 1 TiB device: 8 MiB of table), of which
 * only the entries under the arena's high-water mark are ever touched; calloc would zero all of it
 * whenever it serves the table from its heap (as it does once an earlier table was freed). */
static uint64_t *table_new(uint64_t n) {
  if (n > SIZE_MAX / sizeof(uint64_t)) return NULL;
  void *t = mmap(NULL, n * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return t == MAP_FAILED ? NULL : t;
}

void np_vmm_table_free(uint64_t *table, uint64_t n) {
  if (table) munmap(table, n * sizeof(uint64_t));
}

int np_vmm_reserve(np_ctx *ctx, uint64_t size, uintptr_t *addr, uint64_t **pages) {
  np_backend *be = ctx->be;
  if (!be->granularity || !be->reserve)
    return np_error(NP_ERR_STATE, "backend %s has no virtual-memory API", be->name);
  if (size == 0 || size % be->granularity)
    return np_error(NP_ERR_INVALID, "reservation of %llu bytes is not a multiple of the %llu-byte page",
                    (unsigned long long)size, (unsigned long long)be->granularity);
  uint64_t *table = table_new(size / be->granularity);
  if (!table)
    return np_error(NP_ERR_HOST, "host out of memory for a page table of %llu pages",
                    (unsigned long long)(size / be->granularity));
  int rc = be->reserve(be, size, addr);
  if (rc != NP_OK) {
    np_vmm_table_free(table, size / be->granularity);
    return rc;
  }
  *pages = table;
  return NP_OK;
}

/* Release a handle no longer mapped; one the device refuses goes to *left. */
static void release_handle(np_backend *be, uint64_t handle, uint64_t size, np_vmm_left *left) {
  if (be->page_release(be, handle, size) != NP_OK) *left = (np_vmm_left){0, size, handle};
}

int np_vmm_chunk_map(np_backend *be, np_segment *seg, uint64_t first, uint64_t n, uint64_t spare, np_vmm_left *left) {
  uint64_t g = be->granularity, size = n * g, h = spare;
  uintptr_t va = seg->addr + first * g;
  *left = (np_vmm_left){0};
  NP_ASSERT(n > 0 && (first + n) * g <= seg->size);
  int prev, rc = enter(be, &prev);
  if (rc != NP_OK) {
    if (h) *left = (np_vmm_left){0, size, h}; /* the spare, unmapped and not released: the caller holds it */
    return rc;
  }
  bool mapped = false;
  if (!h) rc = be->page_create(be, size, &h);
  if (rc == NP_OK) mapped = (rc = be->page_map(be, va, size, h)) == NP_OK;
  if (rc == NP_OK && be->page_access) rc = be->page_access(be, va, size);
  if (rc == NP_OK) {
    for (uint64_t p = first; p < first + n; p++) seg->pages[p] = h;
  } else if (h) { /* undo what was done, keeping the first failure's message */
    np_saved_error s;
    np_save_error(&s, rc);
    if (mapped && be->page_unmap(be, va, size) != NP_OK) *left = (np_vmm_left){va, size, h};
    else release_handle(be, h, size, left);
    np_restore_error(&s);
  }
  leave(be, prev);
  return rc;
}

void np_vmm_chunk_at(const np_backend *be, const np_segment *seg, uint64_t p, uint64_t *first, uint64_t *n) {
  uint64_t h = seg->pages[p], pages = seg->size / be->granularity, a = p, b = p + 1;
  NP_ASSERT(h != 0);
  while (a > 0 && seg->pages[a - 1] == h) a--;
  while (b < pages && seg->pages[b] == h) b++;
  *first = a;
  *n = b - a;
}

int np_vmm_chunk_unmap(np_backend *be, np_segment *seg, uint64_t first, bool forget, uint64_t *keep, np_vmm_left *left) {
  uint64_t f, n, g = be->granularity, h = seg->pages[first];
  *left = (np_vmm_left){0};
  np_vmm_chunk_at(be, seg, first, &f, &n);
  NP_ASSERT(f == first);
  uintptr_t va = seg->addr + first * g;
  int prev, rc = enter(be, &prev);
  if (rc == NP_OK) rc = be->page_unmap(be, va, n * g);
  if (rc == NP_OK || forget)
    for (uint64_t p = first; p < first + n; p++) seg->pages[p] = 0;
  if (rc == NP_OK && keep) *keep = h;
  else if (rc == NP_OK) release_handle(be, h, n * g, left);
  else if (forget) *left = (np_vmm_left){va, n * g, h};
  leave(be, prev);
  return rc;
}

int np_vmm_chunk_return(np_backend *be, np_vmm_left *left) {
  int prev, rc = enter(be, &prev);
  if (rc == NP_OK && left->addr) {
    rc = be->page_unmap(be, left->addr, left->size);
    if (rc == NP_OK) left->addr = 0;
  }
  if (rc == NP_OK) rc = be->page_release(be, left->handle, left->size);
  leave(be, prev);
  return rc;
}

uint64_t np_vmm_whole_chunks(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size) {
  uint64_t g = ctx->be->granularity, pages = seg->size / g, bytes = 0;
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr) / g; /* as np_vmm_unmap */
  /* each run of one handle in the range is a chunk, whole unless it goes on past either end (the
   * range's pages only are read: a stats call costs the free pages, not the chunks around them) */
  for (uint64_t p = first; p < end && seg->mapped;) {
    uint64_t h = seg->pages[p], q = p + 1;
    while (q < end && seg->pages[q] == h) q++;
    if (h && !(p == first && p > 0 && seg->pages[p - 1] == h) && !(q == end && q < pages && seg->pages[q] == h))
      bytes += (q - p) * g;
    p = q;
  }
  return bytes;
}

uint64_t np_vmm_unmapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size) {
  uint64_t g = ctx->be->granularity, n = 0;
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr + g - 1) / g;
  for (uint64_t p = first; p < end; p++) n += !seg->pages[p];
  return n * g;
}
