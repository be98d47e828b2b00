/* memory.c -- the device memory a context holds: segments, the one accounting path for
 * reserved bytes, memory whose return the device refused (held and retried), and the range
 * calls of the VMM layer (vmm.h), which account what its chunk calls did. Calls go one way:
 * here -> vmm.c -> the backend; vmm.c never calls back. */
#include <stdio.h>
#include <stdlib.h>

#include "vmm.h"

/* ---- reserved bytes: every change goes through here ------------------------------------- */

static void change_reserved(np_ctx *ctx, int pool, uint64_t bytes, bool add) {
  np_counter *c[2] = {&ctx->st.total.reserved, pool >= 0 && pool < NP_POOLS ? &ctx->st.pool[pool].reserved : NULL};
  for (int i = 0; i < 2; i++) {
    if (!c[i]) continue;
    if (add) np_counter_add(c[i], bytes);
    else np_counter_sub(c[i], bytes);
  }
}

/* Whether `size` more reserved bytes would pass the memory fraction cap (held memory counted: the
 * device still has it); never for a framework's allocator the device caps (ctx->device_caps), nor
 * while a compaction puts live bytes back (ctx->rescuing: memory the device refused to take back
 * would otherwise keep them out). */
static bool past_cap(const np_ctx *ctx, uint64_t size) {
  return !ctx->device_caps && !ctx->rescuing && (size > ctx->limit || ctx->st.total.reserved.current > ctx->limit - size);
}

/* Reserved bytes the device holds for the pool mapped nowhere (a spare chunk, held memory):
 * counted and recorded (hold / unhold events), so the history adds up to the reserved bytes. */
static void change_held(np_ctx *ctx, int pool, uint64_t bytes, bool add) {
  change_reserved(ctx, pool, bytes, add);
  np_ctx_record(ctx, add ? NP_EV_HOLD : NP_EV_UNHOLD, 0, bytes, 0, -1, pool, 0);
}

void np_ctx_reserved(np_ctx *ctx, int action, np_segment *seg, uintptr_t addr, uint64_t bytes) {
  bool add = action == NP_EV_SEGMENT_ALLOC || action == NP_EV_SEGMENT_MAP;
  change_reserved(ctx, seg->pool, bytes, add);
  if (action == NP_EV_SEGMENT_MAP) ctx->st.device_mallocs++; /* (a segment's malloc is counted where it is made) */
  else if (!add) ctx->st.device_frees++;
  if (add) {
    seg->mapped += bytes;
  } else {
    NP_ASSERT(seg->mapped >= bytes);
    seg->mapped -= bytes;
  }
  np_ctx_record(ctx, action, addr, bytes, seg->stream, -1, seg->pool, 0);
}

/* ---- held memory ------------------------------------------------------------------------- */

void np_ctx_hold(np_ctx *ctx, int kind, uintptr_t addr, uint64_t size, uint64_t handle, np_segment *from) {
  int pool = from ? from->pool : NP_POOL_SHARED;
  ctx->holds++;
  np_copy_text(ctx->hold_error, sizeof ctx->hold_error, np_last_error()); /* the vendor's reason */
  bool memory = kind != NP_HELD_RESERVATION; /* a reservation is address space, not device memory */
  if (memory && from) {
    NP_ASSERT(from->mapped >= size);
    from->mapped -= size; /* stays reserved: now counted as held (in the history: out of its segment, held) */
    np_ctx_record(ctx, kind == NP_HELD_SEGMENT ? NP_EV_SEGMENT_FREE : NP_EV_SEGMENT_UNMAP, addr, size, from->stream, -1,
                  pool, 0);
    np_ctx_record(ctx, NP_EV_HOLD, 0, size, 0, -1, pool, 0);
  } else if (memory) {
    change_held(ctx, pool, size, true);
  }
  if (memory) ctx->st.unreleased += size;
  if (ctx->n_held == ctx->cap_held) {
    size_t cap = ctx->cap_held ? 2 * ctx->cap_held : 16;
    np_held *h = realloc(ctx->held, cap * sizeof *h);
    if (!h) { /* the bytes stay counted as unreleased (the device has them); only their retry is lost */
      if (memory) ctx->unlisted += size;
      return;
    }
    ctx->held = h;
    ctx->cap_held = cap;
  }
  ctx->held[ctx->n_held++] = (np_held){kind, pool, addr, size, handle};
}

