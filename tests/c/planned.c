/* planned.c -- the planned policy under a debug build and the sanitizers: a random plan,
 * iterations that follow it, miss requests, change sizes and add extra ones; every block
 * checked for overwrites. Exit 0 only if requests were served from the plan, fell back
 * and used idle ranges, with every invariant holding. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "npu_pool.h"
#include "plan.h"

#define N 240
#define ITERS 40
static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
typedef struct { unsigned char *p; uint64_t size, due; unsigned char fill; } live_t;
static live_t live[8 * N];
static int n_live;

static int fail(const char *what, np_ctx *ctx) {
  fprintf(stderr, "planned: %s: %s\n", what, np_last_error());
  (void)ctx;
  return 1;
}

static int release(np_ctx *ctx, int i) {
  live_t *l = &live[i];
  for (uint64_t k = 0; k < l->size; k += 4093)
    if (l->p[k] != l->fill) return fail("a planned block was overwritten", ctx);
  if (l->p[l->size - 1] != l->fill) return fail("a planned block was overwritten", ctx);
  if (np_free(ctx, l->p) != NP_OK) return fail("free", ctx);
  live[i] = live[--n_live];
  return 0;
}

int main(void) {
  uint64_t size[N], end[N], offset[N], rounded[N], peak;
  uint32_t span[4 * N], order[N];
  for (uint32_t p = 0; p < N; p++) {
    size[p] = p % 8 == 5 ? (1 << 20) + next() % (3 << 20) : 1 + next() % (1 << 18); /* some of a page or more */
    end[p] = p + 1 + next() % (p % 9 == 0 ? N : 12);      /* some live long, some wrap */
    rounded[p] = (size[p] + 511) / 512 * 512;
    np_span s = np_plan_span(N, 0, p, end[p]);
    span[4 * p] = s.lo, span[4 * p + 1] = s.hi, span[4 * p + 2] = s.lo2, span[4 * p + 3] = s.hi2;
    order[p] = (p * 7919u) % N;
  }
  if (np_plan_place(N, N, rounded, span, order, offset, &peak) != NP_OK) return fail("place", NULL);
  np_config cfg;
  np_config_init(&cfg);
  cfg.policy = np_policy_index("planned");
  cfg.capacity = 1ull << 30;
  cfg.host_backed = 1;
  np_ctx *ctx;
  if (np_create(&cfg, &ctx) != NP_OK) return fail("create", NULL);
  if (np_set_plan(ctx, N, 0, size, offset, end, peak, 0, 1, NULL) != NP_OK) return fail("set_plan", ctx);
  uint64_t step = 0;
  for (int it = 0; it < ITERS; it++) {
    if (np_mark(ctx, NP_MARK_ITER_BEGIN, it) != NP_OK) return fail("mark", ctx);
    for (uint32_t p = 0; p < N; p++, step++) {
      for (int i = 0; i < n_live;)
        if (live[i].due <= step) { if (release(ctx, i)) return 1; } else i++;
      uint64_t r = next() % 100, sz = size[p], life = end[p] - p;
      if (it > 2 && r < 4) continue;                                  /* a request goes missing */
      if (it > 2 && r < 10) sz = 1 + next() % (2 * size[p]);          /* a dynamic size, about the planned one */
      if (it > 2 && r >= 97) { sz = 1 + next() % 5000; life = 1 + next() % (2 * N); } /* an extra one */
      void *ptr;
      if (np_malloc(ctx, sz, 0, &ptr) != NP_OK) return fail("malloc", ctx);
      live_t *l = &live[n_live++];
      *l = (live_t){ptr, sz, step + life, (unsigned char)(next() | 1)};
      memset(l->p, l->fill, sz);
      if (next() % 50 == 0 && np_record_stream(ctx, ptr, 7) != NP_OK) return fail("record_stream", ctx);
      if (next() % 61 == 0 && np_check(ctx) != NP_OK) return fail("check", ctx);
    }
    if (it % 13 == 12 && np_empty_cache(ctx) != NP_OK) return fail("empty_cache", ctx);
  }
  while (n_live)
    if (release(ctx, 0)) return 1;
  uint64_t counts[4];
  if (np_set_plan(ctx, 0, 0, NULL, NULL, NULL, 0, 0, 0, counts) != NP_OK) return fail("counts", ctx);
  if (np_empty_cache(ctx) != NP_OK || np_check(ctx) != NP_OK) return fail("final check", ctx);
  np_stats st;
  np_get_stats(ctx, &st);
  if (st.total.reserved.current || st.total.allocated.current) return fail("memory left reserved", ctx);
  if (np_destroy(ctx) != NP_OK) return fail("destroy", ctx);
  printf("served %llu fallback %llu idle %llu resyncs %llu\n", (unsigned long long)counts[0],
         (unsigned long long)counts[1], (unsigned long long)counts[2], (unsigned long long)counts[3]);
  return counts[0] && counts[1] && counts[2] ? 0 : 2;
}
