/* fake_cuda.c -- a pretend CUDA runtime and driver over host memory, for tests.
 *
 * Exports the cudart and libcuda symbols npu_pool's cuda backend binds, with
 * the vendors' signatures and error codes, over a device of `capacity` bytes
 * (FAKE_CAPACITY, default 1 GiB; `devices` devices, FAKE_DEVICES, default 2).
 * Memory is real host memory, so tests can write patterns: cudaMalloc is an
 * anonymous mapping; a reservation is PROT_NONE address space; cuMemCreate is a
 * capacity charge; cuMemMap records the mapping; cuMemSetAccess makes it
 * readable and writable (as on a GPU, a mapping without access faults).
 *
 * Control (for ctypes): fake_reset, fake_set_capacity, fake_set_used (memory
 * held by "other processes"), fake_set_vmm (0: the device lacks VMM support),
 * fake_fail(fn, skip, count, code) (after `skip` good calls, fail `count` calls
 * of fn with `code`), fake_calls(fn), fake_used, fake_mapped, fake_live,
 * fake_set_busy(stream, on) (cudaStreamQuery reports unfinished work),
 * fake_current_device, fake_set_current_device, fake_last_device.
 * Build with -DFAKE_NO_VMM to leave the driver's VMM symbols out, and with
 * -DFAKE_OMIT_FREE to leave cudaFree out.
 */
#define _GNU_SOURCE
#define FAKE_FIRST_DEVICE 0
#define FAKE_VA_BASE ((uintptr_t)0x200000000000ull) /* 32 TiB */
#include "fake_device.h"

typedef int cu_err;
typedef unsigned long long cu_ptr;
typedef unsigned long long cu_handle;
typedef struct cu_location { int type; int id; } cu_location;
typedef struct cu_alloc_prop {
  int type;
  int requested_handle_types;
  cu_location location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type, gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} cu_alloc_prop;
typedef struct cu_access_desc { cu_location location; int flags; } cu_access_desc;

enum {
  OK = 0, INVALID_VALUE = 1, OOM = 2, INVALID_DEVICE = 101, NOT_SUPPORTED = 801, UNKNOWN = 999,
};


#define LOCKED(fn, ...)         \
  do {                          \
    pthread_mutex_lock(&mu);    \
    cu_err _e = enter(fn);      \
    if (!_e) {                  \
      __VA_ARGS__               \
    }                           \
    pthread_mutex_unlock(&mu);  \
    return _e;                  \
  } while (0)

/* ---- control ---------------------------------------------------------------- */

EXPORT void fake_reset(void) {
  pthread_mutex_lock(&mu);
  reset_locked();
  pthread_mutex_unlock(&mu);
}


/* ---- runtime ---------------------------------------------------------------- */

EXPORT cu_err cudaMalloc(void **ptr, size_t size) {
  LOCKED("cudaMalloc", {
    if (!ptr || !size) _e = INVALID_VALUE;
    else if (!(_e = charge(size) ? OK : OOM)) {
      void *p = fake_map(size, PROT_READ | PROT_WRITE);
      if (p == MAP_FAILED) {
        st.used -= size;
        _e = OOM;
      } else {
        add((uintptr_t)p, size, ALLOC);
        st.last_device = current;
        *ptr = p;
      }
    }
  });
}

/* Copies and pinned host memory (backups of paused tags): device memory is host memory here. */
EXPORT cu_err cudaMemcpy(void *dst, const void *src, size_t count, int kind) {
  LOCKED("cudaMemcpy", {
    if (kind < 0 || kind > 4 || (count && (!dst || !src))) _e = INVALID_VALUE;
    else if (count) memmove(dst, src, count);
  });
}
EXPORT cu_err cudaMallocHost(void **ptr, size_t size) {
  LOCKED("cudaMallocHost", {
    if (!ptr || !size) _e = INVALID_VALUE;
    else if (!(*ptr = malloc(size))) _e = OOM;
  });
}
EXPORT cu_err cudaFreeHost(void *ptr) { LOCKED("cudaFreeHost", { free(ptr); }); }

#ifndef FAKE_OMIT_FREE
EXPORT cu_err cudaFree(void *ptr) {
  LOCKED("cudaFree", {
    if (ptr) {
      region *x = find((uintptr_t)ptr, ALLOC);
      if (!x) _e = INVALID_VALUE;
      else {
        munmap(ptr, x->size);
        st.used -= x->size;
        drop(x);
      }
    }
  });
}
#endif

