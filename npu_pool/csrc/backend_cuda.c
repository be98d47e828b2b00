/* backend_cuda.c -- NVIDIA GPUs through the CUDA runtime (libcudart) for plain
 * allocation and the driver (libcuda) for virtual memory, both dlopen'ed at run
 * time: nothing here is linked against CUDA.
 *
 * np_config.lib_path is "RUNTIME[:DRIVER]": one path serves both (the test
 * fakes export both APIs); "RUNTIME:" loads the default driver.
 *
 * Virtual memory (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess,
 * cuMemUnmap, cuMemRelease, cuMemAddressFree) is used when the driver exports
 * all of it and a probe succeeds (device attribute, granularity, a one-page
 * reservation); otherwise granularity is 0 and the arena makes one cudaMalloc.
 * The chunk calls work on one physical chunk (a multiple of the granularity) each; the
 * core's VMM layer (vmm.h) keeps the chunk table.
 *
 * Invariant: every vendor call runs with this backend's device current and the
 * caller's device is restored after (page calls rely on the VMM layer's enter/leave). cudaFree synchronises the device by itself;
 * unmap does not: the policy unmaps only pages no queued work can still use
 * (after a synchronisation, or on streams stream_idle reports finished).
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dl.h"

typedef int cu_err;                    /* cudaError_t and CUresult; 0 is success in both */
typedef unsigned long long cu_ptr;     /* CUdeviceptr */
typedef unsigned long long cu_handle;  /* CUmemGenericAllocationHandle */

/* Layouts of CUmemLocation, CUmemAllocationProp (v1) and CUmemAccessDesc in cuda.h. */
typedef struct cu_location { int type; int id; } cu_location;
typedef struct cu_alloc_prop {
  int type;
  int requested_handle_types;
  cu_location location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} cu_alloc_prop;
typedef struct cu_access_desc { cu_location location; int flags; } cu_access_desc;

enum {
  CUDA_ERR_OOM = 2, /* cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY */
  CUDA_EVENT_DISABLE_TIMING = 2,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
};

/* Function table; field names are the vendor symbols (see NP_DL_SYM). */
typedef struct cuda_api {
  cu_err (*cudaMalloc)(void **ptr, size_t size);
  cu_err (*cudaFree)(void *ptr);
  cu_err (*cudaMemGetInfo)(size_t *free_bytes, size_t *total);
  cu_err (*cudaGetDevice)(int *device);
  cu_err (*cudaSetDevice)(int device);
  cu_err (*cudaDeviceSynchronize)(void);
  cu_err (*cudaStreamSynchronize)(void *stream);
  const char *(*cudaGetErrorName)(cu_err e);
  const char *(*cudaGetErrorString)(cu_err e);
  cu_err (*cudaGetLastError)(void);
  cu_err (*cudaEventCreateWithFlags)(void **event, unsigned flags);
  cu_err (*cudaEventRecord)(void *event, void *stream);
  cu_err (*cudaStreamWaitEvent)(void *stream, void *event, unsigned flags);
  cu_err (*cudaEventDestroy)(void *event);
  cu_err (*cudaStreamQuery)(void *stream);
  cu_err (*cudaMemcpy)(void *dst, const void *src, size_t count, int kind);
  cu_err (*cudaMallocHost)(void **ptr, size_t size);
  cu_err (*cudaFreeHost)(void *ptr);
  cu_err (*cuInit)(unsigned flags);
  cu_err (*cuDeviceGet)(int *dev, int ordinal);
  cu_err (*cuDeviceGetAttribute)(int *value, int attribute, int dev);
  cu_err (*cuMemGetAllocationGranularity)(size_t *granularity, const cu_alloc_prop *prop, int option);
  cu_err (*cuMemAddressReserve)(cu_ptr *ptr, size_t size, size_t alignment, cu_ptr addr, unsigned long long flags);
  cu_err (*cuMemAddressFree)(cu_ptr ptr, size_t size);
  cu_err (*cuMemCreate)(cu_handle *handle, size_t size, const cu_alloc_prop *prop, unsigned long long flags);
  cu_err (*cuMemRelease)(cu_handle handle);
  cu_err (*cuMemMap)(cu_ptr ptr, size_t size, size_t offset, cu_handle handle, unsigned long long flags);
  cu_err (*cuMemUnmap)(cu_ptr ptr, size_t size);
  cu_err (*cuMemSetAccess)(cu_ptr ptr, size_t size, const cu_access_desc *desc, size_t count);
  cu_err (*cuGetErrorName)(cu_err e, const char **name);
  cu_err (*cuGetErrorString)(cu_err e, const char **text);
} cuda_api;

