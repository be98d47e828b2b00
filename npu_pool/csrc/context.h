/* context.h -- one allocator context per device.
 *
 * The context owns the backend, the policy state, the block structs, the map of allocated
 * blocks, the statistics, the event history and what the device still holds after a failed
 * return, all guarded by one mutex: public entry points lock it, internal functions
 * (np_ctx_*, np_segment_*, np_vmm_*) expect it held.
 *
 * Invariants: live holds exactly the allocated blocks; st.total.allocated is the sum of their
 * sizes; st.total.reserved is the bytes the device holds for this context: every segment's
 * mapped bytes, st.spare (chunks a trim unmapped and kept) and st.unreleased (memory whose
 * return failed, kept in `held` and retried: the sum of the held items' sizes and `unlisted`). Reserved
 * changes only in memory.c, which writes every change to the history (segment_* events, hold
 * and unhold for memory mapped nowhere), so the history adds up to it. A successful malloc
 * leaves reserved <= limit, unless the cap was lowered below what the pool held: the torch and
 * expandable models keep their cache until empty_cache or an out-of-memory retry, as PyTorch's.
 */
#ifndef NP_CONTEXT_H
#define NP_CONTEXT_H

#include <pthread.h>

#include "backend.h"
#include "lifetime.h"
#include "ptrmap.h"
#include "segment.h"

typedef struct np_policy np_policy;

/* Where the markers put the context: the latest marker, its stage, whether an evaluation is
 * open and whether the forward/backward belongs to a later micro-batch (whose requests differ
 * from the first's: gradient accumulation adds into the gradients the first one created),
 * and the allocations since the latest marker. Meaningful once `any` is set. */
typedef struct np_marks {
  bool any;                  /* a marker or phase was ever set: lifetimes are learned per stage */
  int code;                  /* NP_MARK_* of the latest marker */
  int stage;                 /* NP_STAGE_* */
  bool eval;
  bool later_micro;
  uint32_t pos;              /* allocations since the latest marker */
  int64_t layer;             /* the latest layer marker's argument inside the stage, else -1 */
  int64_t micro;             /* the latest forward or backward begin's argument (its micro-batch) */
  uint32_t optimizer_steps;  /* optimizer stages begun, less those that ended skipped (NP_OPTIMIZER_SKIPPED) */
} np_marks;

/* Whether two marker states are the same place in an iteration (all but the counts). */
static inline bool np_marks_same(const np_marks *a, const np_marks *b) {
  return a->code == b->code && a->stage == b->stage && a->eval == b->eval && a->later_micro == b->later_micro;
}

/* Device memory whose return failed: still held by the device, counted as reserved, retried. */
enum { NP_HELD_SEGMENT = 0, NP_HELD_PAGE = 1, NP_HELD_RESERVATION = 2 };
typedef struct np_held {
  int kind;
  int pool;                  /* pool whose reserved bytes count it */
  uintptr_t addr;            /* segment or reservation; a chunk still mapped at addr (0: unmapped) */
  uint64_t size;             /* bytes (a chunk: its size, a multiple of the granularity) */
  uint64_t handle;           /* chunk: its vendor handle */
} np_held;

/* A physical chunk unmapped by a trim and kept, unmapped, for a later growth to map again. */
typedef struct np_spare {
  uint64_t handle;
  uint64_t size;             /* bytes: the chunk maps again only over exactly this many */
  int pool;                  /* the pool whose reserved bytes count it */
} np_spare;

/* What a policy says about a request it could not serve (set on NP_ERR_OOM). */
typedef struct np_fail {
  int pool;                  /* pool the request was for (NP_POOL_SHARED: memory both pools use) */
  uint64_t needed;           /* bytes it needed in one piece (a rounded block, a segment, whole pages) */
  uint64_t usable;           /* free bytes that pool could have used, were they in one piece: free
                                blocks it may use plus what the cap still allows reserving */
  bool refused;              /* the device refused physical memory the cap allowed (memory.c) */
  uint64_t elsewhere;        /* free bytes mapped in the other arenas (tagged regions), which their live
                                blocks keep mapped: counted against the cap, usable by none of this pool */
} np_fail;

