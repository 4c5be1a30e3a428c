/* alloc.h — every heap allocation of the engine goes through these wrappers.
 *
 * They count allocations so that a test can prove a decode step allocates nothing
 * (colibri_stats.allocs_last_eval). The counter is the one piece of process-wide
 * mutable state besides the CPU dispatch table; it is atomic and diagnostic only. */
#ifndef COLIBRI_ALLOC_H
#define COLIBRI_ALLOC_H

#include <stddef.h>
#include <stdint.h>

void *cb_malloc(size_t n);                   /* NULL on failure (no message set) */
void *cb_calloc(size_t count, size_t size);  /* NULL on failure or overflow */
void *cb_aligned_alloc(size_t alignment, size_t n); /* alignment: power of two >= sizeof(void*) */
void cb_free(void *p);                       /* frees memory from any of the above; NULL is fine */
uint64_t cb_alloc_count(void);               /* allocations made so far by this process's engine */

#endif