/* Give a device allocation back. Where the vendor's free does not wait for the device (aclrtFree),
 * the device is synchronised first, once per call: torch_npu too synchronises once and then frees
 * every cached segment (release_cached_blocks). */
static int free_device(np_ctx *ctx, uintptr_t addr, uint64_t size) {
  int rc = ctx->be->free_synchronizes ? NP_OK : np_ctx_drain(ctx);
  return rc != NP_OK ? rc : ctx->be->free(ctx->be, addr, size);
}

/* Held item i is gone (returned): out of the books. */
static void drop_held(np_ctx *ctx, size_t i) {
  np_held *h = &ctx->held[i];
  if (h->kind != NP_HELD_RESERVATION) {
    change_held(ctx, h->pool, h->size, false);
    ctx->st.unreleased -= h->size;
  }
  ctx->held[i] = ctx->held[--ctx->n_held];
}

/* Try to return one held item; NP_OK when it is gone. */
static int retry_one(np_ctx *ctx, np_held *h) {
  np_backend *be = ctx->be;
  int rc;
  switch (h->kind) {
    case NP_HELD_SEGMENT:
      rc = free_device(ctx, h->addr, h->size);
      if (rc == NP_OK) ctx->st.device_frees++; /* (its segment_free was recorded when it was held) */
      return rc;
    case NP_HELD_PAGE: {
      np_vmm_left left = {h->addr, h->size, h->handle};
      rc = np_vmm_chunk_return(be, &left);
      if (h->addr && !left.addr) ctx->st.device_frees++; /* unmapped now, even if the release failed */
      h->addr = left.addr;
      return rc;
    }
    default:
      return be->release(be, h->addr, h->size);
  }
}

static int still_held(np_ctx *ctx, int code, const char *why) {
  char a[32];
  return np_error(code, "the device still holds %s this pool could not return (retried at every empty_cache, "
                  "close and out-of-memory): %s", np_fmt_bytes(ctx->st.unreleased, a), why);
}

int np_ctx_retry_held(np_ctx *ctx) {
  int first = NP_OK;
  np_saved_error s; /* np_save_error writes it before np_restore_error reads it */
  /* pages before reservations: a reservation is released only once nothing is mapped in it */
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < ctx->n_held;) {
      np_held *h = &ctx->held[i];
      if ((h->kind == NP_HELD_RESERVATION) != (pass == 1)) {
        i++;
        continue;
      }
      int rc = retry_one(ctx, h);
      if (rc != NP_OK) {
        if (first == NP_OK) np_save_error(&s, first = rc);
        i++;
        continue;
      }
      drop_held(ctx, i);
    }
  }
  if (first == NP_OK) return NP_OK;
  return still_held(ctx, first, s.text);
}

/* Chunks the device still maps inside [lo, hi) after refusing to unmap them: the page table
 * says unmapped there (a whole unmap forgets them), so a map over them would be refused, and
 * by an error that names the map. Unmap them first; NP_OK when none is left mapped there. */
static int unmap_held_in(np_ctx *ctx, uintptr_t lo, uintptr_t hi) {
  for (size_t i = 0; i < ctx->n_held;) {
    np_held *h = &ctx->held[i];
    if (h->kind != NP_HELD_PAGE || !h->addr || h->addr >= hi || h->addr + h->size <= lo) {
      i++;
      continue;
    }
    uintptr_t at = h->addr;
    char sz[32];
    int rc = retry_one(ctx, h);
    if (rc == NP_OK) {
      drop_held(ctx, i);
    } else if (h->addr) {
      np_saved_error why; /* the vendor's reason, out of the buffer np_error writes */
      np_save_error(&why, rc);
      return np_error(rc, "cannot map memory at %#lx: the device still maps a chunk of %s there that it refused to "
                      "unmap before, and refuses again: %s", (unsigned long)at, np_fmt_bytes(h->size, sz), why.text);
    } else {
      i++; /* unmapped; only its release is still refused: held, out of the way */
    }
  }
  return NP_OK;
}

