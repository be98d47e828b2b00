/* context.c -- requests around the policy: validation, lifetime classes, accounting of
 * blocks, failures explained, statistics and the generic invariants. */
#include <stdio.h>
#include <stdlib.h>

#include "policy.h"
#include "streams.h"
#include "vmm.h"

/* Count b in (add) or out of the totals and its pool's counters. Written out, not looped over
 * tables of counters: it runs on every malloc and free (the hot path). `active` is not counted
 * here: in this core it always equals `allocated` (a freed block's reuse is ordered on the device
 * or synchronised at the free, never deferred), so np_get_stats_locked copies it. */
static void account(np_ctx *ctx, const np_block *b, bool add) {
  np_pool_stats *t = &ctx->st.total, *p = &ctx->st.pool[b->pool];
  if (add) {
    np_counter_add(&t->allocated, b->size);
    np_counter_add(&t->requested, b->requested);
    np_counter_add(&t->blocks, 1);
    np_counter_add(&p->allocated, b->size);
    np_counter_add(&p->requested, b->requested);
    np_counter_add(&p->blocks, 1);
  } else {
    np_counter_sub(&t->allocated, b->size);
    np_counter_sub(&t->requested, b->requested);
    np_counter_sub(&t->blocks, 1);
    np_counter_sub(&p->allocated, b->size);
    np_counter_sub(&p->requested, b->requested);
    np_counter_sub(&p->blocks, 1);
  }
}

/* Why `size` bytes could not be served, from the policy's account (ctx->fail). One explanation
 * for every caller: the message, the history's oom event, reports and OOM snapshots. */
static int classify(const np_ctx *ctx, uint64_t size) {
  const np_fail *f = &ctx->fail;
  uint64_t needed = np_max_u64(f->needed, size);
  if (needed > ctx->limit) return NP_OOM_TOO_LARGE;
  if (f->refused) return NP_OOM_DEVICE; /* whatever the pool's own layout: the device has no room */
  /* free memory of the pool's, in this arena or mapped in other regions' arenas: not in one piece */
  return f->usable + f->elsewhere >= needed ? NP_OOM_FRAGMENTED : NP_OOM_SHORTAGE;
}

int np_ctx_oom_event(np_ctx *ctx, uint64_t size, intptr_t stream, int32_t site, int lifetime, uint64_t *free_bytes,
                     bool *known, uint64_t *compactable) {
  ctx->st.ooms++;
  int why = classify(ctx, size);
  uint64_t reserved = ctx->st.total.reserved.current;
  *free_bytes = ctx->limit > reserved ? ctx->limit - reserved : 0;
  *known = why != NP_OOM_DEVICE || (ctx->be->free_bytes && ctx->be->free_bytes(ctx->be, free_bytes) == NP_OK);
  if (!*known) *free_bytes = UINT64_MAX;
  /* free pages that live tensors' chunks pin: what compaction would give back, were it on */
  uint64_t pinned = UINT64_MAX; /* (not counted) */
  if (compactable) {
    bool applies = why == NP_OOM_FRAGMENTED && !ctx->compact && np_ctx_can_compact(ctx);
    pinned = applies && ctx->policy->pinned ? ctx->policy->pinned(ctx) : 0;
    *compactable = pinned;
  }
  np_ctx_record_oom(ctx, size, stream, site, lifetime, ctx->fail.pool, why, *free_bytes, pinned);
  return why;
}

void np_ctx_compaction_hint(uint64_t pinned, char *buf, size_t cap) {
  char pn[32];
  if (!pinned) {
    *buf = 0;
    return;
  }
  snprintf(buf, cap, "; compaction would give back %s, the free pages live tensors' chunks keep mapped "
           "(Pool.compact() where no other thread queues device work, or at every out-of-memory: "
           "Pool.set_compaction, NPU_POOL_COMPACT=1; docs/api.md)", np_fmt_bytes(pinned, pn));
}

