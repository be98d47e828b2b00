/* segment.h -- a segment is one range of device memory, tiled by blocks: either one device
 * malloc, or an address reservation whose pages are mapped on demand (vmm.h).
 *
 * Invariants: head is the lowest block; blocks are contiguous from addr to addr + size;
 * every block's seg points back here; a segment is on its context's list from creation
 * until its memory is returned to the device. `mapped` is the segment's bytes backed by
 * physical memory: size for a malloc'ed segment, page x (non-zero pages[]) for a
 * reservation, whose pages[i] is the vendor handle of the chunk mapped over page i
 * (0 = unmapped; vmm.h).
 */
#ifndef NP_SEGMENT_H
#define NP_SEGMENT_H

#include "block.h"

typedef struct np_segment {
  uintptr_t addr;
  uint64_t size;
  intptr_t stream;
  uint8_t pool;             /* pool index, or NP_POOL_SHARED */
  uint8_t reserved_only;    /* address reservation (pages mapped separately) */
  np_block *head;
  struct np_segment *prev, *next;
  uint64_t mapped;          /* bytes backed by physical memory */
  uint64_t *pages;          /* reservations: handle per page of the backend's granularity, 0 = unmapped */
} np_segment;

/* Split b into [b.addr, b.addr+size) and the rest; returns the piece of `size` bytes,
 * taken from the high end when take_high. Both pieces keep b's stream and pool.
 * NULL if the host is out of memory (b is then unchanged). */
np_block *np_block_split(np_block_cache *bc, np_block *b, uint64_t size, bool take_high);
/* Merge next into b (b->next == next, both free); next is deleted. */
void np_block_merge_next(np_block_cache *bc, np_block *b);
/* The same on a block b that stays in address-ordered tree t (it keeps its address; the tree's
 * figures follow): the piece split off is b's high end, the block merged is not in a tree. A
 * block in a size-ordered tree is neither split nor merged (its key would change). */
struct np_tree;
np_block *np_block_split_high_in(np_block_cache *bc, struct np_tree *t, np_block *b, uint64_t size);
void np_block_merge_next_in(np_block_cache *bc, struct np_tree *t, np_block *b);

#endif
