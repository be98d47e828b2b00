/* tags.c -- tagged regions: per-tag arenas, pause and resume (see tags.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"
#include "tags.h"
#include "vmm.h"

void np_tags_init(np_ctx *ctx, np_tagset *t) {
  memset(t, 0, sizeof *t);
  t->current = -1;
  t->backup_limit = ctx->be->total; /* default bound: one device's worth of host memory */
}

static np_tag *find(np_tagset *t, const char *name) {
  for (int i = 0; i < t->n; i++)
    if (!strcmp(t->at[i]->name, name)) return t->at[i];
  return NULL;
}

static int bad_name(const char *name) {
  if (!name || !*name) return np_error(NP_ERR_INVALID, "a tag is a non-empty name");
  size_t n = strnlen(name, NP_TAG_NAME);
  if (n >= NP_TAG_NAME) return np_error(NP_ERR_INVALID, "tag names are at most %d bytes", NP_TAG_NAME - 1);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)name[i] < 0x20 || (unsigned char)name[i] > 0x7e)
      return np_error(NP_ERR_INVALID, "tag names are printable ASCII");
  return NP_OK;
}

/* "pause: no tag 'x' (tags: a, b)" */
static int unknown(np_tagset *t, const char *what, const char *name) {
  char known[256] = "";
  size_t at = 0;
  for (int i = 0; i < t->n && at < sizeof known - 1; i++)
    at += (size_t)snprintf(known + at, sizeof known - at, "%s%s", i ? ", " : "", t->at[i]->name);
  return np_error(NP_ERR_INVALID, "%s: no tag '%s' (tags: %s); tensors get a tag when allocated inside "
                  "npu_pool.region(tag)", what, name, t->n ? known : "none yet");
}

static uint64_t mapped_of(const np_arena *a) { return a->seg ? a->seg->mapped : 0; }

void np_tags_budget(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *a) {
  (void)ctx;
  uint64_t others = main == a ? 0 : mapped_of(main);
  for (int i = 0; i < t->n; i++)
    if (&t->at[i]->arena != a) others += mapped_of(&t->at[i]->arena);
  a->set_aside = a->outside = others; /* the cap less the others' bytes; its own reserved bytes */
}

np_arena *np_tags_owner(np_tagset *t, const np_block *b) {
  for (int i = 0; i < t->n; i++)
    if (np_arena_owns(&t->at[i]->arena, b)) return &t->at[i]->arena;
  return NULL;
}

void np_tags_release_idle(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *skip) {
  np_arena *all[NP_TAG_MAX + 1];
  int n = 0;
  all[n++] = main;
  for (int i = 0; i < t->n; i++)
    if (!t->at[i]->paused) all[n++] = &t->at[i]->arena;
  for (int i = 0; i < n; i++) {
    if (all[i] == skip || !all[i]->seg || !all[i]->vmm) continue; /* a fixed arena is never returned here */
    np_tags_budget(ctx, t, main, all[i]);
    np_arena_empty_cache(ctx, all[i]); /* a page the device refuses stays mapped and counted */
  }
}

static uint64_t idle_elsewhere(np_tagset *t, np_arena *main, np_arena *a); /* (below, with blocks_of) */

uint64_t np_tags_pinned(np_ctx *ctx, np_tagset *t, np_arena *main) {
  uint64_t sum = np_arena_pinned(ctx, main);
  for (int i = 0; i < t->n; i++)
    if (!t->at[i]->paused) sum += np_arena_pinned(ctx, &t->at[i]->arena);
  return sum;
}

int np_tags_compact(np_ctx *ctx, np_tagset *t, np_arena *main, np_arena *skip) {
  np_saved_error first = {.code = NP_OK};
  for (int i = -1; i < t->n; i++) {
    np_arena *o = i < 0 ? main : &t->at[i]->arena;
    if (o == skip || (i >= 0 && t->at[i]->paused)) continue;
    np_tags_budget(ctx, t, main, o);
    int rc;
    np_arena_compact(ctx, o, &rc);
    if (ctx->lost) return rc;
    if (rc != NP_OK && first.code == NP_OK) np_save_error(&first, rc);
  }
  return first.code == NP_OK ? NP_OK : np_restore_error(&first);
}