#define RT(fn, group) NP_DL_SYM(cuda_api, fn, group)
static const np_dl_sym runtime_syms[] = {
    RT(cudaMalloc, NP_DL_REQUIRED),         RT(cudaFree, NP_DL_REQUIRED),
    RT(cudaMemGetInfo, NP_DL_REQUIRED),     RT(cudaGetDevice, NP_DL_REQUIRED),
    RT(cudaSetDevice, NP_DL_REQUIRED),      RT(cudaDeviceSynchronize, NP_DL_REQUIRED),
    RT(cudaStreamSynchronize, NP_DL_REQUIRED), RT(cudaGetErrorName, NP_DL_OPTIONAL),
    RT(cudaGetErrorString, NP_DL_OPTIONAL), RT(cudaGetLastError, NP_DL_OPTIONAL),
    /* stream ordering (all five, or no cross-stream reuse) */
    RT(cudaEventCreateWithFlags, NP_DL_OPTIONAL), RT(cudaEventRecord, NP_DL_OPTIONAL),
    RT(cudaStreamWaitEvent, NP_DL_OPTIONAL), RT(cudaEventDestroy, NP_DL_OPTIONAL),
    RT(cudaStreamQuery, NP_DL_OPTIONAL),
    /* backups of paused tags (all three, or none) */
    RT(cudaMemcpy, NP_DL_OPTIONAL), RT(cudaMallocHost, NP_DL_OPTIONAL), RT(cudaFreeHost, NP_DL_OPTIONAL),
};
static const np_dl_sym driver_syms[] = {
    RT(cuInit, NP_DL_VMM),
    RT(cuDeviceGet, NP_DL_VMM),
    RT(cuMemGetAllocationGranularity, NP_DL_VMM),
    RT(cuMemAddressReserve, NP_DL_VMM),
    RT(cuMemAddressFree, NP_DL_VMM),
    RT(cuMemCreate, NP_DL_VMM),
    RT(cuMemRelease, NP_DL_VMM),
    RT(cuMemMap, NP_DL_VMM),
    RT(cuMemUnmap, NP_DL_VMM),
    RT(cuMemSetAccess, NP_DL_VMM),
    RT(cuDeviceGetAttribute, NP_DL_OPTIONAL),
    RT(cuGetErrorName, NP_DL_OPTIONAL),
    RT(cuGetErrorString, NP_DL_OPTIONAL),
};
#undef RT

static const char *const runtime_names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                            "libcudart.so.11.0", NULL};
static const char *const driver_names[] = {"libcuda.so.1", "libcuda.so", NULL};

typedef struct cuda_backend {
  np_backend base;
  cuda_api api;
  void *runtime, *driver;
  int device;
  void *event;          /* cudaEvent_t for stream_wait, created on first use (re-recording is safe) */
  cu_alloc_prop prop;   /* physical pages: pinned device memory of `device` */
  char name[192];       /* "cuda", or "cuda (no VMM: why)" */
} cuda_backend;

/* ---- errors --------------------------------------------------------------- */

/* Runtime failure, e.g. "cuda: cudaMalloc(2.00 GiB) on device 0 failed: error 2
 * (cudaErrorMemoryAllocation: out of memory)". */
