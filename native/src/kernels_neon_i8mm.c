/* kernels_neon_i8mm.c — Advanced SIMD + SDOT + SMMLA (int8 matrix multiply, HWCAP2_I8MM); built with -march=armv8.2-a+dotprod+i8mm.
 * The code is kernels_neon.h's; cpu.c selects this table only when the hardware capability
 * bits say the CPU runs it. */
#define NEON_DOT 1
#define NEON_MMLA 1
#include "kernels_neon.h"

const kernel_table kernels_neon_i8mm = {
    .name = "neon-i8mm",
    .isa = KERNEL_ISA_NEON_I8MM,
    .matmul_rows = neon_matmul_rows,
    .quantize_row_q8a = neon_quantize_row_q8a,
    .dot_f16_f32 = neon_dot_f16_f32,
    .axpy_f16 = neon_axpy_f16,
    .fp32_to_fp16_row = neon_fp32_to_fp16_row,
    .dot_f32 = neon_dot_f32,
    .silu_mul = silu_mul_scalar,
};
