/* api.c -- the public entry points: validate, lock, call the internals.
 *
 * Lifecycle: np_create makes a context; np_close (under the lock, so after every call in
 * flight) returns its memory and marks it closed, after which every call but the statistics,
 * the history and np_close itself fails with NP_ERR_STATE; np_destroy closes and frees the
 * struct, so it must be the last call on the context (its owner's to order: Python's Pool
 * frees it when the Pool object dies, the device table never does). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "policy.h"
#include "vmm.h"

void np_config_init(np_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->policy = np_policy_index("npu_pool");
  cfg->backend = NP_BACKEND_SIM;
  cfg->capacity = 64 * NP_GIB;
  cfg->vmm = 1;
  cfg->fraction = 1.0;
}

/* The cap a fraction of the device gives: at least the smallest block where the device has one,
 * or nothing could ever be placed under it (a fraction of 1e-300 is a cap of 0 bytes). A device
 * smaller than a block is the device's own size, not the fraction's doing: its requests fail. */
static int cap_of(const np_backend *be, double fraction, uint64_t *limit) {
  *limit = (uint64_t)floor(fraction * (double)be->total);
  if (*limit >= NP_MIN_BLOCK || be->total < NP_MIN_BLOCK) return NP_OK;
  char t[32], f[32];
  return np_error(NP_ERR_INVALID, "memory fraction %s of the %s device is a cap of %llu bytes, less than the smallest "
                  "block (%llu bytes): the smallest fraction is %.3g", np_fmt_double(fraction, f), np_fmt_bytes(be->total, t),
                  (unsigned long long)*limit, (unsigned long long)NP_MIN_BLOCK, (double)NP_MIN_BLOCK / (double)be->total);
}

int np_check_fraction(double f) {
  char x[32];
  if (!(f > 0.0 && f <= 1.0)) /* also rejects NaN */
    return np_error(NP_ERR_INVALID, "memory fraction must be in (0, 1], got %s", np_fmt_double(f, x));
  return NP_OK;
}

/* The per-thread current device of the vendor backends (backend.h) and, apart, the simulator's
 * model of it (a simulated pool never tells a real one which device is current): each valid while
 * its generation is the process's; a forked child starts a new generation (its runtime is not the
 * parent's). */
enum { CACHE_VENDOR, CACHE_SIM };
static __thread int tl_device[2] = {-1, -1};
static __thread unsigned tl_gen[2];
static unsigned device_gen = 1;
static pthread_once_t device_once = PTHREAD_ONCE_INIT;
static void forked_child(void) { __atomic_add_fetch(&device_gen, 1, __ATOMIC_RELAXED); }
static void register_fork(void) { pthread_atfork(NULL, NULL, forked_child); }

static int cache_get(int k) {
  return tl_gen[k] == __atomic_load_n(&device_gen, __ATOMIC_RELAXED) ? tl_device[k] : -1;
}

static void cache_set(int k, int device) {
  pthread_once(&device_once, register_fork);
  tl_device[k] = device;
  tl_gen[k] = __atomic_load_n(&device_gen, __ATOMIC_RELAXED);
}

int np_device_cache_get(void) { return cache_get(CACHE_VENDOR); }
void np_device_cache_set(int device) { cache_set(CACHE_VENDOR, device); }
int np_sim_device_cache_get(void) { return cache_get(CACHE_SIM); }
void np_sim_device_cache_set(int device) { cache_set(CACHE_SIM, device); }

int np_cached_device(void) { return np_device_cache_get(); }
void np_forget_device(void) {
  np_device_cache_set(-1);
  np_sim_device_cache_set(-1);
}

np_backend *np_backend_create(const np_config *cfg) {
  switch (cfg->backend) {
    case NP_BACKEND_SIM: return np_backend_sim_create(cfg);
    case NP_BACKEND_ACL: return np_backend_acl_create(cfg);
    case NP_BACKEND_CUDA: return np_backend_cuda_create(cfg);
    default: np_error(NP_ERR_INVALID, "unknown backend %d (sim=0, acl=1, cuda=2)", cfg->backend); return NULL;
  }
}