static int rt_fail(cuda_backend *c, const char *call, const char *args, cu_err e) {
  const char *name = c->api.cudaGetErrorName ? c->api.cudaGetErrorName(e) : NULL;
  const char *text = c->api.cudaGetErrorString ? c->api.cudaGetErrorString(e) : NULL;
  if (e == CUDA_ERR_OOM && c->api.cudaGetLastError) c->api.cudaGetLastError(); /* clear it: OOM is recoverable */
  return np_error(e == CUDA_ERR_OOM ? NP_ERR_OOM : NP_ERR_BACKEND,
                  "cuda: %s(%s) on device %d failed: error %d (%s: %s)", call, args, c->device, e,
                  name ? name : "?", text ? text : "no description");
}

/* Driver failure, same shape with the CUresult's name and description. */
static int cu_fail(cuda_backend *c, const char *call, const char *args, cu_err e) {
  const char *name = NULL, *text = NULL;
  if (c->api.cuGetErrorName) c->api.cuGetErrorName(e, &name);
  if (c->api.cuGetErrorString) c->api.cuGetErrorString(e, &text);
  return np_error(e == CUDA_ERR_OOM ? NP_ERR_OOM : NP_ERR_BACKEND,
                  "cuda: %s(%s) on device %d failed: error %d (%s: %s)", call, args, c->device, e,
                  name ? name : "?", text ? text : "no description");
}

static const char *bytes_arg(uint64_t size, char *buf) { return np_fmt_bytes(size, buf); }

static const char *addr_arg(uintptr_t addr, char *buf) {
  snprintf(buf, 32, "%#lx", (unsigned long)addr);
  return buf;
}

/* Make a vendor call, counted by kind (NP_CALL_*) where it is made. */
#define CU(c, kind, call) ((c)->base.calls[NP_CALL_##kind]++, (c)->api.call)

/* ---- device guard ---------------------------------------------------------- */

/* Make the backend's device current; *prev is the device to restore, or -1. The thread's
 * current device is cached (np_device_cache_get); `check` asks the runtime anyway (the calls
 * a stale cache would misdirect: malloc, free, synchronise, reserve, release). */
static int enter_ex(cuda_backend *c, int *prev, bool check) {
  int cur = -1;
  *prev = -1;
  if (!check && np_device_cache_get() == c->device) return NP_OK;
  if (CU(c, GET_DEVICE, cudaGetDevice(&cur)) == 0 && cur == c->device) {
    np_device_cache_set(cur);
    return NP_OK;
  }
  cu_err e = CU(c, SET_DEVICE, cudaSetDevice(c->device));
  if (e) {
    char a[16];
    np_device_cache_set(-1);
    snprintf(a, sizeof a, "%d", c->device);
    return rt_fail(c, "cudaSetDevice", a, e);
  }
  np_device_cache_set(c->device);
  *prev = cur;
  return NP_OK;
}

static int enter(cuda_backend *c, int *prev) { return enter_ex(c, prev, true); }

static void leave(cuda_backend *c, int prev) {
  if (prev >= 0) np_device_cache_set(CU(c, SET_DEVICE, cudaSetDevice(prev)) ? -1 : prev);
}

static int cuda_enter(np_backend *be, int *prev) { return enter_ex((cuda_backend *)be, prev, false); }
static void cuda_leave(np_backend *be, int prev) { leave((cuda_backend *)be, prev); }

/* ---- plain allocation ------------------------------------------------------ */

static int cuda_malloc(np_backend *be, uint64_t size, uintptr_t *out) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  void *p = NULL;
  cu_err e = CU(c, MALLOC, cudaMalloc(&p, size));
  if (e) {
    char a[32];
    rc = rt_fail(c, "cudaMalloc", bytes_arg(size, a), e);
  } else {
    *out = (uintptr_t)p;
  }
  leave(c, prev);
  return rc;
}

static int cuda_free(np_backend *be, uintptr_t addr, uint64_t size) {
  cuda_backend *c = (cuda_backend *)be;
  (void)size;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  cu_err e = CU(c, FREE, cudaFree((void *)addr)); /* synchronises the device first */
  char a[32];
  if (e) rc = rt_fail(c, "cudaFree", addr_arg(addr, a), e);
  leave(c, prev);
  return rc;
}

