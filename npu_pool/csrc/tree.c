/* tree.c -- treap of free blocks (see tree.h for the invariants). */
#include "tree.h"

static int key_cmp(const np_tree *t, const np_block *a, const np_block *b) {
  if (t->by_addr) return a->addr < b->addr ? -1 : a->addr > b->addr;
  if (a->stream != b->stream) return a->stream < b->stream ? -1 : 1;
  if (a->size != b->size) return a->size < b->size ? -1 : 1;
  if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
  return 0;
}

/* -- address-ordered trees: each node's sub is the largest size in its subtree ------------- */

static uint64_t sub_of(const np_block *n) { return n ? n->sub : 0; }

/* What n's sub should be: the largest of its size and its children's subs. */
static uint64_t sub_want(const np_block *n) {
  uint64_t l = sub_of(n->left), r = sub_of(n->right), m = l > r ? l : r;
  return n->size > m ? n->size : m;
}

static void pull(np_block *n) { n->sub = sub_want(n); }

/* Recompute sub along the search path of `addr` below n, bottom up, down to the node of that
 * address (pulled, its children left as they are) or to the path's end. After a remove, the
 * nodes whose subtrees changed are all on it: the ancestors of the place and the spine the zip
 * made (the search path of the same address); after an insert, the two spines its split made
 * are the search paths of the address in the new node's subtrees. Expected O(log n) deep. */
static void fix_path(np_block *n, uintptr_t addr) {
  if (!n) return;
  if (addr != n->addr) fix_path(addr < n->addr ? n->left : n->right, addr);
  pull(n);
}

/* Insert and remove walk down from the root without recursion (they run on every malloc and
 * free): insert descends while the nodes' priorities are at least b's, then splits the subtree
 * found there around b's key into b's children; remove unlinks b and zips its two subtrees
 * together by priority. Both keep BST order on keys and heap order on prio. */
void np_tree_insert(np_tree *t, np_block *b) {
  NP_ASSERT(!b->in_tree);
  b->prio = np_next_prio(&t->rng);
  np_block **link = &t->root;
  while (*link && (*link)->prio >= b->prio) {
    if (t->by_addr && (*link)->sub < b->size) (*link)->sub = b->size; /* an ancestor: b joins its subtree */
    link = key_cmp(t, b, *link) < 0 ? &(*link)->left : &(*link)->right;
  }
  np_block *n = *link, **l = &b->left, **r = &b->right;
  while (n) { /* split: keys below b down b's left spine, the rest down its right */
    if (key_cmp(t, n, b) < 0) {
      *l = n;
      l = &n->right;
      n = n->right;
    } else {
      *r = n;
      r = &n->left;
      n = n->left;
    }
  }
  *l = *r = NULL;
  *link = b;
  b->in_tree = 1;
  t->count++;
  t->bytes += b->size;
  if (t->by_addr) { /* the spines the split made, then b */
    fix_path(b->left, b->addr);
    fix_path(b->right, b->addr);
    pull(b);
  }
}

void np_tree_resized(np_tree *t, np_block *b, uint64_t old_size) {
  NP_ASSERT(t->by_addr && b->in_tree);
  t->bytes = t->bytes - old_size + b->size;
  fix_path(t->root, b->addr); /* b and its ancestors */
}

void np_tree_remove(np_tree *t, np_block *b) {
  NP_ASSERT(b->in_tree);
  np_block **link = &t->root;
  while (*link && *link != b) link = key_cmp(t, b, *link) < 0 ? &(*link)->left : &(*link)->right;
  NP_ASSERT(*link);
  if (!*link) return; /* not in this tree: nothing to remove (np_tree_check reports the flag) */
  np_block *l = b->left, *r = b->right;
  while (l && r) { /* zip: the higher priority of the two subtrees' roots goes up */
    if (l->prio > r->prio) {
      *link = l;
      link = &l->right;
      l = l->right;
    } else {
      *link = r;
      link = &r->left;
      r = r->left;
    }
  }
  *link = l ? l : r;
  b->in_tree = 0;
  b->left = b->right = NULL;
  t->count--;
  t->bytes -= b->size;
  if (t->by_addr) fix_path(t->root, b->addr);
}

