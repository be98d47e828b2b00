/* npu_pool.h -- public C API of the npu_pool allocator core, and the vocabulary it shares
 * with Python (npu_pool/vocab.py reads every code and name below through the binding).
 *
 * One np_ctx is one allocator for one device: a backend (where device memory comes
 * from), a policy (how requests are placed), statistics, an event history and a mutex.
 * Every function is thread-safe on its context. Functions return NP_OK or an NP_ERR_*
 * code; np_last_error() then gives a message for the calling thread.
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

/* ---- the vocabulary: codes here, names from np_vocab_name() -------------------------- */

enum { NP_BACKEND_SIM = 0, NP_BACKEND_ACL = 1, NP_BACKEND_CUDA = 2, NP_BACKEND_COUNT = 3 };
/* How long a request lives: placement class of the npu_pool policy. */
enum { NP_LIFE_AUTO = 0, NP_LIFE_LONG = 1, NP_LIFE_SHORT = 2, NP_LIFE_COUNT = 3 };
/* A framework's handover between streams (npu_pool_set_framework_stream_wait, pluggable.h): the
 * reuse ordered, and the calls it made for it, failed ones included -- its event made, recorded,
 * waited on. */
enum { NP_HANDOVER_ORDERED = 1, NP_HANDOVER_MADE = 2, NP_HANDOVER_RECORDED = 4, NP_HANDOVER_WAITED = 8 };
/* Phase markers (trace OP_MARK events carry them in `cat`). */
enum {
  NP_MARK_SETUP_BEGIN = 0, NP_MARK_SETUP_END = 1, NP_MARK_ITER_BEGIN = 2, NP_MARK_ITER_END = 3,
  NP_MARK_FORWARD_BEGIN = 4, NP_MARK_FORWARD_END = 5, NP_MARK_BACKWARD_BEGIN = 6, NP_MARK_BACKWARD_END = 7,
  NP_MARK_LAYER_ENTER = 8, NP_MARK_LAYER_EXIT = 9, NP_MARK_OPTIMIZER_BEGIN = 10, NP_MARK_OPTIMIZER_END = 11,
  NP_MARK_EVAL_BEGIN = 12, NP_MARK_EVAL_END = 13, NP_MARK_COUNT = 14
};
/* optimizer_end's argument for a step that was skipped (an overflow under loss scaling: it made no
 * states), so that the next one is still the first. */
enum { NP_OPTIMIZER_SKIPPED = -2 };
/* Stages: the parts of a run that markers delimit (lifetimes are learned per stage). A begin
 * marker opens its stage; every other marker but layer enter/exit leaves for OUTSIDE. */
enum {
  NP_STAGE_OUTSIDE = 0, NP_STAGE_SETUP = 1, NP_STAGE_FORWARD = 2, NP_STAGE_BACKWARD = 3, NP_STAGE_OPTIMIZER = 4,
  NP_STAGE_EVAL = 5, NP_STAGE_COUNT = 6
};
/* Trace event ops (npu_pool.trace.format: one per event). */
enum {
  NP_OP_ALLOC = 0, NP_OP_FREE = 1, NP_OP_MARK = 2, NP_OP_EMPTY_CACHE = 3, NP_OP_SEG_HINT = 4, NP_OP_SEG_FREE = 5,
  NP_OP_INIT_SEGMENT = 6, NP_OP_INIT_ALLOC = 7, NP_OP_OOM = 8, NP_OP_REGION = 9, NP_OP_PAUSE = 10,
  NP_OP_RESUME = 11, NP_OP_COUNT = 12
};
/* Tensor categories (torch.profiler's, plus unknown). */
enum {
  NP_CAT_UNKNOWN = 0, NP_CAT_PARAMETER = 1, NP_CAT_GRADIENT = 2, NP_CAT_OPTIMIZER_STATE = 3, NP_CAT_ACTIVATION = 4,
  NP_CAT_TEMPORARY = 5, NP_CAT_INPUT = 6, NP_CAT_AUTOGRAD_DETAIL = 7, NP_CAT_COUNT = 8
};
/* What a replay learns lifetimes from: nothing, markers and the trace's sites, that and the
 * categories (an oracle), markers alone (what a device running the recorder sees). */
