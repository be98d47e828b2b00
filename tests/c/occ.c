/* occ.c -- the plan's occupancy index against a scan, frozen and not, under a debug build and the
 * sanitizers (tests/test_c_core.py builds it with small blocks of the frozen lists' max trees, so
 * that short lists take the tree's paths, and with the default).
 *
 * Random rectangles (a span of positions, which may wrap, x an offset interval) go into two
 * indexes, one frozen once built; every query, the lowest offset >= from where `size` bytes are
 * free during a span, must be the same in both and equal to the answer of a walk over all the
 * rectangles (one more added halfway: the add drops the trees, the index is frozen again). Then
 * the cost: on a list of many intervals whose gaps are all too small, the frozen index looks at a
 * few gaps and tree nodes (np_occ_steps), the other at every gap. */
#include <stdio.h>
#include <stdlib.h>
#include "plan.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

#define RECTS 3000
#define POS 200
static np_span spans[RECTS];
static uint64_t offs[RECTS], sizes[RECTS];

static bool pieces_meet(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return a < b && c < d && a < d && c < b; }
static bool spans_meet(const np_span *x, const np_span *y) {
  return pieces_meet(x->lo, x->hi, y->lo, y->hi) || pieces_meet(x->lo, x->hi, y->lo2, y->hi2) ||
         pieces_meet(x->lo2, x->hi2, y->lo, y->hi) || pieces_meet(x->lo2, x->hi2, y->lo2, y->hi2);
}

/* The lowest x >= from where [x, x + size) meets no rectangle live during s: from, or the end of a
 * rectangle, whichever is lowest and free. */
static uint64_t scan(int n, const np_span *s, uint64_t size, uint64_t from) {
  uint64_t best = UINT64_MAX;
  for (int c = -1; c < n; c++) {
    uint64_t x = c < 0 ? from : offs[c] + sizes[c];
    if (x < from || x >= best) continue;
    bool free = true;
    for (int r = 0; r < n && free; r++)
      free = !(spans_meet(&spans[r], s) && offs[r] < x + size && x < offs[r] + sizes[r]);
    if (free) best = x;
  }
  return best;
}

static np_span random_span(void) {
  uint32_t lo = (uint32_t)(next() % POS), len = 1 + (uint32_t)(next() % (next() % 4 ? 8 : POS / 2));
  if (lo + len <= POS) return (np_span){lo, lo + len, 0, 0};
  return (np_span){lo, POS, 0, lo + len - POS}; /* wraps into the next pass */
}

static int check_random(void) {
  long queries = 0;
  for (int round = 0; round < 6; round++) {
    np_occ plain, frozen;
    if (np_occ_init(&plain, POS) != NP_OK || np_occ_init(&frozen, POS) != NP_OK) return 1;
    int n = 100 + (int)(next() % (RECTS - 100));
    for (int r = 0; r < n; r++) {
      spans[r] = random_span();
      sizes[r] = 512 * (1 + next() % (next() % 3 ? 16 : 2048)); /* mostly small gaps between */
      offs[r] = 512 * (next() % (64 * (uint64_t)n));
      if (np_occ_add(&plain, &spans[r], offs[r], sizes[r]) != NP_OK ||
          np_occ_add(&frozen, &spans[r], offs[r], sizes[r]) != NP_OK)
        return 1;
    }
    np_occ_freeze(&frozen);
    for (int q = 0; q < 400; q++, queries++) {
      if (q == 200 && n < RECTS) { /* an add after the freeze: its trees go, the answers stay right */
        spans[n] = random_span(), sizes[n] = 512 * (1 + next() % 64), offs[n] = 512 * (next() % (64 * (uint64_t)n));
        if (np_occ_add(&plain, &spans[n], offs[n], sizes[n]) != NP_OK ||
            np_occ_add(&frozen, &spans[n], offs[n], sizes[n]) != NP_OK || frozen.gfull)
          return 1;
        n++;
        np_occ_freeze(&frozen);
      }
      np_span s = random_span();
      uint64_t size = 512 * (1 + next() % (next() % 2 ? 8 : 4096));
      uint64_t from = next() % 2 ? 0 : 512 * (next() % (64 * (uint64_t)n));
      uint64_t a = np_occ_lowest(&plain, &s, size, from), b = np_occ_lowest(&frozen, &s, size, from);
      uint64_t want = scan(n, &s, size, from);
      if (a != want || b != want) {
        fprintf(stderr, "occ: round %d query %d: %llu (plain), %llu (frozen), the scan %llu\n", round, q,
                (unsigned long long)a, (unsigned long long)b, (unsigned long long)want);
        return 1;
      }
    }
    np_occ_destroy(&plain);
    np_occ_destroy(&frozen);
  }
  printf("occ: ok (%ld queries, frozen and not, against the scan)\n", queries);
  return 0;
}

/* 32,000 rectangles live at every position, 2 MiB each 4 MiB apart: a query of 3 MiB passes every
 * gap to the end. */
static int check_cost(void) {
  enum { N = 32000 };
  const uint64_t MiB = 1 << 20;
  np_occ plain, frozen;
  if (np_occ_init(&plain, 1) != NP_OK || np_occ_init(&frozen, 1) != NP_OK) return 1;
  np_span all = {0, 1, 0, 0};
  for (uint64_t r = 0; r < N; r++)
    if (np_occ_add(&plain, &all, r * 4 * MiB, 2 * MiB) != NP_OK || np_occ_add(&frozen, &all, r * 4 * MiB, 2 * MiB) != NP_OK)
      return 1;
  np_occ_freeze(&frozen);
  uint64_t steps[2], at[2];
  np_occ *both[2] = {&plain, &frozen};
  for (int k = 0; k < 2; k++) {
    np_occ_steps = 0;
    at[k] = np_occ_lowest(both[k], &all, 3 * MiB, 0);
    steps[k] = np_occ_steps;
  }
  np_occ_destroy(&plain);
  np_occ_destroy(&frozen);
  /* plain: every gap after the first interval's (the one the request meets first); frozen: the rest
   * of that block, the tree up and down (about 2 log2 of the blocks), and the last block */
  uint64_t bound = 2 * NP_ULIST_BLOCK + 2 * 32;
  if (at[0] != (N - 1) * 4 * MiB + 2 * MiB || at[1] != at[0] || steps[0] < N - 2 || steps[1] > bound) {
    fprintf(stderr, "occ cost: at %llu and %llu, %llu steps (plain) and %llu (frozen, at most %llu)\n",
            (unsigned long long)at[0], (unsigned long long)at[1], (unsigned long long)steps[0],
            (unsigned long long)steps[1], (unsigned long long)bound);
    return 1;
  }
  printf("occ cost: %llu steps plain, %llu frozen (blocks of %d intervals)\n", (unsigned long long)steps[0],
         (unsigned long long)steps[1], NP_ULIST_BLOCK);
  return 0;
}

int main(void) { return check_random() || check_cost(); }
