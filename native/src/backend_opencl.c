/* backend_opencl.c — the OpenCL backend (backend.h).
 *
 * libOpenCL.so.1 (the ICD loader) is opened with dlopen when a context asks for this backend;
 * the few entry points and constants used are declared here from the OpenCL 1.2 specification,
 * so the engine builds without OpenCL headers and runs without OpenCL installed. The kernels
 * are OpenCL C source built for the chosen device at context creation (first GPU of any
 * platform, else the first accelerator, else the first device: PoCL's CPU device in CI).
 *
 * What runs on the device: matrix x activations for every weight type the engine computes with
 * but Q8_K (one work-group per output row and tile of 4 tokens, the row split over its lanes),
 * and the expert FFN's gate/up products with the activation (SwiGLU, gpt-oss's clamped form with
 * its expert biases, gelu_tanh) and the q8a quantization of the result for the down projection. The arithmetic follows the scalar reference kernels (kernels_scalar.c):
 * activations of quantized weights are block_q8a, each block's integer dot product is exact,
 * scales are applied in the same order, FP contraction is off and division is correctly
 * rounded, so only the order of the float sums (a tree over the lanes) differs. A job the device
 * cannot take (Q8_K, a matrix larger than its buffers) runs on the CPU backend, alongside it.
 *
 * Weights: resident matrices are uploaded once (on a device that shares host memory, such as
 * PoCL's CPU device or an integrated GPU, the buffer wraps the host bytes instead of copying
 * them); a matrix outside them (a streamed expert in a store slot) is copied into one of three
 * staging buffers on the transfer queue, the compute queue waiting for that copy by event, so
 * expert i+1's copy overlaps expert i's kernels and a buffer is reused only after the kernels
 * that read it completed. A device error marks the backend failed: that call and every later
 * one run on the CPU, counted in device_errors.
 *
 * The SwiGLU result stays on the device for the down projection: the expert FFN's q8a output
 * of a glu call is kept in the device buffer gq (up to KEEP_ROWS token rows per call), and a
 * matmul call right after it whose activations are that output reads them there instead of
 * uploading the host's copy. Its host copies (q8a and float rows) are read back only for a
 * reader that needs them: the activation statistics observer (host_copies), a down projection
 * handed to the CPU, sync; after a device error the glu call's jobs are redone on the CPU. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>

#include "alloc.h"
#include "backend.h"
#include "error.h"
#include "model.h"
#include "timeline.h"
#include "types.h"

/* ---- the OpenCL API subset (values from the OpenCL 1.2 specification) ------------------ */

typedef int32_t cl_int;
typedef uint32_t cl_uint;
typedef uint64_t cl_ulong;
typedef cl_ulong cl_bitfield;
typedef struct _cl_platform_id *cl_platform_id;
typedef struct _cl_device_id *cl_device_id;
typedef struct _cl_context *cl_context;
typedef struct _cl_command_queue *cl_command_queue;
typedef struct _cl_mem *cl_mem;
typedef struct _cl_program *cl_program;
typedef struct _cl_kernel *cl_kernel;
typedef struct _cl_event *cl_event;

#define CL_SUCCESS 0
#define CL_TRUE 1
#define CL_FALSE 0
#define CL_PLATFORM_VERSION 0x0901
#define CL_PLATFORM_NAME 0x0902
#define CL_DEVICE_TYPE_CPU (1 << 1)
#define CL_DEVICE_TYPE_GPU (1 << 2)
#define CL_DEVICE_TYPE_ACCELERATOR (1 << 3)
#define CL_DEVICE_TYPE_ALL 0xFFFFFFFFu
#define CL_DEVICE_MAX_WORK_GROUP_SIZE 0x1004
#define CL_DEVICE_MAX_MEM_ALLOC_SIZE 0x1010
#define CL_DEVICE_GLOBAL_MEM_SIZE 0x101F
#define CL_DEVICE_NAME 0x102B
#define CL_DEVICE_HOST_UNIFIED_MEMORY 0x1035
#define CL_QUEUE_PROFILING_ENABLE (1 << 1)
#define CL_MEM_READ_WRITE (1 << 0)
#define CL_MEM_READ_ONLY (1 << 2)
#define CL_MEM_USE_HOST_PTR (1 << 3)
#define CL_PROGRAM_BUILD_LOG 0x1183
#define CL_PROFILING_COMMAND_START 0x1282
#define CL_PROFILING_COMMAND_END 0x1283

typedef struct cl_api {
    cl_int (*GetPlatformIDs)(cl_uint, cl_platform_id *, cl_uint *);
    cl_int (*GetPlatformInfo)(cl_platform_id, cl_uint, size_t, void *, size_t *);
    cl_int (*GetDeviceIDs)(cl_platform_id, cl_bitfield, cl_uint, cl_device_id *, cl_uint *);
    cl_int (*GetDeviceInfo)(cl_device_id, cl_uint, size_t, void *, size_t *);
    cl_context (*CreateContext)(const intptr_t *, cl_uint, const cl_device_id *, void (*)(const char *, const void *, size_t, void *), void *, cl_int *);
    cl_command_queue (*CreateCommandQueue)(cl_context, cl_device_id, cl_bitfield, cl_int *);
    cl_mem (*CreateBuffer)(cl_context, cl_bitfield, size_t, void *, cl_int *);
    cl_program (*CreateProgramWithSource)(cl_context, cl_uint, const char **, const size_t *, cl_int *);
    cl_int (*BuildProgram)(cl_program, cl_uint, const cl_device_id *, const char *, void (*)(cl_program, void *), void *);
    cl_int (*GetProgramBuildInfo)(cl_program, cl_device_id, cl_uint, size_t, void *, size_t *);
    cl_kernel (*CreateKernel)(cl_program, const char *, cl_int *);
    cl_int (*SetKernelArg)(cl_kernel, cl_uint, size_t, const void *);
    cl_int (*EnqueueNDRangeKernel)(cl_command_queue, cl_kernel, cl_uint, const size_t *, const size_t *, const size_t *, cl_uint, const cl_event *, cl_event *);
    cl_int (*EnqueueWriteBuffer)(cl_command_queue, cl_mem, cl_uint, size_t, size_t, const void *, cl_uint, const cl_event *, cl_event *);
    cl_int (*EnqueueReadBuffer)(cl_command_queue, cl_mem, cl_uint, size_t, size_t, void *, cl_uint, const cl_event *, cl_event *);
    cl_int (*EnqueueReadBufferRect)(cl_command_queue, cl_mem, cl_uint, const size_t *, const size_t *, const size_t *, size_t, size_t, size_t, size_t, void *, cl_uint, const cl_event *, cl_event *);
    cl_int (*Finish)(cl_command_queue);
    cl_int (*Flush)(cl_command_queue);
    cl_int (*GetEventProfilingInfo)(cl_event, cl_uint, size_t, void *, size_t *);
    cl_int (*RetainEvent)(cl_event);
    cl_int (*ReleaseEvent)(cl_event);
    cl_int (*ReleaseMemObject)(cl_mem);
    cl_int (*ReleaseKernel)(cl_kernel);
    cl_int (*ReleaseProgram)(cl_program);
    cl_int (*ReleaseCommandQueue)(cl_command_queue);
    cl_int (*ReleaseContext)(cl_context);
} cl_api;

/* The loader stays loaded once opened: ICDs (PoCL's LLVM among them) are not safe to unload
 * and load again in one process. Written once under pthread_once, read-only after. */
static cl_api g_cl;
static char g_cl_error[384];
static pthread_once_t g_cl_once = PTHREAD_ONCE_INIT;

static void cl_load(void) {
    /* A statically linked program has no dynamic loader (the kernel gives no interpreter base):
     * glibc's dlopen from such a program crashes inside the driver, so it is refused here. */
    if (getauxval(AT_BASE) == 0) {
        snprintf(g_cl_error, sizeof g_cl_error, "this program is statically linked and cannot load an OpenCL "
                 "driver; use a dynamically linked build (the shared library, e.g. through the Python package)");
        return;
    }
    const char *env = getenv("COLIBRI_OPENCL_LIB");
    const char *names[] = {env && *env ? env : "libOpenCL.so.1", env && *env ? NULL : "libOpenCL.so"};
    void *h = NULL;
    for (int i = 0; i < 2 && !h; i++)
        if (names[i]) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(g_cl_error, sizeof g_cl_error, "cannot load %s: install an OpenCL loader and driver (Debian: "
                 "ocl-icd-libopencl1 and pocl-opencl-icd, or the GPU vendor's); dlopen: %.160s", names[0], dlerror());
        return;
    }
    struct { void **slot; const char *name; } fns[] = {
#define F(n) {(void **)&g_cl.n, "cl" #n}
        F(GetPlatformIDs), F(GetPlatformInfo), F(GetDeviceIDs), F(GetDeviceInfo), F(CreateContext),
        F(CreateCommandQueue), F(CreateBuffer), F(CreateProgramWithSource), F(BuildProgram),
        F(GetProgramBuildInfo), F(CreateKernel), F(SetKernelArg), F(EnqueueNDRangeKernel),
        F(EnqueueWriteBuffer), F(EnqueueReadBuffer), F(EnqueueReadBufferRect), F(Finish), F(Flush),
        F(GetEventProfilingInfo), F(RetainEvent), F(ReleaseEvent), F(ReleaseMemObject), F(ReleaseKernel), F(ReleaseProgram),
        F(ReleaseCommandQueue), F(ReleaseContext),
#undef F
    };
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
        *fns[i].slot = dlsym(h, fns[i].name);
        if (!*fns[i].slot) {
            snprintf(g_cl_error, sizeof g_cl_error, "%s has no %s (an OpenCL 1.2 loader is needed)", names[0],
                     fns[i].name);
            memset(&g_cl, 0, sizeof g_cl);
            return;
        }
    }
}

/* ---- kernels --------------------------------------------------------------------------- */

#define LWS 64          /* lanes per work-group: one output row */
#define TB 4            /* tokens per work-group (the kernels' tile; KERNEL_SRC says the same) */
#define T_MAX 32        /* tokens per dispatch; longer jobs are split */
#define N_STAGE 3       /* staging buffers: one computing, one being copied, one free to fill */
#define MAX_EVENTS 512  /* events kept for the timeline between two collections */
#define KEEP_ROWS 64    /* token rows of SwiGLU output kept on the device per glu call (decode: top-k) */
#define KEEP_MAX 64     /* kept outputs (one per glu job and T_MAX-token chunk) per call */

/* A kept SwiGLU output's host copies (the q8a rows and the float ones): */
enum {
    KEPT_DEVICE,    /* not written: only the device has it */
    KEPT_CONSUMED,  /* read from the device by a down projection; no host reader asked for it */
    KEPT_HOST,      /* read back (a reader asked, or one may) */
};

