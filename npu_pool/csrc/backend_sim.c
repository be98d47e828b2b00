/* backend_sim.c -- a simulated device on the CPU.
 *
 * The device has a capacity; allocations and mapped pages count against it.
 * By default addresses come from a virtual range with nothing behind them
 * (so replays of 80 GiB traces cost no memory); with host_backed, every
 * allocation or mapping is real host memory, so tests can write patterns.
 *
 * It refuses what the vendors refuse: a chunk is unmapped whole (an unmap must name the start
 * and size of a mapping, as cuMemUnmap does; aclrtUnmapMem takes the start only), a mapping may
 * not overlap another, a handle is released once. It counts the calls the ACL backend would
 * make for the same requests (np_stats.calls): the device looked up (aclrtGetDevice) before
 * each malloc, free, synchronisation, reservation and release, and once per thread for the
 * chunk calls; free synchronises the device first.
 *
 * Invariant: `alloc` holds every live allocation and reservation, `maps` every mapping, each
 * sorted by address and pairwise disjoint; used = allocated bytes + the bytes of live handles
 * (handle_size[h] != 0).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend.h"

#define SIM_BASE ((uintptr_t)1 << 40)  /* virtual addresses start at 1 TiB */
/* Each simulated device (modulo SIM_DEVICES) has its own 4 PiB window above SIM_BASE, so a
 * pointer of one device's pool is foreign to another's (refused as unknown, never freed). */
#define SIM_WINDOW ((uintptr_t)1 << 52)
#define SIM_DEVICES 64
#define SIM_ALIGN (2 * NP_MIB)
#define SIM_GRANULE (32 * NP_MIB) /* cudaMalloc's unit of address space (cuda_addr) */
#define SIM_PAGE ((uint64_t)NP_SIM_PAGE)

/* A live range: in its table's list (address order) and treap (the same order). The rooms are
 * cuda_addr's two scans' tests for this range as numbers (room(): bytes plus one, 0 for none), so
 * that a search can skip whole subtrees where no range passes: room_small, for a request under a
 * granule, the larger of the gap below the range inside its first granule (from the end of the
 * range before it) and the gap above it inside its last granule (up to the next range and the
 * window's top); room_large, the whole granules free between the range's last granule and the
 * next range's first one (or the window's top). They read the range's neighbours only. */
typedef struct sim_range {
  uintptr_t addr;
  uint64_t size;
  struct sim_range *prev, *next;   /* address-order neighbours */
  struct sim_range *left, *right;  /* treap children */
  uint64_t seq;                    /* insertion number: orders ranges of one address (see sim_table) */
  uint64_t room_small, room_large;
  uint64_t max_small, max_large;   /* the largest rooms in the subtree */
  uint32_t prio;                   /* treap priority */
} sim_range;

/* Ranges ordered by address, then newest first: an insert goes before every range at or above its
 * address (only empty ranges, mallocs of 0 bytes, share one; a free or a lookup meets the newest).
 * Invariants: prev/next link the ranges in that order and the treap's in-order walk is the same;
 * heap order on prio; every range's rooms are those of its current neighbours and `top`, and
 * every max_* the largest room_* in its subtree. An insert or removal changes the neighbours of
 * two ranges only, the ones just before and after it: both lie on the path the split walks (or,
 * for a removal's successor, on the left spine drop_first pulls), so every subtree maximum that
 * could change is recomputed. Expected O(log n) per operation. */
typedef struct sim_table {
  sim_range *root;
  uint64_t seq, rng;
  uintptr_t top;       /* the rooms are measured below it: the backend's down_top */
} sim_table;

typedef struct sim_backend {
  np_backend base;
  uint64_t used;
  bool host;
  int device;
  uintptr_t low;       /* the device's window begins here */
  uintptr_t next;      /* bump pointer for virtual addresses (reservations; mallocs unless top_down); past
                        * the window's middle, the lowest gap left between live ranges instead */
  bool queued;         /* torch_npu's rules: inside torch_npu work may wait on its task queue, which no
                        * stream query or event made straight through ACL sees; the ACL backend
                        * synchronises and hands over through torch_npu instead (backend_acl.c,
                        * framework_sync, framework_wait), and so is counted here */
  bool top_down;       /* mallocs as cudaMalloc places them (cuda_addr: granules taken top down,
                        * below `down_top`; CUDA's rules and the simulator's own; measured on an
                        * H100, docs/gpu.md; not host-backed pools, whose ranges come from mmap) */
  uintptr_t down_top;  /* ... the top of that region: the window's middle. Invariant: every range of
                        * `alloc` is disjoint from every other (a malloc never goes below `next`, a
                        * reservation never reaches a malloc: either refuses instead) */
  uintptr_t hint;      /* one-shot address for the next malloc, 0 if none */
  sim_table alloc;     /* allocations and reservations */
  sim_table maps;      /* mappings of physical chunks */
  uint64_t *handle_size; /* bytes of each live handle (index: handle), 0 once released */
  uint64_t n_handles, cap_handles;
  bool event;          /* stream_wait's event is made (the ACL backend keeps one, re-recorded) */
} sim_backend;