/* np_tags_malloc once a tag exists (out of line: without tags a request is a tail call). */
__attribute__((noinline)) static int tagged_malloc(np_ctx *ctx, np_tagset *t, np_arena *main, uint64_t size,
                                                   intptr_t stream, bool long_lived, np_block **out) {
  np_arena *a = main;
  if (t->current >= 0) {
    np_tag *g = t->at[t->current];
    if (g->paused) {
      char x[32];
      return np_error(NP_ERR_STATE, "allocation of %s inside region '%s': the tag is paused; resume it first",
                      np_fmt_bytes(size, x), g->name);
    }
    a = &g->arena;
  }
  np_tags_budget(ctx, t, main, a);
  int rc = np_arena_malloc(ctx, a, size, stream, long_lived, out);
  if (rc != NP_ERR_OOM) return rc;
  /* the other arenas' idle pages count against the same cap: return them, retry once (the device
   * is idle already where the arena's retry synchronised it, this request) */
  rc = np_ctx_drain(ctx);
  if (rc != NP_OK) return rc;
  np_tags_release_idle(ctx, t, main, a);
  np_tags_budget(ctx, t, main, a);
  rc = np_arena_malloc(ctx, a, size, stream, long_lived, out);
  if (rc == NP_ERR_OOM && ctx->compact) { /* (a compacted its own chunks already: the others' too, once more) */
    if ((rc = np_tags_compact(ctx, t, main, a)) != NP_OK && ctx->lost) return rc; /* (a chunk kept: tried anyway) */
    np_tags_budget(ctx, t, main, a);
    rc = np_arena_malloc(ctx, a, size, stream, long_lived, out);
  }
  if (rc == NP_ERR_OOM) ctx->fail.elsewhere = idle_elsewhere(t, main, a);
  return rc;
}

int np_tags_malloc(np_ctx *ctx, np_tagset *t, np_arena *main, uint64_t size, intptr_t stream, bool long_lived,
                   np_block **out) {
  if (t->n) return tagged_malloc(ctx, t, main, size, stream, long_lived, out);
  main->set_aside = main->outside = 0; /* no tags (the common case): the main arena has the whole cap */
  return np_arena_malloc(ctx, main, size, stream, long_lived, out);
}

int np_tags_region(np_ctx *ctx, np_tagset *t, const char *name) {
  if (!name) {
    t->current = -1;
    return NP_OK;
  }
  int rc = bad_name(name);
  if (rc != NP_OK) return rc;
  for (int i = 0; i < t->n; i++)
    if (!strcmp(t->at[i]->name, name)) {
      t->current = i;
      return NP_OK;
    }
  if (t->n == NP_TAG_MAX) return np_error(NP_ERR_INVALID, "region '%s': a pool holds at most %d tags", name, NP_TAG_MAX);
  np_tag *g = calloc(1, sizeof *g);
  if (!g) return np_error(NP_ERR_HOST, "host out of memory for a tag");
  np_arena_init(ctx, &g->arena);
  g->arena.counts_hwm = false; /* (arena_hwm is the main arena's) */
  if (!g->arena.vmm) {
    free(g);
    return np_error(NP_ERR_STATE, "region '%s': tagged regions need the device's virtual-memory API (backend %s%s)",
                    name, ctx->be->name, ctx->cfg.vmm ? " has none" : ", turned off by vmm=False");
  }
  snprintf(g->name, sizeof g->name, "%s", name);
  t->at[t->n] = g;
  t->current = t->n++;
  return NP_OK;
}

/* ---- page runs under allocated blocks ------------------------------------------------------ */

