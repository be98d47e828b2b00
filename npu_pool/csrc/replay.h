/* replay.h -- trace event ops, shared with npu_pool/trace/format.py (OP_*, CAT_*). */
#ifndef NP_REPLAY_H
#define NP_REPLAY_H

enum {
  NP_OP_ALLOC = 0, NP_OP_FREE = 1, NP_OP_MARK = 2, NP_OP_EMPTY_CACHE = 3,
  NP_OP_SEG_HINT = 4, NP_OP_SEG_FREE = 5, NP_OP_INIT_SEGMENT = 6, NP_OP_INIT_ALLOC = 7
};

enum {
  NP_CAT_UNKNOWN = 0, NP_CAT_PARAMETER = 1, NP_CAT_GRADIENT = 2, NP_CAT_OPTIMIZER_STATE = 3,
  NP_CAT_ACTIVATION = 4, NP_CAT_TEMPORARY = 5, NP_CAT_INPUT = 6, NP_CAT_AUTOGRAD_DETAIL = 7
};

#endif
