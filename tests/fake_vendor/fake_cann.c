/* fake_cann.c -- the rest of a pretend CANN runtime, so that the real torch_npu runs on a CPU.
 *
 * One translation unit with fake_acl.c (the device's memory, whose state in fake_device.h is
 * static): this file adds what torch_npu needs besides memory -- aclInit, devices and
 * contexts, streams, events, host<->device copies and memset (host memmove / memset: device
 * memory is host memory here), pinned host memory, and the runtime's option store
 * (aclrtGetSysParamOpt / SetSysParamOpt / CtxSetSysParamOpt keep what was set).
 *
 * Every other symbol torch_npu imports or looks up is a generated stub (tests/fake_vendor/
 * cann.py writes them from cann_symbols.txt) that fails loudly. Kernels above all: no
 * operator runs here, so aclopCompileAndExecute (and every aclnn / op-API entry point)
 * prints why and returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT, never success -- a stub that
 * "succeeded" would leave fill_ or a strided copy silently unwritten.
 *
 * Work on a stream runs when it is queued (copies are synchronous), so events are complete
 * once recorded and streams are idle unless a test marks them busy (fake_set_busy).
 */
#include "fake_acl.c"

#include <stdarg.h>
#include <time.h>

#define NOT_SUPPORTED 207000 /* ACL_ERROR_RT_FEATURE_NOT_SUPPORT */

/* A loud failure: stderr and aclGetRecentErrMsg both say what is missing. */
EXPORT int fake_cann_unsupported(const char *fn, const char *what) {
  fprintf(stderr, "fake CANN: %s %s: this CPU-only test runtime runs no kernels and has no such feature\n", fn,
          what);
  fail(fn, NOT_SUPPORTED, "not available on the fake CPU-only runtime (no kernels run here)");
  return NOT_SUPPORTED;
}

/* Generated stubs report once per symbol (an operator's set-up calls several of them); the
 * kernel entry points above report every time. */
EXPORT int fake_cann_stub(const char *fn) {
  static char seen[256][48];
  static int n_seen;
  pthread_mutex_lock(&mu);
  int known = 0;
  for (int i = 0; i < n_seen && !known; i++) known = !strcmp(seen[i], fn);
  if (!known && n_seen < 256) snprintf(seen[n_seen++], sizeof seen[0], "%s", fn);
  pthread_mutex_unlock(&mu);
  if (!known) fprintf(stderr, "fake CANN: %s is not implemented (reported once)\n", fn);
  if (!recent[0]) fail(fn, NOT_SUPPORTED, "not implemented in the fake CPU-only runtime");
  return NOT_SUPPORTED;
}