/* The page-aligned runs covering the allocated blocks of a, merged, as (addr, size) pairs into
 * out (NULL: count only); returns the number of runs, *bytes their total. */
static size_t runs(const np_arena *a, uint64_t *out, uint64_t *bytes) {
  size_t n = 0;
  uint64_t lo = 0, hi = 0;
  *bytes = 0;
  if (!a->seg) return 0;
  for (np_block *b = a->seg->head;; b = b->next) {
    if (b && !b->allocated) continue;
    uint64_t first = b ? np_round_down(b->addr - a->seg->addr, a->page) : 0;
    uint64_t end = b ? np_round_up(b->addr + b->size - a->seg->addr, a->page) : 0;
    if (b && hi > lo && first <= hi) { /* touches the run: extend it */
      hi = np_max_u64(hi, end);
      continue;
    }
    if (hi > lo) { /* the run ends: emit it */
      if (out) {
        out[2 * n] = a->seg->addr + lo;
        out[2 * n + 1] = hi - lo;
      }
      n++;
      *bytes += hi - lo;
    }
    if (!b) return n;
    lo = first;
    hi = end;
  }
}

static void blocks_of(const np_arena *a, uint64_t *bytes, uint64_t *count) {
  *bytes = *count = 0;
  for (np_block *b = a->seg ? a->seg->head : NULL; b; b = b->next)
    if (b->allocated) {
      *bytes += b->size;
      ++*count;
    }
}

/* Free bytes mapped in the arenas other than `a` (paused ones map nothing): what their live blocks
 * keep mapped around them once empty_cache has returned every wholly free chunk. */
static uint64_t idle_elsewhere(np_tagset *t, np_arena *main, np_arena *a) {
  uint64_t idle = 0;
  for (int i = -1; i < t->n; i++) {
    np_arena *o = i < 0 ? main : &t->at[i]->arena;
    if (o == a || !o->seg || (i >= 0 && t->at[i]->paused)) continue;
    uint64_t allocated = np_arena_allocated(o); /* (a walk over its blocks cost a refusal 190 us at 32,000) */
    idle += o->seg->mapped > allocated ? o->seg->mapped - allocated : 0;
  }
  return idle;
}

/* ---- backups -------------------------------------------------------------------------------- */

/* A block's place in its tag's host buffer: its requested bytes, rounded so that every copy starts
 * aligned (the bound counts the buffer). */
#define NP_BACKUP_ALIGN 64

/* Drop g's backup entries (its host buffer stays, for the next pause). */
static void free_backup(np_tagset *t, np_tag *g) {
  for (size_t i = 0; i < g->n_backup; i++) t->backup_bytes -= g->backup[i].size;
  free(g->backup);
  g->backup = NULL;
  g->n_backup = 0;
}

/* Give g's host buffer back (g holds no backup in it). */
static void drop_host(np_ctx *ctx, np_tagset *t, np_tag *g) {
  if (g->host) ctx->be->host_free(ctx->be, g->host);
  t->backup_held -= g->host_size;
  g->host = NULL;
  g->host_size = 0;
}

/* Give back the host buffers of the tags that hold no backup. */
static void drop_kept(np_ctx *ctx, np_tagset *t) {
  for (int i = 0; i < t->n; i++)
    if (!t->at[i]->n_backup) drop_host(ctx, t, t->at[i]);
}

void np_tags_set_backup_limit(np_ctx *ctx, np_tagset *t, uint64_t bytes) {
  t->backup_limit = bytes;
  if (t->backup_held > bytes) drop_kept(ctx, t);
}

/* A device whose memory has no contents (the simulator without host backing) counts backups. */
static bool counts_only(const np_ctx *ctx) { return ctx->cfg.backend == NP_BACKEND_SIM && !ctx->cfg.host_backed; }

/* Host bytes the backup bound still allows. */
static uint64_t room_of(const np_tagset *t) { return t->backup_limit - np_min_u64(t->backup_held, t->backup_limit); }

