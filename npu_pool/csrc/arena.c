/* arena.c -- one arena, lifetime-aware placement (see arena.h). */
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "vmm.h"

/* The arena's view of the cap: what it may reserve, and what it has reserved with the rest, less the
 * spare chunks (a growth maps them again or gives them back before it takes more). */
static uint64_t limit_of(const np_ctx *ctx, const np_arena *a) { return ctx->limit - np_min_u64(a->set_aside, ctx->limit); }
static uint64_t reserved_of(const np_ctx *ctx, const np_arena *a) {
  return ctx->st.total.reserved.current - a->outside - ctx->st.spare;
}
/* Where cap pressure starts: 1 / NP_ARENA_NEAR_DIV of the arena's budget (streams' free memory
 * merges past it). */
static uint64_t pressure_from(const np_ctx *ctx, const np_arena *a) { return limit_of(ctx, a) / NP_ARENA_NEAR_DIV; }
/* Where growths turn exact and carves keep free chunks whole (arena.h): where cap pressure starts;
 * with compaction, nowhere (near_cap), and geometric growths (granule) may reach the budget. */
static uint64_t exact_from(const np_ctx *ctx, const np_arena *a) {
  return ctx->compact ? limit_of(ctx, a) : pressure_from(ctx, a);
}
/* The out-of-memory error of an arena that would go past its budget by taking `bytes` more
 * (`verb`: what it would do): the cap, or what is left of it to this arena when its owner or other
 * arenas hold part of it (a tagged region's arena, the planned policy's fallback). */
static int over_budget(const np_ctx *ctx, const np_arena *a, const char *verb, uint64_t bytes) {
  char x[32], y[32], z[32];
  if (!a->set_aside)
    return np_error(NP_ERR_OOM, "%s %s more would exceed the memory fraction cap of %s", verb, np_fmt_bytes(bytes, x),
                    np_fmt_bytes(ctx->limit, y));
  return np_error(NP_ERR_OOM, "%s %s more would exceed the %s this arena may hold (the memory fraction cap of %s "
                  "less what the rest of the pool holds)", verb, np_fmt_bytes(bytes, x), np_fmt_bytes(limit_of(ctx, a), y),
                  np_fmt_bytes(ctx->limit, z));
}

/* Cap pressure, where the rules that keep chunks whole apply (exact growths, carves that avoid
 * pinning a wholly free chunk or unmap it first, a top growth aligned to a page): `more` bytes
 * would take the arena past exact_from. Never with compaction: what those rules keep free for a
 * trim, a compaction frees when a request needs it, and their trims and small chunks were most of
 * its calls near the cap (docs/device_calls.md, Compaction: with them on, the physical bound at
 * the minimum capacity held on 10 of 13 traces and no steady call on a full device on 4 of 7;
 * without them, 13 of 13 and 6 of 7, for 2 MiB less waste in all). */
static bool near_cap(const np_ctx *ctx, const np_arena *a, uint64_t more) {
  return !ctx->compact && reserved_of(ctx, a) + more > exact_from(ctx, a);
}

/* Another stream's holes serve a request (behind a device-side wait) when the backend can order
 * streams and every stream is known; once too many streams were seen, holes stay with their stream. */
static bool cross(const np_ctx *ctx, const np_arena *a) { return ctx->be->stream_wait && !a->streams.full; }

/* Whether free memory of tags x and y always merges: of one stream, or untagged. */
static bool compatible(intptr_t x, intptr_t y) { return x == y || x == NP_STREAM_ANY || y == NP_STREAM_ANY; }

/* Cap pressure for what is in use: mapped memory (VMM), or the extent below the top of a fixed
 * arena (which holds its whole cap from the start). */
static bool pressed(const np_ctx *ctx, const np_arena *a) {
  if (a->vmm) return reserved_of(ctx, a) > pressure_from(ctx, a);
  return a->seg && a->seg->size - (a->top ? a->top->size : 0) > pressure_from(ctx, a);
}

/* Whether free memory of tags x and y merges now. Memory of two streams merges only under cap
 * pressure (pressed: past half the budget), where streams can be ordered at all. Far from the cap
 * a mixed hole would make every later request served from it wait for every other stream, a
 * handover (an event record and a stream wait) each time, where holes kept apart serve their own
 * streams without any (four threads on their own streams on an H100: about one handover per two
 * requests, docs/gpu.md 2026-11-27). Near it the memory is worth the waits: holes of several
 * streams, each too small for a request, would need a larger device (never merged, random plays
 * on several streams needed 22% more than on one stream at the median: tests/test_pool.py).
 * Holes left apart before the pressure join at the first request that fails under it
 * (merge_apart). */
static bool merges(const np_ctx *ctx, const np_arena *a, intptr_t x, intptr_t y) {
  return compatible(x, y) || (cross(ctx, a) && pressed(ctx, a));
}

void np_arena_init(np_ctx *ctx, np_arena *a) {
  memset(a, 0, sizeof *a);
  a->vmm = ctx->cfg.vmm && ctx->be->granularity > 0 && ctx->be->reserve;
  a->page = a->vmm ? ctx->be->granularity : NP_MIN_BLOCK;
  a->growth = NP_ARENA_GROWTH;
  a->counts_hwm = true;
  ctx->st.vmm = a->vmm;
}

/* Create the arena: reserve address space for twice the device (VMM: unmapped holes left by
 * empty_cache must not stop the top from growing) or allocate the cap. */
static int ensure(np_ctx *ctx, np_arena *a) {
  if (a->seg) return NP_OK;
  uint64_t limit = limit_of(ctx, a), reserved = reserved_of(ctx, a);
  uint64_t size = a->vmm ? 2 * np_round_up(ctx->be->total, a->page) : np_round_down(limit, NP_MIN_BLOCK);
  if (size == 0) return np_error(NP_ERR_OOM, "the memory fraction cap leaves no room for an arena");
  np_segment *seg = NULL;
  int rc;
  /* A fixed arena asks for the whole cap; where the device has less free (other processes,
   * the runtime's own use), take what there is, down to half the cap. */
  for (uint64_t shrink = size / 16;;) {
    if (!a->vmm && reserved > limit - np_min_u64(size, limit)) {
      rc = over_budget(ctx, a, "reserving", size);
    } else {
      rc = np_segment_create(ctx, size, NP_STREAM_ANY, NP_POOL_SHARED, a->vmm, &seg);
    }
    if (rc != NP_ERR_OOM || a->vmm || size <= limit / 2 + shrink) break;
    size = np_round_down(size - shrink, NP_MIN_BLOCK);
  }
  if (rc != NP_OK) return rc;
  a->seg = seg;
  a->top = seg->head;
  a->page_hwm = 0;
  seg->head->stream = NP_STREAM_ANY;
  return NP_OK;
}

