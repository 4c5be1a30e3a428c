/* colibri-run — the stand-alone runner: a prompt in, a continuation out, no Python needed.
 *
 *   colibri-run MODEL.gguf -p PROMPT [-n N] [--temp T] [--seed S] [-t THREADS] [options]
 *
 * The prompt is tokenized with the GGUF's own vocabulary (tokenizer.c), optionally wrapped as
 * one chat turn in the model's template family (chat_template.c), run through the model in one
 * batched prefill, then tokens are sampled one at a time and printed as they come. Generation
 * stops after N tokens or at an end-of-generation token (tokenizer_is_eog: EOS, an end-of-turn control token;
 * for gpt-oss <|return|> or <|call|>, not <|end|>); other control tokens are not printed. Speed (and
 * with --stats the engine's counters) goes to stderr. Linked against the static engine library;
 * with -DCOLIBRI_STATIC_RUN=ON the executable itself is static (docs/portability.md). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "chat_template.h"
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
            "      --chat             wrap the prompt as one user turn of the model's chat template\n"
            "                         (ChatML, Llama 3, Llama 2, Mistral, Gemma families)\n"
            "      --chat-format F    render --chat as family F (chatml, llama3, llama2, mistral,\n"
            "                         mistral-v3, gemma) whatever tokenizer.chat_template says\n"
            "      --system TEXT      system message for --chat\n"
            "      --print-prompt     print the text that would be tokenized and exit\n"
            "      --tokens           print the prompt's token ids and exit (no model needed)\n"
            "      --show-special     print control tokens as text\n"
            "memory and expert streaming (docs/memory.md):\n"
            "      --memory-budget S  bytes the engine may hold: 512M, 1.5G, bytes; 0 = unlimited (default)\n"
            "      --expert-slots N   expert slots, as a count or a share such as 40%%\n"
            "      --expert-policy P  reuse (default), lfu or lru\n"
            "      --prefetch LIST    lookahead, temporal, hashed (comma list), both, all or none\n"
            "      --lookahead-depth N layers the lookahead predictor looks ahead (1..8)\n"
            "      --routing-profile PATH  a routing profile written by `colibri profile`\n"
            "      --pin-experts N    keep the profile's N hottest experts resident\n"
            "      --kv-type T        f16 (default) or int8\n"
            "      --stats            print the engine's counters (memory, expert store) at the end\n"
            "      --warmup           run the prompt and one decode step once, untimed, and start again from an\n"
            "                         empty context (as llama-bench's warmup run): the timed figures then leave\n"
            "                         out first-run costs; the warmup's own prefill speed is printed too\n"
            "      --cpu-backend NAME kernel set (scalar, avx2, avx512, neon, neon-dotprod, neon-i8mm)\n"
            "      --dump-logits PATH write the float32 logits every sampled token came from\n",
            argv0);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The prompt, then one decode step where the context has room (the prompt's first token again: any
 * token does), untimed; then the context is emptied and the counters zeroed, so the timed run starts as
 * the first one did, less what a first run pays once (first touches of the scratch and the caches, cold
 * processor caches). An expert store keeps the experts the warmup read, as the page cache keeps a
 * file's pages for llama-bench's warmup. */
static colibri_status warmup(colibri_context *ctx, const int32_t *ids, int32_t n_prompt, float *logits) {
    const double t0 = now_s();
    colibri_status st = colibri_eval(ctx, ids, n_prompt, logits, 0);
    const double t1 = now_s();
    if (st == COLIBRI_OK && colibri_context_n_ctx(ctx) > n_prompt) st = colibri_eval(ctx, ids, 1, logits, 0);
    if (st == COLIBRI_OK) st = colibri_truncate(ctx, 0);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: warmup: %s\n", colibri_last_error());
        return st;
    }
    colibri_reset_stats(ctx);
    fprintf(stderr, "colibri-run: warmup prompt: %d tokens in %.3f s (%.1f tok/s), not counted below\n", (int)n_prompt,
            t1 - t0, n_prompt / (t1 - t0 > 0 ? t1 - t0 : 1e-9));
    return COLIBRI_OK;
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

/* Bytes of a size such as 512M, 1.5G, 2GiB or 1048576 (binary units, as the Python CLI reads
 * them); 0, none, unlimited, off = no limit. */
