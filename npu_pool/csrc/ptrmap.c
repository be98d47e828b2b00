/* ptrmap.c -- address -> allocated block. */
#include <stdlib.h>

#include "ptrmap.h"

static size_t hash(uintptr_t a, size_t mask) {
  uint64_t x = (uint64_t)a >> 9; /* blocks are 512-byte aligned */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x & mask;
}

bool np_ptrmap_init(np_ptrmap *m) {
  m->mask = 1023;
  m->count = 0;
  m->buckets = calloc(m->mask + 1, sizeof *m->buckets);
  return m->buckets != NULL;
}

void np_ptrmap_destroy(np_ptrmap *m) {
  free(m->buckets);
  m->buckets = NULL;
}

static bool grow(np_ptrmap *m) {
  size_t nmask = m->mask * 2 + 1;
  np_block **nb = calloc(nmask + 1, sizeof *nb);
  if (!nb) return false;
  for (size_t i = 0; i <= m->mask; i++) {
    for (np_block *b = m->buckets[i], *nx; b; b = nx) {
      nx = b->hnext;
      size_t h = hash(b->addr, nmask);
      b->hnext = nb[h];
      nb[h] = b;
    }
  }
  free(m->buckets);
  m->buckets = nb;
  m->mask = nmask;
  return true;
}

bool np_ptrmap_insert(np_ptrmap *m, np_block *b) {
  if (m->count > m->mask && !grow(m)) return false;
  size_t h = hash(b->addr, m->mask);
  b->hnext = m->buckets[h];
  m->buckets[h] = b;
  m->count++;
  return true;
}

np_block *np_ptrmap_find(const np_ptrmap *m, uintptr_t addr) {
  for (np_block *b = m->buckets[hash(addr, m->mask)]; b; b = b->hnext)
    if (b->addr == addr) return b;
  return NULL;
}

np_block *np_ptrmap_remove(np_ptrmap *m, uintptr_t addr) {
  for (np_block **pp = &m->buckets[hash(addr, m->mask)]; *pp; pp = &(*pp)->hnext) {
    np_block *b = *pp;
    if (b->addr == addr) {
      *pp = b->hnext;
      b->hnext = NULL;
      m->count--;
      return b;
    }
  }
  return NULL;
}
