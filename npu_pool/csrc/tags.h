/* tags.h -- tagged regions of the npu_pool policy: pause and resume a tag's memory (colocated RL).
 *
 * Each tag is its own arena (arena.h): its own address reservation, best fit and lifetime
 * classes inside it, so that pausing it returns whole physical chunks and touches no other
 * tag's memory. Pausing unmaps every mapped chunk of the tag's reservation (the chunks its
 * arena grew by, and those a resume mapped) and keeps its blocks (addresses stay valid, tensors
 * keep their data_ptr()); resuming maps the pages under the blocks still allocated again, at the
 * same addresses, one physical chunk per run of touching blocks, and restores the backup if one
 * was taken. Only the range-level VMM entry points (np_vmm_map / np_vmm_unmap) and the arena's
 * public functions are used.
 *
 * Invariants: a paused tag's reservation has nothing mapped (its page table is empty, its
 * segment's mapped bytes 0; what refused to unmap is held by the context) and the tag takes no requests; a
 * backup entry names a block of its tag allocated when the tag was paused (freed since: skipped
 * at resume) and lies in its tag's host buffer; `backup_bytes` is the sum of the backups' sizes,
 * `backup_held` the sum of the tags' host buffers' sizes (at least backup_bytes), and a pause
 * never takes backup_held past `backup_limit`; `current` is -1 or a tag index.
 *
 * A tag's host buffer is one pinned allocation its backups are copied into, kept after resume for
 * the next pause (colocated RL pauses the same tensors every iteration): pinning and unpinning
 * host memory costs far more than the copies (measured on an H100: docs/gpu.md, "Colocated RL").
 * A pause that needs more takes a larger one. The buffers stay until close, as torch keeps its
 * pinned host blocks (empty_cache returns device memory only: an RL loop calling it every
 * iteration would pin again every iteration); a lower bound gives back those that hold no
 * backup, and so does a pause that needs room under the bound. Every arena's budget is set (np_tags_budget) before a call
 * into it: the others' mapped bytes are both set aside from its cap and outside its reserved.
 */
#ifndef NP_TAGS_H
#define NP_TAGS_H

#include "arena.h"

typedef struct np_backup {
  uintptr_t addr;       /* the block */
  uint64_t size;        /* bytes copied (the block's requested size) */
  void *host;           /* pinned host copy; NULL on a device without contents (sim, not host-backed) */
} np_backup;

typedef struct np_tag {
  char name[NP_TAG_NAME];
  np_arena arena;
  bool paused;
  uint64_t pauses;
  np_backup *backup;
  size_t n_backup;
  void *host;           /* the host buffer backups are copied into (NULL: none, or a device without contents) */
  uint64_t host_size;   /* its bytes; counted on a device without contents too */
} np_tag;

typedef struct np_tagset {
  np_tag *at[NP_TAG_MAX];
  int n;
  int current;              /* the region entered: index into at, or -1 (the main arena) */
  uint64_t backup_limit;    /* host bytes backups may hold, over all tags */
  uint64_t backup_bytes;     /* host bytes holding paused tags' contents */
  uint64_t backup_held;      /* host bytes of the tags' buffers: those contents and the kept rest */
} np_tagset;

void np_tags_init(np_ctx *ctx, np_tagset *t);
/* Return every tag's memory and free its backups and host buffers. */
void np_tags_drop(np_ctx *ctx, np_tagset *t);
/* Set a's view of the budget: the other arenas' mapped bytes are set aside and outside it. */
void np_tags_budget(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *a);
/* The tag arena that owns b, or NULL (the main arena's, or no arena's). */
np_arena *np_tags_owner(np_tagset *t, const np_block *b);
/* Place a request in the current region's arena (or main); on failure, return the other
 * arenas' idle pages and retry once. */
int np_tags_malloc(np_ctx *ctx, np_tagset *t, np_arena *main, uint64_t size, intptr_t stream, bool long_lived,
                   np_block **out);
/* Return idle pages of every arena but `skip` (the device is synchronised). */
void np_tags_release_idle(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *skip);
int np_tags_region(np_ctx *ctx, np_tagset *t, const char *name);
int np_tags_pause(np_ctx *ctx, np_tagset *t, const char *name, bool backup, uint64_t *bytes);
int np_tags_resume(np_ctx *ctx, np_tagset *t, np_arena *main, const char *name, uint64_t *bytes);
int np_tags_info(np_ctx *ctx, np_tagset *t, np_tag_info *out, size_t cap, size_t *n);
int np_tags_empty_cache(np_ctx *ctx, np_tagset *t, np_arena *main);
/* The device idle: the chunks of every arena but `skip` (the main one's, unpaused tags') that hold
 * live blocks and free pages replaced by chunks over their live pages, each arena within its share
 * of the cap (np_arena_compact). NP_ERR_STATE if live bytes were lost (ctx->lost: np_vmm_compact's
 * message), else the first refusal of a chunk the device would not let go (it stays as it was). */
int np_tags_compact(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *skip);
/* What np_tags_compact of every arena would give back: the free pages that live blocks' chunks keep
 * mapped in the main arena and the unpaused tags' (np_arena_pinned; a paused tag has none mapped). */
uint64_t np_tags_pinned(np_ctx *ctx, np_tagset *t, np_arena *main);
/* Bound the host bytes backups may hold; buffers holding no backup go back if the pool holds more. */
void np_tags_set_backup_limit(np_ctx *ctx, np_tagset *t, uint64_t bytes);
void np_tags_fill_stats(np_ctx *ctx, np_tagset *t, np_arena *main, np_stats *st);
int np_tags_check(np_ctx *ctx, np_tagset *t, np_arena *main);

#endif
