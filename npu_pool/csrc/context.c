/* context.c -- context internals: segments, accounting, malloc/free around the policy. */
#include <stdio.h>
#include <stdlib.h>

#include "context.h"

int np_segment_create(np_ctx *ctx, uint64_t size, intptr_t stream, int pool, bool reserve_only, np_segment **out) {
  uintptr_t addr = 0;
  int rc;
  *out = NULL;
  if (reserve_only) {
    rc = ctx->be->reserve(ctx->be, size, &addr);
    if (rc != NP_OK) return rc;
  } else {
    if (size > ctx->limit || ctx->st.total.reserved.current > ctx->limit - size) {
      char a[32], b[32];
      return np_error(NP_ERR_OOM, "reserving %s more would exceed the memory fraction cap of %s",
                      np_fmt_bytes(size, a), np_fmt_bytes(ctx->limit, b));
    }
    rc = ctx->be->malloc(ctx->be, size, &addr);
    if (rc != NP_OK) return rc;
    ctx->st.device_mallocs++;
  }
  np_segment *seg = calloc(1, sizeof *seg);
  np_block *b = seg ? np_block_new(&ctx->blocks) : NULL;
  if (!b) {
    free(seg);
    if (reserve_only) ctx->be->release(ctx->be, addr, size);
    else ctx->be->free(ctx->be, addr, size);
    return np_error(NP_ERR_HOST, "host out of memory for segment bookkeeping");
  }
  *seg = (np_segment){.addr = addr, .size = size, .stream = stream, .pool = (uint8_t)pool,
                      .reserved_only = reserve_only, .head = b};
  b->addr = addr;
  b->size = size;
  b->stream = stream;
  b->pool = (uint8_t)pool;
  b->seg = seg;
  b->mapped = !reserve_only;
  seg->next = ctx->segments;
  if (ctx->segments) ctx->segments->prev = seg;
  ctx->segments = seg;
  np_counter_add(&ctx->st.total.segments, 1);
  np_counter_add(&ctx->st.pool[pool].segments, 1);
  if (!reserve_only) np_ctx_reserved_add(ctx, pool, size);
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
  if (seg->reserved_only) {
    ctx->be->release(ctx->be, seg->addr, seg->size);
  } else {
    ctx->be->free(ctx->be, seg->addr, seg->size);
    ctx->st.device_frees++;
    np_ctx_reserved_sub(ctx, seg->pool, seg->size);
  }
  np_counter_sub(&ctx->st.total.segments, 1);
  np_counter_sub(&ctx->st.pool[seg->pool].segments, 1);
  free(seg);
}

void np_ctx_reserved_add(np_ctx *ctx, int pool, uint64_t bytes) {
  np_counter_add(&ctx->st.total.reserved, bytes);
  np_counter_add(&ctx->st.pool[pool].reserved, bytes);
}

void np_ctx_reserved_sub(np_ctx *ctx, int pool, uint64_t bytes) {
  np_counter_sub(&ctx->st.total.reserved, bytes);
  np_counter_sub(&ctx->st.pool[pool].reserved, bytes);
}

static void account(np_ctx *ctx, const np_block *b, bool add) {
  np_pool_stats *ps[2] = {&ctx->st.total, &ctx->st.pool[b->pool]};
  for (int i = 0; i < 2; i++) {
    if (add) {
      np_counter_add(&ps[i]->allocated, b->size);
      np_counter_add(&ps[i]->requested, b->requested);
      np_counter_add(&ps[i]->active, b->size);
      np_counter_add(&ps[i]->blocks, 1);
    } else {
      np_counter_sub(&ps[i]->allocated, b->size);
      np_counter_sub(&ps[i]->requested, b->requested);
      np_counter_sub(&ps[i]->active, b->size);
      np_counter_sub(&ps[i]->blocks, 1);
    }
  }
}

/* Compose the out-of-memory message: what was asked, what the pool holds, and why it failed. */
static int oom(np_ctx *ctx, uint64_t size) {
  char cause[256];
  snprintf(cause, sizeof cause, "%s", np_last_error()); /* the policy's reason; the buffer is rewritten below */
  np_stats st;
  ctx->st.ooms++;
  np_get_stats_locked(ctx, &st);
  uint64_t reserved = st.total.reserved.current, allocated = st.total.allocated.current;
  char a[32], r[32], l[32], al[32], f[32], t[32];
  const char *why = size > ctx->limit ? "the request alone is larger than the cap"
                    : reserved - allocated >= size
                        ? "the pool holds enough free bytes, but not in one piece (fragmentation)"
                        : "live tensors fill the cap (a real shortage: lower the batch or shard more)";
  return np_error(NP_ERR_OOM,
                  "out of memory on device %d (policy %s): tried to allocate %s; reserved %s of the %s cap "
                  "(fraction %.3g of %s), allocated %s, largest free block %s; %s [%s]",
                  ctx->cfg.device, ctx->policy->name, np_fmt_bytes(size, a), np_fmt_bytes(reserved, r),
                  np_fmt_bytes(ctx->limit, l), ctx->cfg.fraction, np_fmt_bytes(st.device_total, t),
                  np_fmt_bytes(allocated, al), np_fmt_bytes(st.largest_free, f), why, cause);
}