/* ---- copies for backups of paused tags ------------------------------------ */

enum { CUDA_MEMCPY_HOST_TO_DEVICE = 1, CUDA_MEMCPY_DEVICE_TO_HOST = 2 };

static int cuda_copy(np_backend *be, void *dst, const void *src, uint64_t size, int to_device) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter_ex(c, &prev, false); /* one per backed-up block: pause and resume look the device up first */
  if (rc != NP_OK) return rc;
  cu_err e = c->api.cudaMemcpy(dst, src, size, to_device ? CUDA_MEMCPY_HOST_TO_DEVICE : CUDA_MEMCPY_DEVICE_TO_HOST);
  char a[32];
  if (e) rc = rt_fail(c, "cudaMemcpy", bytes_arg(size, a), e);
  leave(c, prev);
  return rc;
}

static int cuda_host_alloc(np_backend *be, uint64_t size, void **out) {
  cuda_backend *c = (cuda_backend *)be;
  cu_err e = c->api.cudaMallocHost(out, size);
  char a[32];
  return e ? rt_fail(c, "cudaMallocHost", bytes_arg(size, a), e) : NP_OK;
}

static void cuda_host_free(np_backend *be, void *p) { ((cuda_backend *)be)->api.cudaFreeHost(p); }

/* The device's free and total bytes (the device current); the error names the call. */
static int mem_info(cuda_backend *c, size_t *free_bytes, size_t *total) {
  cu_err e = CU(c, MEM_INFO, cudaMemGetInfo(free_bytes, total));
  return e ? rt_fail(c, "cudaMemGetInfo", "", e) : NP_OK;
}

static int cuda_free_bytes(np_backend *be, uint64_t *out) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  size_t free_bytes = 0, total = 0;
  rc = mem_info(c, &free_bytes, &total);
  leave(c, prev);
  *out = free_bytes;
  return rc;
}

static int cuda_synchronize(np_backend *be, intptr_t stream) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  if (stream == NP_STREAM_ANY) {
    cu_err e = CU(c, SYNC_DEVICE, cudaDeviceSynchronize());
    if (e) rc = rt_fail(c, "cudaDeviceSynchronize", "", e);
  } else {
    cu_err e = CU(c, SYNC_STREAM, cudaStreamSynchronize((void *)stream));
    char a[32];
    if (e) rc = rt_fail(c, "cudaStreamSynchronize", addr_arg((uintptr_t)stream, a), e);
  }
  leave(c, prev);
  return rc;
}

/* Make `waiter` wait on the device for the work queued so far on `on`. */
static int cuda_stream_wait(np_backend *be, intptr_t waiter, intptr_t on) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter_ex(c, &prev, false); /* per request: the cached device */
  if (rc != NP_OK) return rc;
  const char *call = "cudaEventCreateWithFlags";
  cu_err e = 0;
  if (!c->event && (e = CU(c, EVENT_CREATE, cudaEventCreateWithFlags(&c->event, CUDA_EVENT_DISABLE_TIMING)))) c->event = NULL;
  if (!e && (e = CU(c, EVENT_RECORD, cudaEventRecord(c->event, (void *)on)))) call = "cudaEventRecord";
  else if (!e && (e = CU(c, EVENT_WAIT, cudaStreamWaitEvent((void *)waiter, c->event, 0)))) call = "cudaStreamWaitEvent";
  if (e) {
    char a[64];
    snprintf(a, sizeof a, "waiter %#lx, on %#lx", (unsigned long)waiter, (unsigned long)on);
    rc = rt_fail(c, call, a, e);
  }
  leave(c, prev);
  return rc;
}