/* Host bytes of the buffers kept by tags that hold no backup (drop_kept gives them back). */
static uint64_t kept_of(const np_tagset *t) {
  uint64_t kept = 0;
  for (int i = 0; i < t->n; i++)
    if (!t->at[i]->n_backup) kept += t->at[i]->host_size;
  return kept;
}

/* Whether g may hold a host buffer of `need` bytes within the bound: its own when large enough (one
 * pinned allocation serves every pause of a tag whose tensors stay the same), else a new one,
 * after giving back g's and, if the bound requires it, the other tags' kept buffers; none is
 * given back when even that would not make room. A bound lowered below what the pool holds gives
 * back every buffer holding no backup (g's too) first. */
static bool room_for(np_ctx *ctx, np_tagset *t, np_tag *g, uint64_t need) {
  if (t->backup_held > t->backup_limit) drop_kept(ctx, t);
  if (g->host_size >= need) return true;
  uint64_t backups = t->backup_held - kept_of(t); /* what no pause can give back */
  if (backups > t->backup_limit || need > t->backup_limit - backups) return false;
  drop_host(ctx, t, g);
  if (need > room_of(t)) drop_kept(ctx, t);
  return need <= room_of(t);
}

/* Copy the tag's allocated blocks into its host buffer, within the bound; all or nothing. */
static int save(np_ctx *ctx, np_tagset *t, np_tag *g) {
  np_backend *be = ctx->be;
  bool copies = be->copy && be->host_alloc && be->host_free;
  if (!copies && !counts_only(ctx))
    return np_error(NP_ERR_STATE, "pause of tag '%s' with backup: backend %s cannot copy device memory to the host; "
                    "pause without backup", g->name, be->name);
  uint64_t bytes = 0, need = 0, n = 0;
  for (np_block *b = g->arena.seg ? g->arena.seg->head : NULL; b; b = b->next)
    if (b->allocated) {
      bytes += b->requested;
      need += np_round_up(b->requested, NP_BACKUP_ALIGN);
      n++;
    }
  np_backup *k = n ? calloc(n, sizeof *k) : NULL;
  if (n && !k) return np_error(NP_ERR_HOST, "host out of memory for %llu backup entries", (unsigned long long)n);
  if (!room_for(ctx, t, g, need)) {
    free(k);
    char w[32], x[32], y[32], z[32];
    return np_error(NP_ERR_OOM, "pause of tag '%s' with backup: a host buffer of %s (%s of contents) would pass the "
                    "backup bound of %s (%s already held; set_backup_limit raises the bound); nothing was paused",
                    g->name, np_fmt_bytes(need, w), np_fmt_bytes(bytes, x), np_fmt_bytes(t->backup_limit, y),
                    np_fmt_bytes(t->backup_held, z));
  }
  g->backup = k;
  g->n_backup = 0;
  int rc = NP_OK;
  if (g->host_size < need) { /* a new buffer (room_for gave g's back) */
    if (copies) rc = be->host_alloc(be, need, &g->host);
    if (rc == NP_OK) {
      g->host_size = need;
      t->backup_held += need;
    } else {
      g->host = NULL;
    }
  }
  uint64_t off = 0;
  for (np_block *b = g->arena.seg ? g->arena.seg->head : NULL; b && rc == NP_OK; b = b->next) {
    if (!b->allocated) continue;
    np_backup *e = &k[g->n_backup];
    *e = (np_backup){.addr = b->addr, .size = b->requested, .host = g->host ? (char *)g->host + off : NULL};
    off += np_round_up(b->requested, NP_BACKUP_ALIGN);
    if (e->host && (rc = be->copy(be, e->host, (void *)b->addr, b->requested, 0)) != NP_OK) break;
    g->n_backup++;
    t->backup_bytes += e->size;
  }
  if (rc != NP_OK) {
    np_saved_error s;
    np_save_error(&s, rc);
    free_backup(t, g); /* (a buffer it has stays, for the next pause) */
    np_restore_error(&s);
    char x[32];
    return np_error(rc, "pause of tag '%s' with backup (%s): %s; nothing was paused", g->name, np_fmt_bytes(bytes, x),
                    s.text);
  }
  return NP_OK;
}

