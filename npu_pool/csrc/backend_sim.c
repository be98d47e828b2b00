/* backend_sim.c -- a simulated device on the CPU.
 *
 * The device has a capacity; allocations and mapped pages count against it.
 * By default addresses come from a virtual range with nothing behind them
 * (so replays of 80 GiB traces cost no memory); with host_backed, every
 * allocation or mapping is real host memory, so tests can write patterns.
 *
 * Invariant: `ranges` holds every live allocation and reservation, sorted by
 * address and pairwise disjoint; used = allocated bytes + physical pages' bytes.
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
#define SIM_PAGE ((uint64_t)NP_SIM_PAGE)

typedef struct sim_range {
  uintptr_t addr;
  uint64_t size;
} sim_range;

typedef struct sim_backend {
  np_backend base;
  uint64_t used;
  bool host;
  uintptr_t next;      /* bump pointer for virtual addresses */
  uintptr_t hint;      /* one-shot address for the next malloc, 0 if none */
  sim_range *ranges;
  size_t n, cap;
  uint64_t next_handle;
} sim_backend;

static size_t find_pos(const sim_backend *s, uintptr_t addr) {
  size_t lo = 0, hi = s->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (s->ranges[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static bool overlaps(const sim_backend *s, uintptr_t addr, uint64_t size) {
  size_t i = find_pos(s, addr);
  if (i < s->n && s->ranges[i].addr < addr + size) return true;
  if (i > 0 && s->ranges[i - 1].addr + s->ranges[i - 1].size > addr) return true;
  return false;
}

static int add_range(sim_backend *s, uintptr_t addr, uint64_t size) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 64;
    sim_range *r = realloc(s->ranges, cap * sizeof *r);
    if (!r) return np_error(NP_ERR_HOST, "sim: host out of memory for range table");
    s->ranges = r;
    s->cap = cap;
  }
  size_t i = find_pos(s, addr);
  memmove(&s->ranges[i + 1], &s->ranges[i], (s->n - i) * sizeof *s->ranges);
  s->ranges[i] = (sim_range){addr, size};
  s->n++;
  return NP_OK;
}

static int del_range(sim_backend *s, uintptr_t addr, uint64_t size) {
  size_t i = find_pos(s, addr);
  if (i == s->n || s->ranges[i].addr != addr || s->ranges[i].size != size)
    return np_error(NP_ERR_BACKEND, "sim: free of %#lx (%llu bytes) which the device never handed out",
                    (unsigned long)addr, (unsigned long long)size);
  memmove(&s->ranges[i], &s->ranges[i + 1], (s->n - i - 1) * sizeof *s->ranges);
  s->n--;
  return NP_OK;
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

/* Pick an address range of `size` bytes: real host memory or the next virtual range. */
static int take_addr(sim_backend *s, uint64_t size, int prot, uintptr_t *out) {
  if (s->host) {
    void *p = mmap(NULL, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return np_error(NP_ERR_HOST, "sim: host mmap of %llu bytes failed", (unsigned long long)size);
    *out = (uintptr_t)p;
  } else if (s->hint && !overlaps(s, s->hint, size)) {
    *out = s->hint;
  } else {
    *out = s->next;
    s->next = np_round_up(s->next + size, SIM_ALIGN);
  }
  s->hint = 0;
  int rc = add_range(s, *out, size);
  if (rc != NP_OK && s->host) munmap((void *)*out, size);
  return rc;
}

static void drop_addr(sim_backend *s, uintptr_t addr, uint64_t size) {
  if (s->host) munmap((void *)addr, size);
}

static int sim_malloc(np_backend *be, uint64_t size, uintptr_t *out) {
  sim_backend *s = (sim_backend *)be;
  int rc = charge(s, size);
  if (rc != NP_OK) return rc;
  rc = take_addr(s, size, PROT_READ | PROT_WRITE, out);
  if (rc != NP_OK) s->used -= size;
  return rc;
}

static int sim_free(np_backend *be, uintptr_t addr, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  int rc = del_range(s, addr, size);
  if (rc != NP_OK) return rc;
  drop_addr(s, addr, size);
  s->used -= size;
  return NP_OK;
}

static int sim_reserve(np_backend *be, uint64_t size, uintptr_t *out) {
  sim_backend *s = (sim_backend *)be;
  if (size % SIM_PAGE) return np_error(NP_ERR_INVALID, "sim: reserve size not a multiple of the page size");
  return take_addr(s, size, PROT_NONE, out);
}

static int sim_release(np_backend *be, uintptr_t addr, uint64_t size) {
  sim_backend *s = (sim_backend *)be;
  int rc = del_range(s, addr, size);
  if (rc == NP_OK) drop_addr(s, addr, size);
  return rc;
}

static int sim_page_create(np_backend *be, uint64_t *handle) {
  sim_backend *s = (sim_backend *)be;
  int rc = charge(s, be->granularity);
  if (rc == NP_OK) *handle = ++s->next_handle;
  return rc;
}

static int sim_page_release(np_backend *be, uint64_t handle) {
  (void)handle;
  ((sim_backend *)be)->used -= be->granularity;
  return NP_OK;
}

static int sim_page_map(np_backend *be, uintptr_t va, uint64_t handle) {
  sim_backend *s = (sim_backend *)be;
  (void)handle;
  if (s->host && mprotect((void *)va, be->granularity, PROT_READ | PROT_WRITE) != 0)
    return np_error(NP_ERR_HOST, "sim: mprotect failed while mapping");
  return NP_OK;
}

static int sim_page_unmap(np_backend *be, uintptr_t va) {
  sim_backend *s = (sim_backend *)be;
  if (s->host) {
    madvise((void *)va, be->granularity, MADV_DONTNEED);
    mprotect((void *)va, be->granularity, PROT_NONE);
  }
  return NP_OK;
}

static int sim_synchronize(np_backend *be, intptr_t stream) {
  (void)be;
  (void)stream;
  return NP_OK; /* the simulated device runs nothing asynchronously */
}

static int sim_stream_wait(np_backend *be, intptr_t waiter, intptr_t on) {
  (void)be;
  (void)waiter;
  (void)on;
  return NP_OK; /* nothing runs asynchronously: the order already holds */
}

static int sim_stream_idle(np_backend *be, intptr_t stream) {
  (void)be;
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

static void sim_hint(np_backend *be, uintptr_t addr) { ((sim_backend *)be)->hint = addr; }

static void sim_destroy(np_backend *be) {
  sim_backend *s = (sim_backend *)be;
  for (size_t i = 0; i < s->n; i++) drop_addr(s, s->ranges[i].addr, s->ranges[i].size);
  free(s->ranges);
  free(s);
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
      .stream_idle = sim_stream_idle,
      .destroy = sim_destroy,
      .copy = cfg->host_backed ? sim_copy : NULL,
      .host_alloc = cfg->host_backed ? sim_host_alloc : NULL,
      .host_free = cfg->host_backed ? sim_host_free : NULL,
  };
  s->host = cfg->host_backed != 0;
  s->next = SIM_BASE + (uintptr_t)((unsigned)cfg->device % SIM_DEVICES) * SIM_WINDOW;
  return &s->base;
}