int np_ctx_new_holds(np_ctx *ctx, uint64_t holds_before) {
  return ctx->holds == holds_before ? NP_OK : still_held(ctx, NP_ERR_BACKEND, ctx->hold_error);
}

/* Hold what a chunk call left with the device. `from`: the segment whose mapped bytes counted it. */
static void hold_left(np_ctx *ctx, const np_vmm_left *left, np_segment *from) {
  if (left->handle) np_ctx_hold(ctx, NP_HELD_PAGE, left->addr, left->size, left->handle, from);
}

/* ---- spare chunks: unmapped by a trim, kept (counted as reserved), mapped again by a growth -- */

bool np_vmm_recycle_begin(np_ctx *ctx) {
  bool was = ctx->recycling;
  ctx->recycling = true;
  return was;
}

/* Give an unmapped handle, not counted as reserved, back to the device; one it refuses is held
 * (counted again, retried). */
static void release_spare(np_ctx *ctx, uint64_t handle, uint64_t size) {
  np_vmm_left left = {0, size, handle};
  if (np_vmm_chunk_return(ctx->be, &left) != NP_OK) hold_left(ctx, &left, NULL);
}

/* Spare i leaves the books (no longer reserved as a spare); the last spare takes its slot. */
static np_spare drop_spare(np_ctx *ctx, size_t i) {
  np_spare x = ctx->spare[i];
  change_held(ctx, x.pool, x.size, false);
  ctx->st.spare -= x.size;
  ctx->spare[i] = ctx->spare[--ctx->n_spare];
  return x;
}

/* The index of the largest spare of at most `most` bytes (the first of equals); n_spare: none. */
static size_t largest_spare(const np_ctx *ctx, uint64_t most) {
  size_t best = ctx->n_spare;
  for (size_t i = 0; i < ctx->n_spare; i++) {
    uint64_t sz = ctx->spare[i].size;
    if (sz <= most && (best == ctx->n_spare || sz > ctx->spare[best].size)) best = i;
  }
  return best;
}

/* Give spares back: every one (`all`), or the largest first until `size` more bytes fit under the
 * cap with the spares that stay (they count as reserved) and those hold NP_SPARE_KEEP at most:
 * before a creation, so that the kept ones may serve a later growth instead of a new chunk. A
 * device that has less than the cap refuses that chunk: map_by then gives every spare back and
 * asks once more. */
static void give_back(np_ctx *ctx, uint64_t size, bool all) {
  np_saved_error s;
  np_save_error(&s, NP_ERR_BACKEND); /* keep the caller's message */
  while (ctx->n_spare && (all || ctx->st.spare > NP_SPARE_KEEP || ctx->st.total.reserved.current + size > ctx->limit)) {
    np_spare x = drop_spare(ctx, all ? ctx->n_spare - 1 : largest_spare(ctx, UINT64_MAX));
    release_spare(ctx, x.handle, x.size);
  }
  np_restore_error(&s);
}

void np_vmm_spares_release(np_ctx *ctx) {
  if (ctx->n_spare) give_back(ctx, 0, true);
}

void np_vmm_recycle_end(np_ctx *ctx, bool was) {
  if (!was) ctx->recycling = false; /* the spares stay, counted as reserved */
}

/* Keep an unmapped handle of `size` bytes (just taken out of `pool`'s reserved bytes) as a
 * spare, counted as reserved again; without room for it, give it back now. */
