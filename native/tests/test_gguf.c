/* test_gguf.c — the GGUF reader on small files written here: valid v2/v3 files read back
 * field by field, then broken ones (every truncation, bad header fields, bad metadata, bad
 * tensor tables), each of which must be refused with COLIBRI_E_FORMAT and a message that
 * names the problem. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "gguf.h"
#include "types.h"
#include "test_util.h"


/* ---- a tiny GGUF writer --------------------------------------------------------------- */

static void put_u8(buf *b, uint8_t v) { buf_put(b, &v, 1); }
static void put_u32(buf *b, uint32_t v) {
    unsigned char x[4] = {v, v >> 8, v >> 16, v >> 24};
    buf_put(b, x, 4);
}
static void put_u64(buf *b, uint64_t v) {
    put_u32(b, (uint32_t)v);
    put_u32(b, (uint32_t)(v >> 32));
}
static void put_f32(buf *b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(b, u);
}
static void put_str(buf *b, const char *s) {
    put_u64(b, strlen(s));
    buf_put(b, s, strlen(s));
}
static void pad_to(buf *b, size_t align) {
    while (b->n % align) put_u8(b, 0);
}

typedef struct tdesc {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    int64_t offset;   /* -1: laid out automatically */
} tdesc;

/* Standard metadata: string, u32, f32, bool, i32 array, string array (+ alignment if != 0). */
static void put_std_kvs(buf *b, uint32_t alignment) {
    put_str(b, "general.architecture");
    put_u32(b, GGUF_VT_STRING);
    put_str(b, "llama");
    put_str(b, "llama.block_count");
    put_u32(b, GGUF_VT_UINT32);
    put_u32(b, 7);
    put_str(b, "llama.rope.freq_base");
    put_u32(b, GGUF_VT_FLOAT32);
    put_f32(b, 10000.0f);
    put_str(b, "test.flag");
    put_u32(b, GGUF_VT_BOOL);
    put_u8(b, 1);
    put_str(b, "test.ints");
    put_u32(b, GGUF_VT_ARRAY);
    put_u32(b, GGUF_VT_INT32);
    put_u64(b, 3);
    put_u32(b, 1);
    put_u32(b, (uint32_t)-2);
    put_u32(b, 3);
    put_str(b, "tokenizer.ggml.tokens");
    put_u32(b, GGUF_VT_ARRAY);
    put_u32(b, GGUF_VT_STRING);
    put_u64(b, 2);
    put_str(b, "a");
    put_str(b, "bc");
    put_str(b, "test.neg");
    put_u32(b, GGUF_VT_INT32);
    put_u32(b, (uint32_t)-5);
    if (alignment) {
        put_str(b, "general.alignment");
        put_u32(b, GGUF_VT_UINT32);
        put_u32(b, alignment);
    }
}
#define N_STD_KVS 7

static uint64_t tensor_bytes(const tdesc *t) {
    const type_info_t *ti = type_info(t->type);
    uint64_t n = ti ? t->ne[0] / ti->block_size * ti->block_bytes : t->ne[0];
    for (uint32_t d = 1; d < t->n_dims; d++) n *= t->ne[d];
    return n;
}

/* Writes a complete file: header, standard metadata, tensor table, data (tensor i's bytes
 * are all (i + 1)). The last tensor ends exactly at the end of the file. */
