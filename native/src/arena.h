/* arena.h — bump allocator for per-step scratch. One allocation up front, sized by the
 * plan; arena_alloc never touches the heap. Overflow is an error, never a silent overwrite. */
#ifndef COLIBRI_ARENA_H
#define COLIBRI_ARENA_H

#include <stddef.h>

#include "colibri.h"

#define ARENA_ALIGN 64

typedef struct arena {
    unsigned char *base;
    size_t cap;
    size_t used;
    size_t peak;
} arena;

colibri_status arena_init(arena *a, size_t cap);
void arena_free(arena *a);
/* 64-byte aligned block of n bytes; NULL (with a COLIBRI_E_NOMEM message) if it does not fit. */
void *arena_alloc(arena *a, size_t n);
static inline size_t arena_mark(const arena *a) { return a->used; }
static inline void arena_reset(arena *a, size_t mark) { a->used = mark; }

#endif
