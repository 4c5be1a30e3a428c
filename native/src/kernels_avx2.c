/* kernels_avx2.c — AVX2 + FMA + F16C kernels (see kernels_x86.h for the shapes).
 * Compiled with -mavx2 -mfma -mf16c; cpu.c only selects this table after CPUID and
 * XGETBV confirm the CPU and OS support it. */
#define X86_VNNI 0
#include "kernels_x86.h"

const kernel_table kernels_avx2 = {
    .name = "avx2",
    .isa = KERNEL_ISA_AVX2,
    .matmul_rows = kx_matmul_rows,
    .quantize_row_q8a = kx_quantize_row_q8a,
    .dot_f16_f32 = kx_dot_f16_f32,
    .axpy_f16 = kx_axpy_f16,
    .dot_f16_f32_rows = kx_dot_f16_f32_rows,
    .axpy_f16_rows = kx_axpy_f16_rows,
    .fp32_to_fp16_row = kx_fp32_to_fp16_row,
    .dot_f32 = kx_dot_f32,
    .silu_mul = kx_silu_mul,
};
