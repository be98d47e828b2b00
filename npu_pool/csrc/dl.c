/* dl.c -- loading vendor libraries and binding their symbols. */
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dl.h"

void *np_dl_open(const char *override, const char *const *names, const char *what) {
  if (override && *override) {
    if (strlen(override) >= PATH_MAX) {
      np_error(NP_ERR_INVALID, "cannot load %s: lib_path is %zu bytes, longer than the %d a path may have", what,
               strlen(override), PATH_MAX - 1);
      return NULL;
    }
    struct stat st; /* a path names a file dlopen would open(): a FIFO there blocks it for ever */
    if (strchr(override, '/') && stat(override, &st) == 0 && !S_ISREG(st.st_mode)) {
      np_error(NP_ERR_INVALID, "cannot load %s from %s: not a regular file (%s)", what, override,
               S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket");
      return NULL;
    }
    void *lib = dlopen(override, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char *e = dlerror();
      if (!e) e = "unknown dlopen error";
      if (strstr(e, override)) np_error(NP_ERR_BACKEND, "cannot load %s: %s", what, e); /* it names the path */
      else np_error(NP_ERR_BACKEND, "cannot load %s from %s: %s", what, override, e);
    }
    return lib;
  }
  char tried[256] = "", why[512] = "";
  size_t used = 0;
  for (const char *const *n = names; *n; n++) {
    void *lib = dlopen(*n, RTLD_NOW | RTLD_LOCAL);
    if (lib) return lib;
    const char *e = dlerror();
    np_copy_text(why, sizeof why, e ? e : "unknown dlopen error");
    if (used < sizeof tried - 1) { /* the names tried, a cut ending in "..." */
      np_format_text(tried + used, sizeof tried - used, n == names ? "%s" : ", %s", *n);
      used += strlen(tried + used);
    }
  }
  np_error(NP_ERR_BACKEND, "cannot load %s (tried %s): %s; is the vendor runtime installed and on LD_LIBRARY_PATH?",
           what, tried, why);
  return NULL;
}

void np_dl_close(void *lib) {
  if (lib) dlclose(lib);
}

const char *np_dl_path(void *lib, char *buf, size_t len) {
  struct link_map *map = NULL;
  if (lib && dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name)
    np_copy_text(buf, len, map->l_name);
  else
    snprintf(buf, len, "?");
  return buf;
}

int np_dl_bind(void *lib, const char *libname, const np_dl_sym *syms, size_t n, void *api, char *vmm_missing,
               size_t missing_len) {
  bool vmm_ok = true;
  if (vmm_missing && missing_len) vmm_missing[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    dlerror();
    void *fn = dlsym(lib, syms[i].name);
    memcpy((char *)api + syms[i].offset, &fn, sizeof fn); /* POSIX: function pointers round-trip through void* */
    if (fn) continue;
    if (syms[i].group == NP_DL_REQUIRED)
      return np_error(NP_ERR_BACKEND, "%s has no symbol %s: not the expected vendor library, or a version too old",
                      libname, syms[i].name);
    if (syms[i].group == NP_DL_VMM && vmm_ok) {
      vmm_ok = false;
      if (vmm_missing && missing_len) snprintf(vmm_missing, missing_len, "%s", syms[i].name);
    }
  }
  if (!vmm_ok) {
    void *none = NULL;
    for (size_t i = 0; i < n; i++)
      if (syms[i].group == NP_DL_VMM) memcpy((char *)api + syms[i].offset, &none, sizeof none);
  }
  return NP_OK;
}
