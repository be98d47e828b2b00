/* policy_planned.c -- the planned policy: a training loop's requests at offsets planned offline.
 *
 * A plan (plan.h, installed by np_set_plan) gives every allocation of a prologue (run
 * once: the first step) and of a loop body (one steady iteration, run again and again)
 * an offset in one region, reserved once at the plan's peak. The policy follows the
 * loop by position: position `pos` is expected next; a request of exactly size[pos]
 * bytes is served at region + offset[pos] when that range is free, and the position
 * advances (after the body's last position the body starts again).
 *
 * Finding the position (docs/planner.md has the whole story):
 *  - set-up (the latest marker MARK_SETUP_BEGIN) is never followed: weights may repeat
 *    the sizes of the optimizer's per-weight requests;
 *  - an iteration starts at the first request after MARK_ITER_BEGIN (NP_PLAN_AT_ITER_BEGIN),
 *    or in the marker context (ctx->marks: latest marker, requests since) learned at the body's first
 *    request once the body has been followed to its end, unless that context recurs
 *    inside the iteration; with NP_PLAN_AT_START the first request is position 0;
 *  - a request that does not match is looked up by the hash of its size and the
 *    NP_PLAN_GRAM - 1 sizes before it: while following, a position at most MAX_DRIFT
 *    ahead resynchronises (requests went missing); when lost, only a position that holds
 *    the hash alone (identical layers repeat theirs); before the first sync, the one
 *    nearest the count of requests since set-up;
 *  - with NP_PLAN_MADE_ONCE (a plan of one recorded step, which holds what that step made once
 *    for good: weights, optimizer states; the steps after it do not make them again), a request
 *    that matches the first position after the expected one that is not held for good takes it;
 *  - otherwise it is a dynamic size at the expected position (MoE routing, variable
 *    lengths), which it consumes: a hole. When the next request matches the hole's position
 *    instead, it was an extra request: the position is taken back and the extra size leaves
 *    the hashed window. Where the requests after the hole match the positions expected and
 *    are of the hole's size (a run of equal sizes: layers' tensors), the hole stays open:
 *    a dynamic size before such a run is the more common case; when a request of that size
 *    then matches nothing (after a run of two or more, only where the hole's request was
 *    a small one placed off the region, as an extra tensor mostly is), the hole's was an
 *    extra request, and the run's last position is taken back (each request of the run
 *    stands for the position before the one it took); MAX_MISSES in a row: lost. (A plan
 *    of one recorded step finds what the step made once, below, before a position is taken
 *    back.)
 * Off-plan ranges: in a steady loop (the previous body pass and this one so far followed
 * without losing track, every block freed when the plan said) a dynamic request takes
 * its position's range if it fits there, else the lowest range the plan leaves idle for
 * the position's lifetime and that is free now; so does a matching request whose range
 * is still held. Before that a mismatch is more likely an extra request that may live for
 * good (optimizer states), and it goes to the fallback; so does a dynamic request under a page
 * while such requests the fallback holds take a page together (small_to_fallback, block.aside).
 * The fallback is an arena (arena.h) whose budget leaves the region room: the cap less the
 * region while it is not reserved yet, the cap less what the region holds once it is. Under
 * NP_PLAN_MADE_ONCE a request the plan does not place, short of one it leaves out or a small one
 * (small_to_fallback), takes the lowest free range of the region that fits before the fallback
 * (later steps differ from the recorded one). When the fallback has no room, that range is a last
 * resort; failing that, with nothing planned live, the region is given up (until empty_cache or a
 * new plan) and the request retried, so that a region the run does not use never costs its share.
 *
 * Invariants: the region segment is tiled by its blocks; its free blocks are exactly the
 * nodes of the address-ordered tree `free` (in_tree set) and no two of them are
 * neighbours; an allocated region block's prio holds the position it was served for
 * (UINT32_MAX: none); `live` counts the allocated region blocks; the fallback's set_aside and
 * outside are brought up to date (budget()) before every call into it.
 */
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "plan.h"
#include "policy.h"

enum { PLANNED_POOL = 0, FALLBACK_POOL = 1 };
enum { SERVED = 0, FALLBACK = 1, IDLE = 2, RESYNCS = 3, N_COUNTS = 4 };

#define MAX_MISSES 16          /* mismatches in a row before the policy stops following */
#define IDLE_TRIES 16          /* idle ranges tried per dynamic request */
#define MAX_DRIFT 64           /* a repeated size pattern this close ahead resynchronises a following policy */
#define RUN_MAX 64             /* equal sizes after a hole followed before it closes (planned_state.hole) */

