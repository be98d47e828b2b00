/* tree.c -- the address-ordered treap's lowest-fit search against a scan, under a debug build
 * and the sanitizers: random inserts, removes and resizes in place of blocks of random sizes,
 * the tree's invariants (the subtree maxima included) checked after each, and every search
 * compared with the lowest-addressed block of at least that size found by walking all of them;
 * then the largest size, in both kinds of tree (a size-ordered one's blocks of streams from
 * INTPTR_MIN to INTPTR_MAX), against the same walk. */
#include <stdio.h>
#include <string.h>
#include "tree.h"

#define N 2000
static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static np_block blocks[N];

static np_block *scan(uint64_t size) {
  for (int i = 0; i < N; i++) /* addresses rise with i */
    if (blocks[i].in_tree && blocks[i].size >= size) return &blocks[i];
  return NULL;
}

static uint64_t largest_by_walk(void) {
  uint64_t m = 0;
  for (int i = 0; i < N; i++)
    if (blocks[i].in_tree && blocks[i].size > m) m = blocks[i].size;
  return m;
}

static int largest(void) {
  static const intptr_t streams[] = {INTPTR_MIN, INTPTR_MIN + 1, -1, 0, 7, 1 << 20, INTPTR_MAX};
  long checks = 0;
  for (int by_addr = 0; by_addr < 2; by_addr++) {
    np_tree t = {.by_addr = by_addr};
    memset(blocks, 0, sizeof blocks);
    for (int i = 0; i < N; i++) blocks[i].addr = 4096u * (uintptr_t)(i + 1);
    for (int step = 0; step < 20000; step++, checks++) {
      np_block *b = &blocks[next() % N];
      if (b->in_tree) {
        np_tree_remove(&t, b);
      } else {
        b->size = 512 * (1 + next() % (next() % 4 ? 64 : 4096));
        b->stream = streams[next() % (sizeof streams / sizeof *streams)];
        np_tree_insert(&t, b);
      }
      if (np_tree_max_size(&t) != largest_by_walk()) {
        fprintf(stderr, "tree: largest size %llu, the walk's %llu (%s tree, step %d)\n",
                (unsigned long long)np_tree_max_size(&t), (unsigned long long)largest_by_walk(),
                by_addr ? "address-ordered" : "size-ordered", step);
        return 1;
      }
    }
  }
  printf("largest: ok (%ld checks)\n", checks);
  return 0;
}

int main(void) {
  np_tree t = {.by_addr = true};
  memset(blocks, 0, sizeof blocks);
  for (int i = 0; i < N; i++) blocks[i].addr = 4096u * (uintptr_t)(i + 1);
  long searches = 0;
  for (int step = 0; step < 40000; step++) {
    np_block *b = &blocks[next() % N];
    if (b->in_tree && next() % 3 == 0) { /* resized in place: a merge into it, a part of it taken */
      uint64_t was = b->size;
      b->size = 512 * (1 + next() % (next() % 4 ? 64 : 4096));
      np_tree_resized(&t, b, was);
    } else if (b->in_tree) {
      np_tree_remove(&t, b);
    } else {
      b->size = 512 * (1 + next() % (next() % 4 ? 64 : 4096)); /* mostly small, some large */
      np_tree_insert(&t, b);
    }
    if (!np_tree_check(&t)) {
      fprintf(stderr, "tree: invariant broken at step %d\n", step);
      return 1;
    }
    for (int k = 0; k < 3; k++, searches++) {
      uint64_t size = 512 * (1 + next() % 5000);
      if (np_tree_lowest_fit(&t, size) != scan(size)) {
        fprintf(stderr, "tree: lowest fit of %llu bytes differs from the scan at step %d\n", (unsigned long long)size, step);
        return 1;
      }
    }
  }
  printf("lowest fit: ok (%ld searches, %zu blocks in the tree at the end)\n", searches, t.count);
  return largest();
}
