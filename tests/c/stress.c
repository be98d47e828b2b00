/* stress.c -- the core under a debug build (NP_DEBUG asserts) and the sanitizers:
 * random malloc/free/empty_cache/fraction/record_stream sequences on every policy, and on
 * the policies that compact with compaction on (np_set_compaction: live bytes moved through
 * the host, which the simulated device's unmap discards), np_check() after each step, every
 * live block's first and last byte checked on host-backed memory. Exit 0 only if every
 * invariant held. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npu_pool.h"

#define STEPS 20000
#define MAX_LIVE 512

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static int fail(const char *what, int policy, int step) {
  fprintf(stderr, "stress: %s (policy %s, step %d): %s\n", what, np_policy_name(policy), step, np_last_error());
  return 1;
}

static int run(int policy, int compact) {
  np_config cfg;
  np_config_init(&cfg);
  cfg.policy = policy;
  cfg.capacity = 256ull << 20;
  cfg.host_backed = 1;
  np_ctx *ctx;
  if (np_create(&cfg, &ctx) != NP_OK) return fail("create", policy, -1);
  if (compact && np_set_compaction(ctx, 1) != NP_OK) return fail("set_compaction", policy, -1);
  struct { unsigned char *p; uint64_t size; unsigned char fill; } live[MAX_LIVE];
  int n = 0;
  for (int step = 0; step < STEPS; step++) {
    uint64_t r = next() % 100;
    if (r < 45 && n < MAX_LIVE) {
      uint64_t kind = next() % 3;
      uint64_t size = 1 + next() % (kind == 0 ? 4096 : kind == 1 ? (1u << 20) : (24u << 20));
      void *p;
      int rc = np_malloc_ex(ctx, size, (intptr_t)(next() % 3), (int)(next() % 3), (int32_t)(next() % 8), &p);
      if (rc == NP_ERR_OOM) continue;
      if (rc != NP_OK) return fail("malloc", policy, step);
      unsigned char fill = (unsigned char)(1 + next() % 255);
      ((unsigned char *)p)[0] = fill;
      ((unsigned char *)p)[size - 1] = fill;
      live[n].p = p;
      live[n].size = size;
      live[n].fill = fill;
      n++;
    } else if (r < 90 && n > 0) {
      int i = (int)(next() % (uint64_t)n);
      if (live[i].p[0] != live[i].fill || live[i].p[live[i].size - 1] != live[i].fill) return fail("overwritten", policy, step);
      if (next() % 8 == 0 && np_record_stream(ctx, live[i].p, 9) != NP_OK) return fail("record_stream", policy, step);
      if (np_free(ctx, live[i].p) != NP_OK) return fail("free", policy, step);
      if (np_free(ctx, live[i].p) != NP_ERR_DOUBLE_FREE) return fail("double free not caught", policy, step);
      live[i] = live[--n];
    } else if (r < 93) {
      if (np_empty_cache(ctx) != NP_OK) return fail("empty_cache", policy, step);
    } else if (r < 95) {
      if (np_set_fraction(ctx, 0.25 + (double)(next() % 4) * 0.25) != NP_OK) return fail("fraction", policy, step);
    } else if (r < 96) {
      if (np_mark(ctx, (int)(next() % NP_MARK_COUNT), -1) != NP_OK) return fail("mark", policy, step);
    }
    if (step % 97 == 0 && np_check(ctx) != NP_OK) return fail("check", policy, step);
  }
  for (int i = 0; i < n; i++)
    if (np_free(ctx, live[i].p) != NP_OK) return fail("final free", policy, STEPS);
  if (np_empty_cache(ctx) != NP_OK || np_check(ctx) != NP_OK) return fail("final check", policy, STEPS);
  np_stats st;
  np_get_stats(ctx, &st);
  if (st.total.reserved.current != 0 || st.total.allocated.current != 0) return fail("memory left reserved", policy, STEPS);
  if (np_destroy(ctx) != NP_OK) return fail("destroy", policy, STEPS);
  printf("%s%s: %llu allocs, %llu ooms, peak reserved %llu, %llu compactions\n", np_policy_name(policy),
         compact ? " compacting" : "", (unsigned long long)st.allocs, (unsigned long long)st.ooms,
         (unsigned long long)st.total.reserved.peak, (unsigned long long)st.compactions);
  if (compact && !st.compactions) return fail("no compaction ran", policy, STEPS);
  return 0;
}

int main(void) {
  for (int policy = 0; policy < np_policy_count(); policy++)
    if (run(policy, 0)) return 1;
  if (run(np_policy_index("npu_pool"), 1) || run(np_policy_index("planned"), 1)) return 1;
  return 0;
}