int np_arena_premap(np_ctx *ctx, np_arena *a, uint64_t bytes) {
  bytes = np_min_u64(bytes, limit_of(ctx, a)); /* (a plan file's figure: never past the budget, nor 2^64) */
  if (!a->vmm || !bytes) return NP_OK;
  int rc = ensure(ctx, a);
  if (rc != NP_OK || !a->top || a->seg->mapped >= bytes) return rc;
  /* Requests go to holes before the top: with a hole that has unmapped pages (empty_cache unmapped
   * it under a live block) they would map there and leave the top's chunk idle. */
  for (np_block *b = a->seg->head; b; b = b->next)
    if (!b->allocated && b != a->top && np_vmm_unmapped(ctx, a->seg, b->addr, b->size)) return NP_OK;
  /* the top's first pages holding `need` unmapped ones (a page of it may be mapped already) */
  uint64_t g = a->page, first = np_round_up(a->top->addr - a->seg->addr, g) / g;
  uint64_t end = (a->top->addr + a->top->size - a->seg->addr) / g, need = np_round_up(bytes - a->seg->mapped, g) / g;
  uint64_t p = first, got = 0;
  for (; p < end && got < need; p++) got += !a->seg->pages[p];
  if (got < need || near_cap(ctx, a, need * g)) return NP_OK;
  rc = np_vmm_map_by(ctx, a->seg, a->seg->addr + first * g, (p - first) * g, 0, false);
  if (p > a->page_hwm) a->page_hwm = p; /* (an upper bound of what is mapped, whatever failed) */
  return rc;
}

/* Unmap the mapped pages among pages [first, end) of the arena; the first failure, if any. */
static int unmap_pages(np_ctx *ctx, np_arena *a, uint64_t first, uint64_t end) {
  if (end > a->page_hwm) end = a->page_hwm;
  if (!a->vmm || first >= end) return NP_OK;
  return np_vmm_unmap(ctx, a->seg, a->seg->addr + first * a->page, (end - first) * a->page, false);
}

/* Unmap the whole pages inside free block b. */
static int unmap_free(np_ctx *ctx, np_arena *a, const np_block *b) {
  uint64_t off = b->addr - a->seg->addr;
  return unmap_pages(ctx, a, np_round_up(off, a->page) / a->page, (off + b->size) / a->page);
}

/* Whether a mapped chunk lies wholly inside free block b: what unmap_free would unmap. A trim
 * asks this before it asks the device whether b's stream is done (a stream query). */
static bool whole_chunk_in(const np_ctx *ctx, const np_arena *a, const np_block *b) {
  uint64_t off = b->addr - a->seg->addr, f = np_round_up(off, a->page) / a->page;
  uint64_t e = np_min_u64((off + b->size) / a->page, a->page_hwm), first = 0, n = 0;
  for (uint64_t p = f; p < e; p = a->seg->pages[p] ? first + n : p + 1) {
    if (!a->seg->pages[p]) continue;
    np_vmm_chunk_at(ctx->be, a->seg, p, &first, &n);
    if (first >= f && first + n <= e) return true;
  }
  return false;
}

void np_arena_drop(np_ctx *ctx, np_arena *a) {
  if (!a->seg) return;
  np_segment_drop(ctx, a->seg); /* unmaps what is mapped */
  /* what outlives the memory: the settings, the owner's budget and the streams seen */
  *a = (np_arena){.vmm = a->vmm, .page = a->page, .growth = a->growth, .set_aside = a->set_aside, .outside = a->outside,
                  .counts_hwm = a->counts_hwm, .streams = a->streams};
}

/* Whether free memory last used on stream `tag` may be unmapped now, under cap pressure (trims and
 * unpins only happen there). A stream still running is waited for: a device synchronisation, one
 * per request at most (ctx->synced), so that what the arena unmaps, and so where later blocks go,
 * depends on the requests alone and not on how far the device runs behind the host. Skipping
 * such memory instead made the layout differ from step to step on a GPU: calls in every step and,
 * at a cap with no byte to spare, out of memory in 3 of 7 runs where waiting fit 6 of 6 and made
 * the simulator's calls, step by step (docs/gpu.md, "cudaMalloc's granules"). */
static bool settled(np_ctx *ctx, np_arena *a, intptr_t tag) {
  return ctx->synced || np_tag_settled(ctx, &a->streams, tag) || np_ctx_drain(ctx) == NP_OK;
}

/* Merge two lists of free blocks linked through hnext, each in address order (descending when
 * `down`), into one. */
static np_block *merge_lists(np_block *x, np_block *y, bool down) {
  np_block *head = NULL, **tail = &head;
  while (x && y) {
    np_block **first = (x->addr < y->addr) != down ? &x : &y;
    *tail = *first;
    tail = &(*first)->hnext;
    *first = (*first)->hnext;
  }
  *tail = x ? x : y;
  return head;
}

static np_block *sort_list(np_block *l, bool down) {
  if (!l || !l->hnext) return l;
  np_block *mid = l, *fast = l->hnext;
  for (; fast && fast->hnext; fast = fast->hnext->hnext) mid = mid->hnext;
  np_block *rest = mid->hnext;
  mid->hnext = NULL;
  return merge_lists(sort_list(l, down), sort_list(rest, down), down);
}

/* Whether the arena's free blocks are best found in the hole tree (few holes among many live
 * blocks: a tree step costs ~15x a list step, measured) rather than by a walk over every block:
 * the walks of the free blocks (free_list) and of the releasable memory (releasable) both ask. */
static bool few_holes(const np_ctx *ctx, const np_arena *a) {
  return 16 * (uint64_t)a->holes.count <= ctx->st.total.blocks.current;
}

/* The arena's free blocks, all of them (its holes and its top: the invariant of arena.h) but a
 * block being carved (in no tree), linked through hnext in address order, descending when `down`.
 * hnext is the pointer map's link, unused while a block is free; the list is good until a block
 * is split, merged or allocated. With few holes among many live blocks (few_holes)
 * the holes are found in their tree and sorted, O(f log f) for f of them: trims and the retry ran
 * once per request under cap pressure, and a walk over every block there made a replay quadratic
 * in the live blocks (a planned fallback of 7,000 live blocks and 2 free ones: minutes). With
 * many holes the block list is walked: a tree step and the sort cost more than the blocks between
 * holes (a trim among 32,000 holes and as many live blocks: 4.9 ms found so, 0.5 ms walked). */
static np_block *free_list(const np_ctx *ctx, np_arena *a, bool down) {
  np_block *head = NULL, **tail = &head;
  if (!few_holes(ctx, a)) {
    for (np_block *b = a->seg->head; b; b = b->next) {
      if (!b->in_tree && b != a->top) continue;
      if (down) {
        b->hnext = head;
        head = b;
      } else {
        *tail = b;
        tail = &b->hnext;
      }
    }
    if (!down) *tail = NULL;
    return head;
  }
  head = a->top;
  if (head) head->hnext = NULL;
  for (np_block *b = np_tree_lower_bound(&a->holes, NP_STREAM_ANY, 0); b; b = np_tree_next(&a->holes, b)) {
    b->hnext = head;
    head = b;
  }
  return sort_list(head, down);
}

/* Under cap pressure: unmap whole free pages of free blocks (not `skip`), highest first, until
 * `need` bytes are back (waiting for their streams: settled). Returns the bytes unmapped. */
