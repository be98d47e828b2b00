/* policy_npu_pool.c -- the npu_pool policy: one arena per device.
 *
 * Long-lived and short-lived requests are placement classes inside one arena,
 * not separately cached segment sets (two caches hoard memory the other could
 * use). The arena is an address reservation whose pages are mapped as the
 * high-water mark grows (virtual-memory API), or one device allocation of the
 * fraction cap where the vendor has none.
 *
 *  - blocks are exact (512-byte rounded): no segment rounding, no boundaries;
 *  - a request takes the smallest hole that fits (O(log n) tree by stream,
 *    size, address), long-lived at the hole's low end, short-lived at its high
 *    end, so short-lived churn stays away from long-lived neighbours and the
 *    hole that remains is contiguous with other free memory;
 *  - when no hole fits it extends the top (the free memory above the highest
 *    allocation), first merging a hole of its stream that touches the top;
 *  - freed memory keeps the tag of the stream that used it: only that stream
 *    may reuse it until a device synchronisation (empty_cache, or the retry
 *    after a failure) clears the tags; untagged memory (never used, or
 *    synchronised) serves every stream;
 *  - empty_cache unmaps every whole page inside free memory.
 *
 * Invariants: the arena segment is tiled by its blocks; `top` is the last block
 * when that block is free and untagged, else NULL; every other free block is
 * in `holes`; no two neighbouring free blocks with compatible tags are left
 * unmerged except a tagged hole below the top; with VMM every page touched by
 * an allocated block is mapped and mapped_bytes == reserved.
 */
#include <stdlib.h>
#include <string.h>

#include "context.h"
#include "tree.h"

enum { LONG_POOL = 0, SHORT_POOL = 1 };

typedef struct arena_state {
  np_tree holes;
  np_segment *seg;      /* NULL until the first request */
  np_block *top;
  bool vmm;
  uint64_t page;        /* mapping granularity */
  uint8_t *mapped;      /* one byte per page: 1 if mapped */
  uint64_t n_pages;
  uint64_t mapped_bytes;
  uint64_t page_hwm;    /* pages at or above this index have never been mapped */
} arena_state;

static arena_state *state(np_ctx *ctx) { return (arena_state *)ctx->pstate; }

static bool compatible(intptr_t a, intptr_t b) { return a == b || a == NP_STREAM_ANY || b == NP_STREAM_ANY; }
static intptr_t merged_tag(intptr_t a, intptr_t b) { return a == NP_STREAM_ANY ? b : a; }

static int arena_init(np_ctx *ctx) {
  arena_state *as = calloc(1, sizeof *as);
  if (!as) return np_error(NP_ERR_HOST, "host out of memory");
  as->vmm = ctx->cfg.vmm && ctx->be->granularity > 0 && ctx->be->reserve;
  as->page = as->vmm ? ctx->be->granularity : NP_MIN_BLOCK;
  ctx->pstate = as;
  ctx->st.vmm = as->vmm;
  return NP_OK;
}

/* Create the arena: reserve address space for twice the device (VMM: unmapped holes
 * left by empty_cache must not stop the top from growing) or allocate the cap. */
static int ensure_arena(np_ctx *ctx) {
  arena_state *as = state(ctx);
  if (as->seg) return NP_OK;
  uint64_t size = as->vmm ? 2 * np_round_up(ctx->be->total, as->page) : np_round_down(ctx->limit, NP_MIN_BLOCK);
  if (size == 0) return np_error(NP_ERR_OOM, "the memory fraction cap leaves no room for an arena");
  np_segment *seg;
  int rc = np_segment_create(ctx, size, NP_STREAM_ANY, LONG_POOL, as->vmm, &seg);
  if (rc != NP_OK) return rc;
  if (as->vmm) {
    as->n_pages = size / as->page;
    as->mapped = calloc(as->n_pages, 1);
    if (!as->mapped) {
      np_segment_destroy(ctx, seg);
      return np_error(NP_ERR_HOST, "host out of memory for the page map");
    }
  }
  as->seg = seg;
  as->top = seg->head;
  seg->head->stream = NP_STREAM_ANY;
  return NP_OK;
}

/* Unmap the mapped pages among pages [first, end). */
static void unmap_pages(np_ctx *ctx, uint64_t first, uint64_t end) {
  arena_state *as = state(ctx);
  if (end > as->page_hwm) end = as->page_hwm;
  for (uint64_t p = first; p < end;) {
    if (!as->mapped[p]) {
      p++;
      continue;
    }
    uint64_t q = p;
    while (q < end && as->mapped[q]) q++;
    if (ctx->be->unmap(ctx->be, as->seg->addr + p * as->page, (q - p) * as->page) == NP_OK) {
      memset(as->mapped + p, 0, q - p);
      as->mapped_bytes -= (q - p) * as->page;
      np_counter_sub(&ctx->st.total.reserved, (q - p) * as->page);
      ctx->st.device_frees++;
    }
    p = q;
  }
}

