/* plan.h -- an allocation plan in memory, and the occupancy index behind it.
 *
 * A plan serves the allocations of a training loop: positions [0, loop) are a
 * prologue run once (the first step), [loop, n) the loop body, one steady iteration,
 * run again and again. Request p (its position among the allocations) asks for
 * size[p] bytes and is given offset[p] inside a region of `region` bytes; it is live
 * for positions [p, end[p]); a body request with end[p] > n wraps into the next pass,
 * to loop + end[p] - n. Unplanned positions (lifetime longer than an iteration,
 * unknown) have offset NP_PLAN_NONE.
 *
 * np_occ indexes rectangles (position ranges x offset intervals) so that "the lowest
 * offset >= from where `size` bytes are free during these positions" takes a few
 * binary searches: a segment tree over positions whose nodes keep unions of offset
 * intervals -- `full`: rectangles covering the node's whole span (stored at their
 * canonical nodes), `any`: rectangles touching the span, covering it or not (stored
 * at the canonical nodes and their ancestors). A rectangle touching a query range is
 * then in `any` of one of the range's canonical nodes, or in `full` of an ancestor.
 * The planner places rectangles with it (np_plan_place); the planned policy asks the
 * plan's index for idle ranges. Invariant of every list: sorted boundaries
 * [lo0, hi0, lo1, hi1, ...] of disjoint, non-touching intervals (hi_i < lo_i+1).
 */
#ifndef NP_PLAN_H
#define NP_PLAN_H

#include "common.h"

#define NP_PLAN_NONE UINT64_MAX /* offset of an unplanned position, end of an unknown lifetime */
#define NP_PLAN_GRAM 8          /* sizes hashed to recognise a position (resynchronisation) */

/* Live positions of a rectangle: [lo, hi) and [lo2, hi2) (empty unless it wraps). */
typedef struct np_span {
  uint32_t lo, hi, lo2, hi2;
} np_span;

typedef struct np_ulist {
  uint64_t *v;
  uint32_t n, cap;
} np_ulist;

#ifndef NP_ULIST_BLOCK /* (tests/c/occ.c builds with small blocks, so that short lists take the tree's paths) */
#define NP_ULIST_BLOCK 64 /* intervals per leaf of a frozen list's max tree */
#endif

typedef struct np_occ {
  uint32_t base;   /* leaves: a power of two >= positions */
  np_ulist *full;  /* 2 * base nodes, 1 = root */
  np_ulist *any;
  /* Frozen (np_occ_freeze; NULL otherwise, and again after an add): per node, a max tree over the
   * gaps of its list in full / any, or NULL for a short list. Leaves from the power of two >= the
   * list's blocks of NP_ULIST_BLOCK intervals; leaf b is the largest gap before one of intervals
   * [b, b + 1) * NP_ULIST_BLOCK (v[2i] - v[2i-1], i >= 1); node v the larger of 2v and 2v + 1.
   * Apart from the lists, so that an index never frozen (the planner's) keeps 16 bytes a list. */
  uint64_t **gfull;
  uint64_t **gany;
} np_occ;

#define NP_OCC_MAX_POS (1u << 31) /* positions an index takes */
int np_occ_init(np_occ *o, uint32_t n_pos);
void np_occ_destroy(np_occ *o);
/* Mark [off, off + size) used during span s. */
int np_occ_add(np_occ *o, const np_span *s, uint64_t off, uint64_t size);
/* Lowest offset >= from where [offset, offset + size) is unused during span s. */
uint64_t np_occ_lowest(const np_occ *o, const np_span *s, uint64_t size, uint64_t from);
/* No more adds: index the gaps of long lists, so that a query passes the intervals whose gaps are
 * too small in O(log) instead of one by one (a plan's index, asked at every request of a dynamic
 * size, is frozen once built). Without host memory for it, a list is left as it was. */
void np_occ_freeze(np_occ *o);
#ifdef NP_DEBUG
extern _Thread_local uint64_t np_occ_steps; /* gaps and tree nodes np_occ_lowest looked at, this thread */
#endif

/* A plan installed on a context (see np_set_plan). gram_key/gram_pos: every position
 * keyed by the hash of the NP_PLAN_GRAM sizes ending there, sorted by key. */
typedef struct np_plan {
  uint64_t n;
  uint64_t loop;     /* first position of the loop body */
  uint64_t region;
  uint64_t *size, *offset, *end;
  np_span *span;
  uint64_t *gram_key;
  uint32_t *gram_pos;
  uint32_t *past_held; /* per position: the first at or after it (in the loop) not held for good, itself if
                        * none is (held for good: a body position whose end is p + body, its range its own
                        * throughout the body) */
  np_occ occ;        /* planned rectangles */
} np_plan;

/* Whether body position `pos` is held for good (end = pos + body). */
static inline bool np_plan_held(const np_plan *p, uint64_t pos) {
  return pos >= p->loop && p->end[pos] != NP_PLAN_NONE && p->end[pos] == pos + (p->n - p->loop);
}

/* Validate and copy a plan; NP_ERR_INVALID naming the first bad position. */
int np_plan_build(np_plan *p, uint64_t n, uint64_t loop, const uint64_t *size, const uint64_t *offset,
                  const uint64_t *end, uint64_t region);
void np_plan_free(np_plan *p);
/* Hash of sizes (oldest first), as gram_key holds them. */
uint64_t np_plan_gram(const uint64_t *sizes, int k);
/* The position with this gram key nearest at or after `from` (circularly), NP_PLAN_NONE if none;
 * *count receives how many positions have the key, *behind the nearest one before `from`. */
uint64_t np_plan_find(const np_plan *p, uint64_t key, uint64_t from, uint64_t *count, uint64_t *behind);
/* Span of position `pos`: [pos, end) folded onto the loop. */
np_span np_plan_span(uint64_t n, uint64_t loop, uint64_t pos, uint64_t end);
/* The position after `pos`: the body repeats. */
static inline uint64_t np_plan_next(const np_plan *p, uint64_t pos) { return pos + 1 < p->n ? pos + 1 : p->loop; }

/* np_plan_place (npu_pool.h) is the planner's placement kernel over this index. */

#endif