static int adopt(np_ctx *ctx, np_block *b, uint64_t size, int32_t site, void **out);

/* splitmix64's finalizer: a bijection of 64-bit words with full avalanche. */
static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* A site id for (marker context, position, size), disjoint from callers' ids (bit 30 set).
 * The context is last_mark: the latest marker's code and the stage it is in (see np_ctx_mark).
 * Every input bit reaches the 30 kept bits (a plain shift-and-xor dropped high bits, so that
 * different contexts collided). */
static int32_t derived_site(int mark, uint32_t pos, uint64_t size) {
  uint64_t x = mix64(mix64(((uint64_t)(uint32_t)mark << 32) ^ pos) ^ size);
  return (int32_t)(0x40000000u | (uint32_t)(x & 0x3FFFFFFFu));
}

int np_ctx_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out) {
  *out = NULL;
  if (size == 0) return np_error(NP_ERR_INVALID, "malloc of 0 bytes: a size of at least 1 byte is required");
  if (size > NP_MAX_REQUEST) {
    char a[32];
    return np_error(NP_ERR_INVALID, "malloc of %llu bytes (%s) is absurd: no device has that much memory",
                    (unsigned long long)size, np_fmt_bytes(size, a));
  }
  if (lifetime < NP_LIFE_AUTO || lifetime > NP_LIFE_SHORT)
    return np_error(NP_ERR_INVALID, "lifetime must be NP_LIFE_AUTO, NP_LIFE_LONG or NP_LIFE_SHORT, got %d", lifetime);
  if (ctx->phased) {
    /* Without a caller's site, a request is known by where it comes in its phase: the
     * k-th allocation of this size after a layer-enter marker is the same tensor in
     * every layer and every step, so what one layer teaches applies to the next. */
    if (site < 0) site = derived_site(ctx->last_mark, ctx->mark_pos, size);
    ctx->mark_pos++;
    if (lifetime == NP_LIFE_AUTO) lifetime = np_lifetime_predict(&ctx->life, site);
  }
  if (lifetime == NP_LIFE_AUTO) lifetime = ctx->default_life;
  np_block *b = NULL;
  int rc = ctx->policy->malloc(ctx, size, stream, lifetime, &b);
  if (rc == NP_ERR_OOM) {
    np_ctx_record(ctx, NP_EV_OOM, 0, size, stream, site, lifetime);
    return oom(ctx, size);
  }
  if (rc != NP_OK) return rc;
  rc = adopt(ctx, b, size, site, out);
  if (rc == NP_OK) {
    np_ctx_record(ctx, NP_EV_ALLOC, b->addr, size, stream, site, lifetime);
    ctx->last_life = lifetime;
  }
  return rc;
}

int np_ctx_alloc_at(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, void **out) {
  *out = NULL;
  if (!ctx->policy->alloc_at) return np_error(NP_ERR_STATE, "policy %s cannot place blocks at given addresses", ctx->policy->name);
  if (size == 0 || size > NP_MAX_REQUEST) return np_error(NP_ERR_INVALID, "bad size %llu", (unsigned long long)size);
  np_block *b = NULL;
  int rc = ctx->policy->alloc_at(ctx, addr, size, stream, &b);
  if (rc != NP_OK) return rc;
  ctx->last_life = NP_LIFE_LONG;
  return adopt(ctx, b, size, -1, out);
}

/* Mark a block the policy placed as allocated, file it and count it. */
static int adopt(np_ctx *ctx, np_block *b, uint64_t size, int32_t site, void **out) {
  b->allocated = 1;
  b->requested = size;
  b->site = site;
  b->phase = ctx->phase;
  b->born = ctx->clock++;
  if (!np_ptrmap_insert(&ctx->live, b)) {
    ctx->policy->free(ctx, b);
    return np_error(NP_ERR_HOST, "host out of memory for the pointer map");
  }
  account(ctx, b, true);
  ctx->st.allocs++;
  *out = (void *)b->addr;
  return NP_OK;
}