static uint64_t trim(np_ctx *ctx, np_arena *a, const np_block *skip, uint64_t need) {
  uint64_t before = a->seg->mapped;
  ctx->trimming = true;
  for (np_block *b = free_list(ctx, a, true); b && before - a->seg->mapped < need; b = b->hnext) {
    if (b == skip || !whole_chunk_in(ctx, a, b) || !settled(ctx, a, b->stream)) continue;
    unmap_free(ctx, a, b);
  }
  ctx->trimming = false;
  if (a->seg->mapped < before) ctx->st.trims++;
  return before - a->seg->mapped;
}

/* The bytes a growth far from the cap maps at least: the growth granule (a->growth, PyTorch's
 * large-pool segment); while the arena has no free memory below its top (every byte it placed is
 * live, as in a set-up placing weights and optimizer states), 1 / NP_ARENA_GROWTH_DIV of what it
 * holds when that is more, so that such a phase grows in O(log) chunks rather than one a granule.
 * Never more than reaches the point where growths turn exact (exact_from), nor than a
 * granule past it. 0 (the planned policy's exact fallback) stays 0. */
static uint64_t granule(const np_ctx *ctx, const np_arena *a, uint64_t after) {
  if (!a->growth || a->holes.bytes) return a->growth;
  uint64_t exact_at = exact_from(ctx, a), left = exact_at > after ? exact_at - after : 0;
  return np_max_u64(a->growth, np_min_u64(reserved_of(ctx, a) / NP_ARENA_GROWTH_DIV, left));
}

/* How far the chunk mapped for the unmapped run of pages [r0, end) under a block extends: to
 * at least `least` bytes (granule()) over pages that are unmapped, within `room` more bytes of
 * the budget -- exactly the shortfall near the cap. A growth is one chunk, so a training run's
 * arena grows in few of them and never maps again once its high-water mark is reached. */
static uint64_t grow_end(const np_arena *a, uint64_t r0, uint64_t end, uint64_t least, uint64_t room) {
  uint64_t pages = a->seg->size / a->page, want = r0 + np_max_u64(end - r0, (least + a->page - 1) / a->page);
  uint64_t cap = end + room / a->page, e = end;
  want = np_min_u64(np_min_u64(want, pages), cap);
  while (e < want && !a->seg->pages[e]) e++;
  return e;
}

/* map_range's work, inside a recycle window: trim if the budget presses (the budget counts mapped
 * bytes: spares are mapped again or given back before anything new is created), then map. */
static int grow(np_ctx *ctx, np_arena *a, const np_block *b, uint64_t need, uint64_t limit) {
  if (reserved_of(ctx, a) + need > limit) trim(ctx, a, b, reserved_of(ctx, a) + need - limit);
  if (reserved_of(ctx, a) + need > limit) {
    ctx->fail.needed = np_max_u64(ctx->fail.needed, need);
    return over_budget(ctx, a, "mapping", need);
  }
  uint64_t g = a->page, off = b->addr - a->seg->addr, end = (off + b->size + g - 1) / g, r0 = end;
  while (r0 > off / g && !a->seg->pages[r0 - 1]) r0--;
  /* Near the cap (past 1 / NP_ARENA_NEAR_DIV of it: near_cap) a growth is exactly the shortfall, in
   * chunks that free up whole: the pages b covers whole are one chunk, each page b shares with a
   * neighbour (its first and last, when b starts or ends inside them) one of its own, so that
   * once b is freed its chunk can be trimmed whatever its neighbours hold (a b of whole pages at
   * the top shares none: align_top). Far from the cap, the last unmapped run under b is one chunk
   * grown to granule(), never past a granule below the cap (with compaction, which makes no exact
   * growths, up to the cap). (docs/device_calls.md: the trade-off.) Chunks mapped before a failure
   * stay mapped. */
  uint64_t after = reserved_of(ctx, a) + need, keep = ctx->compact ? 0 : np_min_u64(limit, a->growth);
  bool near = near_cap(ctx, a, need);
  int rc = NP_OK;
  if (!near) {
    uint64_t room = after < limit - keep ? limit - keep - after : 0;
    uint64_t e = r0 < end ? grow_end(a, r0, end, granule(ctx, a, after), room) : end;
    rc = np_vmm_map_by(ctx, a->seg, a->seg->addr + off, e * g - off, 0, false);
    if (e > a->page_hwm) a->page_hwm = e;
    /* a device with less free than the granule (other processes hold the rest): the block's own
     * pages, as near the cap, before the request fails */
    near = rc == NP_ERR_OOM && ctx->fail.refused && e > end;
  }
  if (near) {
    uint64_t whole = np_round_up(off, g) / g, stop = np_max_u64((off + b->size) / g, whole); /* b's whole pages */
    uint64_t cut[4] = {off / g, whole, stop, end};
    rc = NP_OK;
    for (int i = 0; i < 3 && rc == NP_OK; i++)
      if (cut[i + 1] > cut[i]) rc = np_vmm_map_by(ctx, a->seg, a->seg->addr + cut[i] * g, (cut[i + 1] - cut[i]) * g, 0, false);
    if (end > a->page_hwm) a->page_hwm = end;
  }
  return rc;
}

/* Map every unmapped page under block b; trims settled free chunks when the budget would be
 * exceeded, and fails whole if that is not enough. The trimmed chunks' physical allocations are
 * mapped again by this growth or a later one where they fit (spares, vmm.h). */
static int map_range(np_ctx *ctx, np_arena *a, const np_block *b) {
  if (!a->vmm) return NP_OK;
  uint64_t need = np_vmm_unmapped(ctx, a->seg, b->addr, b->size);
  if (!need) return NP_OK;
  uint64_t limit = limit_of(ctx, a);
  bool was = np_vmm_recycle_begin(ctx); /* what the trim unmaps, the growth maps again */
  int rc = grow(ctx, a, b, need, limit);
  np_vmm_recycle_end(ctx, was);
  return rc;
}

static np_block *better(np_block *x, np_block *y) {
  if (!x) return y;
  if (!y) return x;
  return y->size < x->size || (y->size == x->size && y->addr < x->addr) ? y : x;
}

/* Best-fitting hole for `stream`: of its own or untagged; failing that (cross-stream
 * reuse), of any other stream or mixed. */
static np_block *best_hole(const np_ctx *ctx, np_arena *a, intptr_t stream, uint64_t size) {
  np_block *h = better(np_tree_best_fit(&a->holes, stream, size), np_tree_best_fit(&a->holes, NP_STREAM_ANY, size));
  if (h || !cross(ctx, a)) return h;
  h = np_tree_best_fit(&a->holes, NP_STREAM_MIXED, size);
  for (int i = 0; i < a->streams.n; i++)
    if (a->streams.ids[i] != stream) h = better(h, np_tree_best_fit(&a->holes, a->streams.ids[i], size));
  return h;
}

/* Free block b (in no tree): merged into the free block below it when their tags are compatible
 * (that one leaves the tree); returns the block that holds b's memory, in no tree. */