int np_backend_load(int backend, const char *lib_path) {
  switch (backend) {
    case NP_BACKEND_ACL: return np_backend_acl_load(lib_path);
    case NP_BACKEND_CUDA: return np_backend_cuda_load(lib_path);
    default: return NP_OK;
  }
}

static void names(np_ctx *ctx) {
  snprintf(ctx->st.total.name, sizeof ctx->st.total.name, "all");
  for (int p = 0; p < NP_POOLS; p++) snprintf(ctx->st.pool[p].name, sizeof ctx->st.pool[p].name, "%s", ctx->policy->pool_name[p]);
}

int np_create(const np_config *cfg, np_ctx **out) {
  *out = NULL;
  if (!cfg) return np_error(NP_ERR_INVALID, "np_create: config is NULL");
  const np_policy *policy = np_policy_at(cfg->policy);
  if (!policy) {
    char known[256] = "";
    for (int i = 0, used = 0; i < np_policy_count() && used < (int)sizeof known; i++)
      used += snprintf(known + used, sizeof known - (size_t)used, "%s%d=%s", i ? ", " : "", i, np_policy_name(i));
    return np_error(NP_ERR_INVALID, "unknown policy %d (%s)", cfg->policy, known);
  }
  int rc = np_check_fraction(cfg->fraction);
  if (rc != NP_OK) return rc;
  if (cfg->device_rules < 0 || cfg->device_rules >= NP_DEVICE_COUNT)
    return np_error(NP_ERR_INVALID, "unknown device rules %d (auto=0, npu=1, cuda=2)", cfg->device_rules);
  np_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return np_error(NP_ERR_HOST, "host out of memory creating a context");
  ctx->cfg = *cfg;
  ctx->cfg.lib_path = NULL; /* not owned; only used while creating the backend */
  ctx->policy = policy;
  ctx->default_life = ctx->base_life = NP_LIFE_LONG;
  ctx->replay_time = -1;
  names(ctx);
  pthread_mutex_init(&ctx->lock, NULL);
  if (!np_ptrmap_init(&ctx->live) || !np_lifetime_init(&ctx->life) || !np_lifetime_init(&ctx->places)) {
    rc = np_error(NP_ERR_HOST, "host out of memory creating a context");
    goto fail;
  }
  np_ctx_set_history(ctx, NP_HISTORY_DEFAULT);
  ctx->be = np_backend_create(cfg);
  if (!ctx->be) {
    rc = np_last_code() ? np_last_code() : NP_ERR_BACKEND; /* a bad capacity is INVALID, a missing library BACKEND */
    goto fail;
  }
  if (cfg->device_rules == NP_DEVICE_NPU || cfg->device_rules == NP_DEVICE_CUDA) { /* the runtime's request rules */
    ctx->be->request_align = ctx->be->request_tail = cfg->device_rules == NP_DEVICE_NPU ? NP_NPU_PAD : 0;
  }
  ctx->be->no_lookups = ctx->be->simulated && ctx->policy->framework;
  ctx->device_caps = ctx->policy->framework && cfg->fraction >= 1.0;
  rc = cap_of(ctx->be, cfg->fraction, &ctx->limit);
  if (rc != NP_OK) goto fail;
  rc = ctx->policy->init(ctx);
  if (rc != NP_OK) goto fail;
  np_fork_register(ctx);
  *out = ctx;
  return NP_OK;
fail:
  if (ctx->be) {
    np_saved_error why; /* the failure that stopped the creation, not a refusal while undoing it */
    np_save_error(&why, rc);
    if (ctx->be->destroy(ctx->be) != NP_OK) np_restore_error(&why);
  }
  np_ctx_history_free(ctx);
  np_lifetime_destroy(&ctx->life);
  np_lifetime_destroy(&ctx->places);
  np_ptrmap_destroy(&ctx->live);
  pthread_mutex_destroy(&ctx->lock);
  free(ctx);
  return rc;
}