struct np_ctx {
  pthread_mutex_t lock;
  np_config cfg;
  np_backend *be;
  const np_policy *policy;
  void *pstate;              /* the policy's own state */
  np_block_cache blocks;
  np_ptrmap live;            /* allocated blocks by address */
  np_segment *segments;      /* every segment, newest first */
  uint64_t limit;            /* fraction * device total */
  np_stats st;
  np_lifetime life;          /* per-site lifetime history */
  np_lifetime places;        /* per place key (a site in its layer and micro-batch): where its last block lay */
  np_place again;            /* the request being placed: where its key's last block lay (side NONE: unknown) */
  uint32_t phase;            /* advanced by np_set_phase and np_mark */
  np_marks marks;
  int last_life;             /* class the latest successful malloc was placed as */
  int default_life;          /* class of NP_LIFE_AUTO requests with no site history */
  int base_life;             /* default_life outside set-up and the first optimizer step */
  bool trimming;             /* unmaps now are trims (history) */
  bool device_caps;          /* a segment past the cap is asked of the device: a framework's allocator
                              * (np_policy.framework) before any memory fraction is set, which caps it from then on
                              * (under torch_npu's rules, but a fraction of 1.0: no cap, as before) */
  bool synced;               /* the device was synchronised during the current call (cleared at every entry
                              * under the lock: work may have been queued between calls) */
  np_fail fail;              /* the policy's account of the latest failed request */
  /* Spare chunks (vmm.h): physical chunks a trim unmapped (between np_vmm_recycle_begin and _end,
   * `recycling`) and kept, so that a growth maps them again instead of releasing and creating as
   * many. Counted as reserved (st.spare of it): the device holds them for the pool. Given back
   * before any other physical allocation, and at empty_cache, an out-of-memory retry, a new cap
   * and close. Invariant: st.spare is the sum of the spares' sizes; at most NP_SPARE_MAX spares. */
  bool recycling;
  np_spare *spare;
  size_t n_spare, cap_spare;
  np_held *held;             /* memory whose return failed */
  uint64_t unlisted;         /* bytes of it the host had no room to list (never retried): in st.unreleased */
  size_t n_orphans;          /* allocated blocks whose free was refused (np_block.orphan) */
  size_t n_held, cap_held;
  uint64_t holds;            /* returns that failed so far (np_ctx_hold calls) */
  char hold_error[512];      /* the vendor's message of the latest one */
  np_event_info *hist;       /* ring of the latest events: entry seq % hist_slots */
  uint64_t hist_max;         /* np_set_history's bound */
  uint64_t hist_slots;       /* slots allocated (grows to hist_max) */
  uint64_t n_events;         /* events recorded so far */
  uint64_t hist_next;        /* slot of the next event: n_events % hist_slots (no division per event) */
  uint64_t t0_ns;            /* creation time */
  int64_t replay_time;       /* inside np_replay: the trace event's index, else -1 */
  /* Lifecycle (api.c, fork.c). closed: np_close ran (device memory returned, the struct kept so
   * that callers still in flight fail cleanly); inherited: this process is a fork of the one that
   * made a vendor-backed context, whose device memory is not ours; fork_prev/next: the list of
   * live contexts whose locks the fork handlers take (guarded by fork.c's lock). */
  bool closed;
  bool inherited;
  /* Compaction at an out-of-memory (np_set_compaction; vmm.h: np_vmm_compact): asked for; lost: a
   * compaction (np_compact's too) could not put live bytes back (the device refused their pages
   * every time asked, or every copy back failed), so tensors hold wrong bytes and the context
   * refuses every call but stats and close. */
  bool compact;
  bool lost;
  bool rescuing;             /* a compaction puts live bytes back: the cap does not refuse their pages */
  np_ctx *fork_prev, *fork_next;
  uint64_t calls_base[NP_CALL_COUNT]; /* be->calls at the latest np_reset_accumulated (stats.calls: since) */
};

