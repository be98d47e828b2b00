/* block.h -- a block is a contiguous byte range inside a segment.
 *
 * Invariants:
 *  - the blocks of a segment tile it exactly, linked by prev/next in address order;
 *  - free neighbours are merged unless their policy keeps them apart: the torch policy
 *    merges always; npu_pool's arena keeps holes of different stream tags apart where
 *    the backend cannot order streams, and far from the cap where it can (arena.c,
 *    merges); expandable keeps mapped and unmapped free neighbours apart;
 *  - a free block is in exactly one free tree (in_tree), an allocated one in the
 *    pointer map; size is a multiple of NP_MIN_BLOCK.
 */
#ifndef NP_BLOCK_H
#define NP_BLOCK_H

#include "common.h"

struct np_segment;

/* Where a block at `at` was placed among its neighbours: just above the allocated block at
 * `anchor` (NP_PLACE_ABOVE, `at` its end; anchor 0: at its segment's start) or just below it
 * (NP_PLACE_BELOW, ending at `anchor`);
 * NP_PLACE_NONE: between free blocks, or by a policy that does not say. The next request of its
 * place key may go back there (arena.c, placed_again). */
enum { NP_PLACE_NONE = 0, NP_PLACE_ABOVE = 1, NP_PLACE_BELOW = 2 };
typedef struct np_place {
  uintptr_t at, anchor;
  uint8_t side;
} np_place;

typedef struct np_block {
  uintptr_t addr;
  uint64_t size;
  uint64_t requested;            /* bytes asked for, when allocated */
  intptr_t stream;               /* owner stream; for free blocks, who may reuse it */
  struct np_block *prev, *next;  /* address-order neighbours in the segment */
  struct np_segment *seg;
  struct np_block *left, *right; /* free tree links */
  uint64_t sub;                  /* in an address-ordered tree: the largest size in its subtree (tree.h) */
  struct np_block *hnext;        /* allocated: pointer-map chain; free: the arena's list of its free
                                  * blocks, while it walks them (arena.c, free_list) */
  uint32_t prio;                 /* treap priority */
  uint32_t phase;                /* phase counter when allocated */
  int32_t site;                  /* allocation site, -1 if unknown */
  uintptr_t anchor;              /* allocated: where the arena placed it (np_place, with side) */
  uint8_t allocated;
  uint8_t pool;                  /* index into the context's pool stats */
  uint8_t in_tree;
  uint8_t mapped;                /* expandable: backed by physical pages */
  uint8_t shared;                /* allocated, and used on another stream too (record_stream) */
  uint8_t life;                  /* allocated: the NP_LIFE_* class it was placed as */
  uint8_t side;                  /* allocated: NP_PLACE_*, with anchor (NONE once freed) */
  uint8_t orphan;                /* allocated, its free refused (the device could not synchronise for another
                                  * stream's use): freed by the next empty_cache whose synchronisation succeeds */
  uint8_t aside;                 /* allocated by the planned policy's fallback as a small request off the plan
                                  * (policy_planned.c, small_to_fallback) */
} np_block;

/* Block structs come from a slab list owned by the context; never from the device. */
typedef struct np_block_cache {
  np_block *free_list;
  void **slabs;
  size_t n_slabs, cap_slabs;
} np_block_cache;

np_block *np_block_new(np_block_cache *bc);
void np_block_delete(np_block_cache *bc, np_block *b);
void np_block_cache_destroy(np_block_cache *bc);

#endif