/* Count what the ACL backend's device guard calls before a call: a lookup always (`check`),
 * or only while the thread's cached device (the simulator's model of the vendors' cache,
 * np_sim_device_cache_get: forgotten where theirs is) is not ours; none for a framework's own
 * allocator (no_lookups), which keeps the device itself. */
static void sim_enter(sim_backend *s, bool check) {
  if (s->base.no_lookups || (!check && np_sim_device_cache_get() == s->device)) return;
  s->base.calls[NP_CALL_GET_DEVICE]++;
  np_sim_device_cache_set(s->device); /* the caller made it current (torch_npu does) */
}

/* The first range at or above addr; *before (if asked) gets the last one below it. */
static sim_range *seek(const sim_table *t, uintptr_t addr, sim_range **before) {
  sim_range *at = NULL, *below = NULL;
  for (sim_range *n = t->root; n;) {
    if (n->addr < addr) {
      below = n;
      n = n->right;
    } else {
      at = n;
      n = n->left;
    }
  }
  if (before) *before = below;
  return at;
}

static bool overlaps(const sim_table *s, uintptr_t addr, uint64_t size) {
  sim_range *below, *at = seek(s, addr, &below);
  if (at && at->addr < addr + size) return true;
  if (below && below->addr + below->size > addr) return true;
  return false;
}

/* The bytes of [from, to) plus one; 0 when to < from (cuda_addr's `to >= from + need` is
 * room(from, to) > need, with no sum to overflow). */
static uint64_t room(uintptr_t from, uintptr_t to) { return to >= from ? to - from + 1 : 0; }

static uintptr_t granule_of(uintptr_t a) { return a & ~(uintptr_t)(SIM_GRANULE - 1); }

/* Where a request under a granule may start below r (its first granule, from lo up), and where the
 * room above r ends (the end of its last granule, the next range, the window's top). */
static uintptr_t below_from(const sim_range *r, uintptr_t lo) { return lo < granule_of(r->addr) ? granule_of(r->addr) : lo; }
static uintptr_t above_from(const sim_range *r) { return np_round_up(r->addr + r->size, SIM_ALIGN); }
static uintptr_t above_to(const sim_range *r, uintptr_t down_top) {
  uintptr_t hi = np_round_up(above_from(r), SIM_GRANULE);
  if (r->next && r->next->addr < hi) hi = r->next->addr;
  return hi > down_top ? down_top : hi;
}

/* The top of the whole granules free above r: the next range's first granule, or the window's top
 * (a next range at or past it starts no lower). */
static uintptr_t large_upper(const sim_range *r, uintptr_t down_top) {
  uintptr_t upper = granule_of(down_top);
  if (r->next && granule_of(r->next->addr) < upper) upper = granule_of(r->next->addr);
  return upper;
}

static void set_rooms(const sim_table *t, sim_range *r) {
  uintptr_t lo = r->prev ? np_round_up(r->prev->addr + r->prev->size, SIM_ALIGN) : 0;
  uint64_t below = room(below_from(r, lo), r->addr), above = room(above_from(r), above_to(r, t->top));
  r->room_small = below > above ? below : above;
  r->room_large = room(np_round_up(r->addr + r->size, SIM_GRANULE), large_upper(r, t->top));
}

static void pull(sim_range *n) {
  n->max_small = n->room_small;
  n->max_large = n->room_large;
  for (int i = 0; i < 2; i++) {
    const sim_range *c = i ? n->right : n->left;
    if (c && c->max_small > n->max_small) n->max_small = c->max_small;
    if (c && c->max_large > n->max_large) n->max_large = c->max_large;
  }
}