static int parse_size(const char *s, uint64_t *out) {
    static const char *const unlimited[] = {"0", "none", "unlimited", "off"};
    for (size_t i = 0; i < sizeof unlimited / sizeof unlimited[0]; i++)
        if (strcasecmp(s, unlimited[i]) == 0) {
            *out = 0;
            return 0;
        }
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0) || s[0] == '-' || s[0] == '+') return -1;
    double unit = 1;
    switch (*end) {
    case 'k': case 'K': unit = 1024.0, end++; break;
    case 'm': case 'M': unit = 1048576.0, end++; break;
    case 'g': case 'G': unit = 1073741824.0, end++; break;
    case 't': case 'T': unit = 1099511627776.0, end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return -1;
    v *= unit;
    if ((v < 1 && v != 0) || v >= 1.8e19) return -1;
    *out = (uint64_t)v;
    return 0;
}

static int parse_prefetch(const char *s, int32_t *out) {
    if (!strcasecmp(s, "none") || !strcasecmp(s, "off") || !*s) return *out = COLIBRI_PREFETCH_NONE, 0;
    if (!strcasecmp(s, "both")) return *out = COLIBRI_PREFETCH_LOOKAHEAD | COLIBRI_PREFETCH_TEMPORAL, 0;
    if (!strcasecmp(s, "all"))
        return *out = COLIBRI_PREFETCH_LOOKAHEAD | COLIBRI_PREFETCH_TEMPORAL | COLIBRI_PREFETCH_HASHED, 0;
    int32_t flags = 0;
    const char *p = s;
    while (*p) {
        size_t n = strcspn(p, ",");
        if (n == 9 && !strncasecmp(p, "lookahead", 9)) flags |= COLIBRI_PREFETCH_LOOKAHEAD;
        else if (n == 8 && !strncasecmp(p, "temporal", 8)) flags |= COLIBRI_PREFETCH_TEMPORAL;
        else if (n == 6 && !strncasecmp(p, "hashed", 6)) flags |= COLIBRI_PREFETCH_HASHED;
        else return -1;
        p += n;
        if (*p == ',') p++;
    }
    *out = flags;
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
    const char *model, *prompt, *prompt_file, *system, *chat_format, *cpu_backend, *dump_logits;
    const char *expert_slots;  /* a count or "P%", resolved against the model */
    long n_predict, threads, n_ctx;
    colibri_sampler_params sp;
    colibri_context_params cp;  /* the memory options; threads and n_ctx are set later */
    int chat, tokens_only, show_special, print_prompt, stats, warmup;
} options;

