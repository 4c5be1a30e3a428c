/* digest.c — the colibri-mx64 digest, the MODEL.digests sidecar (see digest.h), and the two
 * file-level entry points: colibri_write_digests and colibri_verify_file. */
#include "digest.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "model.h"

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t rd64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);   /* little-endian hosts only (x86-64, aarch64), as the GGUF reader */
    return w;
}
static inline uint64_t absorb(uint64_t v, uint64_t w) { return rotl((v ^ w) * P1, 29); }

void digest_init(digest_state *s) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 4; i++) s->v[i] = P3 * (uint64_t)(i + 1);
}

/* Whole 32-byte stripes: four independent lanes, so the multiplies overlap in the pipeline. */
static void stripes(uint64_t v[4], const unsigned char *p, size_t n_stripes) {
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (size_t i = 0; i < n_stripes; i++, p += 32) {
        a = absorb(a, rd64(p));
        b = absorb(b, rd64(p + 8));
        c = absorb(c, rd64(p + 16));
        d = absorb(d, rd64(p + 24));
    }
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

void digest_update(digest_state *s, const void *data, size_t n) {
    const unsigned char *p = data;
    s->len += n;
    if (s->n_buf) {
        const size_t take = n < 32 - s->n_buf ? n : 32 - s->n_buf;
        memcpy(s->buf + s->n_buf, p, take);
        s->n_buf += take;
        p += take;
        n -= take;
        if (s->n_buf < 32) return;
        stripes(s->v, s->buf, 1);
        s->n_buf = 0;
    }
    stripes(s->v, p, n / 32);
    p += n / 32 * 32;
    n %= 32;
    memcpy(s->buf, p, n);
    s->n_buf = n;
}

uint64_t digest_final(const digest_state *s) {
    uint64_t v[4] = {s->v[0], s->v[1], s->v[2], s->v[3]};
    /* the partial stripe: whole words, then the last bytes zero-padded into one word */
    unsigned char pad[32] = {0};
    memcpy(pad, s->buf, s->n_buf);
    for (size_t k = 0; k * 8 < s->n_buf; k++) v[k] = absorb(v[k], rd64(pad + 8 * k));
    uint64_t h = s->len * P2;
    for (int i = 0; i < 4; i++) h = rotl((h ^ v[i]) * P2, 31);
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t digest_bytes(const void *p, size_t n) {
    digest_state s;
    digest_init(&s);
    digest_update(&s, p, n);
    return digest_final(&s);
}

/* ---- the sidecar -------------------------------------------------------- */

int digest_per_expert(const gguf_tensor *t) { return strstr(t->name, "_exps.weight") != NULL && t->n_dims == 3; }

int digest_sidecar_path(const char *model_path, char *buf, size_t cap) {
    const int n = snprintf(buf, cap, "%s.digests", model_path);
    return n > 0 && (size_t)n < cap;
}

static uint64_t count_digests(const gguf_file *f) {
    uint64_t n = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) n += digest_per_expert(&f->tensors[i]) ? f->tensors[i].ne[2] : 1;
    return n;
}

void digest_table_free(digest_table *d) {
    if (!d) return;
    cb_free(d->first);
    cb_free(d->value);
    cb_free(d);
}

uint64_t digest_expected(const digest_table *d, uint64_t tensor, uint64_t e) { return d->value[d->first[tensor] + e]; }

static colibri_status read_all(int fd, const char *path, unsigned char *dst, size_t n) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = pread(fd, dst + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return cb_error(COLIBRI_E_IO, "reading %s: %s", path, strerror(errno));
        if (r == 0) return cb_error(COLIBRI_E_FORMAT, "%s is truncated", path);
        got += (size_t)r;
    }
    return COLIBRI_OK;
}