void np_ctx_device_refusal(const np_ctx *ctx, uint64_t free_bytes, bool known, char *buf, size_t cap) {
  uint64_t reserved = ctx->st.total.reserved.current, total = ctx->be->total;
  char u[32], o[32];
  if (known)
    snprintf(buf, cap, "the device refused memory the cap allows: it has %s free, and %s of it is held outside this "
             "pool (other processes, collective-communication buffers, another allocator): free that memory or "
             "lower what they take", np_fmt_bytes(free_bytes, u),
             np_fmt_bytes(total > free_bytes + reserved ? total - free_bytes - reserved : 0, o));
  else
    snprintf(buf, cap, "the device refused memory the cap allows: memory outside this pool (other processes, "
             "collective-communication buffers, another allocator) holds the rest of it");
}

static uint64_t device_size(const np_ctx *ctx, uint64_t size);

/* Compose the out-of-memory message: what was asked, what the pool holds, and why it failed. */
static int oom(np_ctx *ctx, uint64_t size, intptr_t stream, int32_t site, int lifetime) {
  char cause[1024];
  np_copy_text(cause, sizeof cause, np_last_error()); /* the policy's reason; the buffer is rewritten below */
  uint64_t room, pinned;
  bool known;
  int why = np_ctx_oom_event(ctx, size, stream, site, lifetime, &room, &known, &pinned);
  np_stats st;
  np_get_stats_locked(ctx, &st);
  const np_fail *f = &ctx->fail;
  const char *pool = f->pool >= 0 && f->pool < NP_POOLS ? st.pool[f->pool].name
                     : ctx->policy->memory ? ctx->policy->memory : "the arena";
  char a[32], n[32], r[32], l[32], al[32], lf[32], t[32], u[32], h[32], ps[32], el[32], what[768],
      held[320] = "", hint[320] = "";
  np_ctx_compaction_hint(pinned, hint, sizeof hint);
  int at = 0;
  if (ctx->st.unreleased)
    at = snprintf(held, sizeof held, "; of the reserved, %s is memory the device refused to take back (retried at "
                  "empty_cache, close and an out-of-memory)", np_fmt_bytes(ctx->st.unreleased, h));
  if (st.paused && at >= 0 && (size_t)at < sizeof held) /* allocated, but nothing behind it: not in reserved */
    snprintf(held + at, sizeof held - (size_t)at, "; of the allocated, %s is in paused tagged regions (no memory "
             "behind it until resume)", np_fmt_bytes(st.paused, ps));
  /* free bytes the pool holds: paused bytes are allocated, not reserved */
  uint64_t in_use = st.total.allocated.current - np_min_u64(st.paused, st.total.allocated.current);
  uint64_t cached = st.total.reserved.current > in_use ? st.total.reserved.current - in_use : 0;
  bool rounded = f->needed > device_size(ctx, size); /* past the vendor's padding: a segment or whole pages */
  if (why == NP_OOM_TOO_LARGE)
    snprintf(what, sizeof what, "the request needs %s in one piece, more than the whole cap", np_fmt_bytes(np_max_u64(f->needed, size), n));
  else if (why == NP_OOM_DEVICE)
    np_ctx_device_refusal(ctx, room, known, what, sizeof what);
  else if (why == NP_OOM_FRAGMENTED && f->usable < np_max_u64(f->needed, size))
    snprintf(what, sizeof what, "fragmentation across tagged regions: %s has only %s it could use, and the request "
             "needs %s in one piece; %s more is free in the pool's other arenas (untagged tensors' and other regions'), "
             "kept mapped by their live tensors (empty_cache cannot return it: free those tensors, or pause those "
             "regions)%s", pool,
             np_fmt_bytes(f->usable, u), np_fmt_bytes(np_max_u64(f->needed, size), n), np_fmt_bytes(f->elsewhere, el),
             hint);
  else if (why == NP_OOM_FRAGMENTED)
    snprintf(what, sizeof what, "fragmentation: %s could serve it (its free blocks plus what the cap still allows) "
             "but not in one piece of %s%s%s", pool, np_fmt_bytes(np_max_u64(f->needed, size), n),
             rounded ? " (the request rounded up to what the policy takes from the device: a new segment or whole pages)" : "",
             hint);
  else
    snprintf(what, sizeof what, "a real shortage: %s has only %s it could use, and the request needs %s in one piece%s, "
             "even with no fragmentation (lower the batch, recompute, shard more, or raise the fraction)",
             pool, np_fmt_bytes(f->usable, u), np_fmt_bytes(np_max_u64(f->needed, size), n),
             rounded ? " (rounded up to what the policy takes from the device: a new segment or whole pages)" : "");
  return np_error(NP_ERR_OOM,
                  "out of memory on device %d (policy %s): tried to allocate %s; reserved %s of the %s cap "
                  "(fraction %.3g of %s), allocated %s, largest free block %s%s%s; %s [%s]",
                  ctx->cfg.device, ctx->policy->name, np_fmt_bytes(size, a), np_fmt_bytes(st.total.reserved.current, r),
                  np_fmt_bytes(ctx->limit, l), ctx->cfg.fraction, np_fmt_bytes(st.device_total, t),
                  np_fmt_bytes(st.total.allocated.current, al), np_fmt_bytes(st.largest_free, lf),
                  /* an arena's free block counts pages the cap lets it map (more than the pool holds
                   * free): under a "device" failure the device would not give them */
                  st.largest_free <= cached ? ""
                  : why == NP_OOM_DEVICE ? " (address space the cap allows, not memory the device gave)"
                                         : " (with pages the cap still allows mapping: more than the pool holds free)",
                  held,
                  what, cause);
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
 * Every input bit reaches the 30 kept bits. */
static int32_t derived_site(const np_marks *m, uint64_t size) {
  uint32_t context = (uint32_t)m->code | (uint32_t)m->stage << 8 | (m->eval ? 0x1000u : 0) | (m->later_micro ? 0x2000u : 0);
  uint64_t x = mix64(mix64(((uint64_t)context << 32) ^ m->pos) ^ size);
  return (int32_t)(0x40000000u | (uint32_t)(x & 0x3FFFFFFFu));
}

/* A place key: the site in its layer and micro-batch, where the site alone is the same in every
 * layer (a place is where one tensor of one iteration lay, for the same tensor of the next). */
static int32_t place_key(const np_marks *m, int32_t site) {
  uint64_t x = mix64((uint64_t)(uint32_t)site << 32 ^ (uint64_t)m->layer * 0x9E3779B97F4A7C15u ^ (uint64_t)m->micro);
  return (int32_t)(x & 0x7FFFFFFFu);
}

/* The vendor's rule for request sizes (Ascend: round to 32 bytes, add 32). */
static uint64_t device_size(const np_ctx *ctx, uint64_t size) {
  const np_backend *be = ctx->be;
  if (be->request_align) size = np_round_up(size, be->request_align);
  return size + be->request_tail;
}

int np_ctx_check_stream(intptr_t stream) {
  if (!np_stream_is_tag(stream)) return NP_OK;
  return np_error(NP_ERR_INVALID, "stream %lld is reserved: the pool tags free memory with it (%s streams)",
                  (long long)stream, stream == NP_STREAM_ANY ? "any of the" : "several");
}

int np_ctx_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out) {
  *out = NULL;
  if (np_ctx_usable(ctx, "malloc") != NP_OK) return NP_ERR_STATE;
  ctx->synced = false; /* one request: a replay holds the lock across many */
  if (size == 0) return np_error(NP_ERR_INVALID, "malloc of 0 bytes: a size of at least 1 byte is required");
  if (size > NP_MAX_REQUEST) {
    char a[32];
    return np_error(NP_ERR_INVALID, "malloc of %llu bytes (%s) is absurd: no device has that much memory",
                    (unsigned long long)size, np_fmt_bytes(size, a));
  }
  if (lifetime < NP_LIFE_AUTO || lifetime > NP_LIFE_SHORT)
    return np_error(NP_ERR_INVALID, "lifetime must be NP_LIFE_AUTO, NP_LIFE_LONG or NP_LIFE_SHORT, got %d", lifetime);
  if (np_ctx_check_stream(stream) != NP_OK) return NP_ERR_INVALID;
  np_site_entry *place = NULL; /* where the request's place key's last block went (np_lifetime) */
  ctx->again = (np_place){.side = NP_PLACE_NONE};
  if (ctx->marks.any) {
    /* Without a caller's site, a request is known by where it comes in its phase: the
     * k-th allocation of this size after a layer-enter marker is the same tensor in
     * every layer and every step, so what one layer teaches applies to the next. */
    if (site < 0) site = derived_site(&ctx->marks, size);
    ctx->marks.pos++;
    if (lifetime == NP_LIFE_AUTO) lifetime = np_lifetime_predict(&ctx->life, site);
    /* Places from the first optimizer step on: before it (set-up, the first forward and
     * backward) the layout is not yet the one that repeats, which holds the optimizer's states
     * (going back to the first step's places, a recompute model's second step needed a second
     * 20 MiB chunk where best fit fitted in one). */
    if (ctx->policy->keeps_places && ctx->marks.optimizer_steps > 0) {
      place = np_lifetime_place(&ctx->places, place_key(&ctx->marks, site));
      if (place) ctx->again = (np_place){place->at, place->anchor, place->side};
    }
  }
  if (lifetime == NP_LIFE_AUTO) lifetime = ctx->default_life;
  np_block *b = NULL;
  ctx->fail = (np_fail){.pool = NP_POOL_SHARED};
  int rc = ctx->policy->malloc(ctx, device_size(ctx, size), stream, lifetime, &b);
  if (rc == NP_ERR_OOM && ctx->n_held) { /* memory the device refused to take back before: ask again, then retry */
    np_saved_error why;
    np_save_error(&why, rc);
    uint64_t before = ctx->st.unreleased;
    np_ctx_retry_held(ctx);
    if (ctx->st.unreleased < before) {
      ctx->fail = (np_fail){.pool = NP_POOL_SHARED};
      rc = ctx->policy->malloc(ctx, device_size(ctx, size), stream, lifetime, &b);
    } else {
      np_restore_error(&why);
    }
  }
  if (rc == NP_ERR_OOM) return oom(ctx, size, stream, site, lifetime);
  if (rc != NP_OK) return rc;
  b->life = (uint8_t)lifetime;
  rc = adopt(ctx, b, size, site, out);
  if (rc == NP_OK) {
    if (place) { /* (the table had no new key since: the entry is still the key's) */
      place->side = b->side;
      place->at = b->addr;
      place->anchor = b->anchor;
    }
    np_ctx_record(ctx, NP_EV_ALLOC, b->addr, size, stream, site, b->pool, lifetime);
    ctx->last_life = lifetime;
  }
  return rc;
}

