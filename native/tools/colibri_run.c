/* colibri-run — the stand-alone runner: a prompt in, a continuation out, no Python needed.
 *
 *   colibri-run MODEL.gguf -p PROMPT [-n N] [--temp T] [--seed S] [-t THREADS] [options]
 *
 * The prompt is tokenized with the GGUF's own byte-level BPE vocabulary (tokenizer.c), run
 * through the model in one batched prefill, then tokens are sampled one at a time and printed
 * as they come. Generation stops after N tokens, at the end-of-sequence token, or at any other
 * control token. Speed goes to stderr. Linked statically against the engine. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"
#include "error.h"
#include "gguf.h"
#include "tokenizer.h"

static void usage(FILE *o, const char *argv0) {
    fprintf(o,
            "usage: %s MODEL.gguf -p PROMPT [options]\n"
            "  -p, --prompt TEXT      prompt text (control tokens such as <|im_start|> are recognised)\n"
            "  -f, --file PATH        read the prompt from a file instead\n"
            "  -n, --n-predict N      tokens to generate (default 128)\n"
            "  -t, --threads N        worker threads (default: all CPUs)\n"
            "  -c, --ctx-size N       context length (default: prompt + N, at most the model's)\n"
            "      --temp T           temperature; 0 = greedy (default 0)\n"
            "      --top-k K          (default 0 = off)\n"
            "      --top-p P          (default 1 = off)\n"
            "      --min-p P          (default 0 = off)\n"
            "      --repeat-penalty R (default 1 = off), over the last 64 tokens\n"
            "      --seed S           sampling seed (default 0)\n"
            "      --chat             wrap the prompt as one user turn of a ChatML template\n"
            "      --system TEXT      system message for --chat\n"
            "      --tokens           print the prompt's token ids and exit (no model needed)\n"
            "      --show-special     print control tokens as text\n",
            argv0);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s) return -1;
    *out = v;
    return 0;
}

static char *read_file(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, fp);
        if (r == 0) break;
        n += r;
    }
    fclose(fp);
    *len = n;
    return buf;
}

typedef struct options {
    const char *model, *prompt, *prompt_file, *system;
    long n_predict, threads, n_ctx;
    colibri_sampler_params sp;
    int chat, tokens_only, show_special;
} options;

static int parse_args(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128;
    colibri_sampler_default_params(&o->sp);
    o->sp.temperature = 0.0f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        long iv;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout, argv[0]);
            exit(0);
        } else if (!strcmp(a, "--chat")) {
            o->chat = 1;
            takes = 0;
        } else if (!strcmp(a, "--tokens")) {
            o->tokens_only = 1;
            takes = 0;
        } else if (!strcmp(a, "--show-special")) {
            o->show_special = 1;
            takes = 0;
        } else if (a[0] != '-') {
            if (o->model) {
                fprintf(stderr, "colibri-run: unexpected argument '%s'\n", a);
                return -1;
            }
            o->model = a;
            takes = 0;
        } else if (!v) {
            fprintf(stderr, "colibri-run: %s needs a value\n", a);
            return -1;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            o->prompt = v;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            o->prompt_file = v;
        } else if (!strcmp(a, "--system")) {
            o->system = v;
        } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            bad = parse_int(v, 0, 1 << 24, &o->n_predict);
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            bad = parse_int(v, 1, 1024, &o->threads);
        } else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) {
            bad = parse_int(v, 1, 1 << 24, &o->n_ctx);
        } else if (!strcmp(a, "--temp")) {
            bad = parse_float(v, &o->sp.temperature);
        } else if (!strcmp(a, "--top-k")) {
            bad = parse_int(v, 0, 1 << 30, &iv);
            o->sp.top_k = (int32_t)iv;
        } else if (!strcmp(a, "--top-p")) {
            bad = parse_float(v, &o->sp.top_p);
        } else if (!strcmp(a, "--min-p")) {
            bad = parse_float(v, &o->sp.min_p);
        } else if (!strcmp(a, "--repeat-penalty")) {
            bad = parse_float(v, &o->sp.repetition_penalty);
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            o->sp.seed = strtoull(v, &end, 10);
            bad = errno || *end || end == v;
        } else {
            fprintf(stderr, "colibri-run: unknown option '%s'\n", a);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "colibri-run: bad value '%s' for %s\n", v, a);
            return -1;
        }
        i += takes;
    }
    if (!o->model || (!o->prompt && !o->prompt_file)) {
        usage(stderr, argv[0]);
        return -1;
    }
    return 0;
}

/* Builds the text to tokenize: the prompt itself, or a ChatML user turn. */
static char *build_text(const options *o, const gguf_file *f, const char *prompt, size_t plen, size_t *out_len) {
    if (!o->chat) {
        char *t = malloc(plen + 1);
        if (t) memcpy(t, prompt, plen);
        *out_len = plen;
        return t;
    }
    const gguf_kv *kv = gguf_find(f, "tokenizer.chat_template");
    int chatml = 0;
    if (kv && kv->type == GGUF_VT_STRING)
        for (uint64_t i = 0; i + 12 <= kv->v.str.len && !chatml; i++)
            chatml = memcmp(kv->v.str.ptr + i, "<|im_start|>", 12) == 0;
    if (!chatml) {
        fprintf(stderr, "colibri-run: --chat supports ChatML templates (<|im_start|>) only; this model's template "
                        "is different or missing\n");
        return NULL;
    }
    size_t cap = plen + (o->system ? strlen(o->system) : 0) + 128;
    char *t = malloc(cap);
    if (!t) return NULL;
    int n = 0;
    if (o->system) n += snprintf(t + n, cap - (size_t)n, "<|im_start|>system\n%s<|im_end|>\n", o->system);
    n += snprintf(t + n, cap - (size_t)n, "<|im_start|>user\n");
    memcpy(t + n, prompt, plen);
    n += (int)plen;
    n += snprintf(t + n, cap - (size_t)n, "<|im_end|>\n<|im_start|>assistant\n");
    *out_len = (size_t)n;
    return t;
}