static void keep_spare(np_ctx *ctx, uint64_t handle, uint64_t size, int pool) {
  if (ctx->n_spare == ctx->cap_spare && ctx->n_spare < NP_SPARE_MAX) {
    size_t cap = ctx->cap_spare ? 2 * ctx->cap_spare : 64;
    np_spare *t = realloc(ctx->spare, cap * sizeof *t);
    if (t) {
      ctx->spare = t;
      ctx->cap_spare = cap;
    }
  }
  if (ctx->n_spare == ctx->cap_spare) {
    release_spare(ctx, handle, size);
    return;
  }
  ctx->spare[ctx->n_spare++] = (np_spare){handle, size, pool};
  ctx->st.spare += size;
  change_held(ctx, pool, size, true);
}

/* The largest spare of at most `most` bytes, taken out of the spares: its handle, and its size in
 * *size (0: none fits). A handle maps only over exactly its size, so a spare smaller than the
 * chunk asked for maps over its start and one larger over more of the unmapped run. */
static uint64_t take_spare(np_ctx *ctx, uint64_t most, uint64_t *size) {
  size_t best = largest_spare(ctx, most);
  if (best == ctx->n_spare) return 0;
  np_spare x = drop_spare(ctx, best); /* its map counts it again, as mapped */
  *size = x.size;
  return x.handle;
}

/* ---- the VMM layer's range calls: chunks mapped and unmapped, accounted ------------------ */

/* Unmap the chunk at page p (accounted); see np_vmm_unmap for `whole`. Inside a recycle window
 * the unmapped handle is kept as a spare instead of released. */
static int unmap_chunk(np_ctx *ctx, np_segment *seg, uint64_t p, bool whole, uint64_t *unmapped) {
  uint64_t f, n, g = ctx->be->granularity, kept = 0;
  np_vmm_chunk_at(ctx->be, seg, p, &f, &n);
  np_vmm_left left;
  int rc = np_vmm_chunk_unmap(ctx->be, seg, f, whole, ctx->recycling ? &kept : NULL, &left);
  if (rc == NP_OK) {
    np_ctx_reserved(ctx, NP_EV_SEGMENT_UNMAP, seg, seg->addr + f * g, n * g);
    *unmapped += n * g;
    if (kept) keep_spare(ctx, kept, n * g, seg->pool);
    if (left.handle) { /* unmapped, but the handle was not released: held, counted reserved again */
      np_saved_error s;
      np_save_error(&s, NP_ERR_BACKEND);
      hold_left(ctx, &left, NULL);
      np_restore_error(&s);
    }
  } else if (left.handle) { /* whole: out of the page table, held while still mapped */
    hold_left(ctx, &left, seg);
    *unmapped += n * g;
  }
  return rc;
}

int np_vmm_unmap_ex(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole, uint64_t *unmapped) {
  uint64_t g = ctx->be->granularity, bytes = 0;
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr) / g;
  np_saved_error s; /* np_save_error writes it before np_restore_error reads it */
  int rc = NP_OK;
  for (uint64_t p = first; p < end && seg->mapped;) { /* nothing mapped left: the rest of the table is zero */
    if (!seg->pages[p]) {
      p++;
      continue;
    }
    uint64_t f, n;
    np_vmm_chunk_at(ctx->be, seg, p, &f, &n);
    if (f >= first && f + n <= end) { /* the whole chunk is in the range */
      int urc = unmap_chunk(ctx, seg, f, whole, &bytes);
      if (urc != NP_OK && rc == NP_OK) np_save_error(&s, rc = urc);
    }
    p = f + n;
  }
  if (unmapped) *unmapped = bytes;
  return rc == NP_OK ? NP_OK : np_restore_error(&s);
}

int np_vmm_unmap(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole) {
  return np_vmm_unmap_ex(ctx, seg, addr, size, whole, NULL);
}

/* Note a device that refused `bytes` of physical memory (rc NP_ERR_OOM) the cap allowed: the rest
 * of the device is held outside the pool (the out-of-memory message says so, context.c). */