typedef struct planned_state {
  np_arena fb;                 /* the fallback */
  np_plan plan;                /* plan.n == 0: none installed */
  int flags;
  np_segment *seg;             /* the region; NULL until the first planned request */
  bool seg_failed;             /* reserving it failed; tried again after empty_cache or a new plan */
  uint64_t outside;            /* bytes the plan expects live outside it: the fallback maps them with the region */
  bool premapped;              /* a plan with no region (it plans nothing) mapped `outside` at its first position */
  np_tree free;                /* the region's free blocks, by address */
  uint64_t live;               /* allocated blocks in the region */
  bool synced;                 /* pos is trusted */
  bool began;                  /* the policy found its place in the loop: the next iteration start is the body's */
  np_marks start;              /* learned: the markers' state at the body's first request */
  bool start_known;            /* (false: not learned yet, or not unique to that request) */
  bool start_learned;
  bool ever_synced;            /* before the first sync, positions are counted from the end of set-up */
  bool in_setup;               /* the previous request came during set-up */
  uint64_t pos;                /* position expected next */
  uint64_t last;               /* position of the latest located request */
  /* A request that does not match consumes the position expected (a dynamic size there): the hole. While
   * every request after it matches the position expected, of the hole's size (a run of equal sizes), the
   * hole stays open: a request of that size that matches nothing then shows the hole's request was an
   * extra one, each request since standing for the position before the one it took; it takes the run's
   * last position back (takeback). run_pos/run_blk: the hole's position and the run's, and the region
   * blocks they were served (NULL: elsewhere, or freed since). */
  uint64_t hole;               /* NONE: no hole open */
  uint64_t hole_n;             /* the hole's request: its index in the count of `recent` (from 0) */
  uint32_t run_n;              /* positions in the run after the hole */
  int joining;                 /* this request's entry in run_*, or -1 */
  bool takeback;               /* this request takes the run's last position back */
  bool hole_small;             /* the hole's request is under a page and was placed off the region: more likely
                                * an extra one than a dynamic size, which is mostly larger (placement) */
  uint64_t run_pos[RUN_MAX + 1];
  np_block *run_blk[RUN_MAX + 1];
  bool lap_clean;              /* this iteration has been followed without a jump or a lifetime off plan */
  bool steady;                 /* so was the previous one, and this one so far: ranges off plan may be used */
  uint32_t misses;             /* mismatches in a row while synced */
  uint64_t recent[NP_PLAN_GRAM]; /* sizes of the latest requests, ring */
  uint64_t n_recent;
  uint64_t aside;              /* bytes of the small requests off the plan the fallback holds (block.aside) */
  bool small;                  /* this request goes to the fallback by small_to_fallback */
  uint64_t count[N_COUNTS];
  np_streams streams;          /* streams that allocated from the region, for waits on mixed memory */
} planned_state;

static planned_state *state(np_ctx *ctx) { return (planned_state *)ctx->pstate; }

/* Something showed the policy off the plan: no ranges off plan until a clean iteration. */
static void trouble(planned_state *st) {
  st->lap_clean = false;
  st->steady = false;
}

/* -- the fallback: an arena leaving the region room ------------------------------------ */

static uint64_t set_aside(np_ctx *ctx, const planned_state *st) {
  uint64_t r = st->plan.n && !st->seg_failed ? st->plan.region : 0;
  return r <= ctx->limit ? r : 0;
}

/* Bring the fallback's budget up to date: the region's share of the cap, and what it holds. */
static np_arena *budget(np_ctx *ctx, planned_state *st) {
  st->fb.set_aside = set_aside(ctx, st);
  st->fb.outside = st->seg ? st->seg->mapped : 0;
  return &st->fb;
}

/* -- the region ------------------------------------------------------------------------- */

static int region_reserve(np_ctx *ctx, planned_state *st) {
  if (st->seg) return NP_OK;
  if (st->seg_failed) return NP_ERR_OOM;
  np_segment *seg;
  int rc = np_segment_create(ctx, st->plan.region, NP_STREAM_ANY, PLANNED_POOL, false, &seg);
  if (rc != NP_OK) {
    st->seg_failed = true; /* the fallback gets the whole device from now on */
    return rc;
  }
  st->seg = seg;
  seg->head->stream = NP_STREAM_ANY;
  np_tree_insert(&st->free, seg->head);
  /* what the plan leaves out, mapped now (what the fallback lacks of it, short of cap pressure): the
   * requests it serves in later iterations then find it mapped. A refusal leaves the fallback to grow
   * on demand. */
  np_arena_premap(ctx, budget(ctx, st), st->outside);
  return NP_OK;
}

static void region_drop(np_ctx *ctx, planned_state *st) {
  if (!st->seg) return;
  st->hole = NP_PLAN_NONE; /* (its run's blocks go) */
  np_segment_drop(ctx, st->seg);
  st->seg = NULL;
  st->free = (np_tree){.by_addr = true};
  st->live = 0;
}

