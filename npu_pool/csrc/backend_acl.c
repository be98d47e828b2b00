/* backend_acl.c -- Ascend NPUs through the ACL runtime (libascendcl.so),
 * dlopen'ed at run time: nothing here is linked against CANN. ACL itself is
 * initialised by torch_npu (aclInit); this backend never calls aclInit.
 *
 * Plain allocation is aclrtMalloc with the huge-page-first policy. Virtual
 * memory (aclrtReserveMemAddress, aclrtMallocPhysical, aclrtMapMem,
 * aclrtUnmapMem, aclrtFreePhysical, aclrtReleaseMemAddress) is used when the
 * library exports all of it and a one-page reservation succeeds; otherwise
 * granularity is 0 and the arena makes one aclrtMalloc. The chunk calls work on one
 * physical chunk each, mapped and unmapped whole (aclrtUnmapMem unmaps whole mappings
 * only); the core's VMM layer (vmm.h) keeps the chunk table.
 *
 * Vendor rule: Ascend kernels may read or write up to 32 bytes past a tensor, so a request
 * is rounded up to 32 bytes and given 32 more -- under torch_npu's condition (AddPadSize in
 * NPUCachingAllocator.cpp): always, except on an Ascend950 SoC (aclrtGetSocName) with CANN
 * 9.1.0 or later (aclsysGetCANNVersion); an unknown SoC or version pads, as torch_npu does.
 *
 * Invariant: every vendor call runs with this backend's device current (the
 * caller's device is restored after, when it had one; page calls rely on the
 * VMM layer's enter/leave). free synchronises the device first, as cudaFree does
 * by itself; unmap does not: the policy unmaps only pages no queued work can
 * still use (after a synchronisation, or on streams stream_idle reports finished).
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dl.h"

#define ACL_PAD NP_NPU_PAD /* bytes Ascend kernels may touch past a tensor; requests round to it too */
#define ACL_PKG_NAME_CANN 0 /* aclCANNPackageName */

typedef int acl_err; /* aclError; 0 is ACL_SUCCESS */

/* Layouts of aclrtMemLocation and aclrtPhysicalMemProp in acl_rt.h. */
typedef struct acl_location { uint32_t id; int type; } acl_location;
/* aclCANNPackageVersion in acl_rt.h: version, then major, minor, release, patch, reserved. */
typedef struct acl_pkg_version { char version[128]; char parts[4][64]; char reserved[128]; } acl_pkg_version;
typedef struct acl_phys_prop {
  int handle_type;      /* ACL_MEM_HANDLE_TYPE_NONE */
  int allocation_type;  /* ACL_MEM_ALLOCATION_TYPE_PINNED */
  int mem_attr;         /* aclrtMemAttr */
  acl_location location;
  uint64_t reserve;
} acl_phys_prop;

enum {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_HBM_MEM = 1,
  ACL_HBM_MEM_HUGE = 4,
  ACL_MEM_LOCATION_TYPE_DEVICE = 1,
  ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  ACL_RESERVE_HUGE_PAGES = 1, /* aclrtReserveMemAddress flags: huge pages, like the physical memory */
  ACL_STREAM_STATUS_COMPLETE = 0,
  ACL_EVENT_SYNC = 1, /* aclrtCreateEventExWithFlag: an event streams wait on */
};

/* Error codes that get a name in messages; the allocation failures are OOM. */
static const struct { acl_err code; const char *name; } acl_errors[] = {
    {100000, "ACL_ERROR_INVALID_PARAM"},         {107000, "ACL_ERROR_RT_PARAM_INVALID"},
    {107001, "ACL_ERROR_RT_INVALID_DEVICEID"},   {107002, "ACL_ERROR_RT_CONTEXT_NULL"},
    {107017, "ACL_ERROR_RT_INVALID_HANDLE"},     {200000, "ACL_ERROR_BAD_ALLOC"},
    {207000, "ACL_ERROR_RT_FEATURE_NOT_SUPPORT"}, {207001, "ACL_ERROR_RT_MEMORY_ALLOCATION"},
    {207002, "ACL_ERROR_RT_MEMORY_FREE"},        {207004, "ACL_ERROR_RT_NO_DEVICE"},
    {507000, "ACL_ERROR_RT_INTERNAL_ERROR"},     {507899, "ACL_ERROR_RT_DRV_INTERNAL_ERROR"},
};
static bool is_oom(acl_err e) { return e == 207001 || e == 200000; }
static bool is_bad_param(acl_err e) { return e == 100000 || e == 107000; }