static void drop_arena(np_ctx *ctx) {
  arena_state *as = state(ctx);
  if (!as->seg) return;
  for (np_block *b = as->seg->head; b; b = b->next) {
    if (b->allocated) np_ptrmap_remove(&ctx->live, b->addr);
    b->allocated = 0;
    b->in_tree = 0;
  }
  if (as->vmm) unmap_pages(ctx, 0, as->n_pages);
  np_segment_destroy(ctx, as->seg);
  free(as->mapped);
  memset(&as->holes, 0, sizeof as->holes);
  as->seg = NULL;
  as->top = NULL;
  as->mapped = NULL;
  as->mapped_bytes = 0;
  as->page_hwm = 0;
}

static void arena_destroy(np_ctx *ctx) {
  drop_arena(ctx);
  free(ctx->pstate);
}

/* Map every unmapped page under [addr, addr+size); fails whole if the cap would be exceeded. */
static int map_range(np_ctx *ctx, uintptr_t addr, uint64_t size) {
  arena_state *as = state(ctx);
  if (!as->vmm) return NP_OK;
  uint64_t first = (addr - as->seg->addr) / as->page, last = (addr + size - 1 - as->seg->addr) / as->page;
  uint64_t need = 0;
  for (uint64_t p = first; p <= last; p++) need += !as->mapped[p];
  if (!need) return NP_OK;
  if (as->mapped_bytes + need * as->page > ctx->limit) {
    char a[32], b[32];
    return np_error(NP_ERR_OOM, "mapping %s more would exceed the memory fraction cap of %s",
                    np_fmt_bytes(need * as->page, a), np_fmt_bytes(ctx->limit, b));
  }
  for (uint64_t p = first; p <= last;) {
    if (as->mapped[p]) {
      p++;
      continue;
    }
    uint64_t q = p;
    while (q <= last && !as->mapped[q]) q++;
    int rc = ctx->be->map(ctx->be, as->seg->addr + p * as->page, (q - p) * as->page);
    if (rc != NP_OK) return rc; /* pages mapped so far stay mapped and accounted */
    memset(as->mapped + p, 1, q - p);
    if (q > as->page_hwm) as->page_hwm = q;
    as->mapped_bytes += (q - p) * as->page;
    np_counter_add(&ctx->st.total.reserved, (q - p) * as->page);
    ctx->st.device_mallocs++;
    p = q;
  }
  return NP_OK;
}

/* Unmap every mapped page lying wholly inside the free block b. */
static void unmap_free(np_ctx *ctx, const np_block *b) {
  arena_state *as = state(ctx);
  uint64_t off = b->addr - as->seg->addr;
  unmap_pages(ctx, np_round_up(off, as->page) / as->page, (off + b->size) / as->page);
}

/* Best-fitting hole usable by `stream`: its own tagged holes or untagged ones. */
static np_block *best_hole(arena_state *as, intptr_t stream, uint64_t size) {
  np_block *own = np_tree_best_fit(&as->holes, stream, size);
  np_block *any = stream == NP_STREAM_ANY ? NULL : np_tree_best_fit(&as->holes, NP_STREAM_ANY, size);
  if (!own) return any;
  if (!any) return own;
  return any->size < own->size || (any->size == own->size && any->addr < own->addr) ? any : own;
}

/* Free block b (not in any tree): merge with compatible free neighbours, then file it. */
static void put_free(np_ctx *ctx, np_block *b) {
  arena_state *as = state(ctx);
  np_block *p = b->prev;
  if (p && !p->allocated && compatible(p->stream, b->stream)) {
    np_tree_remove(&as->holes, p);
    p->stream = merged_tag(p->stream, b->stream);
    np_block_merge_next(&ctx->blocks, p);
    b = p;
  }
  np_block *n = b->next;
  if (n && !n->allocated && n != as->top && compatible(n->stream, b->stream)) {
    np_tree_remove(&as->holes, n);
    b->stream = merged_tag(b->stream, n->stream);
    np_block_merge_next(&ctx->blocks, b);
  }
  n = b->next;
  if (n && n == as->top && b->stream == NP_STREAM_ANY) {
    np_block_merge_next(&ctx->blocks, b);
    as->top = b;
  } else if (!n && b->stream == NP_STREAM_ANY) {
    as->top = b;
  } else {
    np_tree_insert(&as->holes, b);
  }
}