/* File free block b (in no tree): merge it with its free neighbours. */
static void put_free(np_ctx *ctx, planned_state *st, np_block *b) {
  np_block *p = b->prev, *n = b->next;
  if (n && !n->allocated) {
    np_tree_remove(&st->free, n);
    b->stream = np_tag_merge(b->stream, n->stream);
    np_block_merge_next(&ctx->blocks, b);
  }
  if (p && !p->allocated) { /* b joins the free block below, which keeps its address and its place */
    p->stream = np_tag_merge(p->stream, b->stream);
    np_block_merge_next_in(&ctx->blocks, &st->free, p);
  } else {
    np_tree_insert(&st->free, b);
  }
}

/* Allocate [off, off + size) of the region if it is free; NP_ERR_OOM if not. */
static int region_take(np_ctx *ctx, planned_state *st, uint64_t off, uint64_t size, intptr_t stream, uint64_t pos,
                       np_block **out) {
  uintptr_t addr = st->seg->addr + off;
  np_block *h = np_tree_floor(&st->free, addr);
  if (!h || h->addr + h->size < addr + size || np_order_after(ctx, &st->streams, stream, h->stream) != NP_OK)
    return NP_ERR_OOM; /* not free, or another stream's memory that cannot be ordered for this one */
  if (h->addr < addr) { /* keep the free part below, in the tree where it is (its address is h's) */
    np_block *piece = np_block_split_high_in(&ctx->blocks, &st->free, h, h->addr + h->size - addr);
    if (!piece) return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    h = piece;
  } else {
    np_tree_remove(&st->free, h);
  }
  if (h->size > size) { /* and above */
    if (!np_block_split(&ctx->blocks, h, size, false)) {
      put_free(ctx, st, h);
      return np_error(NP_ERR_HOST, "host out of memory splitting a block");
    }
    np_tree_insert(&st->free, h->next);
  }
  h->stream = stream;
  h->pool = PLANNED_POOL;
  h->prio = (uint32_t)pos; /* allocated blocks are in no tree: prio holds the position served */
  st->live++;
  np_streams_note(&st->streams, stream);
  *out = h;
  return NP_OK;
}

static void region_free(np_ctx *ctx, planned_state *st, np_block *b) {
  const np_plan *pl = &st->plan;
  /* freed when the plan says? (prologue requests run once: not checked). While a hole is open, the requests
   * since may each stand for the position before the one they took (its request an extra one): the
   * position expected next may be the run's last, and the run's own blocks stand for either. */
  bool in_run = false;
  for (uint32_t i = 0; st->hole != NP_PLAN_NONE && i <= st->run_n; i++)
    if (st->run_blk[i] == b) st->run_blk[i] = NULL, in_run = true;
  uint64_t pos = b->prio, end;
  if (st->synced && !in_run && pos < pl->n && pos >= pl->loop && (end = pl->end[pos]) != NP_PLAN_NONE) {
    end = end < pl->n ? end : pl->loop + end - pl->n;
    if (end != st->pos && (st->hole == NP_PLAN_NONE || end != st->last)) trouble(st);
  }
  st->live--;
  if (b->shared) { /* used on other streams too (record_stream) */
    b->stream = NP_STREAM_MIXED;
    b->shared = 0;
  }
  put_free(ctx, st, b);
}

/* -- following the iteration ------------------------------------------------------------- */

/* An iteration was followed to its end (or the next began). */
static void lap_done(planned_state *st) {
  st->steady = st->lap_clean;
  st->lap_clean = true;
}

static void lose_track(planned_state *st) {
  if (st->synced) trouble(st);
  st->synced = false;
  st->pos = np_plan_next(&st->plan, st->pos); /* keep guessing ahead */
}

/* Learn how the body's first request looks to the context (the latest marker, requests
 * since): on devices the iteration may begin with other markers than MARK_ITER_BEGIN. */
static void learn_start(np_ctx *ctx, planned_state *st) {
  if (!ctx->marks.any || st->start_learned) return;
  st->start_learned = st->start_known = true;
  st->start = ctx->marks;
}

/* Where the steps after the first skip what it made once (NP_PLAN_MADE_ONCE), the body's first and
 * last positions may be such: a pass begins at the first that is not, and ends after the last that
 * is not. The position a pass begins at: */
static uint64_t pass_begins(const planned_state *st) {
  const np_plan *p = &st->plan;
  return st->flags & NP_PLAN_MADE_ONCE ? p->past_held[p->loop] : p->loop;
}

/* Whether expecting `pos` next means the previous pass was followed to its end. */
static bool pass_over(const planned_state *st, uint64_t pos) {
  const np_plan *p = &st->plan;
  return pos == p->loop || ((st->flags & NP_PLAN_MADE_ONCE) && p->past_held[pos] == p->past_held[p->loop]);
}

/* Does the request located at `at` begin the next pass of the body, the previous one followed to its end? */
static bool lap_ends(const planned_state *st, uint64_t at) {
  return at == pass_begins(st) && st->last != NP_PLAN_NONE && st->last >= st->plan.loop &&
         pass_over(st, np_plan_next(&st->plan, st->last));
}