static np_block *merge_prev(np_ctx *ctx, np_arena *a, np_block *b) {
  np_block *p = b->prev;
  if (!p || p->allocated || !merges(ctx, a, p->stream, b->stream)) return b;
  np_tree_remove(&a->holes, p);
  p->stream = np_tag_merge(p->stream, b->stream);
  np_block_merge_next(&ctx->blocks, p);
  return p;
}

/* Free block b (in no tree): merge with free neighbours as `merges` says, then file it; returns
 * the block that holds b's memory. A merge can change b's tag (memory of two streams becomes
 * mixed) and so make a neighbour passed over mergeable, a mixed one always: merge until nothing
 * merges (twice on each side at most). */
static np_block *put_free(np_ctx *ctx, np_arena *a, np_block *b) {
  for (bool merged = true; merged;) {
    np_block *p = merge_prev(ctx, a, b);
    merged = p != b;
    b = p;
    np_block *n = b->next;
    if (n && !n->allocated && n != a->top && merges(ctx, a, n->stream, b->stream)) {
      np_tree_remove(&a->holes, n);
      b->stream = np_tag_merge(b->stream, n->stream);
      np_block_merge_next(&ctx->blocks, b);
      merged = true;
    }
  }
  np_block *n = b->next;
  if (n && n == a->top && b->stream == NP_STREAM_ANY) {
    np_block_merge_next(&ctx->blocks, b);
    a->top = b;
  } else if (!n && b->stream == NP_STREAM_ANY) {
    a->top = b;
  } else {
    np_tree_insert(&a->holes, b);
  }
  return b;
}

