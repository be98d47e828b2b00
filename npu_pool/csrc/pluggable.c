/* pluggable.c -- torch's pluggable-allocator entry points over a per-device
 * context table. The table is the core's only global state. */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"
#include "pluggable.h"

/* Invariants: ctx[d] is NULL or a context built from `cfg` for device d; npu_pool_shutdown()
 * closes it and keeps the struct on `retired` (a hook that read ctx[d] just before may still
 * call it: it fails cleanly on a closed context, never on freed memory); `cfg` and `lib_path`
 * change only while every ctx[d] is NULL; fraction[d] (0 = none), history[d] (-1 = default) and
 * compact[d] are what device d gets when its context is created. error[d] is d's last failure,
 * printed[d] whether it was printed since the last successful malloc. devices is the count torch sees (0: not told yet).
 * `lock` guards everything but the ctx reads of the allocation fast path and the atomics. */
static struct {
  pthread_mutex_t lock;
  bool configured;
  np_config cfg;
  char lib_path[PATH_MAX];
  char origin_policy[512];   /* where the policy and the fraction came from ("NPU_POOL_POLICY='x'"), */
  char origin_fraction[512]; /* named in a creation's failure ("": nowhere to name) */
  double fraction[NP_MAX_DEVICES];
  int64_t history[NP_MAX_DEVICES];
  bool compact[NP_MAX_DEVICES];
  _Atomic(np_ctx *) ctx[NP_MAX_DEVICES];
  char error[NP_MAX_DEVICES][4096];
  char printed_text[NP_MAX_DEVICES][4096];
  atomic_bool printed[NP_MAX_DEVICES];
  atomic_int quiet;
  atomic_int devices;
  _Atomic(void (*)(int, uint64_t, void *)) on_oom;
  np_ctx **retired;          /* closed by npu_pool_shutdown, never freed */
  size_t n_retired, cap_retired;
} table = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The notes an OOM handler adds while this thread's failed malloc calls it (noting: its device,
 * -1 outside a handler): they join the thread's own message as well as the device's, which a
 * failure on another thread may replace before this thread reads it. A handler whose own malloc
 * fails nests: its notes follow the outer call's and leave with its own message. */
static _Thread_local int tl_noting = -1;
static _Thread_local char tl_note[4096];

/* Append `text` to the message in buf (len bytes), after a newline when `newline`; what does not
 * fit is cut, and the cut shows ("..." at the end), whatever was written before. */
static void append_line(char *buf, size_t len, const char *text, bool newline) {
  size_t n = strlen(buf);
  if (newline && n + 1 < len) {
    buf[n++] = '\n';
    buf[n] = '\0';
  }
  if (strlen(text) < len - n || len - n > 4) np_copy_text(buf + n, len - n, text); /* a cut ends buf in "..." */
  else if (len > 4) memcpy(buf + len - 4, "...", 4); /* no room for the cut's mark after the text before it */
}

/* Every path takes the table's lock here: the fork handlers are installed first, so that a fork
 * while another thread holds it, before any context exists, does not leave it locked in the child. */
static void lock_table(void) {
  np_fork_init();
  pthread_mutex_lock(&table.lock);
}

static bool valid_device(int device) { return device >= 0 && device < NP_MAX_DEVICES; }

static void clear_pending_locked(void) {
  for (int d = 0; d < NP_MAX_DEVICES; d++) {
    table.fraction[d] = 0;
    table.history[d] = -1;
    table.compact[d] = false;
  }
}

/* Keep the calling thread's np_last_error() as `device`'s last failure. */
static void keep(int device) {
  if (!valid_device(device)) return;
  lock_table();
  np_copy_text(table.error[device], sizeof table.error[device], np_last_error());
  pthread_mutex_unlock(&table.lock);
}

/* Print the calling thread's failure (the device's kept one may be another thread's by now) unless
 * it repeats the one printed last on `device` with nothing served in between, or the caller
 * reports it (`quiet`). */
static void print_kept(int device, const char *what, bool quiet) {
  char msg[sizeof table.error[0]];
  np_copy_text(msg, sizeof msg, np_last_error());
  if (!valid_device(device)) {
    if (!quiet) fprintf(stderr, "npu_pool: %s failed: %s\n", what, msg);
    return;
  }
  lock_table();
  bool repeat = atomic_load(&table.printed[device]) && strcmp(table.printed_text[device], msg) == 0;
  if (!quiet && !repeat) {
    atomic_store(&table.printed[device], true);
    snprintf(table.printed_text[device], sizeof table.printed_text[device], "%s", msg);
  }
  pthread_mutex_unlock(&table.lock);
  if (!quiet && !repeat) fprintf(stderr, "npu_pool: %s failed on device %d: %s\n", what, device, msg);
}

