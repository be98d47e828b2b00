/* fake_device.h -- what the fake vendor libraries (fake_acl.c, fake_cuda.c) share: a
 * device of `capacity` bytes over host memory (FAKE_CAPACITY, default 1 GiB;
 * FAKE_DEVICES devices, default 2), the table of its regions, per-function call
 * counters with injected failures, busy streams, and the control functions the
 * tests call through ctypes.
 *
 * Included once by each fake (everything is static or exported from that library).
 * Define FAKE_FIRST_DEVICE (a thread's current device before any set-device call)
 * first. Invariants: st.used <= st.capacity - st.others; every region in st.r is a
 * live allocation, reservation or mapping; everything here runs with `mu` held
 * unless it takes the lock itself.
 *
 * Addresses: allocations and reservations take fresh address space bottom-up, 2 MiB aligned,
 * never reusing a range (fake_map), as the simulated device does (backend_sim.c): best fit's
 * ties, broken by the lower address, then fall the same way in a replay on the fake and in the
 * simulator. FAKE_VA_BASE (defined before including) is where each fake's range starts.
 */
#ifndef FAKE_DEVICE_H
#define FAKE_DEVICE_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define EXPORT __attribute__((visibility("default")))
#define UNUSED __attribute__((unused))
#define PAGE ((size_t)2 << 20)

typedef struct phys { size_t size; int mapped; int released; } phys; /* a physical allocation */
typedef struct region { uintptr_t addr; size_t size; int kind; phys *ph; } region;
enum { ALLOC = 1, RESERVED = 2, MAPPING = 3 };
typedef struct event { int recorded; void *stream; } event;          /* a device event */
typedef struct counter { char name[48]; long calls, skip, fail; int code; } counter;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  size_t capacity, used, others, mapped;
  int devices, vmm, flags_reserved, last_device, last_policy, initialised;
  region *r;
  size_t n, cap;
  long live_phys, live_events;
  void *busy[16];
  counter c[64];
  int nc;
  uintptr_t va;      /* next fresh address (fake_map); 0 until first use */
} st;
static __thread int current = FAKE_FIRST_DEVICE;

static void init_locked(void) {
  if (st.initialised) return;
  const char *cap = getenv("FAKE_CAPACITY"), *dev = getenv("FAKE_DEVICES");
  st.capacity = cap ? strtoull(cap, NULL, 0) : ((size_t)1 << 30);
  st.devices = dev ? atoi(dev) : 2;
  st.vmm = 1;
  st.last_device = st.last_policy = -1;
  st.initialised = 1;
}

/* The counter of fn, created on first use. */
static counter *counter_for(const char *fn) {
  init_locked();
  for (int i = 0; i < st.nc; i++)
    if (!strcmp(st.c[i].name, fn)) return &st.c[i];
  if (st.nc == 64) return NULL;
  counter *c = &st.c[st.nc++];
  memset(c, 0, sizeof *c);
  snprintf(c->name, sizeof c->name, "%s", fn);
  return c;
}

/* Count a call of fn; returns the injected error code or 0. */
static int enter(const char *fn) {
  counter *c = counter_for(fn);
  if (!c) return 0;
  c->calls++;
  if (c->skip > 0) {
    c->skip--;
    return 0;
  }
  if (c->fail > 0) {
    c->fail--;
    return c->code;
  }
  return 0;
}

static region *add(uintptr_t addr, size_t size, int kind) {
  if (st.n == st.cap) {
    st.cap = st.cap ? st.cap * 2 : 64;
    st.r = realloc(st.r, st.cap * sizeof *st.r);
  }
  st.r[st.n] = (region){addr, size, kind, NULL};
  return &st.r[st.n++];
}

static UNUSED region *find(uintptr_t addr, int kind) {
  for (size_t i = 0; i < st.n; i++)
    if (st.r[i].addr == addr && st.r[i].kind == kind) return &st.r[i];
  return NULL;
}

static UNUSED void drop(region *x) { *x = st.r[--st.n]; }

/* Whether [a, a+s) lies inside one region of `kind` (stored in *out when out is given). */
static UNUSED int inside(uintptr_t a, size_t s, int kind, region **out) {
  for (size_t i = 0; i < st.n; i++)
    if (st.r[i].kind == kind && a >= st.r[i].addr && a + s <= st.r[i].addr + st.r[i].size) {
      if (out) *out = &st.r[i];
      return 1;
    }
  return 0;
}