/* Is this request the first of an iteration? A request right after MARK_ITER_BEGIN is, where the
 * plan says so; one in the learned start context is, unless that context recurs inside the
 * iteration (a request matching the plan mid-way): then it is forgotten. */
static bool iteration_starts(np_ctx *ctx, planned_state *st, uint64_t req) {
  const np_marks *m = &ctx->marks;
  if (!m->any) return false;
  if ((st->flags & NP_PLAN_AT_ITER_BEGIN) && m->code == NP_MARK_ITER_BEGIN && m->pos == 1) return true;
  if (!st->start_known || !np_marks_same(m, &st->start) || m->pos != st->start.pos) return false;
  if (st->synced && st->pos != st->plan.loop && st->plan.size[st->pos] == req) {
    st->start_known = false;
    return false;
  }
  return true;
}

/* Drop the `i`th request (from 0) from the ring of recent sizes, where it still is: an extra one is no part
 * of the pattern. */
static void forget_recent(planned_state *st, uint64_t i) {
  if (i >= st->n_recent || st->n_recent - i > NP_PLAN_GRAM) return;
  for (uint64_t j = i + 1; j < st->n_recent; j++) st->recent[(j - 1) % NP_PLAN_GRAM] = st->recent[j % NP_PLAN_GRAM];
  st->n_recent--;
}

/* The position this request stands for; *dynamic when its size differs from the plan's.
 * NP_PLAN_NONE when the policy does not know where in the iteration it is. A request
 * that does not match consumes the expected position (a dynamic size there: a hole); when
 * the next one, or the first after a run of the hole's size, matches the hole's size but
 * not the position expected, the mismatch was an extra request and a position is taken
 * back (the file's comment). */
static uint64_t locate(np_ctx *ctx, planned_state *st, uint64_t req, bool *dynamic) {
  const np_plan *p = &st->plan;
  uint64_t hole = st->hole; /* open still only where this request extends its run */
  st->hole = NP_PLAN_NONE;
  st->joining = -1;
  st->takeback = *dynamic = false;
  bool setup = ctx->marks.any && ctx->marks.code == NP_MARK_SETUP_BEGIN;
  if (st->in_setup && !setup) st->n_recent = 0; /* set-up's sizes are no part of any iteration's pattern */
  st->in_setup = setup;
  st->recent[st->n_recent++ % NP_PLAN_GRAM] = req;
  if (!p->loop && !(st->flags & NP_PLAN_AT_START) && ctx->marks.any && ctx->marks.code == NP_MARK_OPTIMIZER_BEGIN &&
      ctx->marks.optimizer_steps == 1) {
    /* the first optimizer step creates the optimizer states, which live for good: unless the plan
     * planned that step (a prologue, or a plan from the run's first request), none of them goes
     * into the region, where they would hold body ranges for good */
    lose_track(st);
    return NP_PLAN_NONE;
  }
  if (setup) {
    st->synced = false; /* set-up builds the model: no iteration yet, whatever its sizes resemble */
    return NP_PLAN_NONE;
  }
  if (iteration_starts(ctx, st, req)) {
    if (st->synced && pass_over(st, st->pos)) lap_done(st);
    else if (st->synced) trouble(st), st->count[RESYNCS]++; /* the iteration was shorter or longer */
    else st->count[RESYNCS]++, st->lap_clean = true;
    st->pos = st->began ? p->loop : 0; /* the prologue runs once */
    st->synced = st->began = st->ever_synced = true;
    st->misses = 0;
    hole = NP_PLAN_NONE;
  }
  uint64_t at = NP_PLAN_NONE, past;
  if (st->synced && p->size[st->pos] == req) {
    at = st->pos; /* (first: see the file's comment) */
    if (hole != NP_PLAN_NONE && p->size[hole] == req && st->run_n < RUN_MAX) { /* the run goes on */
      st->hole = hole;
      st->joining = (int)++st->run_n;
      st->run_pos[st->run_n] = at;
    }
  } else if (st->synced && (st->flags & NP_PLAN_MADE_ONCE) && (past = p->past_held[st->pos]) != st->pos &&
             p->size[past] == req) {
    at = past; /* the tensors made once, expected here, were made in an earlier pass: not missed */
  } else if (st->synced && hole != NP_PLAN_NONE && p->size[hole] == req && (st->run_n <= 1 || st->hole_small)) {
    /* the hole's request was an extra one: this one stands for the run's last position (the hole's, where
     * no run followed it), the position expected stays next, and the extra size leaves the pattern. (After
     * a run of two or more, only where the hole's request was a small one placed off the region: a dynamic
     * size, more often larger, at a run's first and another of the run's size after it took a position
     * back, and every pass was followed a position late) */
    at = st->last;
    st->takeback = true;
    forget_recent(st, st->hole_n);
  } else if (st->n_recent >= NP_PLAN_GRAM && (st->began || !(st->flags & NP_PLAN_AT_ITER_BEGIN) || !ctx->marks.any)) {
    /* markers, where the plan relies on them, decide where the loop starts: set-up that
     * happens to repeat a stretch of the iteration is not taken for it */
    uint64_t w[NP_PLAN_GRAM];
    for (int i = 0; i < NP_PLAN_GRAM; i++) w[i] = st->recent[(st->n_recent + (uint64_t)i) % NP_PLAN_GRAM];
    uint64_t count, behind, found = np_plan_find(p, np_plan_gram(w, NP_PLAN_GRAM), st->pos, &count, &behind);
    /* following: only a position a little ahead (a missing request) -- dynamic sizes make
     * chance matches elsewhere; lost: a pattern the iteration holds once (layers repeat theirs);
     * before the first sync, counting from the end of set-up, one near the count */
    uint64_t ahead = (found + p->n - st->pos) % p->n, back = (st->pos + p->n - behind) % p->n;
    bool counting = !st->ever_synced && !st->synced;
    if (counting && behind != NP_PLAN_NONE && back < ahead) found = behind, ahead = back;
    bool sure = st->synced ? ahead <= MAX_DRIFT : count == 1 || (counting && ahead <= MAX_DRIFT);
    if (found != NP_PLAN_NONE && sure && p->size[found] == req) { /* else a hash collision */
      if (!st->synced || found != st->pos) st->count[RESYNCS]++;
      if (!st->synced) st->lap_clean = false; /* joined in the middle of an iteration */
      st->synced = st->ever_synced = st->began = true;
      at = found;
    }
  }
  if (at != NP_PLAN_NONE) {
    st->began = true; /* (a plan followed from its first request, NP_PLAN_AT_START, began there) */
    if (lap_ends(st, at)) {
      lap_done(st);
      learn_start(ctx, st);
    }
    st->misses = 0;
  } else if (st->synced && st->misses < MAX_MISSES) {
    st->misses++;
    at = st->hole = st->run_pos[0] = st->pos;
    st->hole_n = st->n_recent - 1;
    st->run_n = 0;
    st->joining = 0;
    *dynamic = true;
  } else {
    lose_track(st);
    return NP_PLAN_NONE;
  }
  st->last = at;
  st->pos = np_plan_next(p, at);
  return at;
}

