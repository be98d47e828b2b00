/* replay.c -- serve a recorded alloc/free sequence through a context, in C.
 *
 * The loop holds the context's lock once and calls the internal entry points,
 * so a replay measures the policy, not Python. Ids index a dense table of
 * live pointers; an event that breaks the trace's rules is an NP_ERR_INVALID
 * naming its index, a request the device cannot serve ends the replay with
 * ok = 0 and fail_index set. A recorded OOM (a request the recorded run could not
 * serve) is tried and, if served, freed at once: replay_out counts both. History
 * entries carry the trace event's index as their time.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "policy.h"
#include "streams.h"

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* What the profiler's tensor category says about lifetime (oracle hints). */
static int category_lifetime(uint8_t cat) {
  switch (cat) {
    case NP_CAT_PARAMETER:
    case NP_CAT_GRADIENT:
    case NP_CAT_OPTIMIZER_STATE:
    case NP_CAT_ACTIVATION:
    case NP_CAT_INPUT: return NP_LIFE_LONG;
    case NP_CAT_TEMPORARY:
    case NP_CAT_AUTOGRAD_DETAIL: return NP_LIFE_SHORT;
    default: return NP_LIFE_AUTO;
  }
}

typedef struct replay {
  np_ctx *ctx;
  const np_replay_in *in;
  np_replay_out *out;
  void **ptrs;       /* id -> live pointer */
  uint64_t *sizes;   /* id -> requested size */
  uint64_t live;
  uint64_t stretch;  /* the stretch (bounds) the replay is in: 0 before the first bound */
  int8_t *tag;       /* id -> tag of the region it was allocated in, -1 none */
  uint8_t *off;      /* id -> 1 while offloaded (policies without pause: freed at pause, re-allocated at resume) */
  int region;        /* the region entered (NP_OP_REGION), -1 none */
  bool paused[NP_TAG_MAX]; /* live bytes of a paused tag are off the device: not in `live` */
} replay;

/* Trace tags are numbers; the pool's tags are their names. */
static void tag_name(int64_t tag, char *buf) { snprintf(buf, NP_TAG_NAME, "tag%lld", (long long)tag); }

/* Live bytes grew: the run's peak, and the current stretch's (in->bound_peaks). */
static void live_grew(replay *r) {
  if (r->live > r->out->peak_live) r->out->peak_live = r->live;
  uint64_t *pk = r->in->bound_peaks;
  if (pk && r->live > pk[r->stretch]) pk[r->stretch] = r->live;
}

/* NP_OP_REGION / PAUSE / RESUME. With a policy that pauses tags, its hooks; with any other, what
 * a user of the stock allocator does (explicit offload): pause frees the tag's live tensors (their
 * contents copied to host) and empties the cache, resume allocates them again. A resume the device
 * cannot serve ends the replay (ok 0). */
static int tag_op(replay *r, uint64_t i, uint8_t op, int64_t tag) {
  np_ctx *ctx = r->ctx;
  const np_policy *p = ctx->policy;
  char name[NP_TAG_NAME];
  tag_name(tag, name);
  uint64_t bytes;
  if (op == NP_OP_REGION) {
    r->region = (int)tag;
    return p->region ? p->region(ctx, tag < 0 ? NULL : name) : NP_OK;
  }
  uint64_t tag_live = 0; /* the tag's live bytes leave the device at pause, come back at resume */
  for (uint64_t id = 0; id < r->in->n_ids; id++)
    if (r->tag[id] == tag && (r->ptrs[id] || r->off[id])) tag_live += r->sizes[id];
  r->paused[tag] = op == NP_OP_PAUSE;
  if (op == NP_OP_PAUSE) r->live -= tag_live;
  else {
    r->live += tag_live;
    live_grew(r);
  }
  if (p->pause && p->resume && p->region) {
    if (op == NP_OP_PAUSE) { /* a tag paused before any allocation in it: make it, stay in the region */
      char cur[NP_TAG_NAME];
      tag_name(r->region, cur);
      int rc = p->region(ctx, name);
      if (rc == NP_OK) rc = p->region(ctx, r->region < 0 ? NULL : cur);
      if (rc != NP_OK) return rc;
    }
    int rc = op == NP_OP_PAUSE ? p->pause(ctx, name, r->in->cat[i] != 0, &bytes) : p->resume(ctx, name, &bytes);
    if (rc == NP_ERR_OOM && op == NP_OP_RESUME) {
      r->out->fail_index = i;
      return NP_ERR_OOM;
    }
    return rc;
  }
  for (uint64_t id = 0; id < r->in->n_ids; id++) {
    if (r->tag[id] != tag) continue;
    if (op == NP_OP_PAUSE && r->ptrs[id]) {
      int rc = np_ctx_free(ctx, r->ptrs[id]);
      if (rc != NP_OK) return rc;
      r->ptrs[id] = NULL;
      r->off[id] = 1;
      r->out->ops++;
    } else if (op == NP_OP_RESUME && r->off[id]) {
      void *q;
      int rc = np_ctx_malloc(ctx, r->sizes[id], 0, NP_LIFE_LONG, -1, &q);
      if (rc == NP_ERR_OOM) r->out->fail_index = i;
      if (rc != NP_OK) return rc;
      r->ptrs[id] = q;
      r->off[id] = 0;
      r->out->ops++;
    }
  }
  /* what offloading users do next (verl, MindSpeed-RL): return the freed memory to the device */
  return op == NP_OP_PAUSE ? np_ctx_empty_cache(ctx) : NP_OK;
}

