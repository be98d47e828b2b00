/* npu_pool.h -- public C API of the npu_pool allocator core.
 *
 * One np_ctx is one allocator for one device: a backend (where device memory
 * comes from), a policy (how requests are placed), statistics, and a mutex.
 * Every function is thread-safe on its context. Functions return NP_OK or an
 * NP_ERR_* code; np_last_error() then gives a message for the calling thread.
 *
 * The block between CDEF BEGIN/END is read by cffi: plain declarations only.
 */
#ifndef NPU_POOL_H
#define NPU_POOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF BEGIN */
typedef struct np_ctx np_ctx;

enum {
  NP_OK = 0,
  NP_ERR_OOM = 1,          /* the device (or the fraction cap) has no room */
  NP_ERR_INVALID = 2,      /* bad argument: size 0, absurd size, bad fraction, ... */
  NP_ERR_DOUBLE_FREE = 3,  /* pointer was allocated by this pool and already freed */
  NP_ERR_UNKNOWN_PTR = 4,  /* pointer was never returned by this pool */
  NP_ERR_BACKEND = 5,      /* the vendor runtime failed or could not be loaded */
  NP_ERR_HOST = 6,         /* host memory for bookkeeping ran out */
  NP_ERR_STATE = 7         /* call not allowed in the current state */
};

enum { NP_POLICY_TORCH = 0, NP_POLICY_NPU_POOL = 1, NP_POLICY_EXPANDABLE = 2, NP_POLICY_PLANNED = 3, NP_POLICY_COUNT = 4 };
enum { NP_BACKEND_SIM = 0, NP_BACKEND_ACL = 1, NP_BACKEND_CUDA = 2 };
enum { NP_LIFE_AUTO = 0, NP_LIFE_LONG = 1, NP_LIFE_SHORT = 2 };
/* Phase markers; the same codes as MARK_* in npu_pool/trace/format.py. */
enum {
  NP_MARK_SETUP_BEGIN = 0, NP_MARK_SETUP_END = 1, NP_MARK_ITER_BEGIN = 2, NP_MARK_ITER_END = 3,
  NP_MARK_FORWARD_BEGIN = 4, NP_MARK_FORWARD_END = 5, NP_MARK_BACKWARD_BEGIN = 6, NP_MARK_BACKWARD_END = 7,
  NP_MARK_LAYER_ENTER = 8, NP_MARK_LAYER_EXIT = 9, NP_MARK_OPTIMIZER_BEGIN = 10, NP_MARK_OPTIMIZER_END = 11,
  NP_MARK_EVAL_BEGIN = 12, NP_MARK_EVAL_END = 13, NP_MARK_COUNT = 14
};

typedef struct np_config {
  int policy;               /* NP_POLICY_* */
  int backend;              /* NP_BACKEND_* */
  int device;               /* device index (vendor backends) */
  uint64_t capacity;        /* sim: device total bytes */
  int host_backed;          /* sim: real host memory behind every mapping */
  int vmm;                  /* use the virtual-memory API when the backend has it (1), or never (0) */
  double fraction;          /* reserved bytes <= fraction * device total; 0 < f <= 1 */
  uint64_t max_split_size;  /* torch policy: blocks at least this big are never split; 0 = unlimited */
  const char *lib_path;     /* vendor backends: library to dlopen (NULL = default name) */
} np_config;

typedef struct np_counter { uint64_t current; uint64_t peak; } np_counter;

typedef struct np_pool_stats {
  np_counter allocated;     /* bytes in allocated blocks (rounded sizes) */
  np_counter requested;     /* bytes asked for by the callers */
  np_counter active;        /* allocated bytes plus freed bytes still in use by a stream */
  np_counter reserved;      /* bytes held from the device (arena policies: whole arena in total only) */
  np_counter blocks;        /* allocated blocks */
  np_counter segments;      /* device segments */
} np_pool_stats;

typedef struct np_stats {
  np_pool_stats total;
  np_pool_stats pool[2];    /* torch/expandable: small, large; npu_pool: long-lived, short-lived */
  uint64_t device_total;    /* backend's device memory */
  uint64_t limit;           /* fraction * device_total */
  np_counter arena_hwm;     /* npu_pool: highest byte offset in use in the arena */
  uint64_t largest_free;    /* largest free block (npu_pool: including the arena's unused top) */
  uint64_t device_mallocs;  /* backend malloc/map calls */
  uint64_t device_frees;    /* backend free/unmap calls */
  uint64_t ooms;            /* requests that failed for lack of memory */
  uint64_t retries;         /* release-cache-and-retry events */
  uint64_t stream_waits;    /* npu_pool: reuses across streams ordered by an event wait */
  uint64_t trims;           /* npu_pool: free pages unmapped under cap pressure without a synchronisation */
  uint64_t allocs;          /* successful mallocs */
  uint64_t frees;           /* successful frees */
  int vmm;                  /* 1 if the arena grows through the virtual-memory API */
  int policy;
} np_stats;