static const char *KERNEL_SRC =
    "#pragma OPENCL FP_CONTRACT OFF\n"
    "#define LWS 64\n"
    "#define TB 4\n"
    "typedef struct { float d; float s; char qs[32]; } q8a;\n"
    /* fp16 bits to float, exact for every value (subnormals included) */
    "inline float h2f(uint h) {\n"
    "  const uint s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;\n"
    "  if (e == 0) { const float f = (float)m * 5.9604644775390625e-8f; return s ? -f : f; }\n"
    "  if (e == 31) return as_float(s | 0x7f800000u | (m << 13));\n"
    "  return as_float(s | ((e + 112u) << 23) | (m << 13));\n"
    "}\n"
    "inline uint ld16(global const uchar *p) { return (uint)p[0] | ((uint)p[1] << 8); }\n"
    /* A work-group computes one output row for a tile of up to TB tokens: each lane takes every
     * LWS-th block of the row, decodes it once and meets all the tile's tokens with it (the
     * weight bytes come from memory once per tile), then the lanes' partial sums are added as
     * a tree. Per token, the sum order is the same whatever the tile. */
    "inline void finish(local float *red, const float *acc, int nt, global float *Y, int t0, int ldy, int r) {\n"
    "  const int l = get_local_id(0);\n"
    "  for (int k = 0; k < TB; k++) red[k * LWS + l] = acc[k];\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (int s = LWS / 2; s > 0; s >>= 1) {\n"
    "    if (l < s) for (int k = 0; k < TB; k++) red[k * LWS + l] += red[k * LWS + l + s];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  if (l == 0) for (int k = 0; k < nt; k++) Y[(size_t)(t0 + k) * ldy + r] = red[k * LWS];\n"
    "}\n"
    "#define HEAD(name) kernel void name(global const uchar *W, ulong w_off, ulong row_bytes, int n_cols, \\\n"
    "    global const float *X, global const q8a *XQ, global float *Y, int ldy, int n_tok, ulong xq_off) { \\\n"
    "  const int r = get_group_id(0), t0 = get_group_id(1) * TB, l = get_local_id(0), nb = n_cols / 32; \\\n"
    "  XQ += xq_off; \\\n"
    "  const int nt = min(TB, n_tok - t0); \\\n"
    "  global const uchar *row = W + w_off + (ulong)r * row_bytes; \\\n"
    "  local float red[TB * LWS]; float acc[TB]; for (int k = 0; k < TB; k++) acc[k] = 0.0f;\n"
    "#define TAIL finish(red, acc, nt, Y, t0, ldy, r); }\n"
    /* x of token k of the tile, element i; q8a block b of token k */
    "#define XF(k, i) X[(size_t)(t0 + (k)) * n_cols + (i)]\n"
    "#define XB(k, b) XQ[(size_t)(t0 + (k)) * nb + (b)]\n"
    "HEAD(mm_f32) global const float *w = (global const float *)row;\n"
    "  for (int i = l; i < n_cols; i += LWS) { const float v = w[i]; for (int k = 0; k < nt; k++) acc[k] += v * XF(k, i); }\n"
    "TAIL\n"
    "HEAD(mm_f16) global const ushort *w = (global const ushort *)row;\n"
    "  for (int i = l; i < n_cols; i += LWS) { const float v = h2f(w[i]); for (int k = 0; k < nt; k++) acc[k] += v * XF(k, i); }\n"
    "TAIL\n"
    "HEAD(mm_bf16) global const ushort *w = (global const ushort *)row;\n"
    "  for (int i = l; i < n_cols; i += LWS) { const float v = as_float((uint)w[i] << 16); for (int k = 0; k < nt; k++) acc[k] += v * XF(k, i); }\n"
    "TAIL\n"
    "HEAD(mm_q8_0)\n"
    "  for (int b = l; b < nb; b += LWS) {\n"
    "    global const uchar *bp = row + (size_t)b * 34; const float d = h2f(ld16(bp)); char q[32];\n"
    "    for (int i = 0; i < 32; i++) q[i] = ((global const char *)(bp + 2))[i];\n"
    "    for (int k = 0; k < nt; k++) {\n"
    "      global const q8a *x = &XB(k, b); int sumi = 0;\n"
    "      for (int i = 0; i < 32; i++) sumi += (int)q[i] * (int)x->qs[i];\n"
    "      acc[k] += d * x->d * (float)sumi;\n"
    "    }\n"
    "  }\n"
    "TAIL\n"
    "HEAD(mm_q4_0)\n"
    "  for (int b = l; b < nb; b += LWS) {\n"
    "    global const uchar *bp = row + (size_t)b * 18; const float d = h2f(ld16(bp)); char q[32];\n"
    "    for (int i = 0; i < 16; i++) { q[i] = (char)((bp[2 + i] & 15) - 8); q[i + 16] = (char)((bp[2 + i] >> 4) - 8); }\n"
    "    for (int k = 0; k < nt; k++) {\n"
    "      global const q8a *x = &XB(k, b); int sumi = 0;\n"
    "      for (int i = 0; i < 32; i++) sumi += (int)q[i] * (int)x->qs[i];\n"
    "      acc[k] += d * x->d * (float)sumi;\n"
    "    }\n"
    "  }\n"
    "TAIL\n"
    "HEAD(mm_q4_1)\n"
    "  for (int b = l; b < nb; b += LWS) {\n"
    "    global const uchar *bp = row + (size_t)b * 20; const float d = h2f(ld16(bp)), m = h2f(ld16(bp + 2)); uchar q[32];\n"
    "    for (int i = 0; i < 16; i++) { q[i] = bp[4 + i] & 15; q[i + 16] = bp[4 + i] >> 4; }\n"
    "    for (int k = 0; k < nt; k++) {\n"
    "      global const q8a *x = &XB(k, b); int sumi = 0;\n"
    "      for (int i = 0; i < 32; i++) sumi += (int)q[i] * (int)x->qs[i];\n"
    "      acc[k] += d * x->d * (float)sumi + m * x->s;\n"
    "    }\n"
    "  }\n"
    "TAIL\n"
    /* Q4_K: 144-byte super-blocks of 8 sub-blocks of 32; 6-bit scale and minimum per sub-block */
    "HEAD(mm_q4_k)\n"
    "  for (int b = l; b < nb; b += LWS) {\n"
    "    const int j = b & 7; global const uchar *bp = row + (size_t)(b >> 3) * 144, *sc = bp + 4;\n"
    "    global const uchar *qs = bp + 16 + 32 * (j >> 1);\n"
    "    int s, m;\n"
    "    if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }\n"
    "    else { s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4); m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }\n"
    "    const float d = h2f(ld16(bp)), dmin = h2f(ld16(bp + 2)); const int sh = 4 * (j & 1); uchar q[32];\n"
    "    for (int i = 0; i < 32; i++) q[i] = (qs[i] >> sh) & 15;\n"
    "    for (int k = 0; k < nt; k++) {\n"
    "      global const q8a *x = &XB(k, b); int dot = 0;\n"
    "      for (int i = 0; i < 32; i++) dot += (int)q[i] * (int)x->qs[i];\n"
    "      acc[k] += d * x->d * (float)(s * dot);\n"
    "      acc[k] -= dmin * (float)m * x->s;\n"
    "    }\n"
    "  }\n"
    "TAIL\n"
    /* Q6_K: 210-byte super-blocks, 16 sub-blocks of 16 with int8 scales */
    "HEAD(mm_q6_k)\n"
    "  for (int b = l; b < nb; b += LWS) {\n"
    "    const int j = b & 7, p = j >> 2, rr = j & 3; global const uchar *bp = row + (size_t)(b >> 3) * 210;\n"
    "    global const uchar *ql = bp + 64 * p + 32 * (rr & 1), *qh = bp + 128 + 32 * p;\n"
    "    global const char *sc = (global const char *)(bp + 192);\n"
    "    const int shl = 4 * (rr >> 1), shh = 2 * rr, s0 = sc[2 * j], s1 = sc[2 * j + 1];\n"
    "    const float d = h2f(ld16(bp + 208)); char q[32];\n"
    "    for (int i = 0; i < 32; i++) q[i] = (char)((((ql[i] >> shl) & 15) | (((qh[i] >> shh) & 3) << 4)) - 32);\n"
    "    for (int k = 0; k < nt; k++) {\n"
    "      global const q8a *x = &XB(k, b); int d0 = 0, d1 = 0;\n"
    "      for (int i = 0; i < 16; i++) { d0 += (int)q[i] * (int)x->qs[i]; d1 += (int)q[i + 16] * (int)x->qs[i + 16]; }\n"
    "      acc[k] += d * x->d * (float)(s0 * d0 + s1 * d1);\n"
    "    }\n"
    "  }\n"
    "TAIL\n"
    /* The formats the scalar reference handles with row_dot_kq (kernels_scalar.c): each 32-element
     * block of the row is unpacked to its quants in element order, the integer scale and minimum
     * of each 16-element half, and the block's float scale d and minimum scale dmin; per token
     *   acc += d * dx * (sc0 * dot0 + sc1 * dot1)          (an exact int32 sum)
     * and the minimum term in the scalar kernel's order: MIN_ADD (Q5_1) acc += dmin * s,
     * MIN_SUB (Q5_K) acc -= dmin * m * s, MIN_Q2K acc -= dmin * dx * (m0 * sum0 + m1 * sum1). */
    "constant char IQ4V[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};\n"
    "constant char MXV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};\n"
    "inline uint ld32(global const uchar *p) { return ld16(p) | (ld16(p + 2) << 16); }\n"
    "typedef struct { float d, dmin; int sc0, sc1, mn0, mn1; } kparm;\n"
    "inline kparm kp(float d, float dmin, int sc0, int sc1, int mn0, int mn1) {\n"
    "  kparm p; p.d = d; p.dmin = dmin; p.sc0 = sc0; p.sc1 = sc1; p.mn0 = mn0; p.mn1 = mn1; return p;\n"
    "}\n"
    "inline kparm un_q5_0(global const uchar *row, int b, char *q) {\n"
    "  global const uchar *bp = row + (size_t)b * 22, *qs = bp + 6; const uint h = ld32(bp + 2);\n"
    "  for (int i = 0; i < 16; i++) {\n"
    "    q[i] = (char)(((qs[i] & 15) | (((h >> i) & 1u) << 4)) - 16);\n"
    "    q[i + 16] = (char)(((qs[i] >> 4) | (((h >> (i + 16)) & 1u) << 4)) - 16);\n"
    "  }\n"
    "  return kp(h2f(ld16(bp)), 0.0f, 1, 1, 0, 0);\n"
    "}\n"
    "inline kparm un_q5_1(global const uchar *row, int b, char *q) {\n"
    "  global const uchar *bp = row + (size_t)b * 24, *qs = bp + 8; const uint h = ld32(bp + 4);\n"
    "  for (int i = 0; i < 16; i++) {\n"
    "    q[i] = (char)((qs[i] & 15) | (((h >> i) & 1u) << 4));\n"
    "    q[i + 16] = (char)((qs[i] >> 4) | (((h >> (i + 16)) & 1u) << 4));\n"
    "  }\n"
    "  return kp(h2f(ld16(bp)), h2f(ld16(bp + 2)), 1, 1, 0, 0);\n"
    "}\n"
    "inline kparm un_iq4_nl(global const uchar *row, int b, char *q) {\n"
    "  global const uchar *bp = row + (size_t)b * 18, *qs = bp + 2;\n"
    "  for (int i = 0; i < 16; i++) { q[i] = IQ4V[qs[i] & 15]; q[i + 16] = IQ4V[qs[i] >> 4]; }\n"
    "  return kp(h2f(ld16(bp)), 0.0f, 1, 1, 0, 0);\n"
    "}\n"
    /* E8M0 exponent e as 2^(e - 128) (the element table holds doubled values) */
    "inline kparm un_mxfp4(global const uchar *row, int b, char *q) {\n"
    "  global const uchar *bp = row + (size_t)b * 17, *qs = bp + 1; const uint e = bp[0];\n"
    "  for (int i = 0; i < 16; i++) { q[i] = MXV[qs[i] & 15]; q[i + 16] = MXV[qs[i] >> 4]; }\n"
    "  return kp(as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23), 0.0f, 1, 1, 0, 0);\n"
    "}\n"
    /* Q2_K, 84 bytes: scales[16], qs[64], d, dmin; sub-block j's element l is bits 2 (j % 4) of qs[32 (j / 4) + l] */
    "inline kparm un_q2_k(global const uchar *row, int b, char *q) {\n"
    "  const int j = b & 7; global const uchar *bp = row + (size_t)(b >> 3) * 84, *qs = bp + 16 + 32 * (j >> 2);\n"
    "  for (int l = 0; l < 32; l++) q[l] = (char)((qs[l] >> (2 * (j & 3))) & 3);\n"
    "  const uint s0 = bp[2 * j], s1 = bp[2 * j + 1];\n"
    "  return kp(h2f(ld16(bp + 80)), h2f(ld16(bp + 82)), s0 & 15, s1 & 15, s0 >> 4, s1 >> 4);\n"
    "}\n"
    /* Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (6-bit, offset 32), d */
    "inline int k3s(global const uchar *sc, int j) {\n"
    "  const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4, hi = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;\n"
    "  return (lo | (hi << 4)) - 32;\n"
    "}\n"
    "inline kparm un_q3_k(global const uchar *row, int b, char *q) {\n"
    "  const int j = b & 7; global const uchar *bp = row + (size_t)(b >> 3) * 110, *qs = bp + 32 + 32 * (j >> 2);\n"
    "  for (int l = 0; l < 32; l++) q[l] = (char)(((qs[l] >> (2 * (j & 3))) & 3) - (((bp[l] >> j) & 1) ? 0 : 4));\n"
    "  return kp(h2f(ld16(bp + 108)), 0.0f, k3s(bp + 96, 2 * j), k3s(bp + 96, 2 * j + 1), 0, 0);\n"
    "}\n"
    /* Q5_K, 176 bytes: d, dmin, scales[12] (as Q4_K), qh[32], qs[128] */
    "inline kparm un_q5_k(global const uchar *row, int b, char *q) {\n"
    "  const int j = b & 7; global const uchar *bp = row + (size_t)(b >> 3) * 176, *sc = bp + 4;\n"
    "  global const uchar *qh = bp + 16, *qs = bp + 48 + 32 * (j >> 1);\n"
    "  for (int l = 0; l < 32; l++) q[l] = (char)(((qs[l] >> (4 * (j & 1))) & 15) | (((qh[l] >> j) & 1) << 4));\n"
    "  int s, m;\n"
    "  if (j < 4) { s = sc[j] & 63; m = sc[j + 4] & 63; }\n"
    "  else { s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4); m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }\n"
    "  return kp(h2f(ld16(bp)), h2f(ld16(bp + 2)), s, s, m, m);\n"
    "}\n"
    /* IQ4_XS, 136 bytes: d, scales_h (2 bits each), scales_l[4] (4 bits each), qs[128]; offset 32 */
    "inline kparm un_iq4_xs(global const uchar *row, int b, char *q) {\n"
    "  const int j = b & 7; global const uchar *bp = row + (size_t)(b >> 3) * 136, *qs = bp + 8 + 16 * j;\n"
    "  for (int i = 0; i < 16; i++) { q[i] = IQ4V[qs[i] & 15]; q[i + 16] = IQ4V[qs[i] >> 4]; }\n"
    "  const int s = (((bp[4 + (j >> 1)] >> (4 * (j & 1))) & 15) | (((ld16(bp + 2) >> (2 * j)) & 3) << 4)) - 32;\n"
    "  return kp(h2f(ld16(bp)), 0.0f, s, s, 0, 0);\n"
    "}\n"
    "#define MIN_NONE 0\n"
    "#define MIN_ADD 1\n"
    "#define MIN_SUB 2\n"
    "#define MIN_Q2K 3\n"
    "#define KQ(name, unpack, mode) HEAD(name) \\\n"
    "  for (int b = l; b < nb; b += LWS) { \\\n"
    "    char q[32]; const kparm p = unpack(row, b, q); \\\n"
    "    for (int k = 0; k < nt; k++) { \\\n"
    "      global const q8a *x = &XB(k, b); int d0 = 0, d1 = 0, x0 = 0, x1 = 0; \\\n"
    "      for (int i = 0; i < 16; i++) { \\\n"
    "        d0 += (int)q[i] * (int)x->qs[i]; x0 += x->qs[i]; \\\n"
    "        d1 += (int)q[i + 16] * (int)x->qs[i + 16]; x1 += x->qs[i + 16]; \\\n"
    "      } \\\n"
    "      acc[k] += p.d * x->d * (float)(p.sc0 * d0 + p.sc1 * d1); \\\n"
    "      if (mode == MIN_ADD) acc[k] += p.dmin * x->s; \\\n"
    "      else if (mode == MIN_SUB) acc[k] -= p.dmin * (float)p.mn0 * x->s; \\\n"
    "      else if (mode == MIN_Q2K) acc[k] -= p.dmin * x->d * (float)(p.mn0 * x0 + p.mn1 * x1); \\\n"
    "    } \\\n"
    "  } \\\n"
    "  TAIL\n"
    "KQ(mm_q5_0, un_q5_0, MIN_NONE)\n"
    "KQ(mm_q5_1, un_q5_1, MIN_ADD)\n"
    "KQ(mm_iq4_nl, un_iq4_nl, MIN_NONE)\n"
    "KQ(mm_mxfp4, un_mxfp4, MIN_NONE)\n"
    "KQ(mm_q2_k, un_q2_k, MIN_Q2K)\n"
    "KQ(mm_q3_k, un_q3_k, MIN_NONE)\n"
    "KQ(mm_q5_k, un_q5_k, MIN_SUB)\n"
    "KQ(mm_iq4_xs, un_iq4_xs, MIN_NONE)\n"
    /* The activation of the expert FFN (ops.c's, in its order): optional biases added to the
     * gate and up rows (width F), then silu(g) * u, gpt-oss's clamped form or gelu_tanh(g) * u. */
    "#define ACT_SWIGLU 0\n"
    "#define ACT_SWIGLU_OAI 1\n"
    "#define ACT_GEGLU_TANH 2\n"
    "kernel void glu_act(global float *G, global const float *U, int n, int F, global const float *BG,\n"
    "    ulong bg_off, global const float *BU, ulong bu_off, int bias, int act, float alpha, float limit) {\n"
    "  const int i = get_global_id(0);\n"
    "  if (i >= n) return;\n"
    "  float g = G[i], u = U[i];\n"
    "  if (bias & 1) g += BG[bg_off + i % F];\n"
    "  if (bias & 2) u += BU[bu_off + i % F];\n"
    "  if (act == ACT_SWIGLU_OAI) {\n"
    "    const float v = fmin(g, limit), up = fmin(fmax(u, -limit), limit);\n"
    "    G[i] = (up + 1.0f) * (v / (1.0f + exp(-alpha * v)));\n"
    "  } else if (act == ACT_GEGLU_TANH) {\n"
    "    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));\n"
    "    G[i] = 0.5f * g * (1.0f + tanh(inner)) * u;\n"
    "  } else {\n"
    "    G[i] = g / (1.0f + exp(-g)) * u;\n"
    "  }\n"
    "}\n"
    /* block_q8a of 32 floats, as quantize_row_q8a: d = max|x| / 127, q = round(x / d); with keep_g
     * the float rows are copied to GK too (kept on the device with the quantized ones) */
    "kernel void quant_q8a(global const float *G, global q8a *Q, int n_blocks, ulong q_off, global float *GK,\n"
    "    int keep_g) {\n"
    "  const int b = get_global_id(0);\n"
    "  if (b >= n_blocks) return;\n"
    "  Q += q_off;\n"
    "  global const float *x = G + (size_t)b * 32;\n"
    "  float amax = 0.0f; for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(x[i]));\n"
    "  const float d = amax / 127.0f; int sum = 0;\n"
    "  for (int i = 0; i < 32; i++) { const int q = d != 0.0f ? (int)round(x[i] / d) : 0; Q[b].qs[i] = (char)q; sum += q; }\n"
    "  Q[b].d = d; Q[b].s = d * (float)sum;\n"
    "  if (keep_g) for (int i = 0; i < 32; i++) GK[(q_off + (ulong)b) * 32 + i] = x[i];\n"
    "}\n";

