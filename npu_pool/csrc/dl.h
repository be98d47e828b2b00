/* dl.h -- what the vendor backends (acl, cuda) share: loading a vendor library at run
 * time and binding its symbols into a table of function pointers.
 *
 * Nothing here links against a vendor: libraries are dlopen'ed by name (or by
 * the np_config.lib_path override) and every failure is an NP_ERR_* code with
 * np_error() naming the library, the symbol or the vendor call.
 */
#ifndef NP_DL_H
#define NP_DL_H

#include "common.h"

enum { NP_DL_REQUIRED = 0, NP_DL_OPTIONAL = 1, NP_DL_VMM = 2 };

/* One symbol to bind: its name, where its pointer goes in the api table, and its
 * group (required, optional, or part of the all-or-nothing virtual-memory group). */
typedef struct np_dl_sym {
  const char *name;
  size_t offset;
  int group;
} np_dl_sym;

/* Entry for a table whose fields are named after the vendor functions. */
#define NP_DL_SYM(api_t, fn, group) {#fn, offsetof(api_t, fn), group}

/* Open `override` if set (NP_ERR_INVALID when longer than a path may be), else the first of the
 * NULL-terminated `names` that loads. `what` names the library in the error ("the Ascend runtime (ACL)"). */
void *np_dl_open(const char *override, const char *const *names, const char *what);
void np_dl_close(void *lib);
/* The path a handle was loaded from (for messages); "?" if unknown. */
const char *np_dl_path(void *lib, char *buf, size_t len);

/* Bind every symbol of `syms` into `api`. A missing required symbol is an error;
 * a missing optional one stays NULL; a missing VMM symbol clears the whole VMM
 * group and writes its name to `vmm_missing` (if not NULL; "" when complete). */
int np_dl_bind(void *lib, const char *libname, const np_dl_sym *syms, size_t n, void *api, char *vmm_missing,
               size_t missing_len);

#endif
