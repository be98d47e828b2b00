/* memory.c -- the device memory a context holds: segments, the one accounting path for
 * reserved bytes, and memory whose return the device refused (held and retried). */
#include <stdio.h>
#include <stdlib.h>

#include "vmm.h"

/* ---- reserved bytes: every change goes through here ------------------------------------- */

static void change_reserved(np_ctx *ctx, int pool, uint64_t bytes, bool add) {
  np_counter *c[2] = {&ctx->st.total.reserved, pool >= 0 && pool < NP_POOLS ? &ctx->st.pool[pool].reserved : NULL};
  for (int i = 0; i < 2; i++) {
    if (!c[i]) continue;
    if (add) np_counter_add(c[i], bytes);
    else np_counter_sub(c[i], bytes);
  }
}

void np_ctx_reserved(np_ctx *ctx, int action, np_segment *seg, uintptr_t addr, uint64_t bytes) {
  bool add = action == NP_EV_SEGMENT_ALLOC || action == NP_EV_SEGMENT_MAP;
  change_reserved(ctx, seg->pool, bytes, add);
  if (add) {
    seg->mapped += bytes;
    ctx->st.device_mallocs++;
  } else {
    NP_ASSERT(seg->mapped >= bytes);
    seg->mapped -= bytes;
    ctx->st.device_frees++;
  }
  np_ctx_record(ctx, action, addr, bytes, seg->stream, -1, seg->pool, 0);
}

/* ---- held memory ------------------------------------------------------------------------- */

void np_ctx_hold(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, uint64_t handle, np_segment *from) {
  int pool = from ? from->pool : NP_POOL_SHARED;
  ctx->holds++;
  snprintf(ctx->hold_error, sizeof ctx->hold_error, "%s", np_last_error()); /* the vendor's reason */
  bool memory = kind != NP_HELD_RESERVATION; /* a reservation is address space, not device memory */
  if (memory && from) {
    NP_ASSERT(from->mapped >= size);
    from->mapped -= size; /* stays reserved: now counted as held */
  } else if (memory) {
    change_reserved(ctx, pool, size, true);
  }
  if (memory) ctx->st.unreleased += size;
  if (ctx->n_held == ctx->cap_held) {
    size_t cap = ctx->cap_held ? 2 * ctx->cap_held : 16;
    np_held *h = realloc(ctx->held, cap * sizeof *h);
    if (!h) return; /* the bytes stay counted as unreleased; only their retry is lost */
    ctx->held = h;
    ctx->cap_held = cap;
  }
  ctx->held[ctx->n_held++] = (np_held){kind, pool, addr, size, handle};
}

/* Try to return one held item; NP_OK when it is gone. */
static int retry_one(np_ctx *ctx, np_held *h) {
  np_backend *be = ctx->be;
  int rc, prev = -1;
  switch (h->kind) {
    case NP_HELD_SEGMENT:
      rc = be->free(be, h->addr, h->size);
      if (rc == NP_OK) {
        ctx->st.device_frees++;
        np_ctx_record(ctx, NP_EV_SEGMENT_FREE, h->addr, h->size, 0, -1, h->pool, 0);
      }
      return rc;
    case NP_HELD_PAGE:
      rc = be->enter ? be->enter(be, &prev) : NP_OK;
      if (rc == NP_OK && h->addr) {
        rc = be->page_unmap(be, h->addr);
        if (rc == NP_OK) h->addr = 0;
      }
      if (rc == NP_OK) rc = be->page_release(be, h->handle);
      if (be->leave) be->leave(be, prev);
      return rc;
    default:
      return be->release(be, h->addr, h->size);
  }
}

static int still_held(np_ctx *ctx, int code, const char *why) {
  char a[32];
  return np_error(code, "the device still holds %s this pool could not return (retried at every empty_cache "
                  "and at close): %s", np_fmt_bytes(ctx->st.unreleased, a), why);
}

