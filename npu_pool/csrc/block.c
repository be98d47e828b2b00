/* block.c -- slab allocation of block structs. */
#include <stdlib.h>
#include <string.h>

#include "block.h"

#define NP_SLAB_BLOCKS 1024

static bool grow(np_block_cache *bc) {
  if (bc->n_slabs == bc->cap_slabs) {
    size_t cap = bc->cap_slabs ? bc->cap_slabs * 2 : 16;
    void **s = realloc(bc->slabs, cap * sizeof *s);
    if (!s) return false;
    bc->slabs = s;
    bc->cap_slabs = cap;
  }
  np_block *slab = malloc(NP_SLAB_BLOCKS * sizeof(np_block));
  if (!slab) return false;
  bc->slabs[bc->n_slabs++] = slab;
  for (size_t i = 0; i < NP_SLAB_BLOCKS; i++) {
    slab[i].next = bc->free_list;
    bc->free_list = &slab[i];
  }
  return true;
}

np_block *np_block_new(np_block_cache *bc) {
  if (!bc->free_list && !grow(bc)) return NULL;
  np_block *b = bc->free_list;
  bc->free_list = b->next;
  memset(b, 0, sizeof *b);
  b->site = -1;
  return b;
}

void np_block_delete(np_block_cache *bc, np_block *b) {
  b->next = bc->free_list;
  bc->free_list = b;
}

void np_block_cache_destroy(np_block_cache *bc) {
  for (size_t i = 0; i < bc->n_slabs; i++) free(bc->slabs[i]);
  free(bc->slabs);
  memset(bc, 0, sizeof *bc);
}
