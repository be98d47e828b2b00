/* policy_torch.c -- a faithful model of PyTorch's CUDA caching allocator
 * (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator, without
 * expandable segments): the baseline every benchmark compares against.
 *
 *  - sizes round up to 512 bytes; requests <= 1 MiB use the small pool,
 *    served from 2 MiB segments; larger ones the large pool, served from
 *    20 MiB segments below 10 MiB and from exact 2 MiB-rounded segments above;
 *  - a request takes the smallest cached block of its pool and stream that
 *    fits (lowest address on ties); large blocks split only when more than
 *    1 MiB would remain, small ones whenever 512 bytes remain;
 *  - with max_split_size set, blocks that big are never split nor handed to
 *    smaller requests, and large requests skip blocks 20 MiB too big;
 *  - on failure it frees cached oversize blocks (max_split_size only), then
 *    every cached segment, and retries once; freed blocks merge with free
 *    neighbours of their segment.
 * Under torch_npu's rules (np_config.device_rules = NP_DEVICE_NPU) the context pads every
 * request to round_up(r, 32) + 32 before it reaches this policy, as torch_npu's round_size()
 * does: rounding and pool choice below then see the padded size, and the model is torch_npu's
 * NPUCachingAllocator, whose defaults are otherwise CUDA's (docs/policies.md lists each
 * difference and where it lives).
 * Invariant: every free block is in its pool's tree; no two free neighbours.
 */
#include <stdlib.h>

#include "policy.h"
#include "tree.h"

#define K_SMALL_SIZE (1 * NP_MIB)
#define K_SMALL_BUFFER (2 * NP_MIB)
#define K_LARGE_BUFFER (20 * NP_MIB)
#define K_MIN_LARGE_ALLOC (10 * NP_MIB)
#define K_ROUND_LARGE (2 * NP_MIB)

enum { SMALL = 0, LARGE = 1 };

typedef struct torch_state {
  np_tree pools[2];
  uint64_t max_split; /* UINT64_MAX when unset */
} torch_state;

static torch_state *state(np_ctx *ctx) { return (torch_state *)ctx->pstate; }

static uint64_t round_size(uint64_t size) { return size < NP_MIN_BLOCK ? NP_MIN_BLOCK : np_round_up(size, NP_MIN_BLOCK); }

static uint64_t allocation_size(uint64_t size) {
  if (size <= K_SMALL_SIZE) return K_SMALL_BUFFER;
  if (size < K_MIN_LARGE_ALLOC) return K_LARGE_BUFFER;
  return np_round_up(size, K_ROUND_LARGE);
}

static int torch_init(np_ctx *ctx) {
  torch_state *ts = calloc(1, sizeof *ts);
  if (!ts) return np_error(NP_ERR_HOST, "host out of memory");
  ts->max_split = ctx->cfg.max_split_size ? ctx->cfg.max_split_size : UINT64_MAX;
  if (ctx->cfg.max_split_size && ctx->cfg.max_split_size <= K_LARGE_BUFFER) {
    free(ts);
    return np_error(NP_ERR_INVALID, "max_split_size must be more than 20 MiB (as in PyTorch), got %llu",
                    (unsigned long long)ctx->cfg.max_split_size);
  }
  ctx->pstate = ts;
  return NP_OK;
}

/* Return every segment, allocated or not, to the device (context teardown). */
static void release_all(np_ctx *ctx) {
  while (ctx->segments) np_segment_drop(ctx, ctx->segments);
}

static void torch_destroy(np_ctx *ctx) {
  release_all(ctx);
  free(ctx->pstate);
}

static np_block *get_free_block(torch_state *ts, int pool, intptr_t stream, uint64_t size) {
  np_block *b = np_tree_best_fit(&ts->pools[pool], stream, size);
  if (!b) return NULL;
  if (size < ts->max_split && b->size >= ts->max_split) return NULL;           /* oversize block, small request */
  if (size >= ts->max_split && b->size >= size + K_LARGE_BUFFER) return NULL; /* far too large */
  np_tree_remove(&ts->pools[pool], b);
  return b;
}

static int alloc_block(np_ctx *ctx, int pool, intptr_t stream, uint64_t alloc_size, np_block **out) {
  np_segment *seg;
  int rc = np_segment_create(ctx, alloc_size, stream, pool, false, &seg);
  *out = seg ? seg->head : NULL;
  return rc;
}

static bool is_whole_segment(const np_block *b) { return !b->prev && !b->next; }

static void release_block(np_ctx *ctx, np_block *b) {
  np_tree_remove(&state(ctx)->pools[b->pool], b);
  np_segment_destroy(ctx, b->seg);
}