enum { NP_HINTS_NONE = 0, NP_HINTS_SITES = 1, NP_HINTS_ORACLE = 2, NP_HINTS_MARKERS = 3, NP_HINTS_COUNT = 4 };
/* Event history kinds (np_history), PyTorch's TraceEntry actions where they exist. HOLD / UNHOLD:
 * device memory the pool keeps mapped nowhere (a spare chunk, or memory the device refused to
 * take back) comes / goes, so that the reserved bytes are the sum of the segment_alloc/map and
 * hold events less the segment_free/unmap and unhold ones. COMPACT: a chunk (at addr) was replaced
 * by chunks over its live pages (a compaction), after that chunk's segment_unmap and their
 * segment_map events; size: the live bytes moved (copied out and back). */
enum {
  NP_EV_ALLOC = 0, NP_EV_FREE = 1, NP_EV_SEGMENT_ALLOC = 2, NP_EV_SEGMENT_FREE = 3, NP_EV_SEGMENT_MAP = 4,
  NP_EV_SEGMENT_UNMAP = 5, NP_EV_EMPTY_CACHE = 6, NP_EV_OOM = 7, NP_EV_MARK = 8, NP_EV_HOLD = 9, NP_EV_UNHOLD = 10,
  NP_EV_COMPACT = 11, NP_EV_COUNT = 12
};
/* Why a request failed (np_event_info.detail of an NP_EV_OOM). NP_OOM_DEVICE: the device refused
 * memory the pool's cap allowed (other processes, collective-communication buffers or another
 * allocator hold the rest of the device). */
enum { NP_OOM_TOO_LARGE = 1, NP_OOM_FRAGMENTED = 2, NP_OOM_SHORTAGE = 3, NP_OOM_DEVICE = 4, NP_OOM_COUNT = 5 };
/* np_set_plan flags: position 0 is the first request after MARK_ITER_BEGIN / after the plan is installed;
 * body positions held for good (end = p + body) were made once, in the first pass (a plan of one
 * recorded step): later passes skip them. */
enum { NP_PLAN_AT_ITER_BEGIN = 1, NP_PLAN_AT_START = 2, NP_PLAN_MADE_ONCE = 4 };
/* Whose request rules a context applies (np_config.device_rules): the backend's own (ACL pads where
 * torch_npu pads, sim and CUDA do not), torch_npu's on an Ascend NPU (every request rounds up to
 * NP_NPU_PAD bytes and gets NP_NPU_PAD more before the policy sees it), CUDA's (none). */
enum { NP_DEVICE_AUTO = 0, NP_DEVICE_NPU = 1, NP_DEVICE_CUDA = 2, NP_DEVICE_COUNT = 3 };
/* Device calls by kind (np_stats.calls): each backend counts a call where it makes it, failed
 * ones too, so a live run's counts equal the vendor's own per-function counts (NP_VOCAB_CALL_ACL
 * and NP_VOCAB_CALL_CUDA name the vendor function of each kind; NULL: that vendor has none). The
 * simulated device counts the calls the ACL backend would make for the same requests. */