static buf make_file(uint32_t version, uint32_t alignment, const tdesc *ts, int nt) {
    buf b = {0};
    uint32_t align = alignment ? alignment : 32;
    put_u32(&b, 0x46554747u);
    put_u32(&b, version);
    put_u64(&b, (uint64_t)nt);
    put_u64(&b, N_STD_KVS + (alignment ? 1 : 0));
    put_std_kvs(&b, alignment);
    uint64_t off = 0;
    uint64_t offs[16];
    for (int i = 0; i < nt; i++) {
        offs[i] = ts[i].offset >= 0 ? (uint64_t)ts[i].offset : off;
        off = offs[i] + tensor_bytes(&ts[i]);
        off = (off + align - 1) / align * align;
        put_str(&b, ts[i].name);
        put_u32(&b, ts[i].n_dims);
        for (uint32_t d = 0; d < ts[i].n_dims; d++) put_u64(&b, ts[i].ne[d]);
        put_u32(&b, ts[i].type);
        put_u64(&b, offs[i]);
    }
    pad_to(&b, align);
    size_t data0 = b.n;
    for (int i = 0; i < nt; i++) {
        uint64_t nb = tensor_bytes(&ts[i]);
        while (b.n < data0 + offs[i] + nb) put_u8(&b, 0);
        memset(b.p + data0 + offs[i], i + 1, (size_t)nb);
    }
    return b;
}

static char tmp_path[256];

static colibri_status open_bytes(const unsigned char *p, size_t n, gguf_file *f) {
    FILE *fp = fopen(tmp_path, "wb");
    if (!fp) abort();
    if (n && fwrite(p, 1, n, fp) != n) abort();
    fclose(fp);
    cb_clear_error();
    return gguf_open(tmp_path, f);
}

/* Expects the bytes to be refused with `code` and a message containing `needle`;
 * `line` identifies the case in the failure report. */
static void expect_fail(const unsigned char *p, size_t n, colibri_status code, const char *needle, int line) {
    gguf_file f;
    colibri_status st = open_bytes(p, n, &f);
    if (st != code || (needle && !strstr(cb_last_error(), needle))) {
        fprintf(stderr, "line %d: expected status %d with '%s', got %d: %s\n", line, code, needle ? needle : "",
                st, cb_last_error());
        failures++;
    }
    if (st == COLIBRI_OK) gguf_close(&f);
    /* a refused open leaves *out zeroed */
    if (st != COLIBRI_OK) CHECK(f.map == NULL && f.kv == NULL && f.tensors == NULL && f.n_kv == 0);
}
#define EXPECT_FAIL(b, code, needle) expect_fail((b).p, (b).n, code, needle, __LINE__)

static const tdesc STD_TENSORS[] = {
    {"token_embd.weight", 2, {4, 3, 1, 1}, GGML_TYPE_F32, -1},
    {"blk.0.ffn_gate_exps.weight", 3, {32, 2, 4, 1}, GGML_TYPE_Q8_0, -1},
    {"output_norm.weight", 1, {4, 1, 1, 1}, GGML_TYPE_F16, -1},
};

/* Offset in b of the tensor-table entry for tensor `i` (parses the std layout). */
static size_t tensor_entry_offset(const buf *b, int i) {
    /* the entry is the only place where the u64 name length is followed by the name */
    size_t pos = 24;
    const char *name = STD_TENSORS[i].name;
    size_t L = strlen(name);
    for (; pos + 8 + L <= b->n; pos++) {
        uint64_t len;
        memcpy(&len, b->p + pos, 8);
        if (len == L && memcmp(b->p + pos + 8, name, L) == 0) return pos;
    }
    abort();
}

static buf copy_buf(const buf *b) {
    buf c = {malloc(b->n), b->n, b->n};
    memcpy(c.p, b->p, b->n);
    return c;
}

/* ---- tests ------------------------------------------------------------------------- */