static void refused(np_ctx *ctx, int rc, uint64_t bytes) {
  uint64_t reserved = ctx->st.total.reserved.current;
  if (rc == NP_ERR_OOM && bytes <= ctx->limit && reserved <= ctx->limit - bytes) ctx->fail.refused = true;
}

int np_vmm_map_by(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, uint64_t unit, bool whole) {
  uint64_t g = ctx->be->granularity, u = unit ? np_max_u64(unit / g, 1) : 0;
  uint64_t first = (addr - seg->addr) / g, end = (addr + size - seg->addr + g - 1) / g;
  uint64_t *fresh = NULL, n_fresh = 0, cap_fresh = 0; /* first pages of the chunks this call mapped (whole) */
  int rc = ctx->n_held ? unmap_held_in(ctx, seg->addr + first * g, seg->addr + end * g) : NP_OK;
  for (uint64_t p = first; p < end && rc == NP_OK;) {
    if (seg->pages[p]) {
      p++;
      continue;
    }
    uint64_t q = p + 1; /* the chunk: the unmapped run from p, cut at the next multiple of the unit */
    uint64_t stop = u ? np_min_u64(end, (p / u + 1) * u) : end;
    while (q < stop && !seg->pages[q]) q++;
    np_vmm_left left;
    uint64_t spare = 0, bytes = 0;
    if (ctx->n_spare) { /* the largest spare the whole unmapped run from p can hold maps there */
      uint64_t r = q;
      while (r < end && !seg->pages[r]) r++;
      if ((spare = take_spare(ctx, (r - p) * g, &bytes))) q = p + bytes / g;
      else give_back(ctx, (q - p) * g, false); /* the spares and the new chunk within the cap */
    }
    if (!spare && past_cap(ctx, (q - p) * g)) {
      /* a spare the device refused to take back is held, still reserved: a new chunk would pass the cap */
      char a[32], b[32], c[32];
      rc = np_error(NP_ERR_OOM, "mapping %s more would exceed the memory fraction cap of %s: the device refused to "
                    "take back %s this pool gave it (held, retried at every empty_cache, close and out-of-memory)",
                    np_fmt_bytes((q - p) * g, a), np_fmt_bytes(ctx->limit, b), np_fmt_bytes(ctx->st.unreleased, c));
      break;
    }
    rc = np_vmm_chunk_map(ctx->be, seg, p, q - p, spare, &left);
    if (rc == NP_ERR_OOM && !spare && !left.handle && ctx->n_spare) {
      np_vmm_spares_release(ctx); /* a device with less than the cap: it gets every spare back first */
      rc = np_vmm_chunk_map(ctx->be, seg, p, q - p, 0, &left);
    }
    if (rc != NP_OK) {
      np_saved_error s;
      np_save_error(&s, rc);
      hold_left(ctx, &left, NULL);
      refused(ctx, rc, (q - p) * g);
      np_restore_error(&s);
      break;
    }
    np_ctx_reserved(ctx, NP_EV_SEGMENT_MAP, seg, seg->addr + p * g, (q - p) * g);
    if (whole && n_fresh == cap_fresh) {
      uint64_t *f = realloc(fresh, (cap_fresh = cap_fresh ? 2 * cap_fresh : 8) * sizeof *f);
      if (!f) rc = np_error(NP_ERR_HOST, "host out of memory mapping a range");
      else fresh = f;
    }
    if (whole && rc == NP_OK) fresh[n_fresh++] = p;
    if (rc != NP_OK) { /* no room to remember it: undo it now */
      uint64_t ignored = 0;
      np_saved_error s;
      np_save_error(&s, rc);
      unmap_chunk(ctx, seg, p, true, &ignored);
      np_restore_error(&s);
    }
    p = q;
  }
  if (rc != NP_OK && whole) { /* as it was: unmap the chunks this call mapped */
    np_saved_error s;
    np_save_error(&s, rc);
    for (uint64_t i = 0, ignored = 0; i < n_fresh; i++) unmap_chunk(ctx, seg, fresh[i], true, &ignored);
    np_restore_error(&s);
  }
  free(fresh);
  return rc;
}

