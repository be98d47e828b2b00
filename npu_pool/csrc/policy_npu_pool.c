/* policy_npu_pool.c -- the npu_pool policy: one arena per device, lifetime-aware placement.
 *
 * Long-lived and short-lived requests are placement classes inside one arena,
 * not separately cached segment sets (two caches hoard memory the other could
 * use). With a virtual-memory API the arena is an address reservation whose
 * pages are mapped as its high-water mark grows; without one it is a single
 * device allocation of the fraction cap. (A separate arena for small requests
 * was measured: it helps inference traces and hurts training ones about as much,
 * see docs/policies.md, so there is one.)
 *
 *  - blocks are exact (512-byte rounded): no segment rounding, no boundaries;
 *  - a request takes the smallest hole that fits (O(log n) tree by stream,
 *    size, address), long-lived at the hole's low end, short-lived at its high
 *    end, so short-lived churn stays away from long-lived neighbours and the
 *    hole that remains is contiguous with other free memory;
 *  - when no hole fits it extends the top (the free memory above the highest
 *    allocation), first taking a hole of its stream that touches the top;
 *  - freed memory keeps the tag of the stream that used it (or "mixed" once
 *    memory of two streams merges). A request prefers holes of its own stream or
 *    untagged ones (never used, or synchronised); failing that, where the backend
 *    can order streams on the device (an event wait, as cudaMallocAsync pools do)
 *    it takes another stream's hole and makes its stream wait for that stream's
 *    queued work: memory serves every stream without a host synchronisation.
 *    Without that hook, holes stay with their stream until a synchronisation
 *    (empty_cache, or the retry after a failure) clears the tags;
 *  - when mapping would pass the cap, it first trims: unmaps whole free pages
 *    whose streams have finished all queued work (no synchronisation needed);
 *    only if that is not enough does the request fail into the retry, which
 *    synchronises the device and unmaps every whole free page, as empty_cache.
 *
 * Invariants: the arena's segment is tiled by its blocks; `top` is the last
 * block when that block is free and untagged, else NULL; every other free block
 * is in `holes`; no two neighbouring free blocks with compatible tags are left
 * unmerged except a tagged hole below the top; with VMM every page touched by an
 * allocated block is mapped, and mapped bytes equal reserved bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "context.h"
#include "streams.h"
#include "tree.h"

enum { LONG_POOL = 0, SHORT_POOL = 1 };

typedef struct arena {
  np_tree holes;
  np_segment *seg;      /* NULL until the first request */
  np_block *top;
  uint8_t *mapped;      /* VMM: one byte per page, 1 if mapped */
  uint64_t n_pages;
  uint64_t page_hwm;    /* pages at or above this index have never been mapped */
  uint64_t mapped_bytes;
} arena;

typedef struct npu_pool_state {
  arena arena;
  bool vmm;
  uint64_t page;        /* mapping granularity */
  np_streams streams;   /* streams that allocated or were recorded, for waits on mixed memory */
} npu_pool_state;

static npu_pool_state *state(np_ctx *ctx) { return (npu_pool_state *)ctx->pstate; }

/* Holes serve every stream when the backend can order streams and every stream is
 * known; once too many streams were seen, holes stay with their stream. */
static bool cross(const np_ctx *ctx, const npu_pool_state *ps) { return ctx->be->stream_wait && !ps->streams.full; }

static bool compatible(const np_ctx *ctx, const npu_pool_state *ps, intptr_t a, intptr_t b) {
  return a == b || a == NP_STREAM_ANY || b == NP_STREAM_ANY || cross(ctx, ps);
}

static int npu_pool_init(np_ctx *ctx) {
  npu_pool_state *ps = calloc(1, sizeof *ps);
  if (!ps) return np_error(NP_ERR_HOST, "host out of memory");
  ps->vmm = ctx->cfg.vmm && ctx->be->granularity > 0 && ctx->be->reserve;
  ps->page = ps->vmm ? ctx->be->granularity : NP_MIN_BLOCK;
  ctx->pstate = ps;
  ctx->st.vmm = ps->vmm;
  return NP_OK;
}

/* Create an arena: reserve address space for twice the device (VMM: unmapped holes
 * left by empty_cache must not stop the top from growing) or allocate the cap. */
