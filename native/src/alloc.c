#include "alloc.h"

#include <stdatomic.h>
#include <stdlib.h>

static atomic_uint_fast64_t n_allocs;

void *cb_malloc(size_t n) {
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return malloc(n ? n : 1);
}

void *cb_calloc(size_t count, size_t size) {
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    if (count == 0 || size == 0) return calloc(1, 1);
    return calloc(count, size);
}

void *cb_aligned_alloc(size_t alignment, size_t n) {
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    void *p = NULL;
    if (posix_memalign(&p, alignment, n ? n : alignment) != 0) return NULL;
    return p;
}

void cb_free(void *p) { free(p); }

uint64_t cb_alloc_count(void) { return atomic_load_explicit(&n_allocs, memory_order_relaxed); }
