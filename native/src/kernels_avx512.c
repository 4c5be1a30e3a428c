/* kernels_avx512.c — AVX-512 (F/BW/VL/DQ) + VNNI kernels (see kernels_x86.h): quantized
 * weights go two blocks per 512-bit vector through vpdpbusd, with 8-row decode tiles and
 * 4 x 4 prefill tiles in the 32 vector registers. Compiled with the AVX-512 flags; cpu.c
 * only selects this table after CPUID and XGETBV (ZMM and opmask state) confirm support. */
#define X86_VNNI 1
#include "kernels_x86.h"
#include "kernels_x86_gemm.h" /* Q4_K / Q5_K / Q6_K prefill: 8 tokens per lane */

const kernel_table kernels_avx512 = {
    .name = "avx512",
    .isa = KERNEL_ISA_AVX512,
    .matmul_rows = kg_matmul_rows,
    .quantize_row_q8a = kx_quantize_row_q8a,
    .dot_f16_f32 = kx_dot_f16_f32,
    .axpy_f16 = kx_axpy_f16,
    .dot_f16_f32_rows = kx_dot_f16_f32_rows,
    .axpy_f16_rows = kx_axpy_f16_rows,
    .fp32_to_fp16_row = kx_fp32_to_fp16_row,
    .dot_f32 = kx_dot_f32,
    .silu_mul = kx_silu_mul,
};