typedef struct np_replay_in {
  uint64_t n;               /* events */
  const uint8_t *op;        /* columns of npu_pool.trace.format */
  const uint8_t *cat;
  const int32_t *site;
  const int64_t *id;
  const uint64_t *size;
  const int64_t *stream;
  const uint64_t *addr;
  uint64_t n_ids;           /* ids are 0..n_ids-1 */
  int fidelity;             /* prime recorded segments, take recorded segment addresses */
  int hints;                /* 0: none; 1: markers and the trace's sites; 2: that and categories (oracle);
                               3: markers only (what a device with the recorder sees) */
  uint64_t *placed;         /* optional (NULL): per event, the address an allocation got */
  uint8_t *classes;         /* optional (NULL): per event, NP_LIFE_LONG/SHORT an allocation was placed as */
} np_replay_in;

typedef struct np_replay_out {
  int ok;                   /* 1 if every event was served */
  uint64_t fail_index;      /* event that failed when ok == 0 */
  uint64_t ops;             /* alloc + free calls made */
  uint64_t ns;              /* wall time of the loop */
  uint64_t peak_live;       /* peak of requested live bytes */
  uint64_t same_addr;       /* window allocations placed at their recorded address */
  uint64_t compared;        /* window allocations with a recorded address */
} np_replay_out;

/* One block of the segment map (np_blocks). */
typedef struct np_block_info {
  uint64_t segment;         /* segment base address */
  uint64_t segment_size;
  uint64_t addr;
  uint64_t size;
  uint64_t requested;       /* 0 for free blocks */
  int64_t stream;           /* free npu_pool blocks: INT64_MIN when usable by every stream */
  int32_t site;
  uint8_t pool;
  uint8_t allocated;
  uint8_t mapped;           /* backed by physical memory */
} np_block_info;

/* One entry of the recent-events ring (np_recent_events), for OOM snapshots. */
enum { NP_EV_ALLOC = 0, NP_EV_FREE = 1, NP_EV_EMPTY_CACHE = 2, NP_EV_OOM = 3 };
typedef struct np_event_info {
  uint64_t seq;             /* position in the context's history (0 = first event) */
  uint64_t addr;            /* 0 for a failed request */
  uint64_t size;            /* requested bytes */
  int64_t stream;
  int32_t site;
  uint8_t kind;             /* NP_EV_* */
  uint8_t lifetime;         /* NP_LIFE_* the request was placed as */
} np_event_info;

void np_config_init(np_config *cfg);
int np_create(const np_config *cfg, np_ctx **out);
void np_destroy(np_ctx *ctx);

int np_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, void **out);
int np_malloc_ex(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out);
int np_free(np_ctx *ctx, void *ptr);
int np_empty_cache(np_ctx *ctx);
int np_set_fraction(np_ctx *ctx, double fraction);
void np_get_stats(np_ctx *ctx, np_stats *out);
void np_reset_peak(np_ctx *ctx);

/* Lifetime hints: the phase counter advances at phase boundaries; once phases are in
 * use, a block that outlives the phase it was born in teaches its site to be
 * long-lived, one that dies inside it short-lived, and NP_LIFE_AUTO requests follow
 * their site's history. The default class applies to sites with no history (and to
 * every NP_LIFE_AUTO request while no phase was ever set). */
int np_set_phase(np_ctx *ctx, uint32_t phase, int default_lifetime);
/* A phase marker (npu_pool.trace.format MARK_* codes). Every marker but layer enter/exit
 * ends the current stage (set-up, forward, backward, optimizer, eval) and advances the
 * phase; layer markers restart the position count of derived sites. Sites with no history
 * default to: set-up long, forward the base class, backward short, the first optimizer
 * step long and later ones short, eval short. */
int np_mark(np_ctx *ctx, int code, int64_t arg);

int np_block_size(np_ctx *ctx, void *ptr, uint64_t *size);
/* torch's record_stream: the block is also used on `stream`, so its memory must not be
 * reused before that use ends (npu_pool: reuse waits on every stream that used it;
 * the model policies synchronise the device when such a block is freed). */
int np_record_stream(np_ctx *ctx, void *ptr, intptr_t stream);
int np_check(np_ctx *ctx);
/* Copy up to cap blocks of every segment into out, segments in address order; *n gets the
 * total number of blocks (call with cap 0 to size the buffer). */
int np_blocks(np_ctx *ctx, np_block_info *out, size_t cap, size_t *n);
/* Copy the most recent events (up to cap, at most NP_RECENT_EVENTS kept), oldest first. */
int np_recent_events(np_ctx *ctx, np_event_info *out, size_t cap, size_t *n);               /* verify every invariant; NP_OK or an error naming it */
int np_replay(np_ctx *ctx, const np_replay_in *in, np_replay_out *out);

const char *np_last_error(void);
const char *np_policy_name(int policy);
/* Planned policy (docs/planner.md): install a plan of n positions, [0, loop) run once, [loop, n) repeating --
 * per position p its requested size, offset in the planned region (UINT64_MAX: unplanned) and end, the position
 * it is freed at (> p; past n it wraps to loop + end - n; UINT64_MAX: unknown) -- over a region of `region`
 * bytes; n == 0 removes the plan, size == NULL keeps it. flags: 1 = every iteration's first allocation follows
 * MARK_ITER_BEGIN, 2 = position 0 is the first request after this call. counts (optional, 4 entries) receives
 * the requests served from the plan, fallen back, placed in idle ranges, resynchronisations. */
int np_set_plan(np_ctx *ctx, uint64_t n, uint64_t loop, const uint64_t *size, const uint64_t *offset,
                const uint64_t *end, uint64_t region, int flags, uint64_t *counts);
/* CDEF END */

#ifdef __cplusplus
}
#endif
#endif
