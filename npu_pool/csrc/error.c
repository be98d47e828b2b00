/* error.c -- per-thread error messages (like errno: each caller sees its own). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static _Thread_local char np_errbuf[NP_ERR_TEXT];
static _Thread_local int np_errcode;

/* vsnprintf into buf (len > 0 bytes); a cut text ends in "...", so that it shows. */
static void format_v(char *buf, size_t len, const char *fmt, va_list ap) {
  int n = vsnprintf(buf, len, fmt, ap);
  if (n >= 0 && (size_t)n >= len && len > 4) memcpy(buf + len - 4, "...", 4);
}

int np_error(int code, const char *fmt, ...) {
  np_errcode = code;
  va_list ap;
  va_start(ap, fmt);
  format_v(np_errbuf, sizeof np_errbuf, fmt, ap);
  va_end(ap);
  return code;
}

void np_copy_text(char *dst, size_t len, const char *text) { np_format_text(dst, len, "%s", text); }

void np_format_text(char *dst, size_t len, const char *fmt, ...) {
  if (!len) return;
  va_list ap;
  va_start(ap, fmt);
  format_v(dst, len, fmt, ap);
  va_end(ap);
}

const char *np_last_error(void) { return np_errbuf; }

int np_last_code(void) { return np_errcode; }

void np_save_error(np_saved_error *s, int code) {
  s->code = code;
  snprintf(s->text, sizeof s->text, "%s", np_errbuf);
}

int np_restore_error(const np_saved_error *s) { return np_error(s->code, "%s", s->text); }

const char *np_fmt_double(double x, char *buf) {
  for (int digits = 6; digits <= 17; digits++) { /* the fewest digits that read back as x: 1.0000001, not 1 */
    snprintf(buf, 32, "%.*g", digits, x);
    if (strtod(buf, NULL) == x) break;
  }
  return buf; /* (NaN never reads back equal: 17 digits of "nan") */
}

const char *np_fmt_bytes(uint64_t bytes, char *buf) {
  if (bytes >= NP_GIB) snprintf(buf, 32, "%.2f GiB", (double)bytes / (double)NP_GIB);
  else if (bytes >= NP_MIB) snprintf(buf, 32, "%.2f MiB", (double)bytes / (double)NP_MIB);
  else snprintf(buf, 32, "%llu bytes", (unsigned long long)bytes);
  return buf;
}