enum {
  NP_CALL_MALLOC = 0, NP_CALL_FREE = 1, NP_CALL_RESERVE = 2, NP_CALL_RELEASE = 3, NP_CALL_PHYS_CREATE = 4,
  NP_CALL_PHYS_RELEASE = 5, NP_CALL_MAP = 6, NP_CALL_UNMAP = 7, NP_CALL_SET_ACCESS = 8, NP_CALL_SYNC_DEVICE = 9,
  NP_CALL_SYNC_STREAM = 10, NP_CALL_EVENT_CREATE = 11, NP_CALL_EVENT_RECORD = 12, NP_CALL_EVENT_WAIT = 13,
  NP_CALL_EVENT_DESTROY = 14, NP_CALL_STREAM_QUERY = 15, NP_CALL_GET_DEVICE = 16, NP_CALL_SET_DEVICE = 17,
  NP_CALL_MEM_INFO = 18, NP_CALL_GRANULARITY = 19, NP_CALL_COUNT = 20
};
/* Tables of np_vocab_name. */
enum {
  NP_VOCAB_BACKEND = 0, NP_VOCAB_LIFE = 1, NP_VOCAB_MARK = 2, NP_VOCAB_OP = 3, NP_VOCAB_CAT = 4, NP_VOCAB_HINTS = 5,
  NP_VOCAB_EVENT = 6, NP_VOCAB_ERROR = 7, NP_VOCAB_OOM = 8, NP_VOCAB_STAGE = 9, NP_VOCAB_DEVICE = 10,
  NP_VOCAB_CALL = 11, NP_VOCAB_CALL_ACL = 12, NP_VOCAB_CALL_CUDA = 13, NP_VOCAB_COUNT = 14
};
#define NP_MAX_REQUEST 0x1000000000000ULL /* 2^48: larger requests (and capacities) are absurd */
enum {
  NP_ROUND = 512,               /* every block is a multiple of this many bytes */
  NP_SIM_PAGE = 2097152,        /* the simulated device's mapping page */
  NP_POOLS = 2,                 /* pools per policy, besides the total */
  NP_NAME_LEN = 16,
  NP_HISTORY_DEFAULT = 4096,    /* history events a context keeps unless np_set_history says otherwise */
  NP_NPU_PAD = 32,              /* torch_npu's request padding (NP_DEVICE_NPU): round up to it, add it */
  NP_TAG_MAX = 32,              /* tags (np_region) a context can hold */
  NP_TAG_NAME = 64              /* bytes of a tag's name, with its terminating 0 */
};

/* ---- configuration and statistics ------------------------------------------------------- */

typedef struct np_config {
  int policy;               /* index into the policy registry: np_policy_index("npu_pool") */
  int backend;              /* NP_BACKEND_* */
  int device;               /* device index (vendor backends) */
  uint64_t capacity;        /* sim: device total bytes */
  int host_backed;          /* sim: real host memory behind every mapping */
  int vmm;                  /* use the virtual-memory API when the backend has it (1), or never (0) */
  double fraction;          /* reserved bytes <= fraction * device total; 0 < f <= 1 */
  uint64_t max_split_size;  /* torch policy: blocks at least this big are never split; 0 = unlimited */
  const char *lib_path;     /* vendor backends: library to dlopen (NULL = default name) */
  int device_rules;         /* NP_DEVICE_*: whose request rules apply (AUTO: the backend's own) */
} np_config;

/* A figure with its high-water mark and, as in PyTorch's Stat, the sums of all its
 * increases (allocated) and decreases (freed) since np_reset_accumulated. */
typedef struct np_counter { uint64_t current; uint64_t peak; uint64_t allocated; uint64_t freed; } np_counter;

typedef struct np_pool_stats {
  char name[16];            /* "all" for the total; else the policy's name of the pool */
  np_counter allocated;     /* bytes in allocated blocks (rounded sizes) */
  np_counter requested;     /* bytes asked for by the callers */
  np_counter active;        /* allocated bytes plus freed bytes still in use by a stream */
  np_counter reserved;      /* bytes held from the device (memory shared by both pools: total only) */
  np_counter blocks;        /* allocated blocks */
  np_counter segments;      /* device segments (reservations count once) */
} np_pool_stats;

