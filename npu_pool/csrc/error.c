/* error.c -- per-thread error messages (like errno: each caller sees its own). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

static _Thread_local char np_errbuf[NP_ERR_TEXT];
static _Thread_local int np_errcode;

int np_error(int code, const char *fmt, ...) {
  np_errcode = code;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(np_errbuf, sizeof np_errbuf, fmt, ap);
  va_end(ap);
  if (n >= (int)sizeof np_errbuf) memcpy(np_errbuf + sizeof np_errbuf - 4, "...", 4); /* cut: say so */
  return code;
}

const char *np_last_error(void) { return np_errbuf; }

int np_last_code(void) { return np_errcode; }

void np_save_error(np_saved_error *s, int code) {
  s->code = code;
  snprintf(s->text, sizeof s->text, "%s", np_errbuf);
}

int np_restore_error(const np_saved_error *s) { return np_error(s->code, "%s", s->text); }

const char *np_fmt_bytes(uint64_t bytes, char *buf) {
  if (bytes >= NP_GIB) snprintf(buf, 32, "%.2f GiB", (double)bytes / (double)NP_GIB);
  else if (bytes >= NP_MIB) snprintf(buf, 32, "%.2f MiB", (double)bytes / (double)NP_MIB);
  else snprintf(buf, 32, "%llu bytes", (unsigned long long)bytes);
  return buf;
}