static void test_valid(uint32_t version, uint32_t alignment) {
    buf b = make_file(version, alignment, STD_TENSORS, 3);
    gguf_file f;
    colibri_status st = open_bytes(b.p, b.n, &f);
    if (st != COLIBRI_OK) fprintf(stderr, "valid v%u file refused: %s\n", version, cb_last_error());
    CHECK(st == COLIBRI_OK);
    if (st != COLIBRI_OK) {
        free(b.p);
        return;
    }
    CHECK(f.version == version);
    CHECK(f.size == b.n);
    CHECK(f.alignment == (alignment ? alignment : 32));
    CHECK(f.n_kv == N_STD_KVS + (alignment ? 1u : 0u));
    CHECK(f.n_tensors == 3);
    CHECK(f.data_offset % f.alignment == 0);

    char s[64];
    CHECK(gguf_get_str(&f, "general.architecture", s, sizeof s) == 1 && strcmp(s, "llama") == 0);
    CHECK(gguf_get_str(&f, "general.architecture", s, 3) == 1 && strcmp(s, "ll") == 0);   /* truncated */
    uint32_t u = 0;
    CHECK(gguf_get_u32(&f, "llama.block_count", &u) == 1 && u == 7);
    int32_t i32 = 0;
    CHECK(gguf_get_i32(&f, "llama.block_count", &i32) == 1 && i32 == 7);
    CHECK(gguf_get_i32(&f, "test.neg", &i32) == 1 && i32 == -5);
    CHECK(gguf_get_u32(&f, "test.neg", &u) == -1 && strstr(cb_last_error(), "test.neg"));
    CHECK(gguf_get_u32(&f, "no.such.key", &u) == 0);
    CHECK(gguf_get_u32(&f, "general.architecture", &u) == -1);
    float fl = 0;
    CHECK(gguf_get_f32(&f, "llama.rope.freq_base", &fl) == 1 && fl == 10000.0f);
    CHECK(gguf_get_f32(&f, "llama.block_count", &fl) == 1 && fl == 7.0f);
    int bo = 0;
    CHECK(gguf_get_bool(&f, "test.flag", &bo) == 1 && bo == 1);
    CHECK(gguf_get_bool(&f, "llama.block_count", &bo) == -1);
    gguf_value_type at;
    uint64_t al;
    CHECK(gguf_get_arr(&f, "test.ints", &at, &al) == 1 && at == GGUF_VT_INT32 && al == 3);
    CHECK(gguf_get_arr(&f, "tokenizer.ggml.tokens", &at, &al) == 1 && at == GGUF_VT_STRING && al == 2);
    CHECK(gguf_get_arr(&f, "test.flag", &at, &al) == -1);
    const gguf_kv *kv = gguf_find(&f, "test.ints");
    CHECK(kv && (int32_t)(kv->arr_data[4] | kv->arr_data[5] << 8 | kv->arr_data[6] << 16 |
                          (uint32_t)kv->arr_data[7] << 24) == -2);
    kv = gguf_find(&f, "tokenizer.ggml.tokens");
    CHECK(kv && kv->arr_data[0] == 1 && kv->arr_data[8] == 'a' && kv->arr_data[9] == 2 && kv->arr_data[17] == 'b');

    const gguf_tensor *t = gguf_find_tensor(&f, "blk.0.ffn_gate_exps.weight");
    CHECK(t != NULL);
    if (t) {
        CHECK(t->n_dims == 3 && t->ne[0] == 32 && t->ne[1] == 2 && t->ne[2] == 4 && t->ne[3] == 1);
        CHECK(t->type == GGML_TYPE_Q8_0 && t->nbytes == 34 * 2 * 4);
        CHECK(t->offset % f.alignment == 0 && t->offset >= f.data_offset);
        CHECK((const uint8_t *)t->data == f.map + t->offset);
        CHECK(((const uint8_t *)t->data)[0] == 2 && ((const uint8_t *)t->data)[t->nbytes - 1] == 2);
        uint64_t off, nb;
        CHECK(gguf_expert_range(t, 3, &off, &nb) == COLIBRI_OK && nb == 68 && off == t->offset + 3 * 68);
        CHECK(gguf_expert_range(t, 4, &off, &nb) == COLIBRI_E_INVALID_ARG);
    }
    t = gguf_find_tensor(&f, "token_embd.weight");
    CHECK(t && t->nbytes == 48 && ((const uint8_t *)t->data)[47] == 1);
    if (t) {
        uint64_t off, nb;
        CHECK(gguf_expert_range(t, 0, &off, &nb) == COLIBRI_E_INVALID_ARG);   /* not 3-D */
    }
    t = gguf_find_tensor(&f, "output_norm.weight");
    CHECK(t && t->nbytes == 8 && t->offset + t->nbytes == f.size);
    CHECK(gguf_find_tensor(&f, "missing") == NULL);
    gguf_close(&f);
    CHECK(f.map == NULL && f.kv == NULL);
    gguf_close(&f);   /* closing twice is harmless */

    /* every strict prefix of a valid file is refused, never a crash */
    int bad = 0;
    for (size_t n = 0; n < b.n; n++) {
        gguf_file g;
        colibri_status s2 = open_bytes(b.p, n, &g);
        if (s2 != COLIBRI_E_FORMAT) {
            if (bad == 0) fprintf(stderr, "prefix of %zu bytes: status %d: %s\n", n, s2, cb_last_error());
            bad++;
        }
        if (s2 == COLIBRI_OK) gguf_close(&g);
    }
    CHECK(bad == 0);
    free(b.p);
}

