/* lifetime.h -- online lifetime learning per allocation site; where the last block of a place
 * key lay.
 *
 * Each site keeps two small counts: how many of its blocks outlived the phase
 * they were born in (long) and how many died inside it (short). When either
 * count saturates both are halved, so the table follows a changing pattern.
 * A table of places (a context keeps one apart from its sites' table) keeps, per key, where the
 * last block of that key was placed (np_place), for the key's next request (arena.c,
 * placed_again). Open addressing over a power-of-two table; key -1 is never stored. A table
 * holds NP_LIFE_MAX_SITES keys at most: a run whose requests never repeat (sizes
 * that change every step, a phase with no end) teaches nothing, and the table
 * starts over when full rather than grow with the run.
 */
#ifndef NP_LIFETIME_H
#define NP_LIFETIME_H

#include "block.h"

#define NP_LIFE_MAX_SITES (1u << 18) /* 12 MiB of table at most: many times the sites of one training step */

typedef struct np_site_entry {
  int32_t site;      /* the key; -1 = empty slot */
  uint8_t n_long;    /* (a table of sites) */
  uint8_t n_short;
  uint8_t side;      /* (a table of places) where its last block was placed (np_place) */
  uintptr_t at, anchor;
} np_site_entry;

typedef struct np_lifetime {
  np_site_entry *tab;
  size_t mask;
  size_t count;     /* keys held (<= NP_LIFE_MAX_SITES) */
} np_lifetime;

bool np_lifetime_init(np_lifetime *lt);
void np_lifetime_destroy(np_lifetime *lt);
/* NP_LIFE_LONG or NP_LIFE_SHORT from the site's history; NP_LIFE_AUTO if unknown. */
int np_lifetime_predict(const np_lifetime *lt, int32_t site);
void np_lifetime_learn(np_lifetime *lt, int32_t site, bool lived_long);
/* The entry of place key `key` (made if new, side NP_PLACE_NONE; NULL when the host has no memory
 * for it): its side, at and anchor say where the key's last block was placed, and the caller sets
 * them to its new block's place (the entry stays valid until the table's next new key). */
np_site_entry *np_lifetime_place(np_lifetime *lt, int32_t key);

#endif