int main(int argc, char **argv) {
    options o;
    if (parse_args(argc, argv, &o) != 0) return 2;

    int rc = 1;
    gguf_file f;
    cb_tokenizer *tok = NULL;
    colibri_model *model = NULL;
    colibri_context *ctx = NULL;
    colibri_sampler *smp = NULL;
    char *file_prompt = NULL, *text = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    memset(&f, 0, sizeof f);

    const char *prompt = o.prompt;
    size_t plen = prompt ? strlen(prompt) : 0;
    if (o.prompt_file) {
        file_prompt = read_file(o.prompt_file, &plen);
        if (!file_prompt) {
            fprintf(stderr, "colibri-run: cannot read '%s': %s\n", o.prompt_file, strerror(errno));
            return 1;
        }
        prompt = file_prompt;
    }

    colibri_status st = gguf_open(o.model, &f);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: %s: %s\n", colibri_status_name(st), cb_last_error());
        goto out;
    }
    if ((st = tokenizer_load(&f, &tok)) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: %s: %s\n", colibri_status_name(st), cb_last_error());
        goto out;
    }
    size_t tlen = 0;
    text = build_text(&o, &f, prompt, plen, &tlen);
    if (!text) goto out;
    if (tlen > (1u << 28)) {
        fprintf(stderr, "colibri-run: the prompt is %zu bytes; at most 256 MiB is supported\n", tlen);
        goto out;
    }
    int32_t cap = (int32_t)(tlen + 2);
    ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) goto out;
    int32_t n_prompt = tokenizer_encode(tok, text, tlen, tokenizer_add_bos(tok), 1, ids, cap);
    if (n_prompt > cap) {   /* byte fallback produced more tokens than bytes: once more, with room */
        free(ids);
        cap = n_prompt;
        ids = malloc((size_t)cap * sizeof *ids);
        if (!ids) goto out;
        n_prompt = tokenizer_encode(tok, text, tlen, tokenizer_add_bos(tok), 1, ids, cap);
    }
    if (n_prompt < 0) {
        fprintf(stderr, "colibri-run: tokenizer: %s\n", cb_last_error());
        goto out;
    }
    if (o.tokens_only) {
        for (int32_t i = 0; i < n_prompt; i++) printf(i ? " %d" : "%d", (int)ids[i]);
        printf("\n");
        rc = 0;
        goto out;
    }
    if (n_prompt == 0) {
        fprintf(stderr, "colibri-run: the prompt is empty\n");
        goto out;
    }

    if ((st = colibri_model_open(o.model, &model)) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: %s: %s\n", colibri_status_name(st), colibri_last_error());
        goto out;
    }
    colibri_model_info info;
    colibri_model_get_info(model, &info);
    if (info.n_vocab != tokenizer_n_vocab(tok))
        fprintf(stderr, "colibri-run: note: the model has %d logits but the vocabulary %d tokens\n",
                (int)info.n_vocab, (int)tokenizer_n_vocab(tok));
    colibri_context_params cp;
    colibri_context_default_params(&cp);
    cp.n_threads = (int32_t)o.threads;
    long want = o.n_ctx > 0 ? o.n_ctx : (long)n_prompt + o.n_predict;
    if (o.n_ctx <= 0 && info.n_ctx_train > 0 && want > info.n_ctx_train) want = info.n_ctx_train;
    if (want < n_prompt) {
        fprintf(stderr, "colibri-run: the prompt has %d tokens but the context holds %ld\n", (int)n_prompt, want);
        goto out;
    }
    cp.n_ctx = (int32_t)want;
    if ((st = colibri_context_new(model, &cp, &ctx)) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: %s: %s\n", colibri_status_name(st), colibri_last_error());
        goto out;
    }
    if ((st = colibri_sampler_new(&o.sp, info.n_vocab, &smp)) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: sampler: %s\n", colibri_last_error());
        goto out;
    }
    logits = malloc((size_t)info.n_vocab * sizeof *logits);
    if (!logits) goto out;
    for (int32_t i = 0; i < n_prompt; i++) colibri_sampler_accept(smp, ids[i] < info.n_vocab ? ids[i] : 0);

    double t0 = now_s();
    if ((st = colibri_eval(ctx, ids, n_prompt, logits, 0)) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: eval: %s\n", colibri_last_error());
        goto out;
    }
    double t1 = now_s(), t_first = 0;
    long n_gen = 0, room = (long)colibri_context_n_ctx(ctx) - n_prompt;
    long limit = o.n_predict < room ? o.n_predict : room;
    char piece[256];
    while (n_gen < limit) {
        int32_t next;
        if ((st = colibri_sampler_sample(smp, logits, &next)) != COLIBRI_OK) {
            fprintf(stderr, "\ncolibri-run: sampler: %s\n", colibri_last_error());
            goto out;
        }
        n_gen++;
        if (n_gen == 1) t_first = now_s();
        int ty = tokenizer_token_type(tok, next);
        if (next == tokenizer_eos(tok) || ty == TOKEN_TYPE_CONTROL) {
            if (o.show_special) {
                int32_t l = tokenizer_decode(tok, next, 1, piece, sizeof piece);
                if (l > 0) fwrite(piece, 1, (size_t)(l < (int32_t)sizeof piece ? l : (int32_t)sizeof piece), stdout);
            }
            break;
        }
        int32_t l = tokenizer_decode(tok, next, o.show_special, piece, sizeof piece);
        if (l > (int32_t)sizeof piece) {
            char *big = malloc((size_t)l);
            if (big) {
                tokenizer_decode(tok, next, o.show_special, big, (size_t)l);
                fwrite(big, 1, (size_t)l, stdout);
                free(big);
            }
        } else if (l > 0) {
            fwrite(piece, 1, (size_t)l, stdout);
        }
        fflush(stdout);
        colibri_sampler_accept(smp, next);
        if (n_gen == limit) break;
        if ((st = colibri_eval(ctx, &next, 1, logits, 0)) != COLIBRI_OK) {
            fprintf(stderr, "\ncolibri-run: eval: %s\n", colibri_last_error());
            goto out;
        }
    }
    double t2 = now_s();
    printf("\n");
    fflush(stdout);
    double dec_s = t2 - (t_first > 0 ? t_first : t2);
    fprintf(stderr,
            "colibri-run: %s, %d threads, kernels %s\n"
            "  prompt: %d tokens in %.3f s (%.1f tok/s)\n"
            "  generated: %ld tokens, time to first token %.3f s, decode %.1f tok/s\n",
            info.arch, (int)(cp.n_threads > 0 ? cp.n_threads : 0), colibri_cpu_backend(), (int)n_prompt, t1 - t0,
            n_prompt / (t1 - t0 > 0 ? t1 - t0 : 1e-9), n_gen, (t_first > 0 ? t_first : t1) - t0,
            n_gen > 1 && dec_s > 0 ? (double)(n_gen - 1) / dec_s : 0.0);
    rc = 0;
out:
    free(logits);
    free(ids);
    free(text);
    free(file_prompt);
    colibri_sampler_free(smp);
    colibri_context_free(ctx);
    colibri_model_close(model);
    tokenizer_free(tok);
    gguf_close(&f);
    return rc;
}
