/* teardown.c -- closing while other threads call in, and fork() while they do, under a debug
 * build and the sanitizers: np_close and npu_pool_shutdown race with threads that malloc, free
 * and read statistics; every call after the close must fail with NP_ERR_STATE and none may touch
 * freed memory (ASan aborts if one does). Every entry point on a closed context: refused as
 * closed, or (statistics) answered, never a crash. Then a fork while threads hammer the pool, and
 * one while threads hold the device table's lock before any context exists: the child reads the
 * statistics and closes the pool (or makes its first context) within a deadline. Exit 0 only if
 * all of that held. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "npu_pool.h"
#include "pluggable.h"

#define THREADS 6
#define ROUNDS 12

static atomic_int bad;      /* calls that failed with anything but the closed-pool refusal */
static atomic_int refused;  /* calls refused because the pool was closed */
static atomic_int stop;

static void expect_closed(int rc) {
  if (rc == NP_ERR_STATE && strstr(np_last_error(), "closed pool")) atomic_fetch_add(&refused, 1);
  else {
    fprintf(stderr, "teardown: unexpected failure %d: %s\n", rc, np_last_error());
    atomic_fetch_add(&bad, 1);
  }
}

/* malloc/free/stats on one context until it is closed. */
static void *ctx_worker(void *arg) {
  np_ctx *ctx = arg;
  void *live[16] = {0};
  for (unsigned i = 0;; i++) {
    void **slot = &live[i % 16];
    int rc;
    if (*slot) {
      rc = np_free(ctx, *slot);
      if (rc == NP_OK) *slot = NULL;
    } else {
      rc = np_malloc(ctx, 4096u * (1 + i % 37), 0, slot);
    }
    if (rc != NP_OK) {
      expect_closed(rc);
      return NULL;
    }
    if (i % 5 == 0) {
      np_stats st;
      np_get_stats(ctx, &st);
    }
  }
}

static int close_race(int policy) {
  np_config cfg;
  np_config_init(&cfg);
  cfg.policy = policy;
  cfg.capacity = 256ull << 20;
  cfg.host_backed = 1;
  np_ctx *ctx;
  if (np_create(&cfg, &ctx) != NP_OK) return fprintf(stderr, "create: %s\n", np_last_error()), 1;
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, ctx_worker, ctx);
  usleep(2000);
  if (np_close(ctx) != NP_OK) return fprintf(stderr, "close: %s\n", np_last_error()), 1;
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  void *p;
  expect_closed(np_malloc(ctx, 4096, 0, &p));
  np_stats st;
  np_get_stats(ctx, &st);
  if (st.total.reserved.current || st.total.allocated.current) return fprintf(stderr, "closed pool holds memory\n"), 1;
  if (np_close(ctx) != NP_OK) return 1; /* twice: nothing */
  return np_destroy(ctx) != NP_OK;
}

/* Every other entry point on a closed context of `policy` (the closed-pool refusal, or an answer
 * for statistics): before, reset_accumulated and a replay with iteration bounds read the closed
 * context's backend, which close had dropped. */
static int closed_calls(int policy) {
  np_config cfg;
  np_config_init(&cfg);
  cfg.policy = policy;
  cfg.capacity = 64ull << 20;
  np_ctx *ctx;
  if (np_create(&cfg, &ctx) != NP_OK || np_close(ctx) != NP_OK) return fprintf(stderr, "closed: %s\n", np_last_error()), 1;
  np_reset_accumulated(ctx);
  np_reset_peak(ctx);
  uint8_t op = 0, cat = 0;
  int32_t site = -1;
  int64_t id = 0, stream = 0;
  uint64_t size = 4096, addr = 0, bound = 0, bound_calls[NP_CALL_COUNT];
  np_replay_in in = {.n = 1, .op = &op, .cat = &cat, .site = &site, .id = &id, .size = &size, .stream = &stream,
                     .addr = &addr, .n_ids = 1, .bounds = &bound, .n_bounds = 1, .bound_calls = bound_calls};
  np_replay_out out;
  uint64_t bytes, plan[1] = {4096}, offset[1] = {0}, end[1] = {1}, counts[4];
  int before = atomic_load(&refused);
  expect_closed(np_replay(ctx, &in, &out));
  expect_closed(np_region(ctx, "a"));
  expect_closed(np_pause(ctx, "a", 0, &bytes));
  expect_closed(np_resume(ctx, "a", &bytes));
  expect_closed(np_set_backup_limit(ctx, 1 << 20));
  expect_closed(np_set_plan(ctx, 1, 0, plan, offset, end, 0, 0, 0, counts));
  expect_closed(np_set_plan(ctx, 0, 0, NULL, NULL, NULL, 0, 0, 0, counts));
  if (atomic_load(&refused) - before != 7) return fprintf(stderr, "closed: a call on a closed pool was not refused\n"), 1;
  return np_destroy(ctx) != NP_OK;
}

