/* fork.c -- the core's locks across fork().
 *
 * A child starts with one thread: a lock another thread of the parent held at fork() would
 * stay locked forever (the child hangs in its first np_get_stats). So fork() takes every lock
 * of the core first, in one order -- the device table's (pluggable.c), this list's, then
 * every live context's, oldest first -- which also waits for the calls in flight to finish
 * and leaves every structure consistent; then the parent and the child (its one thread is the
 * one that took them) each release them. In the child, a context of a vendor backend is marked
 * inherited: its device memory belongs to the parent (the child may read it, and close it
 * without device calls); a simulated device is plain host memory, copied by fork, and stays the
 * child's to use.
 *
 * Lock order everywhere: device table -> this list -> one context. Nothing takes the list or
 * the table lock while holding a context's.
 */
#include <pthread.h>

#include "context.h"
#include "pluggable.h"

/* Invariant: `head` lists every context between np_create and np_destroy (newest first,
 * linked by fork_prev/fork_next), guarded by `lock`. */
static struct {
  pthread_mutex_t lock;
  pthread_once_t once;
  np_ctx *head;
} live = {.lock = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

static np_ctx *oldest(void) {
  np_ctx *c = live.head;
  while (c && c->fork_next) c = c->fork_next;
  return c;
}

static void prepare(void) {
  np_pluggable_fork_lock();
  pthread_mutex_lock(&live.lock);
  for (np_ctx *c = oldest(); c; c = c->fork_prev) pthread_mutex_lock(&c->lock);
}

static void parent(void) {
  for (np_ctx *c = live.head; c; c = c->fork_next) pthread_mutex_unlock(&c->lock);
  pthread_mutex_unlock(&live.lock);
  np_pluggable_fork_unlock();
}

/* The child's one thread is the one that took every lock in prepare(): it releases them, as
 * the parent does (making a locked mutex anew, as this did before, is undefined in POSIX). */
static void child(void) {
  for (np_ctx *c = live.head; c; c = c->fork_next)
    if (c->cfg.backend != NP_BACKEND_SIM) c->inherited = true;
  parent();
}

static void install_handlers(void) { pthread_atfork(prepare, parent, child); }

void np_fork_init(void) { pthread_once(&live.once, install_handlers); }

void np_fork_register(np_ctx *ctx) {
  np_fork_init();
  pthread_mutex_lock(&live.lock);
  ctx->fork_prev = NULL;
  ctx->fork_next = live.head;
  if (live.head) live.head->fork_prev = ctx;
  live.head = ctx;
  pthread_mutex_unlock(&live.lock);
}

void np_fork_unregister(np_ctx *ctx) {
  pthread_mutex_lock(&live.lock);
  if (ctx->fork_prev) ctx->fork_prev->fork_next = ctx->fork_next;
  else if (live.head == ctx) live.head = ctx->fork_next;
  if (ctx->fork_next) ctx->fork_next->fork_prev = ctx->fork_prev;
  ctx->fork_prev = ctx->fork_next = NULL;
  pthread_mutex_unlock(&live.lock);
}