/* 1 if `stream` has finished everything queued on it; 0 if not, or on any error. */
static int cuda_stream_idle(np_backend *be, intptr_t stream) {
  cuda_backend *c = (cuda_backend *)be;
  int prev;
  if (enter_ex(c, &prev, false) != NP_OK) return 0;
  cu_err e = CU(c, STREAM_QUERY, cudaStreamQuery((void *)stream));
  if (e && c->api.cudaGetLastError) c->api.cudaGetLastError(); /* cudaErrorNotReady is no failure */
  leave(c, prev);
  return e == 0;
}

/* ---- virtual memory: one chunk per vendor call (the device is current) ------ */

static int page_create(np_backend *be, uint64_t size, uint64_t *handle) {
  cuda_backend *c = (cuda_backend *)be;
  cu_handle h = 0;
  cu_err e = CU(c, PHYS_CREATE, cuMemCreate(&h, size, &c->prop, 0));
  char a[32];
  if (e) return cu_fail(c, "cuMemCreate", bytes_arg(size, a), e);
  *handle = h;
  return NP_OK;
}

static int page_release(np_backend *be, uint64_t handle, uint64_t size) {
  cuda_backend *c = (cuda_backend *)be;
  (void)size;
  cu_err e = CU(c, PHYS_RELEASE, cuMemRelease(handle));
  return e ? cu_fail(c, "cuMemRelease", "handle", e) : NP_OK;
}

static int page_map(np_backend *be, uintptr_t va, uint64_t size, uint64_t handle) {
  cuda_backend *c = (cuda_backend *)be;
  cu_err e = CU(c, MAP, cuMemMap(va, size, 0, handle, 0));
  char a[32];
  return e ? cu_fail(c, "cuMemMap", addr_arg(va, a), e) : NP_OK;
}

static int page_unmap(np_backend *be, uintptr_t va, uint64_t size) {
  cuda_backend *c = (cuda_backend *)be;
  cu_err e = CU(c, UNMAP, cuMemUnmap(va, size));
  char a[32];
  return e ? cu_fail(c, "cuMemUnmap", addr_arg(va, a), e) : NP_OK;
}

static int page_access(np_backend *be, uintptr_t va, uint64_t size) {
  cuda_backend *c = (cuda_backend *)be;
  cu_access_desc d = {.location = c->prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  cu_err e = CU(c, SET_ACCESS, cuMemSetAccess(va, size, &d, 1));
  if (!e) return NP_OK;
  char a[64], b[32];
  snprintf(a, sizeof a, "%#lx, %s", (unsigned long)va, np_fmt_bytes(size, b));
  return cu_fail(c, "cuMemSetAccess", a, e);
}

static int cuda_reserve(np_backend *be, uint64_t size, uintptr_t *out) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  cu_ptr p = 0;
  cu_err e = CU(c, RESERVE, cuMemAddressReserve(&p, size, 0, 0, 0));
  if (e) {
    char a[32];
    rc = cu_fail(c, "cuMemAddressReserve", bytes_arg(size, a), e);
  } else {
    *out = p;
  }
  leave(c, prev);
  return rc;
}

static int cuda_release(np_backend *be, uintptr_t addr, uint64_t size) {
  cuda_backend *c = (cuda_backend *)be;
  int prev, rc = enter(c, &prev);
  if (rc != NP_OK) return rc;
  cu_err e = CU(c, RELEASE, cuMemAddressFree(addr, size));
  char a[32];
  if (e) rc = cu_fail(c, "cuMemAddressFree", bytes_arg(size, a), e);
  leave(c, prev);
  return rc;
}

/* ---- life cycle ------------------------------------------------------------ */

static int cuda_destroy(np_backend *be) { /* the context returned its memory first */
  cuda_backend *c = (cuda_backend *)be;
  int rc = NP_OK;
  cu_err e = c->event ? CU(c, EVENT_DESTROY, cudaEventDestroy(c->event)) : 0;
  if (e) rc = rt_fail(c, "cudaEventDestroy", "the pool's cross-stream event", e);
  np_dl_close(c->driver);
  np_dl_close(c->runtime);
  free(c);
  return rc;
}