/* NP_ERR_STATE saying why a closed (or inherited) context refuses a call; np_ctx_usable is
 * NP_OK when the context may allocate, free or touch its device. */
int np_ctx_refuse(const np_ctx *ctx, const char *what);
static inline int np_ctx_usable(const np_ctx *ctx, const char *what) {
  return ctx->closed || ctx->inherited || ctx->lost ? np_ctx_refuse(ctx, what) : NP_OK;
}
/* NP_ERR_INVALID for a caller's stream that the pool reserves: NP_STREAM_ANY and NP_STREAM_MIXED
 * tag free memory (streams.h), so a block used on one would be ordered after no stream. */
int np_ctx_check_stream(intptr_t stream);
/* fork.c: every live context is listed for the fork handlers (np_create / np_destroy), which
 * np_fork_init installs once: before the first lock of the core that a fork must not find held
 * (a context's, the device table's). */
void np_fork_init(void);
void np_fork_register(np_ctx *ctx);
void np_fork_unregister(np_ctx *ctx);

/* Internal (lock held) versions of the public calls, used by replay. */
int np_ctx_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out);
int np_ctx_free(np_ctx *ctx, void *ptr);
int np_ctx_empty_cache(np_ctx *ctx);
/* Why this pool cannot compact (policy, backend or vmm), or NULL where it can (a per-thread text). */
const char *np_ctx_compaction_refused(const np_ctx *ctx);
/* Whether it can (the same rules, no text: stats() and every out-of-memory ask it). */
bool np_ctx_can_compact(const np_ctx *ctx);
/* np_compact, under the lock. */
int np_ctx_compact(np_ctx *ctx, uint64_t *returned);
void np_ctx_set_phase(np_ctx *ctx, uint32_t phase, int default_life);
int np_ctx_mark(np_ctx *ctx, int code, int64_t arg);
/* Place a block at a recorded address (fidelity replays; policies with alloc_at). */
int np_ctx_alloc_at(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, void **out);
void np_get_stats_locked(np_ctx *ctx, np_stats *out);
/* `active` equals `allocated` in this core (context.c, account): set it in a copy of the statistics. */
static inline void np_stats_fill_active(np_stats *st) {
  st->total.active = st->total.allocated;
  for (int i = 0; i < NP_POOLS; i++) st->pool[i].active = st->pool[i].allocated;
}
int np_ctx_check(np_ctx *ctx);
/* Synchronise the device (counted in stats.syncs); sets `synced` for the rest of the call. */
int np_ctx_synchronize(np_ctx *ctx);
/* The device idle for the rest of the call: synchronised, unless this call already did. (The
 * framework models call np_ctx_synchronize where their framework synchronises again.) */
static inline int np_ctx_drain(np_ctx *ctx) { return ctx->synced ? NP_OK : np_ctx_synchronize(ctx); }
/* Leave a public call. Debug builds (NP_DEBUG) first check every invariant (np_ctx_check) and
 * abort naming the first one broken: a call that breaks one is caught as it returns. A lost
 * context (a compaction could not put live bytes back) has live blocks on unmapped pages by
 * definition: it said so, and refuses every call but stats and close; nothing to check. */
static inline void np_ctx_unlock(np_ctx *ctx) {
#ifdef NP_DEBUG
  if (!ctx->closed && !ctx->lost && np_ctx_check(ctx) != NP_OK) {
    fprintf(stderr, "npu_pool: invariant broken by a call: %s\n", np_last_error());
    abort();
  }
#endif
  pthread_mutex_unlock(&ctx->lock);
}
/* Take the context's lock for one call: what the device ran before is not known synchronised. */
static inline void np_ctx_lock(np_ctx *ctx) {
  pthread_mutex_lock(&ctx->lock);
  ctx->synced = false;
}

/* Segments: a device malloc (or an address reservation) and its first block. */
int np_segment_create(np_ctx *ctx, uint64_t size, intptr_t stream, int pool, bool reserve_only, np_segment **out);
/* Return a segment to the device (a reservation's mapped pages are unmapped first); what the
 * device refuses is held and retried (np_ctx_retry_held). */