static void test_header(void) {
    buf b = make_file(3, 0, STD_TENSORS, 3);
    buf c = copy_buf(&b);
    c.p[0] = 'X';
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "not a GGUF file");
    memcpy(c.p, b.p, b.n);
    c.p[4] = 1;
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "version 1");
    c.p[4] = 4;
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "version 4");
    c.p[4] = 0;
    c.p[7] = 3;
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "big-endian");
    memcpy(c.p, b.p, b.n);
    c.p[15] = 0x10;   /* n_tensors ~ 2^60 */
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "tensors cannot fit");
    memcpy(c.p, b.p, b.n);
    memset(c.p + 16, 0xff, 8);   /* n_kv = 2^64 - 1 */
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "metadata entries cannot fit");
    memcpy(c.p, b.p, b.n);
    c.p[16] = N_STD_KVS + 1;   /* one kv too many: the first tensor entry is parsed as a kv */
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, NULL);
    free(c.p);
    free(b.p);

    gguf_file f;
    CHECK(gguf_open("/nonexistent/dir/x.gguf", &f) == COLIBRI_E_IO && strstr(cb_last_error(), "x.gguf"));
    CHECK(gguf_open("/tmp", &f) == COLIBRI_E_IO);
    CHECK(open_bytes((const unsigned char *)"GGUF", 4, &f) == COLIBRI_E_FORMAT);
    CHECK(open_bytes((const unsigned char *)"", 0, &f) == COLIBRI_E_FORMAT);
    CHECK(gguf_open(NULL, &f) == COLIBRI_E_INVALID_ARG);
}