/* Decide whether the driver's virtual-memory API works here; sets the granularity. */
static void probe_vmm(cuda_backend *c, const np_config *cfg, const char *missing) {
  char why[128] = "";
  int dev = 0, supported = 1;
  size_t gran = 0;
  cu_ptr p = 0;
  cu_err e;
  if (!cfg->vmm) snprintf(why, sizeof why, "disabled by the configuration");
  else if (!c->driver) snprintf(why, sizeof why, "the driver library (libcuda) could not be loaded");
  else if (missing[0]) snprintf(why, sizeof why, "the driver library has no %s", missing);
  else if ((e = c->api.cuInit(0))) snprintf(why, sizeof why, "cuInit failed with error %d", e);
  else if ((e = c->api.cuDeviceGet(&dev, c->device))) snprintf(why, sizeof why, "cuDeviceGet failed with error %d", e);
  else if (c->api.cuDeviceGetAttribute &&
           c->api.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) == 0 &&
           !supported)
    snprintf(why, sizeof why, "the device does not support virtual memory management");
  if (!why[0]) {
    c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->prop.location.id = dev;
    if ((e = CU(c, GRANULARITY, cuMemGetAllocationGranularity(&gran, &c->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM))) || gran == 0)
      snprintf(why, sizeof why, "cuMemGetAllocationGranularity failed with error %d", e);
    else if ((e = CU(c, RESERVE, cuMemAddressReserve(&p, gran, 0, 0, 0))))
      snprintf(why, sizeof why, "the probe cuMemAddressReserve failed with error %d", e);
    else
      CU(c, RELEASE, cuMemAddressFree(p, gran));
  }
  if (why[0]) {
    snprintf(c->name, sizeof c->name, "cuda (no VMM: %s)", why);
    return;
  }
  c->base.granularity = gran;
  c->base.reserve = cuda_reserve;
  c->base.release = cuda_release;
  c->base.page_create = page_create;
  c->base.page_release = page_release;
  c->base.page_map = page_map;
  c->base.page_unmap = page_unmap;
  c->base.page_access = page_access;
}

/* Split "RUNTIME[:DRIVER]"; the driver is NULL for the default, "" for the runtime's own file. A path
 * the buffers (len bytes) cannot hold is refused: cut, it would name another file. */
static int split_paths(const char *lib_path, char *runtime, char *driver, size_t len, const char **rt,
                       const char **drv) {
  *rt = *drv = NULL;
  if (!lib_path || !*lib_path) return NP_OK;
  const char *colon = strchr(lib_path, ':');
  size_t n = colon ? (size_t)(colon - lib_path) : strlen(lib_path);
  if (n >= len)
    return np_error(NP_ERR_INVALID, "cannot load the CUDA runtime: lib_path%s is %zu bytes, longer than the %zu a "
                    "path may have", colon ? "'s runtime part (before ':')" : "", n, len - 1);
  if (colon && strlen(colon + 1) >= len)
    return np_error(NP_ERR_INVALID, "cannot load the CUDA driver: lib_path's driver part (after ':') is %zu bytes, "
                    "longer than the %zu a path may have", strlen(colon + 1), len - 1);
  snprintf(runtime, len, "%.*s", (int)n, lib_path);
  *rt = runtime;
  if (!colon) {
    snprintf(driver, len, "%s", runtime);
    *drv = driver;
  } else if (colon[1]) {
    snprintf(driver, len, "%s", colon + 1);
    *drv = driver;
  }
  return NP_OK;
}

/* Load the runtime and the driver ("RUNTIME:DRIVER" in lib_path, else the default names) and
 * bind their symbols into c->api; no device call. Without a driver the virtual-memory symbols
 * stay unbound (a fixed arena); those a driver lacks are named in `missing`. */