/* A dynamic-size request at position `at`: its own planned range if it fits, else a range
 * idle in the plan during the position's lifetime and free now. */
static int place_dynamic(np_ctx *ctx, planned_state *st, uint64_t at, uint64_t size, intptr_t stream, np_block **out) {
  const np_plan *p = &st->plan;
  if (p->offset[at] != NP_PLAN_NONE && size <= np_round_up(p->size[at], NP_MIN_BLOCK) &&
      region_take(ctx, st, p->offset[at], size, stream, at, out) == NP_OK)
    return NP_OK;
  uint64_t from = 0;
  for (int tries = 0; tries < IDLE_TRIES; tries++) {
    uint64_t off = np_occ_lowest(&p->occ, &p->span[at], size, from);
    if (off > p->region || p->region - off < size) break;
    int rc = region_take(ctx, st, off, size, stream, at, out);
    if (rc != NP_ERR_OOM) return rc;
    np_block *next = np_tree_after(&st->free, st->seg->addr + off); /* skip what holds the range now */
    if (!next) break;
    from = next->addr - st->seg->addr;
  }
  return NP_ERR_OOM;
}

/* Whether a small request the plan does not place (an extra one, a dynamic size) goes to the fallback
 * first: there such requests cost a page at most, live together; in the region each may hold, for
 * good, a range that planned requests need. (Past that page the region again: many such requests are
 * dynamic sizes, and a fallback growing beside a region with free memory would hold both.) */
static bool small_to_fallback(const planned_state *st, uint64_t size) {
  uint64_t page = st->fb.page;
  return size < page && st->aside <= page - np_round_up(size, NP_MIN_BLOCK);
}

/* The run's last position taken back (locate): the hole's request was an extra one, freed as no position;
 * each request of the run stands for the position before the one it took, and is freed as that; this one
 * for the run's last, in its range (where each request of the run took the range of the position before,
 * that one is free), else the first of the run's ranges that is. */
static int take_back(np_ctx *ctx, planned_state *st, uint64_t size, intptr_t stream, np_block **out) {
  const np_plan *p = &st->plan;
  uint32_t n = st->run_n;
  if (st->run_blk[0]) st->run_blk[0]->prio = UINT32_MAX;
  for (uint32_t i = 1; i <= n; i++)
    if (st->run_blk[i]) st->run_blk[i]->prio = (uint32_t)st->run_pos[i - 1];
  int rc = NP_ERR_OOM;
  for (uint32_t k = 0; k <= n && rc == NP_ERR_OOM; k++) {
    uint64_t q = st->run_pos[k == 0 ? n : k - 1]; /* the last, then the hole on */
    if (p->offset[q] != NP_PLAN_NONE) rc = region_take(ctx, st, p->offset[q], size, stream, st->run_pos[n], out);
  }
  return rc;
}

