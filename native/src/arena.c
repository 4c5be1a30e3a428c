#include "arena.h"

#include "alloc.h"
#include "error.h"

colibri_status arena_init(arena *a, size_t cap) {
    a->used = a->peak = 0;
    a->cap = (cap + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    a->base = cb_aligned_alloc(ARENA_ALIGN, a->cap);
    if (!a->base) {
        a->cap = 0;
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate a scratch arena of %zu bytes", cap);
    }
    return COLIBRI_OK;
}

void arena_free(arena *a) {
    cb_free(a->base);
    a->base = NULL;
    a->cap = a->used = a->peak = 0;
}

void *arena_alloc(arena *a, size_t n) {
    size_t need = (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if (need < n || need > a->cap - a->used) {
        cb_error(COLIBRI_E_NOMEM, "scratch arena overflow: need %zu more bytes, %zu of %zu in use", n, a->used,
                 a->cap);
        return NULL;
    }
    void *p = a->base + a->used;
    a->used += need;
    if (a->used > a->peak) a->peak = a->used;
    return p;
}