/* Function table; field names are the vendor symbols (see NP_DL_SYM). */
typedef struct acl_api {
  acl_err (*aclrtMalloc)(void **ptr, size_t size, int policy);
  acl_err (*aclrtFree)(void *ptr);
  acl_err (*aclrtGetMemInfo)(int attr, size_t *free_bytes, size_t *total);
  acl_err (*aclrtGetDevice)(int32_t *device);
  acl_err (*aclrtSetDevice)(int32_t device);
  acl_err (*aclrtSynchronizeDevice)(void);
  acl_err (*aclrtSynchronizeStream)(void *stream);
  const char *(*aclGetRecentErrMsg)(void);
  acl_err (*aclrtCreateEvent)(void **event);
  acl_err (*aclrtCreateEventExWithFlag)(void **event, uint32_t flag);
  acl_err (*aclrtRecordEvent)(void *event, void *stream);
  acl_err (*aclrtStreamWaitEvent)(void *stream, void *event);
  acl_err (*aclrtDestroyEvent)(void *event);
  acl_err (*aclrtStreamQuery)(void *stream, int *status);
  acl_err (*aclrtReserveMemAddress)(void **ptr, size_t size, size_t alignment, void *expect, uint64_t flags);
  acl_err (*aclrtReleaseMemAddress)(void *ptr);
  acl_err (*aclrtMallocPhysical)(void **handle, size_t size, const acl_phys_prop *prop, uint64_t flags);
  acl_err (*aclrtFreePhysical)(void *handle);
  acl_err (*aclrtMapMem)(void *ptr, size_t size, size_t offset, void *handle, uint64_t flags);
  acl_err (*aclrtUnmapMem)(void *ptr);
  acl_err (*aclrtMemGetAllocationGranularity)(acl_phys_prop *prop, int option, size_t *granularity);
  const char *(*aclrtGetSocName)(void);
  acl_err (*aclsysGetCANNVersion)(int name, acl_pkg_version *version);
  acl_err (*aclrtMemcpy)(void *dst, size_t dest_max, const void *src, size_t count, int kind);
  acl_err (*aclrtMallocHost)(void **ptr, size_t size);
  acl_err (*aclrtFreeHost)(void *ptr);
} acl_api;

#define SYM(fn, group) NP_DL_SYM(acl_api, fn, group)
static const np_dl_sym acl_syms[] = {
    SYM(aclrtMalloc, NP_DL_REQUIRED),
    SYM(aclrtFree, NP_DL_REQUIRED),
    SYM(aclrtGetMemInfo, NP_DL_REQUIRED),
    SYM(aclrtGetDevice, NP_DL_REQUIRED),
    SYM(aclrtSetDevice, NP_DL_REQUIRED),
    SYM(aclrtSynchronizeDevice, NP_DL_REQUIRED),
    SYM(aclrtSynchronizeStream, NP_DL_REQUIRED),
    SYM(aclGetRecentErrMsg, NP_DL_OPTIONAL),
    SYM(aclrtCreateEvent, NP_DL_OPTIONAL), /* stream ordering: all five, or no cross-stream reuse */
    SYM(aclrtRecordEvent, NP_DL_OPTIONAL),
    SYM(aclrtStreamWaitEvent, NP_DL_OPTIONAL),
    SYM(aclrtDestroyEvent, NP_DL_OPTIONAL),
    SYM(aclrtCreateEventExWithFlag, NP_DL_OPTIONAL), /* an event re-recorded for every wait (CANN 8) */
    SYM(aclrtStreamQuery, NP_DL_OPTIONAL),
    SYM(aclrtReserveMemAddress, NP_DL_VMM),
    SYM(aclrtReleaseMemAddress, NP_DL_VMM),
    SYM(aclrtMallocPhysical, NP_DL_VMM),
    SYM(aclrtFreePhysical, NP_DL_VMM),
    SYM(aclrtMapMem, NP_DL_VMM),
    SYM(aclrtUnmapMem, NP_DL_VMM),
    SYM(aclrtMemGetAllocationGranularity, NP_DL_OPTIONAL), /* 2 MiB when absent */
    SYM(aclrtGetSocName, NP_DL_OPTIONAL),                  /* the padding rule: unknown pads */
    SYM(aclsysGetCANNVersion, NP_DL_OPTIONAL),
    SYM(aclrtMemcpy, NP_DL_OPTIONAL), /* backups of paused tags: all three, or none */
    SYM(aclrtMallocHost, NP_DL_OPTIONAL),
    SYM(aclrtFreeHost, NP_DL_OPTIONAL),
};
#undef SYM