/* The torch hooks on the device table while it is shut down. */
static void *hook_worker(void *arg) {
  (void)arg;
  void *live[8] = {0};
  for (unsigned i = 0; !atomic_load(&stop); i++) {
    void **slot = &live[i % 8];
    if (*slot) {
      npu_pool_free(*slot, 0, 0, NULL); /* after the shutdown: refused (and printed), never a crash */
      *slot = NULL;
    } else {
      *slot = npu_pool_malloc(8192u * (1 + i % 11), 0, NULL);
    }
    np_stats st;
    npu_pool_device_stats(0, &st);
  }
  return NULL;
}

static int shutdown_race(void) {
  if (npu_pool_configure(np_policy_index("npu_pool"), NP_BACKEND_SIM, 1.0, 1, NULL) != NP_OK) return 1;
  atomic_store(&stop, 0);
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, hook_worker, NULL);
  usleep(2000);
  npu_pool_shutdown();
  usleep(1000);
  atomic_store(&stop, 1);
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  return 0;
}

static void *spin(void *arg) {
  np_ctx *ctx = arg;
  for (unsigned i = 0; !atomic_load(&stop); i++) {
    void *p;
    if (np_malloc(ctx, 1u << 20, 0, &p) == NP_OK) np_free(ctx, p);
  }
  return NULL;
}

/* Wait for forked child pid; 1 (and says how) unless it exited with 0. */
static int failed_child(pid_t pid, const char *which) {
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
  fprintf(stderr, "teardown: child %s %s %d\n", which, WIFSIGNALED(status) ? "killed by signal" : "exited",
          WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
  return 1;
}

static void *table_worker(void *arg) {
  (void)arg;
  for (unsigned i = 0; !atomic_load(&stop); i++) {
    np_stats st;
    npu_pool_device_stats(0, &st); /* each takes the device table's lock */
    npu_pool_set_fraction(1, 0.5);
    npu_pool_set_history(-1, 100);
  }
  return NULL;
}

/* fork() while threads hold the device table's lock and no context exists yet (the fork handlers
 * were installed only by the first context before): the child makes its first context. Must run
 * before anything in this process creates a context. */
static int fork_before_any_context(void) {
  if (npu_pool_configure(np_policy_index("npu_pool"), NP_BACKEND_SIM, 1.0, 1, NULL) != NP_OK) return 1;
  atomic_store(&stop, 0);
  pthread_t t[2];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, table_worker, NULL);
  int failed = 0;
  for (int round = 0; round < ROUNDS && !failed; round++) {
    usleep(200);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(10); /* a hang is a failure, not a stuck test */
      _exit(npu_pool_device_ctx(0) ? 0 : 3);
    }
    failed = failed_child(pid, "forked before any context");
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  npu_pool_shutdown();
  return failed;
}

/* fork() while threads are inside the pool: the child's first call must not hang. */
static int fork_race(void) {
  np_config cfg;
  np_config_init(&cfg);
  cfg.capacity = 1ull << 30;
  np_ctx *ctx;
  if (np_create(&cfg, &ctx) != NP_OK) return 1;
  atomic_store(&stop, 0);
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, spin, ctx);
  int failed = 0;
  for (int round = 0; round < ROUNDS && !failed; round++) {
    usleep(500);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(10); /* a hang is a failure, not a stuck test */
      np_stats st;
      np_get_stats(ctx, &st);
      void *p;
      int rc = np_malloc(ctx, 4096, 0, &p); /* a simulated device is host memory: the child's copy */
      if (rc == NP_OK) rc = np_free(ctx, p);
      if (rc == NP_OK) rc = np_check(ctx);
      if (rc == NP_OK) rc = np_close(ctx);
      _exit(rc == NP_OK ? 0 : 3);
    }
    failed = failed_child(pid, "forked while threads were inside the pool");
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  return np_destroy(ctx) != NP_OK || failed;
}

int main(void) {
  if (fork_before_any_context()) return 1; /* first: no context may exist yet */
  printf("fork before any context: ok\n");
  for (int p = 0; p < np_policy_count(); p++)
    if (closed_calls(p)) return 1;
  printf("closed calls: ok\n");
  for (int round = 0; round < ROUNDS; round++)
    for (int p = 0; p < np_policy_count(); p++)
      if (close_race(p)) return 1;
  printf("close: %d calls refused as closed, %d other failures\n", atomic_load(&refused), atomic_load(&bad));
  for (int round = 0; round < 3; round++)
    if (shutdown_race()) return 1;
  printf("shutdown: ok\n");
  if (fork_race()) return 1;
  printf("fork: ok\n");
  return atomic_load(&bad) != 0;
}