np_block *np_tree_lower_bound(const np_tree *t, intptr_t stream, uint64_t size) {
  np_block *best = NULL;
  for (np_block *n = t->root; n;) {
    bool ge = n->stream != stream ? n->stream > stream : n->size >= size;
    if (ge) {
      best = n;
      n = n->left;
    } else {
      n = n->right;
    }
  }
  return best;
}

np_block *np_tree_best_fit(const np_tree *t, intptr_t stream, uint64_t size) {
  np_block *b = np_tree_lower_bound(t, stream, size);
  return b && b->stream == stream ? b : NULL;
}

np_block *np_tree_floor(const np_tree *t, uintptr_t addr) {
  NP_ASSERT(t->by_addr);
  np_block *best = NULL;
  for (np_block *n = t->root; n;) {
    if (n->addr <= addr) {
      best = n;
      n = n->right;
    } else {
      n = n->left;
    }
  }
  return best;
}

np_block *np_tree_after(const np_tree *t, uintptr_t addr) {
  NP_ASSERT(t->by_addr);
  np_block *best = NULL;
  for (np_block *n = t->root; n;) {
    if (n->addr > addr) {
      best = n;
      n = n->left;
    } else {
      n = n->right;
    }
  }
  return best;
}

np_block *np_tree_lowest_fit(const np_tree *t, uint64_t size) {
  NP_ASSERT(t->by_addr);
  for (np_block *n = t->root; n && n->sub >= size;) {
    if (sub_of(n->left) >= size) n = n->left;
    else if (n->size >= size) return n;
    else n = n->right; /* (its sub is at least size: n's is, and neither n nor its left holds it) */
  }
  return NULL;
}

np_block *np_tree_next(const np_tree *t, const np_block *b) {
  np_block *best = NULL;
  for (np_block *n = t->root; n;) {
    if (key_cmp(t, n, b) > 0) {
      best = n;
      n = n->left;
    } else {
      n = n->right;
    }
  }
  return best;
}

/* The last block of stream s or a lower one in key order: the largest of stream s, when it has one. */
static const np_block *last_upto(const np_tree *t, intptr_t s) {
  const np_block *best = NULL;
  for (const np_block *n = t->root; n;) {
    if (n->stream <= s) best = n, n = n->right;
    else n = n->left;
  }
  return best;
}

/* Keys order by stream first: the largest of each stream's blocks, its last, one descent per
 * stream (O(streams log n)); an address-ordered tree's root knows it. */
uint64_t np_tree_max_size(const np_tree *t) {
  if (t->by_addr) return sub_of(t->root);
  uint64_t best = 0;
  for (const np_block *b = np_tree_lower_bound(t, INTPTR_MIN, 0); b;) {
    uint64_t size = last_upto(t, b->stream)->size;
    if (size > best) best = size;
    if (b->stream == INTPTR_MAX) break;
    b = np_tree_lower_bound(t, b->stream + 1, 0); /* the next stream's first */
  }
  return best;
}

static bool check(const np_tree *t, const np_block *n, const np_block *lo, const np_block *hi, size_t *count,
                  uint64_t *bytes) {
  if (!n) return true;
  if (!n->in_tree || n->allocated) return false;
  if ((lo && key_cmp(t, lo, n) >= 0) || (hi && key_cmp(t, n, hi) >= 0)) return false;
  if ((n->left && n->left->prio > n->prio) || (n->right && n->right->prio > n->prio)) return false;
  if (t->by_addr && n->sub != sub_want(n)) return false;
  (*count)++;
  *bytes += n->size;
  return check(t, n->left, lo, n, count, bytes) && check(t, n->right, n, hi, count, bytes);
}

bool np_tree_check(const np_tree *t) {
  size_t count = 0;
  uint64_t bytes = 0;
  return check(t, t->root, NULL, NULL, &count, &bytes) && count == t->count && bytes == t->bytes;
}
