/* vmm.h -- the one virtual-memory layer: which pages of a reservation are mapped, and to which
 * physical handle, over any backend's page calls (backend.h).
 *
 * Every page is mapped and unmapped on its own (one physical handle per page of the backend's
 * granularity), so any page-aligned sub-range can be returned, and a vendor failure touches one
 * page: the page table (np_segment.pages) always says exactly which pages are mapped, and a
 * policy asks it instead of keeping its own copy. A page whose unmap failed is still mapped
 * (and retried by the next release); a handle whose release failed is held by the context
 * (np_ctx_hold) and retried. Mapped bytes go through np_ctx_reserved: reserved bytes, device
 * call counters and the history follow every page.
 */
#ifndef NP_VMM_H
#define NP_VMM_H

#include "context.h"

/* Reserve address space of `size` bytes (a multiple of the granularity) and its page table. */
int np_vmm_reserve(np_ctx *ctx, uint64_t size, uintptr_t *addr, uint64_t **pages);
/* Unmap what is still mapped in seg and release its address range (failures are held). */
void np_vmm_release(np_ctx *ctx, np_segment *seg);
/* Map every unmapped page under [addr, addr+size) of reservation seg. On failure the pages
 * mapped so far stay mapped (and accounted); with `whole`, they are unmapped again, so that the
 * range is as it was (a page that refuses is held: np_ctx_hold). The error names the vendor call. */
int np_vmm_map(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole);
/* Unmap every mapped page in [addr, addr+size) (page-aligned). Tries every page; returns the
 * first failure. A page that refuses stays mapped and in the page table; with `whole` it is held
 * instead (counted, retried at empty_cache and close), so that the whole range is unmapped in
 * the page table's view -- for policies that keep runs of pages mapped or unmapped together. */
int np_vmm_unmap(np_ctx *ctx, np_segment *seg, uintptr_t addr, uint64_t size, bool whole);
/* Bytes of the pages under [addr, addr+size) that are not mapped. */
uint64_t np_vmm_unmapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr, uint64_t size);
/* Whether the page holding addr is mapped. */
bool np_vmm_page_mapped(const np_ctx *ctx, const np_segment *seg, uintptr_t addr);

#endif