enum {
    K_F32, K_F16, K_BF16, K_Q8_0, K_Q4_0, K_Q4_1, K_Q4_K, K_Q6_K,
    K_Q5_0, K_Q5_1, K_IQ4_NL, K_MXFP4, K_Q2_K, K_Q3_K, K_Q5_K, K_IQ4_XS,
    K_GLU, K_QUANT, K_COUNT
};
static const char *KERNEL_NAMES[K_COUNT] = {
    "mm_f32",  "mm_f16",  "mm_bf16",   "mm_q8_0",  "mm_q4_0", "mm_q4_1", "mm_q4_k", "mm_q6_k",  "mm_q5_0",
    "mm_q5_1", "mm_iq4_nl", "mm_mxfp4", "mm_q2_k", "mm_q3_k", "mm_q5_k", "mm_iq4_xs", "glu_act", "quant_q8a"};

static int kernel_of(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return K_F32;
    case GGML_TYPE_F16: return K_F16;
    case GGML_TYPE_BF16: return K_BF16;
    case GGML_TYPE_Q8_0: return K_Q8_0;
    case GGML_TYPE_Q4_0: return K_Q4_0;
    case GGML_TYPE_Q4_1: return K_Q4_1;
    case GGML_TYPE_Q4_K: return K_Q4_K;
    case GGML_TYPE_Q6_K: return K_Q6_K;
    case GGML_TYPE_Q5_0: return K_Q5_0;
    case GGML_TYPE_Q5_1: return K_Q5_1;
    case GGML_TYPE_IQ4_NL: return K_IQ4_NL;
    case GGML_TYPE_MXFP4: return K_MXFP4;
    case GGML_TYPE_Q2_K: return K_Q2_K;
    case GGML_TYPE_Q3_K: return K_Q3_K;
    case GGML_TYPE_Q5_K: return K_Q5_K;
    case GGML_TYPE_IQ4_XS: return K_IQ4_XS;
    default: return -1;
    }
}

