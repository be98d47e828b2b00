/* fake_acl.c -- a pretend Ascend runtime (libascendcl.so) over host memory, for tests.
 *
 * Exports the ACL symbols npu_pool's acl backend binds, with ACL's signatures
 * and error codes, over a device of `capacity` bytes (FAKE_CAPACITY, default
 * 1 GiB; FAKE_DEVICES devices, default 2). Memory is real host memory, so tests
 * can write patterns: aclrtMalloc is an anonymous mapping; a reservation is
 * PROT_NONE address space; aclrtMallocPhysical is a capacity charge; aclrtMapMem
 * makes the pages readable and writable; aclrtUnmapMem takes a mapping's start
 * and unmaps that whole mapping. A thread has no current device until
 * aclrtSetDevice (aclrtGetDevice then fails with ACL_ERROR_RT_CONTEXT_NULL).
 *
 * Control (for ctypes): fake_reset, fake_set_capacity, fake_set_used (memory
 * held by "other processes"), fake_set_vmm (0: aclrtReserveMemAddress is not
 * supported), fake_set_flags_reserved (1: aclrtReserveMemAddress wants flags 0),
 * fake_fail(fn, skip, count, code), fake_calls(fn), fake_used, fake_mapped,
 * fake_live, fake_set_busy(stream, on) (aclrtStreamQuery reports unfinished
 * work), fake_current_device, fake_set_current_device, fake_last_device,
 * fake_last_policy, fake_set_soc_name(name) (aclrtGetSocName; default "Ascend910B1"),
 * fake_set_cann_version(v) (aclsysGetCANNVersion's CANN version; default none: the call
 * fails, as where the runtime lacks it). Build with -DFAKE_NO_VMM to leave the virtual-memory
 * symbols out, and with -DFAKE_OMIT_FREE to leave aclrtFree out.
 */
#define _GNU_SOURCE
#define FAKE_FIRST_DEVICE -1 /* no current device until aclrtSetDevice */
#define FAKE_VA_BASE ((uintptr_t)0x100000000000ull) /* 16 TiB */
#include "fake_device.h"

typedef int acl_err;
typedef struct acl_location { uint32_t id; int type; } acl_location;
typedef struct acl_phys_prop {
  int handle_type, allocation_type, mem_attr;
  acl_location location;
  uint64_t reserve;
} acl_phys_prop;

enum {
  OK = 0,
  INVALID_PARAM = 100000,       /* ACL_ERROR_INVALID_PARAM */
  RT_PARAM_INVALID = 107000,    /* ACL_ERROR_RT_PARAM_INVALID */
  RT_INVALID_DEVICEID = 107001, /* ACL_ERROR_RT_INVALID_DEVICEID */
  RT_CONTEXT_NULL = 107002,     /* ACL_ERROR_RT_CONTEXT_NULL */
  RT_INVALID_HANDLE = 107017,   /* ACL_ERROR_RT_INVALID_HANDLE */
  RT_NOT_SUPPORT = 207000,      /* ACL_ERROR_RT_FEATURE_NOT_SUPPORT */
  RT_MEMORY_ALLOCATION = 207001 /* ACL_ERROR_RT_MEMORY_ALLOCATION */
};

static __thread char recent[256]; /* the latest failure, for aclGetRecentErrMsg */
static char soc_name[64] = "Ascend910B1", cann_version[128] = ""; /* what runtime this is (fake_reset restores) */

/* Remember a failure the way ACL does, for aclGetRecentErrMsg. */
static acl_err fail(const char *fn, acl_err e, const char *why) {
  snprintf(recent, sizeof recent, "EE9999: [fake ACL] %s failed (%d): %s", fn, e, why);
  return e;
}

#define LOCKED(fn, ...)                        \
  do {                                         \
    pthread_mutex_lock(&mu);                   \
    acl_err _e = enter(fn);                    \
    if (_e) fail(fn, _e, "injected failure");  \
    else {                                     \
      __VA_ARGS__                              \
    }                                          \
    pthread_mutex_unlock(&mu);                 \
    return _e;                                 \
  } while (0)

/* ---- control ---------------------------------------------------------------- */

EXPORT void fake_reset(void) {
  pthread_mutex_lock(&mu);
  reset_locked();
  recent[0] = '\0';
  snprintf(soc_name, sizeof soc_name, "Ascend910B1");
  cann_version[0] = '\0';
  pthread_mutex_unlock(&mu);
}
EXPORT void fake_set_flags_reserved(int on) { pthread_mutex_lock(&mu); st.flags_reserved = on; pthread_mutex_unlock(&mu); }
EXPORT int fake_last_policy(void) { return st.last_policy; }

/* ---- runtime ---------------------------------------------------------------- */

EXPORT const char *aclGetRecentErrMsg(void) {
  static __thread char out[256];
  if (!recent[0]) return NULL;
  snprintf(out, sizeof out, "%s", recent);
  recent[0] = '\0';
  return out;
}