static void report(int device, const char *what, bool quiet) {
  keep(device);
  print_kept(device, what, quiet);
}

static bool any_ctx_locked(void) {
  for (int d = 0; d < NP_MAX_DEVICES; d++)
    if (atomic_load(&table.ctx[d])) return true;
  return false;
}

int npu_pool_configure(int policy, int backend, double fraction, int vmm, const char *lib_path) {
  if (!np_policy_name(policy)) return np_error(NP_ERR_INVALID, "unknown policy %d (0..%d)", policy, np_policy_count() - 1);
  if (backend < 0 || backend >= NP_BACKEND_COUNT)
    return np_error(NP_ERR_INVALID, "unknown backend %d (sim=0, acl=1, cuda=2)", backend);
  int rc = np_check_fraction(fraction);
  if (rc != NP_OK) return rc;
  if (lib_path && strlen(lib_path) >= sizeof table.lib_path)
    return np_error(NP_ERR_INVALID, "lib_path is %zu bytes, longer than the %zu a path may have", strlen(lib_path),
                    sizeof table.lib_path - 1);
  if ((rc = np_backend_load(backend, lib_path)) != NP_OK) return rc; /* before torch's allocator is swapped */
  lock_table();
  np_config cfg;
  np_config_init(&cfg);
  cfg.policy = policy;
  cfg.backend = backend;
  cfg.fraction = fraction;
  cfg.vmm = vmm != 0;
  const char *path = lib_path ? lib_path : "";
  if (any_ctx_locked()) {
    bool same = table.configured && table.cfg.policy == policy && table.cfg.backend == backend &&
                table.cfg.fraction == fraction && table.cfg.vmm == cfg.vmm && strcmp(table.lib_path, path) == 0;
    pthread_mutex_unlock(&table.lock);
    return same ? NP_OK
                : np_error(NP_ERR_STATE, "the allocator already serves a device with another configuration; "
                           "configure it before the first allocation (call npu_pool.install() before any tensor "
                           "is moved to the device)");
  }
  table.cfg = cfg;
  snprintf(table.lib_path, sizeof table.lib_path, "%s", path);
  clear_pending_locked();
  table.configured = true;
  pthread_mutex_unlock(&table.lock);
  return NP_OK;
}

/* Without the virtual-memory API (the runtime has none, or its probe failed: the backend's name
 * says why) an arena is one allocation of the whole cap, taken at the first request: memory
 * that HCCL/NCCL and other processes need must lie outside it. Said once per device, as the pool
 * is made (a user would otherwise first meet it as a collective's out-of-memory, far from here). */
static void say_fixed_arena(const np_ctx *ctx) {
  bool arena = ctx->cfg.policy == np_policy_index("npu_pool") || ctx->cfg.policy == np_policy_index("planned");
  if (!arena || !ctx->cfg.vmm || ctx->cfg.backend == NP_BACKEND_SIM || ctx->st.vmm) return;
  char cap[32];
  fprintf(stderr, "npu_pool: device %d: %s: its memory is one allocation of the whole cap (%s, fraction %.2f), "
          "taken at the first request; what collective libraries and other processes need must stay outside it "
          "(lower the fraction: NPU_POOL_FRACTION or npu_pool.set_fraction)\n", ctx->cfg.device, ctx->be->name,
          np_fmt_bytes(ctx->limit, cap), ctx->cfg.fraction);
}

