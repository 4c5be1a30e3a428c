/* error.h — thread-local error message behind colibri_last_error(). */
#ifndef COLIBRI_ERROR_H
#define COLIBRI_ERROR_H

#include "colibri.h"

/* Record a failure for the calling thread and return `code`, so callers can write
 *     return cb_error(COLIBRI_E_FORMAT, "tensor %s: offset %llu past end of file", name, off); */
colibri_status cb_error(colibri_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cb_clear_error(void);
const char *cb_last_error(void);

#endif