EXPORT acl_err aclrtGetDevice(int32_t *d) {
  LOCKED("aclrtGetDevice", {
    if (current < 0) _e = fail("aclrtGetDevice", RT_CONTEXT_NULL, "no current device on this thread");
    else *d = current;
  });
}

EXPORT acl_err aclrtSetDevice(int32_t d) {
  LOCKED("aclrtSetDevice", {
    if (d < 0 || d >= st.devices) _e = fail("aclrtSetDevice", RT_INVALID_DEVICEID, "no such device");
    else current = d;
  });
}

EXPORT acl_err aclrtMalloc(void **ptr, size_t size, int policy) {
  LOCKED("aclrtMalloc", {
    if (current < 0) _e = fail("aclrtMalloc", RT_CONTEXT_NULL, "no current device");
    else if (!ptr || !size) _e = fail("aclrtMalloc", INVALID_PARAM, "size 0");
    else if (!charge(size)) _e = fail("aclrtMalloc", RT_MEMORY_ALLOCATION, "out of device memory");
    else {
      void *p = fake_map(size, PROT_READ | PROT_WRITE);
      add((uintptr_t)p, size, ALLOC);
      st.last_device = current;
      st.last_policy = policy;
      *ptr = p;
    }
  });
}

#ifndef FAKE_OMIT_FREE
EXPORT acl_err aclrtFree(void *ptr) {
  LOCKED("aclrtFree", {
    region *x = find((uintptr_t)ptr, ALLOC);
    if (!x) _e = fail("aclrtFree", INVALID_PARAM, "not an allocation");
    else {
      munmap(ptr, x->size);
      st.used -= x->size;
      drop(x);
    }
  });
}
#endif

EXPORT acl_err aclrtGetMemInfo(int attr, size_t *free_bytes, size_t *total) {
  LOCKED("aclrtGetMemInfo", {
    if (current < 0) _e = fail("aclrtGetMemInfo", RT_CONTEXT_NULL, "no current device");
    else if (attr != 1) *free_bytes = *total = 0; /* only ACL_HBM_MEM exists on this device */
    else {
      *free_bytes = st.capacity - st.others - st.used;
      *total = st.capacity;
    }
  });
}

EXPORT acl_err aclrtSynchronizeDevice(void) { LOCKED("aclrtSynchronizeDevice", {}); }
EXPORT acl_err aclrtSynchronizeStream(void *s) { (void)s; LOCKED("aclrtSynchronizeStream", {}); }

/* ---- events and streams -------------------------------------------------------- */

EXPORT acl_err aclrtCreateEvent(void **ev) {
  LOCKED("aclrtCreateEvent", {
    *ev = calloc(1, sizeof(event));
    st.live_events++;
  });
}
#ifndef FAKE_NO_EVENT_EX /* CANN 8's events, re-recorded at will; -DFAKE_NO_EVENT_EX: an older runtime */
EXPORT acl_err aclrtCreateEventExWithFlag(void **ev, uint32_t flag) {
  (void)flag;
  LOCKED("aclrtCreateEventExWithFlag", {
    *ev = calloc(1, sizeof(event));
    st.live_events++;
  });
}
#endif
EXPORT acl_err aclrtRecordEvent(void *ev, void *stream) {
  LOCKED("aclrtRecordEvent", {
    if (!ev) _e = fail("aclrtRecordEvent", INVALID_PARAM, "no event");
    else *(event *)ev = (event){1, stream};
  });
}
EXPORT acl_err aclrtStreamWaitEvent(void *stream, void *ev) {
  (void)stream;
  LOCKED("aclrtStreamWaitEvent", {
    if (!ev || !((event *)ev)->recorded) _e = fail("aclrtStreamWaitEvent", INVALID_PARAM, "event not recorded");
  });
}
EXPORT acl_err aclrtDestroyEvent(void *ev) {
  LOCKED("aclrtDestroyEvent", {
    if (!ev) _e = fail("aclrtDestroyEvent", INVALID_PARAM, "no event");
    else {
      free(ev);
      st.live_events--;
    }
  });
}
EXPORT acl_err aclrtStreamQuery(void *stream, int *status) {
  LOCKED("aclrtStreamQuery", { *status = is_busy(stream); }); /* ACL_STREAM_STATUS_COMPLETE 0, NOT_READY 1 */
}

/* ---- virtual memory ------------------------------------------------------------ */

#ifndef FAKE_NO_VMM
static int good_prop(const acl_phys_prop *p) {
  return p && p->handle_type == 0 && p->allocation_type == 0 && (p->mem_attr == 4 || p->mem_attr == 13) &&
         p->location.type == 1 && (int)p->location.id < st.devices;
}

EXPORT acl_err aclrtMemGetAllocationGranularity(acl_phys_prop *prop, int option, size_t *g) {
  LOCKED("aclrtMemGetAllocationGranularity", {
    if (!good_prop(prop) || (option != 0 && option != 1)) _e = fail("aclrtMemGetAllocationGranularity", INVALID_PARAM, "bad prop");
    else *g = PAGE;
  });
}