/* Carve `size` bytes out of free block h (in no tree); the rest goes back as free memory. */
static int carve(np_ctx *ctx, np_block *h, uint64_t size, bool high, np_block **out) {
  if (h->size > size) {
    np_block *piece = np_block_split(&ctx->blocks, h, size, high);
    if (!piece) return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    np_block *rest = high ? piece->prev : piece->next; /* keeps the hole's tag */
    h = piece;
    if (rest == h->next && !rest->next && rest->stream == NP_STREAM_ANY) state(ctx)->top = rest;
    else np_tree_insert(&state(ctx)->holes, rest);
  }
  *out = h;
  return NP_OK;
}

static int try_place(np_ctx *ctx, uint64_t size, intptr_t stream, bool long_lived, np_block **out) {
  arena_state *as = state(ctx);
  np_block *h = best_hole(as, stream, size);
  if (h) {
    np_tree_remove(&as->holes, h);
  } else {
    np_block *t = as->top;
    if (!t) return np_error(NP_ERR_OOM, "the arena's address range is full");
    np_block *below = t->prev;
    /* No hole fits, so a usable hole under the top is smaller than the request:
     * start the request there; it covers the whole hole, the rest is untagged. */
    bool absorb = below && !below->allocated && compatible(below->stream, stream) && below->size + t->size >= size;
    if (!absorb && t->size < size) return np_error(NP_ERR_OOM, "the arena's address range is full");
    if (absorb) {
      np_tree_remove(&as->holes, below);
      np_block_merge_next(&ctx->blocks, below);
      t = below;
      t->stream = NP_STREAM_ANY;
    }
    as->top = NULL;
    h = t;
    long_lived = true; /* take the top's low end: the high-water mark grows only by `size` */
  }
  intptr_t tag = h->stream;
  np_block *b = NULL;
  int rc = carve(ctx, h, size, !long_lived, &b);
  if (rc != NP_OK) {
    put_free(ctx, h);
    return rc;
  }
  rc = map_range(ctx, b->addr, b->size);
  if (rc != NP_OK) {
    b->stream = tag;
    put_free(ctx, b);
    return rc;
  }
  b->stream = stream;
  uint64_t end = b->addr + b->size - as->seg->addr;
  if (end > ctx->st.arena_hwm.peak) ctx->st.arena_hwm.peak = end;
  *out = b;
  return NP_OK;
}

/* Device synchronisation: clear every stream tag, merge free neighbours, rebuild the tree. */
static void synchronize(np_ctx *ctx) {
  arena_state *as = state(ctx);
  memset(&as->holes, 0, sizeof as->holes);
  as->top = NULL;
  for (np_block *b = as->seg->head; b; b = b->next) {
    if (b->allocated) continue;
    b->in_tree = 0;
    b->stream = NP_STREAM_ANY;
    while (b->next && !b->next->allocated) {
      b->next->in_tree = 0;
      np_block_merge_next(&ctx->blocks, b);
    }
    if (b->next) np_tree_insert(&as->holes, b);
    else as->top = b;
  }
}

static void release_pages(np_ctx *ctx) {
  arena_state *as = state(ctx);
  if (!as->vmm) return;
  for (np_block *b = as->seg->head; b; b = b->next)
    if (!b->allocated) unmap_free(ctx, b);
}

static int arena_empty_cache(np_ctx *ctx) {
  arena_state *as = state(ctx);
  if (!as->seg) return NP_OK;
  if (ctx->live.count == 0 && !as->vmm) {
    drop_arena(ctx); /* nothing allocated: return the whole fixed arena */
    return NP_OK;
  }
  synchronize(ctx);
  release_pages(ctx);
  return NP_OK;
}

static int arena_malloc(np_ctx *ctx, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  uint64_t size = np_round_up(req, NP_MIN_BLOCK);
  int rc = ensure_arena(ctx);
  if (rc != NP_OK) return rc;
  bool long_lived = lifetime != NP_LIFE_SHORT;
  rc = try_place(ctx, size, stream, long_lived, out);
  if (rc == NP_ERR_OOM) {
    /* what PyTorch does on failure, at arena scale: synchronise, release free pages, retry once */
    ctx->st.retries++;
    rc = ctx->be->synchronize(ctx->be, NP_STREAM_ANY);
    if (rc != NP_OK) return rc;
    synchronize(ctx);
    release_pages(ctx);
    rc = try_place(ctx, size, stream, long_lived, out);
  }
  if (rc == NP_OK) (*out)->pool = lifetime == NP_LIFE_SHORT ? SHORT_POOL : LONG_POOL;
  return rc;
}

