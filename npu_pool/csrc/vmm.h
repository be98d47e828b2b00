/* vmm.h -- the one virtual-memory layer: which chunks of a reservation are mapped, over any
 * backend's chunk calls (backend.h).
 *
 * A chunk is one physical allocation mapped once, at a place and of a size (a multiple of the
 * backend's granularity) its caller chooses: a growth of an arena is one chunk, whatever its
 * size, so the device calls follow the growths, not the bytes. A chunk is unmapped whole (the
 * vendors unmap whole mappings only), so memory returns to the device in whole chunks.
 *
 * The page table (np_segment.pages, one entry per granularity page) is the only record of
 * what is mapped: pages[i] is the handle of the chunk mapped over page i (0: unmapped); a
 * chunk's pages hold its handle and its neighbours' differ, so a chunk's extent is the run of
 * its handle. A policy asks the page table instead of keeping its own copy.
 *
 * Two levels, calls going one way (accounting -> vmm -> backend):
 *  - the chunk calls below (np_vmm_chunk_*) make the vendor calls and keep the page table;
 *    they account nothing: they say what they did and what the device refused to take back;
 *  - the range calls (np_vmm_map, np_vmm_unmap, np_vmm_release, defined in memory.c) loop over
 *    chunks and account every change (reserved bytes, history) and every refusal (held memory,
 *    retried at empty_cache, close and out-of-memory).
 */
#ifndef NP_VMM_H
#define NP_VMM_H

#include "context.h"

/* What the device refused to take back during a chunk call: a handle (size bytes) still
 * mapped at addr (addr != 0), or unmapped but not released (addr == 0). handle == 0: none. */
typedef struct np_vmm_left {
  uintptr_t addr;
  uint64_t size;
  uint64_t handle;
} np_vmm_left;

/* Reserve address space of `size` bytes (a multiple of the granularity) and its page table. */
int np_vmm_reserve(np_ctx *ctx, uint64_t size, uintptr_t *addr, uint64_t **pages);
/* Free a page table of n entries (NULL: nothing). */
void np_vmm_table_free(uint64_t *table, uint64_t n);
/* Map pages [first, first + n) of seg, all unmapped, as one chunk: one physical allocation (or
 * `spare`, an unmapped handle of exactly n pages kept from an earlier unmap; 0: none), one map
 * (and access where the vendor needs it). On failure the page table is unchanged, the handle
 * (spare or new) is released, and *left says what the device kept. */
int np_vmm_chunk_map(np_backend *be, np_segment *seg, uint64_t first, uint64_t n, uint64_t spare, np_vmm_left *left);
/* The chunk over mapped page p of seg: its first page and its page count. */
void np_vmm_chunk_at(const np_backend *be, const np_segment *seg, uint64_t p, uint64_t *first, uint64_t *n);
/* Unmap the chunk starting at page `first` and release its handle (with `keep`: hand the
 * unmapped handle to the caller in *keep instead). If the unmap fails the chunk stays mapped (in
 * the page table) unless `forget`, which drops it from the page table and reports it in *left
 * (still mapped); a failed release reports the handle in *left. */
int np_vmm_chunk_unmap(np_backend *be, np_segment *seg, uint64_t first, bool forget, uint64_t *keep, np_vmm_left *left);
/* Retry returning what *left describes; NP_OK when it is gone (left->addr is cleared once unmapped). */
int np_vmm_chunk_return(np_backend *be, np_vmm_left *left);

/* ---- range calls, accounted (memory.c) ---------------------------------------------------- */

/* Map every unmapped run of pages under [addr, addr+size) of reservation seg, each run as one
 * chunk. On failure the chunks mapped so far stay mapped (and accounted); with `whole`, they are
 * unmapped again, so that the range is as it was (a chunk that refuses is held: np_ctx_hold).
 * The error names the vendor call. */
int np_vmm_map(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole);
/* np_vmm_map with runs cut into chunks of `unit` bytes at multiples of `unit` from the segment's
 * start (unit 0: one chunk per run), as PyTorch's expandable segments map one handle per page. */
