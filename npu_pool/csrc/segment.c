/* segment.c -- splitting and merging blocks inside a segment. */
#include "segment.h"
#include "tree.h"

static np_block *split(np_block_cache *bc, np_block *b, uint64_t size, bool take_high) {
  np_block *n = np_block_new(bc);
  if (!n) return NULL;
  n->seg = b->seg;
  n->stream = b->stream;
  n->pool = b->pool;
  n->mapped = b->mapped;
  /* n goes after b in address order */
  n->prev = b;
  n->next = b->next;
  if (b->next) b->next->prev = n;
  b->next = n;
  uint64_t low = take_high ? b->size - size : size;
  n->addr = b->addr + low;
  n->size = b->size - low;
  b->size = low;
  return take_high ? n : b;
}

static void merge_next(np_block_cache *bc, np_block *b) {
  np_block *n = b->next;
  NP_ASSERT(n && !n->allocated && !b->allocated && !n->in_tree);
  NP_ASSERT(b->addr + b->size == n->addr);
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  np_block_delete(bc, n);
}

np_block *np_block_split(np_block_cache *bc, np_block *b, uint64_t size, bool take_high) {
  NP_ASSERT(size > 0 && size < b->size && !b->in_tree);
  return split(bc, b, size, take_high);
}

void np_block_merge_next(np_block_cache *bc, np_block *b) {
  NP_ASSERT(!b->in_tree);
  merge_next(bc, b);
}

np_block *np_block_split_high_in(np_block_cache *bc, np_tree *t, np_block *b, uint64_t size) {
  NP_ASSERT(t->by_addr && b->in_tree && size > 0 && size < b->size);
  uint64_t was = b->size;
  np_block *piece = split(bc, b, size, true);
  if (piece) np_tree_resized(t, b, was);
  return piece;
}

void np_block_merge_next_in(np_block_cache *bc, np_tree *t, np_block *b) {
  NP_ASSERT(t->by_addr && b->in_tree);
  uint64_t was = b->size;
  merge_next(bc, b);
  np_tree_resized(t, b, was);
}