int np_ctx_free(np_ctx *ctx, void *ptr) {
  if (!ptr) return np_error(NP_ERR_INVALID, "free of a NULL pointer");
  np_block *b = np_ptrmap_remove(&ctx->live, (uintptr_t)ptr);
  if (!b) {
    /* Tell a double free (inside a segment of ours) from a foreign pointer. */
    for (np_segment *s = ctx->segments; s; s = s->next)
      if ((uintptr_t)ptr >= s->addr && (uintptr_t)ptr < s->addr + s->size)
        return np_error(NP_ERR_DOUBLE_FREE,
                        "free of %p: inside this pool's memory but not an allocated block "
                        "(double free, or a pointer into the middle of a tensor)", ptr);
    return np_error(NP_ERR_UNKNOWN_PTR, "free of %p: this pool never allocated it (foreign pointer)", ptr);
  }
  account(ctx, b, false);
  np_ctx_record(ctx, NP_EV_FREE, b->addr, b->requested, b->stream, b->site, b->pool == 1 ? NP_LIFE_SHORT : NP_LIFE_LONG);
  if (ctx->phased) np_lifetime_learn(&ctx->life, b->site, ctx->phase != b->phase); /* outlived its phase? */
  b->allocated = 0;
  b->requested = 0;
  if (b->shared && ctx->policy != &np_policy_npu_pool) {
    /* the model policies reuse a block on its own stream at once: first let the other
     * streams' work on it finish */
    int rc = ctx->be->synchronize(ctx->be, NP_STREAM_ANY);
    if (rc != NP_OK) np_error(rc, "free of %p: synchronising for a recorded stream failed", ptr);
    b->shared = 0;
  }
  ctx->policy->free(ctx, b);
  ctx->st.frees++;
  return NP_OK;
}

void np_ctx_record(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, intptr_t stream, int32_t site, int lifetime) {
  np_event_info *e = &ctx->recent[ctx->n_events % NP_RECENT_EVENTS];
  *e = (np_event_info){.seq = ctx->n_events++, .addr = addr, .size = size, .stream = stream, .site = site,
                       .kind = (uint8_t)kind, .lifetime = (uint8_t)lifetime};
}

int np_ctx_empty_cache(np_ctx *ctx) {
  np_ctx_record(ctx, NP_EV_EMPTY_CACHE, 0, 0, 0, -1, 0);
  int rc = ctx->be->synchronize(ctx->be, NP_STREAM_ANY);
  if (rc != NP_OK) return rc;
  return ctx->policy->empty_cache(ctx);
}

void np_ctx_set_phase(np_ctx *ctx, uint32_t phase, int default_life) {
  ctx->phased = true;
  ctx->phase = phase;
  ctx->default_life = default_life;
  ctx->base_life = default_life;
}

/* Stages a marker puts the context in. Lifetimes are learned per stage: a block is
 * long-lived when it outlives the stage it was born in (forward -> backward: an activation;
 * backward -> optimizer: a gradient), short-lived when it dies inside it. Layer markers
 * do not end a stage; they restart the position count of derived sites, so that the k-th
 * request of a layer is the same site in every layer. ctx->last_mark packs the marker
 * code (bits 0-7), the stage (bits 8-11), "inside eval" (bit 12) and "a later micro-batch"
 * (bit 13: forward/backward of micro-batch > 0, whose requests differ from the first's:
 * gradient accumulation adds into the gradients the first backward created). */
enum { STAGE_OUTSIDE = 0, STAGE_SETUP, STAGE_FORWARD, STAGE_BACKWARD, STAGE_OPTIMIZER, STAGE_EVAL };
#define MARK_STAGE(m) (((m) >> 8) & 0xF)
#define MARK_EVAL 0x1000
#define MARK_LATER_MICRO 0x2000

