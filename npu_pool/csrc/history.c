/* history.c -- the context's event history: what happened to memory, in order, like PyTorch's
 * TraceEntry list (allocations, frees, segments allocated, mapped, unmapped and freed, cache
 * releases, failed requests, markers). Reports, memory_viz snapshots and OOM snapshots read it.
 *
 * A ring of the latest hist_max events (entry seq % hist_slots); its slots are allocated at the
 * first event (NP_HISTORY_DEFAULT of them, or hist_max if less: the default ring is never copied)
 * and grow by doubling up to hist_max as events come, so a large bound costs memory only when
 * used. A failure to grow keeps the ring as it is (older events are overwritten sooner).
 * hist_max 0 records nothing.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "context.h"

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Microseconds since the context was created (out of line: the clock is read outside replays only). */
__attribute__((noinline)) static uint64_t clock_us(const np_ctx *ctx) { return (now_ns() - ctx->t0_ns) / 1000; }

/* The ring is exactly full and never wrapped (n_events == hist_slots): double it, up to
 * hist_max, so that the ring's order stays the array's. A failure keeps the ring as it is.
 * Out of line: it runs a few times in a context's life, np_ctx_event on every malloc and free. */
__attribute__((noinline, cold)) static void grow(np_ctx *ctx) {
  if (ctx->hist_slots >= ctx->hist_max) return;
  uint64_t slots = np_min_u64(ctx->hist_slots ? 2 * ctx->hist_slots : NP_HISTORY_DEFAULT, ctx->hist_max);
  np_event_info *h = realloc(ctx->hist, slots * sizeof *h);
  if (!h) return;
  ctx->hist = h;
  ctx->hist_slots = slots;
  ctx->hist_next = ctx->n_events; /* < slots: the slot after the old end */
}

np_event_info *np_ctx_event(np_ctx *ctx, int kind) {
  if (ctx->n_events == ctx->hist_slots) grow(ctx);
  if (!ctx->hist_slots) {
    ctx->n_events++;
    return NULL;
  }
  NP_ASSERT(ctx->hist_next == ctx->n_events % ctx->hist_slots);
  np_event_info *e = &ctx->hist[ctx->hist_next]; /* hist_next: n_events % hist_slots, kept without a division */
  if (++ctx->hist_next == ctx->hist_slots) ctx->hist_next = 0;
  *e = (np_event_info){.seq = ctx->n_events++, .time = (uint64_t)ctx->replay_time, .kind = (uint8_t)kind};
  if (ctx->replay_time < 0) e->time = clock_us(ctx); /* in replays, the trace event's index */
  return e;
}

void np_ctx_record_oom(np_ctx *ctx, uint64_t size, intptr_t stream, int32_t site, int lifetime, int pool, int why,
                       uint64_t device_free, uint64_t compactable) {
  np_event_info *e = np_ctx_event(ctx, NP_EV_OOM);
  if (!e) return;
  e->size = size;
  e->stream = stream;
  e->site = site;
  e->pool = (uint8_t)(pool >= 0 && pool < NP_POOLS ? pool : NP_POOLS);
  e->lifetime = (uint8_t)lifetime;
  e->detail = (uint8_t)why;
  e->device_free = device_free;
  e->compactable = compactable;
  e->addr = ctx->st.total.reserved.current; /* (what held_outside is computed against) */
}

uint64_t np_history_max(void) { return ((uint64_t)1 << 40) / sizeof(np_event_info); }

int np_ctx_set_history(np_ctx *ctx, uint64_t max_entries) {
  if (max_entries > np_history_max())
    return np_error(NP_ERR_INVALID, "history of %llu events is absurd (at most 2^40 bytes of history)",
                    (unsigned long long)max_entries);
  free(ctx->hist);
  ctx->hist = NULL;
  ctx->hist_slots = ctx->hist_next = 0;
  ctx->hist_max = max_entries;
  ctx->n_events = 0;
  if (!ctx->t0_ns) ctx->t0_ns = now_ns();
  return NP_OK;
}

void np_ctx_history_free(np_ctx *ctx) {
  free(ctx->hist);
  ctx->hist = NULL;
  ctx->hist_slots = ctx->hist_max = ctx->hist_next = 0;
}

size_t np_ctx_history_copy(const np_ctx *ctx, np_event_info *out, size_t cap) {
  uint64_t kept = np_min_u64(ctx->n_events, ctx->hist_slots);
  if (!out) return kept;
  if (cap > kept) cap = kept;
  for (size_t i = 0; i < cap; i++) out[i] = ctx->hist[(ctx->n_events - cap + i) % ctx->hist_slots];
  return cap;
}

int np_history(np_ctx *ctx, np_event_info *out, size_t cap, size_t *n) {
  *n = 0;
  if (cap && !out) return np_error(NP_ERR_INVALID, "np_history: no buffer for %zu entries", cap);
  np_ctx_lock(ctx);
  *n = out ? np_ctx_history_copy(ctx, out, cap) : 0; /* (none copied: NULL asks the count of those kept) */
  pthread_mutex_unlock(&ctx->lock);
  return NP_OK;
}

int np_set_history(np_ctx *ctx, uint64_t max_entries) {
  np_ctx_lock(ctx);
  int rc = np_ctx_set_history(ctx, max_entries);
  pthread_mutex_unlock(&ctx->lock);
  return rc;
}