static int ensure_arena(np_ctx *ctx, arena *a) {
  npu_pool_state *ps = state(ctx);
  if (a->seg) return NP_OK;
  uint64_t size = ps->vmm ? 2 * np_round_up(ctx->be->total, ps->page) : np_round_down(ctx->limit, NP_MIN_BLOCK);
  if (size == 0) return np_error(NP_ERR_OOM, "the memory fraction cap leaves no room for an arena");
  np_segment *seg;
  int rc = np_segment_create(ctx, size, NP_STREAM_ANY, LONG_POOL, ps->vmm, &seg);
  /* A fixed arena asks for the whole cap; where the device has less free (other
   * processes, the runtime's own use), take what there is, down to half the cap. */
  for (uint64_t shrink = size / 16; rc == NP_ERR_OOM && !ps->vmm && size > ctx->limit / 2 + shrink;) {
    size = np_round_down(size - shrink, NP_MIN_BLOCK);
    rc = np_segment_create(ctx, size, NP_STREAM_ANY, LONG_POOL, false, &seg);
  }
  if (rc != NP_OK) return rc;
  if (ps->vmm) {
    a->n_pages = size / ps->page;
    a->mapped = calloc(a->n_pages, 1);
    if (!a->mapped) {
      np_segment_destroy(ctx, seg);
      return np_error(NP_ERR_HOST, "host out of memory for the page map");
    }
  }
  a->seg = seg;
  a->top = seg->head;
  seg->head->stream = NP_STREAM_ANY;
  return NP_OK;
}

/* Unmap the mapped pages among pages [first, end) of arena a. */
static void unmap_pages(np_ctx *ctx, arena *a, uint64_t first, uint64_t end) {
  uint64_t page = state(ctx)->page;
  if (end > a->page_hwm) end = a->page_hwm;
  for (uint64_t p = first; p < end;) {
    if (!a->mapped[p]) {
      p++;
      continue;
    }
    uint64_t q = p;
    while (q < end && a->mapped[q]) q++;
    if (ctx->be->unmap(ctx->be, a->seg->addr + p * page, (q - p) * page) == NP_OK) {
      memset(a->mapped + p, 0, q - p);
      a->mapped_bytes -= (q - p) * page;
      np_counter_sub(&ctx->st.total.reserved, (q - p) * page);
      ctx->st.device_frees++;
    }
    p = q;
  }
}

static void drop_arena(np_ctx *ctx, arena *a) {
  if (!a->seg) return;
  for (np_block *b = a->seg->head; b; b = b->next) {
    if (b->allocated) np_ptrmap_remove(&ctx->live, b->addr);
    b->allocated = 0;
    b->in_tree = 0;
  }
  if (a->mapped) unmap_pages(ctx, a, 0, a->n_pages);
  np_segment_destroy(ctx, a->seg);
  free(a->mapped);
  memset(a, 0, sizeof *a);
}

static void npu_pool_destroy(np_ctx *ctx) {
  npu_pool_state *ps = state(ctx);
  drop_arena(ctx, &ps->arena);
  free(ps);
}

/* Under cap pressure: unmap whole free pages of settled free blocks (not `skip`),
 * highest first, until `need` bytes are back. Returns the bytes unmapped. */
static uint64_t trim(np_ctx *ctx, arena *a, const np_block *skip, uint64_t need) {
  uint64_t page = state(ctx)->page, before = a->mapped_bytes;
  np_block *last = a->seg->head;
  while (last->next) last = last->next;
  for (np_block *b = last; b && before - a->mapped_bytes < need; b = b->prev) {
    if (b->allocated || b == skip || !np_tag_settled(ctx, &state(ctx)->streams, b->stream)) continue;
    uint64_t off = b->addr - a->seg->addr;
    unmap_pages(ctx, a, np_round_up(off, page) / page, (off + b->size) / page);
  }
  if (a->mapped_bytes < before) ctx->st.trims++;
  return before - a->mapped_bytes;
}

/* Map every unmapped page under [addr, addr+size) of block b; trims settled free pages
 * when the cap would be exceeded, and fails whole if that is not enough. */
