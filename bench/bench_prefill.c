/*
 * bench_prefill.c: prefill throughput (tokens/s) of the built-in model (calib/model.h) on real
 * held-out text, against the sgemm rate of the backend the model uses (oneDNN or OpenBLAS, kvcc_model_gemm_name;
 * the OpenBLAS rate of the same shape is printed next to it) measured in the same run
 * (`make bench`; bench/prefill_vs_torch.sh puts it side by side with transformers on torch CPU).
 *
 * Prompts: the first --tokens tokens (no BOS) of each of the first --prompts files of
 * examples/data/heldout/ (sorted by name) that hold that many, tokenized with calib/tokenizer.h.
 * One run = kvcc_state_reset + kvcc_model_prefill(KVCC_LOGITS_LAST) of every prompt; after a
 * warm-up prefill of the first prompt, --reps runs (default 3) are timed; tokens/s is T over the
 * median time of one prompt's prefill (reps x prompts samples; the best is printed too, since a
 * shared machine's load only ever slows a run down). sgemm is measured before and after. Defaults take about 70 s on 2 cores with OpenBLAS's generic kernels.
 * FLOPs per prompt of T tokens (what "fraction of sgemm" divides): 2 x (linear-layer weights per
 * layer: wq, wk, wv, wo, gate, up, down) x layers x T, plus attention 2 x 2 x H x d x T(T+1)/2 per
 * layer (QK^T and AV, causal), plus the LM head once (2 x V x E, last token only).
 *
 * Decode (--decode N, default 0: off): after each timed prefill, the next N tokens of the same
 * text go through kvcc_model_decode one at a time (a decode step: every weight matrix times one
 * row, attention over the growing cache, logits over the vocabulary). tokens/s is N over the
 * median decode time of one prompt. Its limit is memory bandwidth: every step reads all f32
 * weights once, so the ceiling printed is the triad bandwidth measured in the same run divided
 * by the weight bytes per token. The decode GEMV alone (gate/up and lm_head shapes) is measured
 * against cblas_sgemv and the same triad.
 *
 * usage: bench_prefill [--model F] [--prompts N] [--tokens T] [--reps R] [--decode N]
 *                      [--ids-out FILE]
 *   --ids-out FILE  write the prompts' token ids (int32, N x (T + decode), little-endian) for a
 *                   peer run
 *   --precision P   f32 (default) or bf16 (kvcc_model_set_precision; the GEMM reference rate
 *                   stays the f32 sgemm; the decode ceiling counts 2 bytes per weight)
 * Env: KVCC_MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf). Skips (exit 0, one line)
 * when the model file is missing. Prints a machine-readable "RESULT ..." line last.
 */
#include <cblas.h>
#include <dirent.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include <unistd.h>

#include "gguf.h"
#include "model.h"
#include "tokenizer.h"
#if KVCC_WITH_DNNL
#include <dnnl.h>
#endif

#define HELDOUT_DIR "examples/data/heldout"
#define MAX_FILES 64

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        *len = (size_t)n;
    }
    return b;
}

// ---------------------------------------------------------------- triad bandwidth
/* Median GB/s of a[i] = b[i] + s c[i] over 3 x 64 MiB arrays (threads: OpenMP default), counting
 * 3 x 4 bytes per element (no write-allocate). The ceiling a weight-streaming decode step meets. */
static double triad_rate(int runs) {
    const size_t n = (size_t)16 << 20;
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_prefill: out of memory\n");
        exit(1);
    }
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = (float)(i & 1023), c[i] = 1.0f;
    double r[64];
    if (runs > 64) runs = 64;
    for (int k = 0; k < runs; k++) {
        double t0 = now_s();
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
        r[k] = 3.0 * n * sizeof(float) / (now_s() - t0) * 1e-9;
    }
    if (a[n - 1] != b[n - 1] + 0.5f) exit(1); /* keep the stores */
    free(a);
    free(b);
    free(c);
    return median(r, runs);
}