typedef struct np_stats {
  np_pool_stats total;
  np_pool_stats pool[2];    /* the policy's two pools (np_policy_pool_name) */
  uint64_t device_total;    /* backend's device memory */
  uint64_t limit;           /* fraction * device_total */
  double fraction;          /* the memory fraction set (1.0: none) */
  uint64_t releasable;      /* reserved bytes empty_cache would return now (spares included) */
  uint64_t non_releasable;  /* free bytes held that empty_cache could not return: reserved + paused - active
                               - releasable (paused tags' blocks are active, not reserved); torch's
                               inactive_split_bytes */
  np_counter arena_hwm;     /* arena policies: highest byte offset in use in the arena */
  uint64_t largest_free;    /* largest free block (arena policies: including the arena's unused top) */
  uint64_t device_mallocs;  /* segments and chunks taken: mallocs and maps the device served (calls counts refused ones too) */
  uint64_t device_frees;    /* segments and chunks given back: frees and unmaps the device took */
  uint64_t ooms;            /* requests that failed for lack of memory */
  uint64_t retries;         /* release-cache-and-retry events */
  uint64_t syncs;           /* device synchronisations the pool asked for */
  uint64_t stream_waits;    /* reuses across streams ordered by an event wait */
  uint64_t trims;           /* free pages unmapped under cap pressure without a synchronisation */
  uint64_t allocs;          /* successful mallocs */
  uint64_t frees;           /* successful frees */
  uint64_t unreleased;      /* bytes still held by the device because returning them failed (retried) */
  uint64_t spare;           /* bytes of physical chunks a trim unmapped and kept for a later growth to map
                               again (counted in reserved; given back at empty_cache) */
  uint64_t compactions;     /* chunks replaced by chunks over their live pages only (np_set_compaction) */
  uint64_t compacted;       /* bytes those moved through host memory: copied out and back */
  uint64_t learned_sites;   /* allocation sites whose lifetimes the pool keeps (at most 2^18: a full table
                               starts over) */
  int vmm;                  /* 1 if memory is mapped page by page through the virtual-memory API */
  int compaction;           /* 1 while a request compacts before it fails (np_set_compaction) */
  int compactable;          /* 1 where the pool can compact (its policy, the virtual-memory API, a backend
                               that copies): np_compact and np_set_compaction do not refuse */
  int policy;
  uint64_t paused;          /* bytes of paused tags' allocated blocks, unmapped until np_resume */
  uint64_t backup;          /* host bytes holding paused tags' contents (np_pause with backup) */
  uint64_t backup_held;     /* pinned host bytes the tags' backup buffers hold: those contents, and the rest
                               kept for the next pause (until close, or a lower np_set_backup_limit) */
  uint64_t calls[20];       /* device calls by kind (NP_CALL_*, NP_CALL_COUNT of them) since creation or
                               np_reset_accumulated */
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
  int hints;                /* NP_HINTS_* */
  int probe_ooms;           /* try each NP_OP_OOM request, freed again at once (on the recorded run's memory:
                               would this policy serve it?); 0 passes over them: nobody served them, so no
                               figure counts them (peak live never does) */
  uint64_t *placed;         /* optional (NULL): per event, the address an allocation got */
  uint8_t *classes;         /* optional (NULL): per event, NP_LIFE_LONG/SHORT an allocation was placed as */
  const uint64_t *bounds;   /* optional (NULL): n_bounds increasing event indices (iteration starts) ... */
  uint64_t n_bounds;
  uint64_t *bound_calls;    /* ... and n_bounds x NP_CALL_COUNT: the device calls by kind made before each */
  uint64_t *bound_peaks;    /* optional (NULL): n_bounds + 1, the peak of requested live bytes in each stretch
                               (before the first bound, between bounds, after the last), as peak_live */
} np_replay_in;

typedef struct np_replay_out {
  int ok;                   /* 1 if every event was served */
  uint64_t fail_index;      /* event that failed when ok == 0 */
  uint64_t ops;             /* alloc + free calls made */
  uint64_t ns;              /* wall time of the loop */
  uint64_t peak_live;       /* peak of requested live bytes (a paused tag's are off the device) */
  uint64_t same_addr;       /* window allocations placed at their recorded address */
  uint64_t compared;        /* window allocations with a recorded address */
  uint64_t recorded_ooms;   /* NP_OP_OOM events: requests the recorded run could not serve */
  uint64_t ooms_served;     /* of those, how many this policy served (probe_ooms; each freed again at once) */
} np_replay_out;

/* One block of the segment map (np_blocks). */
typedef struct np_block_info {
  uint64_t segment;         /* segment base address */
  uint64_t segment_size;
  uint64_t addr;
  uint64_t size;
  uint64_t requested;       /* 0 for free blocks */
  int64_t stream;           /* owner stream; free blocks: who may reuse it (tagged == 0: any stream) */
  int32_t site;
  uint8_t pool;
  uint8_t allocated;
  uint8_t mapped;           /* every byte backed by physical memory */
  uint8_t tagged;           /* free blocks: 1 if only `stream` (or streams it waits on) may reuse it */
  uint8_t vmm;              /* the segment is an address reservation mapped page by page */
} np_block_info;