static int bad_id(uint64_t i, int64_t id, const char *what) {
  return np_error(NP_ERR_INVALID, "trace event %llu: %s id %lld", (unsigned long long)i, what, (long long)id);
}

static void placed(replay *r, uint64_t i, void *p, int64_t id) {
  const np_replay_in *in = r->in;
  r->ptrs[id] = p;
  r->sizes[id] = in->size[i];
  r->live += in->size[i];
  live_grew(r);
  r->out->ops++;
  if (in->placed) in->placed[i] = (uintptr_t)p;
  if (in->classes) in->classes[i] = (uint8_t)r->ctx->last_life;
  if (in->addr[i] && in->op[i] == NP_OP_ALLOC) { /* placements inside the window */
    r->out->compared++;
    r->out->same_addr += (uintptr_t)p == in->addr[i];
  }
}

/* Fidelity: place a run of initial allocations at their recorded addresses, highest first. */
static int place_initial_run(replay *r, uint64_t first, uint64_t end) {
  const np_replay_in *in = r->in;
  for (uint64_t k = end; k-- > first;) {
    int64_t id = in->id[k];
    if (id < 0 || (uint64_t)id >= in->n_ids || r->ptrs[id]) return bad_id(k, id, "initial alloc of bad or live");
    void *p;
    int rc = np_ctx_alloc_at(r->ctx, in->addr[k], in->size[k], in->stream[k], &p);
    if (rc != NP_OK) return rc;
    placed(r, k, p, id);
  }
  return NP_OK;
}

