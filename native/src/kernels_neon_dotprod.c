/* kernels_neon_dotprod.c — Advanced SIMD + SDOT (ARMv8.2 dot product, HWCAP_ASIMDDP); built with -march=armv8.2-a+dotprod.
 * The code is kernels_neon.h's; cpu.c selects this table only when the hardware capability
 * bits say the CPU runs it. */
#define NEON_DOT 1
#define NEON_MMLA 0
#include "kernels_neon.h"

const kernel_table kernels_neon_dotprod = {
    .name = "neon-dotprod",
    .isa = KERNEL_ISA_NEON_DOTPROD,
    .matmul_rows = neon_matmul_rows,
    .quantize_row_q8a = neon_quantize_row_q8a,
    .dot_f16_f32 = neon_dot_f16_f32,
    .axpy_f16 = neon_axpy_f16,
    .fp32_to_fp16_row = neon_fp32_to_fp16_row,
    .dot_f32 = neon_dot_f32,
    .silu_mul = silu_mul_scalar,
};
