/* policy_expandable.c -- a model of PyTorch's expandable segments
 * (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), the second baseline.
 *
 *  - one virtual range per stream and pool (small: requests <= 1 MiB), sized
 *    like PyTorch's (1.125 x device memory), backed by physical pages of
 *    2 MiB (small) or 20 MiB (large) mapped as it grows: each page is one physical
 *    handle and one map (and one unmap and release), as in ExpandableSegment;
 *  - rounding and pools as in the torch policy; a block always splits when at
 *    least 512 bytes remain;
 *  - a request takes the best-fitting mapped free block of its stream; among
 *    equal fits it prefers one that cannot grow into unmapped space; when none
 *    fits it maps pages at the lowest place where free and unmapped space
 *    together are large enough (starting at a free block just below it);
 *  - freed blocks merge with neighbours in the same mapped state; releasing
 *    the cache (empty_cache, or a failed request before its retry) unmaps every
 *    whole page inside free blocks and drops ranges left with nothing mapped.
 * Reserved bytes are mapped bytes (and pages the device refused to take back, held by the
 * context). Runs are mapped and unmapped whole (np_vmm_map/unmap with `whole`), so a block's
 * `mapped` is the page table's word for every page under it.
 * Invariants: mapped free blocks are in their pool's tree, unmapped blocks in
 * their pool's address-ordered tree of unmapped blocks, allocated blocks mapped; no two free
 * neighbours share a mapped state; a block's `mapped` says whether every page under it is mapped
 * (unmapped blocks: none is).
 */
#include <stdlib.h>

#include "policy.h"
#include "tree.h"
#include "vmm.h"

enum { SMALL = 0, LARGE = 1 };
static const uint64_t page_size[2] = {2 * NP_MIB, 20 * NP_MIB};

typedef struct exp_state {
  np_tree pools[2];
  /* Each pool's unmapped blocks, by address: where a growth may start is searched among them
   * (find_expandable) instead of among all of a segment's blocks, allocated ones included. */
  np_tree unmapped[2];
} exp_state;

static exp_state *state(np_ctx *ctx) { return (exp_state *)ctx->pstate; }

static int exp_init(np_ctx *ctx) {
  if (!ctx->be->granularity || !ctx->be->reserve || (2 * NP_MIB) % ctx->be->granularity)
    return np_error(NP_ERR_INVALID, "the expandable policy needs a backend with a virtual-memory API "
                    "and a page size dividing 2 MiB (backend %s has none)", ctx->be->name);
  exp_state *es = calloc(1, sizeof *es);
  if (!es) return np_error(NP_ERR_HOST, "host out of memory");
  es->unmapped[SMALL].by_addr = es->unmapped[LARGE].by_addr = true;
  ctx->pstate = es;
  ctx->st.vmm = 1;
  return NP_OK;
}

static bool free_mapped(const np_block *b) { return b && !b->allocated && b->mapped; }
static bool allocatable(const np_block *b) { return b && !b->allocated; }

static np_tree *unmapped_of(np_ctx *ctx, const np_block *b) { return &state(ctx)->unmapped[b->seg->pool]; }

/* Merge unmapped free neighbours into unmapped b (in no tree) and file the result. */
static void merge_unmapped(np_ctx *ctx, np_block *b) {
  np_tree *u = unmapped_of(ctx, b);
  if (b->prev && !b->prev->allocated && !b->prev->mapped) {
    b = b->prev;
    np_tree_remove(u, b);
    np_block_merge_next(&ctx->blocks, b);
  }
  if (b->next && !b->next->allocated && !b->next->mapped) {
    np_tree_remove(u, b->next);
    np_block_merge_next(&ctx->blocks, b);
  }
  np_tree_insert(u, b);
}

