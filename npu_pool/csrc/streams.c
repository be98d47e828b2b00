/* streams.c -- stream tags of free memory (see streams.h). */
#include "streams.h"

intptr_t np_tag_merge(intptr_t a, intptr_t b) {
  return a == b || b == NP_STREAM_ANY ? a : a == NP_STREAM_ANY ? b : NP_STREAM_MIXED;
}

void np_streams_note(np_streams *s, intptr_t stream) {
  for (int i = 0; i < s->n; i++)
    if (s->ids[i] == stream) return;
  if (s->n < NP_MAX_STREAMS) s->ids[s->n++] = stream;
  else s->full = true;
}

bool np_tag_orderable(const np_ctx *ctx, const np_streams *s, intptr_t tag, intptr_t stream) {
  if (tag == stream || tag == NP_STREAM_ANY) return true;
  return ctx->be->stream_wait && !(tag == NP_STREAM_MIXED && s->full);
}

int np_order_after(np_ctx *ctx, const np_streams *s, intptr_t stream, intptr_t tag) {
  if (tag == NP_STREAM_ANY || tag == stream) return NP_OK;
  if (!np_tag_orderable(ctx, s, tag, stream))
    return np_error(NP_ERR_STATE, "memory used by other streams cannot be ordered for stream %#lx", (unsigned long)stream);
  ctx->st.stream_waits++;
  if (tag != NP_STREAM_MIXED) return ctx->be->stream_wait(ctx->be, stream, tag);
  for (int i = 0; i < s->n; i++) {
    if (s->ids[i] == stream) continue;
    int rc = ctx->be->stream_wait(ctx->be, stream, s->ids[i]);
    if (rc != NP_OK) return rc;
  }
  return NP_OK;
}

bool np_tag_settled(np_ctx *ctx, const np_streams *s, intptr_t tag) {
  if (tag == NP_STREAM_ANY) return true;
  if (!ctx->be->stream_idle) return false;
  if (tag != NP_STREAM_MIXED) return ctx->be->stream_idle(ctx->be, tag) == 1;
  if (s->full) return false;
  for (int i = 0; i < s->n; i++)
    if (ctx->be->stream_idle(ctx->be, s->ids[i]) != 1) return false;
  return true;
}
