// torch_cuda_hooks.cpp -- the malloc, free and memory-fraction hooks of torch's
// CUDAPluggableAllocator, in C++ so that a request npu_pool cannot serve raises
// torch.OutOfMemoryError and a refused fraction a RuntimeError (malloc_hook.h says why a C
// function cannot). Built against the installed torch's headers by npu_pool/cpp_hooks.py
// (cached), bound to the core's C entry points at load. Needs no CUDA header: the stream is
// passed through as the pointer it is.
#include "malloc_hook.h"

namespace {
npu_pool_shim::CoreMalloc core;
}  // namespace

extern "C" {

// The core's entry points (addresses from the binding); returns 0.
int npu_pool_hooks_bind(void *malloc_fn, void *free_fn, void *last_error_fn, void *last_code_fn, void *set_fraction_fn) {
  npu_pool_shim::bind_malloc(core, malloc_fn, free_fn, last_error_fn, last_code_fn, set_fraction_fn);
  return 0;
}

void *npu_pool_hooks_malloc(size_t size, int device, void *stream) {
  return npu_pool_shim::malloc_or_throw(core, size, device, stream);
}

void npu_pool_hooks_free(void *ptr, size_t size, int device, void *stream) { core.free(ptr, size, device, stream); }

void npu_pool_hooks_memory_fraction(double fraction, int device) { npu_pool_shim::fraction_or_throw(core, fraction, device); }

}  // extern "C"