static int cuda_open(cuda_backend *c, const char *lib_path, char *missing, size_t len) {
  char rt_buf[PATH_MAX], drv_buf[PATH_MAX], where[PATH_MAX], libname[PATH_MAX + 8];
  const char *rt_path, *drv_path;
  int rc = split_paths(lib_path, rt_buf, drv_buf, sizeof rt_buf, &rt_path, &drv_path);
  if (rc != NP_OK) return rc;
  c->runtime = np_dl_open(rt_path, runtime_names, "the CUDA runtime (libcudart)");
  if (!c->runtime) return np_last_code();
  snprintf(libname, sizeof libname, "cuda: %s", np_dl_path(c->runtime, where, sizeof where));
  rc = np_dl_bind(c->runtime, libname, runtime_syms, sizeof runtime_syms / sizeof *runtime_syms, &c->api, NULL, 0);
  if (rc != NP_OK) return rc;
  c->driver = np_dl_open(drv_path, driver_names, "the CUDA driver (libcuda)");
  const char *colon = lib_path ? strchr(lib_path, ':') : NULL;
  if (!c->driver && colon && colon[1]) return np_last_code(); /* named by the caller: not a quiet fixed arena */
  if (c->driver)
    np_dl_bind(c->driver, "libcuda", driver_syms, sizeof driver_syms / sizeof *driver_syms, &c->api, missing, len);
  return NP_OK;
}

int np_backend_cuda_load(const char *lib_path) {
  cuda_backend *c = calloc(1, sizeof *c);
  if (!c) return np_error(NP_ERR_HOST, "cuda: host out of memory");
  char missing[64];
  int rc = cuda_open(c, lib_path, missing, sizeof missing);
  if (rc != NP_OK) { /* else they stay loaded: the first context opens them again */
    np_dl_close(c->runtime);
    np_dl_close(c->driver);
  }
  free(c);
  return rc;
}

np_backend *np_backend_cuda_create(const np_config *cfg) {
  if (cfg->device < 0) {
    np_error(NP_ERR_INVALID, "cuda: device index must be >= 0, got %d", cfg->device);
    return NULL;
  }
  cuda_backend *c = calloc(1, sizeof *c);
  if (!c) {
    np_error(NP_ERR_HOST, "cuda: host out of memory");
    return NULL;
  }
  c->device = cfg->device;
  snprintf(c->name, sizeof c->name, "cuda");
  c->base = (np_backend){.name = c->name, .malloc = cuda_malloc, .free = cuda_free, .enter = cuda_enter,
                         .leave = cuda_leave, .synchronize = cuda_synchronize, .destroy = cuda_destroy,
                         .free_bytes = cuda_free_bytes,
                         .free_synchronizes = true};
  char missing[64] = "";
  if (cuda_open(c, cfg->lib_path, missing, sizeof missing) != NP_OK) goto fail;

  int prev;
  if (enter(c, &prev) != NP_OK) goto fail;
  size_t free_bytes = 0, total = 0;
  /* (creates the device's primary context if needed, as cudaFree(NULL) would: no free is counted
   * where nothing is freed, and torch.cuda.memory_stats()'s num_device_free stays the segments') */
  if (mem_info(c, &free_bytes, &total) != NP_OK) {
    leave(c, prev);
    goto fail;
  }
  if (total == 0) {
    np_error(NP_ERR_BACKEND, "cuda: cudaMemGetInfo reports 0 bytes of memory on device %d", c->device);
    leave(c, prev);
    goto fail;
  }
  c->base.total = total;
  if (c->api.cudaEventCreateWithFlags && c->api.cudaEventRecord && c->api.cudaStreamWaitEvent &&
      c->api.cudaEventDestroy && c->api.cudaStreamQuery) {
    c->base.stream_wait = cuda_stream_wait;
    c->base.stream_idle = cuda_stream_idle;
  }
  if (c->api.cudaMemcpy && c->api.cudaMallocHost && c->api.cudaFreeHost) {
    c->base.copy = cuda_copy;
    c->base.host_alloc = cuda_host_alloc;
    c->base.host_free = cuda_host_free;
  }
  probe_vmm(c, cfg, missing);
  leave(c, prev);
  return &c->base;
fail:
  np_dl_close(c->driver);
  np_dl_close(c->runtime);
  free(c);
  return NULL;
}
