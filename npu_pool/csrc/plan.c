/* plan.c -- the occupancy index, plan validation and lookup, the placement kernel (see plan.h). */
#include <stdlib.h>
#include <string.h>

#include "plan.h"

#define MAX_NODES 256 /* canonical or ancestor nodes of a two-piece span: 2 pieces x 2 x 64 levels */

#ifdef NP_DEBUG
_Thread_local uint64_t np_occ_steps;
#define OCC_STEP() (np_occ_steps++)
#else
#define OCC_STEP() ((void)0)
#endif

/* -- unions of offset intervals ---------------------------------------------------- */

/* First index whose boundary is > x. */
static uint32_t upper_bound(const np_ulist *l, uint64_t x) {
  uint32_t lo = 0, hi = l->n;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (l->v[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static uint32_t lower_bound(const np_ulist *l, uint64_t x) {
  uint32_t lo = 0, hi = l->n;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (l->v[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Add [lo, hi) to the union, merging the intervals it touches. */
static int ulist_add(np_ulist *l, uint64_t lo, uint64_t hi) {
  uint32_t i = lower_bound(l, lo), j = upper_bound(l, hi);
  uint64_t add[2];
  uint32_t k = 0;
  if (!(i & 1)) add[k++] = lo;
  if (!(j & 1)) add[k++] = hi;
  uint32_t n = l->n - (j - i) + k;
  if (n > l->cap) {
    uint32_t cap = l->cap ? l->cap * 2 : 4;
    while (cap < n) cap *= 2;
    uint64_t *v = realloc(l->v, (size_t)cap * sizeof *v);
    if (!v) return np_error(NP_ERR_HOST, "host out of memory in the plan index");
    l->v = v;
    l->cap = cap;
  }
  memmove(l->v + i + k, l->v + j, (size_t)(l->n - j) * sizeof *l->v);
  memcpy(l->v + i, add, k * sizeof *add);
  l->n = n;
  return NP_OK;
}

/* The gap before interval i (i >= 1): from the end of the one before to its start. */
static uint64_t gap_before(const np_ulist *l, uint32_t i) {
  OCC_STEP();
  return l->v[2 * i] - l->v[2 * i - 1];
}

/* The first leaf of a frozen list's max tree: the power of two >= its blocks. */
static uint32_t first_leaf(const np_ulist *l) {
  uint32_t blocks = (l->n / 2 + NP_ULIST_BLOCK - 1) / NP_ULIST_BLOCK, leaf = 1;
  while (leaf < blocks) leaf <<= 1;
  return leaf;
}

/* The max tree of l's gaps (np_occ's gfull / gany); NULL for a short list, or without host memory
 * for it (the list is then walked as before). */
static uint64_t *ulist_freeze(const np_ulist *l) {
  uint32_t m = l->n / 2, leaf = first_leaf(l);
  if (m <= 2 * NP_ULIST_BLOCK) return NULL;
  uint64_t *g = calloc(2 * (size_t)leaf, sizeof *g);
  if (!g) return NULL;
  for (uint32_t i = 1; i < m; i++) g[leaf + i / NP_ULIST_BLOCK] = np_max_u64(g[leaf + i / NP_ULIST_BLOCK], gap_before(l, i));
  for (uint32_t v = leaf - 1; v > 0; v--) g[v] = np_max_u64(g[2 * v], g[2 * v + 1]);
  return g;
}

/* The first block >= b of a frozen list (its tree g, leaves from `leaf`) with a gap of at least
 * `size`; UINT32_MAX if none. Up from b's leaf to the first subtree on its right that has one,
 * then down to its first such leaf. */
static uint32_t first_block(const uint64_t *g, uint32_t leaf, uint32_t b, uint64_t size) {
  uint32_t v = leaf + b;
  while (OCC_STEP(), g[v] < size) {
    while (v & 1) v >>= 1; /* a right child: up */
    if (!v) return UINT32_MAX;
    v++;                    /* the subtree to its right */
  }
  while (v < leaf) v = (OCC_STEP(), g[2 * v] >= size) ? 2 * v : 2 * v + 1;
  return v - leaf;
}

/* The first interval i' >= i whose gap before it is at least `size`; the number of intervals if
 * none. With its tree g, the gaps of i's block, then of the first block whose largest gap fits;
 * without, every gap. */
static uint32_t first_gap(const np_ulist *l, const uint64_t *g, uint32_t i, uint64_t size) {
  uint32_t m = l->n / 2, leaf = g ? first_leaf(l) : 0;
  for (;;) {
    uint32_t stop = g ? (i / NP_ULIST_BLOCK + 1) * NP_ULIST_BLOCK : m;
    for (; i < stop && i < m; i++)
      if (gap_before(l, i) >= size) return i;
    if (i >= m) return m;
    uint32_t b = first_block(g, leaf, i / NP_ULIST_BLOCK, size);
    if (b == UINT32_MAX) return m;
    i = b * NP_ULIST_BLOCK;
  }
}

/* Smallest x >= off such that [x, x + size) misses every interval of l (g: its tree, or NULL):
 * off, or past the interval in the way, the end of the first interval after which the gap fits
 * `size` (the last one's when none does). */
static uint64_t ulist_fit(const np_ulist *l, const uint64_t *g, uint64_t off, uint64_t size) {
  uint32_t j = upper_bound(l, off);
  if (j & 1) off = l->v[j++]; /* inside an interval: start at its end */
  if (j < l->n && l->v[j] < off + size) off = l->v[2 * first_gap(l, g, j / 2 + 1, size) - 1];
  return off;
}

/* -- the segment tree over positions ---------------------------------------------- */

int np_occ_init(np_occ *o, uint32_t n_pos) {
  memset(o, 0, sizeof *o);
  if (n_pos > NP_OCC_MAX_POS) /* the leaves are a power of two in 32 bits */
    return np_error(NP_ERR_INVALID, "a plan index of %u positions: at most %u", n_pos, NP_OCC_MAX_POS);
  o->base = 1;
  while (o->base < n_pos) o->base <<= 1;
  o->full = calloc(2 * (size_t)o->base, sizeof *o->full);
  o->any = calloc(2 * (size_t)o->base, sizeof *o->any);
  if (!o->full || !o->any) {
    np_occ_destroy(o);
    return np_error(NP_ERR_HOST, "host out of memory for a plan index of %u positions", n_pos);
  }
  return NP_OK;
}

/* An add changes the lists: their trees go. */
static void unfreeze(np_occ *o) {
  if (!o->gfull && !o->gany) return; /* (the planner's placement kernel adds to an index never frozen) */
  for (size_t i = 0; o->gfull && o->gany && i < 2 * (size_t)o->base; i++) free(o->gfull[i]), free(o->gany[i]);
  free(o->gfull);
  free(o->gany);
  o->gfull = o->gany = NULL;
}

void np_occ_destroy(np_occ *o) {
  unfreeze(o);
  for (size_t i = 0; o->full && i < 2 * (size_t)o->base; i++) free(o->full[i].v);
  for (size_t i = 0; o->any && i < 2 * (size_t)o->base; i++) free(o->any[i].v);
  free(o->full);
  free(o->any);
  memset(o, 0, sizeof *o);
}

/* Canonical nodes of [lo, hi) into canon, and their strict ancestors into path: the nodes
 * above the range's two end leaves that the range does not cover whole. */
static void nodes_of(const np_occ *o, uint32_t lo, uint32_t hi, uint32_t *canon, int *nc, uint32_t *path, int *np) {
  if (lo >= hi) return;
  uint32_t a = lo + o->base, b = hi + o->base;
  while (a < b) {
    if (a & 1) canon[(*nc)++] = a++;
    if (b & 1) canon[(*nc)++] = --b;
    a >>= 1;
    b >>= 1;
  }
  uint32_t ends[2] = {lo + o->base, hi - 1 + o->base};
  for (int e = 0; e < 2; e++) {
    for (int k = 1; (ends[e] >> k) != 0; k++) {
      uint32_t v = ends[e] >> k;
      uint64_t first = ((uint64_t)v << k) - o->base, last = ((uint64_t)(v + 1) << k) - o->base;
      if (first >= lo && last <= hi) continue; /* covered whole: canonical or below one */
      if (e == 1 && *np > 0) { /* the two ends share their upper ancestors */
        bool dup = false;
        for (int i = 0; i < *np && !dup; i++) dup = path[i] == v;
        if (dup) continue;
      }
      path[(*np)++] = v;
    }
  }
}

static void span_nodes(const np_occ *o, const np_span *s, uint32_t *canon, int *nc, uint32_t *path, int *np) {
  *nc = *np = 0;
  nodes_of(o, s->lo, s->hi, canon, nc, path, np);
  nodes_of(o, s->lo2, s->hi2, canon, nc, path, np);
}

int np_occ_add(np_occ *o, const np_span *s, uint64_t off, uint64_t size) {
  uint32_t canon[MAX_NODES], path[MAX_NODES];
  int nc, np;
  unfreeze(o);
  span_nodes(o, s, canon, &nc, path, &np);
  for (int i = 0; i < nc; i++) {
    int rc = ulist_add(&o->full[canon[i]], off, off + size);
    if (rc == NP_OK) rc = ulist_add(&o->any[canon[i]], off, off + size);
    if (rc != NP_OK) return rc;
  }
  for (int i = 0; i < np; i++) {
    int rc = ulist_add(&o->any[path[i]], off, off + size);
    if (rc != NP_OK) return rc;
  }
  return NP_OK;
}

void np_occ_freeze(np_occ *o) {
  if (o->gfull) return;
  o->gfull = calloc(2 * (size_t)o->base, sizeof *o->gfull);
  o->gany = calloc(2 * (size_t)o->base, sizeof *o->gany);
  if (!o->gfull || !o->gany) { /* without host memory for them, the lists are walked as before */
    unfreeze(o);
    return;
  }
  for (size_t i = 0; i < 2 * (size_t)o->base; i++) {
    o->gfull[i] = ulist_freeze(&o->full[i]);
    o->gany[i] = ulist_freeze(&o->any[i]);
  }
}

uint64_t np_occ_lowest(const np_occ *o, const np_span *s, uint64_t size, uint64_t from) {
  uint32_t canon[MAX_NODES], path[MAX_NODES];
  const np_ulist *lists[2 * MAX_NODES];
  const uint64_t *trees[2 * MAX_NODES];
  int nc, np, k = 0;
  span_nodes(o, s, canon, &nc, path, &np);
  for (int i = 0; i < nc; i++)
    if (o->any[canon[i]].n) trees[k] = o->gany ? o->gany[canon[i]] : NULL, lists[k++] = &o->any[canon[i]];
  for (int i = 0; i < np; i++)
    if (o->full[path[i]].n) trees[k] = o->gfull ? o->gfull[path[i]] : NULL, lists[k++] = &o->full[path[i]];
  /* Cycle through the lists until all of them accept the same offset. */
  uint64_t off = from;
  for (int i = 0, ok = 0; ok < k; i = i + 1 < k ? i + 1 : 0) {
    uint64_t next = ulist_fit(lists[i], trees[i], off, size);
    ok = next == off ? ok + 1 : 1;
    off = next;
  }
  return off;
}

/* -- plans --------------------------------------------------------------------------- */

np_span np_plan_span(uint64_t n, uint64_t loop, uint64_t pos, uint64_t end) {
  np_span s = {(uint32_t)pos, (uint32_t)(end == NP_PLAN_NONE || end > n ? n : end), 0, 0};
  if (end != NP_PLAN_NONE && end > n) s.lo2 = (uint32_t)loop, s.hi2 = (uint32_t)(loop + end - n);
  return s;
}

uint64_t np_plan_gram(const uint64_t *sizes, int k) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < k; i++) h = (h ^ sizes[i]) * 0x100000001b3ull;
  return h ^ (h >> 29);
}

typedef struct gram {
  uint64_t key;
  uint32_t pos;
} gram;

static int gram_cmp(const void *a, const void *b) {
  const gram *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->pos < y->pos ? -1 : x->pos > y->pos;
}

static int build_grams(np_plan *p) {
  gram *g = malloc(p->n * sizeof *g);
  p->gram_key = malloc(p->n * sizeof *p->gram_key);
  p->gram_pos = malloc(p->n * sizeof *p->gram_pos);
  if (!g || !p->gram_key || !p->gram_pos) {
    free(g);
    return np_error(NP_ERR_HOST, "host out of memory for the plan's position index");
  }
  uint64_t window[NP_PLAN_GRAM], body = p->n - p->loop;
  for (uint64_t q = 0; q < p->n; q++) {
    for (int i = 0; i < NP_PLAN_GRAM; i++) { /* the sizes ending at q: in the body, the previous pass's before it */
      uint64_t back = (uint64_t)(NP_PLAN_GRAM - 1 - i);
      if (q >= p->loop) window[i] = p->size[p->loop + (q - p->loop + body * NP_PLAN_GRAM - back) % body];
      else window[i] = q >= back ? p->size[q - back] : 0;
    }
    g[q] = (gram){np_plan_gram(window, NP_PLAN_GRAM), (uint32_t)q};
  }
  qsort(g, p->n, sizeof *g, gram_cmp);
  for (uint64_t i = 0; i < p->n; i++) {
    p->gram_key[i] = g[i].key;
    p->gram_pos[i] = g[i].pos;
  }
  free(g);
  return NP_OK;
}

/* The first index in [lo, hi) whose (key, position) is not below (key, pos), in the grams' order. */
static uint64_t gram_lower(const np_plan *p, uint64_t lo, uint64_t hi, uint64_t key, uint64_t pos) {
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (p->gram_key[mid] < key || (p->gram_key[mid] == key && p->gram_pos[mid] < pos)) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Three binary searches: the positions of a key (sorted) and, among them, the first at or after
 * `from`. A scan of them all cost a lost planned pool 163 us a request when 32,000 positions
 * shared the key (a plan repeating one size), each request of the resynchronisation. */
uint64_t np_plan_find(const np_plan *p, uint64_t key, uint64_t from, uint64_t *count, uint64_t *behind) {
  uint64_t lo = gram_lower(p, 0, p->n, key, 0), hi = gram_lower(p, lo, p->n, key, UINT64_MAX);
  uint64_t f = p->n ? from % p->n : 0, at = gram_lower(p, lo, hi, key, f);
  *count = hi - lo;
  *behind = NP_PLAN_NONE;
  if (lo == hi) return NP_PLAN_NONE;
  if (at > lo) *behind = p->gram_pos[at - 1];                          /* the nearest before `from` */
  else if (p->gram_pos[hi - 1] != f) *behind = p->gram_pos[hi - 1];   /* none before it: around the end */
  return p->gram_pos[at < hi ? at : lo];                               /* the nearest at or after it, around */
}

void np_plan_free(np_plan *p) {
  free(p->size);
  free(p->offset);
  free(p->end);
  free(p->span);
  free(p->gram_key);
  free(p->gram_pos);
  free(p->past_held);
  np_occ_destroy(&p->occ);
  memset(p, 0, sizeof *p);
}

/* past_held, in one backward walk around the body from a position not held for good. */
static int build_past_held(np_plan *p) {
  p->past_held = malloc(p->n * sizeof *p->past_held);
  if (!p->past_held) return np_error(NP_ERR_HOST, "host out of memory for a plan");
  uint64_t body = p->n - p->loop, free_at = p->n;
  for (uint64_t q = 0; q < p->n; q++) {
    p->past_held[q] = (uint32_t)q;
    if (free_at == p->n && q >= p->loop && !np_plan_held(p, q)) free_at = q;
  }
  if (free_at == p->n) return NP_OK; /* every body position held (or none in the body): nothing to skip to */
  uint64_t cur = free_at;
  for (uint64_t k = 0; k < body; k++) {
    uint64_t q = p->loop + (free_at - p->loop + body - k) % body; /* free_at, then backwards around the body */
    if (!np_plan_held(p, q)) cur = q;
    p->past_held[q] = (uint32_t)cur;
  }
  return NP_OK;
}

int np_plan_build(np_plan *p, uint64_t n, uint64_t loop, const uint64_t *size, const uint64_t *offset,
                  const uint64_t *end, uint64_t region) {
  memset(p, 0, sizeof *p);
  if (n == 0 || n >= UINT32_MAX / 2) return np_error(NP_ERR_INVALID, "plan: %llu positions", (unsigned long long)n);
  if (loop >= n) return np_error(NP_ERR_INVALID, "plan: the loop body starts at %llu of %llu positions",
                                 (unsigned long long)loop, (unsigned long long)n);
  if (region % NP_MIN_BLOCK) return np_error(NP_ERR_INVALID, "plan: region of %llu bytes is not a multiple of %d",
                                             (unsigned long long)region, NP_ROUND);
  for (uint64_t q = 0; q < n; q++) {
    if (size[q] == 0 || size[q] > NP_MAX_REQUEST)
      return np_error(NP_ERR_INVALID, "plan position %llu: bad size %llu", (unsigned long long)q, (unsigned long long)size[q]);
    uint64_t limit = q < loop ? n : q + n - loop; /* a body request lives at most one pass */
    if (end[q] != NP_PLAN_NONE && (end[q] <= q || end[q] > limit))
      return np_error(NP_ERR_INVALID, "plan position %llu: end %llu is not in (%llu, %llu]", (unsigned long long)q,
                      (unsigned long long)end[q], (unsigned long long)q, (unsigned long long)limit);
    if (offset[q] != NP_PLAN_NONE &&
        (offset[q] % NP_MIN_BLOCK || offset[q] > region || region - offset[q] < np_round_up(size[q], NP_MIN_BLOCK)))
      return np_error(NP_ERR_INVALID, "plan position %llu: offset %llu (+%llu bytes) is unaligned or outside the "
                      "region of %llu bytes", (unsigned long long)q, (unsigned long long)offset[q],
                      (unsigned long long)size[q], (unsigned long long)region);
  }
  p->n = n;
  p->loop = loop;
  p->region = region;
  p->size = malloc(n * sizeof *p->size);
  p->offset = malloc(n * sizeof *p->offset);
  p->end = malloc(n * sizeof *p->end);
  p->span = malloc(n * sizeof *p->span);
  int rc = p->size && p->offset && p->end && p->span ? NP_OK : np_error(NP_ERR_HOST, "host out of memory for a plan");
  if (rc == NP_OK) rc = np_occ_init(&p->occ, (uint32_t)n);
  if (rc != NP_OK) goto fail;
  memcpy(p->size, size, n * sizeof *size);
  memcpy(p->offset, offset, n * sizeof *offset);
  memcpy(p->end, end, n * sizeof *end);
  for (uint64_t q = 0; q < n; q++) {
    p->span[q] = np_plan_span(n, loop, q, end[q]);
    if (offset[q] != NP_PLAN_NONE) {
      rc = np_occ_add(&p->occ, &p->span[q], offset[q], np_round_up(size[q], NP_MIN_BLOCK));
      if (rc != NP_OK) goto fail;
    }
  }
  np_occ_freeze(&p->occ);
  rc = build_grams(p);
  if (rc == NP_OK) rc = build_past_held(p);
  if (rc == NP_OK) return NP_OK;
fail:
  np_plan_free(p);
  return rc;
}

/* -- the planner's placement kernel ------------------------------------------------ */

int np_plan_place(uint32_t n_pos, uint64_t n, const uint64_t *size, const uint32_t *span, const uint32_t *order,
                  uint64_t *offset, uint64_t *peak) {
  np_occ o;
  *peak = 0;
  for (uint64_t i = 0; i < n; i++) {
    const uint32_t *s = span + 4 * i;
    if (order[i] >= n || s[0] > s[1] || s[1] > n_pos || s[2] > s[3] || s[3] > n_pos)
      return np_error(NP_ERR_INVALID, "np_plan_place: rectangle %llu is malformed", (unsigned long long)i);
    if (size[i] > NP_MAX_REQUEST) /* (an offset past 2^64 is refused below) */
      return np_error(NP_ERR_INVALID, "np_plan_place: rectangle %llu is %llu bytes, more than any device", (unsigned long long)i,
                      (unsigned long long)size[i]);
  }
  int rc = np_occ_init(&o, n_pos);
  for (uint64_t i = 0; i < n && rc == NP_OK; i++) {
    uint32_t r = order[i];
    const uint32_t *s4 = span + 4 * (uint64_t)r;
    np_span s = {s4[0], s4[1], s4[2], s4[3]};
    uint64_t off = np_occ_lowest(&o, &s, size[r], 0);
    if (off > UINT64_MAX - size[r]) {
      rc = np_error(NP_ERR_INVALID, "np_plan_place: rectangle %u would end past 2^64 bytes", r);
      break;
    }
    offset[r] = off;
    if (off + size[r] > *peak) *peak = off + size[r];
    rc = np_occ_add(&o, &s, off, size[r]);
  }
  np_occ_destroy(&o);
  return rc;
}