/* Copy the backups back into the blocks still allocated; the first failure. */
static int restore(np_ctx *ctx, np_tag *g) {
  np_backend *be = ctx->be;
  for (size_t i = 0; i < g->n_backup; i++) {
    np_backup *e = &g->backup[i];
    np_block *b = np_ptrmap_find(&ctx->live, e->addr);
    if (!e->host || !b || !np_arena_owns(&g->arena, b)) continue; /* freed while paused */
    int rc = be->copy(be, (void *)e->addr, e->host, np_min_u64(e->size, b->requested), 1);
    if (rc != NP_OK) return rc;
  }
  return NP_OK;
}

/* ---- pause and resume ------------------------------------------------------------------------ */

int np_tags_pause(np_ctx *ctx, np_tagset *t, const char *name, bool backup, uint64_t *bytes) {
  *bytes = 0;
  int rc = bad_name(name);
  if (rc != NP_OK) return rc;
  np_tag *g = find(t, name);
  if (!g) return unknown(t, "pause", name);
  if (g->paused) return np_error(NP_ERR_STATE, "pause: tag '%s' is already paused; resume it first", name);
  rc = np_ctx_synchronize(ctx); /* queued work may still read or write the tag's memory */
  if (rc != NP_OK) return rc;
  if (backup && (rc = save(ctx, t, g)) != NP_OK) return rc;
  np_arena *a = &g->arena;
  /* what the device got back: a chunk the device refused to release (or to unmap) is held, counted
   * in reserved and retried (empty_cache, resume), not in this figure */
  uint64_t before = ctx->st.total.reserved.current;
  if (a->seg) rc = np_vmm_unmap(ctx, a->seg, a->seg->addr, a->seg->size, true); /* what refuses is held, retried */
  g->paused = true; /* with `whole`, the range is unmapped in the page table's view even on a failure */
  g->pauses++;
  *bytes = before - ctx->st.total.reserved.current;
  if (rc == NP_OK) return NP_OK;
  np_saved_error s; /* (the message is rewritten below) */
  np_save_error(&s, rc);
  return np_error(rc, "pause of tag '%s': %s; the tag is paused all the same (the memory the device refused is held, "
                  "and returned at the next empty_cache or resume): resume it before its tensors are used again%s",
                  name, s.text, g->n_backup ? " (resume restores their contents)" : "");
}

/* Map the runs again, all or nothing, within the cap. */
static int map_runs(np_ctx *ctx, np_tag *g, const uint64_t *r, size_t n, uint64_t need) {
  np_vmm_spares_release(ctx); /* the runs map over their own pages, not a spare's size */
  uint64_t reserved = ctx->st.total.reserved.current;
  if (need && (need > ctx->limit || reserved > ctx->limit - need)) { /* (nothing to map fits any cap) */
    char x[32], y[32];
    return np_error(NP_ERR_OOM, "mapping %s more would pass the memory fraction cap of %s", np_fmt_bytes(need, x),
                    np_fmt_bytes(ctx->limit, y));
  }
  for (size_t i = 0; i < n; i++) {
    int rc = np_vmm_map(ctx, g->arena.seg, r[2 * i], r[2 * i + 1], true);
    if (rc != NP_OK) {
      np_saved_error s;
      np_save_error(&s, rc);
      for (size_t j = 0; j < i; j++) np_vmm_unmap(ctx, g->arena.seg, r[2 * j], r[2 * j + 1], true);
      return np_restore_error(&s);
    }
  }
  return NP_OK;
}