// ---------------------------------------------------------------- sgemm rate
/* C[m,n] = A[m,k] . B[n,k]^T through the backend the model uses (backend 1: oneDNN when built
 * with it) or OpenBLAS (backend 0). */
static void sgemm_nt(int backend, int m, int n, int k, const float *A, const float *B, float *C) {
#if KVCC_WITH_DNNL
    if (backend && dnnl_sgemm('N', 'T', m, n, k, 1.0f, A, k, B, k, 0.0f, C, n) == dnnl_success) return;
#endif
    (void)backend;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, A, k, B, k, 0.0f, C, n);
}

/* Median GFLOP/s of C[m,n] = A[m,k] . B[n,k]^T (the model's NoTrans/Trans call) over `runs`. */
static double sgemm_rate_on(int backend, int m, int n, int k, int runs) {
    float *A = malloc((size_t)m * k * sizeof *A), *B = malloc((size_t)n * k * sizeof *B);
    float *C = malloc((size_t)m * n * sizeof *C);
    if (!A || !B || !C) {
        fprintf(stderr, "bench_prefill: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < (size_t)m * k; i++) A[i] = (float)((i * 7919u) % 1000) * 1e-3f - 0.5f;
    for (size_t i = 0; i < (size_t)n * k; i++) B[i] = (float)((i * 104729u) % 1000) * 1e-3f - 0.5f;
    double r[64];
    if (runs > 64) runs = 64;
    sgemm_nt(backend, m, n, k, A, B, C); /* warm */
    for (int i = 0; i < runs; i++) {
        int inner = 0;
        double t0 = now_s(), t;
        do { /* at least 50 ms per sample */
            sgemm_nt(backend, m, n, k, A, B, C);
            inner++;
        } while ((t = now_s() - t0) < 0.05);
        r[i] = 2.0 * m * n * k * inner / t * 1e-9;
    }
    free(A);
    free(B);
    free(C);
    return median(r, runs);
}
static double sgemm_rate(int m, int n, int k, int runs) { return sgemm_rate_on(1, m, n, k, runs); }

// ---------------------------------------------------------------- GEMV rate
/* Median GB/s (weight bytes / time) of y = W x for W (rows, cols) f32: impl 0 cblas_sgemv, 1 the
 * model's decode GEMV (kvcc_model_gemv_f32). W is larger than the caches for the shapes asked
 * (or cycled through copies so that each call reads from memory). */
static double gemv_rate(int impl, int rows, int cols, int runs) {
    const size_t wn = (size_t)rows * cols;
    const int copies = wn * sizeof(float) >= ((size_t)64 << 20) ? 1 : (int)(((size_t)64 << 20) / (wn * sizeof(float))) + 1;
    float *W = malloc(wn * copies * sizeof *W), *x = malloc((size_t)cols * sizeof *x), *y = malloc((size_t)rows * sizeof *y);
    if (!W || !x || !y) {
        fprintf(stderr, "bench_prefill: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < wn * copies; i++) W[i] = (float)((i * 7919u) % 1000) * 1e-3f - 0.5f;
    for (int i = 0; i < cols; i++) x[i] = (float)(i % 17) * 0.01f;
    double r[64];
    if (runs > 64) runs = 64;
    int c = 0;
    for (int i = 0; i < runs; i++) {
        int inner = 0;
        double t0 = now_s(), t;
        do {
            const float *Wc = W + (size_t)(c++ % copies) * wn;
            if (impl == 0) cblas_sgemv(CblasRowMajor, CblasNoTrans, rows, cols, 1.0f, Wc, cols, x, 1, 0.0f, y, 1);
            else kvcc_model_gemv_f32(1, Wc, rows, cols, x, 0.0f, y);
            inner++;
        } while ((t = now_s() - t0) < 0.05);
        r[i] = (double)wn * sizeof(float) * inner / t * 1e-9;
    }
    free(W);
    free(x);
    free(y);
    return median(r, runs);
}

int main(int argc, char **argv) {
    const char *model_path = getenv("KVCC_MODEL") ? getenv("KVCC_MODEL") : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *ids_out = NULL;
    int n_prompts = 4, T = 512, reps = 3, n_dec = 0, prec = KVCC_PREC_F32;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--model") && v) model_path = argv[++i];
        else if (!strcmp(argv[i], "--prompts") && v) n_prompts = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && v) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--decode") && v) n_dec = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ids-out") && v) ids_out = argv[++i];
        else if (!strcmp(argv[i], "--precision") && v && kvcc_precision_parse(v) >= 0) prec = kvcc_precision_parse(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--model F] [--prompts N] [--tokens T] [--reps R] [--decode N] "
                    "[--ids-out FILE] [--precision f32|bf16]\n", argv[0]);
            return 2;
        }
    }
    if (n_prompts < 1 || n_prompts > MAX_FILES || T < 2 || T > 8192 || reps < 1 || reps > 99 ||
        n_dec < 0 || n_dec > 1024 || T + n_dec > 8192) {
        fprintf(stderr, "bench_prefill: need 1 <= prompts <= %d, 2 <= tokens <= 8192, 1 <= reps <= 99, "
                "0 <= decode <= 1024, tokens + decode <= 8192\n", MAX_FILES);
        return 2;
    }
    if (access(model_path, R_OK) != 0) {
        printf("bench_prefill: skipped (model %s not found; scripts/fetch-model.sh fetches it)\n", model_path);
        return 0;
    }
    const char *ct = getenv("OPENBLAS_CORETYPE");
    printf("bench_prefill: model GEMMs: %s; %d OpenMP threads\n", kvcc_model_gemm_name(), omp_get_max_threads());
    printf("bench_prefill: OpenBLAS %s, core %s, %d threads; OPENBLAS_CORETYPE=%s\n", openblas_get_config(),
           openblas_get_corename(), openblas_get_num_threads(), ct ? ct : "(unset)");

    // ------------------------------------------------------------ model and prompts
    char msg[1024];
    kvcc_gguf *g;
    kvcc_tok *tok;
    kvcc_model *m;
    int st;
    double t0 = now_s();
    if ((st = kvcc_gguf_open(model_path, &g, msg, sizeof msg)) || (st = kvcc_tok_from_gguf(g, &tok, msg, sizeof msg)) ||
        (st = kvcc_model_load_gguf(g, &m, msg, sizeof msg)) || (st = kvcc_model_set_precision(m, prec, msg, sizeof msg))) {
        fprintf(stderr, "bench_prefill: %s (%s)\n", msg, kvcc_gguf_status_str(st));
        return 1;
    }
    kvcc_gguf_close(g);
    double t_load = now_s() - t0;
    DIR *dir = opendir(HELDOUT_DIR);
    if (!dir) {
        fprintf(stderr, "bench_prefill: cannot open %s (run from the repository root)\n", HELDOUT_DIR);
        return 1;
    }
    char *names[MAX_FILES];
    int nf = 0;
    for (struct dirent *e; (e = readdir(dir)) && nf < MAX_FILES;)
        if (strstr(e->d_name, ".txt")) names[nf++] = strdup(e->d_name);
    closedir(dir);
    qsort(names, (size_t)nf, sizeof *names, cmp_str);
    const int TT = T + n_dec; /* tokens per prompt row: prefill, then decode */
    int32_t *ids = malloc((size_t)n_prompts * TT * sizeof *ids);
    int np = 0;
    for (int i = 0; i < nf && np < n_prompts; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", HELDOUT_DIR, names[i]);
        size_t len;
        char *text = read_file(path, &len);
        int32_t *t = NULL;
        size_t n = 0;
        if (text && kvcc_tok_encode(tok, text, len, 0, &t, &n) == 0 && n >= (size_t)TT)
            memcpy(ids + (size_t)np++ * TT, t, (size_t)TT * sizeof *ids);
        free(t);
        free(text);
    }
    for (int i = 0; i < nf; i++) free(names[i]);
    if (np < n_prompts) {
        fprintf(stderr, "bench_prefill: only %d files of %s hold %d tokens (asked %d prompts)\n", np, HELDOUT_DIR, TT,
                n_prompts);
        return 1;
    }
    if (ids_out) {
        FILE *f = fopen(ids_out, "wb");
        if (!f || fwrite(ids, sizeof *ids, (size_t)np * TT, f) != (size_t)np * TT || fclose(f)) {
            fprintf(stderr, "bench_prefill: cannot write %s\n", ids_out);
            return 1;
        }
    }

    // ------------------------------------------------------------ FLOPs
    const kvcc_model_hparams *hp = &m->hp;
    double E = hp->n_embd, F = hp->n_ff, H = hp->n_head, Hkv = hp->n_head_kv, d = hp->head_dim, V = hp->n_vocab;
    double lin = E * (H * d) * 2 + E * (Hkv * d) * 2 + 3 * E * F; /* wq, wo, wk, wv, gate, up, down */
    double flops_prompt = hp->n_layer * (2 * lin * T + 4 * H * d * (double)T * (T + 1) / 2) + 2 * V * E;
    printf("bench_prefill: %s: %d layers, E %d, F %d, H %d, Hkv %d, d %d, V %d (loaded in %.2fs); %d prompts x %d "
           "tokens; %.1f MFLOP/token (linear %.1f, attention %.1f, head %.2f); precision %s, weights %.1f MB\n",
           m->name, hp->n_layer, hp->n_embd, hp->n_ff, hp->n_head, hp->n_head_kv, hp->head_dim, hp->n_vocab, t_load,
           np, T, flops_prompt / T * 1e-6, 2 * lin * hp->n_layer * 1e-6,
           hp->n_layer * 4 * H * d * (T + 1) / 2.0 * 1e-6, 2 * V * E / T * 1e-6, kvcc_precision_name(prec),
           m->weight_bytes * 1e-6);

    // ------------------------------------------------------------ sgemm rate
    struct { int m, n, k; const char *what; } shapes[] = {
        {512, 1536, 576, "[512 x 576] x [576 x 1536] (gate/up)"},
        {512, 576, 1536, "[512 x 1536] x [1536 x 576] (down)"},
        {256, 1536, 576, "[256 x 576] x [576 x 1536] (one prefill chunk)"},
    };
    double rates[3];
    for (int i = 0; i < 3; i++) {
        rates[i] = sgemm_rate(shapes[i].m, shapes[i].n, shapes[i].k, 7);
#if KVCC_WITH_DNNL
        const double ob = sgemm_rate_on(0, shapes[i].m, shapes[i].n, shapes[i].k, 7);
        printf("sgemm %-46s %7.1f GFLOP/s oneDNN (the model's), %7.1f OpenBLAS (median of 7)\n", shapes[i].what,
               rates[i], ob);
#else
        printf("sgemm %-46s %7.1f GFLOP/s OpenBLAS (the model's; median of 7)\n", shapes[i].what, rates[i]);
#endif
    }

    // ------------------------------------------------------------ prefill
    kvcc_state *s;
    if (kvcc_state_create(m, TT, &s)) {
        fprintf(stderr, "bench_prefill: out of memory\n");
        return 1;
    }
    float *logits = malloc((size_t)hp->n_vocab * sizeof *logits);
    double *sec = malloc((size_t)reps * np * sizeof *sec), *runs = malloc((size_t)reps * sizeof *runs);
    double *dsec = malloc((size_t)reps * np * sizeof *dsec);
    kvcc_state_reset(s); /* warm-up: one prompt (page faults, OpenBLAS buffers, OpenMP pool) */
    if (!sec || !runs || !dsec || (st = kvcc_model_prefill(m, s, ids, T, logits, KVCC_LOGITS_LAST))) {
        fprintf(stderr, "bench_prefill: prefill failed (%d)\n", st);
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        runs[r] = 0;
        for (int p = 0; p < np; p++) {
            kvcc_state_reset(s);
            double a = now_s();
            if ((st = kvcc_model_prefill(m, s, ids + (size_t)p * TT, T, logits, KVCC_LOGITS_LAST))) {
                fprintf(stderr, "bench_prefill: prefill failed (%d)\n", st);
                return 1;
            }
            sec[r * np + p] = now_s() - a;
            runs[r] += sec[r * np + p];
            a = now_s();
            for (int i = 0; i < n_dec; i++)
                if ((st = kvcc_model_decode(m, s, ids[(size_t)p * TT + T + i], logits))) {
                    fprintf(stderr, "bench_prefill: decode failed (%d)\n", st);
                    return 1;
                }
            dsec[r * np + p] = now_s() - a;
        }
    }
    /* the machine's limit again after the prefill runs: the higher of the two medians counts */
    double rate_after = sgemm_rate(shapes[0].m, shapes[0].n, shapes[0].k, 7);
    printf("sgemm %-46s %7.1f GFLOP/s (again, after the prefill runs)\n", shapes[0].what, rate_after);
    double rate = rate_after > rates[0] ? rate_after : rates[0];
    int ns = reps * np;
    double med = T / median(sec, ns), best = T / sec[0], worst = T / sec[ns - 1]; /* sorted by median() */
    double gflops = med / T * flops_prompt * 1e-9;
    printf("prefill (ours): %.1f tokens/s median of %d prefills (%d runs x %d prompts; best %.1f, worst %.1f), "
           "%.3f s per %d-token prompt; %.1f GFLOP/s = %.0f%% of the [512 x 576] x [576 x 1536] sgemm rate "
           "(%.1f GFLOP/s)\n",
           med, ns, reps, np, best, worst, T / med, T, gflops, 100 * gflops / rate, rate);
    if (n_dec > 0) {
        /* weights read once per step: the linear layers of every layer plus the LM head, 4 bytes
         * each in f32, 2 in bf16 */
        const double wbytes = (lin * hp->n_layer + V * E) * (prec == KVCC_PREC_BF16 ? 2 : 4);
        const double bw = triad_rate(7);
        struct { int rows, cols; const char *what; } gs[] = {{hp->n_ff, hp->n_embd, "gate/up"},
                                                             {hp->n_vocab, hp->n_embd, "lm_head"}};
        for (int i = 0; i < 2; i++) {
            const double ours = gemv_rate(1, gs[i].rows, gs[i].cols, 7), ob = gemv_rate(0, gs[i].rows, gs[i].cols, 7);
            printf("gemv %-8s %5d x %-4d: ours %.1f GB/s = %.0f%% of triad, cblas_sgemv %.1f GB/s = %.0f%% (median of 7)\n",
                   gs[i].what, gs[i].rows, gs[i].cols, ours, 100 * ours / bw, ob, 100 * ob / bw);
        }
        const double dmed = n_dec / median(dsec, ns), dbest = n_dec / dsec[0];
        printf("triad: %.1f GB/s (median of 7, 3 x 64 MiB); decode ceiling %.1f tokens/s = triad / "
               "%.1f MB of %s weights per token\n", bw, bw * 1e9 / wbytes, wbytes * 1e-6, kvcc_precision_name(prec));
        printf("decode (ours): %.1f tokens/s median of %d x %d steps after a %d-token prefill (best "
               "%.1f); %.0f%% of the triad ceiling\n", dmed, ns, n_dec, T, dbest,
               100 * dmed / (bw * 1e9 / wbytes));
        printf("RESULT_DECODE tokens_per_s=%.2f best_tokens_per_s=%.2f triad_gbps=%.2f ceiling=%.2f "
               "steps=%d\n", dmed, dbest, bw, bw * 1e9 / wbytes, n_dec);
    }
    printf("RESULT tokens_per_s=%.2f best_tokens_per_s=%.2f gflops=%.2f sgemm_gflops=%.2f fraction=%.3f prompts=%d "
           "tokens=%d reps=%d precision=%s\n", med, best, gflops, rate, gflops / rate, np, T, reps, kvcc_precision_name(prec));
    free(sec);
    free(dsec);
    free(runs);
    free(logits);
    free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(tok);
    kvcc_model_free(m);
    return 0;
}