static const char *const acl_names[] = {"libascendcl.so", NULL};

/* Make a vendor call, counted by kind (NP_CALL_*) where it is made: the one place each call is. */
#define ACL(a, kind, call) ((a)->base.calls[NP_CALL_##kind]++, (a)->api.call)

typedef struct acl_backend {
  np_backend base;
  acl_api api;
  void *lib;
  int device;
  uint64_t reserve_flags; /* ACL_RESERVE_HUGE_PAGES, or 0 where the runtime wants the reserved 0 */
  acl_phys_prop prop;     /* physical pages: huge-page HBM of `device` */
  void *event;            /* stream_wait's event, made on first use where the runtime has
                           * aclrtCreateEventExWithFlag: a wait uses the event's last record before it
                           * (later records do not change it), so one event serves every wait */
  char name[192];         /* "acl", or "acl (no VMM: why)" */
} acl_backend;

/* ---- errors --------------------------------------------------------------- */

/* "acl: aclrtMapMem(0x...) on device 0 failed: error 207001 (ACL_ERROR_RT_MEMORY_ALLOCATION): <runtime's message>". */
static int acl_fail(acl_backend *a, const char *call, const char *args, acl_err e) {
  const char *name = "unknown aclError";
  for (size_t i = 0; i < sizeof acl_errors / sizeof *acl_errors; i++)
    if (acl_errors[i].code == e) name = acl_errors[i].name;
  char recent[1024] = "";
  const char *msg = a->api.aclGetRecentErrMsg ? a->api.aclGetRecentErrMsg() : NULL;
  if (msg) {
    np_format_text(recent, sizeof recent, ": %s", msg);
    for (char *p = recent; *p; p++)
      if (*p == '\n' || *p == '\r') *p = ' ';
  }
  return np_error(is_oom(e) ? NP_ERR_OOM : NP_ERR_BACKEND, "acl: %s(%s) on device %d failed: error %d (%s)%s", call,
                  args, a->device, e, name, recent);
}

static const char *addr_arg(uintptr_t addr, char *buf) {
  snprintf(buf, 32, "%#lx", (unsigned long)addr);
  return buf;
}

/* ---- device guard ---------------------------------------------------------- */

/* Make the backend's device current; *prev is the device to restore, or -1 when the thread
 * had none (it then keeps ours, as torch_npu's threads do). The thread's current device is
 * cached (np_device_cache_get, as torch_npu keeps it): no vendor call while it is ours. Calls
 * whose effect depends on which device is current and that a stale cache would misdirect
 * (malloc, free, synchronise, reserve, release: each rare, and a device call itself) pass
 * `check` and ask the runtime. */