int np_tags_resume(np_ctx *ctx, np_tagset *t, np_arena *main, const char *name, uint64_t *bytes) {
  *bytes = 0;
  int rc = bad_name(name);
  if (rc != NP_OK) return rc;
  np_tag *g = find(t, name);
  if (!g) return unknown(t, "resume", name);
  if (!g->paused) return np_error(NP_ERR_STATE, "resume: tag '%s' is not paused", name);
  np_forget_device(); /* a rarer call: its first device call looks the current device up (pause's
                         synchronisation does), the chunk calls and copies after it use it */
  /* a chunk that refused to unmap at the pause is held, still mapped at its address: return it
   * first (as empty_cache would), or mapping the tag's runs over it fails; what stays held is
   * named in the error */
  char held[1024] = "";
  if (ctx->n_held && np_ctx_retry_held(ctx) != NP_OK) np_format_text(held, sizeof held, " (%s)", np_last_error());
  uint64_t need = 0;
  size_t n = runs(&g->arena, NULL, &need);
  uint64_t *r = n ? malloc(2 * n * sizeof *r) : NULL;
  if (n && !r) return np_error(NP_ERR_HOST, "host out of memory for %zu ranges", n);
  runs(&g->arena, r, &need);
  ctx->fail = (np_fail){.pool = NP_POOL_SHARED, .needed = need}; /* (at fixed addresses: nothing else usable) */
  rc = map_runs(ctx, g, r, n, need);
  if (rc == NP_ERR_OOM) {
    /* as a failed malloc does before it retries: what rollouts used and freed must not block */
    ctx->st.retries++;
    rc = np_ctx_synchronize(ctx);
    if (rc == NP_OK) {
      np_tags_release_idle(ctx, t, main, &g->arena);
      rc = map_runs(ctx, g, r, n, need);
      if (rc == NP_ERR_OOM && ctx->compact) {
        if ((rc = np_tags_compact(ctx, t, main, &g->arena)) != NP_OK && ctx->lost) { /* live bytes lost: its message */
          free(r);
          return rc;
        }
        rc = map_runs(ctx, g, r, n, need);
      }
    }
  }
  if (rc == NP_OK && g->n_backup && (rc = restore(ctx, g)) != NP_OK) {
    np_saved_error s;
    np_save_error(&s, rc);
    if (rc == NP_ERR_OOM) { /* the device refused what a copy needed: an out-of-memory event too */
      uint64_t free_bytes;
      bool known;
      ctx->fail.refused = true;
      np_ctx_oom_event(ctx, need, NP_STREAM_ANY, -1, NP_LIFE_LONG, &free_bytes, &known, NULL);
    }
    for (size_t j = 0; j < n; j++) np_vmm_unmap(ctx, g->arena.seg, r[2 * j], r[2 * j + 1], true);
    free(r);
    np_restore_error(&s);
    return np_error(rc, "resume of tag '%s': restoring its backup failed (%s); the tag stays paused with its "
                    "backup", name, s.text);
  }
  free(r);
  if (rc != NP_OK) {
    char x[32], y[32], z[32], cause[1024], why[400] = "";
    np_copy_text(cause, sizeof cause, np_last_error());
    if (rc == NP_ERR_OOM) { /* an out-of-memory of its own, in the history as a malloc's is (oom.explain) */
      uint64_t free_bytes, reserved = ctx->st.total.reserved.current;
      bool known;
      /* at fixed addresses any room under the cap serves it: what it lacked is held in the other
       * arenas' chunks around their live blocks (fragmentation, where that would have been enough) */
      ctx->fail.usable = ctx->limit > reserved ? ctx->limit - reserved : 0;
      ctx->fail.elsewhere = idle_elsewhere(t, main, &g->arena);
      uint64_t pinned; /* (the tag's own arena is paused: all of it is the other arenas') */
      if (np_ctx_oom_event(ctx, need, NP_STREAM_ANY, -1, NP_LIFE_LONG, &free_bytes, &known, &pinned) == NP_OOM_DEVICE) {
        why[0] = ';';
        why[1] = ' ';
        np_ctx_device_refusal(ctx, free_bytes, known, why + 2, sizeof why - 2);
      } else
        np_ctx_compaction_hint(pinned, why, sizeof why);
    }
    return np_error(rc, "resume of tag '%s' failed: its blocks need %s mapped again at their addresses; the pool "
                    "holds %s of the %s cap%s%s; nothing was mapped, the tag stays paused [%s]%s", name,
                    np_fmt_bytes(need, x), np_fmt_bytes(ctx->st.total.reserved.current, y), np_fmt_bytes(ctx->limit, z),
                    rc == NP_ERR_OOM ? " after returning its idle memory" : "", why, cause, held);
  }
  free_backup(t, g); /* the host buffer stays: the next pause copies into it */
  if (t->backup_held > t->backup_limit) drop_host(ctx, t, g); /* unless the bound was lowered meanwhile */
  g->paused = false;
  *bytes = need;
  return NP_OK;
}