int np_ctx_alloc_at(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, void **out) {
  *out = NULL;
  if (np_ctx_usable(ctx, "malloc") != NP_OK) return NP_ERR_STATE;
  ctx->synced = false; /* one request: a replay holds the lock across many */
  if (!ctx->policy->alloc_at) return np_error(NP_ERR_STATE, "policy %s cannot place blocks at given addresses", ctx->policy->name);
  if (size == 0 || size > NP_MAX_REQUEST) return np_error(NP_ERR_INVALID, "bad size %llu", (unsigned long long)size);
  if (np_ctx_check_stream(stream) != NP_OK) return NP_ERR_INVALID;
  np_block *b = NULL;
  int rc = ctx->policy->alloc_at(ctx, addr, size, stream, &b);
  if (rc != NP_OK) return rc;
  ctx->last_life = NP_LIFE_LONG;
  b->life = NP_LIFE_LONG;
  rc = adopt(ctx, b, size, -1, out);
  if (rc == NP_OK) np_ctx_record(ctx, NP_EV_ALLOC, b->addr, size, stream, -1, b->pool, NP_LIFE_LONG);
  return rc;
}

/* Mark a block the policy placed as allocated, file it and count it. */
static int adopt(np_ctx *ctx, np_block *b, uint64_t size, int32_t site, void **out) {
  b->allocated = 1;
  b->orphan = 0;
  b->requested = size;
  b->site = site;
  b->phase = ctx->phase;
  if (!np_ptrmap_insert(&ctx->live, b)) {
    b->allocated = 0;
    ctx->policy->free(ctx, b);
    return np_error(NP_ERR_HOST, "host out of memory for the pointer map");
  }
  account(ctx, b, true);
  ctx->st.allocs++;
  *out = (void *)b->addr;
  return NP_OK;
}