static int enter_ex(acl_backend *a, int *prev, bool check) {
  int32_t cur = -1;
  *prev = -1;
  if (!check && np_device_cache_get() == a->device) return NP_OK;
  bool has = ACL(a, GET_DEVICE, aclrtGetDevice(&cur)) == 0;
  if (has && cur == a->device) {
    np_device_cache_set(cur);
    return NP_OK;
  }
  acl_err e = ACL(a, SET_DEVICE, aclrtSetDevice(a->device));
  if (e) {
    char s[16];
    np_device_cache_set(-1);
    snprintf(s, sizeof s, "%d", a->device);
    return acl_fail(a, "aclrtSetDevice", s, e);
  }
  np_device_cache_set(a->device);
  if (has) *prev = cur;
  return NP_OK;
}

static int enter(acl_backend *a, int *prev) { return enter_ex(a, prev, true); }

static void leave(acl_backend *a, int prev) {
  if (prev < 0) return;
  np_device_cache_set(ACL(a, SET_DEVICE, aclrtSetDevice(prev)) ? -1 : prev);
}

/* The chunk calls: the device is known current from the cache. */
static int acl_enter(np_backend *be, int *prev) { return enter_ex((acl_backend *)be, prev, false); }
static void acl_leave(np_backend *be, int prev) { leave((acl_backend *)be, prev); }

/* The framework's device synchronisation (torch_npu: its task queue emptied first), when bound;
 * and its handover between streams (an event through that queue; it returns the NP_HANDOVER_*
 * bits of the calls it made: pluggable.h). */
static int (*framework_sync)(void);
static int (*framework_wait)(int device, void *waiter, void *on);

void np_acl_set_framework_sync(int (*fn)(void)) { __atomic_store_n(&framework_sync, fn, __ATOMIC_RELEASE); }
void np_acl_set_framework_stream_wait(int (*fn)(int, void *, void *)) {
  __atomic_store_n(&framework_wait, fn, __ATOMIC_RELEASE);
}

static int sync_device(acl_backend *a) {
  int (*fw)(void) = __atomic_load_n(&framework_sync, __ATOMIC_ACQUIRE);
  if (fw) { /* (it calls aclrtSynchronizeDevice itself: one synchronisation, counted as ours) */
    a->base.calls[NP_CALL_SYNC_DEVICE]++;
    return fw() == 0 ? NP_OK : acl_fail(a, "npuSynchronizeDevice (torch_npu's task queue, then the device)", "", 1);
  }
  acl_err e = ACL(a, SYNC_DEVICE, aclrtSynchronizeDevice());
  return e ? acl_fail(a, "aclrtSynchronizeDevice", "", e) : NP_OK;
}

/* ---- plain allocation ------------------------------------------------------ */

static int acl_malloc(np_backend *be, uint64_t size, uintptr_t *out) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  void *p = NULL;
  acl_err e = ACL(a, MALLOC, aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST));
  if (e) {
    char s[32];
    rc = acl_fail(a, "aclrtMalloc", np_fmt_bytes(size, s), e);
  } else {
    *out = (uintptr_t)p;
  }
  leave(a, prev);
  return rc;
}

static int acl_free(np_backend *be, uintptr_t addr, uint64_t size) {
  acl_backend *a = (acl_backend *)be;
  (void)size;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  acl_err e = ACL(a, FREE, aclrtFree((void *)addr)); /* the caller synchronised the device (memory.c) */
  char s[32];
  if (e) rc = acl_fail(a, "aclrtFree", addr_arg(addr, s), e);
  leave(a, prev);
  return rc;
}

static int acl_synchronize(np_backend *be, intptr_t stream) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  if (stream == NP_STREAM_ANY) {
    rc = sync_device(a);
  } else {
    acl_err e = ACL(a, SYNC_STREAM, aclrtSynchronizeStream((void *)stream));
    char s[32];
    if (e) rc = acl_fail(a, "aclrtSynchronizeStream", addr_arg((uintptr_t)stream, s), e);
  }
  leave(a, prev);
  return rc;
}

/* Make `waiter` wait on the device for the work queued so far on `on`: record an event on `on`,
 * then the wait. With aclrtCreateEventExWithFlag one event is re-recorded for every wait (two
 * calls a wait); an older runtime's event is made and destroyed around each wait (four calls):
 * its documented re-use goes through aclrtResetEvent, whose rules changed across CANN versions. */