int np_vmm_map_by(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, uint64_t unit, bool whole);
/* Unmap every mapped chunk that lies entirely in [addr, addr+size) (chunks reaching outside stay
 * mapped: no vendor unmaps part of a mapping). Tries every chunk; returns the first failure. A
 * chunk that refuses stays mapped and in the page table; with `whole` it is held instead
 * (counted, retried at empty_cache, close and out-of-memory), so that it is unmapped in the
 * page table's view.
 * *unmapped (optional) gets the bytes taken out of the page table. */
int np_vmm_unmap_ex(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole, uint64_t *unmapped);
int np_vmm_unmap(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole);
/* A recycle window, for a trim and the growth it makes room for: chunks unmapped inside it keep
 * their handles (spares), and a chunk to map, inside a window or in a later call, starts with the
 * largest spare its unmapped run can hold (a handle maps only over exactly its size, the rest of
 * the run is mapped next) instead of a new handle: an unmap and a map where there were
 * a release, an unmap, a creation and a map. Spares outlive the window: the device holds them
 * for the pool, counted as reserved (ctx->st.spare of it), until a growth maps them. Before a
 * chunk no spare fits is created, spares go back, largest first, until it fits under the cap
 * with those that stay and they hold NP_SPARE_KEEP at most (a device that refuses it even so
 * gets every spare back, and is asked once more); any other physical allocation gives every
 * spare back first (np_vmm_spares_release; a refusal is held). Windows nest: begin returns
 * whether one was open, to pass to _end. */
bool np_vmm_recycle_begin(np_ctx *ctx);
void np_vmm_recycle_end(np_ctx *ctx, bool was);
/* Give every spare back to the device (empty_cache, a retry after an out-of-memory, a new cap,
 * close, and before physical memory is taken other than by a growth's map). */
void np_vmm_spares_release(np_ctx *ctx);
/* The most spare bytes a creation leaves the pool holding: one growth granule (arena.h's
 * NP_ARENA_GROWTH), the least a growth far from the cap maps. Keeping every spare the cap allows
 * would hold reserved memory nothing maps, up to the cap. */
#define NP_SPARE_KEEP (20 * NP_MIB)
/* The most spares a context keeps (take_spare looks at each); past it, a trim releases. */
#define NP_SPARE_MAX 4096
/* Compaction (np_set_compaction, np_compact): replace the chunk that starts at page `first` of seg (n pages)
 * by chunks over the runs of its pages that `keep` marks (keep[i]: page first + i), the bytes of
 * those pages copied to host memory and back at the same addresses, so that the pages not kept
 * go back to the device (*freed: their bytes). The device must be idle (the caller synchronised
 * it and no other thread queues work). A failure before the unmap changes nothing; the chunk's
 * handle, unmapped, is released (one the device refuses to take back maps again where it was:
 * the chunk as it was, the error returned). The runs need fewer pages than the device took back
 * a moment before: a run it refuses is asked once more, every spare given back first, and if it
 * refuses again the chunk's unmapped pages are mapped as they were (three tries, spares and held
 * memory given back before each, the cap set aside: ctx->rescuing), the bytes copied back (three
 * tries) and the error returned. Only if that fails too are live bytes lost: the context is
 * marked lost (refusing every call but stats and close) and NP_ERR_STATE says so. The simulated
 * device without host memory copies nothing (stats count the bytes all the same). */
int np_vmm_compact(np_ctx *ctx, np_segment *seg, uint64_t first, uint64_t n, const uint8_t *keep, uint64_t *freed);
/* Unmap what is still mapped in seg and release its address range (failures are held). */
void np_vmm_release(np_ctx *ctx, np_segment *seg);

/* ---- queries -------------------------------------------------------------------------------- */

/* Bytes of the mapped chunks lying wholly in [addr, addr+size): what np_vmm_unmap of it unmaps. */
uint64_t np_vmm_whole_chunks(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size);
/* Bytes of the pages under [addr, addr+size) that are not mapped. */
uint64_t np_vmm_unmapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size);

#endif