/* Unmap the whole pages inside free mapped block b (in no tree); file the pieces. */
static int unmap_block(np_ctx *ctx, np_block *b) {
  np_segment *seg = b->seg;
  np_tree *t = &state(ctx)->pools[seg->pool];
  uint64_t page = page_size[seg->pool];
  uintptr_t lo = seg->addr + np_round_up(b->addr - seg->addr, page);
  uintptr_t hi = seg->addr + np_round_down(b->addr + b->size - seg->addr, page);
  np_block *head = NULL, *mid = b, *tail = NULL;
  if (lo >= hi) goto keep;
  if (b->addr < lo) {
    if (!np_block_split(&ctx->blocks, b, lo - b->addr, false)) goto keep;
    head = b;
    mid = b->next;
  }
  if (mid->addr + mid->size > hi) {
    if (!np_block_split(&ctx->blocks, mid, hi - mid->addr, false)) goto undo;
    tail = mid->next;
  }
  int rc = np_vmm_unmap(ctx, seg, lo, hi - lo, true); /* a page that refuses is held: [lo, hi) is unmapped */
  if (head) np_tree_insert(t, head);
  if (tail) np_tree_insert(t, tail);
  mid->mapped = 0;
  merge_unmapped(ctx, mid);
  return rc;
undo:
  if (head) np_block_merge_next(&ctx->blocks, head);
keep:
  np_tree_insert(t, b);
  return NP_OK;
}

/* Unmap every whole free page and drop ranges left with nothing mapped; the first failure. */
static int release_cached(np_ctx *ctx) {
  exp_state *es = state(ctx);
  int first = NP_OK;
  np_saved_error s = {0};
  for (int p = 0; p < 2; p++) {
    np_block *b;
    /* unmap_block refiles the mapped leftovers, so collect first */
    size_t n = es->pools[p].count, i = 0;
    np_block **todo = n ? malloc(n * sizeof *todo) : NULL;
    if (n && !todo) return np_error(NP_ERR_HOST, "host out of memory releasing the cache");
    for (b = np_tree_lower_bound(&es->pools[p], INTPTR_MIN, 0); b; b = np_tree_next(&es->pools[p], b)) todo[i++] = b;
    for (i = 0; i < n; i++) {
      np_tree_remove(&es->pools[p], todo[i]);
      int rc = unmap_block(ctx, todo[i]);
      if (rc != NP_OK && first == NP_OK) np_save_error(&s, first = rc);
    }
    free(todo);
  }
  for (np_segment *sg = ctx->segments, *nx; sg; sg = nx) {
    nx = sg->next;
    if (!sg->head->next && !sg->head->allocated && !sg->head->mapped) {
      np_tree_remove(unmapped_of(ctx, sg->head), sg->head);
      np_segment_destroy(ctx, sg);
    }
  }
  return first == NP_OK ? NP_OK : np_restore_error(&s);
}

static void exp_destroy(np_ctx *ctx) {
  while (ctx->segments) np_segment_drop(ctx, ctx->segments); /* unmaps what is mapped */
  free(ctx->pstate);
}

/* Best fit by size; among candidates prefer blocks whose reach into unmapped space is smaller. */
static np_block *get_free_block(np_ctx *ctx, int pool, intptr_t stream, uint64_t size) {
  np_tree *t = &state(ctx)->pools[pool];
  np_block *b = np_tree_best_fit(t, stream, size);
  if (!b) return NULL;
#define REACH(x) ((x)->size + ((x)->next && !(x)->next->allocated && !(x)->next->mapped ? (x)->next->size : 0))
  for (np_block *n = np_tree_next(t, b); n && n->stream == stream && REACH(n) < REACH(b); n = np_tree_next(t, n)) b = n;
#undef REACH
  np_tree_remove(t, b);
  return b;
}

/* Map pages for the first `size` bytes of unmapped block b; merge with free mapped neighbours.
 * Returns the merged free block (in no tree) or NULL (b as it was, filed as unmapped). */