static int acl_stream_wait(np_backend *be, intptr_t waiter, intptr_t on) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter_ex(a, &prev, false); /* per request: the cached device */
  if (rc != NP_OK) return rc;
  if (__atomic_load_n(&framework_sync, __ATOMIC_ACQUIRE)) {
    /* inside torch_npu `on` may still have work queued on the host, which an event recorded here
     * would not follow: the framework records and waits its own event through that queue; where it
     * cannot (a stream it does not know, per-stream queues), its synchronisation orders the reuse */
    int (*fw)(int, void *, void *) = __atomic_load_n(&framework_wait, __ATOMIC_ACQUIRE);
    int made = fw ? fw(a->device, (void *)waiter, (void *)on) : 0;
    /* (its calls, counted as ours: it made them for the pool) */
    a->base.calls[NP_CALL_EVENT_CREATE] += (made & NP_HANDOVER_MADE) != 0;
    a->base.calls[NP_CALL_EVENT_RECORD] += (made & NP_HANDOVER_RECORDED) != 0;
    a->base.calls[NP_CALL_EVENT_WAIT] += (made & NP_HANDOVER_WAITED) != 0;
    if (!(made & NP_HANDOVER_ORDERED)) rc = sync_device(a);
    leave(a, prev);
    return rc;
  }
  bool reuse = a->api.aclrtCreateEventExWithFlag != NULL;
  void *ev = reuse ? a->event : NULL;
  const char *call = reuse ? "aclrtCreateEventExWithFlag" : "aclrtCreateEvent";
  acl_err e = 0;
  if (!ev) {
    e = reuse ? ACL(a, EVENT_CREATE, aclrtCreateEventExWithFlag(&ev, ACL_EVENT_SYNC)) : ACL(a, EVENT_CREATE, aclrtCreateEvent(&ev));
    if (e) ev = NULL;
    else if (reuse) a->event = ev;
  }
  if (!e && (e = ACL(a, EVENT_RECORD, aclrtRecordEvent(ev, (void *)on)))) call = "aclrtRecordEvent";
  else if (!e && (e = ACL(a, EVENT_WAIT, aclrtStreamWaitEvent((void *)waiter, ev)))) call = "aclrtStreamWaitEvent";
  if (e) {
    char s[64];
    snprintf(s, sizeof s, "waiter %#lx, on %#lx", (unsigned long)waiter, (unsigned long)on);
    rc = acl_fail(a, call, s, e);
  }
  if (ev && !reuse) ACL(a, EVENT_DESTROY, aclrtDestroyEvent(ev));
  leave(a, prev);
  return rc;
}

/* 1 if `stream` has finished everything queued on it; 0 if not, or on any error. Under a framework's
 * task queue (framework_sync bound) a stream the device has finished may still have work queued
 * on the host: never idle then, so that the caller synchronises (through the framework) instead. */
static int acl_stream_idle(np_backend *be, intptr_t stream) {
  acl_backend *a = (acl_backend *)be;
  if (__atomic_load_n(&framework_sync, __ATOMIC_ACQUIRE)) return 0;
  int prev, status = -1;
  if (enter_ex(a, &prev, false) != NP_OK) return 0;
  acl_err e = ACL(a, STREAM_QUERY, aclrtStreamQuery((void *)stream, &status));
  if (e && a->api.aclGetRecentErrMsg) a->api.aclGetRecentErrMsg(); /* drop the message */
  leave(a, prev);
  return !e && status == ACL_STREAM_STATUS_COMPLETE;
}

/* ---- virtual memory: one chunk per vendor call (the device is current) ------ */

static int page_create(np_backend *be, uint64_t size, uint64_t *handle) {
  acl_backend *a = (acl_backend *)be;
  void *h = NULL;
  acl_err e = ACL(a, PHYS_CREATE, aclrtMallocPhysical(&h, size, &a->prop, 0));
  char s[32];
  if (e) return acl_fail(a, "aclrtMallocPhysical", np_fmt_bytes(size, s), e);
  *handle = (uint64_t)(uintptr_t)h;
  return NP_OK;
}