colibri_status digest_table_load(const char *model_path, const gguf_file *f, digest_table **out) {
    *out = NULL;
    char path[4096];
    if (!digest_sidecar_path(model_path, path, sizeof path)) return COLIBRI_OK;
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return COLIBRI_OK;
        return cb_error(COLIBRI_E_IO, "cannot open digests %s: %s", path, strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return cb_error(COLIBRI_E_IO, "digests %s is not a readable regular file", path);
    }
    const uint64_t n_dig = count_digests(f);
    const uint64_t want = DIGEST_HEADER_BYTES + 8 * n_dig + 8;
    if ((uint64_t)sb.st_size != want) {
        close(fd);
        return cb_error(COLIBRI_E_FORMAT,
                        "digests %s is %lld bytes; this model's (%llu digests) would be %llu: it belongs to "
                        "another file (rewrite it with `colibri verify --write`)",
                        path, (long long)sb.st_size, (unsigned long long)n_dig, (unsigned long long)want);
    }
    unsigned char *b = cb_malloc((size_t)want);
    digest_table *d = cb_calloc(1, sizeof *d);
    if (d) {
        d->first = cb_malloc((size_t)(f->n_tensors ? f->n_tensors : 1) * sizeof(uint64_t));
        d->value = cb_malloc((size_t)(n_dig ? n_dig : 1) * sizeof(uint64_t));
    }
    colibri_status st = COLIBRI_OK;
    if (!b || !d || !d->first || !d->value) st = cb_error(COLIBRI_E_NOMEM, "out of memory reading %s", path);
    if (!st) st = read_all(fd, path, b, (size_t)want);
    close(fd);
    if (!st && memcmp(b, DIGEST_MAGIC, 8) != 0) st = cb_error(COLIBRI_E_FORMAT, "%s is not a digests file", path);
    uint32_t version = 0;
    if (!st) memcpy(&version, b + 8, 4);
    if (!st && version != DIGEST_VERSION)
        st = cb_error(COLIBRI_E_UNSUPPORTED, "digests %s has version %u (this engine reads %d)", path, version,
                      DIGEST_VERSION);
    if (!st && digest_bytes(b, (size_t)want - 8) != rd64(b + want - 8))
        st = cb_error(COLIBRI_E_FORMAT, "digests %s is corrupt: checksum mismatch", path);
    if (!st && (rd64(b + 16) != f->size || rd64(b + 24) != digest_bytes(f->map, (size_t)f->data_offset) ||
                rd64(b + 32) != f->n_tensors || rd64(b + 40) != n_dig))
        st = cb_error(COLIBRI_E_FORMAT,
                      "digests %s was made from another file (its size, metadata or tensor table differ); "
                      "rewrite it with `colibri verify --write` or delete it",
                      path);
    if (st) {
        cb_free(b);
        digest_table_free(d);
        return st;
    }
    d->n_tensors = f->n_tensors;
    d->n_digests = n_dig;
    for (uint64_t i = 0, k = 0; i < f->n_tensors; i++) {
        d->first[i] = k;
        k += digest_per_expert(&f->tensors[i]) ? f->tensors[i].ne[2] : 1;
    }
    for (uint64_t k = 0; k < n_dig; k++) d->value[k] = rd64(b + DIGEST_HEADER_BYTES + 8 * k);
    cb_free(b);
    *out = d;
    return COLIBRI_OK;
}

/* ---- file-level: write and verify ---------------------------------------- */

#define SCAN_CHUNK ((size_t)8 << 20)

/* Digest of the file's bytes [off, off + len) read with pread through buf[SCAN_CHUNK]. */
static colibri_status digest_range(int fd, const char *path, unsigned char *buf, uint64_t off, uint64_t len,
                                   uint64_t *out) {
    digest_state s;
    digest_init(&s);
    while (len > 0) {
        const size_t ask = len < SCAN_CHUNK ? (size_t)len : SCAN_CHUNK;
        const ssize_t r = pread(fd, buf, ask, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return cb_error(COLIBRI_E_IO, "reading %s: %s", path, strerror(errno));
        if (r == 0) return cb_error(COLIBRI_E_FORMAT, "%s ends early (truncated while reading?)", path);
        digest_update(&s, buf, (size_t)r);
        off += (uint64_t)r;
        len -= (uint64_t)r;
    }
    *out = digest_final(&s);
    return COLIBRI_OK;
}

/* Every digest of the file, in sidecar order, into value[count_digests(f)]. */
static colibri_status digest_file(const char *path, const gguf_file *f, uint64_t *value) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "cannot open '%s': %s", path, strerror(errno));
    unsigned char *buf = cb_malloc(SCAN_CHUNK);
    colibri_status st = buf ? COLIBRI_OK : cb_error(COLIBRI_E_NOMEM, "out of memory");
    uint64_t k = 0;
    for (uint64_t i = 0; !st && i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (!digest_per_expert(t)) {
            st = digest_range(fd, path, buf, t->offset, t->nbytes, &value[k++]);
            continue;
        }
        for (uint64_t e = 0; !st && e < t->ne[2]; e++) {
            uint64_t off, len;
            st = gguf_expert_range(t, (uint32_t)e, &off, &len);
            if (!st) st = digest_range(fd, path, buf, off, len, &value[k++]);
        }
    }
    cb_free(buf);
    close(fd);
    return st;
}

static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

