/* simdev.c -- the simulated device's placement (backend_sim.c: a treap of ranges carrying each
 * range's room) against the linear scans it replaced (a sorted array, the code of e6bba47's
 * parent, kept here as the reference), under a debug build and the sanitizers: random mallocs,
 * frees, reservations and releases, hinted addresses (aligned or not, below the bump pointer,
 * near the window's top), sizes from 0 bytes to past the window, on CUDA's rules (top down) and
 * torch_npu's; every address and refusal compared. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

#define SIM_BASE ((uintptr_t)1 << 40)
#define SIM_WINDOW ((uintptr_t)1 << 52)
#define SIM_DEVICES 64
#define SIM_ALIGN (2 * NP_MIB)
#define SIM_GRANULE (32 * NP_MIB)
#define SIM_PAGE ((uint64_t)NP_SIM_PAGE)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

/* ---- the reference: the parent's sorted array and scans --------------------------------- */
typedef struct { uintptr_t addr; uint64_t size; } rr;
typedef struct {
  rr *r;
  size_t n, cap;
  uint64_t used, total;
  uintptr_t low, next, down_top, hint;
  int top_down;
} ref;

static size_t find_pos(const ref *s, uintptr_t addr) {
  size_t lo = 0, hi = s->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (s->r[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
static int overlaps(const ref *s, uintptr_t addr, uint64_t size) {
  size_t i = find_pos(s, addr);
  if (i < s->n && s->r[i].addr < addr + size) return 1;
  if (i > 0 && s->r[i - 1].addr + s->r[i - 1].size > addr) return 1;
  return 0;
}
static void add(ref *s, uintptr_t addr, uint64_t size) {
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 64;
    s->r = realloc(s->r, s->cap * sizeof *s->r);
  }
  size_t i = find_pos(s, addr);
  memmove(&s->r[i + 1], &s->r[i], (s->n - i) * sizeof *s->r);
  s->r[i] = (rr){addr, size};
  s->n++;
}
static int del(ref *s, uintptr_t addr, uint64_t size) {
  size_t i = find_pos(s, addr);
  if (i == s->n || s->r[i].addr != addr || s->r[i].size != size) return NP_ERR_BACKEND;
  memmove(&s->r[i], &s->r[i + 1], (s->n - i - 1) * sizeof *s->r);
  s->n--;
  return NP_OK;
}
static uintptr_t free_from(const ref *s, size_t first, uintptr_t from) {
  const rr *r = first > 0 ? &s->r[first - 1] : NULL;
  return r && r->addr + r->size > from ? np_round_up(r->addr + r->size, SIM_ALIGN) : from;
}
static uintptr_t cuda_addr(const ref *s, uint64_t size) {
  uint64_t need = np_round_up(size, SIM_ALIGN);
  const rr *rs = s->r;
  size_t first = find_pos(s, s->next), end = find_pos(s, s->down_top);
  uintptr_t low = free_from(s, first, s->next);
  if (need < SIM_GRANULE) {
    for (size_t i = first; i < end; i++) {
      uintptr_t g = rs[i].addr & ~(uintptr_t)(SIM_GRANULE - 1);
      uintptr_t lo = i > first ? np_round_up(rs[i - 1].addr + rs[i - 1].size, SIM_ALIGN) : low;
      if (lo < g) lo = g;
      if (rs[i].addr >= lo + need) return lo;
      uintptr_t top = np_round_up(rs[i].addr + rs[i].size, SIM_ALIGN);
      uintptr_t hi = np_round_up(top, SIM_GRANULE);
      if (i + 1 < end && rs[i + 1].addr < hi) hi = rs[i + 1].addr;
      if (hi > s->down_top) hi = s->down_top;
      if (hi >= top + need) return top;
    }
  }
  uint64_t span = np_round_up(need, SIM_GRANULE);
  uintptr_t upper = s->down_top & ~(uintptr_t)(SIM_GRANULE - 1);
  for (size_t i = end; i-- > first;) {
    uintptr_t top = np_round_up(rs[i].addr + rs[i].size, SIM_GRANULE);
    if (top <= upper && upper - top >= span) break;
    uintptr_t g = rs[i].addr & ~(uintptr_t)(SIM_GRANULE - 1);
    if (g < upper) upper = g;
  }
  return upper >= low + span ? upper - span : 0;
}
static uintptr_t lowest_gap(const ref *s, uint64_t size) {
  uint64_t need = np_round_up(size, SIM_ALIGN);
  const rr *rs = s->r;
  size_t i = find_pos(s, s->low), end = find_pos(s, s->down_top);
  uintptr_t lo = free_from(s, i, s->low);
  for (; i < end; i++) {
    if (rs[i].addr >= lo && rs[i].addr - lo >= need) return lo;
    uintptr_t top = np_round_up(rs[i].addr + rs[i].size, SIM_ALIGN);
    if (top > lo) lo = top;
  }
  return lo < s->down_top && s->down_top - lo >= need ? lo : 0;
}
static long n_hint, n_small, n_large, n_bump, n_gap, n_full;
static int take(ref *s, uint64_t size, int is_malloc, uintptr_t *out) {
  if (s->hint && !overlaps(s, s->hint, size)) {
    *out = s->hint;
    n_hint++;
  } else if (s->top_down && is_malloc) {
    *out = cuda_addr(s, size);
    if (!*out) { n_full++; return NP_ERR_OOM; }
    if (np_round_up(size, SIM_ALIGN) < SIM_GRANULE && (*out & (SIM_GRANULE - 1))) n_small++;
    else n_large++;
  } else if (!overlaps(s, s->next, size) && s->next <= s->down_top && s->down_top - s->next >= size) {
    *out = s->next;
    s->next = np_round_up(s->next + size, SIM_ALIGN);
    n_bump++;
  } else {
    *out = lowest_gap(s, size);
    if (!*out) { n_full++; return NP_ERR_OOM; }
    n_gap++;
  }
  s->hint = 0;
  add(s, *out, size);
  return NP_OK;
}
static int ref_malloc(ref *s, uint64_t size, uintptr_t *out) {
  if (size > s->total - s->used) return NP_ERR_OOM;
  s->used += size;
  int rc = take(s, size, 1, out);
  if (rc != NP_OK) s->used -= size;
  return rc;
}
static int ref_reserve(ref *s, uint64_t size, uintptr_t *out) {
  if (size % SIM_PAGE) return NP_ERR_INVALID;
  return take(s, size, 0, out);
}

/* ---- the driver ----------------------------------------------------------------------------- */
typedef struct { uintptr_t addr; uint64_t size; int reserved; } live;

static uint64_t pick_size(uint64_t total) {
  switch (rnd() % 10) {
    case 0: return 0;
    case 1: return 1 + rnd() % (4 * NP_MIB);                             /* under the alignment */
    case 2: return SIM_ALIGN * (1 + rnd() % 16);                          /* under a granule */
    case 3: return SIM_GRANULE - SIM_ALIGN + (rnd() % 3) * SIM_ALIGN - 1 + rnd() % 3; /* around a granule */
    case 4: return SIM_GRANULE * (1 + rnd() % 8) + rnd() % SIM_GRANULE;
    case 5: return total / (1 + rnd() % 8);
    case 6: return total - rnd() % (2 * SIM_GRANULE);
    case 7: return (uint64_t)1 << (20 + rnd() % 32);
    default: return 512 * (1 + rnd() % 100000);
  }
}

static uintptr_t pick_hint(const ref *s, const live *lv, size_t n) {
  switch (rnd() % 6) {
    case 0: return n ? np_round_up(lv[rnd() % n].addr + lv[rnd() % n].size, rnd() % 2 ? SIM_ALIGN : 512) : s->next;
    case 1: return n ? lv[rnd() % n].addr - SIM_ALIGN * (rnd() % 20) - (rnd() % 2 ? 512 * (rnd() % 64) : 0) : s->low;
    case 2: return s->down_top - SIM_GRANULE * (rnd() % 6) - 512 * (rnd() % 3);  /* at the window's top */
    case 3: return s->down_top + SIM_GRANULE * (rnd() % 4);                      /* past it */
    case 4: return s->low + SIM_ALIGN * (rnd() % 1000);                          /* low, below next */
    default: return s->low + (rnd() % (SIM_WINDOW / 2)) / 512 * 512;
  }
}

static int run(int rules, uint64_t total, int steps, int device, long *compared) {
  np_config cfg;
  np_config_init(&cfg);
  cfg.capacity = total;
  cfg.vmm = 1;
  cfg.device_rules = rules;
  cfg.device = device;
  np_backend *be = np_backend_sim_create(&cfg);
  if (!be) { fprintf(stderr, "simdev: create: %s\n", np_last_error()); return 1; }
  ref s = {.total = total, .top_down = rules != NP_DEVICE_NPU};
  s.low = s.next = SIM_BASE + (uintptr_t)((unsigned)device % SIM_DEVICES) * SIM_WINDOW;
  s.down_top = s.next + SIM_WINDOW / 2;
  size_t cap = 4096, n = 0;
  live *lv = malloc(cap * sizeof *lv);
  for (int step = 0; step < steps; step++) {
    unsigned op = rnd() % 16;
    if (n == cap) op = 0;
    if (op < 5 && n) { /* free or release one (any order) */
      size_t i = rnd() % n;
      int rc = lv[i].reserved ? be->release(be, lv[i].addr, lv[i].size) : be->free(be, lv[i].addr, lv[i].size);
      int want = del(&s, lv[i].addr, lv[i].size);
      if (want == NP_OK && !lv[i].reserved) s.used -= lv[i].size;
      if ((rc == NP_OK) != (want == NP_OK)) {
        fprintf(stderr, "simdev: step %d: free of %#lx: %d, the scan's %d\n", step, (unsigned long)lv[i].addr, rc, want);
        return 1;
      }
      lv[i] = lv[--n];
      continue;
    }
    if (op == 5) { /* a hint for the next malloc or reservation */
      uintptr_t h = pick_hint(&s, lv, n);
      be->hint_addr(be, h);
      s.hint = h;
    }
    int reserve = op >= 12;
    uint64_t size = pick_size(total);
    if (reserve) size = np_round_up(size, SIM_PAGE) * (rnd() % 4 ? 1 : 1 + rnd() % 64);
    if (reserve && rnd() % 8 == 0 && s.next < s.down_top) /* most of what is left above the bump pointer */
      size = (s.down_top - s.next) / SIM_PAGE * SIM_PAGE - SIM_GRANULE * (rnd() % 8);
    if (size > ((uint64_t)1 << 56)) size = (uint64_t)1 << 56;
    uintptr_t got = 0, want = 0;
    int rc = reserve ? be->reserve(be, size, &got) : be->malloc(be, size, &got);
    int wrc = reserve ? ref_reserve(&s, size, &want) : ref_malloc(&s, size, &want);
    (*compared)++;
    if (rc != wrc || (rc == NP_OK && got != want)) {
      fprintf(stderr, "simdev: step %d (rules %d, %llu bytes total): %s of %llu bytes: %d at %#lx, the scan's %d at %#lx "
              "(%zu live)\n", step, rules, (unsigned long long)total, reserve ? "reserve" : "malloc", (unsigned long long)size, rc,
              (unsigned long)got, wrc, (unsigned long)want, s.n);
      return 1;
    }
    if (rc == NP_OK) lv[n++] = (live){got, size, reserve};
  }
  while (n) { /* frees in reverse, then destroy with none left, and again with some live */
    n--;
    int rc = lv[n].reserved ? be->release(be, lv[n].addr, lv[n].size) : be->free(be, lv[n].addr, lv[n].size);
    int want = del(&s, lv[n].addr, lv[n].size);
    if (rc != want) {
      fprintf(stderr, "simdev: final free of %#lx (%llu bytes, %s): %d, the scan's %d: %s\n", (unsigned long)lv[n].addr,
              (unsigned long long)lv[n].size, lv[n].reserved ? "reserved" : "allocated", rc, want, np_last_error());
      return 1;
    }
  }
  uintptr_t a;
  be->malloc(be, 3 * NP_MIB, &a); /* destroyed with a range live */
  be->destroy(be);
  free(lv);
  free(s.r);
  return 0;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 6, steps = argc > 2 ? atoi(argv[2]) : 3000;
  if (argc > 3) rng = strtoull(argv[3], NULL, 0);
  static const uint64_t totals[] = {96 * NP_MIB, 1ull << 30, 80ull << 30, 1ull << 40, NP_MAX_REQUEST};
  static const int rules[] = {NP_DEVICE_CUDA, NP_DEVICE_NPU, NP_DEVICE_AUTO};
  long compared = 0;
  int runs = 0;
  for (int round = 0; round < rounds; round++)
    for (size_t t = 0; t < sizeof totals / sizeof *totals; t++)
      for (size_t r = 0; r < 3; r++, runs++)
        if (run(rules[r], totals[t], steps, (int)(rnd() % 70), &compared)) return 1;
  printf("simdev: ok (%d runs, %ld placements compared: %ld hinted, %ld beside a range, %ld whole granules, %ld bumped, "
         "%ld in the lowest gap, %ld refused as the window is full)\n", runs, compared, n_hint, n_small, n_large, n_bump, n_gap, n_full);
  return 0;
}