/* A file whose single metadata entry is written by `fill`, with no tensors. */
static buf one_kv(void (*fill)(buf *)) {
    buf b = {0};
    put_u32(&b, 0x46554747u);
    put_u32(&b, 3);
    put_u64(&b, 0);
    put_u64(&b, 1);
    fill(&b);
    return b;
}
static void kv_ctrl_key(buf *b) { put_str(b, "a\tb"); put_u32(b, GGUF_VT_UINT8); put_u8(b, 1); put_u64(b, 0); }
static void kv_ok(buf *b) { put_str(b, "a.b"); put_u32(b, GGUF_VT_UINT64); put_u64(b, 1ull << 40); }
static void kv_bad_type(buf *b) { put_str(b, "a.b"); put_u32(b, 13); put_u32(b, 0); }
static void kv_huge_str(buf *b) { put_str(b, "a.b"); put_u32(b, GGUF_VT_STRING); put_u64(b, 1ull << 62); put_u64(b, 0); }
static void kv_huge_key(buf *b) { put_u64(b, 1ull << 40); put_u64(b, 0); put_u64(b, 0); }
static void kv_empty_key(buf *b) { put_u64(b, 0); put_u32(b, GGUF_VT_UINT8); put_u8(b, 0); put_u64(b, 0); }
static void kv_huge_arr(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, GGUF_VT_UINT64); put_u64(b, 1ull << 61); put_u64(b, 0);
}
static void kv_huge_str_arr(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, GGUF_VT_STRING); put_u64(b, 1ull << 40); put_u64(b, 0);
}
static void kv_str_arr_bad_elem(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, GGUF_VT_STRING); put_u64(b, 2);
    put_str(b, "x"); put_u64(b, 1000); put_u64(b, 0);
}
static void kv_nested(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, GGUF_VT_ARRAY); put_u64(b, 1);
    put_u32(b, GGUF_VT_UINT8); put_u64(b, 0);
}
static void kv_arr_bad_type(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, 99); put_u64(b, 0); put_u64(b, 0);
}
static void kv_bool2(buf *b) { put_str(b, "a.b"); put_u32(b, GGUF_VT_BOOL); put_u8(b, 2); put_u64(b, 0); }
static void kv_bool_arr2(buf *b) {
    put_str(b, "a.b"); put_u32(b, GGUF_VT_ARRAY); put_u32(b, GGUF_VT_BOOL); put_u64(b, 2); put_u8(b, 1); put_u8(b, 7);
    put_u64(b, 0);
}
static void kv_align_str(buf *b) { put_str(b, "general.alignment"); put_u32(b, GGUF_VT_STRING); put_str(b, "32"); }
static void kv_align_3(buf *b) { put_str(b, "general.alignment"); put_u32(b, GGUF_VT_UINT32); put_u32(b, 48); put_u64(b, 0); }
static void kv_align_0(buf *b) { put_str(b, "general.alignment"); put_u32(b, GGUF_VT_UINT32); put_u32(b, 0); put_u64(b, 0); }
static void kv_trunc_val(buf *b) { put_str(b, "a.b"); put_u32(b, GGUF_VT_UINT64); put_u32(b, 1); }
static void kv_dup(buf *b) {
    /* n_kv says 1; patched to 2 by the caller */
    put_str(b, "a.b"); put_u32(b, GGUF_VT_UINT8); put_u8(b, 1);
    put_str(b, "a.b"); put_u32(b, GGUF_VT_UINT8); put_u8(b, 2);
    put_u64(b, 0);
}