static bool precedes(const sim_range *a, const sim_range *b) {
  return a->addr < b->addr || (a->addr == b->addr && a->seq > b->seq);
}

/* Split subtree n into the ranges before r (*lo) and the rest (*hi), pulling the path walked. */
static void split(sim_range *n, const sim_range *r, sim_range **lo, sim_range **hi) {
  if (!n) {
    *lo = *hi = NULL;
  } else if (precedes(n, r)) {
    split(n->right, r, &n->right, hi);
    *lo = n;
    pull(n);
  } else {
    split(n->left, r, lo, &n->left);
    *hi = n;
    pull(n);
  }
}

/* Join two subtrees, every range of a before every range of b. */
static sim_range *merge(sim_range *a, sim_range *b) {
  if (!a || !b) return a ? a : b;
  if (a->prio > b->prio) {
    a->right = merge(a->right, b);
    pull(a);
    return a;
  }
  b->left = merge(a, b->left);
  pull(b);
  return b;
}

static void pull_first(sim_range *n) {
  if (!n) return;
  pull_first(n->left);
  pull(n);
}

/* Remove the first range of subtree n. The subtree that takes its place has the removed range's
 * successor first, whose rooms changed: its left spine is pulled, then the way back up. */
static sim_range *drop_first(sim_range *n) {
  if (!n->left) {
    pull_first(n->right);
    return n->right;
  }
  n->left = drop_first(n->left);
  pull(n);
  return n;
}

static int add_range(sim_table *s, uintptr_t addr, uint64_t size) {
  sim_range *r = malloc(sizeof *r);
  if (!r) return np_error(NP_ERR_HOST, "sim: host out of memory for range table");
  sim_range *prev, *next = seek(s, addr, &prev);
  *r = (sim_range){.addr = addr, .size = size, .prev = prev, .next = next, .seq = ++s->seq,
                   .prio = np_next_prio(&s->rng)};
  if (prev) prev->next = r;
  if (next) next->prev = r;
  set_rooms(s, r);
  pull(r);
  if (prev) set_rooms(s, prev); /* both on the split's path, which pulls them */
  if (next) set_rooms(s, next);
  sim_range *lo, *hi;
  split(s->root, r, &lo, &hi);
  s->root = merge(merge(lo, r), hi);
  return NP_OK;
}

static int del_range(sim_table *s, uintptr_t addr, uint64_t size, const char *what) {
  sim_range *r = seek(s, addr, NULL);
  if (!r || r->addr != addr || r->size != size)
    return np_error(NP_ERR_BACKEND, "sim: %s of %#lx (%llu bytes) which is not one whole %s the device handed out",
                    what, (unsigned long)addr, (unsigned long long)size, what[0] == 'u' ? "mapping" : "range");
  if (r->prev) r->prev->next = r->next;
  if (r->next) r->next->prev = r->prev;
  if (r->prev) set_rooms(s, r->prev); /* on the split's path */
  if (r->next) set_rooms(s, r->next); /* on it, or first in r's right subtree: drop_first's */
  sim_range *lo, *hi;
  split(s->root, r, &lo, &hi); /* r is hi's first */
  s->root = merge(lo, drop_first(hi));
  free(r);
  return NP_OK;
}

/* The first range after f whose room_small is at least x, or NULL. */
static const sim_range *first_small_fit(const sim_range *n, const sim_range *f, uint64_t x) {
  if (!n || n->max_small < x) return NULL;
  if (!precedes(f, n)) return first_small_fit(n->right, f, x);
  const sim_range *r = first_small_fit(n->left, f, x);
  if (r) return r;
  return n->room_small >= x ? n : first_small_fit(n->right, f, x);
}

/* The last range below addr `end` whose room_large is at least x, or NULL. */
static const sim_range *last_large_fit(const sim_range *n, uintptr_t end, uint64_t x) {
  if (!n || n->max_large < x) return NULL;
  if (n->addr >= end) return last_large_fit(n->left, end, x);
  const sim_range *r = last_large_fit(n->right, end, x);
  if (r) return r;
  return n->room_large >= x ? n : last_large_fit(n->left, end, x);
}

static int charge(sim_backend *s, uint64_t size) {
  if (size > s->base.total - s->used) {
    char a[32], b[32], c[32];
    return np_error(NP_ERR_OOM, "sim device out of memory: %s requested, %s of %s free", np_fmt_bytes(size, a),
                    np_fmt_bytes(s->base.total - s->used, b), np_fmt_bytes(s->base.total, c));
  }
  s->used += size;
  return NP_OK;
}

