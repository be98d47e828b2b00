/* segment.c -- splitting and merging blocks inside a segment. */
#include "segment.h"

np_block *np_block_split(np_block_cache *bc, np_block *b, uint64_t size, bool take_high) {
  /* b may stay in an address-ordered tree when it keeps its address (take_high), its tree told
   * (np_tree_resized); in a size-ordered one its key would change */
  NP_ASSERT(size > 0 && size < b->size && (!b->in_tree || take_high));
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

void np_block_merge_next(np_block_cache *bc, np_block *b) {
  np_block *n = b->next;
  /* b may stay in an address-ordered tree (it keeps its address), its tree told (np_tree_resized) */
  NP_ASSERT(n && !n->allocated && !b->allocated && !n->in_tree);
  NP_ASSERT(b->addr + b->size == n->addr);
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  np_block_delete(bc, n);
}
