/*
 * bench_corpus.c: corpus read throughput and peak memory of the streaming reader (calib/corpus.h)
 * (`make bench`). Checks the promise of docs/corpus-format.md: the reader holds one
 * (prompt, layer) at a time, so its peak memory does not grow with the number of prompts.
 *
 * Corpora: synthetic (calib/synth.h kvcc_synth_write) with the smollm2-135m preset's shape
 * (30 layers, 9 heads, 3 KV heads, d 64), 512 context + 64 continuation tokens, f16, 4 and 32
 * prompts, written once into --dir (default build/bench/) and reused while their options match.
 * Each size is read in its own forked child (its peak RSS is reset with /proc/self/clear_refs
 * after a warm-up read of prompt 0 and read from VmHWM, so the two sizes do not share a
 * high-water mark and library pages faulted in late do not count as growth): kvcc_corpus_open, then
 * every prompt's tokens and every (prompt, layer)'s q, k, v via kvcc_corpus_read_layer into one
 * reused set of buffers; --runs passes, median MB/s. MB/s counts decoded activations (f32 bytes
 * delivered, 1 MB = 1e6 bytes); the f16 payload rate is half of it. Also reads build/demo/corpus.h5
 * (a corpus captured from the real model by `make demo`) when it exists.
 *
 * usage: bench_corpus [--dir D] [--runs R] [--real F]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>

#include "bench_util.h"
#include <unistd.h>

#include "corpus.h"
#include "presets.h"
#include "synth.h"

/* A field of /proc/self/status in kB, or -1. */
static long proc_kb(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') {
            v = atol(line + n + 1);
            break;
        }
    fclose(f);
    return v;
}

/* Reset the peak RSS (VmHWM) to the current RSS; 0 on success (Linux >= 4.0). */
static int reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return -1;
    int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

typedef struct {
    int ok;
    double mbps;          /* median decoded MB/s */
    double mb;            /* decoded MB per pass */
    double seconds;       /* median seconds per pass */
    long rss0_kb;         /* RSS before opening */
    long hwm_kb;          /* peak RSS while reading */
    long hwm8_kb;         /* peak RSS after the first 8 prompts of the first pass (or all, if fewer) */
    long maxrss_kb;       /* getrusage ru_maxrss at the end (may include the pre-fork parent) */
    int peak_reset;       /* clear_refs worked */
    uint32_t prompts, layers, tokens;
    char msg[600];
} read_result;

