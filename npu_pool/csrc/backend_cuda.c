/* backend_cuda.c -- placeholder until the vendor backend lands. */
#include "backend.h"

np_backend *np_backend_cuda_create(const np_config *cfg) {
  (void)cfg;
  np_error(NP_ERR_BACKEND, "the cuda backend is not available in this build");
  return NULL;
}