/* ---- the backend ------------------------------------------------------------------------ */

typedef struct resident_buf {
    const unsigned char *host;  /* [host, host + bytes) is on the device in mem */
    size_t bytes;
    cl_mem mem;
} resident_buf;

/* A staging buffer and what it holds: up to two matrices (an expert's gate and up, or its
 * down) copied from host pointers during generation `gen`. */
typedef struct stage_buf {
    cl_mem mem;
    const void *host[2];
    size_t off[2];
    int n;
    uint64_t gen;
    cl_event ready;     /* the copy (NULL: none pending) */
    cl_event last_use;  /* the last kernel that read it */
} stage_buf;

typedef struct timed_event {
    cl_event ev;
    int stage;  /* TL_STAGE or TL_COMPUTE */
} timed_event;

struct cb_buf {
    cl_mem mem;
    size_t bytes;
};

/* What the activation buffers (float, q8a) hold since the start of the call: jobs of one call that
 * share their input (q, k and v; gate and up) upload it once. */
typedef struct last_x {
    const void *host;
    size_t bytes;
} last_x;

typedef struct ocl_backend {
    const cb_backend *cpu;
    timeline *tl;
    cl_device_id dev;
    cl_context ctx;
    cl_command_queue q;      /* compute: activations in, kernels, results out (in order) */
    cl_command_queue qx;     /* transfer: streamed weights into staging buffers */
    cl_program prog;
    cl_kernel k[K_COUNT];
    int unified;             /* the device reads host memory directly */
    size_t max_alloc;
    char name[192];
    /* resident weights, sorted by host address */
    resident_buf *res;
    int n_res, cap_res;
    /* staging */
    stage_buf stage[N_STAGE];
    size_t stage_bytes;
    int stage_next;
    uint64_t gen;            /* bumped by every call: a staged copy is only reused within its call */
    /* activations and results, [T_MAX] tokens of the widest shapes */
    cl_mem xf, xq, y, g, u, gq;
    cl_mem gk;               /* the float SwiGLU rows of the kept outputs (block for block with gq's) */
    cl_mem bias;             /* a job's gate and up biases, [2][max_ff], when they are not resident */
    last_x lx[2];            /* [0] xf, [1] xq */
    size_t max_cols, max_rows, max_ff;
    /* the last glu call's q8a outputs kept in gq, blocks [0, keep_blocks); the rows after them
     * take the outputs that do not fit */
    struct {
        const void *host;    /* the host copy (the down projection's activations) */
        size_t bytes, off;   /* its size, and its offset in gq in blocks (in gk: off * 32 floats) */
        float *host_g;       /* the float rows' host copy, g_floats of them */
        size_t g_floats;
        int state;           /* KEPT_*: whether the host copies are written */
    } kept[KEEP_MAX];
    int n_kept;
    glu_job *last_glu;       /* that call's jobs, to redo them on the CPU when the kept rows are lost */
    int n_last_glu;          /* -1: the call had more jobs than fit (then nothing was kept) */
    size_t keep_blocks, keep_used;
    uint64_t keep_gen;       /* that call's generation: the kept outputs serve the call right after it */
    /* jobs handed to the CPU in the current call */
    mm_job *cpu_jobs;
    glu_job *cpu_glu;
    int max_jobs;
    /* timeline */
    timed_event evs[MAX_EVENTS];
    int n_evs;
    double clock_offset[TL_STAGES]; /* host seconds = device ns * 1e-9 + clock_offset[stage] */
    /* counters */
    uint64_t uploaded, staged, dev_jobs, cpu_jobs_n, errors;
    uint64_t reused;         /* activation bytes read from kept outputs instead of uploaded */
    uint64_t readback;       /* SwiGLU output bytes read back to the host (eagerly or on demand) */
    uint64_t buffer_bytes;   /* staging and activation buffers */
    int failed;
    char first_error[160];
    int fail_next;           /* fault injection: kernel enqueues that report an error */
} ocl_backend;

static colibri_status cl_fail(ocl_backend *b, const char *what, cl_int err) {
    b->errors++;
    if (!b->failed) snprintf(b->first_error, sizeof b->first_error, "%s failed (OpenCL error %d)", what, (int)err);
    b->failed = 1;
    return cb_error(COLIBRI_E_INTERNAL, "OpenCL: %s failed (error %d)", what, (int)err);
}

static void release_event(cl_event *e) {
    if (*e) g_cl.ReleaseEvent(*e);
    *e = NULL;
}

static void ocl_destroy(void *vctx) {
    ocl_backend *b = vctx;
    if (!b) return;
    if (b->q) g_cl.Finish(b->q);
    if (b->qx) g_cl.Finish(b->qx);
    for (int i = 0; i < b->n_evs; i++) g_cl.ReleaseEvent(b->evs[i].ev);
    for (int i = 0; i < N_STAGE; i++) {
        release_event(&b->stage[i].ready);
        release_event(&b->stage[i].last_use);
        if (b->stage[i].mem) g_cl.ReleaseMemObject(b->stage[i].mem);
    }
    for (int i = 0; i < b->n_res; i++) g_cl.ReleaseMemObject(b->res[i].mem);
    cl_mem bufs[] = {b->xf, b->xq, b->y, b->g, b->u, b->gq, b->gk, b->bias};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) g_cl.ReleaseMemObject(bufs[i]);
    for (int i = 0; i < K_COUNT; i++)
        if (b->k[i]) g_cl.ReleaseKernel(b->k[i]);
    if (b->prog) g_cl.ReleaseProgram(b->prog);
    if (b->qx) g_cl.ReleaseCommandQueue(b->qx);
    if (b->q) g_cl.ReleaseCommandQueue(b->q);
    if (b->ctx) g_cl.ReleaseContext(b->ctx);
    cb_free(b->res);
    cb_free(b->cpu_jobs);
    cb_free(b->cpu_glu);
    cb_free(b->last_glu);
    cb_free(b);
}

static colibri_status ocl_buf_alloc(void *vctx, size_t bytes, cb_buf **out) {
    ocl_backend *b = vctx;
    *out = NULL;
    cb_buf *r = cb_calloc(1, sizeof *r);
    if (!r) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    cl_int err;
    r->mem = g_cl.CreateBuffer(b->ctx, CL_MEM_READ_WRITE, bytes ? bytes : 1, NULL, &err);
    if (!r->mem || err != CL_SUCCESS) {
        cb_free(r);
        return cb_error(COLIBRI_E_NOMEM, "OpenCL: cannot allocate a device buffer of %zu bytes (error %d)", bytes,
                        (int)err);
    }
    r->bytes = bytes;
    *out = r;
    return COLIBRI_OK;
}

static void ocl_buf_free(void *vctx, cb_buf *r) {
    if (!r) return;
    g_cl.ReleaseMemObject(r->mem);
    cb_free(r);
}

static colibri_status ocl_upload(void *vctx, cb_buf *dst, size_t off, const void *src, size_t bytes) {
    ocl_backend *b = vctx;
    if (off > dst->bytes || bytes > dst->bytes - off)
        return cb_error(COLIBRI_E_INVALID_ARG, "upload of %zu bytes at %zu overruns a buffer of %zu", bytes, off,
                        dst->bytes);
    cl_int err = g_cl.EnqueueWriteBuffer(b->q, dst->mem, CL_TRUE, off, bytes, src, 0, NULL, NULL);
    if (err != CL_SUCCESS) return cl_fail(b, "clEnqueueWriteBuffer", err);
    b->uploaded += bytes;
    return COLIBRI_OK;
}

static colibri_status ocl_add_resident(void *vctx, const void *host, size_t bytes) {
    ocl_backend *b = vctx;
    if (bytes == 0) return COLIBRI_OK;
    /* a view inside a range already uploaded (a tied output head, say) needs nothing */
    for (int i = 0; i < b->n_res; i++)
        if ((const unsigned char *)host >= b->res[i].host &&
            (const unsigned char *)host + bytes <= b->res[i].host + b->res[i].bytes)
            return COLIBRI_OK;
    if (bytes > b->max_alloc) return COLIBRI_OK;  /* too big for one buffer: its jobs run on the CPU */
    if (b->n_res == b->cap_res) {
        const int cap = b->cap_res ? 2 * b->cap_res : 64;
        resident_buf *n = cb_malloc((size_t)cap * sizeof *n);
        if (!n) return cb_error(COLIBRI_E_NOMEM, "out of memory");
        if (b->n_res) memcpy(n, b->res, (size_t)b->n_res * sizeof *n);
        cb_free(b->res);
        b->res = n;
        b->cap_res = cap;
    }
    cl_int err;
    cl_mem mem;
    if (b->unified) {
        mem = g_cl.CreateBuffer(b->ctx, CL_MEM_READ_ONLY | CL_MEM_USE_HOST_PTR, bytes, (void *)host, &err);
    } else {
        mem = g_cl.CreateBuffer(b->ctx, CL_MEM_READ_ONLY, bytes, NULL, &err);
        if (mem && err == CL_SUCCESS) err = g_cl.EnqueueWriteBuffer(b->q, mem, CL_TRUE, 0, bytes, host, 0, NULL, NULL);
    }
    if (!mem || err != CL_SUCCESS) {
        if (mem) g_cl.ReleaseMemObject(mem);
        return cb_error(COLIBRI_E_NOMEM, "OpenCL: cannot upload %zu bytes of weights to %s (error %d)", bytes,
                        b->name, (int)err);
    }
    int at = b->n_res;
    while (at > 0 && b->res[at - 1].host > (const unsigned char *)host) {
        b->res[at] = b->res[at - 1];
        at--;
    }
    b->res[at] = (resident_buf){(const unsigned char *)host, bytes, mem};
    b->n_res++;
    b->uploaded += bytes;
    return COLIBRI_OK;
}