static int map_range(np_ctx *ctx, arena *a, const np_block *b) {
  uintptr_t addr = b->addr;
  uint64_t size = b->size;
  npu_pool_state *ps = state(ctx);
  if (!ps->vmm) return NP_OK;
  uint64_t page = ps->page;
  uint64_t first = (addr - a->seg->addr) / page, last = (addr + size - 1 - a->seg->addr) / page;
  uint64_t need = 0;
  for (uint64_t p = first; p <= last; p++) need += !a->mapped[p];
  if (!need) return NP_OK;
  if (ctx->st.total.reserved.current + need * page > ctx->limit)
    trim(ctx, a, b, ctx->st.total.reserved.current + need * page - ctx->limit);
  if (ctx->st.total.reserved.current + need * page > ctx->limit) {
    char x[32], y[32];
    return np_error(NP_ERR_OOM, "mapping %s more would exceed the memory fraction cap of %s",
                    np_fmt_bytes(need * page, x), np_fmt_bytes(ctx->limit, y));
  }
  for (uint64_t p = first; p <= last;) {
    if (a->mapped[p]) {
      p++;
      continue;
    }
    uint64_t q = p;
    while (q <= last && !a->mapped[q]) q++;
    int rc = ctx->be->map(ctx->be, a->seg->addr + p * page, (q - p) * page);
    if (rc != NP_OK) return rc; /* pages mapped so far stay mapped and accounted */
    memset(a->mapped + p, 1, q - p);
    if (q > a->page_hwm) a->page_hwm = q;
    a->mapped_bytes += (q - p) * page;
    np_counter_add(&ctx->st.total.reserved, (q - p) * page);
    ctx->st.device_mallocs++;
    p = q;
  }
  return NP_OK;
}

static np_block *better(np_block *x, np_block *y) {
  if (!x) return y;
  if (!y) return x;
  return y->size < x->size || (y->size == x->size && y->addr < x->addr) ? y : x;
}

/* Best-fitting hole for `stream`: of its own or untagged; failing that (cross-stream
 * reuse), of any other stream or mixed. */
static np_block *best_hole(const np_ctx *ctx, const npu_pool_state *ps, arena *a, intptr_t stream, uint64_t size) {
  np_block *h = better(np_tree_best_fit(&a->holes, stream, size), np_tree_best_fit(&a->holes, NP_STREAM_ANY, size));
  if (h || !cross(ctx, ps)) return h;
  h = np_tree_best_fit(&a->holes, NP_STREAM_MIXED, size);
  for (int i = 0; i < ps->streams.n; i++)
    if (ps->streams.ids[i] != stream) h = better(h, np_tree_best_fit(&a->holes, ps->streams.ids[i], size));
  return h;
}

/* Free block b (in no tree): merge with compatible free neighbours, then file it. */
static void put_free(np_ctx *ctx, arena *a, np_block *b) {
  const npu_pool_state *ps = state(ctx);
  np_block *p = b->prev;
  if (p && !p->allocated && compatible(ctx, ps, p->stream, b->stream)) {
    np_tree_remove(&a->holes, p);
    p->stream = np_tag_merge(p->stream, b->stream);
    np_block_merge_next(&ctx->blocks, p);
    b = p;
  }
  np_block *n = b->next;
  if (n && !n->allocated && n != a->top && compatible(ctx, ps, n->stream, b->stream)) {
    np_tree_remove(&a->holes, n);
    b->stream = np_tag_merge(b->stream, n->stream);
    np_block_merge_next(&ctx->blocks, b);
  }
  n = b->next;
  if (n && n == a->top && b->stream == NP_STREAM_ANY) {
    np_block_merge_next(&ctx->blocks, b);
    a->top = b;
  } else if (!n && b->stream == NP_STREAM_ANY) {
    a->top = b;
  } else {
    np_tree_insert(&a->holes, b);
  }
}

/* Carve `size` bytes out of free block h (in no tree); the rest goes back as free memory. */
static int carve(np_ctx *ctx, arena *a, np_block *h, uint64_t size, bool high, np_block **out) {
  if (h->size > size) {
    np_block *piece = np_block_split(&ctx->blocks, h, size, high);
    if (!piece) return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    np_block *rest = high ? piece->prev : piece->next; /* keeps the hole's tag */
    h = piece;
    if (rest == h->next && !rest->next && rest->stream == NP_STREAM_ANY) a->top = rest;
    else np_tree_insert(&a->holes, rest);
  }
  *out = h;
  return NP_OK;
}