colibri_status colibri_write_digests(const char *model_path) {
    if (!model_path) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_write_digests: path is NULL");
    gguf_file f;
    colibri_status st = gguf_open(model_path, &f);
    if (st) return st;
    const uint64_t n_dig = count_digests(&f);
    const size_t n = (size_t)(DIGEST_HEADER_BYTES + 8 * n_dig + 8);
    unsigned char *b = cb_calloc(1, n);
    if (!b) {
        gguf_close(&f);
        return cb_error(COLIBRI_E_NOMEM, "out of memory");
    }
    memcpy(b, DIGEST_MAGIC, 8);
    const uint32_t version = DIGEST_VERSION;
    memcpy(b + 8, &version, 4);
    put64(b + 16, f.size);
    put64(b + 24, digest_bytes(f.map, (size_t)f.data_offset));
    put64(b + 32, f.n_tensors);
    put64(b + 40, n_dig);
    uint64_t *value = cb_malloc((size_t)(n_dig ? n_dig : 1) * sizeof(uint64_t));
    st = value ? digest_file(model_path, &f, value) : cb_error(COLIBRI_E_NOMEM, "out of memory");
    gguf_close(&f);
    for (uint64_t k = 0; !st && k < n_dig; k++) put64(b + DIGEST_HEADER_BYTES + 8 * k, value[k]);
    cb_free(value);
    if (!st) put64(b + n - 8, digest_bytes(b, n - 8));
    /* written beside and renamed over: a reader sees the old sidecar or the whole new one */
    char path[4096], tmp[4200];
    if (!st && !digest_sidecar_path(model_path, path, sizeof path))
        st = cb_error(COLIBRI_E_INVALID_ARG, "model path is too long");
    if (!st) {
        snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
        FILE *o = fopen(tmp, "wb");
        if (!o) st = cb_error(COLIBRI_E_IO, "cannot write %s: %s", tmp, strerror(errno));
        else {
            const int ok = fwrite(b, 1, n, o) == n;
            if (fclose(o) != 0 || !ok) st = cb_error(COLIBRI_E_IO, "cannot write %s: %s", tmp, strerror(errno));
            else if (rename(tmp, path) != 0) st = cb_error(COLIBRI_E_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
            if (st) unlink(tmp);
        }
    }
    cb_free(b);
    return st;
}

/* Append "name" (and " expert E") as one line of report[cap] (always NUL-terminated, lines that
 * do not fit are dropped; the count still counts them). */
static void report_bad(char *report, size_t cap, const char *name, int64_t expert) {
    if (!report || cap == 0) return;
    const size_t used = strnlen(report, cap);
    char line[192];
    const int n = expert >= 0 ? snprintf(line, sizeof line, "%s expert %lld\n", name, (long long)expert)
                              : snprintf(line, sizeof line, "%s\n", name);
    if (n > 0 && used + (size_t)n < cap) memcpy(report + used, line, (size_t)n + 1);
}

colibri_status digest_report(const gguf_file *f, const digest_table *d, const uint64_t *value, int32_t resident_blocks,
                             char *report, size_t cap, int32_t *n_bad) {
    *n_bad = 0;
    if (report && cap) report[0] = '\0';
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        const int per = digest_per_expert(t);
        if (resident_blocks > 0 && (per || model_block_of(t->name) >= resident_blocks)) continue;
        const uint64_t n = per ? t->ne[2] : 1;
        for (uint64_t e = 0; e < n; e++) {
            uint64_t got;
            if (value) {
                got = value[d->first[i] + e];
            } else {
                got = digest_bytes(t->data, (size_t)t->nbytes);
            }
            if (got != digest_expected(d, i, e)) {
                (*n_bad)++;
                report_bad(report, cap, t->name, per ? (int64_t)e : -1);
            }
        }
    }
    return COLIBRI_OK;
}

colibri_status colibri_verify_file(const char *model_path, char *report, size_t cap, int32_t *n_bad) {
    if (!model_path || !n_bad) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_verify_file: NULL argument");
    *n_bad = 0;
    if (report && cap) report[0] = '\0';
    gguf_file f;
    colibri_status st = gguf_open(model_path, &f);
    if (st) return st;
    digest_table *d = NULL;
    st = digest_table_load(model_path, &f, &d);
    if (!st && !d)
        st = cb_error(COLIBRI_E_UNSUPPORTED, "%s has no digests (%s.digests); write them with `colibri verify --write`",
                      model_path, model_path);
    uint64_t *value = NULL;
    if (!st) {
        value = cb_malloc((size_t)(d->n_digests ? d->n_digests : 1) * sizeof(uint64_t));
        st = value ? digest_file(model_path, &f, value) : cb_error(COLIBRI_E_NOMEM, "out of memory");
    }
    if (!st) st = digest_report(&f, d, value, 0, report, cap, n_bad);
    cb_free(value);
    digest_table_free(d);
    gguf_close(&f);
    return st;
}