static int page_release(np_backend *be, uint64_t handle, uint64_t size) {
  acl_backend *a = (acl_backend *)be;
  (void)size;
  acl_err e = ACL(a, PHYS_RELEASE, aclrtFreePhysical((void *)(uintptr_t)handle));
  return e ? acl_fail(a, "aclrtFreePhysical", "handle", e) : NP_OK;
}

static int page_map(np_backend *be, uintptr_t va, uint64_t size, uint64_t handle) {
  acl_backend *a = (acl_backend *)be;
  acl_err e = ACL(a, MAP, aclrtMapMem((void *)va, size, 0, (void *)(uintptr_t)handle, 0));
  char s[32];
  return e ? acl_fail(a, "aclrtMapMem", addr_arg(va, s), e) : NP_OK;
}

static int page_unmap(np_backend *be, uintptr_t va, uint64_t size) {
  acl_backend *a = (acl_backend *)be;
  (void)size; /* aclrtUnmapMem unmaps the whole mapping at va */
  acl_err e = ACL(a, UNMAP, aclrtUnmapMem((void *)va));
  char s[32];
  return e ? acl_fail(a, "aclrtUnmapMem", addr_arg(va, s), e) : NP_OK;
}

static int acl_reserve(np_backend *be, uint64_t size, uintptr_t *out) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  void *p = NULL;
  acl_err e = ACL(a, RESERVE, aclrtReserveMemAddress(&p, size, 0, NULL, a->reserve_flags));
  if (e) {
    char s[32];
    rc = acl_fail(a, "aclrtReserveMemAddress", np_fmt_bytes(size, s), e);
  } else {
    *out = (uintptr_t)p;
  }
  leave(a, prev);
  return rc;
}

static int acl_release(np_backend *be, uintptr_t addr, uint64_t size) {
  acl_backend *a = (acl_backend *)be;
  (void)size;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  acl_err e = ACL(a, RELEASE, aclrtReleaseMemAddress((void *)addr));
  char s[32];
  if (e) rc = acl_fail(a, "aclrtReleaseMemAddress", addr_arg(addr, s), e);
  leave(a, prev);
  return rc;
}

/* ---- request rule ----------------------------------------------------------- */

/* Whether torch_npu pads requests on this runtime: yes unless the SoC is an Ascend950 and the
 * CANN package is 9.1.0 or later (version "major.minor.patch...", compared number by number). */
static bool pads_requests(acl_backend *a) {
  const char *soc = a->api.aclrtGetSocName ? a->api.aclrtGetSocName() : NULL;
  if (!soc || strncmp(soc, "Ascend950", 9) != 0) return true;
  acl_pkg_version v;
  memset(&v, 0, sizeof v);
  if (!a->api.aclsysGetCANNVersion || a->api.aclsysGetCANNVersion(ACL_PKG_NAME_CANN, &v) != 0) {
    if (a->api.aclGetRecentErrMsg) a->api.aclGetRecentErrMsg(); /* drop the message */
    return true;
  }
  v.version[sizeof v.version - 1] = '\0';
  static const long want[3] = {9, 1, 0};
  const char *p = v.version;
  for (int i = 0; i < 3; i++) {
    if (*p < '0' || *p > '9') return true; /* "9.1.RC1" and the like: not a release at least 9.1.0 */
    char *end;
    long n = strtol(p, &end, 10);
    if (n != want[i]) return n < want[i];
    p = *end == '.' ? end + 1 : end;
  }
  return false;
}

/* ---- life cycle ------------------------------------------------------------ */

static int acl_destroy(np_backend *be) { /* the context returned its memory first */
  acl_backend *a = (acl_backend *)be;
  int rc = NP_OK, prev;
  if (a->event && (rc = enter_ex(a, &prev, false)) == NP_OK) { /* the event's device */
    acl_err e = ACL(a, EVENT_DESTROY, aclrtDestroyEvent(a->event));
    if (e) rc = acl_fail(a, "aclrtDestroyEvent", "the pool's cross-stream event", e);
    leave(a, prev);
  }
  np_dl_close(a->lib);
  free(a);
  return rc;
}

