/* arena.h -- one arena: the npu_pool policy's memory, and the planned policy's fallback.
 *
 * With a virtual-memory API the arena is an address reservation of twice the device, mapped in
 * chunks as its high-water mark grows (one physical allocation and one map per chunk: a growth is
 * one chunk of at least NP_ARENA_GROWTH far from the cap; near it, exactly the shortfall, a block's
 * whole pages one chunk and each page it shares with a neighbour one of its own) and unmapped in
 * whole free chunks, kept as spares for a later growth (the page table is the segment's, vmm.h);
 * without one it is a single device allocation of the cap.
 *
 *  - blocks are exact (512-byte rounded): no segment rounding, no boundaries;
 *  - a request whose place key's last block lay against an allocated block that is still there
 *    (np_place: just above or below it, kept per key by np_lifetime from the first optimizer step
 *    on: context.c, place_key) goes back there when the free block beside it, of its stream or
 *    untagged, fits and starts where that block did (above the neighbour) or ends at the
 *    neighbour (below it): a loop that repeats repeats its layout, which fitted in what is mapped
 *    (arena.c, placed_again). Far from the cap not where that maps memory and a best fit would
 *    not; a request a place would fail goes by best fit (arena.c, try_place). Otherwise:
 *  - a request takes the smallest hole that fits (O(log n) tree by stream, size, address),
 *    long-lived at the hole's low end, short-lived at its high end, so short-lived churn
 *    stays away from long-lived neighbours and the hole that remains is contiguous with
 *    other free memory (in the hole just below the top, short-lived at the low end too: the
 *    rest then stays next to the top, where a request larger than every hole starts);
 *  - under cap pressure (reserved past cap / NP_ARENA_NEAR_DIV) a carve that would put the block
 *    inside a mapped chunk that is wholly free ("pin" it: it could no longer be trimmed) takes
 *    the hole's other end, or else the smallest compatible hole whose carve pins nothing (at
 *    most one growth larger, mapping no more), among NP_ARENA_PIN_WALK holes at most; failing
 *    that, it unmaps the free chunk first (a trim) and maps only the block's own pages;
 *  - when no hole fits it extends the top (the free memory above the highest allocation),
 *    first taking a hole of its stream that touches the top; under cap pressure a request of
 *    whole pages that would start inside a page starts on the next one (its growth is one
 *    chunk), the skipped piece staying a hole;
 *  - freed memory keeps the tag of the stream that used it ("mixed" for a block used on several,
 *    record_stream, or for free memory of several merged); free memory of two streams merges
 *    only under cap pressure (arena.c, merges). A request prefers holes of its
 *    own stream or untagged ones (never used, or synchronised); failing that, where the backend
 *    can order streams on the device (an event wait, as cudaMallocAsync pools do) it takes
 *    another stream's hole and makes its stream wait for that stream's queued work: memory
 *    serves every stream without a host synchronisation, a handover (event record and wait)
 *    each time it changes streams. Without that hook, holes stay with their stream until
 *    a synchronisation (empty_cache, or the retry after a failure) clears the tags;
 *  - when mapping would pass the budget, it first trims: unmaps whole free chunks, highest
 *    first, waiting for the device first when one of their streams still has queued work
 *    (one synchronisation per request at most: arena.c, settled); only if that is not
 *    enough does the request fail into the retry, which synchronises the device and
 *    unmaps every whole free chunk, as empty_cache; with compaction (np_set_compaction) a
 *    request that still fails then compacts (arena.c, compact), and the rules above that keep
 *    chunks whole under cap pressure (exact growths, pins avoided or unmapped, the aligned top
 *    start) do not apply: a compaction frees what they keep free, when it is needed.
 *
 * The arena's budget is the context's cap less `set_aside` (promised to its owner, e.g. the
 * planned region) and the reserved bytes `outside` it (held by its owner): its owner keeps
 * both up to date before every call.
 *
 * Invariants: the segment is tiled by its blocks; `top` is the last block when that block
 * is free and untagged, else NULL; every other free block is in `holes`; no two
 * neighbouring free blocks with compatible tags (the same stream's, or one untagged) are left
 * unmerged except a tagged hole below the top (holes of two streams may be, arena.c: merges);
 * with VMM every page touched by an allocated block is mapped, and no page at or above page_hwm
 * was ever mapped.
 */
#ifndef NP_ARENA_H
#define NP_ARENA_H

#include "streams.h"
#include "tree.h"

/* The least an arena grows by (VMM): one chunk of PyTorch's large-pool segment size (20 MiB),
 * rounded to the granularity, while its reserved bytes stay under cap / NP_ARENA_NEAR_DIV and a
 * granule below the cap (with compaction: up to the cap, arena.c near_cap); past that, growths are
 * exact, in chunks that free up whole with their block, so that trims can return free memory
 * (docs/device_calls.md: the trade-off). */