/* The resident buffer holding [p, p + bytes), and p's offset in it. */
static cl_mem find_resident(const ocl_backend *b, const void *p, size_t bytes, size_t *off) {
    const unsigned char *q = p;
    int lo = 0, hi = b->n_res - 1, at = -1;
    while (lo <= hi) {  /* last range starting at or below q */
        const int mid = (lo + hi) / 2;
        if (b->res[mid].host <= q) at = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    if (at < 0 || q + bytes > b->res[at].host + b->res[at].bytes) return NULL;
    *off = (size_t)(q - b->res[at].host);
    return b->res[at].mem;
}

static void note_event(ocl_backend *b, cl_event ev, int stage);

/* Copy n matrices (host pointers and sizes) into the next staging buffer, after the kernels
 * that read its previous contents. Returns its index, or -1 (then nothing was issued). */
static int stage_mats(ocl_backend *b, const void *const *host, const size_t *bytes, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (bytes[i] + 255) & ~(size_t)255;
    if (total > b->stage_bytes) return -1;
    const int k = b->stage_next;
    b->stage_next = (k + 1) % N_STAGE;
    stage_buf *s = &b->stage[k];
    release_event(&s->ready);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        cl_event wait = s->last_use, ev = NULL;
        cl_int err = g_cl.EnqueueWriteBuffer(b->qx, s->mem, CL_FALSE, off, bytes[i], host[i], wait ? 1 : 0,
                                             wait ? &wait : NULL, &ev);
        if (err != CL_SUCCESS) {
            s->n = 0;
            cl_fail(b, "staging copy", err);
            return -1;
        }
        s->host[i] = host[i];
        s->off[i] = off;
        off += (bytes[i] + 255) & ~(size_t)255;
        b->staged += bytes[i];
        release_event(&s->ready);  /* the in-order queue finishes copies in order: the last one will do */
        s->ready = ev;
        if (b->tl) {
            g_cl.RetainEvent(ev);
            note_event(b, ev, TL_STAGE);
        }
    }
    release_event(&s->last_use);
    s->n = n;
    s->gen = b->gen;
    g_cl.Flush(b->qx);
    return k;
}

/* Where matrix w is on the device: its buffer and offset, and the event to wait for (a
 * staging copy) or NULL. NULL buffer: not on the device (stage it or give it to the CPU). */
static cl_mem find_mat(ocl_backend *b, const mat *w, size_t *off, cl_event *wait, int *stage) {
    *wait = NULL;
    *stage = -1;
    cl_mem m = find_resident(b, w->data, (size_t)w->rows * w->row_bytes, off);
    if (m) return m;
    for (int k = 0; k < N_STAGE; k++) {
        const stage_buf *s = &b->stage[k];
        if (s->gen != b->gen) continue;
        for (int i = 0; i < s->n; i++)
            if (s->host[i] == w->data) {
                *off = s->off[i];
                *wait = s->ready;
                *stage = k;
                return s->mem;
            }
    }
    return NULL;
}

static void collect_timeline(ocl_backend *b);

/* Keep ev (one reference, now the list's) for the timeline; without one, let it go. */
static void note_event(ocl_backend *b, cl_event ev, int stage) {
    if (!ev) return;
    if (!b->tl) {
        g_cl.ReleaseEvent(ev);
        return;
    }
    if (b->n_evs == MAX_EVENTS) {  /* full: wait for what was issued and collect it */
        g_cl.Finish(b->qx);
        g_cl.Finish(b->q);
        collect_timeline(b);
    }
    b->evs[b->n_evs++] = (timed_event){ev, stage};
}

static cl_int set_mm_args(ocl_backend *b, cl_kernel k, cl_mem w, cl_ulong w_off, const mat *m, cl_mem xq,
                          cl_ulong xq_off, cl_mem y, int ldy, int nt) {
    const cl_ulong rb = m->row_bytes;
    const int cols = m->cols;
    cl_int e = g_cl.SetKernelArg(k, 0, sizeof w, &w);
    e |= g_cl.SetKernelArg(k, 1, sizeof w_off, &w_off);
    e |= g_cl.SetKernelArg(k, 2, sizeof rb, &rb);
    e |= g_cl.SetKernelArg(k, 3, sizeof cols, &cols);
    e |= g_cl.SetKernelArg(k, 4, sizeof b->xf, &b->xf);
    e |= g_cl.SetKernelArg(k, 5, sizeof xq, &xq);
    e |= g_cl.SetKernelArg(k, 6, sizeof y, &y);
    e |= g_cl.SetKernelArg(k, 7, sizeof ldy, &ldy);
    e |= g_cl.SetKernelArg(k, 8, sizeof nt, &nt);
    e |= g_cl.SetKernelArg(k, 9, sizeof xq_off, &xq_off);
    return e;
}

/* Tokens [t0, t0 + nt) of a job's activations on the device: *xqb at block *xqo holds the q8a
 * ones (a SwiGLU output the last glu call kept, or xq), xf the float ones. Uploaded unless
 * there already. */
static cl_int upload_x(ocl_backend *b, const mat *w, const float *x, const block_q8a *xq, int t0, int nt,
                       cl_mem *xqb, cl_ulong *xqo) {
    const int q = kernel_wants_q8a(w->type);
    const size_t nb = (size_t)w->cols / QK8A;
    const void *src = q ? (const void *)(xq + (size_t)t0 * nb) : (const void *)(x + (size_t)t0 * w->cols);
    const size_t bytes = q ? (size_t)nt * nb * sizeof(block_q8a) : (size_t)nt * w->cols * sizeof(float);
    *xqb = b->xq;
    *xqo = 0;
    if (q && b->keep_gen + 1 == b->gen)
        for (int i = 0; i < b->n_kept; i++)
            if (b->kept[i].host == src && b->kept[i].bytes == bytes) {
                *xqb = b->gq;
                *xqo = b->kept[i].off;
                b->reused += bytes;
                if (b->kept[i].state == KEPT_DEVICE) b->kept[i].state = KEPT_CONSUMED;
                return CL_SUCCESS;
            }
    last_x *l = &b->lx[q];
    if (l->host == src && l->bytes == bytes) return CL_SUCCESS;
    l->host = src;
    l->bytes = bytes;
    return g_cl.EnqueueWriteBuffer(b->q, q ? b->xq : b->xf, CL_FALSE, 0, bytes, src, 0, NULL, NULL);
}

/* y = W x on the device for tokens [t0, t0 + nt), into device buffer y (row stride ldy). */
static cl_int enqueue_mm(ocl_backend *b, const mat *w, cl_mem wm, size_t w_off, cl_mem xq, cl_ulong xq_off,
                         cl_event wait, cl_mem y, int ldy, int nt, cl_event *done) {
    if (b->fail_next > 0) {
        b->fail_next--;
        return -5; /* CL_OUT_OF_RESOURCES */
    }
    cl_kernel k = b->k[kernel_of(w->type)];
    cl_int err = set_mm_args(b, k, wm, (cl_ulong)w_off, w, xq, xq_off, y, ldy, nt);
    if (err != CL_SUCCESS) return err;
    const size_t gws[2] = {(size_t)w->rows * LWS, (size_t)(nt + TB - 1) / TB}, lws[2] = {LWS, 1};
    cl_event ev = NULL;
    err = g_cl.EnqueueNDRangeKernel(b->q, k, 2, NULL, gws, lws, wait ? 1 : 0, wait ? &wait : NULL,
                                    (b->tl || done) ? &ev : NULL);
    if (err != CL_SUCCESS) return err;
    if (ev && done) {  /* the caller's reference, and the timeline's */
        *done = ev;
        if (b->tl) g_cl.RetainEvent(ev);
        else return CL_SUCCESS;
    }
    note_event(b, ev, TL_COMPUTE);
    return CL_SUCCESS;
}

/* Where w lives on the device, staging it when it is not resident (alone: a down projection). */
static cl_mem place(ocl_backend *b, const mat *w, size_t *off, cl_event *wait, int *stage) {
    cl_mem m = find_mat(b, w, off, wait, stage);
    if (m) return m;
    const void *h[1] = {w->data};
    const size_t n[1] = {(size_t)w->rows * w->row_bytes};
    const int k = stage_mats(b, h, n, 1);
    if (k < 0) return NULL;
    return find_mat(b, w, off, wait, stage);
}

static void collect_timeline(ocl_backend *b) {
    for (int i = 0; i < b->n_evs; i++) {
        cl_ulong t0 = 0, t1 = 0;
        if (g_cl.GetEventProfilingInfo(b->evs[i].ev, CL_PROFILING_COMMAND_START, sizeof t0, &t0, NULL) == CL_SUCCESS &&
            g_cl.GetEventProfilingInfo(b->evs[i].ev, CL_PROFILING_COMMAND_END, sizeof t1, &t1, NULL) == CL_SUCCESS)
            timeline_add(b->tl, b->evs[i].stage, 1e-9 * (double)t0 + b->clock_offset[b->evs[i].stage],
                         1e-9 * (double)t1 + b->clock_offset[b->evs[i].stage]);
        g_cl.ReleaseEvent(b->evs[i].ev);
    }
    b->n_evs = 0;
}

/* After the device part of a call: wait for it, hand the timeline its intervals. */
static cl_int finish_call(ocl_backend *b) {
    cl_int e1 = g_cl.Finish(b->qx), e2 = g_cl.Finish(b->q);
    if (b->tl) collect_timeline(b);
    return e1 != CL_SUCCESS ? e1 : e2;
}

/* An expert with outlier corrections (outliers.h) stays on the CPU, which adds them. */
static int device_takes(const ocl_backend *b, const mat *w) {
    return !b->failed && w->data && !w->ol && kernel_of(w->type) >= 0 && w->rows > 0 && w->cols % QK8A == 0 &&
           (size_t)w->cols <= b->max_cols && (size_t)w->rows <= b->max_rows;
}

static cl_int device_matmul(ocl_backend *b, const mm_job *jb) {
    size_t off;
    cl_event wait;
    int stage;
    cl_mem wm = place(b, &jb->w, &off, &wait, &stage);
    if (!wm) return 1;  /* cannot place it: the CPU takes it (not an error) */
    const int rows = jb->w.rows;
    for (int t0 = 0; t0 < jb->n_tok; t0 += T_MAX) {
        const int nt = jb->n_tok - t0 < T_MAX ? jb->n_tok - t0 : T_MAX;
        cl_mem xqb;
        cl_ulong xqo;
        cl_int err = upload_x(b, &jb->w, jb->x, jb->xq, t0, nt, &xqb, &xqo);
        cl_event done = NULL;
        if (err == CL_SUCCESS)
            err = enqueue_mm(b, &jb->w, wm, off, xqb, xqo, wait, b->y, rows, nt, stage >= 0 ? &done : NULL);
        if (err != CL_SUCCESS) return err;
        if (stage >= 0) {
            release_event(&b->stage[stage].last_use);
            b->stage[stage].last_use = done;
        }
        const size_t bo[3] = {0, 0, 0}, ho[3] = {0, 0, 0};
        const size_t region[3] = {(size_t)rows * sizeof(float), (size_t)nt, 1};
        err = g_cl.EnqueueReadBufferRect(b->q, b->y, CL_FALSE, bo, ho, region, (size_t)rows * sizeof(float), 0,
                                         (size_t)jb->ldy * sizeof(float), 0, jb->y + (size_t)t0 * jb->ldy, 0, NULL,
                                         NULL);
        if (err != CL_SUCCESS) return err;
    }
    b->dev_jobs++;
    return CL_SUCCESS;
}

/* ---- the SwiGLU outputs kept on the device, and their host copies ------------------------ */