static int parse_args(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128;
    colibri_sampler_default_params(&o->sp);
    o->sp.temperature = 0.0f;
    colibri_context_default_params(&o->cp);
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
        } else if (!strcmp(a, "--print-prompt")) {
            o->print_prompt = 1;
            takes = 0;
        } else if (!strcmp(a, "--stats")) {
            o->stats = 1;
            takes = 0;
        } else if (!strcmp(a, "--warmup")) {
            o->warmup = 1;
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
        } else if (!strcmp(a, "--chat-format")) {
            o->chat_format = v;
            o->chat = 1;
        } else if (!strcmp(a, "--cpu-backend")) {
            o->cpu_backend = v;
        } else if (!strcmp(a, "--dump-logits")) {
            o->dump_logits = v;
        } else if (!strcmp(a, "--memory-budget")) {
            bad = parse_size(v, &o->cp.memory_budget);
        } else if (!strcmp(a, "--expert-slots")) {
            o->expert_slots = v;
        } else if (!strcmp(a, "--expert-policy")) {
            if (!strcasecmp(v, "lfu")) o->cp.expert_policy = COLIBRI_POLICY_LFU;
            else if (!strcasecmp(v, "lru")) o->cp.expert_policy = COLIBRI_POLICY_LRU;
            else if (!strcasecmp(v, "reuse")) o->cp.expert_policy = COLIBRI_POLICY_REUSE;
            else bad = 1;
        } else if (!strcmp(a, "--prefetch")) {
            bad = parse_prefetch(v, &o->cp.prefetch);
        } else if (!strcmp(a, "--lookahead-depth")) {
            bad = parse_int(v, 1, 8, &iv);
            o->cp.lookahead_depth = (int32_t)iv;
        } else if (!strcmp(a, "--routing-profile")) {
            o->cp.routing_profile = v;
        } else if (!strcmp(a, "--pin-experts")) {
            bad = parse_int(v, 0, 1 << 30, &iv);
            o->cp.pin_experts = (int32_t)iv;
        } else if (!strcmp(a, "--kv-type")) {
            if (!strcasecmp(v, "f16")) o->cp.kv_type = COLIBRI_KV_F16;
            else if (!strcasecmp(v, "int8")) o->cp.kv_type = COLIBRI_KV_INT8;
            else bad = 1;
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

/* The template family --chat renders: --chat-format if given, else what the GGUF's
 * tokenizer.chat_template looks like. Prints why and returns UNKNOWN when neither works. */
static chat_format chat_format_of(const options *o, const gguf_file *f) {
    if (o->chat_format) {
        static const chat_format all[] = {CHAT_FORMAT_CHATML, CHAT_FORMAT_LLAMA3, CHAT_FORMAT_LLAMA2,
                                          CHAT_FORMAT_MISTRAL, CHAT_FORMAT_MISTRAL_TIGHT, CHAT_FORMAT_GEMMA};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (!strcmp(o->chat_format, chat_format_name(all[i]))) return all[i];
        fprintf(stderr, "colibri-run: unknown --chat-format '%s' (expected chatml, llama3, llama2, mistral, "
                        "mistral-v3 or gemma)\n", o->chat_format);
        return CHAT_FORMAT_UNKNOWN;
    }
    const gguf_kv *kv = gguf_find(f, "tokenizer.chat_template");
    if (!kv || kv->type != GGUF_VT_STRING) {
        fprintf(stderr, "colibri-run: --chat: this model has no tokenizer.chat_template; name its format with "
                        "--chat-format, or pass the formatted prompt with -p\n");
        return CHAT_FORMAT_UNKNOWN;
    }
    chat_format fmt = chat_format_detect(kv->v.str.ptr, kv->v.str.len);
    if (fmt == CHAT_FORMAT_UNKNOWN)
        fprintf(stderr, "colibri-run: --chat: cannot render this model's chat template (the built-in renderer "
                        "knows ChatML, Llama 3, Llama 2, Mistral and Gemma); name a format with --chat-format, "
                        "or pass the formatted prompt with -p\n");
    return fmt;
}

/* Builds the text to tokenize: the prompt itself, or one chat turn. */
static char *build_text(const options *o, const gguf_file *f, const char *prompt, size_t plen, size_t *out_len) {
    if (!o->chat) {
        char *t = malloc(plen + 1);
        if (t) memcpy(t, prompt, plen);
        *out_len = plen;
        return t;
    }
    chat_format fmt = chat_format_of(o, f);
    if (fmt == CHAT_FORMAT_UNKNOWN) return NULL;
    char *t = NULL;
    if (chat_render(fmt, o->system, prompt, plen, &t, out_len) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: %s\n", cb_last_error());
        return NULL;
    }
    return t;
}

/* --expert-slots: a count, or a share of the model's routed experts rounded up (at least top-k),
 * as the Python CLI resolves it. -1 with a message when it does not fit the model. */
static long resolve_expert_slots(const char *spec, const colibri_model_info *info) {
    const long total = (long)info->n_layer * info->n_expert, k = info->n_expert_used;
    size_t n = strlen(spec);
    long slots;
    if (n > 1 && spec[n - 1] == '%') {
        char *end;
        errno = 0;
        double pct = strtod(spec, &end);
        if (errno || end != spec + n - 1 || !(pct > 0 && pct <= 100)) {
            fprintf(stderr, "colibri-run: --expert-slots %s: a share must be in (0%%, 100%%]\n", spec);
            return -1;
        }
        double want = (double)total * pct / 100.0 - 1e-9;
        slots = (long)want;
        if ((double)slots < want) slots++;
        if (slots < k) slots = k;
    } else if (parse_int(spec, 0, 1 << 30, &slots) != 0) {
        fprintf(stderr, "colibri-run: --expert-slots %s is not a number of experts or a share such as 40%%\n", spec);
        return -1;
    }
    if (slots == 0) return 0;
    if (total == 0) {
        fprintf(stderr, "colibri-run: --expert-slots is for mixture-of-experts models; this one has no routed "
                        "experts\n");
        return -1;
    }
    if (slots < k || slots > total) {
        fprintf(stderr, "colibri-run: --expert-slots %ld: must be between the top-%ld and the model's %ld experts\n",
                slots, k, total);
        return -1;
    }
    return slots;
}

static void print_stats(const colibri_context *ctx) {
    colibri_stats s;
    if (colibri_get_stats(ctx, &s) != COLIBRI_OK) return;
    fprintf(stderr,
            "colibri-run: stats\n"
            "  tokens: %" PRIu64 " prompt in %.3f s, %" PRIu64 " decode in %.3f s, %" PRIu64 " eval calls\n"
            "  memory: budget %" PRIu64 " B, planned %" PRIu64 " B, weights %" PRIu64 " B, KV %" PRIu64
            " B, scratch %" PRIu64 " B (peak %" PRIu64 " B)\n"
            "  heap allocations: %" PRIu64 " in all, %" PRIu64 " in the last eval\n",
            s.n_prompt_tokens, s.prefill_seconds, s.n_decode_tokens, s.decode_seconds, s.n_eval_calls,
            s.memory_budget, s.planned_bytes, s.weight_bytes, s.kv_bytes, s.scratch_bytes, s.scratch_peak_bytes,
            s.allocs_total, s.allocs_last_eval);
    if (s.expert_slots == 0) {
        fprintf(stderr, "  experts: all resident (no expert store)\n");
        return;
    }
    const double hit = s.expert_calls ? 100.0 * (double)s.expert_hits / (double)s.expert_calls : 0.0;
    fprintf(stderr,
            "  experts: %" PRIu64 " slots, %" PRIu64 " calls, %" PRIu64 " hits (%.1f%%), %" PRIu64
            " misses, %" PRIu64 " B read, stall %.3f s (decode %.3f s)\n"
            "  prefetch: %" PRIu64 " issued, %" PRIu64 " used, %" PRIu64 " wasted; %d pinned\n",
            s.expert_slots, s.expert_calls, s.expert_hits, hit, s.expert_misses, s.expert_bytes_read,
            s.expert_stall_seconds, s.expert_stall_decode_seconds, s.prefetch_issued, s.prefetch_used,
            s.prefetch_wasted, (int)s.experts_pinned);
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
    FILE *dump = NULL;
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
    if (tokenizer_unknown_pre(tok))
        fprintf(stderr, "colibri-run: warning: tokenizer.ggml.pre '%s' is not known; the prompt is split as gpt2 "
                "splits it, which may give other ids than the model's tokenizer\n", tokenizer_unknown_pre(tok));
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
    if (o.print_prompt) {
        fwrite(text, 1, tlen, stdout);
        rc = 0;
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

    if (o.cpu_backend && colibri_set_cpu_backend(o.cpu_backend) != COLIBRI_OK) {
        fprintf(stderr, "colibri-run: --cpu-backend: %s\n", colibri_last_error());
        goto out;
    }
    if (o.dump_logits && !(dump = fopen(o.dump_logits, "wb"))) {
        fprintf(stderr, "colibri-run: cannot write '%s': %s\n", o.dump_logits, strerror(errno));
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
    colibri_context_params cp = o.cp;
    if (o.expert_slots) {
        long slots = resolve_expert_slots(o.expert_slots, &info);
        if (slots < 0) goto out;
        cp.expert_slots = (int32_t)slots;
    }
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

    if (o.warmup && warmup(ctx, ids, n_prompt, logits) != COLIBRI_OK) goto out;
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
        if (dump && fwrite(logits, sizeof *logits, (size_t)info.n_vocab, dump) != (size_t)info.n_vocab) {
            fprintf(stderr, "\ncolibri-run: writing '%s' failed: %s\n", o.dump_logits, strerror(errno));
            goto out;
        }
        if ((st = colibri_sampler_sample(smp, logits, &next)) != COLIBRI_OK) {
            fprintf(stderr, "\ncolibri-run: sampler: %s\n", colibri_last_error());
            goto out;
        }
        n_gen++;
        if (n_gen == 1) t_first = now_s();
        if (tokenizer_is_eog(tok, next)) {
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
            info.arch, (int)(cp.n_threads > 0 ? cp.n_threads : sysconf(_SC_NPROCESSORS_ONLN)), colibri_cpu_backend(), (int)n_prompt, t1 - t0,
            n_prompt / (t1 - t0 > 0 ? t1 - t0 : 1e-9), n_gen, (t_first > 0 ? t_first : t1) - t0,
            n_gen > 1 && dec_s > 0 ? (double)(n_gen - 1) / dec_s : 0.0);
    if (o.stats) print_stats(ctx);
    if (dump && fclose(dump) != 0) {
        dump = NULL;
        fprintf(stderr, "colibri-run: writing '%s' failed: %s\n", o.dump_logits, strerror(errno));
        goto out;
    }
    dump = NULL;
    rc = 0;
out:
    if (dump) fclose(dump);
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