static void test_metadata(void) {
    gguf_file f;
    buf b = one_kv(kv_ok);
    CHECK(open_bytes(b.p, b.n, &f) == COLIBRI_OK);
    if (f.map) {
        CHECK(f.n_tensors == 0 && f.data_offset <= f.size);
        uint32_t u;
        CHECK(gguf_get_u32(&f, "a.b", &u) == -1 && strstr(cb_last_error(), "a.b"));
        gguf_close(&f);
    }
    free(b.p);

    struct { void (*fill)(buf *); const char *needle; } cases[] = {
        {kv_bad_type, "unknown value type 13"},
        {kv_ctrl_key, "not printable ASCII"},
        {kv_huge_str, "string length 4611686018427387904"},
        {kv_huge_key, "key length 1099511627776"},
        {kv_empty_key, "key length 0"},
        {kv_huge_arr, "array of 2305843009213693952 uint64"},
        {kv_huge_str_arr, "array of 1099511627776 strings"},
        {kv_str_arr_bad_elem, "string 1 of 2: length 1000"},
        {kv_nested, "nested arrays"},
        {kv_arr_bad_type, "unknown array element type 99"},
        {kv_bool2, "bool value 2"},
        {kv_bool_arr2, "bool element 1 is 7"},
        {kv_align_str, "general.alignment has type string"},
        {kv_align_3, "general.alignment is 48"},
        {kv_align_0, "general.alignment is 0"},
        {kv_trunc_val, "uint64 value past end"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        b = one_kv(cases[i].fill);
        expect_fail(b.p, b.n, COLIBRI_E_FORMAT, cases[i].needle, (int)(2000 + i));
        free(b.p);
    }
    b = one_kv(kv_dup);
    b.p[16] = 2;
    EXPECT_FAIL(b, COLIBRI_E_FORMAT, "'a.b' appears more than once");
    free(b.p);
}

/* Rewrites tensor i's table entry fields in a copy of the standard file. */
typedef struct patch {
    int tensor;
    enum { P_NDIMS, P_NE0, P_NE1, P_TYPE, P_OFFSET, P_NAMEBYTE } field;
    uint64_t value;
} patch;

static buf patched(const buf *b, patch p) {
    buf c = copy_buf(b);
    size_t e = tensor_entry_offset(&c, p.tensor);
    const tdesc *t = &STD_TENSORS[p.tensor];
    size_t name_end = e + 8 + strlen(t->name);
    size_t ne_at = name_end + 4;
    size_t type_at = ne_at + 8 * t->n_dims;
    switch (p.field) {
    case P_NDIMS: { uint32_t v = (uint32_t)p.value; memcpy(c.p + name_end, &v, 4); break; }
    case P_NE0: memcpy(c.p + ne_at, &p.value, 8); break;
    case P_NE1: memcpy(c.p + ne_at + 8, &p.value, 8); break;
    case P_TYPE: { uint32_t v = (uint32_t)p.value; memcpy(c.p + type_at, &v, 4); break; }
    case P_OFFSET: memcpy(c.p + type_at + 4, &p.value, 8); break;
    case P_NAMEBYTE: c.p[e + 8 + 1] = (unsigned char)p.value; break;
    }
    return c;
}

static void test_tensor_table(void) {
    buf b = make_file(3, 0, STD_TENSORS, 3);
    struct { patch p; const char *needle; } cases[] = {
        {{0, P_NDIMS, 0}, "0 dimensions"},
        {{0, P_NDIMS, 5}, "5 dimensions"},
        {{0, P_NE0, 0}, "dimension 0 is 0"},
        {{0, P_NE1, 1ull << 63}, "dimension 1 is 9223372036854775808"},
        {{0, P_NE0, 1ull << 40}, "past the end"},
        {{1, P_NE1, 1ull << 58}, "more than 2^63-1 elements"},
        {{1, P_NE0, 31}, "row length 31 is not a multiple of the Q8_0 block size 32"},
        {{0, P_TYPE, 4}, "unknown ggml type id 4"},
        {{0, P_TYPE, 99}, "unknown ggml type id 99"},
        {{0, P_TYPE, 0xffffffffu}, "unknown ggml type id 4294967295"},
        {{1, P_OFFSET, 33}, "not a multiple of the alignment 32"},
        {{2, P_OFFSET, 1ull << 62}, "past the end"},
        {{2, P_OFFSET, 0}, "overlap"},
        {{0, P_NAMEBYTE, 0}, "NUL byte"},
        {{0, P_NAMEBYTE, 0xff}, "not valid UTF-8"},
        {{0, P_NAMEBYTE, 0xc0}, "not valid UTF-8"},   /* truncated/overlong sequence */
        {{0, P_NAMEBYTE, '\n'}, "control character 0x0a"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        buf c = patched(&b, cases[i].p);
        expect_fail(c.p, c.n, COLIBRI_E_FORMAT, cases[i].needle, (int)(1000 + i));
        free(c.p);
    }
    /* Q8_0 ne0 of 2^62 with ne1 = 2: bytes overflow before the element count does */
    {
        buf c = patched(&b, (patch){1, P_NE0, 1ull << 62});
        EXPECT_FAIL(c, COLIBRI_E_FORMAT, "blk.0.ffn_gate_exps.weight");
        free(c.p);
    }
    free(b.p);

    /* duplicate names */
    tdesc dup[2] = {STD_TENSORS[0], STD_TENSORS[0]};
    b = make_file(3, 0, dup, 2);
    EXPECT_FAIL(b, COLIBRI_E_FORMAT, "'token_embd.weight' appears more than once");
    free(b.p);

    /* name length: 127 accepted, 128 refused */
    char longname[129];
    memset(longname, 'n', 128);
    longname[127] = '\0';
    tdesc ln = {longname, 1, {8, 1, 1, 1}, GGML_TYPE_F32, -1};
    b = make_file(3, 0, &ln, 1);
    gguf_file f;
    CHECK(open_bytes(b.p, b.n, &f) == COLIBRI_OK);
    if (f.map) {
        CHECK(gguf_find_tensor(&f, longname) != NULL);
        gguf_close(&f);
    }
    free(b.p);
    longname[127] = 'n';
    longname[128] = '\0';
    b = make_file(3, 0, &ln, 1);
    EXPECT_FAIL(b, COLIBRI_E_FORMAT, "name length 128");
    free(b.p);

    /* multi-byte UTF-8 names are fine */
    tdesc u8 = {"t\xc3\xb6k\xe2\x82\xac.\xf0\x9f\x98\x80", 1, {8, 1, 1, 1}, GGML_TYPE_F32, -1};
    b = make_file(3, 0, &u8, 1);
    CHECK(open_bytes(b.p, b.n, &f) == COLIBRI_OK);
    if (f.map) gguf_close(&f);
    free(b.p);

    /* rows that are not a whole number of blocks are refused by name: a Q4_K row of 288 (not a
     * multiple of 256, as llama.cpp's fallbacks to Q5_0 / Q8_0 avoid), a Q5_0 row of 48 */
    tdesc bad_k = {"blk.3.ffn_down_exps.weight", 3, {288, 2, 4, 1}, GGML_TYPE_Q4_K, -1};
    b = make_file(3, 0, &bad_k, 1);
    EXPECT_FAIL(b, COLIBRI_E_FORMAT,
                "tensor 'blk.3.ffn_down_exps.weight': row length 288 is not a multiple of the Q4_K block size 256");
    free(b.p);
    tdesc bad_5 = {"blk.0.attn_v.weight", 2, {48, 2, 1, 1}, GGML_TYPE_Q5_0, -1};
    b = make_file(3, 0, &bad_5, 1);
    EXPECT_FAIL(b, COLIBRI_E_FORMAT,
                "blk.0.attn_v.weight': row length 48 is not a multiple of the Q5_0 block size 32");
    free(b.p);

    /* a K-quant tensor opens with its byte size from the block layout (refusing types without
     * kernels is the model loader's job) */
    tdesc qk = {"blk.0.attn_q.weight", 2, {256, 2, 1, 1}, 12, -1};
    b = make_file(3, 0, &qk, 1);
    CHECK(open_bytes(b.p, b.n, &f) == COLIBRI_OK);
    if (f.map) {
        CHECK(f.tensors[0].nbytes == 288);
        gguf_close(&f);
    }
    free(b.p);

    /* custom alignment is honoured; offsets that are 32- but not 64-aligned are refused */
    b = make_file(3, 64, STD_TENSORS, 3);
    buf c = patched(&b, (patch){2, P_OFFSET, 32 * 5});
    EXPECT_FAIL(c, COLIBRI_E_FORMAT, "alignment 64");
    free(c.p);
    free(b.p);

    /* the data section itself past the end of the file (header ends, padding missing) */
    tdesc one = {"x", 1, {1, 1, 1, 1}, GGML_TYPE_F32, -1};
    b = make_file(3, 0, &one, 1);
    expect_fail(b.p, b.n - 5, COLIBRI_E_FORMAT, NULL, __LINE__);
    free(b.p);
}

int main(void) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/colibri_test_gguf_%d.gguf", (int)getpid());
    test_valid(3, 0);
    test_valid(2, 0);
    test_valid(3, 64);
    test_valid(3, 1);
    test_header();
    test_metadata();
    test_tensor_table();
    unlink(tmp_path);
    return test_summary("test_gguf");
}
