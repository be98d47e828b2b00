/* ptrmap.h -- hash map from an allocated block's address to its block.
 *
 * Chained through np_block.hnext; the bucket count is a power of two and grows
 * when the load exceeds 1. Holds exactly the allocated blocks of a context.
 */
#ifndef NP_PTRMAP_H
#define NP_PTRMAP_H

#include "block.h"

typedef struct np_ptrmap {
  np_block **buckets;
  size_t mask;     /* buckets - 1 */
  size_t count;
} np_ptrmap;

bool np_ptrmap_init(np_ptrmap *m);
void np_ptrmap_destroy(np_ptrmap *m);
bool np_ptrmap_insert(np_ptrmap *m, np_block *b);  /* false: host out of memory */
np_block *np_ptrmap_find(const np_ptrmap *m, uintptr_t addr);
np_block *np_ptrmap_remove(np_ptrmap *m, uintptr_t addr);

#endif