int np_ctx_refuse(const np_ctx *ctx, const char *what) {
  if (ctx->closed)
    return np_error(NP_ERR_STATE, "%s on a closed pool: close() returned its memory; make a new pool", what);
  if (ctx->lost)
    return np_error(NP_ERR_STATE, "%s refused: a compaction could not put live tensors' bytes back (see the error "
                    "of the request that compacted); their contents are lost; close the pool", what);
  return np_error(NP_ERR_STATE, "%s refused: this process is a fork of the one that made this pool, whose %s device "
                  "memory belongs to the parent (a forked child may read its statistics and close it)",
                  what, np_vocab_name(NP_VOCAB_BACKEND, ctx->cfg.backend));
}

/* What a closed context still answers: the policy's name and pools, and no operation. */
static const np_policy closed_policy = {.name = "(closed)", .summary = "a closed pool"};

/* Whether returning the context's memory must first wait for the device: work still queued on freed
 * memory (another stream's) may use it. A vendor free that waits by itself (cudaFree) needs no wait;
 * mapped pages (an unmap does not wait) and frees that do not (aclrtFree) do. */
static bool close_waits(const np_ctx *ctx) {
  for (const np_segment *s = ctx->segments; s; s = s->next)
    if (s->reserved_only ? s->mapped != 0 : !ctx->be->free_synchronizes) return true;
  return false;
}

/* Release everything but the struct and its lock (lock held). An inherited context gives
 * nothing back to the device: that memory is the parent's. */
static int close_locked(np_ctx *ctx) {
  int rc = NP_OK;
  if (!ctx->inherited) {
    /* as at empty_cache, once; a device that cannot say so is not waited for: closing returns the
     * memory all the same (the pool is gone), and the failure is said unless another comes first */
    int drained = close_waits(ctx) ? np_ctx_synchronize(ctx) : NP_OK;
    np_saved_error unsynced;
    np_save_error(&unsynced, drained);
    np_vmm_spares_release(ctx);
    ctx->policy->destroy(ctx); /* returns every segment to the device */
    rc = np_ctx_retry_held(ctx);
    np_saved_error held;
    np_save_error(&held, rc);
    int destroyed = ctx->be->destroy(ctx->be); /* a refused vendor object (an event) is reported, not kept */
    if (rc != NP_OK) np_restore_error(&held); /* memory the device still holds: the first thing to say */
    else if (destroyed != NP_OK) rc = destroyed;
    else if (drained != NP_OK) rc = drained, np_restore_error(&unsynced);
    free(ctx->held);
    free(ctx->spare);
    np_block_cache_destroy(&ctx->blocks);
    np_lifetime_destroy(&ctx->life);
    np_lifetime_destroy(&ctx->places);
    np_ptrmap_destroy(&ctx->live);
  } /* else: the books are dropped (host memory of the child, freed with the process) */
  ctx->be = NULL;
  ctx->held = NULL;
  ctx->n_held = ctx->cap_held = 0;
  ctx->spare = NULL;
  ctx->n_spare = ctx->cap_spare = 0;
  ctx->segments = NULL;
  ctx->pstate = NULL;
  np_ctx_history_free(ctx);
  np_stats zero = {0};
  zero.total = (np_pool_stats){.name = "all"};
  for (int p = 0; p < NP_POOLS; p++) memcpy(zero.pool[p].name, ctx->st.pool[p].name, sizeof zero.pool[p].name);
  zero.policy = ctx->cfg.policy;
  ctx->st = zero;
  ctx->limit = 0;
  ctx->policy = &closed_policy;
  ctx->closed = true;
  return rc;
}

