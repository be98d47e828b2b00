/* marks.c -- phase markers: the stage a request comes in, and what it teaches lifetimes.
 *
 * Lifetimes are learned per stage: a block is long-lived when it outlives the stage it was
 * born in (forward -> backward: an activation; backward -> optimizer: a gradient),
 * short-lived when it dies inside it. Layer markers do not end a stage; they restart the
 * position count of derived sites, so that the k-th request of a layer is the same site in
 * every layer. */
#include "context.h"

/* The stage table, once: what each marker opens and closes (npu_pool.vocab reads it). */
static const struct {
  int8_t opens, closes;
} stage_of[NP_MARK_COUNT] = {
    [NP_MARK_SETUP_BEGIN] = {NP_STAGE_SETUP, -1},         [NP_MARK_SETUP_END] = {NP_STAGE_OUTSIDE, NP_STAGE_SETUP},
    [NP_MARK_ITER_BEGIN] = {NP_STAGE_OUTSIDE, -1},        [NP_MARK_ITER_END] = {NP_STAGE_OUTSIDE, -1},
    [NP_MARK_FORWARD_BEGIN] = {NP_STAGE_FORWARD, -1},     [NP_MARK_FORWARD_END] = {NP_STAGE_OUTSIDE, NP_STAGE_FORWARD},
    [NP_MARK_BACKWARD_BEGIN] = {NP_STAGE_BACKWARD, -1},   [NP_MARK_BACKWARD_END] = {NP_STAGE_OUTSIDE, NP_STAGE_BACKWARD},
    [NP_MARK_LAYER_ENTER] = {-1, -1},                     [NP_MARK_LAYER_EXIT] = {-1, -1},
    [NP_MARK_OPTIMIZER_BEGIN] = {NP_STAGE_OPTIMIZER, -1}, [NP_MARK_OPTIMIZER_END] = {NP_STAGE_OUTSIDE, NP_STAGE_OPTIMIZER},
    [NP_MARK_EVAL_BEGIN] = {NP_STAGE_EVAL, -1},           [NP_MARK_EVAL_END] = {NP_STAGE_OUTSIDE, NP_STAGE_EVAL},
};

int np_mark_opens(int code) { return code >= 0 && code < NP_MARK_COUNT ? stage_of[code].opens : -1; }
int np_mark_closes(int code) { return code >= 0 && code < NP_MARK_COUNT ? stage_of[code].closes : -1; }

void np_ctx_set_phase(np_ctx *ctx, uint32_t phase, int default_life) {
  ctx->marks.any = true;
  ctx->phase = phase;
  ctx->default_life = default_life;
  ctx->base_life = default_life;
}

int np_ctx_mark(np_ctx *ctx, int code, int64_t arg) {
  if (code < 0 || code >= NP_MARK_COUNT) return np_error(NP_ERR_INVALID, "unknown marker code %d", code);
  np_marks *m = &ctx->marks;
  m->any = true;
  m->pos = 0;
  np_ctx_record(ctx, NP_EV_MARK, 0, 0, (intptr_t)arg, code, -1, 0);
  m->code = code;
  int stage = stage_of[code].opens;
  if (stage < 0) { /* layer markers stay in the stage */
    m->layer = arg;
    return NP_OK;
  }
  m->layer = -1;
  if (code == NP_MARK_FORWARD_BEGIN || code == NP_MARK_BACKWARD_BEGIN) m->micro = arg;
  m->later_micro = (code == NP_MARK_FORWARD_BEGIN || code == NP_MARK_BACKWARD_BEGIN) && arg > 0;
  ctx->phase++; /* every other marker ends the stage */
  if (code == NP_MARK_OPTIMIZER_END && arg == NP_OPTIMIZER_SKIPPED && m->stage == NP_STAGE_OPTIMIZER && m->optimizer_steps)
    m->optimizer_steps--; /* a step skipped (an overflow under loss scaling) made no states: the next is the first */
  m->stage = stage;
  switch (stage) {
    case NP_STAGE_SETUP: ctx->default_life = NP_LIFE_LONG; break;
    case NP_STAGE_FORWARD: ctx->default_life = ctx->base_life; break;
    /* backward: activation gradients and scratch die inside it; gradients are learned */
    case NP_STAGE_BACKWARD: ctx->default_life = NP_LIFE_SHORT; break;
    /* the first step creates the optimizer states, which live for the whole run (one that ends
     * skipped, NP_OPTIMIZER_SKIPPED, does not count: Megatron's first fp16 steps often overflow) */
    case NP_STAGE_OPTIMIZER: ctx->default_life = m->optimizer_steps++ == 0 ? NP_LIFE_LONG : NP_LIFE_SHORT; break;
    case NP_STAGE_EVAL: m->eval = true; ctx->default_life = NP_LIFE_SHORT; break;
    default: ctx->default_life = ctx->base_life; break; /* ends, iteration markers */
  }
  if (code == NP_MARK_EVAL_END) m->eval = false;
  if (m->eval) ctx->default_life = NP_LIFE_SHORT; /* nothing of an evaluation outlives it */
  return NP_OK;
}