/* Create device's context (table lock held). */
static np_ctx *create_locked(int device) {
  np_ctx *ctx = atomic_load(&table.ctx[device]);
  if (ctx) return ctx;
  if (!table.configured) {
    np_error(NP_ERR_STATE, "npu_pool is not configured: call npu_pool.install() (or npu_pool_configure()) "
             "before torch allocates device memory");
    return NULL;
  }
  np_config cfg = table.cfg;
  cfg.device = device;
  if (table.fraction[device] > 0) cfg.fraction = table.fraction[device];
  cfg.lib_path = table.lib_path[0] ? table.lib_path : NULL;
  if (np_create(&cfg, &ctx) != NP_OK) {
    /* a setting the user made may be what fails: name them (the fraction's only where no other
     * cap was set for this device since: torch's set_per_process_memory_fraction, a repeated install) */
    const char *fraction = table.fraction[device] > 0 ? "" : table.origin_fraction;
    if (table.origin_policy[0] || fraction[0]) {
      char why[3072];
      int code = np_last_code();
      np_copy_text(why, sizeof why, np_last_error());
      np_error(code, "%s (npu_pool was configured by %s%s%s)", why, table.origin_policy,
               table.origin_policy[0] && fraction[0] ? ", " : "", fraction);
    }
    return NULL;
  }
  /* a fraction the caller set before this device's first request is set, as if set now (a framework
   * model caps itself from then on, even at 1.0); it was accepted then, for this device's cap */
  if (table.fraction[device] > 0) np_set_fraction(ctx, table.fraction[device]);
  if (table.history[device] >= 0) np_set_history(ctx, (uint64_t)table.history[device]);
  if (table.compact[device] && np_set_compaction(ctx, 1) != NP_OK) /* (the backend found it cannot: said, not fatal) */
    fprintf(stderr, "npu_pool: device %d: no compaction: %s\n", device, np_last_error());
  say_fixed_arena(ctx);
  atomic_store_explicit(&table.ctx[device], ctx, memory_order_release);
  return ctx;
}

np_ctx *npu_pool_existing_ctx(int device) {
  return valid_device(device) ? atomic_load_explicit(&table.ctx[device], memory_order_acquire) : NULL;
}

np_ctx *npu_pool_device_ctx(int device) {
  if (!valid_device(device)) {
    np_error(NP_ERR_INVALID, "device %d is out of range (0..%d)", device, NP_MAX_DEVICES - 1);
    return NULL;
  }
  np_ctx *ctx = npu_pool_existing_ctx(device);
  if (ctx) return ctx;
  lock_table();
  ctx = create_locked(device);
  pthread_mutex_unlock(&table.lock);
  return ctx;
}

int npu_pool_set_fraction(int device, double fraction) {
  int devices = atomic_load(&table.devices); /* torch's count, once its init hook said it */
  if (!valid_device(device) || (devices > 0 && device >= devices))
    return np_error(NP_ERR_INVALID, "device %d is out of range (0..%d)", device,
                    (devices > 0 ? devices : NP_MAX_DEVICES) - 1);
  int rc = np_check_fraction(fraction);
  if (rc != NP_OK) return rc;
  lock_table();
  np_ctx *ctx = atomic_load(&table.ctx[device]);
  if (!ctx) table.fraction[device] = fraction;
  pthread_mutex_unlock(&table.lock);
  return ctx ? np_set_fraction(ctx, fraction) : NP_OK;
}

int npu_pool_set_history(int device, uint64_t max_entries) {
  if (device != -1 && !valid_device(device))
    return np_error(NP_ERR_INVALID, "device %d is out of range (-1 for all, 0..%d)", device, NP_MAX_DEVICES - 1);
  if (max_entries > np_history_max()) /* checked before anything is kept for devices without a context */
    return np_error(NP_ERR_INVALID, "history of %llu events is absurd", (unsigned long long)max_entries);
  int rc = NP_OK;
  for (int d = device < 0 ? 0 : device; d < (device < 0 ? NP_MAX_DEVICES : device + 1) && rc == NP_OK; d++) {
    lock_table();
    np_ctx *ctx = atomic_load(&table.ctx[d]);
    if (!ctx) table.history[d] = (int64_t)max_entries;
    pthread_mutex_unlock(&table.lock);
    if (ctx) rc = np_set_history(ctx, max_entries);
  }
  return rc;
}

int npu_pool_set_compaction(int device, int on) {
  if (device != -1 && !valid_device(device))
    return np_error(NP_ERR_INVALID, "device %d is out of range (-1 for all, 0..%d)", device, NP_MAX_DEVICES - 1);
  int rc = NP_OK;
  for (int d = device < 0 ? 0 : device; d < (device < 0 ? NP_MAX_DEVICES : device + 1) && rc == NP_OK; d++) {
    lock_table();
    np_ctx *ctx = atomic_load(&table.ctx[d]);
    if (!ctx) table.compact[d] = on != 0;
    pthread_mutex_unlock(&table.lock);
    if (ctx) rc = np_set_compaction(ctx, on);
  }
  return rc;
}