/* Decide whether the virtual-memory API works here; sets the granularity. */
static void probe_vmm(acl_backend *a, const np_config *cfg, const char *missing) {
  char why[128] = "";
  size_t gran = 2 * NP_MIB;
  acl_err e = 0;
  void *p = NULL;
  a->prop = (acl_phys_prop){.mem_attr = ACL_HBM_MEM_HUGE,
                            .location = {.id = (uint32_t)a->device, .type = ACL_MEM_LOCATION_TYPE_DEVICE}};
  a->reserve_flags = ACL_RESERVE_HUGE_PAGES;
  if (!cfg->vmm) snprintf(why, sizeof why, "disabled by the configuration");
  else if (missing[0]) snprintf(why, sizeof why, "the library has no %s", missing);
  else if (a->api.aclrtMemGetAllocationGranularity &&
           ((e = ACL(a, GRANULARITY, aclrtMemGetAllocationGranularity(&a->prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &gran))) ||
            gran == 0))
    snprintf(why, sizeof why, "aclrtMemGetAllocationGranularity failed with error %d", e);
  if (!why[0]) {
    e = ACL(a, RESERVE, aclrtReserveMemAddress(&p, gran, 0, NULL, a->reserve_flags));
    if (is_bad_param(e)) { /* runtimes where flags is reserved and must be 0 */
      a->reserve_flags = 0;
      e = ACL(a, RESERVE, aclrtReserveMemAddress(&p, gran, 0, NULL, 0));
    }
    if (e) snprintf(why, sizeof why, "the probe aclrtReserveMemAddress failed with error %d", e);
    else ACL(a, RELEASE, aclrtReleaseMemAddress(p));
  }
  if (a->api.aclGetRecentErrMsg && why[0]) a->api.aclGetRecentErrMsg(); /* drop the probe's message */
  if (why[0]) {
    snprintf(a->name, sizeof a->name, "acl (no VMM: %s)", why);
    return;
  }
  a->base.granularity = gran;
  a->base.reserve = acl_reserve;
  a->base.release = acl_release;
  a->base.page_create = page_create;
  a->base.page_release = page_release;
  a->base.page_map = page_map;
  a->base.page_unmap = page_unmap;
}

/* ---- copies for backups of paused tags ----------------------------------- */

enum { ACL_MEMCPY_HOST_TO_DEVICE = 1, ACL_MEMCPY_DEVICE_TO_HOST = 2 };

static int acl_copy(np_backend *be, void *dst, const void *src, uint64_t size, int to_device) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter_ex(a, &prev, false); /* one per backed-up block: pause and resume look the device up first */
  if (rc != NP_OK) return rc;
  acl_err e = a->api.aclrtMemcpy(dst, size, src, size, to_device ? ACL_MEMCPY_HOST_TO_DEVICE : ACL_MEMCPY_DEVICE_TO_HOST);
  char s[32];
  if (e) rc = acl_fail(a, "aclrtMemcpy", np_fmt_bytes(size, s), e);
  leave(a, prev);
  return rc;
}

/* The device's free and total HBM bytes (the device current); the error names the call. */
static int mem_info(acl_backend *a, size_t *free_bytes, size_t *total) {
  acl_err e = ACL(a, MEM_INFO, aclrtGetMemInfo(ACL_HBM_MEM, free_bytes, total));
  return e ? acl_fail(a, "aclrtGetMemInfo", "ACL_HBM_MEM", e) : NP_OK;
}

static int acl_free_bytes(np_backend *be, uint64_t *out) {
  acl_backend *a = (acl_backend *)be;
  int prev, rc = enter(a, &prev);
  if (rc != NP_OK) return rc;
  size_t free_bytes = 0, total = 0;
  rc = mem_info(a, &free_bytes, &total);
  leave(a, prev);
  *out = free_bytes;
  return rc;
}