int np_close(np_ctx *ctx) {
  if (!ctx) return NP_OK;
  np_ctx_lock(ctx); /* waits for the call in flight; those queued behind it see `closed` */
  int rc = ctx->closed ? NP_OK : close_locked(ctx);
  np_ctx_unlock(ctx);
  return rc;
}

int np_destroy(np_ctx *ctx) {
  if (!ctx) return NP_OK;
  int rc = np_close(ctx);
  np_ctx_history_free(ctx); /* a history bound set after the close may have grown a ring */
  np_fork_unregister(ctx);
  pthread_mutex_destroy(&ctx->lock);
  free(ctx);
  return rc;
}

int np_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, void **out) {
  return np_malloc_ex(ctx, size, stream, NP_LIFE_AUTO, -1, out);
}

int np_malloc_ex(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out) {
  np_ctx_lock(ctx);
  int rc = np_ctx_malloc(ctx, size, stream, lifetime, site, out);
  np_ctx_unlock(ctx);
  return rc;
}

int np_free(np_ctx *ctx, void *ptr) {
  np_ctx_lock(ctx);
  int rc = np_ctx_free(ctx, ptr);
  np_ctx_unlock(ctx);
  return rc;
}

int np_empty_cache(np_ctx *ctx) {
  np_ctx_lock(ctx);
  int rc = np_ctx_empty_cache(ctx);
  np_ctx_unlock(ctx);
  return rc;
}

int np_compact(np_ctx *ctx, uint64_t *returned) {
  uint64_t ignored;
  np_ctx_lock(ctx);
  int rc = np_ctx_compact(ctx, returned ? returned : &ignored);
  np_ctx_unlock(ctx);
  return rc;
}

/* Whether torch_npu's rules apply: given, or the ACL backend's own. */
static bool npu_rules(const np_ctx *ctx) {
  return ctx->cfg.device_rules == NP_DEVICE_NPU || (ctx->cfg.device_rules == NP_DEVICE_AUTO && ctx->cfg.backend == NP_BACKEND_ACL);
}

int np_set_fraction(np_ctx *ctx, double fraction) {
  int rc = np_check_fraction(fraction);
  if (rc != NP_OK) return rc;
  np_ctx_lock(ctx);
  if (np_ctx_usable(ctx, "set_fraction") != NP_OK) {
    np_ctx_unlock(ctx);
    return NP_ERR_STATE;
  }
  uint64_t limit;
  rc = cap_of(ctx->be, fraction, &limit);
  if (rc != NP_OK) {
    np_ctx_unlock(ctx);
    return rc;
  }
  np_vmm_spares_release(ctx); /* what a smaller cap may no longer hold */
  rc = ctx->policy->set_limit ? ctx->policy->set_limit(ctx, limit) : NP_OK;
  if (rc == NP_OK) {
    ctx->limit = limit;
    ctx->cfg.fraction = fraction;
    /* a fraction set: CUDA's allocator caps itself from now on, even at 1.0; torch_npu's sets no cap at 1.0
     * (setMemoryFraction: a maximum only below 1), the device refusing what it cannot hold */
    ctx->device_caps = ctx->policy->framework && fraction >= 1.0 && npu_rules(ctx);
  }
  np_ctx_unlock(ctx);
  return rc;
}

int np_set_compaction(np_ctx *ctx, int on) {
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "set_compaction");
  const char *why = rc == NP_OK && on ? np_ctx_compaction_refused(ctx) : NULL;
  if (why) rc = np_error(NP_ERR_STATE, "%s", why);
  if (rc == NP_OK) ctx->compact = on != 0;
  np_ctx_unlock(ctx);
  return rc;
}

void np_get_stats(np_ctx *ctx, np_stats *out) {
  np_ctx_lock(ctx);
  if (ctx->closed) { /* zeros: nothing is held any more */
    *out = ctx->st;
    np_stats_fill_active(out);
  } else {
    np_get_stats_locked(ctx, out);
  }
  out->fraction = ctx->cfg.fraction;
  np_ctx_unlock(ctx);
}