static np_block *map_block(np_ctx *ctx, np_block *b, uint64_t size, int *rc) {
  np_segment *seg = b->seg;
  np_tree *t = &state(ctx)->pools[seg->pool];
  uint64_t bytes = np_min_u64(np_round_up(size, page_size[seg->pool]), b->size);
  if (ctx->st.total.reserved.current + bytes > ctx->limit) {
    char a[32], l[32];
    *rc = np_error(NP_ERR_OOM, "mapping %s more would exceed the memory fraction cap of %s", np_fmt_bytes(bytes, a),
                   np_fmt_bytes(ctx->limit, l));
    ctx->fail.needed = np_max_u64(ctx->fail.needed, bytes);
    return NULL;
  }
  np_tree *u = unmapped_of(ctx, b);
  np_tree_remove(u, b);
  bool split = bytes < b->size;
  if (split && !np_block_split(&ctx->blocks, b, bytes, false)) {
    np_tree_insert(u, b);
    *rc = np_error(NP_ERR_HOST, "host out of memory splitting a block");
    return NULL;
  }
  /* one physical handle per page, as PyTorch's ExpandableSegment::map creates one handle of the
   * segment size (2 MiB small, 20 MiB large) per page and maps each: all or nothing */
  *rc = np_vmm_map_by(ctx, seg, b->addr, bytes, page_size[seg->pool], true);
  if (*rc != NP_OK) {
    if (split) np_block_merge_next(&ctx->blocks, b);
    np_tree_insert(u, b);
    return NULL;
  }
  if (split) np_tree_insert(u, b->next); /* the rest stays unmapped */
  b->mapped = 1;
  if (free_mapped(b->prev)) { /* the previous block may be the caller's candidate, already out of the tree */
    if (b->prev->in_tree) np_tree_remove(t, b->prev);
    b = b->prev;
    np_block_merge_next(&ctx->blocks, b);
  }
  if (free_mapped(b->next)) {
    np_tree_remove(t, b->next);
    np_block_merge_next(&ctx->blocks, b);
  }
  return b;
}

static np_segment *find_segment(np_ctx *ctx, int pool, intptr_t stream) {
  for (np_segment *s = ctx->segments; s; s = s->next)
    if (s->pool == pool && s->stream == stream) return s;
  return NULL;
}

/* Where a request that no mapped block fits should start: the lowest unmapped block
 * (or the free block just below it) with enough free space after it. The segment's unmapped
 * blocks in address order are its blocks that are neither allocated nor mapped, the ones a walk
 * of all its blocks would test, in the same order. */
static np_block *find_expandable(np_ctx *ctx, int pool, intptr_t stream, uint64_t size, int *rc) {
  np_segment *seg = find_segment(ctx, pool, stream);
  if (seg) {
    np_tree *u = &state(ctx)->unmapped[pool];
    for (np_block *c = np_tree_after(u, seg->addr - 1); c && c->seg == seg; c = np_tree_next(u, c)) {
      np_block *start = free_mapped(c->prev) ? c->prev : c;
      uint64_t bytes = 0;
      for (np_block *x = start; x && bytes < size && allocatable(x); x = x->next) bytes += x->size;
      if (bytes >= size) return start;
    }
  }
  uint64_t va = np_round_up(ctx->be->total + ctx->be->total / 8, page_size[pool]);
  *rc = np_segment_create(ctx, va, stream, pool, true, &seg);
  if (*rc != NP_OK) return NULL;
  np_tree_insert(&state(ctx)->unmapped[pool], seg->head); /* all of it unmapped */
  return seg->head;
}

static int try_expand(np_ctx *ctx, int pool, intptr_t stream, uint64_t size, np_block **out) {
  int rc = NP_OK;
  np_block *c = find_expandable(ctx, pool, stream, size, &rc);
  if (!c) return rc;
  if (c->mapped) np_tree_remove(&state(ctx)->pools[pool], c);
  else if (!(c = map_block(ctx, c, size, &rc))) return rc;
  while (c->size < size) {
    np_block *n = map_block(ctx, c->next, size - c->size, &rc);
    if (!n) {
      np_tree_insert(&state(ctx)->pools[pool], c);
      return rc;
    }
    c = n;
  }
  *out = c;
  return NP_OK;
}

static int exp_malloc(np_ctx *ctx, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  (void)lifetime;
  uint64_t size = req < NP_MIN_BLOCK ? NP_MIN_BLOCK : np_round_up(req, NP_MIN_BLOCK);
  int pool = size <= NP_MIB ? SMALL : LARGE;
  np_block *b = get_free_block(ctx, pool, stream, size);
  int rc = NP_OK;
  if (!b) rc = try_expand(ctx, pool, stream, size, &b);
  if (!b && rc == NP_ERR_OOM) {
    rc = np_ctx_synchronize(ctx); /* unmapping needs the device idle, as in PyTorch */
    if (rc != NP_OK) return rc;
    release_cached(ctx); /* a page the device refuses to unmap stays mapped and counted */
    ctx->st.retries++;
    rc = try_expand(ctx, pool, stream, size, &b);
  }
  if (!b && rc == NP_ERR_OOM) { /* what the pool could have used: its mapped free blocks, and room under the cap */
    uint64_t reserved = ctx->st.total.reserved.current;
    ctx->fail.pool = pool;
    ctx->fail.needed = np_max_u64(ctx->fail.needed, size);
    ctx->fail.usable = state(ctx)->pools[pool].bytes + (ctx->limit > reserved ? ctx->limit - reserved : 0);
  }
  if (!b) return rc;
  if (b->size - size >= NP_MIN_BLOCK) {
    if (!np_block_split(&ctx->blocks, b, size, false)) {
      np_tree_insert(&state(ctx)->pools[pool], b);
      return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    }
    np_tree_insert(&state(ctx)->pools[pool], b->next);
  }
  *out = b;
  return NP_OK;
}

