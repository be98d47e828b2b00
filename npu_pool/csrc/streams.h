/* streams.h -- which streams used free memory, and ordering its reuse after them.
 *
 * Free memory carries a tag: the stream that used it last, NP_STREAM_ANY (never used,
 * or synchronised since), or NP_STREAM_MIXED (merged memory of several streams). A
 * reuse by another stream is ordered on the device (the backend's stream_wait: an event
 * recorded on one stream, waited on by the other), never by a host synchronisation.
 * Mixed memory is ordered after every stream of an np_streams set: the streams seen
 * allocating or named by record_stream.
 * Invariant: ids are unique, n <= NP_MAX_STREAMS; `full` is set once a stream did not
 * fit, and from then on mixed memory can neither be ordered after nor counted settled.
 */
#ifndef NP_STREAMS_H
#define NP_STREAMS_H

#include "context.h"

#define NP_STREAM_MIXED (INTPTR_MIN + 1)
#define NP_MAX_STREAMS 64

/* Whether `stream` is one of the two tags (never a caller's stream: refused where one comes in). */
static inline bool np_stream_is_tag(intptr_t stream) { return stream == NP_STREAM_ANY || stream == NP_STREAM_MIXED; }

typedef struct np_streams {
  intptr_t ids[NP_MAX_STREAMS];
  int n;
  bool full;
} np_streams;

/* The tag of two free ranges merged into one. */
intptr_t np_tag_merge(intptr_t a, intptr_t b);
void np_streams_note(np_streams *s, intptr_t stream);
/* Whether memory tagged `tag` can be ordered for `stream` without a synchronisation. */
bool np_tag_orderable(const np_ctx *ctx, const np_streams *s, intptr_t tag, intptr_t stream);
/* Make `stream` wait on the device for the work queued on the streams behind `tag`
 * (counted in stats.stream_waits); NP_ERR_STATE where np_tag_orderable says no. */
int np_order_after(np_ctx *ctx, const np_streams *s, intptr_t stream, intptr_t tag);
/* Whether every stream behind `tag` has finished its queued work (backend stream_idle). */
bool np_tag_settled(np_ctx *ctx, const np_streams *s, intptr_t tag);

#endif