void npu_pool_set_device_count(int count) { atomic_store(&table.devices, count > 0 ? count : 0); }

int npu_pool_device_stats(int device, np_stats *out) {
  int devices = atomic_load(&table.devices);
  if (!valid_device(device) || (devices > 0 && device >= devices)) {
    memset(out, 0, sizeof *out);
    return np_error(NP_ERR_INVALID, "Invalid device argument %d: did you call init? (devices 0..%d)", device,
                    (devices > 0 ? devices : NP_MAX_DEVICES) - 1);
  }
  np_ctx *ctx = npu_pool_existing_ctx(device);
  if (ctx) {
    np_get_stats(ctx, out);
    return NP_OK;
  }
  memset(out, 0, sizeof *out); /* nothing allocated on this device yet */
  lock_table();
  int policy = table.configured ? table.cfg.policy : np_policy_index("npu_pool");
  /* the fraction the device will get: one set for it before its first request, else the configured one */
  out->fraction = table.fraction[device] > 0 ? table.fraction[device] : table.configured ? table.cfg.fraction : 1.0;
  pthread_mutex_unlock(&table.lock);
  out->policy = policy;
  snprintf(out->total.name, sizeof out->total.name, "all");
  for (int p = 0; p < NP_POOLS; p++) snprintf(out->pool[p].name, sizeof out->pool[p].name, "%s", np_policy_pool_name(policy, p));
  return NP_OK;
}

void npu_pool_reset_accumulated(int device) {
  np_ctx *ctx = npu_pool_existing_ctx(device);
  if (ctx) np_reset_accumulated(ctx);
}

size_t npu_pool_last_error(int device, char *buf, size_t len) {
  if (!buf || !len) return 0;
  if (!valid_device(device)) {
    np_copy_text(buf, len, np_last_error());
  } else {
    lock_table();
    np_copy_text(buf, len, table.error[device]);
    pthread_mutex_unlock(&table.lock);
  }
  return strlen(buf);
}

int npu_pool_last_code(void) { return np_last_code(); }

void npu_pool_note_error(int device, const char *note) {
  if (!valid_device(device) || !note) return;
  lock_table();
  append_line(table.error[device], sizeof table.error[device], note, strlen(table.error[device]) > 0);
  pthread_mutex_unlock(&table.lock);
  if (tl_noting == device) append_line(tl_note, sizeof tl_note, note, true); /* each note a line of its own */
}

void npu_pool_set_quiet(int quiet) { atomic_store(&table.quiet, quiet != 0); }

void npu_pool_set_origin(const char *policy, const char *fraction) {
  lock_table();
  np_copy_text(table.origin_policy, sizeof table.origin_policy, policy ? policy : "");
  np_copy_text(table.origin_fraction, sizeof table.origin_fraction, fraction ? fraction : "");
  pthread_mutex_unlock(&table.lock);
}

void npu_pool_set_oom_handler(void (*handler)(int device, uint64_t size, void *stream)) {
  atomic_store(&table.on_oom, handler);
}

/* Keep a closed context for good (table lock held); on host OOM it leaks the same way. */
static void retire_locked(np_ctx *ctx) {
  if (table.n_retired == table.cap_retired) {
    size_t cap = table.cap_retired ? 2 * table.cap_retired : 16;
    np_ctx **r = realloc(table.retired, cap * sizeof *r);
    if (!r) return;
    table.retired = r;
    table.cap_retired = cap;
  }
  table.retired[table.n_retired++] = ctx;
}

void npu_pool_shutdown(void) {
  lock_table();
  for (int d = 0; d < NP_MAX_DEVICES; d++) {
    np_ctx *ctx = atomic_exchange(&table.ctx[d], NULL);
    if (ctx && np_close(ctx) != NP_OK) fprintf(stderr, "npu_pool: closing device %d: %s\n", d, np_last_error());
    if (ctx) retire_locked(ctx);
    table.error[d][0] = table.printed_text[d][0] = '\0';
    atomic_store(&table.printed[d], false);
  }
  clear_pending_locked();
  table.configured = false;
  table.lib_path[0] = table.origin_policy[0] = table.origin_fraction[0] = '\0';
  atomic_store(&table.quiet, 0);
  atomic_store(&table.devices, 0);
  atomic_store(&table.on_oom, NULL);
  pthread_mutex_unlock(&table.lock);
}

