/* vocab.c -- the names of the shared vocabulary (codes in npu_pool.h). Python builds its
 * tables from these (npu_pool/vocab.py), so a name exists once. */
#include "common.h"

static const char *const backends[NP_BACKEND_COUNT] = {"sim", "acl", "cuda"};
static const char *const lives[NP_LIFE_COUNT] = {"auto", "long", "short"};
static const char *const marks[NP_MARK_COUNT] = {
    "setup_begin",    "setup_end",    "iter_begin",  "iter_end",   "forward_begin",   "forward_end",
    "backward_begin", "backward_end", "layer_enter", "layer_exit", "optimizer_begin", "optimizer_end",
    "eval_begin",     "eval_end"};
static const char *const ops[NP_OP_COUNT] = {"alloc",    "free",         "mark",       "empty_cache", "seg_hint",
                                             "seg_free", "init_segment", "init_alloc", "oom",
                                             "region",   "pause",        "resume"};
static const char *const cats[NP_CAT_COUNT] = {"unknown",    "parameter", "gradient", "optimizer_state",
                                               "activation", "temporary", "input",    "autograd_detail"};
static const char *const hints[NP_HINTS_COUNT] = {"none", "sites", "oracle", "markers"};
static const char *const events[NP_EV_COUNT] = {"alloc",         "free",          "segment_alloc",
                                                "segment_free",  "segment_map",   "segment_unmap",
                                                "empty_cache",   "oom",           "mark",
                                                "hold",          "unhold",        "compact"};
static const char *const errors[] = {"ok",      "out_of_memory", "invalid", "double_free",
                                     "unknown_pointer", "backend", "host", "state"};

static const char *const ooms[NP_OOM_COUNT] = {"none", "too_large", "fragmentation", "shortage", "device"};
static const char *const devices[NP_DEVICE_COUNT] = {"auto", "npu", "cuda"};
static const char *const calls[NP_CALL_COUNT] = {
    "malloc",       "free",         "reserve",      "release",       "phys_create", "phys_release", "map",
    "unmap",        "set_access",   "sync_device",  "sync_stream",   "event_create", "event_record", "event_wait",
    "event_destroy", "stream_query", "get_device",  "set_device",    "mem_info",    "granularity"};
static const char *const acl_calls[NP_CALL_COUNT] = {
    "aclrtMalloc",           "aclrtFree",           "aclrtReserveMemAddress", "aclrtReleaseMemAddress",
    "aclrtMallocPhysical",   "aclrtFreePhysical",   "aclrtMapMem",            "aclrtUnmapMem",
    NULL,                    "aclrtSynchronizeDevice", "aclrtSynchronizeStream", "aclrtCreateEventExWithFlag",
    "aclrtRecordEvent",      "aclrtStreamWaitEvent", "aclrtDestroyEvent",     "aclrtStreamQuery",
    "aclrtGetDevice",        "aclrtSetDevice",      "aclrtGetMemInfo",        "aclrtMemGetAllocationGranularity"};
static const char *const cuda_calls[NP_CALL_COUNT] = {
    "cudaMalloc",          "cudaFree",           "cuMemAddressReserve", "cuMemAddressFree",     "cuMemCreate",
    "cuMemRelease",        "cuMemMap",           "cuMemUnmap",          "cuMemSetAccess",       "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventDestroy",
    "cudaStreamQuery",     "cudaGetDevice",      "cudaSetDevice",       "cudaMemGetInfo",       "cuMemGetAllocationGranularity"};
_Static_assert(NP_CALL_COUNT == sizeof ((np_stats *)0)->calls / sizeof(uint64_t), "np_stats.calls has NP_CALL_COUNT entries");
static const char *const stages[NP_STAGE_COUNT] = {"outside", "setup", "forward", "backward", "optimizer", "eval"};

static const struct {
  const char *const *names;
  int n;
} tables[NP_VOCAB_COUNT] = {
    [NP_VOCAB_BACKEND] = {backends, NP_BACKEND_COUNT}, [NP_VOCAB_LIFE] = {lives, NP_LIFE_COUNT},
    [NP_VOCAB_MARK] = {marks, NP_MARK_COUNT},          [NP_VOCAB_OP] = {ops, NP_OP_COUNT},
    [NP_VOCAB_CAT] = {cats, NP_CAT_COUNT},             [NP_VOCAB_HINTS] = {hints, NP_HINTS_COUNT},
    [NP_VOCAB_EVENT] = {events, NP_EV_COUNT},          [NP_VOCAB_ERROR] = {errors, NP_ERR_STATE + 1},
    [NP_VOCAB_OOM] = {ooms, NP_OOM_COUNT},             [NP_VOCAB_STAGE] = {stages, NP_STAGE_COUNT},
    [NP_VOCAB_DEVICE] = {devices, NP_DEVICE_COUNT},
    [NP_VOCAB_CALL] = {calls, NP_CALL_COUNT},          [NP_VOCAB_CALL_ACL] = {acl_calls, NP_CALL_COUNT},
    [NP_VOCAB_CALL_CUDA] = {cuda_calls, NP_CALL_COUNT},
};

const char *np_vocab_name(int vocab, int code) {
  if (vocab < 0 || vocab >= NP_VOCAB_COUNT || code < 0 || code >= tables[vocab].n) return NULL;
  return tables[vocab].names[code];
}