/* Child: stream the whole corpus `runs` times. */
static read_result read_all(const char *path, int runs) {
    read_result r = {0};
    char err[512];
    kvcc_corpus *c;
    int rc = kvcc_corpus_open(&c, path, NULL, err, sizeof err);
    if (rc) {
        snprintf(r.msg, sizeof r.msg, "%s [%s]", err, kvcc_corpus_status_name(rc));
        return r;
    }
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const kvcc_corpus_info *in = kvcc_corpus_get_info(c);
    r.prompts = in->n_prompts;
    r.layers = m->n_layers;
    uint32_t maxT = 0;
    for (uint32_t p = 0; p < in->n_prompts; p++) {
        kvcc_corpus_prompt_info pi;
        if ((rc = kvcc_corpus_prompt(c, p, &pi, NULL, NULL))) goto fail;
        if (pi.n_tokens > maxT) maxT = pi.n_tokens;
        r.tokens += pi.n_tokens;
    }
    size_t nq = (size_t)maxT * m->n_heads * m->head_dim, nk = (size_t)maxT * m->n_kv_heads * m->head_dim;
    float *q = malloc(nq * sizeof *q), *k = malloc(nk * sizeof *k), *v = malloc(nk * sizeof *v);
    int32_t *tok = malloc(maxT * sizeof *tok);
    float *lp = malloc(maxT * sizeof *lp);
    if (!q || !k || !v || !tok || !lp) {
        snprintf(r.msg, sizeof r.msg, "out of memory");
        return r;
    }
    /* warm-up: prompt 0, every layer (faults in library code, HDF5's caches, the buffers); then the
     * peak is reset, so growth below is what the remaining prompts add */
    for (uint32_t l = 0; l < m->n_layers && in->n_prompts; l++)
        if ((rc = kvcc_corpus_read_layer(c, 0, l, q, k, v))) goto fail;
    r.peak_reset = reset_peak() == 0;
    r.rss0_kb = proc_kb("VmRSS");
    double sec[64];
    if (runs > 64) runs = 64;
    double bytes = 0;
    for (int run = 0; run < runs; run++) {
        bytes = 0;
        double t0 = now_s();
        for (uint32_t p = 0; p < in->n_prompts; p++) {
            kvcc_corpus_prompt_info pi;
            if ((rc = kvcc_corpus_prompt(c, p, &pi, tok, lp))) goto fail;
            for (uint32_t l = 0; l < m->n_layers; l++) {
                if ((rc = kvcc_corpus_read_layer(c, p, l, q, k, v))) goto fail;
                bytes += (double)pi.n_tokens * (m->n_heads + 2.0 * m->n_kv_heads) * m->head_dim * sizeof(float);
            }
            if (run == 0 && (p == 7 || p + 1 == in->n_prompts) && !r.hwm8_kb) r.hwm8_kb = proc_kb("VmHWM");
        }
        sec[run] = now_s() - t0;
    }
    r.seconds = median(sec, runs);
    r.mb = bytes * 1e-6;
    r.mbps = r.mb / r.seconds;
    r.hwm_kb = proc_kb("VmHWM");
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    r.maxrss_kb = ru.ru_maxrss;
    r.ok = 1;
    free(q);
    free(k);
    free(v);
    free(tok);
    free(lp);
    kvcc_corpus_close(c);
    return r;
fail:
    snprintf(r.msg, sizeof r.msg, "%s [%s]", kvcc_corpus_error(c), kvcc_corpus_status_name(rc));
    kvcc_corpus_close(c);
    return r;
}

/* Fork, read in the child, pass the result back through a pipe. */
static read_result measure(const char *path, int runs) {
    read_result r = {0};
    int fd[2];
    fflush(stdout);
    if (pipe(fd) != 0) {
        snprintf(r.msg, sizeof r.msg, "pipe failed");
        return r;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        read_result cr = read_all(path, runs);
        ssize_t w = write(fd[1], &cr, sizeof cr);
        _exit(w == (ssize_t)sizeof cr ? 0 : 1);
    }
    close(fd[1]);
    if (pid < 0 || read(fd[0], &r, sizeof r) != (ssize_t)sizeof r) {
        memset(&r, 0, sizeof r);
        snprintf(r.msg, sizeof r.msg, "the reader child failed");
    }
    close(fd[0]);
    if (pid > 0) waitpid(pid, NULL, 0);
    return r;
}

static void print_result(const char *label, const char *path, const read_result *r) {
    if (!r->ok) {
        printf("%-10s %s: FAILED: %s\n", label, path, r->msg);
        return;
    }
    printf("%-10s %u prompts x %u layers, %u tokens: %.1f MB decoded in %.2f s: %.0f MB/s (f32 out); "
           "RSS %.1f MB after a warm-up prompt, peak %.1f MB (+%.1f MB)%s\n",
           label, r->prompts, r->layers, r->tokens, r->mb, r->seconds, r->mbps, r->rss0_kb / 1024.0,
           r->hwm_kb / 1024.0, (r->hwm_kb - r->rss0_kb) / 1024.0,
           r->peak_reset ? "" : " (peak not reset: includes the parent's)");
}

/* Make path a synthetic corpus of n prompts unless one with the same options is there. */
static int ensure_corpus(const char *path, const kvcc_corpus_model *m, const kvcc_synth_opts *o) {
    char options[256], err[512];
    snprintf(options, sizeof options, "bench_corpus: model=%s prompts=%u context=%u continuation=%u seed=%llu dtype=f16",
             m->name, o->n_prompts, o->context_len, o->continuation_len, (unsigned long long)o->seed);
    kvcc_corpus *c;
    if (kvcc_corpus_open(&c, path, m, err, sizeof err) == 0) {
        int same = !strcmp(kvcc_corpus_get_info(c)->options, options);
        kvcc_corpus_close(c);
        if (same) return 0;
    }
    double t0 = now_s();
    int rc = kvcc_synth_write(path, m, o, options, NULL, err, sizeof err);
    if (rc) {
        fprintf(stderr, "bench_corpus: %s [%s]\n", err, kvcc_corpus_status_name(rc));
        return 1;
    }
    printf("bench_corpus: wrote %s (%u prompts, %.1fs)\n", path, o->n_prompts, now_s() - t0);
    return 0;
}