static int acl_host_alloc(np_backend *be, uint64_t size, void **out) {
  acl_backend *a = (acl_backend *)be;
  acl_err e = a->api.aclrtMallocHost(out, size);
  char s[32];
  return e ? acl_fail(a, "aclrtMallocHost", np_fmt_bytes(size, s), e) : NP_OK;
}

static void acl_host_free(np_backend *be, void *p) { ((acl_backend *)be)->api.aclrtFreeHost(p); }

/* Load the runtime (lib_path, else the default names) and bind its symbols into a->api; no
 * device call. The virtual-memory symbols a runtime lacks are named in `missing`. */
static int acl_open(acl_backend *a, const char *lib_path, char *missing, size_t len) {
  char where[PATH_MAX], libname[PATH_MAX + 8];
  a->lib = np_dl_open(lib_path, acl_names, "the Ascend runtime (libascendcl.so; source CANN's set_env.sh)");
  if (!a->lib) return np_last_code();
  snprintf(libname, sizeof libname, "acl: %s", np_dl_path(a->lib, where, sizeof where));
  return np_dl_bind(a->lib, libname, acl_syms, sizeof acl_syms / sizeof *acl_syms, &a->api, missing, len);
}

int np_backend_acl_load(const char *lib_path) {
  acl_backend *a = calloc(1, sizeof *a);
  if (!a) return np_error(NP_ERR_HOST, "acl: host out of memory");
  char missing[64];
  int rc = acl_open(a, lib_path, missing, sizeof missing);
  if (rc != NP_OK) np_dl_close(a->lib); /* else it stays loaded: the first context opens it again */
  free(a);
  return rc;
}

np_backend *np_backend_acl_create(const np_config *cfg) {
  if (cfg->device < 0) {
    np_error(NP_ERR_INVALID, "acl: device index must be >= 0, got %d", cfg->device);
    return NULL;
  }
  acl_backend *a = calloc(1, sizeof *a);
  if (!a) {
    np_error(NP_ERR_HOST, "acl: host out of memory");
    return NULL;
  }
  a->device = cfg->device;
  snprintf(a->name, sizeof a->name, "acl");
  a->base = (np_backend){.name = a->name, .request_align = ACL_PAD, .request_tail = ACL_PAD,
                         .malloc = acl_malloc, .free = acl_free, .enter = acl_enter, .leave = acl_leave,
                         .synchronize = acl_synchronize, .destroy = acl_destroy, .free_bytes = acl_free_bytes};
  char missing[64] = "";
  if (acl_open(a, cfg->lib_path, missing, sizeof missing) != NP_OK) goto fail;
  int prev;
  if (enter(a, &prev) != NP_OK) goto fail;
  size_t free_bytes = 0, total = 0;
  int info = mem_info(a, &free_bytes, &total);
  if (info != NP_OK || total == 0) {
    if (info == NP_OK) np_error(NP_ERR_BACKEND, "acl: aclrtGetMemInfo reports 0 bytes of HBM on device %d", a->device);
    leave(a, prev);
    goto fail;
  }
  a->base.total = total;
  if (a->api.aclrtCreateEvent && a->api.aclrtRecordEvent && a->api.aclrtStreamWaitEvent && a->api.aclrtDestroyEvent &&
      a->api.aclrtStreamQuery) {
    a->base.stream_wait = acl_stream_wait;
    a->base.stream_idle = acl_stream_idle;
  }
  if (!pads_requests(a)) a->base.request_align = a->base.request_tail = 0;
  if (a->api.aclrtMemcpy && a->api.aclrtMallocHost && a->api.aclrtFreeHost) {
    a->base.copy = acl_copy;
    a->base.host_alloc = acl_host_alloc;
    a->base.host_free = acl_host_free;
  }
  probe_vmm(a, cfg, missing);
  leave(a, prev);
  return &a->base;
fail:
  np_dl_close(a->lib);
  free(a);
  return NULL;
}