/* NP_ERR_OOM: the plan does not place the request; *left_out when it leaves it to the fallback on purpose
 * (an unplanned position). */
static int place_planned(np_ctx *ctx, planned_state *st, uint64_t req, intptr_t stream, np_block **out,
                         bool *left_out) {
  bool dynamic;
  uint64_t at = locate(ctx, st, req, &dynamic);
  if (at != NP_PLAN_NONE && (!st->plan.region || st->seg_failed) && !st->seg && !st->premapped) {
    /* no region will be reserved to map what the plan leaves out with (none planned, or reserving it
     * failed): map it at the plan's first position instead (a refusal leaves the fallback to grow) */
    st->premapped = true;
    np_arena_premap(ctx, budget(ctx, st), st->outside);
  }
  *left_out = at != NP_PLAN_NONE && !dynamic && st->plan.offset[at] == NP_PLAN_NONE;
  if (at == NP_PLAN_NONE || *left_out) return NP_ERR_OOM;
  if (!st->plan.region) return NP_ERR_OOM; /* no region to place in (a dynamic request too): the fallback's */
  int rc = region_reserve(ctx, st);
  if (rc != NP_OK) return rc;
  uint64_t size = np_round_up(req, NP_MIN_BLOCK);
  if (!dynamic) {
    const np_plan *pl = &st->plan;
    if (st->takeback) {
      rc = take_back(ctx, st, size, stream, out);
    } else {
      /* In a run after a hole, the position before is the one this request stands for where the hole's
       * request was an extra one (the requests after this one tell). Its range first for the run's first
       * (the hole's: free where that request went elsewhere) and, after a small hole request placed off
       * the region (an extra tensor's, mostly), for the others too; else after their own (still held by the
       * position's tensor of the pass before). Taken first for all, it shifted every range of a run after
       * a dynamic size larger than planned. */
      uint64_t before = st->joining > 0 ? st->run_pos[st->joining - 1] : NP_PLAN_NONE;
      bool usable = before != NP_PLAN_NONE && pl->offset[before] != NP_PLAN_NONE;
      bool first = usable && (st->joining == 1 || st->hole_small);
      rc = first ? region_take(ctx, st, pl->offset[before], size, stream, at, out) : NP_ERR_OOM;
      if (rc == NP_ERR_OOM) rc = region_take(ctx, st, pl->offset[at], size, stream, at, out);
      if (rc == NP_ERR_OOM && usable && !first) rc = region_take(ctx, st, pl->offset[before], size, stream, at, out);
    }
    if (rc == NP_OK) st->count[SERVED]++;
    if (rc != NP_ERR_OOM) return rc;
    /* its range is still held (by a request that outlived its plan): an idle one instead */
  }
  /* ranges off plan only in a steady loop: before, a mismatch is more likely an extra request
   * (optimizer states, a different step) than a dynamic size, and it may live for good */
  if (!st->steady || (dynamic && (st->small = small_to_fallback(st, size)))) return NP_ERR_OOM;
  rc = place_dynamic(ctx, st, at, size, stream, out);
  if (rc == NP_OK) st->count[IDLE]++;
  return rc;
}

/* The lowest free range of the region that fits (one search: tree.h), for a request the
 * fallback has no room for (or, under NP_PLAN_MADE_ONCE, one the plan does not place): better
 * than failing or growing, though it may hold a range the plan needs later. */
static int last_resort(np_ctx *ctx, planned_state *st, uint64_t req, intptr_t stream, np_block **out) {
  uint64_t size = np_round_up(req, NP_MIN_BLOCK);
  np_block *h = np_tree_lowest_fit(&st->free, size);
  if (!h || region_take(ctx, st, h->addr - st->seg->addr, size, stream, UINT32_MAX, out) != NP_OK) return NP_ERR_OOM;
  st->count[IDLE]++;
  return NP_OK;
}

/* -- the policy -------------------------------------------------------------------------- */

static int planned_init(np_ctx *ctx) {
  planned_state *st = calloc(1, sizeof *st);
  if (!st) return np_error(NP_ERR_HOST, "host out of memory");
  np_arena_init(ctx, &st->fb);
  st->free.by_addr = true;
  st->last = st->hole = NP_PLAN_NONE;
  ctx->pstate = st;
  return NP_OK;
}

static void planned_destroy(np_ctx *ctx) {
  planned_state *st = state(ctx);
  region_drop(ctx, st);
  np_plan_free(&st->plan);
  np_arena_drop(ctx, budget(ctx, st));
  free(st);
}