int np_ctx_retry_held(np_ctx *ctx) {
  int first = NP_OK;
  np_saved_error s = {0};
  /* pages before reservations: a reservation is released only once nothing is mapped in it */
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < ctx->n_held;) {
      np_held *h = &ctx->held[i];
      if ((h->kind == NP_HELD_RESERVATION) != (pass == 1)) {
        i++;
        continue;
      }
      int rc = retry_one(ctx, h);
      if (rc != NP_OK) {
        if (first == NP_OK) np_save_error(&s, first = rc);
        i++;
        continue;
      }
      if (h->kind != NP_HELD_RESERVATION) {
        change_reserved(ctx, h->pool, h->size, false);
        ctx->st.unreleased -= h->size;
      }
      ctx->held[i] = ctx->held[--ctx->n_held];
    }
  }
  if (first == NP_OK) return NP_OK;
  return still_held(ctx, first, s.text);
}

int np_ctx_new_holds(np_ctx *ctx, uint64_t holds_before) {
  return ctx->holds == holds_before ? NP_OK : still_held(ctx, NP_ERR_BACKEND, ctx->hold_error);
}

/* ---- segments ------------------------------------------------------------------------------ */

int np_segment_create(np_ctx *ctx, uint64_t size, intptr_t stream, int pool, bool reserve_only, np_segment **out) {
  uintptr_t addr = 0;
  uint64_t *pages = NULL;
  int rc;
  *out = NULL;
  if (reserve_only) {
    rc = np_vmm_reserve(ctx, size, &addr, &pages);
    if (rc != NP_OK) return rc;
  } else {
    if (size > ctx->limit || ctx->st.total.reserved.current > ctx->limit - size) {
      char a[32], b[32];
      return np_error(NP_ERR_OOM, "reserving %s more would exceed the memory fraction cap of %s",
                      np_fmt_bytes(size, a), np_fmt_bytes(ctx->limit, b));
    }
    rc = ctx->be->malloc(ctx->be, size, &addr);
    if (rc != NP_OK) return rc;
  }
  np_segment *seg = calloc(1, sizeof *seg);
  np_block *b = seg ? np_block_new(&ctx->blocks) : NULL;
  if (!b) {
    free(seg);
    free(pages);
    int frc = reserve_only ? ctx->be->release(ctx->be, addr, size) : ctx->be->free(ctx->be, addr, size);
    if (frc != NP_OK) { /* the device keeps it: hold it, counted */
      if (reserve_only) np_ctx_hold(ctx, NP_HELD_RESERVATION, addr, size, 0, NULL);
      else np_ctx_hold(ctx, NP_HELD_SEGMENT, addr, size, 0, NULL);
    }
    return np_error(NP_ERR_HOST, "host out of memory for segment bookkeeping");
  }
  *seg = (np_segment){.addr = addr, .size = size, .stream = stream, .pool = (uint8_t)pool,
                      .reserved_only = reserve_only, .head = b, .pages = pages};
  b->addr = addr;
  b->size = size;
  b->stream = stream;
  b->pool = (uint8_t)(pool < NP_POOLS ? pool : 0);
  b->seg = seg;
  b->mapped = !reserve_only;
  seg->next = ctx->segments;
  if (ctx->segments) ctx->segments->prev = seg;
  ctx->segments = seg;
  np_counter_add(&ctx->st.total.segments, 1);
  if (pool < NP_POOLS) np_counter_add(&ctx->st.pool[pool].segments, 1);
  if (!reserve_only) np_ctx_reserved(ctx, NP_EV_SEGMENT_ALLOC, seg, addr, size);
  *out = seg;
  return NP_OK;
}

void np_segment_destroy(np_ctx *ctx, np_segment *seg) {
  for (np_block *b = seg->head, *n; b; b = n) {
    NP_ASSERT(!b->allocated && !b->in_tree);
    n = b->next;
    np_block_delete(&ctx->blocks, b);
  }
  if (seg->prev) seg->prev->next = seg->next;
  else ctx->segments = seg->next;
  if (seg->next) seg->next->prev = seg->prev;
  if (seg->reserved_only) np_vmm_release(ctx, seg);
  else if (ctx->be->free(ctx->be, seg->addr, seg->size) == NP_OK)
    np_ctx_reserved(ctx, NP_EV_SEGMENT_FREE, seg, seg->addr, seg->size);
  else
    np_ctx_hold(ctx, NP_HELD_SEGMENT, seg->addr, seg->size, 0, seg);
  np_counter_sub(&ctx->st.total.segments, 1);
  if (seg->pool < NP_POOLS) np_counter_sub(&ctx->st.pool[seg->pool].segments, 1);
  free(seg);
}