/* Where the vendor's free does not wait for the device (aclrtFree), torch_npu synchronises it once
 * before releasing cached segments (release_available_cached_blocks, release_cached_blocks), whether
 * or not any is then freed; PyTorch on CUDA leaves that to cudaFree. */
static void sync_before_release(np_ctx *ctx) {
  if (!ctx->be->free_synchronizes) np_ctx_synchronize(ctx); /* a failure shows in the free that follows */
}

/* Free cached oversize blocks of this pool and stream, largest first, until `size` is covered. */
static bool release_available(np_ctx *ctx, int pool, intptr_t stream, uint64_t size) {
  torch_state *ts = state(ctx);
  if (ts->max_split == UINT64_MAX) return false;
  sync_before_release(ctx);
  uint64_t key = size < ts->max_split ? ts->max_split : size;
  np_block *b = np_tree_best_fit(&ts->pools[pool], stream, key);
  if (b) {
    if (!is_whole_segment(b)) return false;
    release_block(ctx, b);
    return true;
  }
  uint64_t released = 0;
  while (released < key) {
    np_block *big = NULL; /* largest whole-segment block of this stream >= max_split */
    np_block *cand = np_tree_lower_bound(&ts->pools[pool], stream, ts->max_split);
    for (; cand && cand->stream == stream;) {
      if (is_whole_segment(cand)) big = cand;
      np_block *next = np_tree_lower_bound(&ts->pools[pool], stream, cand->size + 1);
      cand = next;
    }
    if (!big) break;
    released += big->size;
    release_block(ctx, big);
  }
  return released >= key;
}

/* Free every cached segment that holds no allocated block. */
static void release_cached(np_ctx *ctx) {
  for (np_segment *s = ctx->segments, *n; s; s = n) {
    n = s->next;
    if (is_whole_segment(s->head) && !s->head->allocated) release_block(ctx, s->head);
  }
}

static int finish(np_ctx *ctx, np_block *b, uint64_t size, np_block **out) {
  torch_state *ts = state(ctx);
  uint64_t remaining = b->size - size;
  bool split = b->pool == SMALL ? remaining >= NP_MIN_BLOCK : size < ts->max_split && remaining > K_SMALL_SIZE;
  if (split) {
    if (!np_block_split(&ctx->blocks, b, size, false)) {
      np_tree_insert(&ts->pools[b->pool], b);
      return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    }
    np_tree_insert(&ts->pools[b->pool], b->next);
  }
  *out = b;
  return NP_OK;
}

static int torch_malloc(np_ctx *ctx, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  (void)lifetime;
  torch_state *ts = state(ctx);
  uint64_t size = round_size(req);
  int pool = size <= K_SMALL_SIZE ? SMALL : LARGE;
  uint64_t asize = allocation_size(size);
  np_block *b = get_free_block(ts, pool, stream, size);
  int rc = NP_OK;
  if (!b) rc = alloc_block(ctx, pool, stream, asize, &b);
  if (!b && rc == NP_ERR_OOM && release_available(ctx, pool, stream, size)) rc = alloc_block(ctx, pool, stream, asize, &b);
  if (!b && rc == NP_ERR_OOM) {
    sync_before_release(ctx);
    release_cached(ctx);
    ctx->st.retries++;
    rc = alloc_block(ctx, pool, stream, asize, &b);
  }
  if (!b && rc == NP_ERR_OOM) { /* what the pool could have used: its cached free blocks, and room under the cap */
    uint64_t reserved = ctx->st.total.reserved.current;
    ctx->fail = (np_fail){.pool = pool, .needed = asize, .refused = ctx->fail.refused,
                          .usable = ts->pools[pool].bytes + (ctx->limit > reserved ? ctx->limit - reserved : 0)};
  }
  if (!b) return rc;
  return finish(ctx, b, size, out);
}

static void torch_free(np_ctx *ctx, np_block *b) {
  torch_state *ts = state(ctx);
  np_tree *t = &ts->pools[b->pool];
  if (b->prev && !b->prev->allocated) {
    np_block *p = b->prev;
    np_tree_remove(t, p);
    np_block_merge_next(&ctx->blocks, p);
    b = p;
  }
  if (b->next && !b->next->allocated) {
    np_tree_remove(t, b->next);
    np_block_merge_next(&ctx->blocks, b);
  }
  np_tree_insert(t, b);
}

static int torch_empty_cache(np_ctx *ctx) {
  release_cached(ctx);
  return NP_OK;
}