static void exp_free(np_ctx *ctx, np_block *b) {
  np_tree *t = &state(ctx)->pools[b->pool];
  if (free_mapped(b->prev)) {
    np_tree_remove(t, b->prev);
    b = b->prev;
    np_block_merge_next(&ctx->blocks, b);
  }
  if (free_mapped(b->next)) {
    np_tree_remove(t, b->next);
    np_block_merge_next(&ctx->blocks, b);
  }
  np_tree_insert(t, b);
}

static int exp_empty_cache(np_ctx *ctx) { return release_cached(ctx); }

static void exp_fill_stats(np_ctx *ctx, np_stats *st) {
  exp_state *es = state(ctx);
  for (int p = 0; p < 2; p++) {
    st->largest_free = np_max_u64(st->largest_free, np_tree_max_size(&es->pools[p]));
  }
  for (np_segment *seg = ctx->segments; seg; seg = seg->next) { /* what release_cached unmaps: the */
    uint64_t page = page_size[seg->pool]; /* whole pages of every free block (each is cached) */
    for (np_block *b = seg->head; b; b = b->next) {
      if (b->allocated || !b->mapped) continue;
      uintptr_t lo = seg->addr + np_round_up(b->addr - seg->addr, page);
      uintptr_t hi = seg->addr + np_round_down(b->addr + b->size - seg->addr, page);
      if (lo < hi) st->releasable += np_vmm_whole_chunks(ctx, seg, lo, hi - lo);
    }
  }
}

static int exp_check(np_ctx *ctx) {
  exp_state *es = state(ctx);
  size_t in_tree[2] = {0, 0}, unmapped[2] = {0, 0};
  uint64_t mapped = 0;
  for (int p = 0; p < 2; p++)
    if (!np_tree_check(&es->pools[p]) || !np_tree_check(&es->unmapped[p]))
      return np_error(NP_ERR_STATE, "check: expandable pool %d tree is corrupt", p);
  for (np_segment *s = ctx->segments; s; s = s->next) {
    for (np_block *b = s->head; b; b = b->next) {
      if (b->mapped) mapped += b->size;
      if (b->allocated) {
        if (!b->mapped) return np_error(NP_ERR_STATE, "check: allocated block %#lx is not mapped", (unsigned long)b->addr);
        continue;
      }
      if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free block %#lx filed wrongly", (unsigned long)b->addr);
      if (b->next && !b->next->allocated && b->next->mapped == b->mapped)
        return np_error(NP_ERR_STATE, "check: free neighbours not merged at %#lx", (unsigned long)b->addr);
      (b->mapped ? in_tree : unmapped)[s->pool]++;
    }
  }
  for (int p = 0; p < 2; p++)
    if (in_tree[p] != es->pools[p].count || unmapped[p] != es->unmapped[p].count)
      return np_error(NP_ERR_STATE, "check: expandable pool %d holds stray blocks", p);
  if (mapped + ctx->st.unreleased != ctx->st.total.reserved.current)
    return np_error(NP_ERR_STATE, "check: %llu bytes mapped but %llu reserved", (unsigned long long)mapped,
                    (unsigned long long)ctx->st.total.reserved.current);
  return NP_OK;
}

const np_policy np_policy_expandable = {
    .name = "expandable",
    .summary = "a model of PyTorch's expandable segments: one growing virtual range per stream and pool, mapped "
               "page by page",
    .pool_name = {"small", "large"},
    .pool_meaning = {"requests of at most 1 MiB, in a range mapped by 2 MiB pages",
                     "larger requests, in a range mapped by 20 MiB pages"},
    .init = exp_init,
    .destroy = exp_destroy,
    .malloc = exp_malloc,
    .free = exp_free,
    .empty_cache = exp_empty_cache,
    .fill_stats = exp_fill_stats,
    .check = exp_check,
};
