/* profile.c — load and check a routing profile (format in profile.h).
 *
 * The file is small next to the model (shares plus a candidate table), so it is read whole,
 * its size and checksum checked before any value is trusted, then decoded byte by byte (the
 * format is little-endian whatever the host). Every value the engine later indexes with (expert
 * ids, bucket count) is range-checked here, so the hot paths can use the profile unchecked. */
#include "profile.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "resident.h"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define PROFILE_MAX_BUCKETS (1u << 24)

static uint64_t fnv1a(uint64_t h, const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= FNV_PRIME;
    }
    return h;
}

static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd_u64(const unsigned char *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static float rd_f32(const unsigned char *p) {
    const uint32_t u = rd_u32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Read the whole file at path into a new buffer; COLIBRI_E_IO on any failure. */
static colibri_status read_file(const char *path, unsigned char **out, size_t *size) {
    *out = NULL;
    *size = 0;
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "cannot open routing profile %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return cb_error(COLIBRI_E_IO, "routing profile %s is not a regular file", path);
    }
    const size_t n = (size_t)sb.st_size;
    unsigned char *b = cb_malloc(n ? n : 1);
    if (!b) {
        close(fd);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate %zu bytes to read routing profile %s", n, path);
    }
    size_t got = 0;
    while (got < n) {
        const ssize_t r = pread(fd, b + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            const int err = r < 0 ? errno : EIO;
            cb_free(b);
            close(fd);
            return cb_error(COLIBRI_E_IO, "reading routing profile %s: %s", path, strerror(err));
        }
        got += (size_t)r;
    }
    close(fd);
    *out = b;
    *size = n;
    return COLIBRI_OK;
}

/* FNV-1a 64 of the first min(size, PROFILE_FINGERPRINT_BYTES) bytes of the open file fd. */
static colibri_status fingerprint_fd(int fd, const char *model_path, uint64_t *fingerprint, uint64_t *model_bytes) {
    struct stat sb;
    if (fstat(fd, &sb) != 0) return cb_error(COLIBRI_E_IO, "cannot stat %s: %s", model_path, strerror(errno));
    const uint64_t size = (uint64_t)sb.st_size;
    const uint64_t want = size < PROFILE_FINGERPRINT_BYTES ? size : PROFILE_FINGERPRINT_BYTES;
    unsigned char chunk[65536];
    uint64_t h = FNV_OFFSET, done = 0;
    while (done < want) {
        const size_t ask = want - done < sizeof chunk ? (size_t)(want - done) : sizeof chunk;
        const ssize_t r = pread(fd, chunk, ask, (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return cb_error(COLIBRI_E_IO, "reading %s: %s", model_path, strerror(r < 0 ? errno : EIO));
        h = fnv1a(h, chunk, (size_t)r);
        done += (uint64_t)r;
    }
    *fingerprint = h;
    *model_bytes = size;
    return COLIBRI_OK;
}

colibri_status profile_model_fingerprint(const char *model_path, uint64_t *fingerprint, uint64_t *model_bytes) {
    const int fd = open(model_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "cannot open %s: %s", model_path, strerror(errno));
    const colibri_status st = fingerprint_fd(fd, model_path, fingerprint, model_bytes);
    close(fd);
    return st;
}

static int log2_exact(uint32_t v) {
    int s = 0;
    while ((1u << s) < v) s++;
    return s;
}

/* Checks of the header (b holds its PROFILE_HEADER_BYTES when the file is that long) against
 * model m and the file's size; *want = the size the header implies. */
static colibri_status check_header(const char *path, const unsigned char *b, uint64_t n,
                                   const struct colibri_model *m, uint64_t *want) {
    const model_hparams *hp = &m->hp;
    if (n < PROFILE_HEADER_BYTES + 8)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s is truncated: %llu bytes, the header alone needs %d",
                        path, (unsigned long long)n, PROFILE_HEADER_BYTES + 8);
    if (memcmp(b, PROFILE_MAGIC, 8) != 0)
        return cb_error(COLIBRI_E_FORMAT, "%s is not a routing profile (bad magic)", path);
    const uint32_t version = rd_u32(b + 8);
    if (version != PROFILE_VERSION)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s has version %u; this engine reads version %d", path,
                        version, PROFILE_VERSION);
    const uint32_t n_layer = rd_u32(b + 12), n_expert = rd_u32(b + 16), k = rd_u32(b + 20);
    if (n_layer != (uint32_t)hp->n_layer || n_expert != (uint32_t)hp->n_expert || k != (uint32_t)hp->n_expert_used)
        return cb_error(COLIBRI_E_FORMAT,
                        "routing profile %s is for a model with %u layers, %u experts, top-%u; this model has %d, "
                        "%d, top-%d",
                        path, n_layer, n_expert, k, (int)hp->n_layer, (int)hp->n_expert, (int)hp->n_expert_used);
    const uint32_t n_buckets = rd_u32(b + 24), n_cand = rd_u32(b + 28);
    if (n_buckets < 1 || n_buckets > PROFILE_MAX_BUCKETS || (n_buckets & (n_buckets - 1)) != 0)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s: n_buckets %u is not a power of two in [1, 2^24]", path,
                        n_buckets);
    const uint32_t max_cand = n_expert < PROFILE_MAX_CAND ? n_expert : PROFILE_MAX_CAND;
    if (n_cand < k || n_cand > max_cand)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s: n_cand %u is outside [%u, %u]", path, n_cand, k,
                        max_cand);
    *want = PROFILE_HEADER_BYTES + 4 * (uint64_t)n_layer * n_expert + 2 * (uint64_t)n_buckets * n_layer * n_cand + 8;
    if (n < *want)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s is truncated: %llu bytes, its header says %llu", path,
                        (unsigned long long)n, (unsigned long long)*want);
    if (n > *want)
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s has %llu bytes after its checksum", path,
                        (unsigned long long)(n - *want));
    return COLIBRI_OK;
}

