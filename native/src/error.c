#include "error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[512];

colibri_status cb_error(colibri_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

void cb_clear_error(void) { last_error[0] = '\0'; }

const char *cb_last_error(void) { return last_error; }