/* Every counter of the statistics, for the resets. */
static int counters(np_ctx *ctx, np_counter **c) {
  int n = 0;
  np_pool_stats *ps[NP_POOLS + 1] = {&ctx->st.total, &ctx->st.pool[0], &ctx->st.pool[1]};
  for (int i = 0; i <= NP_POOLS; i++) {
    np_counter *cs[6] = {&ps[i]->allocated, &ps[i]->requested, &ps[i]->active,
                         &ps[i]->reserved, &ps[i]->blocks, &ps[i]->segments};
    for (int j = 0; j < 6; j++) c[n++] = cs[j];
  }
  c[n++] = &ctx->st.arena_hwm;
  return n;
}

void np_reset_peak(np_ctx *ctx) {
  np_ctx_lock(ctx);
  np_stats now = ctx->st; /* the arena's high-water mark is computed when read (not kept): read it */
  if (!ctx->closed) np_get_stats_locked(ctx, &now);
  np_counter *c[6 * (NP_POOLS + 1) + 1];
  for (int i = 0, n = counters(ctx, c); i < n; i++) c[i]->peak = c[i]->current;
  ctx->st.arena_hwm.peak = now.arena_hwm.current;
  np_ctx_unlock(ctx);
}

void np_reset_accumulated(np_ctx *ctx) {
  np_ctx_lock(ctx);
  np_counter *c[6 * (NP_POOLS + 1) + 1];
  for (int i = 0, n = counters(ctx, c); i < n; i++) c[i]->allocated = c[i]->freed = 0;
  np_stats *st = &ctx->st;
  st->ooms = st->retries = st->syncs = st->device_mallocs = st->device_frees = 0;
  for (int k = 0; ctx->be && k < NP_CALL_COUNT; k++) ctx->calls_base[k] = ctx->be->calls[k]; /* closed: no backend */
  np_ctx_unlock(ctx);
}

int np_forget(np_ctx *ctx) {
  np_lifetime fresh, fresh_places;
  if (!np_lifetime_init(&fresh)) return np_error(NP_ERR_HOST, "host out of memory for a lifetime table");
  if (!np_lifetime_init(&fresh_places)) {
    np_lifetime_destroy(&fresh);
    return np_error(NP_ERR_HOST, "host out of memory for a lifetime table");
  }
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "forget");
  if (rc == NP_OK) {
    np_lifetime_destroy(&ctx->life);
    np_lifetime_destroy(&ctx->places);
    ctx->life = fresh;
    ctx->places = fresh_places;
    ctx->marks = (np_marks){0};
    ctx->phase = 0;
    ctx->default_life = ctx->base_life = NP_LIFE_LONG; /* as np_create leaves them */
  }
  np_ctx_unlock(ctx);
  if (rc != NP_OK) {
    np_lifetime_destroy(&fresh);
    np_lifetime_destroy(&fresh_places);
  }
  return rc;
}

int np_set_phase(np_ctx *ctx, uint32_t phase, int default_lifetime) {
  if (default_lifetime < NP_LIFE_AUTO || default_lifetime > NP_LIFE_SHORT)
    return np_error(NP_ERR_INVALID, "default lifetime must be NP_LIFE_AUTO, NP_LIFE_LONG or NP_LIFE_SHORT, got %d",
                    default_lifetime);
  np_ctx_lock(ctx);
  int rc = ctx->closed ? np_ctx_refuse(ctx, "set_phase") : NP_OK;
  if (rc == NP_OK) np_ctx_set_phase(ctx, phase, default_lifetime == NP_LIFE_AUTO ? NP_LIFE_LONG : default_lifetime);
  np_ctx_unlock(ctx);
  return rc;
}

int np_mark(np_ctx *ctx, int code, int64_t arg) {
  np_ctx_lock(ctx);
  int rc = ctx->closed ? np_ctx_refuse(ctx, "mark") : np_ctx_mark(ctx, code, arg);
  np_ctx_unlock(ctx);
  return rc;
}