/* The lowest address at or above `from` that the range starting below it (`before`, seek's)
 * leaves free. */
static uintptr_t free_from(const sim_range *before, uintptr_t from) {
  return before && before->addr + before->size > from ? np_round_up(before->addr + before->size, SIM_ALIGN) : from;
}

/* Whether a request of `need` bytes (under a granule) fits beside r, the room below it counted
 * from lo; *at gets where (below before above, as cuda_addr's ascending scan tries them). */
static bool small_place(const sim_range *r, uintptr_t lo, uintptr_t down_top, uint64_t need, uintptr_t *at) {
  uintptr_t from = below_from(r, lo);
  if (room(from, r->addr) > need) {
    *at = from;
    return true;
  }
  from = above_from(r);
  if (room(from, above_to(r, down_top)) > need) {
    *at = from;
    return true;
  }
  return false;
}

/* Where cudaMalloc puts `size` bytes (rounded up to SIM_ALIGN), as the CUDA driver did in every
 * segment address recorded on an H100 (docs/gpu.md): address space goes in SIM_GRANULE units taken
 * top down; a request under a granule goes at the low end of the lowest free range, inside a granule
 * that already holds an allocation, with room for it; other requests, and one no such range takes,
 * get the highest whole granules free (the top of the highest free run that holds them). The window
 * is [low, s->down_top), low being s->next or the end of a range reaching above it (a hinted
 * one); 0 when it has no room.
 * Both are scans over the window's ranges (ascending for the first fit, descending for the
 * highest), each range's test reading only it and its neighbours: the rooms (sim_range) are those
 * tests, so the treap finds the range a scan would stop at without walking the others. The
 * window's first range is tested directly: its room below counts from low, not from the range
 * before it. */
static uintptr_t cuda_addr(const sim_backend *s, uint64_t size) {
  uint64_t need = np_round_up(size, SIM_ALIGN);
  sim_range *before, *first = seek(&s->alloc, s->next, &before);
  uintptr_t low = free_from(before, s->next), at = 0;
  if (first && first->addr >= s->down_top) first = NULL; /* the window holds no range */
  if (need < SIM_GRANULE && first) {
    if (small_place(first, low, s->down_top, need, &at)) return at; /* ascending: the first fit is the lowest */
    const sim_range *r = first_small_fit(s->alloc.root, first, need + 1);
    if (r && r->addr < s->down_top) {
      bool fits = small_place(r, np_round_up(r->prev->addr + r->prev->size, SIM_ALIGN), s->down_top, need, &at);
      NP_ASSERT(fits); /* (its room_small says so; a release build that found otherwise places it as a large one) */
      if (fits) return at;
    }
  }
  uint64_t span = np_round_up(need, SIM_GRANULE);
  uintptr_t upper = granule_of(s->down_top);
  /* descending: the highest range with `span` whole granules free above it; none: all below the
   * window's first range's granule */
  const sim_range *r = first ? last_large_fit(s->alloc.root, s->down_top, span + 1) : NULL;
  if (r && r->addr >= s->next) upper = large_upper(r, s->down_top);
  else if (first && granule_of(first->addr) < upper) upper = granule_of(first->addr);
  return upper >= low + span ? upper - span : 0;
}

/* The lowest range of `size` bytes (rounded up to SIM_ALIGN) in [low, down_top) that no live range
 * touches; 0 when none: where the bump pointer has run out of the window (address space taken and
 * given back over a long run), freed space is used again. (A walk over the ranges: only once the
 * bump pointer has crossed half the window, 2 PiB of addresses.) */
static uintptr_t lowest_gap(const sim_backend *s, uint64_t size) {
  uint64_t need = np_round_up(size, SIM_ALIGN);
  sim_range *before, *r = seek(&s->alloc, s->low, &before);
  uintptr_t lo = free_from(before, s->low);
  for (; r && r->addr < s->down_top; r = r->next) {
    if (r->addr >= lo && r->addr - lo >= need) return lo;
    uintptr_t top = np_round_up(r->addr + r->size, SIM_ALIGN);
    if (top > lo) lo = top;
  }
  return lo < s->down_top && s->down_top - lo >= need ? lo : 0;
}