int np_vmm_map(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole) {
  return np_vmm_map_by(ctx, seg, addr, size, 0, whole);
}

/* ---- compaction: a chunk replaced by chunks over its kept pages, their bytes through the host -- */

/* The next run of kept pages of [first, first + n) at or after page *p: [*p, *q); false if none. */
static bool kept_run(const uint8_t *keep, uint64_t first, uint64_t n, uint64_t *p, uint64_t *q) {
  while (*p < first + n && !keep[*p - first]) ++*p;
  for (*q = *p; *q < first + n && keep[*q - first];) ++*q;
  return *p < first + n;
}

/* Copy the kept pages of [first, first + n) between the device and buf (to_device 0: out). */
static int move_kept(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, const uint8_t *keep, char *buf,
                     int to_device) {
  uint64_t g = ctx->be->granularity, off = 0;
  for (uint64_t p = first, q; kept_run(keep, first, n, &p, &q); off += (q - p) * g, p = q) {
    void *dev = (void *)(seg->addr + p * g), *host = buf + off;
    int rc = ctx->be->copy(ctx->be, to_device ? dev : host, to_device ? host : dev, (q - p) * g, to_device);
    if (rc != NP_OK) return rc;
  }
  return NP_OK;
}

/* Map every kept run of [first, first + n) still unmapped, each as a chunk; the first failure. */
static int map_kept(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, const uint8_t *keep) {
  uint64_t g = ctx->be->granularity;
  int rc = NP_OK;
  np_saved_error s;
  for (uint64_t p = first, q; kept_run(keep, first, n, &p, &q); p = q) {
    int r = np_vmm_map(ctx, seg, seg->addr + p * g, (q - p) * g, false);
    if (r != NP_OK && rc == NP_OK) np_save_error(&s, rc = r);
  }
  return rc == NP_OK ? NP_OK : np_restore_error(&s);
}

/* Map the unmapped pages of the chunk [first, first + n) again, as they were before a compaction
 * (the runs it mapped stay): three tries, spares and held memory given back before each, the cap
 * set aside (the device decides). */
static int put_back(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n) {
  uint64_t g = ctx->be->granularity;
  int rc = NP_ERR_BACKEND;
  ctx->rescuing = true;
  for (int i = 0; i < 3 && rc != NP_OK; i++) {
    np_vmm_spares_release(ctx);
    if (ctx->n_held) np_ctx_retry_held(ctx);
    rc = np_vmm_map(ctx, seg, seg->addr + first * g, n * g, false);
  }
  ctx->rescuing = false;
  return rc;
}

/* Copy the kept pages back from buf: three tries. */
static int copy_back(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, const uint8_t *keep, char *buf) {
  int rc = NP_ERR_BACKEND;
  for (int i = 0; i < 3 && rc != NP_OK; i++) rc = move_kept(ctx, seg, first, n, keep, buf, 1);
  return rc;
}

/* The kept pages' bytes could not be put back: the context is lost (vmm.h). */
static int lost(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, uint64_t kept) {
  char cause[512], x[32], y[32];
  uint64_t g = ctx->be->granularity;
  np_copy_text(cause, sizeof cause, np_last_error());
  ctx->lost = true;
  return np_error(NP_ERR_STATE, "compaction of the chunk at %#llx (%s) could not put its %s of live bytes back (%s): "
                  "the tensors there hold wrong bytes; the pool refuses every call but stats and close",
                  (unsigned long long)(seg->addr + first * g), np_fmt_bytes(n * g, x), np_fmt_bytes(kept * g, y), cause);
}

