/* lifetime.h -- online lifetime learning per allocation site.
 *
 * Each site keeps two small counts: how many of its blocks outlived the phase
 * they were born in (long) and how many died inside it (short). When either
 * count saturates both are halved, so the table follows a changing pattern.
 * Open addressing over a power-of-two table; site -1 is never stored. The table
 * holds NP_LIFE_MAX_SITES sites at most: a run whose requests never repeat (sizes
 * that change every step, a phase with no end) teaches nothing, and the table
 * starts over when full rather than grow with the run.
 */
#ifndef NP_LIFETIME_H
#define NP_LIFETIME_H

#include "common.h"

#define NP_LIFE_MAX_SITES (1u << 18) /* 4 MiB of table: many times the sites of one training step */

typedef struct np_site_entry {
  int32_t site;      /* -1 = empty slot */
  uint8_t n_long;
  uint8_t n_short;
} np_site_entry;

typedef struct np_lifetime {
  np_site_entry *tab;
  size_t mask;
  size_t count;     /* sites held (<= NP_LIFE_MAX_SITES) */
} np_lifetime;

bool np_lifetime_init(np_lifetime *lt);
void np_lifetime_destroy(np_lifetime *lt);
/* NP_LIFE_LONG or NP_LIFE_SHORT from the site's history; NP_LIFE_AUTO if unknown. */
int np_lifetime_predict(const np_lifetime *lt, int32_t site);
void np_lifetime_learn(np_lifetime *lt, int32_t site, bool lived_long);

#endif