/* One entry of the event history (np_history), like PyTorch's TraceEntry. */
typedef struct np_event_info {
  uint64_t seq;             /* position in the context's history (0 = first event ever) */
  uint64_t time;            /* microseconds since the context was created; in replays the trace's event index */
  uint64_t addr;            /* block, segment or mapped range; oom: the pool's reserved bytes at the failure */
  uint64_t size;            /* requested bytes (alloc, free, oom), segment or mapped bytes */
  uint64_t device_free;     /* oom: bytes the pool's cap still allowed; NP_OOM_DEVICE: the device's free bytes
                               (UINT64_MAX: the device did not say) */
  uint64_t compactable;     /* oom: bytes a compaction would give back (np_compact's figure: the free pages live
                               blocks' chunks keep mapped, in every arena it compacts), for NP_OOM_FRAGMENTED
                               where the pool could compact and compaction was off; else 0; UINT64_MAX: not
                               counted (a backup's restore the device refused) */
  int64_t stream;           /* the request's or block's stream; mark: the marker's argument; oom: INTPTR_MIN (a
                               stream no request may name) for a paused region's resume */
  int32_t site;             /* mark: the marker code */
  uint8_t kind;             /* NP_EV_* */
  uint8_t pool;             /* pool of the block or segment; NP_POOLS when the memory is shared */
  uint8_t lifetime;         /* alloc/free/oom: NP_LIFE_* the request was placed as */
  uint8_t detail;           /* segment_unmap: 1 if a trim (under cap pressure, no synchronisation);
                               oom: NP_OOM_* why it failed */
} np_event_info;

void np_config_init(np_config *cfg);
int np_create(const np_config *cfg, np_ctx **out);
/* Return every byte to the device and mark the context closed: safe while other threads call in
 * (it waits for the call in flight; every later call but np_get_stats, np_history and np_close
 * fails with NP_ERR_STATE, "closed pool"). A second call does nothing. NP_ERR_BACKEND when the
 * device refused to take some memory back even after retries (the message says how much; the
 * bytes are lost). */
int np_close(np_ctx *ctx);
/* np_close, then free the struct: the last call on the context (no thread may still be calling
 * in or call later; use np_close where one might). */
int np_destroy(np_ctx *ctx);

int np_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, void **out);
int np_malloc_ex(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out);
int np_free(np_ctx *ctx, void *ptr);
/* Synchronise the device and return what the policy caches; retries earlier failed returns.
 * NP_ERR_BACKEND if the device refused some of it: the pool stays consistent, stats() counts
 * what the device still holds. */
int np_empty_cache(np_ctx *ctx);
int np_set_fraction(np_ctx *ctx, double fraction);
/* Compaction (off by default; policies npu_pool and planned, a backend with the virtual-memory
 * API): when a request finds no room even after the device was synchronised and every wholly free
 * chunk given back, a chunk that holds live blocks and free pages is replaced by chunks over its
 * live pages only, their bytes copied to host memory and back at the same addresses, and the
 * request is tried again; growths are then no longer exact near the cap. It needs the device
 * idle while it copies: safe where one thread at a time queues work on the device (a training
 * loop and its autograd thread), not where other threads queue work while one allocates. */
int np_set_compaction(np_ctx *ctx, int on);
/* Compact now, whether or not np_set_compaction is on (its policies and backends): synchronise the
 * device, return every wholly free chunk (np_empty_cache), then replace every chunk that holds live
 * blocks and free pages by chunks over its live pages, the bytes copied through host memory at the
 * same addresses (a paused tag's and the planned region's memory stay as they are). *returned
 * (NULL: not wanted): the reserved bytes given back to the device. For a point where no other
 * thread queues device work and the memory is wanted elsewhere (after evaluation, before handing
 * it to another engine; not every step: the next step maps again what it gives back):
 * np_set_compaction's caveat, at a moment the caller chooses. */
int np_compact(np_ctx *ctx, uint64_t *returned);
void np_get_stats(np_ctx *ctx, np_stats *out);
void np_reset_peak(np_ctx *ctx);
/* Zero the accumulated figures (every counter's allocated/freed, ooms, retries, device calls). */
void np_reset_accumulated(np_ctx *ctx);
/* Forget what the context learned from its requests (per-site lifetimes, the marker state: stage,
 * optimizer steps seen): later requests are classed as a new context's would be. Memory, blocks
 * and statistics are kept. For repeated replays that must each behave as a first run. */
int np_forget(np_ctx *ctx);

