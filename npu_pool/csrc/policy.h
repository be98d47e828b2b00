/* policy.h -- what a placement policy is. A policy is one file (policy_<name>.c) defining an
 * np_policy, plus one line in policies.c: nothing else in the core names a policy.
 *
 * malloc returns an allocated block with size, pool and stream set (the context accounts
 * for it and files it); free takes a block already removed from the map and accounted.
 * Device memory is taken through np_segment_create / np_vmm_map and given back through
 * np_segment_destroy / np_vmm_unmap, which account for it: a policy never touches the
 * reserved counters. Hooks marked optional may be NULL.
 */
#ifndef NP_POLICY_H
#define NP_POLICY_H

#include "context.h"

struct np_policy {
  const char *name;
  const char *summary;                /* one line: what the policy is */
  const char *pool_name[NP_POOLS];    /* the two pools its blocks are counted in */
  const char *pool_meaning[NP_POOLS]; /* what each pool holds */
  const char *memory;                 /* its memory as messages name it when no one pool failed (NULL: "the arena") */
  /* The policy orders reuse across streams itself (event waits): a freed block that was used
   * on other streams (record_stream) needs no device synchronisation from the context. */
  bool orders_streams;
  /* A model of a framework's own allocator (PyTorch's, torch_npu's): its device calls are the
   * framework's. With no memory fraction set it asks the device for a segment without a cap of
   * its own (a refused malloc is a device call; it then frees its cache and asks again), and it
   * keeps each thread's current device without asking (the simulated device counts no lookup:
   * torch_npu's allocator made none, measured live). */
  bool framework;
  /* It places a request where its place key's last block lay (ctx->again; the arena's
   * placed_again): the context keeps places for it (np_lifetime), for no other. */
  bool keeps_places;
  int (*init)(np_ctx *ctx);
  void (*destroy)(np_ctx *ctx);       /* return every segment */
  int (*malloc)(np_ctx *ctx, uint64_t size, intptr_t stream, int lifetime, np_block **out);
  void (*free)(np_ctx *ctx, np_block *b);
  int (*empty_cache)(np_ctx *ctx);    /* the device is synchronised */
  /* optional, the device idle: replace every chunk of its arenas that holds live blocks and free
   * pages by chunks over their live pages (np_compact). A policy that has it also compacts at an
   * out-of-memory when np_set_compaction asks it to (arena.h). */
  int (*compact)(np_ctx *ctx);
  /* optional, with compact: the bytes compact would give back now (np_arena_pinned of its arenas),
   * for an out-of-memory message: asked only as the message is written. */
  uint64_t (*pinned)(np_ctx *ctx);
  int (*set_limit)(np_ctx *ctx, uint64_t limit); /* optional; may refuse a new limit */
  void (*fill_stats)(np_ctx *ctx, np_stats *st); /* optional: largest_free, arena figures */
  int (*check)(np_ctx *ctx);          /* optional: the policy's own invariants */
  void (*record_stream)(np_ctx *ctx, np_block *b, intptr_t stream); /* optional: b is used on `stream` too */
  /* optional, fidelity replays (torch policy): a recorded segment, a block at a recorded address */
  int (*prime_segment)(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, int pool);
  int (*alloc_at)(np_ctx *ctx, uintptr_t addr, uint64_t size, intptr_t stream, np_block **out);
  /* optional, tagged regions (npu_pool.h: np_region, np_pause, np_resume, np_tags) */
  int (*region)(np_ctx *ctx, const char *tag);
  int (*pause)(np_ctx *ctx, const char *tag, bool backup, uint64_t *bytes);
  int (*resume)(np_ctx *ctx, const char *tag, uint64_t *bytes);
  int (*tags)(np_ctx *ctx, np_tag_info *out, size_t cap, size_t *n);
  int (*set_backup_limit)(np_ctx *ctx, uint64_t bytes);
};

/* The registry (policies.c): NULL outside 0..np_policy_count()-1. */
const np_policy *np_policy_at(int index);

#endif