void np_segment_destroy(np_ctx *ctx, np_segment *seg);
/* Teardown: every block of seg forgotten (allocated ones leave the map: their owner is gone),
 * then np_segment_destroy. */
void np_segment_drop(np_ctx *ctx, np_segment *seg);

/* The accounting path for a segment's memory: `action` (NP_EV_SEGMENT_ALLOC / FREE / MAP / UNMAP)
 * of `bytes` at addr in seg changes reserved bytes, the served device calls (device_mallocs /
 * device_frees), seg->mapped and the history. (Memory mapped nowhere, spares and held memory,
 * is accounted inside memory.c: hold / unhold events.) */
void np_ctx_reserved(np_ctx *ctx, int action, np_segment *seg, uintptr_t addr, uint64_t bytes);
/* Memory the device refused to take back: counted reserved (and unreleased) until a retry works.
 * `from`: the segment whose mapped bytes it was counted in until now (NULL: not counted yet). */
void np_ctx_hold(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, uint64_t handle, np_segment *from);
/* Try to return held memory again; NP_OK when nothing is held any more. */
int np_ctx_retry_held(np_ctx *ctx);
/* NP_ERR_BACKEND saying what the device still holds when a return failed since `holds_before`
 * (a value of ctx->holds), else NP_OK. */
int np_ctx_new_holds(np_ctx *ctx, uint64_t holds_before);

/* History (history.c). np_ctx_event takes the next entry of the ring (its seq and time set, the
 * rest zero) or returns NULL when nothing is recorded; np_ctx_record, on every malloc and free,
 * fills it inline. */
np_event_info *np_ctx_event(np_ctx *ctx, int kind);
static inline void np_ctx_record(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, intptr_t stream, int32_t site,
                                 int pool, int lifetime) {
  np_event_info *e = np_ctx_event(ctx, kind);
  if (!e) return;
  e->addr = addr;
  e->size = size;
  e->stream = stream;
  e->site = site;
  e->pool = (uint8_t)(pool >= 0 && pool < NP_POOLS ? pool : NP_POOLS);
  e->lifetime = (uint8_t)lifetime;
  e->detail = kind == NP_EV_SEGMENT_UNMAP && ctx->trimming; /* a trim */
}
void np_ctx_record_oom(np_ctx *ctx, uint64_t size, intptr_t stream, int32_t site, int lifetime, int pool, int why,
                       uint64_t device_free, uint64_t compactable);
/* A failure to get `size` bytes: counted (stats.ooms), explained and recorded as an oom event of
 * ctx->fail's pool. Returns why (NP_OOM_*, from ctx->fail) and, in *free_bytes, the free bytes that
 * go with it: the cap's room, or for NP_OOM_DEVICE what the device says it has free (a call; *known
 * false and UINT64_MAX when it did not say); in *compactable (where not NULL) what a compaction
 * would give back (the policy's pinned hook; np_event_info.compactable), 0 where compaction would
 * not apply (no fragmentation, compaction on or refused). NULL: not counted (UINT64_MAX recorded).
 * One account for malloc's and resume's failures. */
int np_ctx_oom_event(np_ctx *ctx, uint64_t size, intptr_t stream, int32_t site, int lifetime, uint64_t *free_bytes,
                     bool *known, uint64_t *compactable);
/* "; compaction would give back ..." for an out-of-memory message, into buf ("" for 0 bytes). */
void np_ctx_compaction_hint(uint64_t pinned, char *buf, size_t cap);
/* "the device refused memory the cap allows: ..." for an NP_OOM_DEVICE failure, into buf. */
void np_ctx_device_refusal(const np_ctx *ctx, uint64_t free_bytes, bool known, char *buf, size_t cap);
int np_ctx_set_history(np_ctx *ctx, uint64_t max_entries);
void np_ctx_history_free(np_ctx *ctx);
/* Copy the latest events (up to cap) into out, oldest first; returns how many (out NULL: how many are
 * kept). (Lock held.) */
size_t np_ctx_history_copy(const np_ctx *ctx, np_event_info *out, size_t cap);

#endif