static UNUSED int overlaps_mapping(uintptr_t a, size_t s) {
  for (size_t i = 0; i < st.n; i++)
    if (st.r[i].kind == MAPPING && a < st.r[i].addr + st.r[i].size && st.r[i].addr < a + s) return 1;
  return 0;
}

/* Take `size` bytes of the device's capacity; 0 if they are not there. */
static int charge(size_t size) {
  size_t taken = st.others + st.used; /* others may be set past the capacity: nothing is free then */
  if (taken > st.capacity || size > st.capacity - taken) return 0;
  st.used += size;
  return 1;
}

/* `size` bytes of fresh address space with protection `prot`, above every range handed out
 * before (see the header); MAP_FAILED if the host has none. */
static void *fake_map(size_t size, int prot) {
  size_t span = (size + PAGE - 1) / PAGE * PAGE;
  if (!st.va) st.va = FAKE_VA_BASE;
  for (int tries = 0; tries < 64; tries++) {
    void *p = mmap((void *)st.va, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == (void *)st.va) {
      st.va += span;
      return p;
    }
    if (p != MAP_FAILED) munmap(p, size); /* a kernel without MAP_FIXED_NOREPLACE placed it elsewhere */
    st.va += span;                      /* taken by someone else: step over */
  }
  return mmap(NULL, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
}

static int is_busy(void *stream) {
  for (int i = 0; i < 16; i++)
    if (st.busy[i] && st.busy[i] == stream) return 1;
  return 0;
}

/* Forget every region and setting (the vendor's fake_reset adds its own). */
static void reset_locked(void) {
  init_locked();
  for (size_t i = 0; i < st.n; i++)
    if (st.r[i].kind != MAPPING) munmap((void *)st.r[i].addr, st.r[i].size);
  free(st.r);
  st.r = NULL;
  st.n = st.cap = 0;
  st.used = st.others = st.mapped = 0;
  st.live_phys = st.live_events = 0;
  memset(st.busy, 0, sizeof st.busy);
  st.nc = 0;
  st.va = 0;
  st.vmm = 1;
  st.flags_reserved = 0;
  st.last_device = st.last_policy = -1;
  current = FAKE_FIRST_DEVICE;
}

/* ---- control (ctypes) --------------------------------------------------------- */

EXPORT void fake_set_capacity(unsigned long long b) { pthread_mutex_lock(&mu); init_locked(); st.capacity = b; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_used(unsigned long long b) { pthread_mutex_lock(&mu); st.others = b; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_vmm(int on) { pthread_mutex_lock(&mu); init_locked(); st.vmm = on; pthread_mutex_unlock(&mu); }
/* After `skip` good calls, fail `count` calls of fn with `code`. */
EXPORT void fake_fail(const char *fn, long skip, long count, int code) {
  pthread_mutex_lock(&mu);
  counter *c = counter_for(fn);
  if (c) {
    c->skip = skip;
    c->fail = count;
    c->code = code;
  }
  pthread_mutex_unlock(&mu);
}
EXPORT long fake_calls(const char *fn) {
  long n = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < st.nc; i++)
    if (!strcmp(st.c[i].name, fn)) n = st.c[i].calls;
  pthread_mutex_unlock(&mu);
  return n;
}
EXPORT void fake_set_busy(void *stream, int busy) { /* busy streams have unfinished work */
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 16; i++)
    if (busy ? !st.busy[i] : st.busy[i] == stream) {
      st.busy[i] = busy ? stream : NULL;
      break;
    }
  pthread_mutex_unlock(&mu);
}
EXPORT unsigned long long fake_used(void) { return st.used; }
EXPORT unsigned long long fake_mapped(void) { return st.mapped; }
/* allocations, reservations, mappings, physical handles, events */
EXPORT long fake_live(void) { return (long)st.n + st.live_phys + st.live_events; }
EXPORT int fake_current_device(void) { return current; }
EXPORT void fake_set_current_device(int d) { current = d; }
EXPORT int fake_last_device(void) { return st.last_device; }

#endif