EXPORT cu_err cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  LOCKED("cudaMemGetInfo", {
    *free_bytes = st.capacity - st.others - st.used;
    *total = st.capacity;
  });
}
EXPORT cu_err cudaGetDevice(int *d) { LOCKED("cudaGetDevice", { *d = current; }); }
EXPORT cu_err cudaSetDevice(int d) {
  LOCKED("cudaSetDevice", {
    if (d < 0 || d >= st.devices) _e = INVALID_DEVICE;
    else current = d;
  });
}
EXPORT cu_err cudaDeviceSynchronize(void) { LOCKED("cudaDeviceSynchronize", {}); }
EXPORT cu_err cudaStreamSynchronize(void *stream) { (void)stream; LOCKED("cudaStreamSynchronize", {}); }
EXPORT cu_err cudaGetLastError(void) { return OK; }

static const char *rt_name(cu_err e) {
  switch (e) {
    case OK: return "cudaSuccess";
    case INVALID_VALUE: return "cudaErrorInvalidValue";
    case OOM: return "cudaErrorMemoryAllocation";
    case INVALID_DEVICE: return "cudaErrorInvalidDevice";
    case NOT_SUPPORTED: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}
static const char *text(cu_err e) {
  switch (e) {
    case OK: return "no error";
    case INVALID_VALUE: return "invalid argument";
    case OOM: return "out of memory";
    case INVALID_DEVICE: return "invalid device ordinal";
    case NOT_SUPPORTED: return "operation not supported";
    default: return "unknown error";
  }
}
EXPORT const char *cudaGetErrorName(cu_err e) { return rt_name(e); }
EXPORT const char *cudaGetErrorString(cu_err e) { return text(e); }

/* ---- events and streams -------------------------------------------------------- */

EXPORT cu_err cudaEventCreateWithFlags(void **ev, unsigned flags) {
  LOCKED("cudaEventCreateWithFlags", {
    if (!ev || flags > 0xf) _e = INVALID_VALUE;
    else {
      *ev = calloc(1, sizeof(event));
      st.live_events++;
    }
  });
}
EXPORT cu_err cudaEventRecord(void *ev, void *stream) {
  LOCKED("cudaEventRecord", {
    if (!ev) _e = INVALID_VALUE;
    else *(event *)ev = (event){1, stream};
  });
}
EXPORT cu_err cudaStreamWaitEvent(void *stream, void *ev, unsigned flags) {
  (void)stream;
  LOCKED("cudaStreamWaitEvent", {
    if (!ev || flags || !((event *)ev)->recorded) _e = INVALID_VALUE;
  });
}
EXPORT cu_err cudaEventDestroy(void *ev) {
  LOCKED("cudaEventDestroy", {
    if (!ev) _e = INVALID_VALUE;
    else {
      free(ev);
      st.live_events--;
    }
  });
}
EXPORT cu_err cudaStreamQuery(void *stream) {
  LOCKED("cudaStreamQuery", { _e = is_busy(stream) ? 600 : OK; }); /* 600: cudaErrorNotReady */
}

/* ---- driver ------------------------------------------------------------------ */

static const char *drv_name(cu_err e) {
  switch (e) {
    case OK: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OOM: return "CUDA_ERROR_OUT_OF_MEMORY";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}
EXPORT cu_err cuGetErrorName(cu_err e, const char **s) { *s = drv_name(e); return OK; }
EXPORT cu_err cuGetErrorString(cu_err e, const char **s) { *s = text(e); return OK; }
EXPORT cu_err cuInit(unsigned flags) { (void)flags; LOCKED("cuInit", {}); }
EXPORT cu_err cuDeviceGet(int *dev, int ordinal) {
  LOCKED("cuDeviceGet", {
    if (ordinal < 0 || ordinal >= st.devices) _e = INVALID_DEVICE;
    else *dev = ordinal;
  });
}
EXPORT cu_err cuDeviceGetAttribute(int *value, int attribute, int dev) {
  (void)dev;
  LOCKED("cuDeviceGetAttribute", { *value = attribute == 102 ? st.vmm : 0; });
}

#ifndef FAKE_NO_VMM
static int good_prop(const cu_alloc_prop *p) {
  return p && p->type == 1 && p->location.type == 1 && p->location.id >= 0 && p->location.id < st.devices;
}

EXPORT cu_err cuMemGetAllocationGranularity(size_t *g, const cu_alloc_prop *prop, int option) {
  LOCKED("cuMemGetAllocationGranularity", {
    if (!good_prop(prop) || (option != 0 && option != 1)) _e = INVALID_VALUE;
    else *g = PAGE;
  });
}

EXPORT cu_err cuMemAddressReserve(cu_ptr *ptr, size_t size, size_t alignment, cu_ptr addr, unsigned long long flags) {
  LOCKED("cuMemAddressReserve", {
    if (!st.vmm) _e = NOT_SUPPORTED;
    else if (!size || size % PAGE || addr || flags || (alignment && alignment % PAGE)) _e = INVALID_VALUE;
    else {
      /* PAGE-aligned PROT_NONE address space: over-reserve, then trim */
      char *p = fake_map(size + PAGE, PROT_NONE);
      if (p == MAP_FAILED) _e = OOM;
      else {
        uintptr_t a = ((uintptr_t)p + PAGE - 1) / PAGE * PAGE;
        if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
        munmap((void *)(a + size), (uintptr_t)p + size + PAGE - (a + size));
        add(a, size, RESERVED);
        *ptr = a;
      }
    }
  });
}

EXPORT cu_err cuMemAddressFree(cu_ptr ptr, size_t size) {
  LOCKED("cuMemAddressFree", {
    region *x = find(ptr, RESERVED);
    if (!x || x->size != size || overlaps_mapping(ptr, size)) _e = INVALID_VALUE;
    else {
      munmap((void *)ptr, size);
      drop(x);
    }
  });
}

EXPORT cu_err cuMemCreate(cu_handle *h, size_t size, const cu_alloc_prop *prop, unsigned long long flags) {
  LOCKED("cuMemCreate", {
    if (!good_prop(prop) || !size || size % PAGE || flags) _e = INVALID_VALUE;
    else if (!(_e = charge(size) ? OK : OOM)) {
      phys *p = calloc(1, sizeof *p);
      p->size = size;
      st.live_phys++;
      st.last_device = prop->location.id;
      *h = (cu_handle)(uintptr_t)p;
    }
  });
}

static void free_phys(phys *p) {
  st.used -= p->size;
  st.live_phys--;
  free(p);
}

EXPORT cu_err cuMemRelease(cu_handle h) {
  LOCKED("cuMemRelease", {
    phys *p = (phys *)(uintptr_t)h;
    if (!p || p->released) _e = INVALID_VALUE;
    else if (p->mapped) p->released = 1; /* freed when unmapped, as on a GPU */
    else free_phys(p);
  });
}

EXPORT cu_err cuMemMap(cu_ptr ptr, size_t size, size_t offset, cu_handle h, unsigned long long flags) {
  LOCKED("cuMemMap", {
    phys *p = (phys *)(uintptr_t)h;
    if (!p || p->released || p->mapped || offset || flags || size != p->size || ptr % PAGE ||
        !inside(ptr, size, RESERVED, NULL) || overlaps_mapping(ptr, size))
      _e = INVALID_VALUE;
    else {
      region *m = add(ptr, size, MAPPING);
      m->ph = p;
      p->mapped = 1;
      st.mapped += size;
    }
  });
}

/* The range must cover whole mappings exactly. */
EXPORT cu_err cuMemUnmap(cu_ptr ptr, size_t size) {
  LOCKED("cuMemUnmap", {
    size_t covered = 0;
    for (size_t i = 0; i < st.n; i++)
      if (st.r[i].kind == MAPPING && st.r[i].addr < ptr + size && ptr < st.r[i].addr + st.r[i].size) {
        if (st.r[i].addr < ptr || st.r[i].addr + st.r[i].size > ptr + size) covered = (size_t)-1;
        else if (covered != (size_t)-1) covered += st.r[i].size;
      }
    if (covered != size) _e = INVALID_VALUE;
    else {
      madvise((void *)ptr, size, MADV_DONTNEED);
      mprotect((void *)ptr, size, PROT_NONE);
      for (size_t i = 0; i < st.n;) {
        region *x = &st.r[i];
        if (x->kind == MAPPING && x->addr >= ptr && x->addr < ptr + size) {
          phys *p = x->ph;
          p->mapped = 0;
          st.mapped -= x->size;
          if (p->released) free_phys(p);
          drop(x);
        } else {
          i++;
        }
      }
    }
  });
}

/* The range must be covered by mappings; read-write access opens it. */
EXPORT cu_err cuMemSetAccess(cu_ptr ptr, size_t size, const cu_access_desc *desc, size_t count) {
  LOCKED("cuMemSetAccess", {
    size_t covered = 0;
    for (size_t i = 0; i < st.n; i++)
      if (st.r[i].kind == MAPPING && st.r[i].addr >= ptr && st.r[i].addr + st.r[i].size <= ptr + size)
        covered += st.r[i].size;
    if (!desc || count != 1 || desc->location.type != 1 || desc->location.id < 0 ||
        desc->location.id >= st.devices || covered != size)
      _e = INVALID_VALUE;
    else
      mprotect((void *)ptr, size, desc->flags == 3 ? PROT_READ | PROT_WRITE : PROT_NONE);
  });
}
#endif