static void torch_fill_stats(np_ctx *ctx, np_stats *st) {
  for (int p = 0; p < 2; p++) {
    st->largest_free = np_max_u64(st->largest_free, np_tree_max_size(&state(ctx)->pools[p]));
  }
  for (np_segment *s = ctx->segments; s; s = s->next) /* what release_cached frees */
    if (is_whole_segment(s->head) && !s->head->allocated) st->releasable += s->size;
}

static int torch_check(np_ctx *ctx) {
  torch_state *ts = state(ctx);
  size_t free_blocks[2] = {0, 0};
  for (int p = 0; p < 2; p++)
    if (!np_tree_check(&ts->pools[p])) return np_error(NP_ERR_STATE, "check: torch pool %d tree is corrupt", p);
  for (np_segment *s = ctx->segments; s; s = s->next) {
    for (np_block *b = s->head; b; b = b->next) {
      if (b->pool != s->pool || b->stream != s->stream)
        return np_error(NP_ERR_STATE, "check: block %#lx has another pool or stream than its segment", (unsigned long)b->addr);
      if (b->allocated) continue;
      if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free block %#lx not in its pool", (unsigned long)b->addr);
      if (b->next && !b->next->allocated) return np_error(NP_ERR_STATE, "check: free neighbours not merged at %#lx", (unsigned long)b->addr);
      free_blocks[b->pool]++;
    }
  }
  for (int p = 0; p < 2; p++)
    if (free_blocks[p] != ts->pools[p].count) return np_error(NP_ERR_STATE, "check: torch pool %d holds stray blocks", p);
  return NP_OK;
}

static int torch_prime_segment(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, int pool) {
  if (pool != SMALL && pool != LARGE) return np_error(NP_ERR_INVALID, "segment pool must be 0 (small) or 1 (large)");
  if (ctx->be->hint_addr) ctx->be->hint_addr(ctx->be, addr);
  np_block *b;
  int rc = alloc_block(ctx, pool, stream, size, &b);
  if (rc != NP_OK) return rc;
  if (b->addr != addr) {
    np_segment_destroy(ctx, b->seg);
    return np_error(NP_ERR_STATE, "the backend could not place a segment at the recorded address %#lx", (unsigned long)addr);
  }
  np_tree_insert(&state(ctx)->pools[pool], b);
  return NP_OK;
}

/* Place a block at a recorded address inside a primed segment. Call in descending
 * address order: then the free space after the block is exactly what the recorded
 * allocator saw, and a large block keeps a tail of <= 1 MiB as it did. */
static int torch_alloc_at(np_ctx *ctx, uintptr_t addr, uint64_t req, intptr_t stream, np_block **out) {
  torch_state *ts = state(ctx);
  uint64_t size = round_size(req);
  np_segment *s = ctx->segments;
  while (s && !(addr >= s->addr && addr < s->addr + s->size)) s = s->next;
  if (!s || s->stream != stream) return np_error(NP_ERR_INVALID, "no primed segment of this stream holds %#lx", (unsigned long)addr);
  np_block *b = s->head;
  while (b && b->addr + b->size <= addr) b = b->next;
  if (!b || b->allocated || addr + size > b->addr + b->size)
    return np_error(NP_ERR_INVALID, "recorded block at %#lx (%llu bytes) overlaps another", (unsigned long)addr, (unsigned long long)size);
  np_tree *t = &ts->pools[b->pool];
  np_tree_remove(t, b);
  if (addr > b->addr) {
    if (!np_block_split(&ctx->blocks, b, addr - b->addr, false)) {
      np_tree_insert(t, b);
      return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    }
    np_tree_insert(t, b);
    b = b->next;
  }
  uint64_t tail = b->size - size;
  if (tail > 0 && (b->pool == SMALL || tail > K_SMALL_SIZE)) {
    if (!np_block_split(&ctx->blocks, b, size, false)) {
      np_tree_insert(t, b);
      return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    }
    np_tree_insert(t, b->next);
  }
  *out = b;
  return NP_OK;
}

const np_policy np_policy_torch = {
    .name = "torch",
    .summary = "a model of PyTorch's CUDA caching allocator (small and large pools of cached segments, "
               "per stream): the baseline",
    .pool_name = {"small", "large"},
    .pool_meaning = {"requests of at most 1 MiB, from 2 MiB segments",
                     "larger requests, from 20 MiB segments (below 10 MiB) or segments of their own size"},
    .framework = true,
    .init = torch_init,
    .destroy = torch_destroy,
    .malloc = torch_malloc,
    .free = torch_free,
    .empty_cache = torch_empty_cache,
    .fill_stats = torch_fill_stats,
    .check = torch_check,
    .prime_segment = torch_prime_segment,
    .alloc_at = torch_alloc_at,
};
