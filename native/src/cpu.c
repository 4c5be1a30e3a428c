/* cpu.c — which instruction sets this CPU (and OS) supports, and the one dispatch table.
 *
 * The AVX2 and AVX-512 kernel files are compiled with those instruction sets enabled, so
 * nothing in them may run before the checks here pass: CPUID says the CPU has the
 * instructions, XGETBV says the OS saves the wider registers on context switches.
 * On AArch64 the kernel reports the CPU's features in the auxiliary vector (AT_HWCAP,
 * AT_HWCAP2): Advanced SIMD is part of every AArch64 CPU; SDOT and SMMLA are optional. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "kernels_impl.h"

#if defined(COLIBRI_HAVE_X86)
#include <cpuid.h>

static uint64_t read_xcr0(void) {
    uint32_t lo, hi;
    /* xgetbv with ecx = 0; written as asm so this file needs no -mxsave */
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

typedef struct cpu_caps {
    int avx2;    /* AVX2 + FMA + F16C, YMM state enabled by the OS */
    int avx512;  /* AVX-512 F/BW/VL/DQ/VNNI, ZMM and opmask state enabled by the OS */
} cpu_caps;

static cpu_caps detect_caps(void) {
    cpu_caps caps = {0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return caps;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return caps;
    const uint64_t xcr0 = read_xcr0();
    const int ymm_os = (xcr0 & 0x6) == 0x6;    /* SSE and AVX state */
    const int zmm_os = (xcr0 & 0xe6) == 0xe6;  /* plus opmask, ZMM_Hi256, Hi16_ZMM */
    if (__get_cpuid_max(0, NULL) < 7) return caps;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1;
    const int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    const int vnni = (c >> 11) & 1;
    caps.avx2 = ymm_os && avx2 && fma && f16c;
    caps.avx512 = caps.avx2 && zmm_os && f && dq && bw && vl && vnni;
    return caps;
}
#endif

#if defined(COLIBRI_HAVE_NEON) && defined(__linux__)
#include <sys/auxv.h>
/* The bits of Linux's arch/arm64 uapi hwcap.h, for C libraries whose headers predate them. */
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1ul << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1ul << 13)
#endif
#endif

/* Bit set of the kernel_isa values this CPU runs, detected once. */
static unsigned detect_isas(void) {
    unsigned isas = 1u << KERNEL_ISA_SCALAR;
#if defined(COLIBRI_HAVE_X86)
    cpu_caps caps = detect_caps();
    if (caps.avx2) isas |= 1u << KERNEL_ISA_AVX2;
    if (caps.avx512) isas |= 1u << KERNEL_ISA_AVX512;
#endif
#if defined(COLIBRI_HAVE_NEON)
    isas |= 1u << KERNEL_ISA_NEON;
#if defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (hw & HWCAP_ASIMDDP) {
        isas |= 1u << KERNEL_ISA_NEON_DOTPROD;
        if (hw2 & HWCAP2_I8MM) isas |= 1u << KERNEL_ISA_NEON_I8MM;
    }
#endif
#endif
    return isas;
}

/* Tables this build has, best first, and whether this CPU can run each. */
static const kernel_table *const all_tables[] = {
#if defined(COLIBRI_HAVE_X86)
    &kernels_avx512,
    &kernels_avx2,
#endif
#if defined(COLIBRI_HAVE_NEON)
    &kernels_neon_i8mm,
    &kernels_neon_dotprod,
    &kernels_neon,
#endif
    &kernels_scalar,
};
#define N_TABLES (sizeof all_tables / sizeof all_tables[0])

static int table_supported(const kernel_table *t) {
    static atomic_uint isa_state; /* 0: not yet detected; else the detected bit set (scalar's bit is always on) */
    unsigned st = atomic_load_explicit(&isa_state, memory_order_relaxed);
    if (st == 0) {
        st = detect_isas();
        atomic_store_explicit(&isa_state, st, memory_order_relaxed);
    }
    return (st >> t->isa) & 1u;
}

/* The dispatch table. Races on first use are benign: every thread picks the same table.
 * Switching it (kernels_select) while other threads compute is safe, each kernel call
 * using one table throughout, but results may then mix the sets' rounding. */
static _Atomic(const kernel_table *) current_table;

static const kernel_table *best_table(void) {
    for (size_t i = 0; i < N_TABLES; i++)
        if (table_supported(all_tables[i])) return all_tables[i];
    return &kernels_scalar;
}

/* The first choice: COLIBRI_CPU_BACKEND if it names a set this CPU runs (for comparing
 * kernel sets in a whole program without code changes; colibri_cpu_backend() tells which
 * set is in use), else the best available. */
static const kernel_table *initial_table(void) {
    const char *want = getenv("COLIBRI_CPU_BACKEND");
    if (want && *want)
        for (size_t i = 0; i < N_TABLES; i++)
            if (strcmp(all_tables[i]->name, want) == 0 && table_supported(all_tables[i])) return all_tables[i];
    return best_table();
}

const kernel_table *kernels_current(void) {
    const kernel_table *t = atomic_load_explicit(&current_table, memory_order_acquire);
    if (t) return t;
    t = initial_table();
    atomic_store_explicit(&current_table, t, memory_order_release);
    return t;
}

const char *kernels_backend_name(void) { return kernels_current()->name; }

colibri_status kernels_select(const char *name) {
    if (!name) {
        atomic_store_explicit(&current_table, best_table(), memory_order_release);
        return COLIBRI_OK;
    }
    for (size_t i = 0; i < N_TABLES; i++) {
        if (strcmp(all_tables[i]->name, name) != 0) continue;
        if (!table_supported(all_tables[i]))
            return cb_error(COLIBRI_E_UNSUPPORTED, "CPU backend '%s' is not supported by this CPU", name);
        atomic_store_explicit(&current_table, all_tables[i], memory_order_release);
        return COLIBRI_OK;
    }
    static const char *const known[] = {"avx2", "avx512", "neon", "neon-dotprod", "neon-i8mm"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(name, known[i]) == 0)
            return cb_error(COLIBRI_E_UNSUPPORTED, "CPU backend '%s' is not built for this architecture", name);
    return cb_error(COLIBRI_E_INVALID_ARG,
                    "unknown CPU backend '%s' (expected scalar, avx2, avx512, neon, neon-dotprod or neon-i8mm)", name);
}

COLIBRI_API const char *colibri_cpu_backend(void) { return kernels_backend_name(); }

COLIBRI_API colibri_status colibri_set_cpu_backend(const char *name) {
    if (!name) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_set_cpu_backend: name is NULL");
    return kernels_select(name);
}
