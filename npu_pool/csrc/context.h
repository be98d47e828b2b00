/* context.h -- one allocator context per device.
 *
 * The context owns the backend, the policy state, the block structs, the map of
 * allocated blocks and the statistics, all guarded by one mutex: public entry
 * points lock it, internal functions (np_ctx_*) expect it held.
 *
 * Invariants: live holds exactly the allocated blocks; st.total.allocated is the
 * sum of their sizes, st.total.reserved the bytes held from the backend;
 * a successful malloc leaves reserved <= limit.
 */
#ifndef NP_CONTEXT_H
#define NP_CONTEXT_H

#include <pthread.h>

#include "backend.h"
#include "lifetime.h"
#include "ptrmap.h"
#include "segment.h"

typedef struct np_policy np_policy;

#define NP_RECENT_EVENTS 4096 /* ring of recent events kept for OOM snapshots */

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
  uint32_t phase;            /* advanced by np_set_phase and np_mark */
  bool phased;               /* phases are in use: learn and predict lifetimes per site */
  int last_mark;             /* latest marker: code (bits 0-7), stage (8-11), eval (12), later micro-batch (13) */
  uint32_t mark_pos;         /* allocations since the latest marker */
  int last_life;             /* class the latest successful malloc was placed as */
  int default_life;          /* class of NP_LIFE_AUTO requests with no site history */
  int base_life;             /* default_life outside set-up and the first optimizer step */
  uint32_t optimizer_steps;  /* optimizer phases seen */
  uint64_t clock;            /* allocations so far */
  np_event_info recent[NP_RECENT_EVENTS]; /* ring: entry seq % size */
  uint64_t n_events;         /* events recorded so far */
};

/* A policy places requests. malloc returns an allocated block with size, pool and
 * stream set (accounting is done by the caller); free takes a block already
 * removed from the map and accounted. Optional hooks may be NULL. */
struct np_policy {
  const char *name;
  int (*init)(np_ctx *ctx);
  void (*destroy)(np_ctx *ctx);
  int (*malloc)(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, np_block **out);
  void (*free)(np_ctx *ctx, np_block *b);
  int (*empty_cache)(np_ctx *ctx);
  int (*set_limit)(np_ctx *ctx, uint64_t limit);    /* may refuse a new limit */
  void (*fill_stats)(np_ctx *ctx, np_stats *st);    /* largest_free, arena figures */
  int (*check)(np_ctx *ctx);
  void (*record_stream)(np_ctx *ctx, np_block *b, intptr_t stream); /* b is used on `stream` too */
  /* fidelity replays (torch policy): a recorded segment, a block at a recorded address */
  int (*prime_segment)(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, int pool);
  int (*alloc_at)(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, np_block **out);
};

extern const np_policy np_policy_torch;
extern const np_policy np_policy_npu_pool;
extern const np_policy np_policy_expandable;
extern const np_policy np_policy_planned;

/* Internal (lock held) versions of the public calls, used by replay. */
int np_ctx_malloc(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, int32_t site, void **out);
int np_ctx_free(np_ctx *ctx, void *ptr);
int np_ctx_empty_cache(np_ctx *ctx);
void np_ctx_set_phase(np_ctx *ctx, uint32_t phase, int default_life);
int np_ctx_mark(np_ctx *ctx, int code, int64_t arg);
/* Place a block at a recorded address (fidelity replays; policies with alloc_at). */
int np_ctx_alloc_at(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, void **out);
void np_get_stats_locked(np_ctx *ctx, np_stats *out);
int np_ctx_check(np_ctx *ctx);
void np_ctx_record(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, intptr_t stream, int32_t site, int lifetime);

/* Segments: a device malloc (or address reservation) and its first block. */
int np_segment_create(np_ctx *ctx, uint64_t size, intptr_t stream, int pool, bool reserve_only, np_segment **out);
void np_segment_destroy(np_ctx *ctx, np_segment *seg);
/* Reserved-bytes accounting for memory a policy maps or unmaps itself. */
void np_ctx_reserved_add(np_ctx *ctx, int pool, uint64_t bytes);
void np_ctx_reserved_sub(np_ctx *ctx, int pool, uint64_t bytes);

#endif
