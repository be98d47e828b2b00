/* policies.c -- the policy registry: one line per policy. Its index is np_config.policy. */
#include <string.h>

#include "policy.h"

#define POLICIES(X) \
  X(torch)          \
  X(npu_pool)       \
  X(expandable)     \
  X(planned)

#define DECLARE(name) extern const np_policy np_policy_##name;
POLICIES(DECLARE)
#define ENTRY(name) &np_policy_##name,
static const np_policy *const registry[] = {POLICIES(ENTRY)};
#define COUNT ((int)(sizeof registry / sizeof *registry))

const np_policy *np_policy_at(int index) { return index >= 0 && index < COUNT ? registry[index] : NULL; }

int np_policy_count(void) { return COUNT; }

const char *np_policy_name(int policy) { return policy >= 0 && policy < COUNT ? registry[policy]->name : NULL; }

int np_policy_index(const char *name) {
  for (int i = 0; name && i < COUNT; i++)
    if (strcmp(registry[i]->name, name) == 0) return i;
  return -1;
}

const char *np_policy_pool_name(int policy, int pool) {
  return policy >= 0 && policy < COUNT && pool >= 0 && pool < NP_POOLS ? registry[policy]->pool_name[pool] : NULL;
}

const char *np_policy_pool_meaning(int policy, int pool) {
  return policy >= 0 && policy < COUNT && pool >= 0 && pool < NP_POOLS ? registry[policy]->pool_meaning[pool] : NULL;
}

const char *np_policy_summary(int policy) { return policy >= 0 && policy < COUNT ? registry[policy]->summary : NULL; }
