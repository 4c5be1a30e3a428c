/* kernels_neon.c — base ARMv8-A Advanced SIMD (every AArch64 CPU has it).
 * The code is kernels_neon.h's; cpu.c selects this table only when the hardware capability
 * bits say the CPU runs it. */
#define NEON_DOT 0
#define NEON_MMLA 0
#include "kernels_neon.h"

const kernel_table kernels_neon = {
    .name = "neon",
    .isa = KERNEL_ISA_NEON,
    .matmul_rows = neon_matmul_rows,
    .quantize_row_q8a = neon_quantize_row_q8a,
    .dot_f16_f32 = neon_dot_f16_f32,
    .axpy_f16 = neon_axpy_f16,
    .fp32_to_fp16_row = neon_fp32_to_fp16_row,
    .dot_f32 = neon_dot_f32,
    .silu_mul = silu_mul_scalar,
};

/* The three NEON tables share kernels_neon.h's type list, so this one answers for all. */
int kernels_neon_has_code(uint32_t type) { return kn_has_code(type); }
