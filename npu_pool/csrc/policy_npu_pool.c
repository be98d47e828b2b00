/* policy_npu_pool.c -- the npu_pool policy: one arena per device, lifetime-aware placement
 * (arena.h has the rules). Long-lived and short-lived requests are placement classes inside
 * one arena, not separately cached segment sets (two caches hoard memory the other could
 * use); a separate arena for small requests was measured (docs/policies.md): it helps
 * inference traces and hurts training ones about as much, so there is one. */
#include <stdlib.h>

#include "policy.h"
#include "tags.h"

enum { LONG_POOL = 0, SHORT_POOL = 1 };

/* The main arena, and the tags' arenas (tags.h: tagged regions, pause and resume). */
typedef struct npu_pool_state {
  np_arena main;
  np_tagset tags;
} npu_pool_state;

static npu_pool_state *state(np_ctx *ctx) { return (npu_pool_state *)ctx->pstate; }
static np_arena *arena(np_ctx *ctx) { return &state(ctx)->main; }
static np_tagset *tags(np_ctx *ctx) { return &state(ctx)->tags; }
/* The arena that owns b. */
static np_arena *owner(np_ctx *ctx, const np_block *b) {
  np_arena *a = np_tags_owner(tags(ctx), b);
  return a ? a : arena(ctx);
}

static int npu_pool_init(np_ctx *ctx) {
  npu_pool_state *s = calloc(1, sizeof *s);
  if (!s) return np_error(NP_ERR_HOST, "host out of memory");
  np_arena_init(ctx, &s->main);
  np_tags_init(ctx, &s->tags);
  ctx->pstate = s;
  return NP_OK;
}

static void npu_pool_destroy(np_ctx *ctx) {
  np_tags_drop(ctx, tags(ctx));
  np_arena_drop(ctx, arena(ctx));
  free(ctx->pstate);
}

static int npu_pool_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, np_block **out) {
  int rc = np_tags_malloc(ctx, tags(ctx), arena(ctx), size, stream, lifetime != NP_LIFE_SHORT, out);
  if (rc == NP_OK) (*out)->pool = lifetime == NP_LIFE_SHORT ? SHORT_POOL : LONG_POOL;
  return rc;
}

static void npu_pool_free(np_ctx *ctx, np_block *b) { np_arena_free(ctx, owner(ctx, b), b); }
static int npu_pool_empty_cache(np_ctx *ctx) { return np_tags_empty_cache(ctx, tags(ctx), arena(ctx)); }
static int npu_pool_compact(np_ctx *ctx) { return np_tags_compact(ctx, tags(ctx), arena(ctx), NULL); }
static uint64_t npu_pool_pinned(np_ctx *ctx) { return np_tags_pinned(ctx, tags(ctx), arena(ctx)); }
static int npu_pool_set_limit(np_ctx *ctx, uint64_t limit) { (void)limit; return np_arena_set_limit(ctx, arena(ctx)); }
static void npu_pool_fill_stats(np_ctx *ctx, np_stats *st) { np_tags_fill_stats(ctx, tags(ctx), arena(ctx), st); }
static int npu_pool_check(np_ctx *ctx) { return np_tags_check(ctx, tags(ctx), arena(ctx)); }
static void npu_pool_record_stream(np_ctx *ctx, np_block *b, intptr_t stream) {
  np_arena_record_stream(owner(ctx, b), stream);
}
static int npu_pool_region(np_ctx *ctx, const char *tag) { return np_tags_region(ctx, tags(ctx), tag); }
static int npu_pool_pause(np_ctx *ctx, const char *tag, bool backup, uint64_t *bytes) {
  return np_tags_pause(ctx, tags(ctx), tag, backup, bytes);
}
static int npu_pool_resume(np_ctx *ctx, const char *tag, uint64_t *bytes) {
  return np_tags_resume(ctx, tags(ctx), arena(ctx), tag, bytes);
}
static int npu_pool_tags(np_ctx *ctx, np_tag_info *out, size_t cap, size_t *n) {
  return np_tags_info(ctx, tags(ctx), out, cap, n);
}
static int npu_pool_set_backup_limit(np_ctx *ctx, uint64_t bytes) {
  np_tags_set_backup_limit(ctx, tags(ctx), bytes);
  return NP_OK;
}

const np_policy np_policy_npu_pool = {
    .name = "npu_pool",
    .summary = "one arena per device: best fit, long-lived tensors low in holes and short-lived high, pages mapped "
               "on demand and trimmed under the cap",
    .pool_name = {"long", "short"},
    .pool_meaning = {"long-lived tensors: weights, gradients, optimizer states, activations kept for backward",
                     "short-lived tensors: temporaries that die inside the stage that made them"},
    .orders_streams = true,
    .keeps_places = true,
    .init = npu_pool_init,
    .destroy = npu_pool_destroy,
    .malloc = npu_pool_malloc,
    .free = npu_pool_free,
    .empty_cache = npu_pool_empty_cache,
    .compact = npu_pool_compact,
    .pinned = npu_pool_pinned,
    .set_limit = npu_pool_set_limit,
    .fill_stats = npu_pool_fill_stats,
    .check = npu_pool_check,
    .record_stream = npu_pool_record_stream,
    .region = npu_pool_region,
    .pause = npu_pool_pause,
    .resume = npu_pool_resume,
    .tags = npu_pool_tags,
    .set_backup_limit = npu_pool_set_backup_limit,
};
