/* common.h -- constants, rounding, counters, debug checks and error reporting shared by the core. */
#ifndef NP_COMMON_H
#define NP_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "npu_pool.h"

#define NP_KIB ((uint64_t)1 << 10)
#define NP_MIB ((uint64_t)1 << 20)
#define NP_GIB ((uint64_t)1 << 30)

#define NP_MIN_BLOCK ((uint64_t)NP_ROUND)  /* every block size is a multiple of this */
#define NP_STREAM_ANY INTPTR_MIN          /* tag of free memory usable by every stream */
#define NP_POOL_SHARED NP_POOLS           /* pool index of memory both pools use (arena pages) */

static inline uint64_t np_round_up(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }
static inline uint64_t np_round_down(uint64_t x, uint64_t to) { return x / to * to; }
static inline uint64_t np_min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static inline uint64_t np_max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* A treap priority from the generator state *rng (0: not yet seeded): xorshift64*, cheap and
 * deterministic per tree (tree.c's, the simulated device's range table). */
static inline uint32_t np_next_prio(uint64_t *rng) {
  uint64_t x = *rng ? *rng : 0x9E3779B97F4A7C15ull;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *rng = x;
  return (uint32_t)((x * 0x2545F4914F6CDD1Dull) >> 32);
}

/* Statistics counter: current value, high-water mark, and the sums of its changes. */
static inline void np_counter_add(np_counter *c, uint64_t v) {
  c->current += v;
  c->allocated += v;
  if (c->current > c->peak) c->peak = c->current;
}
static inline void np_counter_sub(np_counter *c, uint64_t v) {
  c->current -= v;
  c->freed += v;
}

/* Set the calling thread's error message; returns code so callers can `return np_error(...)`. */
int np_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The code of the calling thread's latest np_error(). */
int np_last_code(void);
/* Format a byte count as "1.50 GiB" into buf (at least 32 bytes); returns buf. */
const char *np_fmt_bytes(uint64_t bytes, char *buf);
/* Format x with the fewest significant digits (6 to 17) that read back as x, into buf (at least
 * 32 bytes); returns buf. */
const char *np_fmt_double(double x, char *buf);
/* NP_OK for a memory fraction in (0, 1], else an NP_ERR_INVALID saying so (api.c). */
int np_check_fraction(double f);

/* The longest error message kept (a path of PATH_MAX bytes fits, with the loader's own message on it);
 * one cut there ends in "...". */
#define NP_ERR_TEXT 8192
/* Copy text into dst (len bytes); one cut there ends in "...", as np_error's messages do. */
void np_copy_text(char *dst, size_t len, const char *text);
/* snprintf into dst (len bytes), a cut ending in "..." as np_copy_text's. */
void np_format_text(char *dst, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Keep the current error message across calls that may overwrite it (a rollback's own failures). */
typedef struct np_saved_error { int code; char text[NP_ERR_TEXT]; } np_saved_error;
void np_save_error(np_saved_error *s, int code);
int np_restore_error(const np_saved_error *s);

#ifdef NP_DEBUG
#include <stdio.h>
#include <stdlib.h>
#define NP_ASSERT(c)                                                               \
  do {                                                                             \
    if (!(c)) {                                                                    \
      fprintf(stderr, "npu_pool: invariant failed: %s (%s:%d)\n", #c, __FILE__, __LINE__); \
      abort();                                                                     \
    }                                                                              \
  } while (0)
#else
#define NP_ASSERT(c) ((void)0)
#endif

#endif