static int run(replay *r) {
  const np_replay_in *in = r->in;
  np_ctx *ctx = r->ctx;
  bool fidelity = in->fidelity && ctx->policy->alloc_at && ctx->policy->prime_segment; /* both, or neither */
  uint64_t bound = 0;
  for (uint64_t i = 0; i < in->n; i++) {
    for (; bound < in->n_bounds && in->bounds[bound] <= i; bound++) { /* an iteration starts: the calls so far */
      for (int k = 0; k < NP_CALL_COUNT; k++)
        in->bound_calls[bound * NP_CALL_COUNT + k] = ctx->be->calls[k] - ctx->calls_base[k];
      r->stretch = bound + 1;
      if (in->bound_peaks) in->bound_peaks[r->stretch] = r->live; /* what it starts with is live in it */
    }
    uint8_t op = in->op[i];
    ctx->replay_time = (int64_t)i;
    int64_t id = in->id[i];
    int rc = NP_OK;
    switch (op) {
      case NP_OP_INIT_ALLOC:
        if (fidelity) {
          uint64_t end = i;
          while (end < in->n && in->op[end] == NP_OP_INIT_ALLOC) end++;
          rc = place_initial_run(r, i, end);
          if (rc != NP_OK) return rc;
          i = end - 1;
          break;
        }
        /* allocate fresh, as a long-lived request */
        __attribute__((fallthrough));
      case NP_OP_ALLOC: {
        if (id < 0 || (uint64_t)id >= in->n_ids || r->ptrs[id]) return bad_id(i, id, "alloc of bad or live");
        int life = op == NP_OP_INIT_ALLOC      ? NP_LIFE_LONG
                   : in->hints == NP_HINTS_ORACLE ? category_lifetime(in->cat[i])
                                                  : NP_LIFE_AUTO;
        int32_t site = in->hints == NP_HINTS_SITES || in->hints == NP_HINTS_ORACLE ? in->site[i] : -1;
        void *p;
        rc = np_ctx_malloc(ctx, in->size[i], in->stream[i], life, site, &p);
        if (rc == NP_ERR_OOM) {
          r->out->fail_index = i;
          return NP_OK; /* ok stays 0 */
        }
        if (rc != NP_OK) return rc;
        placed(r, i, p, id);
        r->tag[id] = (int8_t)r->region;
        break;
      }
      case NP_OP_FREE:
        if (id >= 0 && (uint64_t)id < in->n_ids && r->off[id]) { /* offloaded: its host copy is dropped */
          r->off[id] = 0;
          r->out->ops++;
          break;
        }
        if (id < 0 || (uint64_t)id >= in->n_ids || !r->ptrs[id]) return bad_id(i, id, "free of bad or dead");
        rc = np_ctx_free(ctx, r->ptrs[id]);
        if (rc != NP_OK) return rc;
        r->ptrs[id] = NULL;
        if (r->tag[id] < 0 || !r->paused[r->tag[id]]) r->live -= r->sizes[id];
        r->out->ops++;
        break;
      case NP_OP_MARK:
        if (in->hints != NP_HINTS_NONE) rc = np_ctx_mark(ctx, in->cat[i], id);
        break;
      case NP_OP_OOM: { /* the recorded run could not serve this request: can this policy? */
        void *p;
        r->out->recorded_ooms++;
        if (!in->probe_ooms) break;
        rc = np_ctx_malloc(ctx, in->size[i], in->stream[i], NP_LIFE_SHORT, -1, &p);
        if (rc == NP_OK) {
          r->out->ooms_served++;
          rc = np_ctx_free(ctx, p);
        } else if (rc == NP_ERR_OOM) {
          rc = NP_OK;
        }
        break;
      }
      case NP_OP_EMPTY_CACHE: rc = np_ctx_empty_cache(ctx); break;
      case NP_OP_SEG_HINT:
        if (fidelity && ctx->be->hint_addr) ctx->be->hint_addr(ctx->be, in->addr[i]);
        break;
      case NP_OP_INIT_SEGMENT:
        if (fidelity) rc = ctx->policy->prime_segment(ctx, in->addr[i], in->size[i], in->stream[i], in->cat[i]);
        break;
      case NP_OP_SEG_FREE: break;
      case NP_OP_REGION:
      case NP_OP_PAUSE:
      case NP_OP_RESUME:
        if (id < (op == NP_OP_REGION ? -1 : 0) || id >= NP_TAG_MAX) return bad_id(i, id, "region, pause or resume of bad tag");
        rc = tag_op(r, i, op, id);
        if (rc == NP_ERR_OOM && r->out->fail_index == i) return NP_OK; /* ok stays 0 */
        break;
      default: return np_error(NP_ERR_INVALID, "trace event %llu: unknown op %u", (unsigned long long)i, op);
    }
    if (rc != NP_OK) return rc;
  }
  r->out->ok = 1;
  return NP_OK;
}

int np_replay(np_ctx *ctx, const np_replay_in *in, np_replay_out *out) {
  *out = (np_replay_out){0};
  if (!in || !in->op || !in->cat || !in->site || !in->id || !in->size || !in->stream || !in->addr)
    return np_error(NP_ERR_INVALID, "replay: a trace column is missing");
  if (in->hints < 0 || in->hints >= NP_HINTS_COUNT)
    return np_error(NP_ERR_INVALID, "replay: hints must be one of NP_HINTS_* (0..%d)", NP_HINTS_COUNT - 1);
  if (in->n_bounds && (!in->bounds || !in->bound_calls))
    return np_error(NP_ERR_INVALID, "replay: %llu iteration bounds without their buffers", (unsigned long long)in->n_bounds);
  for (uint64_t b = 1; b < in->n_bounds; b++)
    if (in->bounds[b] < in->bounds[b - 1])
      return np_error(NP_ERR_INVALID, "replay: iteration bound %llu is before the one ahead of it", (unsigned long long)b);
  uint64_t m = in->n_ids ? in->n_ids : 1;
  if (in->bound_peaks)
    for (uint64_t b = 0; b <= in->n_bounds; b++) in->bound_peaks[b] = 0;
  replay r = {ctx, in, out, calloc(m, sizeof(void *)), calloc(m, sizeof(uint64_t)), 0, 0, malloc(m), calloc(m, 1), -1, {0}};
  if (r.tag) memset(r.tag, -1, m); /* no tag */
  if (!r.ptrs || !r.sizes || !r.tag || !r.off) {
    free(r.ptrs);
    free(r.sizes);
    free(r.tag);
    free(r.off);
    return np_error(NP_ERR_HOST, "replay: host out of memory for %llu ids", (unsigned long long)in->n_ids);
  }
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "replay"); /* a closed pool has no backend to count calls on */
  if (rc == NP_OK) {
    uint64_t t0 = now_ns();
    rc = run(&r);
    out->ns = now_ns() - t0;
    ctx->replay_time = -1;
    if (ctx->policy->region) ctx->policy->region(ctx, NULL); /* leave the trace's region */
  }
  np_ctx_unlock(ctx);
  free(r.ptrs);
  free(r.sizes);
  free(r.tag);
  free(r.off);
  return rc;
}