int np_ctx_synchronize(np_ctx *ctx) {
  ctx->st.syncs++;
  int rc = ctx->be->synchronize(ctx->be, NP_STREAM_ANY);
  ctx->synced = rc == NP_OK;
  return rc;
}

int np_ctx_free(np_ctx *ctx, void *ptr) {
  if (!ptr) return np_error(NP_ERR_INVALID, "free of a NULL pointer");
  if (np_ctx_usable(ctx, "free") != NP_OK) return NP_ERR_STATE;
  ctx->synced = false;
  np_block *b = np_ptrmap_remove(&ctx->live, (uintptr_t)ptr);
  if (!b) {
    /* Tell a double free (inside a segment of ours) from a foreign pointer. */
    for (np_segment *s = ctx->segments; s; s = s->next)
      if ((uintptr_t)ptr >= s->addr && (uintptr_t)ptr - s->addr < s->size)
        return np_error(NP_ERR_DOUBLE_FREE,
                        "free of %p: inside this pool's memory but not an allocated block "
                        "(double free, or a pointer into the middle of a tensor)", ptr);
    return np_error(NP_ERR_UNKNOWN_PTR, "free of %p: this pool never allocated it (foreign pointer)", ptr);
  }
  if (b->shared && !ctx->policy->orders_streams) {
    /* the policy reuses a block on its own stream at once: first let the other streams' work on
     * it finish; a device that cannot say so keeps the block allocated (nothing changed) */
    int rc = np_ctx_synchronize(ctx);
    if (rc != NP_OK) {
      np_saved_error s;
      np_save_error(&s, rc);
      np_ptrmap_insert(&ctx->live, b); /* into the slot the remove freed: the map does not grow */
      if (!b->orphan) ctx->n_orphans++;
      b->orphan = 1; /* (a caller that drops the pointer, as torch does, leaves it to empty_cache) */
      return np_error(NP_ERR_BACKEND, "free of %p: synchronising for a recorded stream failed, so the block stays "
                      "allocated (freed again by the next empty_cache): %s", ptr, s.text);
    }
    b->shared = 0;
  }
  if (b->orphan) {
    b->orphan = 0;
    ctx->n_orphans--;
  }
  account(ctx, b, false);
  np_ctx_record(ctx, NP_EV_FREE, b->addr, b->requested, b->stream, b->site, b->pool, b->life);
  if (ctx->marks.any) np_lifetime_learn(&ctx->life, b->site, ctx->phase != b->phase); /* outlived its phase? */
  b->side = NP_PLACE_NONE; /* (the struct may serve another policy's block next) */
  b->allocated = 0;
  b->requested = 0;
  ctx->policy->free(ctx, b);
  ctx->st.frees++;
  return NP_OK;
}