int np_block_size(np_ctx *ctx, void *ptr, uint64_t *size) {
  *size = 0;
  np_ctx_lock(ctx);
  if (ctx->closed) {
    np_ctx_unlock(ctx);
    return np_ctx_refuse(ctx, "block_size");
  }
  np_block *b = np_ptrmap_find(&ctx->live, (uintptr_t)ptr);
  *size = b ? b->size : 0;
  np_ctx_unlock(ctx);
  return b ? NP_OK : np_error(NP_ERR_UNKNOWN_PTR, "%p is not an allocated block of this pool", ptr);
}

int np_record_stream(np_ctx *ctx, void *ptr, intptr_t stream) {
  np_ctx_lock(ctx);
  if (np_ctx_usable(ctx, "record_stream") != NP_OK) {
    np_ctx_unlock(ctx);
    return NP_ERR_STATE;
  }
  if (np_ctx_check_stream(stream) != NP_OK) {
    np_ctx_unlock(ctx);
    return NP_ERR_INVALID;
  }
  np_block *b = np_ptrmap_find(&ctx->live, (uintptr_t)ptr);
  if (b && stream != b->stream) {
    b->shared = 1;
    if (ctx->policy->record_stream) ctx->policy->record_stream(ctx, b, stream);
  }
  np_ctx_unlock(ctx);
  return b ? NP_OK : np_error(NP_ERR_UNKNOWN_PTR, "record_stream on %p: not an allocated block of this pool", ptr);
}

int np_check(np_ctx *ctx) {
  np_ctx_lock(ctx);
  int rc = ctx->closed || ctx->lost ? np_ctx_refuse(ctx, "check") : np_ctx_check(ctx);
  np_ctx_unlock(ctx);
  return rc;
}

static int seg_cmp(const void *a, const void *b) {
  uintptr_t x = (*(np_segment *const *)a)->addr, y = (*(np_segment *const *)b)->addr;
  return x < y ? -1 : x > y;
}

/* Whether every byte of b is backed by physical memory. */
static bool block_mapped(const np_ctx *ctx, const np_block *b) {
  const np_segment *s = b->seg;
  if (!s->reserved_only) return true;
  uint64_t g = ctx->be->granularity;
  for (uint64_t p = (b->addr - s->addr) / g, end = (b->addr + b->size - 1 - s->addr) / g; p <= end; p++)
    if (!s->pages[p]) return false;
  return true;
}

/* The context's segments in address order (malloc'ed; the caller frees it), or NULL. */
static np_segment **sorted_segments(const np_ctx *ctx, size_t *nseg) {
  size_t n = 0;
  for (np_segment *s = ctx->segments; s; s = s->next) n++;
  np_segment **segs = malloc((n ? n : 1) * sizeof *segs);
  if (!segs) return NULL;
  n = 0;
  for (np_segment *s = ctx->segments; s; s = s->next) segs[n++] = s;
  qsort(segs, n, sizeof *segs, seg_cmp);
  *nseg = n;
  return segs;
}

/* The blocks of every segment, segments in address order: up to cap into out; *n gets them all.
 * (Lock held.) */
static int blocks_locked(const np_ctx *ctx, np_block_info *out, size_t cap, size_t *n) {
  size_t nseg = 0, k = 0;
  np_segment **segs = sorted_segments(ctx, &nseg);
  if (!segs) return np_error(NP_ERR_HOST, "host out of memory listing blocks");
  for (size_t i = 0; i < nseg; i++) {
    for (np_block *b = segs[i]->head; b; b = b->next, k++) {
      if (k >= cap) continue;
      bool tagged = b->allocated || b->stream != NP_STREAM_ANY;
      out[k] = (np_block_info){.segment = segs[i]->addr, .segment_size = segs[i]->size, .addr = b->addr,
                               .size = b->size, .requested = b->allocated ? b->requested : 0,
                               .stream = tagged ? b->stream : 0, .site = b->allocated ? b->site : -1,
                               .pool = b->pool, .allocated = b->allocated, .mapped = block_mapped(ctx, b),
                               .tagged = !b->allocated && tagged, .vmm = segs[i]->reserved_only};
    }
  }
  *n = k;
  free(segs);
  return NP_OK;
}