/* Lifetime hints: the phase counter advances at phase boundaries; once phases are in
 * use, a block that outlives the phase it was born in teaches its site to be
 * long-lived, one that dies inside it short-lived, and NP_LIFE_AUTO requests follow
 * their site's history. The default class applies to sites with no history (and to
 * every NP_LIFE_AUTO request while no phase was ever set). */
int np_set_phase(np_ctx *ctx, uint32_t phase, int default_lifetime);
/* A phase marker (NP_MARK_*). Every marker but layer enter/exit ends the current stage
 * (set-up, forward, backward, optimizer, eval) and advances the phase; layer markers restart
 * the position count of derived sites. Sites with no history default to: set-up long,
 * forward the base class, backward short, the first optimizer step long and later ones
 * short, eval short. */
int np_mark(np_ctx *ctx, int code, int64_t arg);

int np_block_size(np_ctx *ctx, void *ptr, uint64_t *size);
/* torch's record_stream: the block is also used on `stream`, so its memory must not be
 * reused before that use ends (arena policies: reuse waits on every stream that used it;
 * the others synchronise the device when such a block is freed). */
int np_record_stream(np_ctx *ctx, void *ptr, intptr_t stream);
/* Verify every invariant; NP_OK or NP_ERR_STATE naming the first broken one. */
int np_check(np_ctx *ctx);
/* Copy up to cap blocks of every segment into out, segments in address order; *n gets the
 * total number of blocks (call with cap 0 to size the buffer). */
int np_blocks(np_ctx *ctx, np_block_info *out, size_t cap, size_t *n);
/* The address ranges backed by physical memory (whole malloc'ed segments, runs of mapped pages of
 * reservations) as (address, size) pairs in address order: up to cap pairs into out (2 x cap
 * words); *n gets the total number of ranges (call with cap 0 to size the buffer). */
int np_mapped_ranges(np_ctx *ctx, uint64_t *out, size_t cap, size_t *n);
/* Keep the latest `max_entries` events (0: none; the default is 4096). Clears the history. */
int np_set_history(np_ctx *ctx, uint64_t max_entries);
/* The largest bound np_set_history takes (2^40 bytes of events); more is refused as absurd. */
uint64_t np_history_max(void);
/* Copy the latest events (up to cap), oldest first; *n gets how many were copied. */
int np_history(np_ctx *ctx, np_event_info *out, size_t cap, size_t *n);
/* One reading of the pool at one instant (a snapshot taken while other threads allocate agrees with
 * itself): its statistics (as np_get_stats), blocks (np_blocks), mapped ranges (np_mapped_ranges) and
 * latest events, up to ecap (np_history), under one hold of the lock. *nb, *nr and *ne get how many
 * blocks, ranges and events there are (events: kept); unless the blocks and the ranges fit their
 * buffers (then no event is copied) the reading is partial: call again with larger ones. A closed
 * pool refuses it. */
int np_view(np_ctx *ctx, np_stats *stats, np_block_info *blocks, size_t bcap, size_t *nb, uint64_t *ranges,
            size_t rcap, size_t *nr, np_event_info *events, size_t ecap, size_t *ne);
int np_replay(np_ctx *ctx, const np_replay_in *in, np_replay_out *out);
/* Check every rule of a trace (columns of `in`; n_sites sites): ops, categories, markers and
 * segment pools in range; ids dense, n_ids no more than the allocations, each id allocated once
 * and freed once while live; requests of 1..NP_MAX_REQUEST bytes, segments and the bytes live at
 * once NP_MAX_REQUEST at most; sites -1..n_sites-1.
 * NP_ERR_INVALID naming the first bad event (*bad: its index). */
int np_trace_validate(const np_replay_in *in, uint64_t n_sites, uint64_t *bad);

/* The current device the vendor backends keep for the calling thread (as torch_npu keeps it: no
 * aclrtGetDevice per request), -1 when unknown (a new thread, a forked child). A caller that made
 * another device current behind the pool's back (a raw aclrtSetDevice / cudaSetDevice) calls
 * np_forget_device() so that the next device call looks it up again. */
int np_cached_device(void);
void np_forget_device(void);