int np_vmm_compact(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, const uint8_t *keep, uint64_t *freed) {
  np_backend *be = ctx->be;
  uint64_t g = be->granularity, kept = 0, handle = 0;
  uintptr_t addr = seg->addr + first * g;
  *freed = 0;
  for (uint64_t i = 0; i < n; i++) kept += keep[i] != 0;
  if (!kept || kept == n) return NP_OK;
  bool copies = be->copy != NULL; /* (else the simulated device without host memory: nothing to copy) */
  char *buf = copies ? malloc(kept * g) : NULL, x[32];
  if (copies && !buf)
    return np_error(NP_ERR_HOST, "host out of memory for a compaction buffer of %s", np_fmt_bytes(kept * g, x));
  np_vmm_left left;
  int rc = copies ? move_kept(ctx, seg, first, n, keep, buf, 0) : NP_OK;
  if (rc == NP_OK) rc = np_vmm_chunk_unmap(be, seg, first, false, &handle, &left); /* refused: still mapped */
  if (rc != NP_OK) {
    free(buf);
    return rc;
  }
  np_ctx_reserved(ctx, NP_EV_SEGMENT_UNMAP, seg, addr, n * g);
  np_saved_error why; /* the error that leaves the chunk as it was, if any */
  why.code = NP_OK;
  left = (np_vmm_left){0, n * g, handle};
  rc = np_vmm_chunk_return(be, &left);
  if (rc != NP_OK) { /* the device keeps the handle: it maps again where it was, the chunk as it was */
    np_save_error(&why, rc);
    rc = np_vmm_chunk_map(be, seg, first, n, handle, &left);
    if (rc == NP_OK) np_ctx_reserved(ctx, NP_EV_SEGMENT_MAP, seg, addr, n * g);
    else hold_left(ctx, &left, NULL);
    if (rc != NP_OK) rc = put_back(ctx, seg, first, n);
  } else { /* the runs of kept pages, each a chunk: fewer pages than the device took back a moment ago,
            * so not refused for the cap (rescuing): held past a lowered cap, the pool could not
            * otherwise compact its way back under it */
    bool was = ctx->rescuing;
    ctx->rescuing = true;
    rc = map_kept(ctx, seg, first, n, keep);
    if (rc != NP_OK) { /* once more, every spare given back first */
      np_vmm_spares_release(ctx);
      rc = map_kept(ctx, seg, first, n, keep);
    }
    ctx->rescuing = was;
    if (rc != NP_OK) { /* as it was: the chunk's pages still unmapped mapped again */
      np_save_error(&why, rc);
      rc = put_back(ctx, seg, first, n);
    }
  }
  if (rc == NP_OK && copies) rc = copy_back(ctx, seg, first, n, keep, buf);
  free(buf);
  if (rc != NP_OK) return lost(ctx, seg, first, n, kept);
  if (why.code != NP_OK) return np_restore_error(&why); /* every byte back where it was */
  ctx->st.compactions++;
  ctx->st.compacted += kept * g;
  *freed = (n - kept) * g;
  np_ctx_record(ctx, NP_EV_COMPACT, addr, kept * g, NP_STREAM_ANY, -1, -1, 0); /* (after its unmap and maps) */
  return NP_OK;
}

void np_vmm_release(np_ctx *ctx, np_segment *seg) {
  if (seg->mapped) np_vmm_unmap(ctx, seg, seg->addr, seg->size, true); /* what refuses is held */
  if (ctx->be->release(ctx->be, seg->addr, seg->size) != NP_OK)
    np_ctx_hold(ctx, NP_HELD_RESERVATION, seg->addr, seg->size, 0, NULL);
  np_vmm_table_free(seg->pages, seg->size / ctx->be->granularity);
  seg->pages = NULL;
}

/* ---- segments ------------------------------------------------------------------------------ */