/* Free the blocks whose free was refused (np_block.orphan), the device now synchronised: their
 * addresses first (a free may merge blocks), each freed as its caller asked. */
static void free_orphans(np_ctx *ctx) {
  uintptr_t *addrs = malloc(ctx->n_orphans * sizeof *addrs);
  size_t n = 0;
  if (!addrs) return; /* (the next empty_cache tries again) */
  for (np_segment *s = ctx->segments; s && n < ctx->n_orphans; s = s->next)
    for (np_block *b = s->head; b && n < ctx->n_orphans; b = b->next)
      if (b->allocated && b->orphan) {
        addrs[n++] = b->addr;
        b->shared = 0; /* the device was synchronised just before: no other stream's work uses it now */
      }
  np_saved_error keep;
  np_save_error(&keep, NP_OK);
  bool synced = ctx->synced;
  for (size_t i = 0; i < n; i++) np_ctx_free(ctx, (void *)addrs[i]); /* a refusal keeps it an orphan */
  ctx->synced = synced; /* (a free queues no work: the device is as idle as before them) */
  np_restore_error(&keep);
  free(addrs);
}

int np_ctx_empty_cache(np_ctx *ctx) {
  if (np_ctx_usable(ctx, "empty_cache") != NP_OK) return NP_ERR_STATE;
  ctx->synced = false;
  np_ctx_record(ctx, NP_EV_EMPTY_CACHE, 0, 0, 0, -1, -1, 0);
  int rc = np_ctx_synchronize(ctx);
  if (rc != NP_OK) return rc;
  if (ctx->n_orphans) free_orphans(ctx);
  int held = np_ctx_retry_held(ctx); /* what the device refused before: try again */
  np_saved_error s;
  if (held != NP_OK) np_save_error(&s, held);
  uint64_t holds = ctx->holds;
  np_vmm_spares_release(ctx);
  rc = ctx->policy->empty_cache(ctx);
  if (rc == NP_OK) rc = np_ctx_new_holds(ctx, holds); /* and what it refuses now */
  return rc != NP_OK ? rc : held != NP_OK ? np_restore_error(&s) : NP_OK;
}