/* All checks on the file's bytes b[0..n); on success fills *p (arrays allocated). */
static colibri_status parse(const char *path, const unsigned char *b, size_t n, const struct colibri_model *m,
                            routing_profile *p) {
    uint64_t want;
    colibri_status st = check_header(path, b, n, m, &want);
    if (st) return st;
    const uint32_t n_layer = rd_u32(b + 12), n_expert = rd_u32(b + 16), k = rd_u32(b + 20);
    const uint32_t n_buckets = rd_u32(b + 24), n_cand = rd_u32(b + 28);
    const uint64_t n_share = (uint64_t)n_layer * n_expert;
    const uint64_t n_cands = (uint64_t)n_buckets * n_layer * n_cand;
    if (fnv1a(FNV_OFFSET, b, n - 8) != rd_u64(b + n - 8))
        return cb_error(COLIBRI_E_FORMAT, "routing profile %s is corrupt: checksum mismatch", path);

    /* the model it was made from: the fingerprint is read from the loaded file itself (the
     * engine's copy holds only the resident tensors, and the path may name another file now) */
    const uint64_t model_bytes = rd_u64(b + 32), fingerprint = rd_u64(b + 40);
    const int mfd = resident_reopen(m, O_RDONLY | O_CLOEXEC);
    if (mfd < 0) return cb_error(COLIBRI_E_IO, "cannot reopen the model %s: %s", m->path, strerror(errno));
    uint64_t have_fp = 0, have_bytes = 0;
    st = fingerprint_fd(mfd, m->path, &have_fp, &have_bytes);
    close(mfd);
    if (st) return st;
    if (model_bytes != m->file.size || fingerprint != have_fp)
        return cb_error(COLIBRI_E_FORMAT,
                        "routing profile %s was made from another model file (%llu bytes, fingerprint %016llx; "
                        "this one has %llu bytes)",
                        path, (unsigned long long)model_bytes, (unsigned long long)fingerprint,
                        (unsigned long long)m->file.size);
    p->n_tokens = rd_u64(b + 48);
    if (p->n_tokens == 0) return cb_error(COLIBRI_E_FORMAT, "routing profile %s was made from no tokens", path);

    p->n_layer = (int)n_layer;
    p->n_expert = (int)n_expert;
    p->k = (int)k;
    p->n_buckets = (int)n_buckets;
    p->n_cand = (int)n_cand;
    p->bucket_shift = 32 - log2_exact(n_buckets);
    p->share = cb_malloc((size_t)n_share * sizeof(float));
    p->cand = cb_malloc((size_t)n_cands * sizeof(uint16_t));
    if (!p->share || !p->cand)
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate routing profile %s (%llu candidate entries)", path,
                        (unsigned long long)n_cands);

    const unsigned char *sp = b + PROFILE_HEADER_BYTES;
    for (uint32_t l = 0; l < n_layer; l++) {
        double sum = 0.0;
        for (uint32_t e = 0; e < n_expert; e++) {
            const float v = rd_f32(sp + 4 * ((size_t)l * n_expert + e));
            if (!isfinite(v) || v < 0.0f || v > 1.0f)
                return cb_error(COLIBRI_E_FORMAT,
                                "routing profile %s: share of expert %u in layer %u is %g, not in [0, 1]", path, e, l,
                                (double)v);
            p->share[(size_t)l * n_expert + e] = v;
            sum += v;
        }
        /* shares are counts / n_tokens rounded to f32: their sum is k up to rounding (0 for a layer
         * without experts, DeepSeek's leading dense ones) */
        const double want = m->layers[l].router.data ? (double)k : 0.0;
        if (fabs(sum - want) > 1e-3 * (double)k)
            return cb_error(COLIBRI_E_FORMAT, "routing profile %s: the shares of layer %u sum to %g, not %g", path, l,
                            sum, want);
    }

    /* candidate ids: below n_expert, no repeats in a row (a bit set over all uint16 ids,
     * cleared again after each row so a row costs O(n_cand)) */
    const unsigned char *cp = sp + 4 * n_share;
    uint64_t seen[65536 / 64];
    memset(seen, 0, sizeof seen);
    for (uint64_t row = 0; row < (uint64_t)n_buckets * n_layer; row++) {
        uint16_t *dst = p->cand + row * n_cand;
        colibri_status bad = COLIBRI_OK;
        uint32_t written = 0;
        for (uint32_t j = 0; j < n_cand && !bad; j++) {
            const unsigned char *q = cp + 2 * (row * n_cand + j);
            const uint16_t id = (uint16_t)(q[0] | q[1] << 8);
            const unsigned bucket = (unsigned)(row / n_layer), layer = (unsigned)(row % n_layer);
            if (id >= n_expert)
                bad = cb_error(COLIBRI_E_FORMAT,
                               "routing profile %s: candidate %u of bucket %u, layer %u is expert %u (the model has "
                               "%u)",
                               path, j, bucket, layer, id, n_expert);
            else if ((seen[id / 64] >> (id % 64)) & 1)
                bad = cb_error(COLIBRI_E_FORMAT,
                               "routing profile %s: expert %u is listed twice among the candidates of bucket %u, "
                               "layer %u",
                               path, id, bucket, layer);
            else {
                seen[id / 64] |= 1ull << (id % 64);
                dst[j] = id;
                written++;
            }
        }
        for (uint32_t j = 0; j < written; j++) seen[dst[j] / 64] = 0;
        if (bad) return bad;
    }
    return COLIBRI_OK;
}