int np_blocks(np_ctx *ctx, np_block_info *out, size_t cap, size_t *n) {
  *n = 0;
  if (cap && !out) return np_error(NP_ERR_INVALID, "np_blocks: no buffer for %zu entries", cap);
  np_ctx_lock(ctx);
  int rc = ctx->closed ? np_ctx_refuse(ctx, "blocks") : blocks_locked(ctx, out, cap, n);
  np_ctx_unlock(ctx);
  return rc;
}

/* Emit the mapped runs of one segment into out[2k], out[2k+1]; returns the new count. */
static size_t segment_runs(const np_ctx *ctx, const np_segment *s, uint64_t *out, size_t cap, size_t k) {
  if (!s->reserved_only) {
    if (k < cap) out[2 * k] = s->addr, out[2 * k + 1] = s->size;
    return k + 1;
  }
  uint64_t g = ctx->be->granularity, pages = s->size / g;
  for (uint64_t p = 0; s->mapped && p < pages; p++) {
    if (!s->pages[p]) continue;
    uint64_t q = p;
    while (q < pages && s->pages[q]) q++;
    if (k < cap) out[2 * k] = s->addr + p * g, out[2 * k + 1] = (q - p) * g;
    k++;
    p = q;
  }
  return k;
}

/* The mapped ranges of every segment, in address order: up to cap pairs into out; *n gets them all.
 * (Lock held.) */
static int ranges_locked(const np_ctx *ctx, uint64_t *out, size_t cap, size_t *n) {
  size_t nseg = 0, k = 0;
  np_segment **segs = sorted_segments(ctx, &nseg);
  if (!segs) return np_error(NP_ERR_HOST, "host out of memory listing mapped ranges");
  for (size_t i = 0; i < nseg; i++) k = segment_runs(ctx, segs[i], out, cap, k);
  *n = k;
  free(segs);
  return NP_OK;
}

int np_mapped_ranges(np_ctx *ctx, uint64_t *out, size_t cap, size_t *n) {
  *n = 0;
  if (cap && !out) return np_error(NP_ERR_INVALID, "np_mapped_ranges: no buffer for %zu entries", cap);
  np_ctx_lock(ctx);
  int rc = ctx->closed ? np_ctx_refuse(ctx, "mapped_ranges") : ranges_locked(ctx, out, cap, n);
  np_ctx_unlock(ctx);
  return rc;
}

int np_view(np_ctx *ctx, np_stats *stats, np_block_info *blocks, size_t bcap, size_t *nb, uint64_t *ranges,
            size_t rcap, size_t *nr, np_event_info *events, size_t ecap, size_t *ne) {
  *nb = *nr = *ne = 0;
  if ((bcap && !blocks) || (rcap && !ranges) || (ecap && !events))
    return np_error(NP_ERR_INVALID, "np_view: a part has a capacity and no buffer");
  np_ctx_lock(ctx);
  if (ctx->closed) {
    np_ctx_unlock(ctx);
    return np_ctx_refuse(ctx, "view");
  }
  np_get_stats_locked(ctx, stats);
  stats->fraction = ctx->cfg.fraction;
  int rc = blocks_locked(ctx, blocks, bcap, nb);
  if (rc == NP_OK) rc = ranges_locked(ctx, ranges, rcap, nr);
  *ne = np_ctx_history_copy(ctx, NULL, 0);
  if (rc == NP_OK && *nb <= bcap && *nr <= rcap) np_ctx_history_copy(ctx, events, ecap);
  np_ctx_unlock(ctx);
  return rc;
}