/* What stops this pool from compacting: 0 nothing, else the first of its policy, the
 * virtual-memory API and a backend that copies (np_ctx_compaction_refused says it). */
static int compaction_obstacle(const np_ctx *ctx) {
  if (!ctx->policy->compact) return 1;
  if (!ctx->be->granularity || !ctx->cfg.vmm) return 2;
  if (!ctx->be->copy && !ctx->be->simulated) return 3;
  return 0;
}

bool np_ctx_can_compact(const np_ctx *ctx) { return compaction_obstacle(ctx) == 0; }

const char *np_ctx_compaction_refused(const np_ctx *ctx) {
  static _Thread_local char why[160];
  switch (compaction_obstacle(ctx)) {
    case 1: snprintf(why, sizeof why, "policy %s does not compact (npu_pool and planned do)", ctx->policy->name); break;
    case 2:
      snprintf(why, sizeof why, "compaction replaces physical chunks under live blocks: it needs the virtual-memory "
               "API, which %s", ctx->cfg.vmm ? "this backend does not have" : "this pool was made without (vmm off)");
      break;
    case 3: snprintf(why, sizeof why, "backend %s cannot copy device memory to the host: no compaction", ctx->be->name); break;
    default: return NULL;
  }
  return why;
}

int np_ctx_compact(np_ctx *ctx, uint64_t *returned) {
  *returned = 0;
  if (np_ctx_usable(ctx, "compact") != NP_OK) return NP_ERR_STATE;
  const char *why = np_ctx_compaction_refused(ctx);
  if (why) return np_error(NP_ERR_STATE, "%s", why);
  uint64_t before = ctx->st.total.reserved.current;
  /* the device idle, and every wholly free chunk back without a copy; memory the device refused to
   * take back is held (counted), which stops nothing: only a device that could not be synchronised does */
  int rc = np_ctx_empty_cache(ctx);
  if (ctx->synced) {
    np_saved_error s = {.code = NP_OK};
    if (rc != NP_OK) np_save_error(&s, rc);
    int c = ctx->policy->compact(ctx);
    rc = c != NP_OK || s.code == NP_OK ? c : np_restore_error(&s);
  }
  uint64_t after = ctx->st.total.reserved.current;
  *returned = before > after ? before - after : 0;
  return rc;
}