/* Pick an address range of `size` bytes: real host memory, the hinted range, or a virtual range
 * (top down for mallocs under CUDA's rules, else the next one up, else the lowest gap). */
static int take_addr(sim_backend *s, uint64_t size, int prot, uintptr_t *out) {
  if (s->host) {
    void *p = mmap(NULL, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return np_error(NP_ERR_HOST, "sim: host mmap of %llu bytes failed", (unsigned long long)size);
    *out = (uintptr_t)p;
  } else if (s->hint && !overlaps(&s->alloc, s->hint, size)) {
    *out = s->hint;
  } else if (s->top_down && prot != PROT_NONE) {
    *out = cuda_addr(s, size);
    if (!*out) return np_error(NP_ERR_OOM, "sim: the device's virtual address window is full");
  } else if (!overlaps(&s->alloc, s->next, size) && s->next <= s->down_top && s->down_top - s->next >= size) {
    *out = s->next;
    s->next = np_round_up(s->next + size, SIM_ALIGN);
  } else {
    *out = lowest_gap(s, size);
    if (!*out) return np_error(NP_ERR_OOM, "sim: the device's virtual address window is full");
  }
  s->hint = 0;
  int rc = add_range(&s->alloc, *out, size);
  if (rc != NP_OK && s->host) munmap((void *)*out, size);
  return rc;
}

static void drop_addr(sim_backend *s, uintptr_t addr, uint64_t size) {
  if (s->host) munmap((void *)addr, size);
}

static int sim_malloc(np_backend *be, uint64_t size, uintptr_t *out) {
  sim_backend *s = (sim_backend *)be;
  sim_enter(s, true);
  be->calls[NP_CALL_MALLOC]++;
  int rc = charge(s, size);
  if (rc != NP_OK) return rc;
  rc = take_addr(s, size, PROT_READ | PROT_WRITE, out);
  if (rc != NP_OK) s->used -= size;
  return rc;
}

static int sim_free(np_backend *be, uintptr_t addr, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  sim_enter(s, true);
  be->calls[NP_CALL_FREE]++;
  int rc = del_range(&s->alloc, addr, size, "free");
  if (rc != NP_OK) return rc;
  drop_addr(s, addr, size);
  s->used -= size;
  return NP_OK;
}

static int sim_reserve(np_backend *be, uint64_t size, uintptr_t *out) {
  sim_backend *s = (sim_backend *)be;
  sim_enter(s, true);
  be->calls[NP_CALL_RESERVE]++;
  if (size % SIM_PAGE) return np_error(NP_ERR_INVALID, "sim: reserve size not a multiple of the page size");
  return take_addr(s, size, PROT_NONE, out);
}

static int sim_release(np_backend *be, uintptr_t addr, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  sim_enter(s, true);
  be->calls[NP_CALL_RELEASE]++;
  if (overlaps(&s->maps, addr, size))
    return np_error(NP_ERR_BACKEND, "sim: release of the reservation at %#lx while chunks are still mapped in it",
                    (unsigned long)addr);
  int rc = del_range(&s->alloc, addr, size, "release");
  if (rc == NP_OK) drop_addr(s, addr, size);
  return rc;
}

static int sim_page_create(np_backend *be, uint64_t size, uint64_t *handle) {
  sim_backend *s = (sim_backend *)be;
  be->calls[NP_CALL_PHYS_CREATE]++;
  if (size == 0 || size % be->granularity)
    return np_error(NP_ERR_BACKEND, "sim: a physical chunk of %llu bytes is not a multiple of the %llu-byte granularity",
                    (unsigned long long)size, (unsigned long long)be->granularity);
  if (s->n_handles + 1 >= s->cap_handles) {
    uint64_t cap = s->cap_handles ? 2 * s->cap_handles : 256;
    uint64_t *t = realloc(s->handle_size, cap * sizeof *t);
    if (!t) return np_error(NP_ERR_HOST, "sim: host out of memory for the handle table");
    s->handle_size = t;
    s->cap_handles = cap;
  }
  int rc = charge(s, size);
  if (rc != NP_OK) return rc;
  *handle = ++s->n_handles;
  s->handle_size[*handle] = size;
  return NP_OK;
}

static bool live_handle(const sim_backend *s, uint64_t handle) {
  return handle && handle <= s->n_handles && s->handle_size[handle];
}

static int sim_page_release(np_backend *be, uint64_t handle, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  be->calls[NP_CALL_PHYS_RELEASE]++;
  (void)size; /* the vendors release a handle whole, whatever was mapped of it */
  if (!live_handle(s, handle)) return np_error(NP_ERR_BACKEND, "sim: release of handle %llu which is not live", (unsigned long long)handle);
  s->used -= s->handle_size[handle];
  s->handle_size[handle] = 0;
  return NP_OK;
}

/* CUDA's cuMemSetAccess after each map (the CUDA backend's page_access): counted, nothing to do. */
static int sim_page_access(np_backend *be, uintptr_t va, uint64_t size) {
  (void)va;
  (void)size;
  be->calls[NP_CALL_SET_ACCESS]++;
  return NP_OK;
}

static int sim_page_map(np_backend *be, uintptr_t va, uint64_t size, uint64_t handle) {
  sim_backend *s = (sim_backend *)be;
  be->calls[NP_CALL_MAP]++;
  /* a physical allocation is mapped whole (aclrtMapMem: its size, at offset 0) */
  if (!live_handle(s, handle) || size != s->handle_size[handle] || size % be->granularity || !size)
    return np_error(NP_ERR_BACKEND, "sim: map of %llu bytes at %#lx from handle %llu which is not live or of another size",
                    (unsigned long long)size, (unsigned long)va, (unsigned long long)handle);
  if (overlaps(&s->maps, va, size))
    return np_error(NP_ERR_BACKEND, "sim: map at %#lx overlaps a mapping", (unsigned long)va);
  if (s->host && mprotect((void *)va, size, PROT_READ | PROT_WRITE) != 0)
    return np_error(NP_ERR_HOST, "sim: mprotect failed while mapping");
  int rc = add_range(&s->maps, va, size);
  if (rc != NP_OK && s->host) mprotect((void *)va, size, PROT_NONE);
  return rc;
}

static int sim_page_unmap(np_backend *be, uintptr_t va, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  be->calls[NP_CALL_UNMAP]++;
  int rc = del_range(&s->maps, va, size, "unmap"); /* whole mappings only, as the vendors */
  if (rc != NP_OK) return rc;
  if (s->host) {
    madvise((void *)va, size, MADV_DONTNEED);
    mprotect((void *)va, size, PROT_NONE);
  }
  return NP_OK;
}

static int sim_synchronize(np_backend *be, intptr_t stream) {
  sim_enter((sim_backend *)be, true);
  be->calls[stream == NP_STREAM_ANY ? NP_CALL_SYNC_DEVICE : NP_CALL_SYNC_STREAM]++;
  return NP_OK; /* the simulated device runs nothing asynchronously */
}

static int sim_stream_wait(np_backend *be, intptr_t waiter, intptr_t on) {
  sim_backend *s = (sim_backend *)be;
  sim_enter(s, false);
  /* (queued, torch_npu's rules: the C++ hooks' event, recorded and waited through torch_npu's
   * queue, made once and kept for the process; the ACL backend's own otherwise, destroyed at close) */
  if (!s->event) be->calls[NP_CALL_EVENT_CREATE]++;
  s->event = true;
  be->calls[NP_CALL_EVENT_RECORD]++;
  be->calls[NP_CALL_EVENT_WAIT]++;
  (void)waiter;
  (void)on;
  return NP_OK; /* nothing runs asynchronously: the order already holds */
}

static int sim_stream_idle(np_backend *be, intptr_t stream) {
  sim_enter((sim_backend *)be, false);
  be->calls[NP_CALL_STREAM_QUERY]++;
  (void)stream;
  return 1; /* simulated work finishes as it is queued */
}

/* Host-backed: device memory is host memory, so copies are plain ones (there is no pinned kind). */
static int sim_copy(np_backend *be, void *dst, const void *src, uint64_t size, int to_device) {
  (void)be;
  (void)to_device;
  memcpy(dst, src, size);
  return NP_OK;
}

static int sim_host_alloc(np_backend *be, uint64_t size, void **out) {
  (void)be;
  *out = malloc(size ? size : 1);
  return *out ? NP_OK : np_error(NP_ERR_HOST, "sim: host out of memory for a backup of %llu bytes", (unsigned long long)size);
}

static void sim_host_free(np_backend *be, void *p) {
  (void)be;
  free(p);
}

static int sim_free_bytes(np_backend *be, uint64_t *out) {
  sim_backend *s = (sim_backend *)be;
  s->base.calls[NP_CALL_MEM_INFO]++;
  *out = s->base.total - s->used;
  return NP_OK;
}

static int sim_chunk_enter(np_backend *be, int *prev) {
  *prev = -1;
  sim_enter((sim_backend *)be, false);
  return NP_OK;
}

static void sim_chunk_leave(np_backend *be, int prev) {
  (void)be;
  (void)prev;
}

static void sim_hint(np_backend *be, uintptr_t addr) { ((sim_backend *)be)->hint = addr; }

static int sim_destroy(np_backend *be) {
  sim_backend *s = (sim_backend *)be;
  if (s->event && !s->queued) be->calls[NP_CALL_EVENT_DESTROY]++; /* (queued: the hooks keep theirs) */
  for (int t = 0; t < 2; t++) {
    for (sim_range *r = seek(t ? &s->maps : &s->alloc, 0, NULL), *n; r; r = n) {
      n = r->next;
      if (!t) drop_addr(s, r->addr, r->size);
      free(r);
    }
  }
  free(s->handle_size);
  free(s);
  return NP_OK;
}

np_backend *np_backend_sim_create(const np_config *cfg) {
  if (cfg->capacity == 0 || cfg->capacity > NP_MAX_REQUEST) {
    np_error(NP_ERR_INVALID, "sim: capacity must be between 1 byte and 256 TiB, got %llu",
             (unsigned long long)cfg->capacity);
    return NULL;
  }
  sim_backend *s = calloc(1, sizeof *s);
  if (!s) {
    np_error(NP_ERR_HOST, "sim: host out of memory");
    return NULL;
  }
  s->base = (np_backend){
      .name = cfg->host_backed ? "sim-host" : "sim",
      .simulated = true,
      .total = cfg->capacity,
      .granularity = cfg->vmm ? SIM_PAGE : 0,
      .malloc = sim_malloc,
      .free = sim_free,
      .reserve = cfg->vmm ? sim_reserve : NULL,
      .release = cfg->vmm ? sim_release : NULL,
      .page_create = cfg->vmm ? sim_page_create : NULL,
      .page_release = cfg->vmm ? sim_page_release : NULL,
      .page_map = cfg->vmm ? sim_page_map : NULL,
      .page_unmap = cfg->vmm ? sim_page_unmap : NULL,
      .synchronize = sim_synchronize,
      .hint_addr = sim_hint,
      .stream_wait = sim_stream_wait,
      .stream_idle = cfg->device_rules == NP_DEVICE_NPU ? NULL : sim_stream_idle, /* (queued: asks none) */
      .enter = cfg->vmm ? sim_chunk_enter : NULL,
      .leave = cfg->vmm ? sim_chunk_leave : NULL,
      .destroy = sim_destroy,
      .copy = cfg->host_backed ? sim_copy : NULL,
      .host_alloc = cfg->host_backed ? sim_host_alloc : NULL,
      .host_free = cfg->host_backed ? sim_host_free : NULL,
      .free_bytes = sim_free_bytes,
  };
  if (cfg->vmm && cfg->device_rules != NP_DEVICE_NPU) /* CUDA's rules (auto included): a map grants access too */
    s->base.page_access = sim_page_access;
  s->host = cfg->host_backed != 0;
  s->low = s->next = SIM_BASE + (uintptr_t)((unsigned)cfg->device % SIM_DEVICES) * SIM_WINDOW;
  s->top_down = cfg->device_rules != NP_DEVICE_NPU; /* CUDA's, and auto: the simulator's own rules are CUDA's */
  s->queued = cfg->device_rules == NP_DEVICE_NPU;
  s->base.free_synchronizes = cfg->device_rules != NP_DEVICE_NPU; /* cudaFree waits for the device, aclrtFree not */
  s->down_top = s->next + SIM_WINDOW / 2;
  s->alloc.top = s->maps.top = s->down_top; /* (the maps' rooms go unused) */
  s->device = cfg->device;
  /* what the ACL backend asks at creation: the device, its memory, the granularity and a probe reservation */
  sim_enter(s, true);
  s->base.calls[NP_CALL_MEM_INFO]++;
  if (cfg->vmm) {
    s->base.calls[NP_CALL_GRANULARITY]++;
    s->base.calls[NP_CALL_RESERVE]++;
    s->base.calls[NP_CALL_RELEASE]++;
  }
  return &s->base;
}