/* Carve `size` bytes out of free block h (in no tree); the rest goes back as free memory. */
static int carve(np_ctx *ctx, np_arena *a, np_block *h, uint64_t size, bool high, np_block **out) {
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

/* What the arena could have given a request of `size` it could not place (ctx->fail): free
 * memory it may use (holes, top) plus what its budget still allows mapping. */
static void explain(np_ctx *ctx, np_arena *a, uint64_t size) {
  uint64_t limit = limit_of(ctx, a), reserved = reserved_of(ctx, a);
  uint64_t free_bytes = a->holes.bytes + (a->top ? a->top->size : 0);
  uint64_t room = limit > reserved ? limit - reserved : 0;
  if (a->vmm) { /* free memory counts where mapped; unmapped free memory is room under the cap */
    uint64_t allocated = np_arena_allocated(a);
    uint64_t mapped_free = a->seg && a->seg->mapped > allocated ? a->seg->mapped - allocated : 0;
    free_bytes = mapped_free;
  } else if (!a->seg) {
    free_bytes = room = 0; /* the device would not give the arena its memory */
  } else {
    room = 0; /* a fixed arena never grows */
  }
  ctx->fail.pool = NP_POOL_SHARED;
  ctx->fail.needed = np_max_u64(ctx->fail.needed, size);
  ctx->fail.usable = free_bytes + room;
}

/* Whether the mapped chunk over the page holding address x lies wholly inside hole h and reaches
 * outside [lo, hi): then a block carved at [lo, hi) would pin it. */
static bool pinned_at(const np_ctx *ctx, const np_arena *a, const np_block *h, uintptr_t x, uintptr_t lo, uintptr_t hi) {
  uint64_t g = a->page, p = (x - a->seg->addr) / g, first, n;
  if (!a->seg->pages[p]) return false;
  np_vmm_chunk_at(ctx->be, a->seg, p, &first, &n);
  uintptr_t cs = a->seg->addr + first * g, ce = cs + n * g;
  return cs >= h->addr && ce <= h->addr + h->size && (cs < lo || ce > hi);
}

/* Would carving `size` bytes from hole h at its high (else low) end overlap a mapped chunk lying
 * wholly inside h without covering it? Such a chunk is wholly free; the block would pin it (a
 * chunk is unmapped only whole, so it could not be trimmed while the block lives). A chunk that
 * overlaps the carve without lying inside it holds one of the carve's ends: two chunks to look
 * at, whatever the carve's size. */
static bool pins(const np_ctx *ctx, const np_arena *a, const np_block *h, uint64_t size, bool high) {
  uintptr_t lo = high ? h->addr + h->size - size : h->addr, hi = lo + size;
  return pinned_at(ctx, a, h, lo, lo, hi) || pinned_at(ctx, a, h, hi - 1, lo, hi);
}

/* Under cap pressure, before carving `size` bytes from hole h at its high (else low) end where the
 * carve would pin a wholly free chunk (avoid_pin found no better place): unmap that chunk (a trim,
 * kept as a spare) when it has pages the block does not touch, once h's stream has finished its
 * work (settled: waited for), so that the block maps only its own pages and the chunk's other
 * pages can go where a growth needs them, instead of staying pinned while the block lives. The
 * chunks are found first (the two the carve's ends fall in), and the stream is asked only when
 * there is one. Never past the cap: see below. */
static void unpin(np_ctx *ctx, np_arena *a, const np_block *h, uint64_t size, bool high) {
  /* Past the cap (a fraction lowered below what is mapped) the block could not map its own pages
   * once the chunk is gone: it takes the chunk's mapped memory instead, as from torch's cache. */
  if (!a->vmm || !near_cap(ctx, a, size) || reserved_of(ctx, a) > limit_of(ctx, a)) return;
  uint64_t g = a->page, lo = (high ? h->addr + h->size - size : h->addr) - a->seg->addr, hi = lo + size;
  uint64_t touched[2] = {lo / g, (hi + g - 1) / g}, at[2] = {lo / g, (hi - 1) / g};
  uint64_t first[2], n[2];
  int found = 0;
  for (int i = 0; i < 2; i++) {
    if (!a->seg->pages[at[i]]) continue;
    np_vmm_chunk_at(ctx->be, a->seg, at[i], &first[found], &n[found]);
    uintptr_t cs = a->seg->addr + first[found] * g, ce = cs + n[found] * g;
    bool inside = cs >= h->addr && ce <= h->addr + h->size;
    bool pinned = first[found] < touched[0] || first[found] + n[found] > touched[1];
    if (inside && pinned && !(found == 1 && first[1] == first[0])) found++;
  }
  if (!found || !settled(ctx, a, h->stream)) return;
  uint64_t before = a->seg->mapped;
  bool was = np_vmm_recycle_begin(ctx);
  ctx->trimming = true;
  for (int i = 0; i < found; i++) np_vmm_unmap(ctx, a->seg, a->seg->addr + first[i] * g, n[i] * g, false);
  ctx->trimming = false;
  if (a->seg->mapped < before) ctx->st.trims++; /* a failure leaves the chunk mapped: the block pins it */
  np_vmm_recycle_end(ctx, was);
}

/* The smallest hole tagged s that fits `size` and has an end whose carve pins no chunk and maps
 * at most `need` bytes (*high: that end), looking at *budget holes at most (each one looked at is
 * taken from it); NULL if none. */
static np_block *unpinned_hole(const np_ctx *ctx, const np_arena *a, intptr_t s, uint64_t size, uint64_t need,
                               int *budget, bool *high) {
  for (np_block *b = np_tree_lower_bound(&a->holes, s, size); b && b->stream == s && *budget > 0;
       b = np_tree_next(&a->holes, b), (*budget)--)
    for (int e = 0; e < 2; e++)
      if (!pins(ctx, a, b, size, e) &&
          np_vmm_unmapped(ctx, a->seg, e ? b->addr + b->size - size : b->addr, size) <= need) {
        *high = e;
        return b;
      }
  return NULL;
}

/* No room for `size` bytes in the arena's address range: full, or the request alone passes it. */
static int range_full(const np_arena *a, uint64_t size) {
  if (a->seg && size > a->seg->size) {
    char x[32];
    return np_error(NP_ERR_OOM, "the request is larger than the arena's whole address range (%s)",
                    np_fmt_bytes(a->seg->size, x));
  }
  return np_error(NP_ERR_OOM, "the arena's address range is full");
}

/* Under cap pressure (reserved + size past budget / NP_ARENA_NEAR_DIV), keep free chunks whole so
 * trims can return them: when carving best fit h at its usual end would pin a wholly free chunk,
 * carve at its other end, or failing that take the smallest hole best_hole may take with an end that
 * pins nothing, is at most one growth (a->growth) larger than h and maps no more than h's carve
 * would (*long_lived then names the end): avoiding a pin never costs more than a granule of
 * fragmentation nor any extra mapping. This is the arena's only walk over holes: it runs only
 * in that case and looks at NP_ARENA_PIN_WALK holes at most; when none qualifies, h stays.
 * Invariant: the hole returned fits `size` and may serve `stream` (it is h or comes
 * from a tag best_hole may take from). */
static np_block *avoid_pin(np_ctx *ctx, np_arena *a, np_block *h, intptr_t stream, uint64_t size, bool *long_lived) {
  if (!a->vmm || !h || !near_cap(ctx, a, size) || !pins(ctx, a, h, size, !*long_lived)) return h;
  if (!pins(ctx, a, h, size, *long_lived)) {
    *long_lived = !*long_lived;
    return h;
  }
  /* the tags best_hole may take from, own stream first */
  int budget = NP_ARENA_PIN_WALK, tags = cross(ctx, a) ? 3 + a->streams.n : 2;
  uint64_t need = np_vmm_unmapped(ctx, a->seg, *long_lived ? h->addr : h->addr + h->size - size, size);
  np_block *best = NULL;
  bool high = false;
  for (int i = 0; i < tags && budget > 0; i++) {
    intptr_t s = i == 0 ? stream : i == 1 ? NP_STREAM_ANY : i == 2 ? NP_STREAM_MIXED : a->streams.ids[i - 3];
    if (i > 0 && s == stream) continue;
    bool e;
    np_block *b = unpinned_hole(ctx, a, s, size, need, &budget, &e);
    if (b && b->size <= h->size + a->growth && (!best || b->size < best->size)) {
      best = b;
      high = e;
    }
  }
  if (!best) return h;
  *long_lived = !high;
  return best;
}

/* Whether every page under block b is surely mapped, in O(1): b ends at or below the high-water
 * mark and no page under the mark is unmapped (mapped bytes == the mark's). The common case of a
 * block carved from a hole, where map_range's page-table walk would find nothing to map. */
static bool surely_mapped(const np_arena *a, const np_block *b) {
  if (!a->vmm) return true;
  uint64_t hwm = a->page_hwm * a->page;
  return a->seg->mapped == hwm && b->addr + b->size - a->seg->addr <= hwm;
}

/* Whether carving `size` bytes from free block h at its high (else low) end maps nothing: O(1) in
 * the common case (surely_mapped's test, inline), else a walk of the carve's pages. */
static inline bool carve_mapped(const np_ctx *ctx, const np_arena *a, const np_block *h, uint64_t size, bool high) {
  if (!a->vmm) return true;
  uintptr_t lo = high ? h->addr + h->size - size : h->addr;
  uint64_t hwm = a->page_hwm * a->page;
  return (a->seg->mapped == hwm && lo + size - a->seg->addr <= hwm) || np_vmm_unmapped(ctx, a->seg, lo, size) == 0;
}

/* Near the cap, a request of whole pages that grows the top from inside a page starts on the next
 * page boundary: its growth is then one chunk (its own pages) instead of two or three (the pages it
 * covers whole, and the page it would share with each neighbour). The skipped piece of the page
 * below stays free (a hole, merged with free memory beneath it): a later smaller request takes it
 * without a device call. Returns the free block to carve the request from at its low end. */
static np_block *align_top(np_ctx *ctx, np_arena *a, np_block *t, uint64_t size) {
  uint64_t g = a->page, off = t->addr - a->seg->addr, skip = np_round_up(off, g) - off;
  if (!a->vmm || !skip || size % g || t->size < skip + size || !near_cap(ctx, a, size)) return t;
  np_block *gap = np_block_split(&ctx->blocks, t, skip, false);
  if (!gap) return t; /* host out of memory: place it unaligned */
  np_block *rest = gap->next;
  np_tree_insert(&a->holes, merge_prev(ctx, a, gap)); /* not put_free: rest, free until carved, would join */
  return rest;
}

/* The free block beside the allocated block that the last block of the request's place key was
 * placed against (ctx->again: np_lifetime keeps it), when it fits `size` and may serve `stream`: the
 * request goes back there, at the end that touches the anchor (*high: the free block's high end).
 * In a loop that repeats, every request then takes the place its predecessor had, and an iteration
 * repeats the layout of the one before, which fitted in what is mapped; a best fit may choose
 * otherwise once requests change lifetime class or the free memory differs by a block, and a
 * request larger than every hole left then maps more at the top (docs/device_calls.md). The place
 * is a carve from an end of a free block, never from its middle: ABOVE, at the anchor's end, only
 * where the last block started there (the anchor kept its size); BELOW, ending at the anchor. The
 * pointer map finds the anchor in O(1), a block of this arena or not, allocated at that address
 * now. */
static np_block *placed_again(np_ctx *ctx, np_arena *a, uint64_t size, intptr_t stream, bool *high) {
  const np_place *p = &ctx->again;
  if (p->side == NP_PLACE_NONE || !a->seg) return NULL;
  np_block *f = NULL;
  if (p->anchor) {
    np_block *n = np_ptrmap_find(&ctx->live, p->anchor);
    if (!n || n->seg != a->seg) return NULL;
    f = p->side == NP_PLACE_ABOVE ? n->next : n->prev;
  } else if (p->side == NP_PLACE_ABOVE) {
    f = a->seg->head;
  }
  if (!f || f->allocated || f->size < size || !compatible(f->stream, stream) || (!f->in_tree && f != a->top))
    return NULL;
  if (p->side == NP_PLACE_ABOVE && f->addr != p->at) return NULL;
  *high = p->side == NP_PLACE_BELOW;
  return f;
}

/* Where block b, just carved, lies: against the allocated block below it or the segment's start,
 * else against the allocated block above it (placed_again, for its place key's next request). */
static void note_place(np_block *b) {
  const np_block *p = b->prev, *n = b->next;
  b->side = !p || p->allocated ? NP_PLACE_ABOVE : n && n->allocated ? NP_PLACE_BELOW : NP_PLACE_NONE;
  b->anchor = b->side == NP_PLACE_ABOVE ? (p ? p->addr : 0) : b->side == NP_PLACE_BELOW ? n->addr : 0;
}

/* Best fit (best_hole) with the end to carve (*long_lived: the low end), under cap pressure moved
 * so as not to pin a free chunk (avoid_pin); NULL when no hole fits. */
static np_block *best_fit(np_ctx *ctx, np_arena *a, intptr_t stream, uint64_t size, bool *long_lived) {
  np_block *h = best_hole(ctx, a, stream, size);
  /* A short-lived block takes its hole's high end, except in the hole just below the top: there
   * the low end, so that the rest of the hole stays next to the top, where a request larger
   * than every hole starts (absorb, below) instead of mapping above it. */
  if (h && !*long_lived && h->next && h->next == a->top) *long_lived = true;
  return avoid_pin(ctx, a, h, stream, size, long_lived);
}

static int try_place(np_ctx *ctx, np_arena *a, uint64_t size, intptr_t stream, bool long_lived, np_block **out) {
  const bool lifetime_class = long_lived; /* (long_lived below: the end to carve) */
  bool high;
  np_block *h = placed_again(ctx, a, size, stream, &high);
  if (h && !carve_mapped(ctx, a, h, size, high) && !pressed(ctx, a)) {
    /* Far from the cap, a place that would map memory (empty_cache unmapped it) yields to a hole
     * best fit carves without mapping: a place must not grow the arena where best fit would not.
     * Under cap pressure it stays (a trim unmaps places every iteration there, and best fit's
     * holes were no better: h100-gpt-bf16-train's steady calls on a full device went from 11 to
     * 161 under torch_npu's rules); a request it would fail goes by best fit (below). */
    bool end = long_lived;
    np_block *fit = best_fit(ctx, a, stream, size, &end);
    if (fit && carve_mapped(ctx, a, fit, size, !end)) h = NULL;
  }
  bool placed = h != NULL;
  intptr_t used_by; /* who used the memory before: whom the request must be ordered after */
  if (h) {
    long_lived = !high; /* (the end to carve, whatever its class) */
    if (h == a->top) a->top = NULL;
    else np_tree_remove(&a->holes, h);
    used_by = h->stream;
  } else if ((h = best_fit(ctx, a, stream, size, &long_lived))) {
    np_tree_remove(&a->holes, h);
    used_by = h->stream;
  } else {
    np_block *t = a->top;
    if (!t) return range_full(a, size);
    np_block *below = t->prev;
    /* No hole fits, so a usable hole under the top is smaller than the request:
     * start the request there; it covers the whole hole, the rest is untagged. */
    bool absorb = below && !below->allocated && (compatible(below->stream, stream) || cross(ctx, a)) &&
                  below->size + t->size >= size;
    if (!absorb && t->size < size) return range_full(a, size);
    used_by = NP_STREAM_ANY;
    if (absorb) {
      np_tree_remove(&a->holes, below);
      used_by = below->stream;
      np_block_merge_next(&ctx->blocks, below);
      t = below;
      t->stream = NP_STREAM_ANY;
    }
    a->top = NULL;
    h = absorb ? t : align_top(ctx, a, t, size);
    long_lived = true; /* take h's low end: the high-water mark grows only by `size` (and an alignment) */
  }
  unpin(ctx, a, h, size, !long_lived);
  np_block *b = NULL;
  int rc = carve(ctx, a, h, size, !long_lived, &b);
  if (rc != NP_OK) {
    h->stream = np_tag_merge(h->stream, used_by);
    put_free(ctx, a, h);
    return rc;
  }
  rc = surely_mapped(a, b) ? NP_OK : map_range(ctx, a, b);
  if (rc == NP_OK) rc = np_order_after(ctx, &a->streams, stream, used_by);
  if (rc != NP_OK) {
    b->stream = np_tag_merge(b->stream, used_by);
    put_free(ctx, a, b);
    if (rc == NP_ERR_OOM && placed) { /* a place never fails a request that best fit serves */
      ctx->again.side = NP_PLACE_NONE;
      return try_place(ctx, a, size, stream, lifetime_class, out);
    }
    return rc;
  }
  b->stream = stream;
  uint64_t end = b->addr + b->size - a->seg->addr;
  if (a->counts_hwm && end > ctx->st.arena_hwm.peak) ctx->st.arena_hwm.peak = end;
  if (ctx->marks.any) note_place(b); /* (sites are known, and their places kept, only then) */
  *out = b;
  return NP_OK;
}

/* Device synchronisation: clear every stream tag, merge free neighbours, rebuild the tree.
 * Returns the free blocks left, in address order (free_list). */
static np_block *synchronize(np_ctx *ctx, np_arena *a) {
  np_block *list = free_list(ctx, a, false);
  memset(&a->holes, 0, sizeof a->holes);
  a->top = NULL;
  for (np_block *b = list; b; b = b->hnext) {
    b->in_tree = 0;
    b->stream = NP_STREAM_ANY;
    while (b->next && !b->next->allocated) {
      if (b->hnext == b->next) b->hnext = b->next->hnext; /* (always: every free block is listed) */
      b->next->in_tree = 0;
      np_block_merge_next(&ctx->blocks, b);
    }
    if (b->next) np_tree_insert(&a->holes, b);
    else a->top = b;
  }
  return list;
}

/* Synchronise the arena and unmap the whole pages inside its free memory; the first failure. */
static int release(np_ctx *ctx, np_arena *a) {
  if (!a->seg) return NP_OK;
  np_block *list = synchronize(ctx, a);
  int first = NP_OK;
  np_saved_error s; /* np_save_error writes it before np_restore_error reads it */
  for (np_block *b = list; a->vmm && b; b = b->hnext) {
    int rc = unmap_free(ctx, a, b);
    if (rc != NP_OK && first == NP_OK) np_save_error(&s, first = rc);
  }
  return first == NP_OK ? NP_OK : np_restore_error(&s);
}

int np_arena_empty_cache(np_ctx *ctx, np_arena *a) {
  if (!a->vmm && a->seg) {
    bool empty = true;
    for (np_block *b = a->seg->head; b && empty; b = b->next) empty = !b->allocated;
    if (empty) {
      np_arena_drop(ctx, a); /* nothing allocated: return the whole fixed arena */
      return NP_OK;
    }
  }
  return release(ctx, a);
}

/* Under cap pressure, before the retry: merge the neighbouring holes of two streams that were left
 * apart while the cap was far (merges() looks only at a freed block's neighbours, when it is
 * freed), so that a request only they together fit costs a stream wait instead of a device
 * synchronisation. Each such hole is filed again (put_free: under pressure every free neighbour
 * merges, so the first of each run of free blocks takes the run). Whether any merged. */
static bool merge_apart(np_ctx *ctx, np_arena *a) {
  bool any = false;
  for (np_block *b = free_list(ctx, a, false), *after; b; b = after) {
    /* the first listed block past b's free neighbours (they may merge away): a run's first */
    for (after = b; after->hnext && after->hnext == after->next;) after = after->hnext;
    after = after->hnext;
    if (b != a->top && b->next && !b->next->allocated && b->next != a->top) {
      np_tree_remove(&a->holes, b);
      put_free(ctx, a, b);
      any = true;
    }
  }
  return any;
}

/* A chunk holding live blocks and free pages: its first page, its pages, its free pages. */
typedef struct part_free { uint64_t first, n, idle; } part_free;

/* (arena.h) From the free blocks only, as a refused request's other steps (free_list): the pages
 * wholly inside a run of touching free blocks are the free ones, and each chunk they fall in counts
 * them unless they are all of it. O(f log f + the mapped pages in free runs) for f free blocks. */
uint64_t np_arena_pinned(np_ctx *ctx, np_arena *a) {
  if (!a->vmm || !a->seg) return 0;
  uint64_t g = a->page, base = a->seg->addr, total = 0, chunk = UINT64_MAX, chunk_n = 0, idle = 0;
  for (np_block *b = free_list(ctx, a, false); b;) {
    uintptr_t s = b->addr, e = b->addr + b->size;
    for (b = b->hnext; b && b->addr == e; b = b->hnext) e = b->addr + b->size; /* touching: one run */
    uint64_t p = (s - base + g - 1) / g, stop = np_min_u64((e - base) / g, a->page_hwm);
    while (p < stop) {
      if (!a->seg->pages[p]) {
        p++;
        continue;
      }
      uint64_t first, n;
      np_vmm_chunk_at(ctx->be, a->seg, p, &first, &n);
      if (first != chunk) { /* the chunks come in address order: the last one is done */
        total += idle < chunk_n ? idle : 0;
        chunk = first, chunk_n = n, idle = 0;
      }
      uint64_t upto = np_min_u64(first + n, stop);
      idle += upto - p;
      p = upto;
    }
  }
  total += idle < chunk_n ? idle : 0;
  return total * g;
}

/* The cheapest first: most free pages per live page copied (a/(n-a) > b/(m-b), cross-multiplied;
 * page counts stay far below 2^32), then most free pages, then the lowest. */
static int cheapest_first(const void *x, const void *y) {
  const part_free *a = x, *b = y;
  uint64_t l = a->idle * (b->n - b->idle), r = b->idle * (a->n - a->idle);
  if (l != r) return l < r ? 1 : -1;
  return a->idle != b->idle ? (a->idle < b->idle ? 1 : -1) : (a->first > b->first) - (a->first < b->first);
}

/* Compaction (np_set_compaction), the last step before a request fails: the chunks that hold live
 * blocks and free pages, those that free the most per byte copied first, replaced by chunks over
 * the pages live blocks touch (np_vmm_compact: their bytes through the host) until the budget has
 * room for the pages of a `size`-byte request (what it had left counts: a request short of a
 * little copies no more than that little), and all of them in a second `round`. The device is
 * idle: the retry synchronised it (np_ctx_drain), so every free block is settled. Returns whether
 * any memory went back; NP_ERR_STATE (*rc) when live bytes were lost; a chunk the device would not
 * let go stays as it was, its error saved in *refused (the first). O(blocks + mapped pages): a
 * request that would fail pays it, no other. */
static bool compact(np_ctx *ctx, np_arena *a, uint64_t size, int round, int *rc, np_saved_error *refused) {
  uint64_t g = a->page, pages = a->page_hwm, n_parts = 0, freed = 0;
  uint8_t *live = pages ? calloc(pages, 1) : NULL;
  part_free *parts = pages ? malloc(pages * sizeof *parts) : NULL;
  if (!live || !parts) { /* host out of memory: the request fails as it would without compaction */
    free(live);
    free(parts);
    return false;
  }
  for (np_block *b = a->seg->head; b; b = b->next)
    if (b->allocated) {
      uint64_t off = b->addr - a->seg->addr;
      for (uint64_t p = off / g; p < (off + b->size + g - 1) / g && p < pages; p++) live[p] = 1;
    }
  for (uint64_t p = 0, first, n; p < pages; p = first + n) {
    first = p;
    n = 1;
    if (!a->seg->pages[p]) continue;
    np_vmm_chunk_at(ctx->be, a->seg, p, &first, &n);
    uint64_t used = 0;
    for (uint64_t q = first; q < first + n; q++) used += live[q];
    if (used && used < n) parts[n_parts++] = (part_free){first, n, n - used};
  }
  qsort(parts, n_parts, sizeof *parts, cheapest_first);
  /* What the budget must have free for the request: its whole pages (a placement maps whole pages,
   * so `size` alone stops short when the budget's room is not a multiple of a page, and the second
   * round then compacts every chunk), plus what the arena holds past a lowered cap. */
  uint64_t limit = limit_of(ctx, a), reserved = reserved_of(ctx, a);
  uint64_t want = np_round_up(size, g) + (reserved > limit ? reserved - limit : 0);
  uint64_t left = limit > reserved ? limit - reserved : 0;
  for (uint64_t i = 0; i < n_parts && (round || freed + left < want); i++) {
    uint64_t got = 0;
    *rc = np_vmm_compact(ctx, a->seg, parts[i].first, parts[i].n, live + parts[i].first, &got);
    freed += got;
    if (*rc == NP_ERR_STATE && ctx->lost) break; /* (other failures leave that chunk as it was) */
    if (*rc != NP_OK && refused->code == NP_OK) np_save_error(refused, *rc);
    *rc = NP_OK;
  }
  free(live);
  free(parts);
  return freed > 0;
}

bool np_arena_compact(np_ctx *ctx, np_arena *a, int *rc) {
  np_saved_error refused = {.code = NP_OK};
  *rc = NP_OK;
  bool freed = a->vmm && a->seg && compact(ctx, a, 0, 1, rc, &refused);
  if (*rc == NP_OK && refused.code != NP_OK) *rc = np_restore_error(&refused);
  return freed;
}

int np_arena_malloc(np_ctx *ctx, np_arena *a, uint64_t req, intptr_t stream, bool long_lived, np_block **out) {
  uint64_t size = np_round_up(req, NP_MIN_BLOCK);
  int rc = ensure(ctx, a);
  if (rc != NP_OK) {
    if (rc == NP_ERR_OOM) explain(ctx, a, size);
    return rc;
  }
  np_streams_note(&a->streams, stream);
  rc = try_place(ctx, a, size, stream, long_lived, out);
  if (rc == NP_ERR_OOM && cross(ctx, a) && pressed(ctx, a) && merge_apart(ctx, a))
    rc = try_place(ctx, a, size, stream, long_lived, out);
  if (rc == NP_ERR_OOM) {
    /* what PyTorch does on failure, at arena scale: synchronise, release free pages, retry once */
    ctx->st.retries++;
    rc = np_ctx_drain(ctx); /* (settled may have synchronised, this request) */
    if (rc != NP_OK) return rc;
    bool was = np_vmm_recycle_begin(ctx); /* the pages released, the retry maps again */
    release(ctx, a); /* a page the device refuses to unmap stays mapped and is counted */
    rc = try_place(ctx, a, size, stream, long_lived, out);
    np_vmm_recycle_end(ctx, was);
    np_vmm_spares_release(ctx); /* as PyTorch's retry: what the request did not take goes back */
    for (int round = 0; rc == NP_ERR_OOM && ctx->compact && a->vmm && round < 2; round++) {
      int lost = NP_OK;
      np_saved_error refused = {.code = NP_OK}; /* (a chunk the device kept stays as it was: the request goes on) */
      bool freed = compact(ctx, a, size, round, &lost, &refused);
      if (lost != NP_OK) return lost; /* (its message, which a retry would overwrite) */
      if (freed) rc = try_place(ctx, a, size, stream, long_lived, out);
    }
    if (rc == NP_ERR_OOM) explain(ctx, a, size);
  }
  return rc;
}

void np_arena_record_stream(np_arena *a, intptr_t stream) {
  np_streams_note(&a->streams, stream); /* mixed memory waits on every noted stream */
}

void np_arena_free(np_ctx *ctx, np_arena *a, np_block *b) {
  if (b->shared) { /* used on other streams too (record_stream): reuse must wait on all of them */
    b->stream = NP_STREAM_MIXED;
    b->shared = 0;
  }
  put_free(ctx, a, b);
}

int np_arena_set_limit(np_ctx *ctx, np_arena *a) {
  if (a->vmm || !a->seg) return NP_OK;
  for (np_block *b = a->seg->head; b; b = b->next) {
    if (!b->allocated) continue;
    char x[32];
    return np_error(NP_ERR_STATE, "the arena is already allocated at %s without a virtual-memory API; "
                    "set the fraction before the first allocation", np_fmt_bytes(a->seg->size, x));
  }
  np_arena_drop(ctx, a); /* empty: the next request reserves the new size */
  return NP_OK;
}

/* Whether free block b starts a run of free blocks (release merges a run into one block). */
static bool starts_run(const np_block *b) { return !b->allocated && (!b->prev || b->prev->allocated); }

/* What unmap_free unmaps of the free run starting at b (its free neighbours merged, as release
 * merges them first). */
static uint64_t releasable_run(const np_ctx *ctx, const np_arena *a, const np_block *b) {
  uint64_t off = b->addr - a->seg->addr, size = b->size;
  for (b = b->next; b && !b->allocated; b = b->next) size += b->size;
  uint64_t first = np_round_up(off, a->page) / a->page, end = np_min_u64((off + size) / a->page, a->page_hwm);
  return first < end ? np_vmm_whole_chunks(ctx, a->seg, a->seg->addr + first * a->page, (end - first) * a->page) : 0;
}

/* The bytes np_arena_empty_cache would return now: the chunks wholly inside free memory, each
 * free run counted once from its start; a fixed arena with nothing allocated, whole. A stats
 * call pays for it: with few holes among many live blocks (few_holes) the holes and the top are
 * visited, else the block list. */
static uint64_t releasable(const np_ctx *ctx, const np_arena *a) {
  uint64_t bytes = 0;
  if (!a->vmm) {
    for (const np_block *b = a->seg->head; b; b = b->next)
      if (b->allocated) return 0;
    return a->seg->mapped;
  }
  if (few_holes(ctx, a)) {
    for (const np_block *b = np_tree_lower_bound(&a->holes, INTPTR_MIN, 0); b; b = np_tree_next(&a->holes, b))
      if (starts_run(b)) bytes += releasable_run(ctx, a, b);
    if (a->top && starts_run(a->top)) bytes += releasable_run(ctx, a, a->top);
    return bytes;
  }
  for (const np_block *b = a->seg->head; b; b = b->next)
    if (starts_run(b)) bytes += releasable_run(ctx, a, b);
  return bytes;
}

void np_arena_fill_stats(np_ctx *ctx, np_arena *a, np_stats *st) {
  if (!a->seg) return;
  st->releasable += releasable(ctx, a);
  uint64_t largest = np_tree_max_size(&a->holes);
  if (a->counts_hwm) /* (the main arena's; a tag's is its own) */
    st->arena_hwm.current = (a->top ? a->top->addr : a->seg->addr + a->seg->size) - a->seg->addr;
  if (a->top) {
    uint64_t room = a->top->size;
    if (a->vmm) { /* the top can grow by the budget's free pages plus pages it already has mapped */
      uint64_t first = np_round_up(a->top->addr - a->seg->addr, a->page) / a->page, mapped = 0;
      for (uint64_t p = first; p < a->page_hwm; p++) mapped += a->seg->pages[p] ? a->page : 0;
      uint64_t limit = limit_of(ctx, a), reserved = reserved_of(ctx, a);
      room = np_min_u64(room, (limit > reserved ? limit - reserved : 0) + mapped);
    }
    largest = np_max_u64(largest, room);
  }
  st->largest_free = np_max_u64(st->largest_free, largest);
}

int np_arena_check(np_ctx *ctx, np_arena *a) {
  if (!np_tree_check(&a->holes)) return np_error(NP_ERR_STATE, "check: arena hole tree is corrupt");
  if (!a->seg) return a->holes.count ? np_error(NP_ERR_STATE, "check: holes without an arena") : NP_OK;
  size_t holes = 0;
  np_block *last = NULL;
  for (np_block *b = a->seg->head; b; last = b, b = b->next) {
    if (b->allocated) {
      if (a->vmm && np_vmm_unmapped(ctx, a->seg, b->addr, b->size))
        return np_error(NP_ERR_STATE, "check: allocated block %#lx on an unmapped page", (unsigned long)b->addr);
      continue;
    }
    if (b == a->top) {
      if (b->next || b->stream != NP_STREAM_ANY) return np_error(NP_ERR_STATE, "check: the top is not the last untagged block");
      continue;
    }
    if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free block %#lx is not a hole", (unsigned long)b->addr);
    if (b->next && !b->next->allocated && b->next != a->top && compatible(b->stream, b->next->stream))
      return np_error(NP_ERR_STATE, "check: compatible holes not merged at %#lx", (unsigned long)b->addr);
    holes++;
  }
  if (holes != a->holes.count) return np_error(NP_ERR_STATE, "check: the hole tree holds stray blocks");
  if (!a->top && last && !last->allocated && last->stream == NP_STREAM_ANY)
    return np_error(NP_ERR_STATE, "check: free untagged last block is not the top");
  for (uint64_t p = a->page_hwm; a->vmm && p < a->seg->size / a->page; p++)
    if (a->seg->pages[p]) return np_error(NP_ERR_STATE, "check: a page above the arena's high-water mark is mapped");
  return NP_OK;
}
