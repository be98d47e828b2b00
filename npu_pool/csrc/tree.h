/* tree.h -- ordered set of free blocks keyed by (stream, size, address), or by
 * address alone (by_addr).
 *
 * A treap: expected O(log n) insert, remove and searches. The size order is
 * PyTorch's BlockComparatorSize, so "smallest block of this stream that fits,
 * lowest address first" is one lower_bound; an address-ordered tree answers
 * "the free block at or below this address" and, each node keeping the largest
 * size in its subtree (sub), "the lowest block that fits" instead. Invariants: keys
 * unique (addresses are), BST order on keys, heap order on prio; count = number of
 * nodes; by_addr: sub = max(size, children's sub); a block's key fields do not change
 * while it is in a tree, nor, in an address-ordered tree, its size but through np_tree_resized.
 */
#ifndef NP_TREE_H
#define NP_TREE_H

#include "block.h"

typedef struct np_tree {
  np_block *root;
  size_t count;
  uint64_t bytes;     /* sum of sizes */
  uint64_t rng;       /* priority generator state */
  bool by_addr;       /* keyed by address alone (set before the first insert) */
} np_tree;

void np_tree_insert(np_tree *t, np_block *b);
void np_tree_remove(np_tree *t, np_block *b);
/* Size-ordered trees. Smallest block with key >= (stream, size, 0); NULL if none. May be of another stream. */
np_block *np_tree_lower_bound(const np_tree *t, intptr_t stream, uint64_t size);
/* Smallest-fitting block of exactly this stream, or NULL. */
np_block *np_tree_best_fit(const np_tree *t, intptr_t stream, uint64_t size);
/* Address-ordered trees: the block with the highest address <= addr / the lowest > addr, or NULL. */
np_block *np_tree_floor(const np_tree *t, uintptr_t addr);
np_block *np_tree_after(const np_tree *t, uintptr_t addr);
/* Address-ordered trees: b, in the tree, was resized in place (its address unchanged) from
 * old_size bytes; the tree's figures follow. */
void np_tree_resized(np_tree *t, np_block *b, uint64_t old_size);
/* Address-ordered trees: the lowest-addressed block of at least `size` bytes, or NULL. */
np_block *np_tree_lowest_fit(const np_tree *t, uint64_t size);
/* The block after b in key order, or NULL. */
np_block *np_tree_next(const np_tree *t, const np_block *b);
/* The size of the largest block of any stream, 0 if none. */
uint64_t np_tree_max_size(const np_tree *t);
/* Verify order, heap and count invariants; returns false on violation. */
bool np_tree_check(const np_tree *t);

#endif