/* The runtime's logger: torch_npu logs its errors through it. */
EXPORT void aclAppLog(int level, const char *func, const char *file, uint32_t line, const char *fmt, ...) {
  (void)file;
  (void)line;
  if (level < 3) return; /* ACL_ERROR = 3 */
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fake CANN log [%s]: ", func ? func : "?");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ---- initialisation, devices, contexts ------------------------------------------ */

static struct {
  int initialised;
  long inits;
  int64_t sys_param[64];   /* aclSysParamOpt -> value (device-wide) */
  int sys_param_set[64];
  void *context[16];       /* one context per device */
} rt;

EXPORT acl_err aclInit(const char *config) {
  (void)config;
  LOCKED("aclInit", {
    if (rt.initialised) _e = fail("aclInit", 100002, "repeated initialisation"); /* ACL_ERROR_REPEAT_INITIALIZE */
    else rt.initialised = 1, rt.inits++;
  });
}

EXPORT acl_err aclFinalize(void) { LOCKED("aclFinalize", { rt.initialised = 0; }); }

EXPORT acl_err aclrtGetDeviceCount(uint32_t *count) { LOCKED("aclrtGetDeviceCount", { *count = (uint32_t)st.devices; }); }

EXPORT acl_err aclrtResetDevice(int32_t d) {
  LOCKED("aclrtResetDevice", {
    if (d < 0 || d >= st.devices) _e = fail("aclrtResetDevice", RT_INVALID_DEVICEID, "no such device");
  });
}


EXPORT acl_err aclrtGetCurrentContext(void **ctx) {
  LOCKED("aclrtGetCurrentContext", {
    if (current < 0) _e = fail("aclrtGetCurrentContext", RT_CONTEXT_NULL, "no current device");
    else {
      if (!rt.context[current]) rt.context[current] = calloc(1, 16);
      *(int *)rt.context[current] = current;
      *ctx = rt.context[current];
    }
  });
}

EXPORT acl_err aclrtSetCurrentContext(void *ctx) {
  LOCKED("aclrtSetCurrentContext", {
    if (!ctx) _e = fail("aclrtSetCurrentContext", INVALID_PARAM, "no context");
    else current = *(int *)ctx;
  });
}

/* The option store: torch_npu reads back what it set, and fails on anything but success. */
static acl_err set_param(const char *fn, int opt, int64_t value) {
  LOCKED(fn, {
    if (opt < 0 || opt >= 64) _e = fail(fn, INVALID_PARAM, "unknown option");
    else rt.sys_param[opt] = value, rt.sys_param_set[opt] = 1;
  });
}
EXPORT acl_err aclrtSetSysParamOpt(int opt, int64_t value) { return set_param("aclrtSetSysParamOpt", opt, value); }
EXPORT acl_err aclrtCtxSetSysParamOpt(int opt, int64_t value) { return set_param("aclrtCtxSetSysParamOpt", opt, value); }
EXPORT acl_err aclrtGetSysParamOpt(int opt, int64_t *value) {
  LOCKED("aclrtGetSysParamOpt", {
    if (opt < 0 || opt >= 64 || !value) _e = fail("aclrtGetSysParamOpt", INVALID_PARAM, "unknown option");
    else *value = rt.sys_param_set[opt] ? rt.sys_param[opt] : 0;
  });
}

/* Settings that change how kernels run: accepted (there are no kernels to run differently). */
EXPORT acl_err aclrtSetDeviceSatMode(int mode) { (void)mode; LOCKED("aclrtSetDeviceSatMode", {}); }
EXPORT acl_err aclrtSetOpExecuteTimeOut(uint32_t t) { (void)t; LOCKED("aclrtSetOpExecuteTimeOut", {}); }
EXPORT acl_err aclrtSetOpWaitTimeout(uint32_t t) { (void)t; LOCKED("aclrtSetOpWaitTimeout", {}); }
EXPORT acl_err aclSetCompileopt(int opt, const char *value) { (void)opt; (void)value; LOCKED("aclSetCompileopt", {}); }

/* ---- streams --------------------------------------------------------------------- */

typedef struct fake_stream { int device; int id; } fake_stream;
static int next_stream_id = 1;

static acl_err new_stream(const char *fn, void **out) {
  LOCKED(fn, {
    if (current < 0) _e = fail(fn, RT_CONTEXT_NULL, "no current device");
    else if (!out) _e = fail(fn, INVALID_PARAM, "no stream pointer");
    else {
      fake_stream *s = calloc(1, sizeof *s);
      s->device = current;
      s->id = next_stream_id++;
      st.live_events++; /* counted with the other runtime objects in fake_live() */
      *out = s;
    }
  });
}
EXPORT acl_err aclrtCreateStream(void **s) { return new_stream("aclrtCreateStream", s); }
EXPORT acl_err aclrtCreateStreamWithConfig(void **s, uint32_t prio, uint32_t flag) {
  (void)prio;
  (void)flag;
  return new_stream("aclrtCreateStreamWithConfig", s);
}

static acl_err drop_stream(const char *fn, void *s) {
  LOCKED(fn, {
    if (!s) _e = fail(fn, INVALID_PARAM, "no stream");
    else free(s), st.live_events--;
  });
}
EXPORT acl_err aclrtDestroyStream(void *s) { return drop_stream("aclrtDestroyStream", s); }
EXPORT acl_err aclrtSynchronizeStreamWithTimeout(void *s, int32_t timeout) {
  (void)s;
  (void)timeout;
  LOCKED("aclrtSynchronizeStreamWithTimeout", {}); /* work finishes as it is queued */
}
EXPORT acl_err aclrtDestroyStreamForce(void *s) { return drop_stream("aclrtDestroyStreamForce", s); }

EXPORT acl_err aclrtStreamGetId(void *s, int32_t *id) {
  LOCKED("aclrtStreamGetId", { *id = s ? ((fake_stream *)s)->id : 0; });
}

/* ---- events (work finishes as it is queued: a recorded event is complete) --------- */

static acl_err new_event(const char *fn, void **ev) {
  LOCKED(fn, {
    *ev = calloc(1, sizeof(event));
    st.live_events++;
  });
}
EXPORT acl_err aclrtCreateEventWithFlag(void **ev, uint32_t flag) { (void)flag; return new_event("aclrtCreateEventWithFlag", ev); }
EXPORT acl_err aclrtSynchronizeEvent(void *ev) { (void)ev; LOCKED("aclrtSynchronizeEvent", {}); }
EXPORT acl_err aclrtResetEvent(void *ev, void *stream) {
  (void)stream;
  LOCKED("aclrtResetEvent", { if (ev) ((event *)ev)->recorded = 0; });
}
EXPORT acl_err aclrtQueryEventStatus(void *ev, int *status) {
  LOCKED("aclrtQueryEventStatus", { *status = 1; }); /* ACL_EVENT_RECORDED_STATUS_COMPLETE */
}
EXPORT acl_err aclrtQueryEventWaitStatus(void *ev, int *status) {
  (void)ev;
  LOCKED("aclrtQueryEventWaitStatus", { *status = 1; }); /* ACL_EVENT_WAIT_STATUS_COMPLETE */
}
EXPORT acl_err aclrtEventElapsedTime(float *ms, void *start, void *end) {
  (void)start;
  (void)end;
  LOCKED("aclrtEventElapsedTime", { *ms = 0.0f; });
}

/* ---- copies and memset: device memory is host memory here ------------------------- */

static acl_err copy(const char *fn, void *dst, size_t max, const void *src, size_t count) {
  LOCKED(fn, {
    if (count > max) _e = fail(fn, INVALID_PARAM, "count exceeds the destination's size");
    else if (count && (!dst || !src)) _e = fail(fn, INVALID_PARAM, "null pointer");
    else if (count) memmove(dst, src, count);
  });
}
EXPORT acl_err aclrtMemcpy(void *dst, size_t max, const void *src, size_t count, int kind) {
  (void)kind;
  return copy("aclrtMemcpy", dst, max, src, count);
}
EXPORT acl_err aclrtMemcpyAsync(void *dst, size_t max, const void *src, size_t count, int kind, void *stream) {
  (void)kind;
  (void)stream;
  return copy("aclrtMemcpyAsync", dst, max, src, count);
}

static acl_err fill(const char *fn, void *dst, size_t max, int32_t value, size_t count) {
  LOCKED(fn, {
    if (count > max) _e = fail(fn, INVALID_PARAM, "count exceeds the destination's size");
    else if (count) memset(dst, value, count);
  });
}
EXPORT acl_err aclrtMemset(void *p, size_t max, int32_t value, size_t count) { return fill("aclrtMemset", p, max, value, count); }
EXPORT acl_err aclrtMemsetAsync(void *p, size_t max, int32_t value, size_t count, void *stream) {
  (void)stream;
  return fill("aclrtMemsetAsync", p, max, value, count);
}

/* ---- pinned host memory ------------------------------------------------------------ */

EXPORT acl_err aclrtMallocHost(void **p, size_t size) {
  LOCKED("aclrtMallocHost", {
    if (!p || !size) _e = fail("aclrtMallocHost", INVALID_PARAM, "size 0");
    else if (!(*p = malloc(size))) _e = fail("aclrtMallocHost", RT_MEMORY_ALLOCATION, "host out of memory");
  });
}
EXPORT acl_err aclrtFreeHost(void *p) { LOCKED("aclrtFreeHost", { free(p); }); }

/* torch_npu's own caching allocator asks for this variant where the runtime has it. */
EXPORT acl_err aclrtMallocAlign32(void **ptr, size_t size, int policy) { return aclrtMalloc(ptr, size, policy); }

/* ---- memory use per component (torch.npu.memory._dump_snapshot writes it out) ---- */

typedef struct mem_usage { char name[32]; uint64_t current, peak; size_t reserved[8]; } mem_usage;

EXPORT acl_err aclrtGetMemUsageInfo(int32_t device, mem_usage *info, size_t n, size_t *out) {
  LOCKED("aclrtGetMemUsageInfo", {
    if (device < 0 || device >= st.devices) _e = fail("aclrtGetMemUsageInfo", RT_INVALID_DEVICEID, "no such device");
    else if (!out || (n && !info)) _e = fail("aclrtGetMemUsageInfo", INVALID_PARAM, "null pointer");
    else {
      *out = n ? 1 : 0; /* one component: everything the fake device has handed out */
      if (n) {
        memset(info, 0, sizeof *info);
        snprintf(info->name, sizeof info->name, "fake_device");
        info->current = info->peak = st.used;
      }
    }
  });
}

/* ---- kernels: none run here -------------------------------------------------------- */

EXPORT acl_err aclopCompileAndExecute(const char *op, ...) {
  char what[160];
  snprintf(what, sizeof what, "(operator %s) cannot run", op ? op : "?");
  return fake_cann_unsupported("aclopCompileAndExecute", what);
}
EXPORT acl_err aclopCompileAndExecuteV2(const char *op, ...) {
  char what[160];
  snprintf(what, sizeof what, "(operator %s) cannot run", op ? op : "?");
  return fake_cann_unsupported("aclopCompileAndExecuteV2", what);
}

/* ---- profiling hooks: accepted, nothing is profiled --------------------------------- */

EXPORT int32_t MsprofRegisterCallback(uint32_t module, void *handle) { (void)module; (void)handle; return 0; }
EXPORT uint64_t MsprofSysCycleTime(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- control ------------------------------------------------------------------------ */

EXPORT long fake_inits(void) { return rt.inits; }