/* Enqueue the reads of kept output i's host copies (q8a and float rows). */
static cl_int fetch_kept(ocl_backend *b, int i) {
    const size_t off = b->kept[i].off;
    cl_int err = g_cl.EnqueueReadBuffer(b->q, b->gq, CL_FALSE, off * sizeof(block_q8a), b->kept[i].bytes,
                                        (void *)b->kept[i].host, 0, NULL, NULL);
    if (err == CL_SUCCESS)
        err = g_cl.EnqueueReadBuffer(b->q, b->gk, CL_FALSE, off * QK8A * sizeof(float),
                                     b->kept[i].g_floats * sizeof(float), b->kept[i].host_g, 0, NULL, NULL);
    if (err != CL_SUCCESS) return err;
    b->kept[i].state = KEPT_HOST;
    b->readback += b->kept[i].bytes + b->kept[i].g_floats * sizeof(float);
    return CL_SUCCESS;
}

/* The host copies could not be read back (a device error): the last glu call's jobs are redone
 * on the CPU, which writes them (the inputs, weights and slots of those jobs are still in place:
 * the down projections that read their outputs have not run on the host yet). Unless forced (a
 * read that may not have completed), only when some host copy was never read back. */
static void redo_glu_on_cpu(ocl_backend *b, int force) {
    int lost = force;
    for (int i = 0; i < b->n_kept; i++) lost |= b->kept[i].state != KEPT_HOST;
    if (lost && b->n_last_glu > 0) b->cpu->ops->glu(b->cpu->ctx, b->last_glu, b->n_last_glu);
    for (int i = 0; i < b->n_kept; i++) b->kept[i].state = KEPT_HOST;
}

/* Every kept output's host copy written, when no other call came since the glu call that made
 * them (a host reader asked: host_copies, sync, or the next glu call, which reuses gq). */
static void settle_kept(ocl_backend *b) {
    if (b->keep_gen != b->gen) return;
    if (b->failed) {  /* a device error since that call: its outputs are not read from it */
        redo_glu_on_cpu(b, 0);
        return;
    }
    cl_int err = CL_SUCCESS;
    for (int i = 0; i < b->n_kept && err == CL_SUCCESS; i++)
        if (b->kept[i].state != KEPT_HOST) err = fetch_kept(b, i);
    if (err == CL_SUCCESS) err = g_cl.Finish(b->q);
    if (err != CL_SUCCESS) {
        cl_fail(b, "a SwiGLU readback", err);
        redo_glu_on_cpu(b, 1);
    }
}

static void ocl_host_copies(void *vctx) { settle_kept(vctx); }

static int job_reads(const mm_job *jb, const void *p, size_t bytes) {
    const char *a = p, *e = a + bytes;
    const char *x = (const char *)jb->x, *q = (const char *)jb->xq;
    const size_t xb = (size_t)jb->n_tok * jb->w.cols * sizeof(float);
    const size_t qb = (size_t)jb->n_tok * (jb->w.cols / QK8A) * sizeof(block_q8a);
    return (x && x < e && a < x + xb) || (q && q < e && a < q + qb);
}

/* In the matmul call right after a glu call: the kept outputs a CPU job reads, or that no device
 * job consumed, are read back. Returns whether any read was enqueued. */
static int fetch_for_host(ocl_backend *b, const mm_job *cpu_jobs, int n_cpu, cl_int *err) {
    int any = 0;
    for (int i = 0; i < b->n_kept && *err == CL_SUCCESS; i++) {
        int need = b->kept[i].state == KEPT_DEVICE;
        for (int j = 0; j < n_cpu && !need && b->kept[i].state != KEPT_HOST; j++)
            need = job_reads(&cpu_jobs[j], b->kept[i].host, b->kept[i].bytes) ||
                   job_reads(&cpu_jobs[j], b->kept[i].host_g, b->kept[i].g_floats * sizeof(float));
        if (need) {
            *err = fetch_kept(b, i);
            any = 1;
        }
    }
    return any;
}

static void ocl_matmul(void *vctx, const mm_job *jobs, int n_jobs) {
    ocl_backend *b = vctx;
    b->gen++;  /* staged copies are valid within one call: the slots may change between calls */
    memset(b->lx, 0, sizeof b->lx);  /* and the host's activations too */
    const int after_glu = b->keep_gen + 1 == b->gen && b->n_kept > 0;
    if (after_glu && b->failed) redo_glu_on_cpu(b, 0);  /* failed since the glu call: every job to the CPU */
    int n_cpu = 0;
    cl_int err = CL_SUCCESS;
    for (int j = 0; j < n_jobs; j++) {
        const mm_job *jb = &jobs[j];
        cl_int r = 1;
        if (err == CL_SUCCESS && device_takes(b, &jb->w)) r = device_matmul(b, jb);
        if (r == 1) {
            if (n_cpu < b->max_jobs) {
                b->cpu_jobs[n_cpu++] = *jb;
            } else {  /* no room in the list: now, after the host copies it reads */
                if (after_glu && err == CL_SUCCESS && fetch_for_host(b, jb, 1, &err) && err == CL_SUCCESS)
                    err = g_cl.Finish(b->q);
                if (err == CL_SUCCESS) b->cpu->ops->matmul(b->cpu->ctx, jb, 1);
            }
        } else if (r != CL_SUCCESS) {
            err = r;
        }
    }
    /* the host copies the CPU's share reads are there before it runs (the device's products go on) */
    if (after_glu && err == CL_SUCCESS && fetch_for_host(b, b->cpu_jobs, n_cpu, &err) && n_cpu &&
        err == CL_SUCCESS)
        err = g_cl.Finish(b->q);
    /* the CPU's share runs while the device works on its own */
    if (n_cpu && err == CL_SUCCESS) b->cpu->ops->matmul(b->cpu->ctx, b->cpu_jobs, n_cpu);
    b->cpu_jobs_n += (uint64_t)n_cpu;
    cl_int fe = finish_call(b);
    if (err == CL_SUCCESS) err = fe;
    if (err != CL_SUCCESS) {
        cl_fail(b, "a matrix product", err);
        if (after_glu) redo_glu_on_cpu(b, 1);  /* the activations these jobs read, on the host */
        b->cpu->ops->matmul(b->cpu->ctx, jobs, n_jobs);  /* every output rewritten on the CPU */
    }
    if (after_glu) b->n_kept = 0;
}

static int glu_on_device(const ocl_backend *b, const glu_job *jb) {
    return device_takes(b, &jb->gate) && device_takes(b, &jb->up) && jb->gate.rows == jb->up.rows &&
           jb->gate.cols == jb->up.cols &&
           (jb->act == FFN_SWIGLU || jb->act == FFN_SWIGLU_OAI || jb->act == FFN_GEGLU_TANH) &&
           (size_t)jb->gate.rows <= b->max_ff && jb->gate.rows % QK8A == 0;
}

/* A bias row of F floats on the device: inside the resident weights, else copied into the bias
 * buffer's half `half` (the queue is in order: the previous job's kernel has read it by then). */
static cl_int place_bias(ocl_backend *b, const float *h, int F, int half, cl_mem *mem, cl_ulong *off_floats) {
    size_t off;
    *mem = b->bias;
    *off_floats = (cl_ulong)half * b->max_ff;
    if (!h) return CL_SUCCESS;
    cl_mem r = find_resident(b, h, (size_t)F * sizeof(float), &off);
    if (r && off % sizeof(float) == 0) {
        *mem = r;
        *off_floats = off / sizeof(float);
        return CL_SUCCESS;
    }
    return g_cl.EnqueueWriteBuffer(b->q, b->bias, CL_FALSE, (size_t)*off_floats * sizeof(float),
                                   (size_t)F * sizeof(float), h, 0, NULL, NULL);
}

static cl_int enqueue_act(ocl_backend *b, const glu_job *jb, int n, cl_mem bg, cl_ulong bgo, cl_mem bu, cl_ulong buo) {
    const int F = jb->gate.rows, bias = (jb->bg ? 1 : 0) | (jb->bu ? 2 : 0), act = jb->act;
    const float alpha = jb->alpha, limit = jb->limit;
    cl_kernel k = b->k[K_GLU];
    cl_int err = g_cl.SetKernelArg(k, 0, sizeof b->g, &b->g);
    err |= g_cl.SetKernelArg(k, 1, sizeof b->u, &b->u);
    err |= g_cl.SetKernelArg(k, 2, sizeof n, &n);
    err |= g_cl.SetKernelArg(k, 3, sizeof F, &F);
    err |= g_cl.SetKernelArg(k, 4, sizeof bg, &bg);
    err |= g_cl.SetKernelArg(k, 5, sizeof bgo, &bgo);
    err |= g_cl.SetKernelArg(k, 6, sizeof bu, &bu);
    err |= g_cl.SetKernelArg(k, 7, sizeof buo, &buo);
    err |= g_cl.SetKernelArg(k, 8, sizeof bias, &bias);
    err |= g_cl.SetKernelArg(k, 9, sizeof act, &act);  /* FFN_* and the kernel's ACT_* agree */
    err |= g_cl.SetKernelArg(k, 10, sizeof alpha, &alpha);
    err |= g_cl.SetKernelArg(k, 11, sizeof limit, &limit);
    const size_t gws = ((size_t)n + LWS - 1) / LWS * LWS, lws = LWS;
    cl_event ev = NULL;
    if (err == CL_SUCCESS) err = g_cl.EnqueueNDRangeKernel(b->q, k, 1, NULL, &gws, &lws, 0, NULL, b->tl ? &ev : NULL);
    if (err == CL_SUCCESS) note_event(b, ev, TL_COMPUTE);
    return err;
}

/* The q8a rows of tokens [t0, t0 + nt) of a glu job's output: kept on the device for the down
 * projection where there is room (their host copies written only when a reader asks), else
 * quantized into the rows after the kept ones and read back now. */
static cl_int enqueue_quant(ocl_backend *b, const glu_job *jb, int t0, int nt) {
    const int F = jb->gate.rows, n = nt * F, nblk = n / QK8A;
    block_q8a *hq = jb->actq + (size_t)t0 * F / QK8A;
    cl_ulong qoff = b->keep_blocks;
    int keep = 0;
    if (b->n_last_glu >= 0 && b->n_kept < KEEP_MAX && b->keep_used + (size_t)nblk <= b->keep_blocks) {
        qoff = b->keep_used;
        b->kept[b->n_kept].host = hq;
        b->kept[b->n_kept].bytes = (size_t)nblk * sizeof(block_q8a);
        b->kept[b->n_kept].off = b->keep_used;
        b->kept[b->n_kept].host_g = jb->g + (size_t)t0 * F;
        b->kept[b->n_kept].g_floats = (size_t)n;
        b->kept[b->n_kept].state = KEPT_DEVICE;
        b->n_kept++;
        b->keep_used += (size_t)nblk;
        keep = 1;
    }
    cl_kernel k = b->k[K_QUANT];
    cl_int err = g_cl.SetKernelArg(k, 0, sizeof b->g, &b->g);
    err |= g_cl.SetKernelArg(k, 1, sizeof b->gq, &b->gq);
    err |= g_cl.SetKernelArg(k, 2, sizeof nblk, &nblk);
    err |= g_cl.SetKernelArg(k, 3, sizeof qoff, &qoff);
    err |= g_cl.SetKernelArg(k, 4, sizeof b->gk, &b->gk);
    err |= g_cl.SetKernelArg(k, 5, sizeof keep, &keep);
    const size_t gws = ((size_t)nblk + LWS - 1) / LWS * LWS, lws = LWS;
    cl_event ev = NULL;
    if (err == CL_SUCCESS) err = g_cl.EnqueueNDRangeKernel(b->q, k, 1, NULL, &gws, &lws, 0, NULL, b->tl ? &ev : NULL);
    if (err != CL_SUCCESS) return err;
    note_event(b, ev, TL_COMPUTE);
    if (keep) return CL_SUCCESS;
    err = g_cl.EnqueueReadBuffer(b->q, b->gq, CL_FALSE, (size_t)qoff * sizeof(block_q8a),
                                 (size_t)nblk * sizeof(block_q8a), hq, 0, NULL, NULL);
    if (err == CL_SUCCESS)
        err = g_cl.EnqueueReadBuffer(b->q, b->g, CL_FALSE, 0, (size_t)n * sizeof(float), jb->g + (size_t)t0 * F, 0,
                                     NULL, NULL);
    b->readback += (size_t)nblk * sizeof(block_q8a) + (size_t)n * sizeof(float);
    return err;
}