/* ---- trace validation ---------------------------------------------------------------- */

static const char *op_name(uint8_t op) {
  const char *n = np_vocab_name(NP_VOCAB_OP, op);
  return n ? n : "?";
}

int np_trace_validate(const np_replay_in *in, uint64_t n_sites, uint64_t *bad) {
  *bad = UINT64_MAX;
  uint64_t allocs = 0;
  for (uint64_t i = 0; i < in->n; i++) allocs += in->op[i] == NP_OP_ALLOC || in->op[i] == NP_OP_INIT_ALLOC;
  if (in->n_ids > allocs)
    return np_error(NP_ERR_INVALID, "meta['n_ids'] is %llu; ids number the %llu allocations, so it must be an int "
                    "in 0..%llu", (unsigned long long)in->n_ids, (unsigned long long)allocs, (unsigned long long)allocs);
  uint64_t m = in->n_ids ? in->n_ids : 1;
  uint8_t *state = calloc(m, 1); /* 0 never seen, 1 live, 2 freed */
  uint64_t *at = malloc(m * sizeof *at); /* each live id's alloc event: its free copies the size */
  if (!state || !at) {
    free(state);
    free(at);
    return np_error(NP_ERR_HOST, "host out of memory validating %llu ids", (unsigned long long)in->n_ids);
  }
  int rc = NP_OK, region = -1;
  uint64_t window = UINT64_MAX; /* the first event after the initial state (init_* events) */
  uint64_t live = 0;            /* bytes of the live ids: at most NP_MAX_REQUEST, so every sum of them fits */
  bool paused[NP_TAG_MAX] = {false};
  for (uint64_t i = 0; i < in->n && rc == NP_OK; i++) {
    uint8_t op = in->op[i], cat = in->cat[i];
    int64_t id = in->id[i];
    unsigned long long ui = (unsigned long long)i;
    bool init = op == NP_OP_INIT_ALLOC || op == NP_OP_INIT_SEGMENT;
    if (!init && window == UINT64_MAX) window = i;
    if (init && window != UINT64_MAX) {
      rc = np_error(NP_ERR_INVALID, "event %llu: %s after the window began (event %llu): the initial state comes first",
                    ui, op_name(op), (unsigned long long)window);
    } else if (init && (in->addr[i] % NP_MIN_BLOCK ||
                        (op == NP_OP_INIT_SEGMENT && (!in->size[i] || in->size[i] % NP_MIN_BLOCK)))) {
      /* (a fidelity replay places the initial state where it was: on the allocators' 512-byte grid) */
      rc = np_error(NP_ERR_INVALID, "event %llu: %s at %#llx of %llu bytes: off the %llu-byte grid every allocator "
                    "places on (a segment: a positive multiple of it)", ui, op_name(op),
                    (unsigned long long)in->addr[i], (unsigned long long)in->size[i], (unsigned long long)NP_MIN_BLOCK);
    } else if (op == NP_OP_ALLOC || op == NP_OP_INIT_ALLOC) {
      if (id < 0 || (uint64_t)id >= in->n_ids)
        rc = np_error(NP_ERR_INVALID, "event %llu: alloc id %lld outside 0..%lld", ui, (long long)id,
                      (long long)in->n_ids - 1);
      else if (state[id])
        rc = np_error(NP_ERR_INVALID, "event %llu: id %lld allocated twice", ui, (long long)id);
      else {
        state[id] = 1;
        at[id] = i;
      }
    } else if (op == NP_OP_FREE) {
      if (id < 0 || (uint64_t)id >= in->n_ids || state[id] != 1)
        rc = np_error(NP_ERR_INVALID, "event %llu: free of id %lld which is not live", ui, (long long)id);
      else if (in->size[i] != in->size[at[id]]) /* live bytes are counted from it: the lower bound of every figure */
        rc = np_error(NP_ERR_INVALID, "event %llu: free of id %lld with size %llu; its alloc (event %llu) has %llu",
                      ui, (long long)id, (unsigned long long)in->size[i], (unsigned long long)at[id],
                      (unsigned long long)in->size[at[id]]);
      else
        state[id] = 2;
    } else if (op == NP_OP_REGION || op == NP_OP_PAUSE || op == NP_OP_RESUME) {
      int64_t lo = op == NP_OP_REGION ? -1 : 0;
      if (id < lo || id >= NP_TAG_MAX)
        rc = np_error(NP_ERR_INVALID, "event %llu: %s of tag %lld (tags are %lld..%d)", ui, op_name(op), (long long)id,
                      (long long)lo, NP_TAG_MAX - 1);
      else if (op == NP_OP_REGION)
        region = (int)id;
      else if (op == NP_OP_PAUSE && (paused[id] || cat > 1))
        rc = np_error(NP_ERR_INVALID, paused[id] ? "event %llu: pause of tag %lld, already paused"
                                                 : "event %llu: pause of tag %lld with backup flag %u (0 or 1)",
                      ui, (long long)id, cat);
      else if (op == NP_OP_RESUME && !paused[id])
        rc = np_error(NP_ERR_INVALID, "event %llu: resume of tag %lld, which is not paused", ui, (long long)id);
      else
        paused[id] = op == NP_OP_PAUSE;
    } else if (op >= NP_OP_COUNT) {
      rc = np_error(NP_ERR_INVALID, "event %llu: unknown op %u", ui, op);
    }
    if (rc == NP_OK && (op == NP_OP_ALLOC || op == NP_OP_OOM) && region >= 0 && paused[region]) /* (a failed one is replayed) */
      rc = np_error(NP_ERR_INVALID, "event %llu: %s inside region %d, which is paused", ui, op_name(op), region);
    if (rc == NP_OK && (op == NP_OP_ALLOC || op == NP_OP_INIT_ALLOC || op == NP_OP_FREE || op == NP_OP_OOM)) {
      if (cat >= NP_CAT_COUNT)
        rc = np_error(NP_ERR_INVALID, "event %llu: unknown tensor category %u (0..%d)", ui, cat, NP_CAT_COUNT - 1);
      else if (in->size[i] == 0 || in->size[i] > NP_MAX_REQUEST)
        rc = np_error(NP_ERR_INVALID, "event %llu: %s of %llu bytes (1..2^48 allowed)", ui, op_name(op),
                      (unsigned long long)in->size[i]);
      else if (in->site[i] < -1 || (int64_t)in->site[i] >= (int64_t)n_sites)
        rc = np_error(NP_ERR_INVALID, "event %llu: site %d indexes none of the %llu sites", ui, in->site[i],
                      (unsigned long long)n_sites);
      else if (op == NP_OP_FREE)
        live -= in->size[i];
      else if (op != NP_OP_OOM && (live += in->size[i]) > NP_MAX_REQUEST)
        rc = np_error(NP_ERR_INVALID, "event %llu: %llu bytes live at once, more than any device has (2^48)", ui,
                      (unsigned long long)live);
    }
    if (rc == NP_OK && op != NP_OP_MARK && op != NP_OP_REGION && op != NP_OP_PAUSE && op != NP_OP_RESUME &&
        np_stream_is_tag(in->stream[i])) {
      rc = np_error(NP_ERR_INVALID, "event %llu: stream %lld, a value npu_pool reserves for its own tags of free memory; "
                    "no device stream has it", ui, (long long)in->stream[i]);
    } else if (rc == NP_OK && op == NP_OP_MARK && cat >= NP_MARK_COUNT) {
      rc = np_error(NP_ERR_INVALID, "event %llu: unknown marker code %u (0..%d)", ui, cat, NP_MARK_COUNT - 1);
    } else if (rc == NP_OK && (op == NP_OP_SEG_HINT || op == NP_OP_SEG_FREE || op == NP_OP_INIT_SEGMENT)) {
      if (cat > 1)
        rc = np_error(NP_ERR_INVALID, "event %llu: segment pool %u (0 small or 1 large)", ui, cat);
      else if (in->size[i] > NP_MAX_REQUEST)
        rc = np_error(NP_ERR_INVALID, "event %llu: %s of %llu bytes (at most 2^48)", ui, op_name(op),
                      (unsigned long long)in->size[i]);
    }
    if (rc != NP_OK) *bad = i;
  }
  free(state);
  free(at);
  return rc;
}
