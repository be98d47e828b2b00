/* backend_acl.c -- placeholder until the vendor backend lands. */
#include "backend.h"

np_backend *np_backend_acl_create(const np_config *cfg) {
  (void)cfg;
  np_error(NP_ERR_BACKEND, "the acl backend is not available in this build");
  return NULL;
}