static cl_int device_glu(ocl_backend *b, const glu_job *jb) {
    size_t og, ou;
    cl_event wg, wu;
    int sg, su;
    cl_mem mg = find_mat(b, &jb->gate, &og, &wg, &sg), mu = find_mat(b, &jb->up, &ou, &wu, &su);
    if (!mg || !mu) {  /* a streamed expert: gate and up into one staging buffer */
        const void *h[2] = {jb->gate.data, jb->up.data};
        const size_t n[2] = {(size_t)jb->gate.rows * jb->gate.row_bytes, (size_t)jb->up.rows * jb->up.row_bytes};
        if (stage_mats(b, h, n, 2) < 0) return 1;
        mg = find_mat(b, &jb->gate, &og, &wg, &sg);
        mu = find_mat(b, &jb->up, &ou, &wu, &su);
        if (!mg || !mu) return 1;
    }
    const int F = jb->gate.rows;
    cl_mem bg, bu;
    cl_ulong bgo, buo;
    cl_int err = place_bias(b, jb->bg, F, 0, &bg, &bgo);
    if (err == CL_SUCCESS) err = place_bias(b, jb->bu, F, 1, &bu, &buo);
    if (err != CL_SUCCESS) return err;
    for (int t0 = 0; t0 < jb->n_tok; t0 += T_MAX) {
        const int nt = jb->n_tok - t0 < T_MAX ? jb->n_tok - t0 : T_MAX;
        cl_mem xqb;
        cl_ulong xqo;
        err = upload_x(b, &jb->gate, jb->x, jb->xq, t0, nt, &xqb, &xqo);
        if (err == CL_SUCCESS) err = upload_x(b, &jb->up, jb->x, jb->xq, t0, nt, &xqb, &xqo);
        cl_event dg = NULL, du = NULL;
        if (err == CL_SUCCESS)
            err = enqueue_mm(b, &jb->gate, mg, og, xqb, xqo, wg, b->g, F, nt, sg >= 0 ? &dg : NULL);
        if (err == CL_SUCCESS)
            err = enqueue_mm(b, &jb->up, mu, ou, xqb, xqo, wu, b->u, F, nt, su >= 0 ? &du : NULL);
        /* a staging buffer is free again after the last kernel that reads it: up's, when it
         * holds both (the queue runs in order) */
        if (dg) {
            release_event(&b->stage[sg].last_use);
            b->stage[sg].last_use = dg;
        }
        if (du) {
            release_event(&b->stage[su].last_use);
            b->stage[su].last_use = du;
        }
        if (err == CL_SUCCESS) err = enqueue_act(b, jb, nt * F, bg, bgo, bu, buo);
        if (err != CL_SUCCESS) return err;
        if (jb->actq) {
            err = enqueue_quant(b, jb, t0, nt);
        } else {  /* float down weights: they take their activations from the host */
            err = g_cl.EnqueueReadBuffer(b->q, b->g, CL_FALSE, 0, (size_t)nt * F * sizeof(float),
                                         jb->g + (size_t)t0 * F, 0, NULL, NULL);
            b->readback += (size_t)nt * F * sizeof(float);
        }
        if (err != CL_SUCCESS) return err;
    }
    b->dev_jobs += 2;
    return CL_SUCCESS;
}

static void ocl_glu(void *vctx, const glu_job *jobs, int n_jobs) {
    ocl_backend *b = vctx;
    settle_kept(b);  /* the last glu call's outputs, if no matmul call read them: gq is reused now */
    b->gen++;
    memset(b->lx, 0, sizeof b->lx);
    b->n_kept = 0;
    b->keep_used = 0;
    b->keep_gen = b->gen;
    /* kept outputs need the jobs to redo them on the CPU if the device fails before they are read */
    b->n_last_glu = n_jobs <= b->max_jobs ? n_jobs : -1;
    if (b->n_last_glu > 0) memcpy(b->last_glu, jobs, (size_t)n_jobs * sizeof *jobs);
    int n_cpu = 0;
    cl_int err = CL_SUCCESS;
    for (int j = 0; j < n_jobs; j++) {
        const glu_job *jb = &jobs[j];
        cl_int r = 1;
        if (err == CL_SUCCESS && glu_on_device(b, jb)) r = device_glu(b, jb);
        if (r == 1) {
            if (n_cpu < b->max_jobs) b->cpu_glu[n_cpu++] = *jb;
            else b->cpu->ops->glu(b->cpu->ctx, jb, 1);
        } else if (r != CL_SUCCESS) {
            err = r;
        }
    }
    if (n_cpu) b->cpu->ops->glu(b->cpu->ctx, b->cpu_glu, n_cpu);
    b->cpu_jobs_n += 2 * (uint64_t)n_cpu;
    cl_int fe = finish_call(b);
    if (err == CL_SUCCESS) err = fe;
    if (err != CL_SUCCESS) {
        cl_fail(b, "an expert FFN", err);
        b->n_kept = 0;  /* the device's outputs are not to be trusted: the CPU's host copy is */
        b->cpu->ops->glu(b->cpu->ctx, jobs, n_jobs);
    }
}

static colibri_status ocl_sync(void *vctx) {
    ocl_backend *b = vctx;
    settle_kept(b);
    cl_int e = finish_call(b);
    if (e != CL_SUCCESS) return cl_fail(b, "clFinish", e);
    if (b->failed) return cb_error(COLIBRI_E_INTERNAL, "OpenCL: %s; the work was redone on the CPU", b->first_error);
    return COLIBRI_OK;
}

static void ocl_fill_stats(void *vctx, colibri_stats *out) {
    const ocl_backend *b = vctx;
    out->backend = COLIBRI_BACKEND_OPENCL;
    out->device_uploaded_bytes = b->uploaded;
    out->device_staged_bytes = b->staged;
    out->device_jobs = b->dev_jobs;
    out->device_cpu_jobs = b->cpu_jobs_n;
    out->device_errors = b->errors;
    out->device_buffer_bytes = b->buffer_bytes;
    out->device_readback_bytes = b->readback;
}


static const char *ocl_device_name(void *vctx) { return ((const ocl_backend *)vctx)->name; }

static const cb_backend_ops OCL_OPS = {
    .name = "opencl",
    .destroy = ocl_destroy,
    .buf_alloc = ocl_buf_alloc,
    .buf_free = ocl_buf_free,
    .upload = ocl_upload,
    .add_resident = ocl_add_resident,
    .matmul = ocl_matmul,
    .glu = ocl_glu,
    .host_copies = ocl_host_copies,
    .sync = ocl_sync,
    .fill_stats = ocl_fill_stats,
    .device_name = ocl_device_name,
};

/* ---- creation --------------------------------------------------------------------------- */

/* The first GPU of any platform, else the first accelerator, else the first device. */
static colibri_status pick_device(cl_device_id *dev, cl_platform_id *plat) {
    cl_platform_id ps[16];
    cl_uint np = 0;
    cl_int err = g_cl.GetPlatformIDs(16, ps, &np);
    if (err != CL_SUCCESS || np == 0)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "OpenCL: no platform found (clGetPlatformIDs: error %d, %u platforms): install a driver "
                        "(an ICD such as pocl-opencl-icd, or the GPU vendor's)",
                        (int)err, (unsigned)np);
    if (np > 16) np = 16;
    const cl_bitfield order[3] = {CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ACCELERATOR, CL_DEVICE_TYPE_ALL};
    for (int o = 0; o < 3; o++)
        for (cl_uint p = 0; p < np; p++) {
            cl_uint nd = 0;
            if (g_cl.GetDeviceIDs(ps[p], order[o], 1, dev, &nd) == CL_SUCCESS && nd > 0) {
                *plat = ps[p];
                return COLIBRI_OK;
            }
        }
    return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: %u platform(s) but no device", (unsigned)np);
}

static colibri_status build_program(ocl_backend *b) {
    cl_int err;
    b->prog = g_cl.CreateProgramWithSource(b->ctx, 1, &KERNEL_SRC, NULL, &err);
    if (!b->prog || err != CL_SUCCESS) return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: cannot create the program (error %d)", (int)err);
    /* correctly rounded division keeps the q8a quantization equal to the CPU's */
    err = g_cl.BuildProgram(b->prog, 1, &b->dev, "-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt", NULL, NULL);
    if (err != CL_SUCCESS) err = g_cl.BuildProgram(b->prog, 1, &b->dev, "-cl-std=CL1.2", NULL, NULL);
    if (err != CL_SUCCESS) {
        char log[512] = "";
        g_cl.GetProgramBuildInfo(b->prog, b->dev, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
        log[sizeof log - 1] = 0;
        return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: the kernels do not build for %s (error %d): %.400s", b->name,
                        (int)err, log);
    }
    for (int i = 0; i < K_COUNT; i++) {
        b->k[i] = g_cl.CreateKernel(b->prog, KERNEL_NAMES[i], &err);
        if (!b->k[i] || err != CL_SUCCESS)
            return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: no kernel %s (error %d)", KERNEL_NAMES[i], (int)err);
    }
    return COLIBRI_OK;
}

static cl_mem new_buf(ocl_backend *b, size_t bytes, colibri_status *st) {
    if (*st) return NULL;
    cl_int err;
    cl_mem m = g_cl.CreateBuffer(b->ctx, CL_MEM_READ_WRITE, bytes ? bytes : 16, NULL, &err);
    if (!m || err != CL_SUCCESS) {
        *st = cb_error(COLIBRI_E_NOMEM, "OpenCL: cannot allocate %zu bytes on %s (error %d)", bytes, b->name, (int)err);
        return NULL;
    }
    b->buffer_bytes += bytes;
    return m;
}