void np_pluggable_fork_lock(void) { pthread_mutex_lock(&table.lock); }
void np_pluggable_fork_unlock(void) { pthread_mutex_unlock(&table.lock); }

/* ---- torch hooks ----------------------------------------------------------- */

void *npu_pool_malloc(size_t size, int device, void *stream) {
  if (size == 0) return NULL; /* torch keeps a null pointer for empty storage */
  np_ctx *ctx = npu_pool_device_ctx(device);
  if (!ctx) {
    report(device, "creating the allocator", atomic_load(&table.quiet) != 0); /* (quiet: the C++ hook raises it) */
    return NULL;
  }
  void *p = NULL;
  int rc = np_malloc(ctx, size, (intptr_t)stream, &p);
  if (rc == NP_OK) {
    if (atomic_load_explicit(&table.printed[device], memory_order_relaxed)) /* the next failure is news again */
      atomic_store(&table.printed[device], false);
    return p;
  }
  keep(device);
  void (*on_oom)(int, uint64_t, void *) = atomic_load(&table.on_oom);
  if (rc == NP_ERR_OOM && on_oom) {
    np_saved_error s;
    np_save_error(&s, rc);
    int outer = tl_noting;
    size_t from = outer < 0 ? 0 : strlen(tl_note); /* where this call's notes start */
    tl_note[from] = '\0';
    tl_noting = device;
    on_oom(device, size, stream); /* may run Python (no lock of the pool is held); may add a note */
    tl_noting = outer;
    if (tl_note[from]) np_error(rc, "%s%s", s.text, tl_note + from); /* the thread's message, as the device's */
    else np_restore_error(&s);
    tl_note[from] = '\0';
  }
  print_kept(device, "malloc", atomic_load(&table.quiet) != 0);
  return NULL; /* the C++ hook raises the kept message; without it, torch passes NULL on (printed, then) */
}

void npu_pool_free(void *ptr, size_t size, int device, void *stream) {
  (void)size;
  (void)stream; /* the block remembers the stream it was allocated on */
  if (!ptr) return;
  np_ctx *ctx = npu_pool_existing_ctx(device);
  if (!ctx) {
    np_error(NP_ERR_UNKNOWN_PTR, "free of %p: no allocator exists on this device", ptr);
    report(device, "free", false);
    return;
  }
  if (np_free(ctx, ptr) != NP_OK) report(device, "free", false);
}

void npu_pool_record_stream(void *ptr, void *stream) {
  if (!ptr) return;
  for (int d = 0; d < NP_MAX_DEVICES; d++) { /* the pointer's device: the context that owns it */
    np_ctx *ctx = npu_pool_existing_ctx(d);
    if (ctx && np_record_stream(ctx, ptr, (intptr_t)stream) == NP_OK) return;
  }
  np_error(NP_ERR_UNKNOWN_PTR, "record_stream on %p: no device's allocator holds it", ptr);
  report(-1, "record_stream", false);
}

/* torch's init hook: contexts are made per device on first use; say so now if some devices
 * can never have one. */
void npu_pool_init(int device_count) {
  npu_pool_set_device_count(device_count);
  if (device_count > NP_MAX_DEVICES) {
    np_error(NP_ERR_INVALID, "%d devices visible; npu_pool serves devices 0..%d (the others fail to allocate)",
             device_count, NP_MAX_DEVICES - 1);
    report(-1, "init", false);
  }
}

void npu_pool_empty_cache(void) {
  for (int d = 0; d < NP_MAX_DEVICES; d++) {
    np_ctx *ctx = npu_pool_existing_ctx(d);
    if (ctx && np_empty_cache(ctx) != NP_OK) report(d, "empty_cache", false);
  }
}

void npu_pool_empty_cache_checked(bool check_error) {
  (void)check_error; /* failures are reported either way, never raised */
  npu_pool_empty_cache();
}

void npu_pool_memory_fraction(double fraction, int device) {
  if (npu_pool_set_fraction(device, fraction) != NP_OK) report(device, "set_memory_fraction", false);
}

void npu_pool_reset_peak(int8_t device) {
  np_ctx *ctx = npu_pool_existing_ctx(device);
  if (ctx) np_reset_peak(ctx);
}

void npu_pool_set_framework_sync(int (*fn)(void)) { np_acl_set_framework_sync(fn); }
void npu_pool_set_framework_stream_wait(int (*fn)(int, void *, void *)) { np_acl_set_framework_stream_wait(fn); }