colibri_status profile_load(const char *path, const struct colibri_model *m, routing_profile **out) {
    *out = NULL;
    if (!path) return cb_error(COLIBRI_E_INVALID_ARG, "routing profile path is NULL");
    if (m->hp.n_expert <= 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "routing profile %s given, but the model has no experts", path);
    /* the header and the file size first, so a wrong file (a model, say) is refused before
     * anything its size would make us allocate */
    uint64_t bytes;
    colibri_status st = profile_file_bytes(path, m, &bytes);
    if (st) return st;
    unsigned char *b;
    size_t n;
    if ((st = read_file(path, &b, &n))) return st;
    routing_profile *p = cb_calloc(1, sizeof *p);
    if (!p) {
        cb_free(b);
        return cb_error(COLIBRI_E_NOMEM, "out of memory");
    }
    st = parse(path, b, n, m, p);
    cb_free(b);
    if (st) {
        profile_free(p);
        return st;
    }
    *out = p;
    return COLIBRI_OK;
}

colibri_status profile_file_bytes(const char *path, const struct colibri_model *m, uint64_t *bytes) {
    *bytes = 0;
    if (!path) return cb_error(COLIBRI_E_INVALID_ARG, "routing profile path is NULL");
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "cannot open routing profile %s: %s", path, strerror(errno));
    struct stat sb;
    unsigned char h[PROFILE_HEADER_BYTES];
    memset(h, 0, sizeof h);
    const int ok = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode);
    const ssize_t r = ok ? pread(fd, h, sizeof h, 0) : -1;
    close(fd);
    if (!ok) return cb_error(COLIBRI_E_IO, "routing profile %s is not a regular file", path);
    if (r < 0) return cb_error(COLIBRI_E_IO, "reading routing profile %s: %s", path, strerror(errno));
    uint64_t want;
    const uint64_t size = r < (ssize_t)sizeof h ? (uint64_t)r : (uint64_t)sb.st_size;
    colibri_status st = check_header(path, h, size, m, &want);
    if (st) return st;
    /* loaded, shares and candidates take the bytes they take in the file */
    *bytes = sizeof(routing_profile) + (want - PROFILE_HEADER_BYTES - 8);
    return COLIBRI_OK;
}

void profile_free(routing_profile *p) {
    if (!p) return;
    cb_free(p->share);
    cb_free(p->cand);
    cb_free(p);
}

size_t profile_bytes(const routing_profile *p) {
    if (!p) return 0;
    return sizeof *p + (size_t)p->n_layer * p->n_expert * sizeof(float) +
           (size_t)p->n_buckets * p->n_layer * p->n_cand * sizeof(uint16_t);
}