#define NP_ARENA_GROWTH (20 * NP_MIB)
#define NP_ARENA_NEAR_DIV 2
/* Far from the cap, while the arena has no free memory below its top, a growth maps at least
 * 1 / NP_ARENA_GROWTH_DIV of what it holds (when that is more than NP_ARENA_GROWTH): a set-up that
 * only places grows geometrically, as mimalloc's arenas do, in few chunks; what is mapped ahead
 * of need is what the next requests take. Once memory is freed inside the arena, a growth is a
 * granule again: a large chunk holding freed holes could not be trimmed (docs/device_calls.md). */
#define NP_ARENA_GROWTH_DIV 8
/* The most holes a placement looks at to avoid pinning a wholly free chunk under cap pressure
 * (arena.c, avoid_pin): the walk is bounded, the hot path keeps best fit's O(log n). */
#define NP_ARENA_PIN_WALK 32

typedef struct np_arena {
  np_tree holes;
  np_segment *seg;      /* NULL until the first request */
  np_block *top;
  bool vmm;
  uint64_t page;        /* mapping granularity (VMM) or NP_MIN_BLOCK */
  uint64_t page_hwm;    /* pages at or above this index have never been mapped */
  uint64_t growth;      /* least bytes a growth maps far from the cap (NP_ARENA_GROWTH; 0: exactly the shortfall) */
  uint64_t set_aside;   /* bytes of the cap the arena must leave to its owner */
  uint64_t outside;     /* reserved bytes that are not the arena's */
  bool counts_hwm;      /* its high-water mark is the context's arena_hwm (not a tag's arena) */
  np_streams streams;   /* streams that allocated or were recorded, for waits on mixed memory */
} np_arena;

void np_arena_init(np_ctx *ctx, np_arena *a);
/* Return the arena's memory to the device (its blocks' pointers are forgotten). */
void np_arena_drop(np_ctx *ctx, np_arena *a);
/* Have `bytes` mapped: what the arena lacks of them, mapped at the start of its top (where a request no
 * hole fits goes; one chunk unless pages there are mapped already) while that stays short of cap
 * pressure (past it growths are exact, and a chunk mapped ahead would be split by the first block
 * carved from it; with compaction, which has no exact growths, up to the cap) and no hole has
 * unmapped pages (requests would go there first). Memory its owner
 * knows will be asked for (the planned policy's fallback: what the plan leaves out), mapped ahead so
 * that the requests find it mapped. Otherwise, and without VMM, nothing. */
int np_arena_premap(np_ctx *ctx, np_arena *a, uint64_t bytes);
/* Place `size` bytes (rounded) for `stream`; on failure, synchronise, release and retry once. */
int np_arena_malloc(np_ctx *ctx, np_arena *a, uint64_t size, intptr_t stream, bool long_lived, np_block **out);
/* The device idle: replace every chunk of a that holds live blocks and free pages by chunks over its
 * live pages (np_compact; with np_set_compaction, a request of another arena before it fails).
 * Returns whether any memory went back; *rc NP_ERR_STATE when live bytes were lost (ctx->lost), else
 * the first refusal of a chunk the device would not let go (it stays as it was). */
bool np_arena_compact(np_ctx *ctx, np_arena *a, int *rc);
/* The bytes a compaction of a would give back: the free pages of its chunks that hold live blocks
 * (np_compact's figure for a), walking no live block. */
uint64_t np_arena_pinned(np_ctx *ctx, np_arena *a);
void np_arena_free(np_ctx *ctx, np_arena *a, np_block *b);
void np_arena_record_stream(np_arena *a, intptr_t stream);
/* The device was synchronised: clear the tags, return free pages (or the whole empty fixed arena). */
int np_arena_empty_cache(np_ctx *ctx, np_arena *a);
/* A new cap: a fixed arena can only change while empty. */
int np_arena_set_limit(np_ctx *ctx, np_arena *a);
void np_arena_fill_stats(np_ctx *ctx, np_arena *a, np_stats *st);
/* The bytes of the arena's allocated blocks, in O(1): its blocks tile it, and every free one is a
 * hole or the top (but while a request is being placed). */
static inline uint64_t np_arena_allocated(const np_arena *a) {
  return a->seg ? a->seg->size - a->holes.bytes - (a->top ? a->top->size : 0) : 0;
}
/* Whether b is one of the arena's blocks. */
static inline bool np_arena_owns(const np_arena *a, const np_block *b) { return a->seg && b->seg == a->seg; }
int np_arena_check(np_ctx *ctx, np_arena *a);

#endif
