/* lifetime.c -- per-site lifetime counts and per-key places (see lifetime.h). */
#include <stdlib.h>

#include "lifetime.h"

static size_t slot(int32_t site, size_t mask) { return ((uint32_t)site * 2654435761u) & mask; }

static void empty_slots(np_site_entry *t, size_t n) {
  for (size_t i = 0; i < n; i++) t[i] = (np_site_entry){.site = -1};
}

static np_site_entry *alloc_table(size_t n) {
  np_site_entry *t = malloc(n * sizeof *t);
  if (t) empty_slots(t, n);
  return t;
}

bool np_lifetime_init(np_lifetime *lt) {
  lt->mask = 255;
  lt->count = 0;
  lt->tab = alloc_table(lt->mask + 1);
  return lt->tab != NULL;
}

void np_lifetime_destroy(np_lifetime *lt) {
  free(lt->tab);
  lt->tab = NULL;
}

static np_site_entry *lookup(const np_lifetime *lt, int32_t site) {
  for (size_t i = slot(site, lt->mask);; i = (i + 1) & lt->mask) {
    np_site_entry *e = &lt->tab[i];
    if (e->site == site || e->site == -1) return e;
  }
}

static bool grow(np_lifetime *lt) {
  size_t nmask = lt->mask * 2 + 1;
  np_site_entry *nt = alloc_table(nmask + 1);
  if (!nt) return false;
  np_lifetime bigger = {nt, nmask, lt->count};
  for (size_t i = 0; i <= lt->mask; i++)
    if (lt->tab[i].site != -1) *lookup(&bigger, lt->tab[i].site) = lt->tab[i];
  free(lt->tab);
  *lt = bigger;
  return true;
}

/* The entry of `key`, made if new; NULL when the host has no memory for a larger table (what is
 * learned is best effort). */
static np_site_entry *entry(np_lifetime *lt, int32_t key) {
  np_site_entry *e = lookup(lt, key);
  if (e->site != -1) return e;
  if (lt->count == NP_LIFE_MAX_SITES) { /* full: start over (the table keeps its memory) */
    empty_slots(lt->tab, lt->mask + 1);
    lt->count = 0;
    e = lookup(lt, key);
  } else if ((lt->count + 1) * 4 > (lt->mask + 1) * 3) {
    if (!grow(lt)) return NULL;
    e = lookup(lt, key);
  }
  e->site = key;
  lt->count++;
  return e;
}

int np_lifetime_predict(const np_lifetime *lt, int32_t site) {
  if (site < 0) return NP_LIFE_AUTO;
  const np_site_entry *e = lookup(lt, site);
  if (e->site == -1 || e->n_long == e->n_short) return NP_LIFE_AUTO;
  return e->n_long > e->n_short ? NP_LIFE_LONG : NP_LIFE_SHORT;
}

void np_lifetime_learn(np_lifetime *lt, int32_t site, bool lived_long) {
  np_site_entry *e = site < 0 ? NULL : entry(lt, site);
  if (!e) return;
  uint8_t *c = lived_long ? &e->n_long : &e->n_short;
  if (*c == UINT8_MAX) {
    e->n_long /= 2;
    e->n_short /= 2;
  }
  (*c)++;
}

np_site_entry *np_lifetime_place(np_lifetime *lt, int32_t key) { return key < 0 ? NULL : entry(lt, key); }