static int try_place(np_ctx *ctx, arena *a, uint64_t size, intptr_t stream, bool long_lived, np_block **out) {
  npu_pool_state *ps = state(ctx);
  np_block *h = best_hole(ctx, ps, a, stream, size);
  intptr_t used_by; /* who used the memory before: whom the request must be ordered after */
  if (h) {
    np_tree_remove(&a->holes, h);
    used_by = h->stream;
  } else {
    np_block *t = a->top;
    if (!t) return np_error(NP_ERR_OOM, "the arena's address range is full");
    np_block *below = t->prev;
    /* No hole fits, so a usable hole under the top is smaller than the request:
     * start the request there; it covers the whole hole, the rest is untagged. */
    bool absorb = below && !below->allocated && compatible(ctx, ps, below->stream, stream) && below->size + t->size >= size;
    if (!absorb && t->size < size) return np_error(NP_ERR_OOM, "the arena's address range is full");
    used_by = NP_STREAM_ANY;
    if (absorb) {
      np_tree_remove(&a->holes, below);
      used_by = below->stream;
      np_block_merge_next(&ctx->blocks, below);
      t = below;
      t->stream = NP_STREAM_ANY;
    }
    a->top = NULL;
    h = t;
    long_lived = true; /* take the top's low end: the high-water mark grows only by `size` */
  }
  np_block *b = NULL;
  int rc = carve(ctx, a, h, size, !long_lived, &b);
  if (rc != NP_OK) {
    h->stream = np_tag_merge(h->stream, used_by);
    put_free(ctx, a, h);
    return rc;
  }
  rc = map_range(ctx, a, b);
  if (rc == NP_OK) rc = np_order_after(ctx, &ps->streams, stream, used_by);
  if (rc != NP_OK) {
    b->stream = np_tag_merge(b->stream, used_by);
    put_free(ctx, a, b);
    return rc;
  }
  b->stream = stream;
  uint64_t end = b->addr + b->size - a->seg->addr;
  if (end > ctx->st.arena_hwm.peak) ctx->st.arena_hwm.peak = end;
  *out = b;
  return NP_OK;
}

/* Device synchronisation: clear every stream tag, merge free neighbours, rebuild the tree. */
static void synchronize(np_ctx *ctx, arena *a) {
  memset(&a->holes, 0, sizeof a->holes);
  a->top = NULL;
  for (np_block *b = a->seg->head; b; b = b->next) {
    if (b->allocated) continue;
    b->in_tree = 0;
    b->stream = NP_STREAM_ANY;
    while (b->next && !b->next->allocated) {
      b->next->in_tree = 0;
      np_block_merge_next(&ctx->blocks, b);
    }
    if (b->next) np_tree_insert(&a->holes, b);
    else a->top = b;
  }
}

/* Synchronise the arena and unmap the whole pages inside its free memory. */
static void release(np_ctx *ctx) {
  npu_pool_state *ps = state(ctx);
  arena *a = &ps->arena;
  if (!a->seg) return;
  synchronize(ctx, a);
  if (!ps->vmm) return;
  for (np_block *b = a->seg->head; b; b = b->next) {
    if (b->allocated) continue;
    uint64_t off = b->addr - a->seg->addr;
    unmap_pages(ctx, a, np_round_up(off, ps->page) / ps->page, (off + b->size) / ps->page);
  }
}

static int npu_pool_empty_cache(np_ctx *ctx) {
  npu_pool_state *ps = state(ctx);
  if (!ps->vmm && ctx->live.count == 0) {
    drop_arena(ctx, &ps->arena); /* nothing allocated: return the whole fixed arena */
    return NP_OK;
  }
  release(ctx);
  return NP_OK;
}

static int npu_pool_malloc(np_ctx *ctx, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  npu_pool_state *ps = state(ctx);
  uint64_t size = np_round_up(req, NP_MIN_BLOCK);
  arena *a = &ps->arena;
  int rc = ensure_arena(ctx, a);
  if (rc != NP_OK) return rc;
  np_streams_note(&ps->streams, stream);
  bool long_lived = lifetime != NP_LIFE_SHORT;
  rc = try_place(ctx, a, size, stream, long_lived, out);
  if (rc == NP_ERR_OOM) {
    /* what PyTorch does on failure, at arena scale: synchronise, release free pages, retry once */
    ctx->st.retries++;
    rc = ctx->be->synchronize(ctx->be, NP_STREAM_ANY);
    if (rc != NP_OK) return rc;
    release(ctx);
    rc = try_place(ctx, a, size, stream, long_lived, out);
  }
  if (rc == NP_OK) (*out)->pool = lifetime == NP_LIFE_SHORT ? SHORT_POOL : LONG_POOL;
  return rc;
}

static void npu_pool_record_stream(np_ctx *ctx, np_block *b, intptr_t stream) {
  (void)b;
  np_streams_note(&state(ctx)->streams, stream); /* mixed memory waits on every noted stream */
}

static void npu_pool_free(np_ctx *ctx, np_block *b) {
  if (b->shared) { /* used on other streams too (record_stream): reuse must wait on all of them */
    b->stream = NP_STREAM_MIXED;
    b->shared = 0;
  }
  put_free(ctx, &state(ctx)->arena, b);
}