/* Device time to host time, per stage (drivers stamp copies and kernels differently: PoCL's copy
 * stamps run about 8 ms apart from its kernel stamps): a small command of the stage's kind (a
 * 4-byte copy on the transfer queue, a one-group kernel on the compute queue), enqueued and
 * finished between two host clock reads, its profiled midpoint against theirs; of five tries, the
 * one with the tightest host window (the first commands on a queue also pay for its start). */
static void calibrate_stage(ocl_backend *b, int stage) {
    double best = 1e30;
    for (int i = 0; i < 5; i++) {
        float one = 0.0f;
        int n = 1;
        cl_event ev = NULL;
        const double h0 = timeline_now();
        cl_int err;
        if (stage == TL_STAGE) {
            err = g_cl.EnqueueWriteBuffer(b->qx, b->y, CL_FALSE, 0, sizeof one, &one, 0, NULL, &ev);
            if (err == CL_SUCCESS) err = g_cl.Finish(b->qx);
        } else {
            const size_t gws = LWS, lws = LWS;
            const int zero = 0;
            const cl_ulong off0 = 0;
            const float f0 = 0.0f;
            cl_kernel k = b->k[K_GLU];
            err = g_cl.SetKernelArg(k, 0, sizeof b->g, &b->g);
            err |= g_cl.SetKernelArg(k, 1, sizeof b->u, &b->u);
            err |= g_cl.SetKernelArg(k, 2, sizeof n, &n);
            err |= g_cl.SetKernelArg(k, 3, sizeof n, &n);
            err |= g_cl.SetKernelArg(k, 4, sizeof b->bias, &b->bias);
            err |= g_cl.SetKernelArg(k, 5, sizeof off0, &off0);
            err |= g_cl.SetKernelArg(k, 6, sizeof b->bias, &b->bias);
            err |= g_cl.SetKernelArg(k, 7, sizeof off0, &off0);
            for (int a = 8; a < 10; a++) err |= g_cl.SetKernelArg(k, (cl_uint)a, sizeof zero, &zero);
            for (int a = 10; a < 12; a++) err |= g_cl.SetKernelArg(k, (cl_uint)a, sizeof f0, &f0);
            if (err == CL_SUCCESS) err = g_cl.EnqueueNDRangeKernel(b->q, k, 1, NULL, &gws, &lws, 0, NULL, &ev);
            if (err == CL_SUCCESS) err = g_cl.Finish(b->q);
        }
        const double h1 = timeline_now();
        cl_ulong t0 = 0, t1 = 0;
        if (err == CL_SUCCESS && h1 - h0 < best &&
            g_cl.GetEventProfilingInfo(ev, CL_PROFILING_COMMAND_START, sizeof t0, &t0, NULL) == CL_SUCCESS &&
            g_cl.GetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof t1, &t1, NULL) == CL_SUCCESS) {
            best = h1 - h0;
            b->clock_offset[stage] = 0.5 * (h0 + h1) - 0.5e-9 * ((double)t0 + (double)t1);
        }
        if (ev) g_cl.ReleaseEvent(ev);
    }
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* The device buffers' shapes for model m, jobs of up to max_tok tokens: one place for
 * backend_opencl_create and the memory plan (backend_opencl_buffer_bytes). */
typedef struct ocl_sizes {
    size_t max_ff, max_cols, max_rows;  /* widest expert/FFN hidden size, matrix input, matrix output */
    size_t xf, xq, y, g, u, gq;         /* activation and result buffers, bytes: T_MAX tokens at most
                                         * (gq: KEEP_ROWS kept rows, then T_MAX more) */
    size_t gk, bias;                    /* the kept rows as floats; a gate and an up bias row */
    size_t keep_blocks;                 /* gq's kept rows, in blocks */
    size_t stage;                       /* one staging buffer: an expert's gate + up, or its down */
} ocl_sizes;

static void ocl_sizes_of(const struct colibri_model *m, int max_tok, ocl_sizes *s) {
    const model_hparams *hp = &m->hp;
    const size_t E = (size_t)hp->n_embd, qd = (size_t)hp->n_head * hp->head_dim,
                 kvd = (size_t)hp->n_head_kv * hp->head_dim;
    s->max_ff = max3((size_t)hp->n_ff, (size_t)hp->n_ff_exp, (size_t)hp->n_ff_shexp);
    s->max_cols = max3(E, qd, s->max_ff);
    s->max_rows = max3(max3((size_t)hp->n_vocab, qd, kvd), max3(E, s->max_ff, (size_t)hp->n_expert), qd + 2 * kvd);
    const size_t T = (size_t)(max_tok < 1 ? 1 : max_tok < T_MAX ? max_tok : T_MAX);
    s->xf = T * s->max_cols * sizeof(float);
    s->xq = T * (s->max_cols / QK8A + 1) * sizeof(block_q8a);
    s->y = T * s->max_rows * sizeof(float);
    s->g = T * s->max_ff * sizeof(float);
    s->u = s->g;
    s->keep_blocks = (size_t)KEEP_ROWS * (s->max_ff / QK8A + 1);
    s->gq = s->keep_blocks * sizeof(block_q8a) + T * (s->max_ff / QK8A + 1) * sizeof(block_q8a);
    s->gk = s->keep_blocks * QK8A * sizeof(float);
    s->bias = 2 * s->max_ff * sizeof(float);
    /* each matrix 256-byte aligned in the buffer (stage_mats) */
    s->stage = 0;
    for (int l = 0; l < hp->n_layer && hp->n_expert > 0; l++) {
        const layer_weights *w = &m->layers[l];
        const size_t gu = ((w->gate_exps.expert_bytes + 255) & ~(size_t)255) + ((w->up_exps.expert_bytes + 255) & ~(size_t)255);
        const size_t d = (w->down_exps.expert_bytes + 255) & ~(size_t)255;
        if (gu > s->stage) s->stage = gu;
        if (d > s->stage) s->stage = d;
    }
}

void backend_opencl_buffer_bytes(const struct colibri_model *m, int max_tok, int streamed, uint64_t *buffers,
                                 uint64_t *staging) {
    ocl_sizes s;
    ocl_sizes_of(m, max_tok, &s);
    *buffers = (uint64_t)s.xf + s.xq + s.y + s.g + s.u + s.gq + s.gk + s.bias;
    *staging = streamed ? (uint64_t)N_STAGE * s.stage : 0;
}

colibri_status backend_opencl_create(const struct colibri_model *m, int max_tok, int streamed, const cb_backend *cpu,
                                     timeline *tl, cb_backend *out) {
    pthread_once(&g_cl_once, cl_load);
    if (!g_cl.GetPlatformIDs) return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: %s", g_cl_error);
    ocl_backend *b = cb_calloc(1, sizeof *b);
    if (!b) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    b->cpu = cpu;
    b->tl = tl;
    cl_platform_id plat = NULL;
    colibri_status st = pick_device(&b->dev, &plat);
    if (st) {
        ocl_destroy(b);
        return st;
    }
    char pname[64] = "", dname[96] = "";
    g_cl.GetPlatformInfo(plat, CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
    g_cl.GetDeviceInfo(b->dev, CL_DEVICE_NAME, sizeof dname - 1, dname, NULL);
    snprintf(b->name, sizeof b->name, "opencl: %s / %s", pname, dname);
    cl_uint unified = 0;
    cl_ulong max_alloc = 0;
    size_t max_wg = 0;
    g_cl.GetDeviceInfo(b->dev, CL_DEVICE_HOST_UNIFIED_MEMORY, sizeof unified, &unified, NULL);
    g_cl.GetDeviceInfo(b->dev, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof max_alloc, &max_alloc, NULL);
    g_cl.GetDeviceInfo(b->dev, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof max_wg, &max_wg, NULL);
    b->unified = unified != 0;
    b->max_alloc = (size_t)max_alloc;
    if (max_wg < LWS) {
        ocl_destroy(b);
        return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: %s allows %zu work-items per group, the kernels need %d",
                        b->name, max_wg, LWS);
    }
    cl_int err;
    b->ctx = g_cl.CreateContext(NULL, 1, &b->dev, NULL, NULL, &err);
    if (b->ctx && err == CL_SUCCESS) b->q = g_cl.CreateCommandQueue(b->ctx, b->dev, CL_QUEUE_PROFILING_ENABLE, &err);
    if (b->q && err == CL_SUCCESS) b->qx = g_cl.CreateCommandQueue(b->ctx, b->dev, CL_QUEUE_PROFILING_ENABLE, &err);
    if (!b->ctx || !b->q || !b->qx || err != CL_SUCCESS) {
        ocl_destroy(b);
        return cb_error(COLIBRI_E_UNSUPPORTED, "OpenCL: cannot create a context and queues on %s (error %d)", dname,
                        (int)err);
    }
    if ((st = build_program(b))) {
        ocl_destroy(b);
        return st;
    }
    const model_hparams *hp = &m->hp;
    ocl_sizes sz;
    ocl_sizes_of(m, max_tok, &sz);
    b->max_ff = sz.max_ff;
    b->max_cols = sz.max_cols;
    b->max_rows = sz.max_rows;
    b->keep_blocks = sz.keep_blocks;
    b->xf = new_buf(b, sz.xf, &st);
    b->xq = new_buf(b, sz.xq, &st);
    b->y = new_buf(b, sz.y, &st);
    b->g = new_buf(b, sz.g, &st);
    b->u = new_buf(b, sz.u, &st);
    b->gq = new_buf(b, sz.gq, &st);
    b->gk = new_buf(b, sz.gk, &st);
    b->bias = new_buf(b, sz.bias, &st);
    /* staging only where experts stream: resident experts were uploaded with the weights */
    b->stage_bytes = streamed ? sz.stage : 0;
    for (int i = 0; i < N_STAGE && b->stage_bytes; i++) b->stage[i].mem = new_buf(b, b->stage_bytes, &st);
    b->max_jobs = hp->n_expert + 8;
    b->cpu_jobs = cb_malloc((size_t)b->max_jobs * sizeof(mm_job));
    b->cpu_glu = cb_malloc((size_t)b->max_jobs * sizeof(glu_job));
    b->last_glu = cb_malloc((size_t)b->max_jobs * sizeof(glu_job));
    if (!st && (!b->cpu_jobs || !b->cpu_glu || !b->last_glu)) st = cb_error(COLIBRI_E_NOMEM, "out of memory");
    if (st) {
        ocl_destroy(b);
        return st;
    }
    if (tl) {
        calibrate_stage(b, TL_STAGE);
        calibrate_stage(b, TL_COMPUTE);
    }
    out->ops = &OCL_OPS;
    out->ctx = b;
    return COLIBRI_OK;
}

void backend_opencl_fail_next(const cb_backend *b, int n) {
    if (b->ops == &OCL_OPS) ((ocl_backend *)b->ctx)->fail_next = n;
}

uint64_t backend_opencl_readback_bytes(const cb_backend *b) {
    return b->ops == &OCL_OPS ? ((const ocl_backend *)b->ctx)->readback : 0;
}

uint64_t backend_opencl_reused_bytes(const cb_backend *b) {
    return b->ops == &OCL_OPS ? ((const ocl_backend *)b->ctx)->reused : 0;
}