static int serve(np_ctx *ctx, planned_state *st, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  if (st->plan.n) {
    bool left_out = false;
    int rc = place_planned(ctx, st, req, stream, out, &left_out);
    if (rc != NP_ERR_OOM) return rc;
    /* a plan of one recorded step (NP_PLAN_MADE_ONCE): a request it does not place (lost, a size the step
     * did not record, its range still held), short of one it leaves out on purpose or a small one, takes the
     * region's free memory first, as the online pool takes its own: steps after the recorded one differ from
     * it (MoE routing), and a fallback growing beside a region with free memory would hold both */
    if ((st->flags & NP_PLAN_MADE_ONCE) && !left_out && st->seg && !(st->small = small_to_fallback(st, req)) &&
        last_resort(ctx, st, req, stream, out) == NP_OK)
      return NP_OK;
  }
  int rc = np_arena_malloc(ctx, budget(ctx, st), req, stream, lifetime != NP_LIFE_SHORT, out);
  if (rc == NP_ERR_OOM && st->seg && last_resort(ctx, st, req, stream, out) == NP_OK) return NP_OK;
  if (rc == NP_ERR_OOM && set_aside(ctx, st) && st->live == 0) {
    /* The region's share of the cap, idle or not even reserved, would make this request fail
     * where the online pool serves it (a plan this run does not follow, a device too small for
     * both): give the region up until empty_cache or a new plan, as when reserving it failed. */
    region_drop(ctx, st);
    st->seg_failed = true;
    rc = np_arena_malloc(ctx, budget(ctx, st), req, stream, lifetime != NP_LIFE_SHORT, out);
  }
  if (rc == NP_OK) {
    (*out)->pool = FALLBACK_POOL;
    (*out)->aside = st->small;
    st->aside += (*out)->aside ? (*out)->size : 0;
    if (st->plan.n) st->count[FALLBACK]++; /* served by the fallback (a last resort is `idle`, a failure neither) */
  } else if (rc == NP_ERR_OOM && st->seg) {
    ctx->fail.usable += st->free.bytes; /* the region's free ranges are this pool's memory too (the arena said its own) */
  }
  return rc;
}

static int planned_malloc(np_ctx *ctx, uint64_t req, intptr_t stream, int lifetime, np_block **out) {
  planned_state *st = state(ctx);
  st->small = false;
  st->joining = -1;
  int rc = serve(ctx, st, req, stream, lifetime, out);
  if (rc != NP_OK) st->hole = NP_PLAN_NONE; /* (a request that failed opens or extends no run) */
  else if (st->joining >= 0 && st->hole != NP_PLAN_NONE) st->run_blk[st->joining] = (*out)->seg == st->seg ? *out : NULL;
  if (rc == NP_OK && st->joining == 0) st->hole_small = (*out)->seg != st->seg && req < st->fb.page;
  return rc;
}

static void planned_free(np_ctx *ctx, np_block *b) {
  planned_state *st = state(ctx);
  if (st->seg && b->seg == st->seg) {
    region_free(ctx, st, b);
    return;
  }
  st->aside -= b->aside ? b->size : 0;
  b->aside = 0;
  np_arena_free(ctx, budget(ctx, st), b);
}

static void planned_record_stream(np_ctx *ctx, np_block *b, intptr_t stream) {
  planned_state *st = state(ctx);
  if (st->seg && b->seg == st->seg) np_streams_note(&st->streams, stream);
  else np_arena_record_stream(&st->fb, stream);
}

static int planned_empty_cache(np_ctx *ctx) {
  planned_state *st = state(ctx);
  if (st->seg && st->live == 0) region_drop(ctx, st); /* nothing planned is live: return the region */
  for (np_block *b = st->seg ? st->seg->head : NULL; b; b = b->next)
    if (!b->allocated) b->stream = NP_STREAM_ANY; /* the device was synchronised */
  st->seg_failed = st->premapped = false;
  return np_arena_empty_cache(ctx, budget(ctx, st));
}

/* The region is one device allocation, placed by the plan: only the fallback arena compacts. */
static int planned_compact(np_ctx *ctx) {
  int rc;
  np_arena_compact(ctx, budget(ctx, state(ctx)), &rc);
  return rc;
}

static uint64_t planned_pinned(np_ctx *ctx) { return np_arena_pinned(ctx, &state(ctx)->fb); }

static int planned_set_limit(np_ctx *ctx, uint64_t limit) {
  planned_state *st = state(ctx);
  if (st->seg && st->seg->size > limit && st->live == 0) region_drop(ctx, st); /* idle: the cap takes it back */
  if (st->seg && st->seg->size > limit) {
    char a[32];
    return np_error(NP_ERR_STATE, "the planned region of %s does not fit under the new cap", np_fmt_bytes(st->seg->size, a));
  }
  return np_arena_set_limit(ctx, budget(ctx, st));
}

static void planned_fill_stats(np_ctx *ctx, np_stats *out) {
  planned_state *st = state(ctx);
  np_arena_fill_stats(ctx, budget(ctx, st), out);
  if (st->seg && st->live == 0) out->releasable += st->seg->mapped; /* the region, as planned_empty_cache drops it */
  if (st->free.root && st->free.root->sub > out->largest_free) out->largest_free = st->free.root->sub; /* (tree.h) */
}

