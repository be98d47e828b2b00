// malloc_hook_driver.cpp -- drives a built torch_cuda_hooks library over fake core entry points
// (tests/test_cpp_hooks.py): what its malloc hook throws for each way the core can answer.
// Prints one line per case: "<case> <what happened> <message>".
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

#include <c10/util/Exception.h>

#include "npu_pool.h"

static int g_code = NP_OK;
static const char *g_msg = "";
static char g_block[64];

static void *fake_malloc(size_t size, int, void *) {
  if (size == 1) return g_block;  // served
  return nullptr;                 // refused: g_code says why
}
static void fake_free(void *, size_t, int, void *) {}
static size_t fake_last_error(int device, char *buf, size_t n) {
  // the hook must ask for the calling thread's failure (-1), not the device's last one, which
  // another thread's failure may have replaced
  const char *msg = device == -1 ? g_msg : "the device's last failure, not this thread's";
  std::snprintf(buf, n, "%s", msg);
  return std::strlen(msg);
}
static int fake_last_code() { return g_code; }

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  void *so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!so) {
    std::printf("dlopen %s\n", dlerror());
    return 2;
  }
  auto bind = reinterpret_cast<int (*)(void *, void *, void *, void *)>(dlsym(so, "npu_pool_hooks_bind"));
  auto hook = reinterpret_cast<void *(*)(size_t, int, void *)>(dlsym(so, "npu_pool_hooks_malloc"));
  if (!bind || !hook) return 2;
  bind(reinterpret_cast<void *>(fake_malloc), reinterpret_cast<void *>(fake_free),
       reinterpret_cast<void *>(fake_last_error), reinterpret_cast<void *>(fake_last_code));
  struct Case {
    const char *name;
    size_t size;
    int code;
    const char *msg;
  } cases[] = {{"served", 1, NP_OK, ""},
               {"zero", 0, NP_OK, ""},
               {"oom", 2, NP_ERR_OOM, "out of memory on device 0"},
               {"closed", 3, NP_ERR_STATE, "closed pool"}};
  for (const Case &c : cases) {
    g_code = c.code;
    g_msg = c.msg;
    try {
      void *p = hook(c.size, 0, nullptr);
      std::printf("%s returned %s\n", c.name, p == g_block ? "block" : (p ? "other" : "null"));
    } catch (const c10::OutOfMemoryError &e) {
      std::printf("%s OutOfMemoryError %s\n", c.name, e.msg().c_str());
    } catch (const c10::Error &e) {
      std::printf("%s Error %s\n", c.name, e.msg().c_str());
    }
  }
  return 0;
}