static void arena_free(np_ctx *ctx, np_block *b) { put_free(ctx, b); }

static int arena_set_limit(np_ctx *ctx, uint64_t limit) {
  arena_state *as = state(ctx);
  if (as->vmm || !as->seg) return NP_OK;
  if (ctx->live.count) {
    char a[32];
    return np_error(NP_ERR_STATE, "the arena is already allocated at %s without a virtual-memory API; "
                    "set the fraction before the first allocation", np_fmt_bytes(as->seg->size, a));
  }
  (void)limit;
  drop_arena(ctx); /* empty: the next request reserves the new size */
  return NP_OK;
}

static void arena_fill_stats(np_ctx *ctx, np_stats *st) {
  arena_state *as = state(ctx);
  if (!as->seg) return;
  np_block *m = np_tree_max(&as->holes);
  st->largest_free = m ? m->size : 0;
  st->arena_hwm.current = (as->top ? as->top->addr : as->seg->addr + as->seg->size) - as->seg->addr;
  if (as->top) {
    uint64_t room = as->top->size;
    if (as->vmm) {
      uint64_t mapped_in_top = 0, first = np_round_up(as->top->addr - as->seg->addr, as->page) / as->page;
      for (uint64_t p = first; p < as->page_hwm; p++) mapped_in_top += as->mapped[p] ? as->page : 0;
      uint64_t free_cap = ctx->limit > as->mapped_bytes ? ctx->limit - as->mapped_bytes : 0;
      room = np_min_u64(room, free_cap + mapped_in_top);
    }
    if (room > st->largest_free) st->largest_free = room;
  }
}

static int arena_check(np_ctx *ctx) {
  arena_state *as = state(ctx);
  if (!np_tree_check(&as->holes)) return np_error(NP_ERR_STATE, "check: arena hole tree is corrupt");
  if (!as->seg) return as->holes.count ? np_error(NP_ERR_STATE, "check: holes without an arena") : NP_OK;
  size_t holes = 0;
  for (np_block *b = as->seg->head; b; b = b->next) {
    if (b->allocated) {
      if (as->vmm) {
        uint64_t first = (b->addr - as->seg->addr) / as->page, last = (b->addr + b->size - 1 - as->seg->addr) / as->page;
        for (uint64_t p = first; p <= last; p++)
          if (!as->mapped[p]) return np_error(NP_ERR_STATE, "check: allocated block %#lx on an unmapped page", (unsigned long)b->addr);
      }
      continue;
    }
    if (b == as->top) {
      if (b->next || b->stream != NP_STREAM_ANY) return np_error(NP_ERR_STATE, "check: the top is not the last untagged block");
      continue;
    }
    if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free block %#lx is not a hole", (unsigned long)b->addr);
    if (b->next && !b->next->allocated && b->next != as->top && compatible(b->stream, b->next->stream))
      return np_error(NP_ERR_STATE, "check: compatible holes not merged at %#lx", (unsigned long)b->addr);
    holes++;
  }
  if (holes != as->holes.count) return np_error(NP_ERR_STATE, "check: the hole tree holds stray blocks");
  if (!as->top && as->seg->head && !(as->seg->head->next == NULL && as->seg->head->allocated)) {
    np_block *last = as->seg->head;
    while (last->next) last = last->next;
    if (!last->allocated && last->stream == NP_STREAM_ANY) return np_error(NP_ERR_STATE, "check: free untagged last block is not the top");
  }
  if (as->vmm) {
    uint64_t n = 0;
    for (uint64_t p = 0; p < as->n_pages; p++) n += as->mapped[p];
    if (n * as->page != as->mapped_bytes || as->mapped_bytes != ctx->st.total.reserved.current)
      return np_error(NP_ERR_STATE, "check: mapped pages (%llu bytes) disagree with reserved (%llu)",
                      (unsigned long long)(n * as->page), (unsigned long long)ctx->st.total.reserved.current);
  }
  return NP_OK;
}

const np_policy np_policy_npu_pool = {
    .name = "npu_pool",
    .init = arena_init,
    .destroy = arena_destroy,
    .malloc = arena_malloc,
    .free = arena_free,
    .empty_cache = arena_empty_cache,
    .set_limit = arena_set_limit,
    .fill_stats = arena_fill_stats,
    .check = arena_check,
};