/* ---- the rest of the policy's hooks ----------------------------------------------------------- */

int np_tags_info(np_ctx *ctx, np_tagset *t, np_tag_info *out, size_t cap, size_t *n) {
  (void)ctx;
  *n = (size_t)t->n;
  for (int i = 0; i < t->n && (size_t)i < cap; i++) {
    np_tag *g = t->at[i];
    np_tag_info *o = &out[i];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", g->name);
    blocks_of(&g->arena, &o->allocated, &o->blocks);
    o->mapped = mapped_of(&g->arena);
    if (g->paused) runs(&g->arena, NULL, &o->paused);
    for (size_t k = 0; k < g->n_backup; k++) o->backup += g->backup[k].size;
    o->backup_held = g->host_size;
    o->pauses = g->pauses;
    o->is_paused = g->paused;
    o->current = t->current == i;
  }
  return NP_OK;
}

int np_tags_empty_cache(np_ctx *ctx, np_tagset *t, np_arena *main) {
  int first = NP_OK;
  np_saved_error s = {0};
  for (int i = -1; i < t->n; i++) {
    np_arena *a = i < 0 ? main : &t->at[i]->arena;
    np_tags_budget(ctx, t, main, a);
    int rc = np_arena_empty_cache(ctx, a);
    if (rc != NP_OK && first == NP_OK) np_save_error(&s, first = rc);
  }
  return first == NP_OK ? NP_OK : np_restore_error(&s);
}

void np_tags_fill_stats(np_ctx *ctx, np_tagset *t, np_arena *main, np_stats *st) {
  for (int i = 0; i < t->n; i++) {
    np_tag *g = t->at[i];
    uint64_t need = 0;
    np_tags_budget(ctx, t, main, &g->arena);
    if (g->paused) runs(&g->arena, NULL, &need);
    else if (g->arena.seg) np_arena_fill_stats(ctx, &g->arena, st);
    st->paused += need;
  }
  st->backup = t->backup_bytes;
  st->backup_held = t->backup_held;
  np_tags_budget(ctx, t, main, main);
  np_arena_fill_stats(ctx, main, st); /* last: the arena high-water mark is the main arena's */
}