/* The region: tiled, its free blocks indexed and never neighbours, its live blocks counted. */
static int check_region(np_ctx *ctx, planned_state *st) {
  (void)ctx;
  if (!st->seg) return st->free.count || st->live ? np_error(NP_ERR_STATE, "check: region state without a region") : NP_OK;
  size_t free_blocks = 0;
  uint64_t live = 0;
  for (np_block *b = st->seg->head; b; b = b->next) {
    if (b->allocated) {
      live++;
      continue;
    }
    if (!b->in_tree) return np_error(NP_ERR_STATE, "check: free region block %#lx is not indexed", (unsigned long)b->addr);
    if (b->next && !b->next->allocated)
      return np_error(NP_ERR_STATE, "check: free region blocks not merged at %#lx", (unsigned long)b->addr);
    free_blocks++;
  }
  if (live != st->live) return np_error(NP_ERR_STATE, "check: region holds %llu blocks, counted %llu",
                                        (unsigned long long)live, (unsigned long long)st->live);
  if (!np_tree_check(&st->free) || st->free.count != free_blocks)
    return np_error(NP_ERR_STATE, "check: the region's free-block tree is corrupt");
  return NP_OK;
}

static int planned_check(np_ctx *ctx) {
  planned_state *st = state(ctx);
  int rc = check_region(ctx, st);
  return rc != NP_OK ? rc : np_arena_check(ctx, budget(ctx, st));
}

const np_policy np_policy_planned = {
    .name = "planned",
    .summary = "requests of a training loop served at offsets planned offline from a trace (npu-pool plan), "
               "the rest in an npu_pool arena",
    .pool_name = {"planned", "fallback"},
    .pool_meaning = {"requests served from the plan's region (at their planned offset, or in a range idle then)",
                     "requests the plan does not cover, placed in the fallback arena"},
    .memory = "the pool (the plan's region and the fallback arena)",
    .orders_streams = true,
    .keeps_places = true, /* (its fallback arena) */
    .init = planned_init,
    .destroy = planned_destroy,
    .malloc = planned_malloc,
    .free = planned_free,
    .empty_cache = planned_empty_cache,
    .compact = planned_compact,
    .pinned = planned_pinned,
    .set_limit = planned_set_limit,
    .fill_stats = planned_fill_stats,
    .check = planned_check,
    .record_stream = planned_record_stream,
};

/* -- installing a plan ------------------------------------------------------------------ */

static int install(np_ctx *ctx, planned_state *st, uint64_t n, uint64_t loop, const uint64_t *size,
                   const uint64_t *offset, const uint64_t *end, uint64_t region, uint64_t outside, int flags) {
  if (st->live) return np_error(NP_ERR_STATE, "np_set_plan: %llu planned blocks are still allocated",
                                (unsigned long long)st->live);
  np_plan plan = {0};
  if (n) {
    if (!offset || !end) return np_error(NP_ERR_INVALID, "np_set_plan: offset and end are required");
    int rc = np_plan_build(&plan, n, loop, size, offset, end, region);
    if (rc != NP_OK) return rc;
  }
  region_drop(ctx, st);
  np_plan_free(&st->plan);
  st->plan = plan;
  /* with a plan the fallback maps exactly what the plan left out (reserved stays the plan's peak);
   * without one it is the online pool's arena, growing as it does */
  st->fb.growth = plan.n ? 0 : NP_ARENA_GROWTH;
  st->flags = flags;
  st->outside = plan.n ? outside : 0;
  st->seg_failed = st->premapped = false;
  st->synced = (flags & NP_PLAN_AT_START) != 0; /* tentatively: one mismatch ends it */
  st->began = st->steady = st->start_learned = st->start_known = st->ever_synced = false;
  st->lap_clean = st->synced;
  st->pos = st->n_recent = 0;
  st->last = st->hole = NP_PLAN_NONE;
  st->misses = MAX_MISSES;
  memset(st->count, 0, sizeof st->count);
  return NP_OK;
}

int np_set_plan(np_ctx *ctx, uint64_t n, uint64_t loop, const uint64_t *size, const uint64_t *offset,
                const uint64_t *end, uint64_t region, uint64_t outside, int flags, uint64_t *counts) {
  np_ctx_lock(ctx);
  /* installing touches the device: not on a closed pool nor in a forked child (which may read the counts) */
  int rc = size || ctx->closed ? np_ctx_usable(ctx, "set_plan") : NP_OK;
  if (rc == NP_OK && ctx->policy != &np_policy_planned)
    rc = np_error(NP_ERR_STATE, "np_set_plan: the pool's policy is %s, not planned", ctx->policy->name);
  else if (rc == NP_OK && size)
    rc = install(ctx, state(ctx), n, loop, size, offset, end, region, outside, flags);
  if (rc == NP_OK && counts) memcpy(counts, state(ctx)->count, sizeof state(ctx)->count);
  np_ctx_unlock(ctx);
  return rc;
}
