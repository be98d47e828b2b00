/* vmm.c -- page tables of reservations over the backend's page calls (see vmm.h). */
#include <stdlib.h>

#include "vmm.h"

static uint64_t gran(const np_ctx *ctx) { return ctx->be->granularity; }

static int enter(np_ctx *ctx, int *prev) {
  *prev = -1;
  return ctx->be->enter ? ctx->be->enter(ctx->be, prev) : NP_OK;
}

static void leave(np_ctx *ctx, int prev) {
  if (ctx->be->leave) ctx->be->leave(ctx->be, prev);
}

int np_vmm_reserve(np_ctx *ctx, uint64_t size, uintptr_t *addr, uint64_t **pages) {
  np_backend *be = ctx->be;
  if (!be->granularity || !be->reserve)
    return np_error(NP_ERR_STATE, "backend %s has no virtual-memory API", be->name);
  if (size == 0 || size % be->granularity)
    return np_error(NP_ERR_INVALID, "reservation of %llu bytes is not a multiple of the %llu-byte page",
                    (unsigned long long)size, (unsigned long long)be->granularity);
  uint64_t *table = calloc(size / be->granularity, sizeof *table);
  if (!table)
    return np_error(NP_ERR_HOST, "host out of memory for a page table of %llu pages",
                    (unsigned long long)(size / be->granularity));
  int rc = be->reserve(be, size, addr);
  if (rc != NP_OK) {
    free(table);
    return rc;
  }
  *pages = table;
  return NP_OK;
}

/* Return a physical page no longer mapped; one the device refuses is held. */
static void release_page(np_ctx *ctx, uint64_t handle) {
  if (ctx->be->page_release(ctx->be, handle) != NP_OK) np_ctx_hold(ctx, NP_HELD_PAGE, 0, gran(ctx), handle, NULL);
}

/* Undo mapped pages [p, q) of seg that never became usable (access failed): unmapped again, or
 * held while still mapped (never handed out: the page table says unmapped). Nothing was
 * accounted for them yet. */
static void drop_fresh(np_ctx *ctx, np_segment *seg, uint64_t p, uint64_t q) {
  np_saved_error s;
  np_save_error(&s, NP_ERR_BACKEND);
  for (uint64_t k = p; k < q; k++) {
    uintptr_t va = seg->addr + k * gran(ctx);
    if (ctx->be->page_unmap(ctx->be, va) == NP_OK) release_page(ctx, seg->pages[k]);
    else np_ctx_hold(ctx, NP_HELD_PAGE, va, gran(ctx), seg->pages[k], NULL);
    seg->pages[k] = 0;
  }
  np_restore_error(&s);
}

int np_vmm_map(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole) {
  np_backend *be = ctx->be;
  uint64_t g = gran(ctx);
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr + g - 1) / g;
  uint8_t *fresh = whole ? calloc(end - first, 1) : NULL; /* pages this call mapped */
  if (whole && !fresh) return np_error(NP_ERR_HOST, "host out of memory mapping %llu pages", (unsigned long long)(end - first));
  int prev, rc = enter(ctx, &prev);
  for (uint64_t p = first; p < end && rc == NP_OK;) {
    if (seg->pages[p]) {
      p++;
      continue;
    }
    uint64_t q = p;
    for (; q < end && !seg->pages[q]; q++) {
      uint64_t h = 0;
      rc = be->page_create(be, &h);
      if (rc != NP_OK) break;
      rc = be->page_map(be, seg->addr + q * g, h);
      if (rc != NP_OK) {
        np_saved_error s;
        np_save_error(&s, rc);
        release_page(ctx, h);
        np_restore_error(&s);
        break;
      }
      seg->pages[q] = h;
      if (fresh) fresh[q - first] = 1;
    }
    if (q > p && be->page_access) {
      int arc = be->page_access(be, seg->addr + p * g, (q - p) * g);
      if (arc != NP_OK) {
        drop_fresh(ctx, seg, p, q);
        rc = arc;
        break;
      }
    }
    if (q > p) np_ctx_reserved(ctx, NP_EV_SEGMENT_MAP, seg, seg->addr + p * g, (q - p) * g);
    p = q;
  }
  leave(ctx, prev);
  if (rc != NP_OK && fresh) { /* as it was: unmap what this call mapped */
    np_saved_error s;
    np_save_error(&s, rc);
    for (uint64_t p = first; p < end; p++)
      if (fresh[p - first]) np_vmm_unmap(ctx, seg, seg->addr + p * g, g, true);
    np_restore_error(&s);
  }
  free(fresh);
  return rc;
}

int np_vmm_unmap(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole) {
  uint64_t g = gran(ctx);
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr) / g;
  np_saved_error s = {0};
  int prev, rc = enter(ctx, &prev);
  if (rc != NP_OK) return rc;
  for (uint64_t p = first; p < end; p++) {
    if (!seg->pages[p]) continue;
    uint64_t q = p; /* a run of mapped pages, unmapped page by page */
    for (; q < end && seg->pages[q]; q++) {
      int urc = ctx->be->page_unmap(ctx->be, seg->addr + q * g);
      if (urc != NP_OK) { /* still mapped: the next release tries it again */
        if (rc == NP_OK) np_save_error(&s, rc = urc);
        if (whole) { /* ... held, out of the page table: the range counts as unmapped */
          np_ctx_hold(ctx, NP_HELD_PAGE, seg->addr + q * g, g, seg->pages[q], seg);
          seg->pages[q] = 0;
        }
        break;
      }
      uint64_t h = seg->pages[q];
      seg->pages[q] = 0;
      release_page(ctx, h);
    }
    if (q > p) np_ctx_reserved(ctx, NP_EV_SEGMENT_UNMAP, seg, seg->addr + p * g, (q - p) * g);
    p = q; /* the loop steps over q: unmapped, or refused */
  }
  leave(ctx, prev);
  return rc == NP_OK ? NP_OK : np_restore_error(&s);
}

void np_vmm_release(np_ctx *ctx, np_segment *seg) {
  if (seg->mapped) np_vmm_unmap(ctx, seg, seg->addr, seg->size, true); /* what refuses is held */
  if (ctx->be->release(ctx->be, seg->addr, seg->size) != NP_OK)
    np_ctx_hold(ctx, NP_HELD_RESERVATION, seg->addr, seg->size, 0, NULL);
  free(seg->pages);
  seg->pages = NULL;
}

uint64_t np_vmm_unmapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size) {
  uint64_t g = gran(ctx), n = 0;
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr + g - 1) / g;
  for (uint64_t p = first; p < end; p++) n += !seg->pages[p];
  return n * g;
}

bool np_vmm_page_mapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr) {
  return seg->pages[(addr - seg->addr) / gran(ctx)] != 0;
}