int np_tags_check(np_ctx *ctx, np_tagset *t, np_arena *main) {
  int rc = np_arena_check(ctx, main);
  uint64_t backup = 0, held = 0;
  for (int i = 0; i < t->n && rc == NP_OK; i++) {
    np_tag *g = t->at[i];
    uint64_t own = 0;
    for (size_t k = 0; k < g->n_backup; k++) own += g->backup[k].size;
    backup += own;
    held += g->host_size;
    if (!g->paused) rc = np_arena_check(ctx, &g->arena);
    else if (!np_tree_check(&g->arena.holes)) rc = np_error(NP_ERR_STATE, "check: tag '%s': hole tree is corrupt", g->name);
    else if (mapped_of(&g->arena)) rc = np_error(NP_ERR_STATE, "check: paused tag '%s' has memory mapped", g->name);
    else if (g->arena.seg && np_vmm_unmapped(ctx, g->arena.seg, g->arena.seg->addr, g->arena.seg->size) != g->arena.seg->size)
      rc = np_error(NP_ERR_STATE, "check: paused tag '%s' has chunks in its page table", g->name); /* the record */
    if (rc == NP_OK && !g->paused && g->n_backup)
      rc = np_error(NP_ERR_STATE, "check: tag '%s' is not paused but holds a backup", g->name);
    if (rc == NP_OK && own > g->host_size)
      rc = np_error(NP_ERR_STATE, "check: tag '%s': its backup is larger than its host buffer", g->name);
  }
  if (rc == NP_OK && held != t->backup_held)
    rc = np_error(NP_ERR_STATE, "check: host buffers hold %llu bytes but the books say %llu", (unsigned long long)held,
                  (unsigned long long)t->backup_held);
  if (rc == NP_OK && backup != t->backup_bytes)
    rc = np_error(NP_ERR_STATE, "check: backups hold %llu bytes but the books say %llu", (unsigned long long)backup,
                  (unsigned long long)t->backup_bytes);
  if (rc == NP_OK && (t->current < -1 || t->current >= t->n)) rc = np_error(NP_ERR_STATE, "check: bad current region");
  return rc;
}

void np_tags_drop(np_ctx *ctx, np_tagset *t) {
  for (int i = 0; i < t->n; i++) {
    free_backup(t, t->at[i]);
    drop_host(ctx, t, t->at[i]);
    np_arena_drop(ctx, &t->at[i]->arena);
    free(t->at[i]);
    t->at[i] = NULL;
  }
  t->n = 0;
  t->current = -1;
}

/* ---- public entry points ------------------------------------------------------------------------ */

static int no_tags(np_ctx *ctx) {
  return np_error(NP_ERR_STATE, "policy %s has no tagged regions: region, pause and resume need policy npu_pool",
                  ctx->policy->name);
}

int np_region(np_ctx *ctx, const char *tag) {
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "region");
  if (rc == NP_OK) rc = ctx->policy->region ? ctx->policy->region(ctx, tag) : no_tags(ctx);
  np_ctx_unlock(ctx);
  return rc;
}

int np_pause(np_ctx *ctx, const char *tag, int backup, uint64_t *bytes) {
  uint64_t b = 0;
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "pause");
  if (rc == NP_OK) rc = ctx->policy->pause ? ctx->policy->pause(ctx, tag, backup != 0, &b) : no_tags(ctx);
  np_ctx_unlock(ctx);
  if (bytes) *bytes = b;
  return rc;
}

int np_resume(np_ctx *ctx, const char *tag, uint64_t *bytes) {
  uint64_t b = 0;
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "resume");
  if (rc == NP_OK) rc = ctx->policy->resume ? ctx->policy->resume(ctx, tag, &b) : no_tags(ctx);
  np_ctx_unlock(ctx);
  if (bytes) *bytes = b;
  return rc;
}

int np_tags(np_ctx *ctx, np_tag_info *out, size_t cap, size_t *n) {
  *n = 0;
  if (cap && !out) return np_error(NP_ERR_INVALID, "np_tags: no buffer for %zu entries", cap);
  np_ctx_lock(ctx);
  int rc = ctx->policy->tags ? ctx->policy->tags(ctx, out, cap, n) : NP_OK;
  np_ctx_unlock(ctx);
  return rc;
}

int np_set_backup_limit(np_ctx *ctx, uint64_t bytes) {
  if (bytes > NP_MAX_REQUEST) return np_error(NP_ERR_INVALID, "a backup bound of %llu bytes is absurd", (unsigned long long)bytes);
  np_ctx_lock(ctx);
  int rc = np_ctx_usable(ctx, "set_backup_limit");
  if (rc == NP_OK) rc = ctx->policy->set_backup_limit ? ctx->policy->set_backup_limit(ctx, bytes) : no_tags(ctx);
  np_ctx_unlock(ctx);
  return rc;
}