const char *np_last_error(void);
/* Names of the vocabulary: np_vocab_name(NP_VOCAB_MARK, NP_MARK_SETUP_BEGIN) is "setup_begin";
 * NULL outside the table. */
const char *np_vocab_name(int vocab, int code);
/* The stage a marker opens (NP_STAGE_OUTSIDE for markers that end one, -1 for layer markers,
 * which stay in the stage) and the stage an end marker closes (-1 for other markers). */
int np_mark_opens(int code);
int np_mark_closes(int code);
/* The policy registry: indices 0..np_policy_count()-1, each with a name, two pools and what they hold. */
int np_policy_count(void);
const char *np_policy_name(int policy);
int np_policy_index(const char *name);  /* -1 if unknown */
const char *np_policy_pool_name(int policy, int pool);
const char *np_policy_pool_meaning(int policy, int pool);
const char *np_policy_summary(int policy);
/* Planned policy (docs/planner.md): install a plan of n positions, [0, loop) run once, [loop, n) repeating --
 * per position p its requested size, offset in the planned region (UINT64_MAX: unplanned) and end, the position
 * it is freed at (> p; past n it wraps to loop + end - n; UINT64_MAX: unknown) -- over a region of `region`
 * bytes; n == 0 removes the plan, size == NULL keeps it. `outside`: the bytes the plan expects live outside it at
 * once (requests it leaves out, served by the fallback), mapped for the fallback when the region is reserved, where
 * the cap allows, so that later iterations find them mapped (0: none). flags: NP_PLAN_*. counts (optional, 4
 * entries) receives the requests served from the plan, fallen back, placed in idle ranges, resynchronisations. */
int np_set_plan(np_ctx *ctx, uint64_t n, uint64_t loop, const uint64_t *size, const uint64_t *offset,
                const uint64_t *end, uint64_t region, uint64_t outside, int flags, uint64_t *counts);
/* The planner's placement kernel: place rectangle order[0], order[1], ... at the lowest offset
 * where it overlaps no time-overlapping rectangle placed before it. span: 4 per rectangle
 * (lo, hi, lo2, hi2); offset and *peak receive the result. */
int np_plan_place(uint32_t n_pos, uint64_t n, const uint64_t *size, const uint32_t *span, const uint32_t *order,
                  uint64_t *offset, uint64_t *peak);
/* Tagged regions (docs/colocated.md; the npu_pool policy over a virtual-memory API). Requests
 * made while a region is entered go to that tag's own arena (its own address reservation);
 * np_pause returns the tag's physical memory to the device keeping its blocks and addresses
 * (with `backup`, their contents are first copied to pinned host memory, within the backup
 * bound), np_resume maps the same addresses again (first returning the pool's idle memory if
 * the device is short) and restores the contents. The region is the context's, not the
 * thread's: torch's backward threads allocate into it too. np_region(ctx, NULL) leaves it. */
typedef struct np_tag_info {
  char name[64];            /* NP_TAG_NAME */
  uint64_t allocated;       /* bytes of the tag's allocated blocks */
  uint64_t blocks;          /* its allocated blocks */
  uint64_t mapped;          /* bytes of its address range backed by physical memory now */
  uint64_t paused;          /* paused: bytes np_resume will map again (pages under allocated blocks) */
  uint64_t backup;          /* host bytes holding its contents while paused */
  uint64_t backup_held;     /* host bytes of its backup buffer, kept after resume for the next pause */
  uint64_t pauses;          /* times it was paused */
  uint8_t is_paused;
  uint8_t current;          /* the region now entered */
} np_tag_info;
int np_region(np_ctx *ctx, const char *tag);
/* *bytes (may be NULL) gets the device bytes returned (pause) or mapped again (resume). */
int np_pause(np_ctx *ctx, const char *tag, int backup, uint64_t *bytes);
int np_resume(np_ctx *ctx, const char *tag, uint64_t *bytes);
/* Up to cap tags into out; *n gets how many there are. */
int np_tags(np_ctx *ctx, np_tag_info *out, size_t cap, size_t *n);
/* Host bytes np_pause may hold as backups, over all tags (default: the device's memory); buffers
 * holding no backup go back if the pool holds more. */
int np_set_backup_limit(np_ctx *ctx, uint64_t bytes);
/* CDEF END */

#ifdef __cplusplus
}
#endif
#endif