int np_ctx_mark(np_ctx *ctx, int code, int64_t arg) {
  if (code < 0 || code >= NP_MARK_COUNT) return np_error(NP_ERR_INVALID, "unknown marker code %d", code);
  ctx->phased = true;
  ctx->mark_pos = 0;
  int stage = MARK_STAGE(ctx->last_mark), eval = ctx->last_mark & MARK_EVAL;
  int micro = ctx->last_mark & MARK_LATER_MICRO;
  if (code == NP_MARK_LAYER_ENTER || code == NP_MARK_LAYER_EXIT) {
    ctx->last_mark = code | stage << 8 | eval | micro;
    return NP_OK;
  }
  micro = (code == NP_MARK_FORWARD_BEGIN || code == NP_MARK_BACKWARD_BEGIN) && arg > 0 ? MARK_LATER_MICRO : 0;
  ctx->phase++; /* every other marker ends the stage */
  switch (code) {
    case NP_MARK_SETUP_BEGIN: stage = STAGE_SETUP; ctx->default_life = NP_LIFE_LONG; break;
    case NP_MARK_FORWARD_BEGIN: stage = STAGE_FORWARD; ctx->default_life = ctx->base_life; break;
    /* backward: activation gradients and scratch die inside it; gradients are learned */
    case NP_MARK_BACKWARD_BEGIN: stage = STAGE_BACKWARD; ctx->default_life = NP_LIFE_SHORT; break;
    case NP_MARK_OPTIMIZER_BEGIN:
      /* the first step creates the optimizer states, which live for the whole run */
      stage = STAGE_OPTIMIZER;
      ctx->default_life = ctx->optimizer_steps++ == 0 ? NP_LIFE_LONG : NP_LIFE_SHORT;
      break;
    case NP_MARK_EVAL_BEGIN: stage = STAGE_EVAL; eval = MARK_EVAL; ctx->default_life = NP_LIFE_SHORT; break;
    case NP_MARK_EVAL_END: stage = STAGE_OUTSIDE; eval = 0; ctx->default_life = ctx->base_life; break;
    default: stage = STAGE_OUTSIDE; ctx->default_life = ctx->base_life; break; /* ends, iteration markers */
  }
  if (eval) ctx->default_life = NP_LIFE_SHORT; /* nothing of an evaluation outlives it */
  ctx->last_mark = code | stage << 8 | eval | micro;
  return NP_OK;
}

void np_get_stats_locked(np_ctx *ctx, np_stats *out) {
  *out = ctx->st;
  out->device_total = ctx->be->total;
  out->limit = ctx->limit;
  out->policy = ctx->cfg.policy;
  out->largest_free = 0;
  if (ctx->policy->fill_stats) ctx->policy->fill_stats(ctx, out);
}

/* Generic invariants: segments tiled by blocks, the map holds exactly the allocated ones. */
int np_ctx_check(np_ctx *ctx) {
  size_t allocated_blocks = 0;
  uint64_t allocated_bytes = 0, reserved = 0;
  bool reservations = false;
  for (np_segment *s = ctx->segments; s; s = s->next) {
    uintptr_t at = s->addr;
    if (!s->head || s->head->prev) return np_error(NP_ERR_STATE, "check: segment %#lx has a bad head", (unsigned long)s->addr);
    for (np_block *b = s->head; b; b = b->next) {
      if (b->seg != s || b->addr != at || b->size == 0 || b->size % NP_MIN_BLOCK)
        return np_error(NP_ERR_STATE, "check: block %#lx does not tile segment %#lx", (unsigned long)b->addr,
                        (unsigned long)s->addr);
      if (b->next && b->next->prev != b) return np_error(NP_ERR_STATE, "check: broken block links at %#lx", (unsigned long)b->addr);
      if (b->allocated) {
        if (np_ptrmap_find(&ctx->live, b->addr) != b)
          return np_error(NP_ERR_STATE, "check: allocated block %#lx missing from the map", (unsigned long)b->addr);
        if (b->in_tree) return np_error(NP_ERR_STATE, "check: allocated block %#lx in a free tree", (unsigned long)b->addr);
        allocated_blocks++;
        allocated_bytes += b->size;
      }
      at += b->size;
    }
    if (at != s->addr + s->size) return np_error(NP_ERR_STATE, "check: blocks of segment %#lx do not cover it", (unsigned long)s->addr);
    if (s->reserved_only) reservations = true;
    else reserved += s->size;
  }
  if (allocated_blocks != ctx->live.count || allocated_bytes != ctx->st.total.allocated.current)
    return np_error(NP_ERR_STATE, "check: %zu allocated blocks (%llu bytes) but the map has %zu and stats say %llu bytes",
                    allocated_blocks, (unsigned long long)allocated_bytes, ctx->live.count,
                    (unsigned long long)ctx->st.total.allocated.current);
  if (ctx->st.pool[0].allocated.current + ctx->st.pool[1].allocated.current != allocated_bytes)
    return np_error(NP_ERR_STATE, "check: per-pool allocated bytes do not add up");
  if (!reservations && reserved != ctx->st.total.reserved.current)
    return np_error(NP_ERR_STATE, "check: segments hold %llu bytes but stats say %llu reserved",
                    (unsigned long long)reserved, (unsigned long long)ctx->st.total.reserved.current);
  return ctx->policy->check ? ctx->policy->check(ctx) : NP_OK;
}