EXPORT acl_err aclrtReserveMemAddress(void **ptr, size_t size, size_t alignment, void *expect, uint64_t flags) {
  LOCKED("aclrtReserveMemAddress", {
    if (!st.vmm) _e = fail("aclrtReserveMemAddress", RT_NOT_SUPPORT, "virtual memory is not supported on this device");
    else if (!size || size % PAGE || alignment || expect || flags > 1 || (st.flags_reserved && flags))
      _e = fail("aclrtReserveMemAddress", RT_PARAM_INVALID, "bad size, alignment, address or flags");
    else {
      char *p = fake_map(size + PAGE, PROT_NONE); /* page-aligned whichever way it came */
      uintptr_t a = ((uintptr_t)p + PAGE - 1) / PAGE * PAGE;
      if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
      munmap((void *)(a + size), (uintptr_t)p + size + PAGE - (a + size));
      add(a, size, RESERVED);
      *ptr = (void *)a;
    }
  });
}

EXPORT acl_err aclrtReleaseMemAddress(void *ptr) {
  LOCKED("aclrtReleaseMemAddress", {
    region *x = find((uintptr_t)ptr, RESERVED);
    if (!x || overlaps_mapping(x->addr, x->size))
      _e = fail("aclrtReleaseMemAddress", RT_PARAM_INVALID, "not a reservation, or still mapped");
    else {
      munmap(ptr, x->size);
      drop(x);
    }
  });
}

EXPORT acl_err aclrtMallocPhysical(void **handle, size_t size, const acl_phys_prop *prop, uint64_t flags) {
  LOCKED("aclrtMallocPhysical", {
    if (!good_prop(prop) || !size || size % PAGE || flags)
      _e = fail("aclrtMallocPhysical", INVALID_PARAM, "bad size, prop or flags");
    else if (!charge(size))
      _e = fail("aclrtMallocPhysical", RT_MEMORY_ALLOCATION, "out of device memory");
    else {
      phys *p = calloc(1, sizeof *p);
      p->size = size;
      st.live_phys++;
      st.last_device = (int)prop->location.id;
      *handle = p;
    }
  });
}

EXPORT acl_err aclrtFreePhysical(void *handle) {
  LOCKED("aclrtFreePhysical", {
    phys *p = handle;
    if (!p || p->mapped) _e = fail("aclrtFreePhysical", RT_INVALID_HANDLE, "no handle, or still mapped");
    else {
      st.used -= p->size;
      st.live_phys--;
      free(p);
    }
  });
}

EXPORT acl_err aclrtMapMem(void *ptr, size_t size, size_t offset, void *handle, uint64_t flags) {
  LOCKED("aclrtMapMem", {
    phys *p = handle;
    uintptr_t a = (uintptr_t)ptr;
    if (!p || p->mapped || offset || flags || size != p->size || a % PAGE || !inside(a, size, RESERVED, NULL) ||
        overlaps_mapping(a, size))
      _e = fail("aclrtMapMem", INVALID_PARAM, "bad address, size or handle");
    else {
      region *m = add(a, size, MAPPING);
      m->ph = p;
      p->mapped = 1;
      st.mapped += size;
      mprotect(ptr, size, PROT_READ | PROT_WRITE);
    }
  });
}

EXPORT acl_err aclrtUnmapMem(void *ptr) {
  LOCKED("aclrtUnmapMem", {
    region *x = find((uintptr_t)ptr, MAPPING);
    if (!x) _e = fail("aclrtUnmapMem", INVALID_PARAM, "not the start of a mapping");
    else {
      madvise(ptr, x->size, MADV_DONTNEED);
      mprotect(ptr, x->size, PROT_NONE);
      x->ph->mapped = 0;
      st.mapped -= x->size;
      drop(x);
    }
  });
}
#endif

/* ---- what runtime this is (the request-padding rule reads it) ----------------- */

EXPORT void fake_set_soc_name(const char *name) { snprintf(soc_name, sizeof soc_name, "%s", name ? name : ""); }
EXPORT void fake_set_cann_version(const char *v) { snprintf(cann_version, sizeof cann_version, "%s", v ? v : ""); }
EXPORT const char *aclrtGetSocName(void) { return soc_name; }
/* aclCANNPackageVersion: version, major, minor, release, patch, reserved */
typedef struct acl_pkg_version { char version[128]; char parts[4][64]; char reserved[128]; } acl_pkg_version;
EXPORT acl_err aclsysGetCANNVersion(int name, acl_pkg_version *v) {
  LOCKED("aclsysGetCANNVersion", {
    if (!v || name < 0 || name > 7) _e = fail("aclsysGetCANNVersion", INVALID_PARAM, "bad package or output");
    else if (!cann_version[0]) _e = fail("aclsysGetCANNVersion", RT_NOT_SUPPORT, "no version information");
    else {
      memset(v, 0, sizeof *v);
      snprintf(v->version, sizeof v->version, "%s", cann_version);
    }
  });
}