void np_get_stats_locked(np_ctx *ctx, np_stats *out) {
  *out = ctx->st;
  np_stats_fill_active(out);
  out->device_total = ctx->be->total;
  out->compaction = ctx->compact;
  out->compactable = np_ctx_can_compact(ctx);
  out->limit = ctx->limit;
  out->policy = ctx->cfg.policy;
  out->learned_sites = ctx->life.count;
  out->largest_free = 0;
  /* the spares and what the device refused to take back (empty_cache gives back and retries
   * them); the policy's fill_stats adds what its empty_cache returns */
  out->releasable = ctx->st.spare + ctx->st.unreleased;
  for (int k = 0; k < NP_CALL_COUNT; k++) out->calls[k] = ctx->be->calls[k] - ctx->calls_base[k];
  if (ctx->policy->fill_stats) ctx->policy->fill_stats(ctx, out);
  uint64_t held = out->total.reserved.current + out->paused, taken = out->total.active.current + out->releasable;
  out->non_releasable = held > taken ? held - taken : 0;
}

/* Generic invariants: segments tiled by blocks, the map holds exactly the allocated ones,
 * reserved bytes are what the segments have mapped plus what the device still holds (refused
 * returns, listed in `held`, and spare chunks), no recycle window outlives its call. */
int np_ctx_check(np_ctx *ctx) {
  size_t allocated_blocks = 0, orphans = 0;
  uint64_t allocated_bytes = 0, reserved = ctx->st.unreleased, spare = 0;
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
        orphans += b->orphan;
      }
      at += b->size;
    }
    if (at != s->addr + s->size) return np_error(NP_ERR_STATE, "check: blocks of segment %#lx do not cover it", (unsigned long)s->addr);
    if (s->reserved_only) {
      uint64_t mapped = 0, g = ctx->be->granularity;
      for (uint64_t p = 0; p < s->size / g; p++) mapped += s->pages[p] ? g : 0;
      if (mapped != s->mapped) return np_error(NP_ERR_STATE, "check: segment %#lx's page table disagrees with its mapped bytes", (unsigned long)s->addr);
    }
    reserved += s->mapped;
  }
  for (size_t i = 0; i < ctx->n_spare; i++) spare += ctx->spare[i].size;
  if (ctx->recycling) return np_error(NP_ERR_STATE, "check: a recycle window outlived its call");
  if (spare != ctx->st.spare || ctx->n_spare > NP_SPARE_MAX)
    return np_error(NP_ERR_STATE, "check: %zu spare chunks hold %llu bytes but stats say %llu", ctx->n_spare,
                    (unsigned long long)spare, (unsigned long long)ctx->st.spare);
  reserved += spare;
  uint64_t held = 0;
  for (size_t i = 0; i < ctx->n_held; i++) held += ctx->held[i].kind != NP_HELD_RESERVATION ? ctx->held[i].size : 0;
  if (orphans != ctx->n_orphans)
    return np_error(NP_ERR_STATE, "check: %zu blocks wait for their refused free but the context counts %zu", orphans,
                    ctx->n_orphans);
  if (held + ctx->unlisted != ctx->st.unreleased) /* (unlisted: what the host had no room to list) */
    return np_error(NP_ERR_STATE, "check: %zu held items hold %llu bytes (%llu more unlisted) but stats say %llu "
                    "unreleased", ctx->n_held, (unsigned long long)held, (unsigned long long)ctx->unlisted,
                    (unsigned long long)ctx->st.unreleased);
  if (allocated_blocks != ctx->live.count || allocated_bytes != ctx->st.total.allocated.current)
    return np_error(NP_ERR_STATE, "check: %zu allocated blocks (%llu bytes) but the map has %zu and stats say %llu bytes",
                    allocated_blocks, (unsigned long long)allocated_bytes, ctx->live.count,
                    (unsigned long long)ctx->st.total.allocated.current);
  if (ctx->st.pool[0].allocated.current + ctx->st.pool[1].allocated.current != allocated_bytes)
    return np_error(NP_ERR_STATE, "check: per-pool allocated bytes do not add up");
  if (reserved != ctx->st.total.reserved.current)
    return np_error(NP_ERR_STATE, "check: segments map %llu bytes (device still holding %llu more) but stats say %llu reserved",
                    (unsigned long long)(reserved - ctx->st.unreleased - spare), (unsigned long long)(ctx->st.unreleased + spare),
                    (unsigned long long)ctx->st.total.reserved.current);
  return ctx->policy->check ? ctx->policy->check(ctx) : NP_OK;
}