static int npu_pool_set_limit(np_ctx *ctx, uint64_t limit) {
  npu_pool_state *ps = state(ctx);
  arena *a = &ps->arena;
  (void)limit;
  if (ps->vmm || !a->seg) return NP_OK;
  if (ctx->live.count) {
    char x[32];
    return np_error(NP_ERR_STATE, "the arena is already allocated at %s without a virtual-memory API; "
                    "set the fraction before the first allocation", np_fmt_bytes(a->seg->size, x));
  }
  drop_arena(ctx, a); /* empty: the next request reserves the new size */
  return NP_OK;
}

static void npu_pool_fill_stats(np_ctx *ctx, np_stats *st) {
  npu_pool_state *ps = state(ctx);
  arena *a = &ps->arena;
  if (!a->seg) return;
  np_block *m = np_tree_max(&a->holes);
  st->largest_free = m ? m->size : 0;
  st->arena_hwm.current = (a->top ? a->top->addr : a->seg->addr + a->seg->size) - a->seg->addr;
  if (!a->top) return;
  uint64_t room = a->top->size;
  if (ps->vmm) { /* the top can grow by the cap's free pages plus pages it already has mapped */
    uint64_t mapped_in_top = 0, first = np_round_up(a->top->addr - a->seg->addr, ps->page) / ps->page;
    for (uint64_t p = first; p < a->page_hwm; p++) mapped_in_top += a->mapped[p] ? ps->page : 0;
    uint64_t reserved = ctx->st.total.reserved.current;
    room = np_min_u64(room, (ctx->limit > reserved ? ctx->limit - reserved : 0) + mapped_in_top);
  }
  if (room > st->largest_free) st->largest_free = room;
}

static int check_arena(np_ctx *ctx, arena *a) {
  npu_pool_state *ps = state(ctx);
  if (!np_tree_check(&a->holes)) return np_error(NP_ERR_STATE, "check: arena hole tree is corrupt");
  if (!a->seg) return a->holes.count ? np_error(NP_ERR_STATE, "check: holes without an arena") : NP_OK;
  size_t holes = 0;
  np_block *last = NULL;
  for (np_block *b = a->seg->head; b; last = b, b = b->next) {
    if (b->allocated) {
      if (ps->vmm) {
        uint64_t first = (b->addr - a->seg->addr) / ps->page, end = (b->addr + b->size - 1 - a->seg->addr) / ps->page;
        for (uint64_t p = first; p <= end; p++)
          if (!a->mapped[p]) return np_error(NP_ERR_STATE, "check: allocated block %#lx on an unmapped page", (unsigned long)b->addr);
      }
      continue;
    }
    if (b == a->top) {
      if (b->next || b->stream != NP_STREAM_ANY) return np_error(NP_ERR_STATE, "check: the top is not the last untagged block");
      continue;
    }
    if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free block %#lx is not a hole", (unsigned long)b->addr);
    if (b->next && !b->next->allocated && b->next != a->top && compatible(ctx, ps, b->stream, b->next->stream))
      return np_error(NP_ERR_STATE, "check: compatible holes not merged at %#lx", (unsigned long)b->addr);
    holes++;
  }
  if (holes != a->holes.count) return np_error(NP_ERR_STATE, "check: the hole tree holds stray blocks");
  if (!a->top && last && !last->allocated && last->stream == NP_STREAM_ANY)
    return np_error(NP_ERR_STATE, "check: free untagged last block is not the top");
  if (ps->vmm) {
    uint64_t n = 0;
    for (uint64_t p = 0; p < a->n_pages; p++) n += a->mapped[p];
    if (n * ps->page != a->mapped_bytes) return np_error(NP_ERR_STATE, "check: page map disagrees with mapped bytes");
  }
  return NP_OK;
}

static int npu_pool_check(np_ctx *ctx) {
  npu_pool_state *ps = state(ctx);
  int rc = check_arena(ctx, &ps->arena);
  if (rc == NP_OK && ps->vmm && ps->arena.mapped_bytes != ctx->st.total.reserved.current)
    return np_error(NP_ERR_STATE, "check: mapped pages (%llu bytes) disagree with reserved (%llu)",
                    (unsigned long long)ps->arena.mapped_bytes, (unsigned long long)ctx->st.total.reserved.current);
  return rc;
}

const np_policy np_policy_npu_pool = {
    .name = "npu_pool",
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