int main(int argc, char **argv) {
    const char *dir = "build/bench", *real = "build/demo/corpus.h5";
    int runs = 3;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--dir") && v) dir = argv[++i];
        else if (!strcmp(argv[i], "--runs") && v) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--real") && v) real = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--dir D] [--runs R] [--real F]\n", argv[0]);
            return 2;
        }
    }
    if (runs < 1 || runs > 64) {
        fprintf(stderr, "bench_corpus: --runs must be 1..64\n");
        return 2;
    }
    const kvcc_preset *p = kvcc_preset_find("smollm2-135m");
    if (!p) {
        fprintf(stderr, "bench_corpus: preset smollm2-135m missing\n");
        return 1;
    }
    kvcc_corpus_model m = {.n_layers = p->n_layers, .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads,
                           .head_dim = p->head_dim, .vocab_size = p->vocab_size, .rope_theta = p->rope_theta,
                           .rope_scaling_factor = 1.0f};
    snprintf(m.name, sizeof m.name, "%s", p->name);
    snprintf(m.rope_scaling, sizeof m.rope_scaling, "none");
    const uint32_t sizes[2] = {4, 32};
    char paths[2][1024];
    for (int i = 0; i < 2; i++) {
        kvcc_synth_opts o = {.n_prompts = sizes[i], .context_len = 512, .continuation_len = 64, .seed = 1,
                             .dtype_f16 = 1, .retrieval_heads = 2};
        snprintf(paths[i], sizeof paths[i], "%s/corpus_smollm2_%uprompts.h5", dir, sizes[i]);
        if (ensure_corpus(paths[i], &m, &o)) return 1;
    }
    printf("bench_corpus: streaming read (kvcc_corpus_read_layer, one reused buffer set), median of %d passes, "
           "each size in its own child process\n", runs);
    read_result r[2];
    for (int i = 0; i < 2; i++) {
        char label[32];
        snprintf(label, sizeof label, "synth %u:", sizes[i]);
        r[i] = measure(paths[i], runs);
        print_result(label, paths[i], &r[i]);
        if (!r[i].ok) return 1;
    }
    double g0 = (r[0].hwm_kb - r[0].rss0_kb) / 1024.0, g1 = (r[1].hwm_kb - r[1].rss0_kb) / 1024.0;
    double late = (r[1].hwm_kb - r[1].hwm8_kb) / 1024.0; /* what prompts 9..32 added */
    /* "grew": prompts 9..32 raised the peak by more than 4 MB (HDF5's metadata cache and the allocator
     * settle within the first few prompts; a reader that kept data would add ~66 MB per prompt) */
    int grew = late > 4.0;
    printf("peak RSS growth while reading: +%.1f MB for 4 prompts, +%.1f MB for 32 prompts (8x the data); of the "
           "latter, +%.1f MB over the first 8 prompts (HDF5 caches warming) and +%.1f MB over prompts 9..32: %s\n",
           g0, g1, (r[1].hwm8_kb - r[1].rss0_kb) / 1024.0, late,
           grew ? "GREW with the number of prompts (the reader is not streaming)"
                : "bounded, does not grow with the number of prompts");
    if (access(real, R_OK) == 0) {
        read_result rr = measure(real, runs);
        print_result("real:", real, &rr);
    } else {
        printf("real:      skipped (%s not found; `make demo` captures one)\n", real);
    }
    printf("RESULT mbps_4=%.1f mbps_32=%.1f peak_mb_4=%.1f peak_mb_32=%.1f growth_after_8_prompts_mb=%.1f rss_grew=%d\n",
           r[0].mbps, r[1].mbps, r[0].hwm_kb / 1024.0, r[1].hwm_kb / 1024.0, late, grew);
    return 0;
}