int np_segment_create(np_ctx *ctx, uint64_t size, intptr_t stream, int pool, bool reserve_only, np_segment **out) {
  uintptr_t addr = 0;
  uint64_t *pages = NULL;
  int rc;
  *out = NULL;
  if (reserve_only) {
    rc = np_vmm_reserve(ctx, size, &addr, &pages);
    if (rc != NP_OK) return rc;
  } else {
    np_vmm_spares_release(ctx); /* physical memory taken other than by a growth's map */
    /* past the cap: refused here, or by the device (a call) for a framework's allocator with no fraction set */
    if (past_cap(ctx, size)) {
      char a[32], b[32];
      return np_error(NP_ERR_OOM, "reserving %s more would exceed the memory fraction cap of %s",
                      np_fmt_bytes(size, a), np_fmt_bytes(ctx->limit, b));
    }
    rc = ctx->be->malloc(ctx->be, size, &addr);
    if (rc != NP_OK) {
      refused(ctx, rc, size);
      return rc;
    }
    ctx->st.device_mallocs++; /* (served: counted here, whatever the bookkeeping below makes of it) */
  }
  np_segment *seg = calloc(1, sizeof *seg);
  np_block *b = seg ? np_block_new(&ctx->blocks) : NULL;
  if (!b) {
    free(seg);
    if (reserve_only) np_vmm_table_free(pages, size / ctx->be->granularity); /* (no page table otherwise) */
    /* never used by the device: no synchronisation needed */
    int frc = reserve_only ? ctx->be->release(ctx->be, addr, size) : ctx->be->free(ctx->be, addr, size);
    if (frc == NP_OK && !reserve_only) ctx->st.device_frees++;
    if (frc != NP_OK) { /* the device keeps it: hold it, counted */
      if (reserve_only) np_ctx_hold(ctx, NP_HELD_RESERVATION, addr, size, 0, NULL);
      else np_ctx_hold(ctx, NP_HELD_SEGMENT, addr, size, 0, NULL);
    }
    return np_error(NP_ERR_HOST, "host out of memory for segment bookkeeping");
  }
  *seg = (np_segment){.addr = addr, .size = size, .stream = stream, .pool = (uint8_t)pool,
                      .reserved_only = reserve_only, .head = b, .pages = pages};
  b->addr = addr;
  b->size = size;
  b->stream = stream;
  b->pool = (uint8_t)(pool < NP_POOLS ? pool : 0);
  b->seg = seg;
  b->mapped = !reserve_only;
  seg->next = ctx->segments;
  if (ctx->segments) ctx->segments->prev = seg;
  ctx->segments = seg;
  np_counter_add(&ctx->st.total.segments, 1);
  if (pool < NP_POOLS) np_counter_add(&ctx->st.pool[pool].segments, 1);
  if (!reserve_only) np_ctx_reserved(ctx, NP_EV_SEGMENT_ALLOC, seg, addr, size);
  *out = seg;
  return NP_OK;
}

void np_segment_drop(np_ctx *ctx, np_segment *seg) {
  for (np_block *b = seg->head; b; b = b->next) {
    if (b->allocated) np_ptrmap_remove(&ctx->live, b->addr);
    b->allocated = 0;
    b->in_tree = 0;
  }
  np_segment_destroy(ctx, seg);
}

void np_segment_destroy(np_ctx *ctx, np_segment *seg) {
  for (np_block *b = seg->head, *n; b; b = n) {
    NP_ASSERT(!b->allocated && !b->in_tree);
    n = b->next;
    np_block_delete(&ctx->blocks, b);
  }
  if (seg->prev) seg->prev->next = seg->next;
  else ctx->segments = seg->next;
  if (seg->next) seg->next->prev = seg->prev;
  if (seg->reserved_only) np_vmm_release(ctx, seg);
  else if (free_device(ctx, seg->addr, seg->size) == NP_OK)
    np_ctx_reserved(ctx, NP_EV_SEGMENT_FREE, seg, seg->addr, seg->size);
  else
    np_ctx_hold(ctx, NP_HELD_SEGMENT, seg->addr, seg->size, 0, seg);
  np_counter_sub(&ctx->st.total.segments, 1);
  if (seg->pool < NP_POOLS) np_counter_sub(&ctx->st.pool[seg->pool].segments, 1);
  free(seg);
}
