/* policy_npu_pool.c -- the npu_pool policy: one arena per device, lifetime-aware placement
 * (arena.h has the rules). Long-lived and short-lived requests are placement classes inside
 * one arena, not separately cached segment sets (two caches hoard memory the other could
 * use); a separate arena for small requests was measured (docs/policies.md): it helps
 * inference traces and hurts training ones about as much, so there is one. */
#include <stdlib.h>

#include "arena.h"
#include "policy.h"

enum { LONG_POOL = 0, SHORT_POOL = 1 };

static np_arena *arena(np_ctx *ctx) { return (np_arena *)ctx->pstate; }

static int npu_pool_init(np_ctx *ctx) {
  np_arena *a = calloc(1, sizeof *a);
  if (!a) return np_error(NP_ERR_HOST, "host out of memory");
  np_arena_init(ctx, a);
  ctx->pstate = a;
  return NP_OK;
}

static void npu_pool_destroy(np_ctx *ctx) {
  np_arena_drop(ctx, arena(ctx));
  free(ctx->pstate);
}

static int npu_pool_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, np_block **out) {
  int rc = np_arena_malloc(ctx, arena(ctx), size, stream, lifetime != NP_LIFE_SHORT, out);
  if (rc == NP_OK) (*out)->pool = lifetime == NP_LIFE_SHORT ? SHORT_POOL : LONG_POOL;
  return rc;
}

static void npu_pool_free(np_ctx *ctx, np_block *b) { np_arena_free(ctx, arena(ctx), b); }
static int npu_pool_empty_cache(np_ctx *ctx) { return np_arena_empty_cache(ctx, arena(ctx)); }
static int npu_pool_set_limit(np_ctx *ctx, uint64_t limit) { (void)limit; return np_arena_set_limit(ctx, arena(ctx)); }
static void npu_pool_fill_stats(np_ctx *ctx, np_stats *st) { np_arena_fill_stats(ctx, arena(ctx), st); }
static int npu_pool_check(np_ctx *ctx) { return np_arena_check(ctx, arena(ctx)); }
static void npu_pool_record_stream(np_ctx *ctx, np_block *b, intptr_t stream) {
  (void)b;
  np_arena_record_stream(arena(ctx), stream);
}

const np_policy np_policy_npu_pool = {
    .name = "npu_pool",
    .summary = "one arena per device: best fit, long-lived tensors low in holes and short-lived high, pages mapped "
               "on demand and trimmed under the cap",
    .pool_name = {"long", "short"},
    .pool_meaning = {"long-lived tensors: weights, gradients, optimizer states, activations kept for backward",
                     "short-lived tensors: temporaries that die inside the stage that made them"},
    .orders_streams = true,
    .init = npu_pool_init,
    .destroy = npu_pool_destroy,
    .malloc = npu_pool_malloc,
    .free = npu_pool_free,
    .empty_cache = npu_pool_empty_cache,
    .set_limit = npu_pool_set_limit,
    .fill_stats = npu_pool_fill_stats,
    .check = npu_pool_check,
    .record_stream = npu_pool_record_stream,
};
