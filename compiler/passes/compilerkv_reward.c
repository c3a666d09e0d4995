/*
 * compilerkv_reward.c: the two rewards of the CompilerKV pass (compiler/passes/compilerkv.c)
 * behind one function, ckv_reward, and the corpus pass that builds a prompt's CompilerKV
 * features (shared with kvcc eval through kvcc_compilerkv_prompt_from_corpus).
 * Callers: compilerkv.c (rollouts), compilerkv_report.c (--reward-check scores both rewards),
 * kvcc eval, tests/unit/test_compilerkv.c (kvcc_ckv_*: against kvrt_cache_gather +
 * kvrt_attend_ref).
 *
 * defines: ckv_reward, ckv_prompt_features, kvcc_compilerkv_prompt_from_corpus, kvcc_ckv_layer_*,
 *          kvcc_ckv_base_*, kvcc_ckv_scratch_doubles(_for), kvcc_ckv_error, ckv_get_layer,
 *          ckv_build_layer_cb, ckv_model_open, ckv_model_nll
 *
 * Reward `attention` (default): minus the layer's relative attention-output error
 * ||o_c - o_full|| / ||o_full|| of the continuation queries [C, T), which attend to the kept
 * context tokens plus the exact continuation (causal, as kvcc eval and a serving stack do),
 * averaged over continuation queries then query heads. Computed exactly, in double, and
 * incrementally (kvcc): per (prompt, layer) a layer cache holds w[t, i, h] = exp(z - M) (z the
 * scaled logit of continuation query i, head h, on context token t; M the row's maximum over
 * the whole context and its visible continuation, so no weight exceeds 1), the context values,
 * the continuation part of every row and o_full. Per (prompt, layer, budget) the incumbent's
 * kept set is summed once (the base); a rollout adds the tokens its set has beyond the base and
 * subtracts the ones it lacks, in ascending position order - cost |symmetric difference| rows,
 * not |kept set| x continuation x d. The layer caches of all (prompt, layer) are built once, in
 * the features pass: kept in memory when they fit KVCC_COMPILERKV_CACHE_MB (default
 * CKV_DEFAULT_CACHE_MB = 0), else written to an unlinked temporary file (kvcc_ckv_layer_write)
 * and read back at each visit, so the pass's memory does not grow with the prompts. Where they
 * live changes the speed only: the artifact is the same either way.
 *
 * Reward `model` (--gguf, the model the corpus was captured with): minus the continuation NLL
 * delta through the built-in model with only layer l's context cache compressed. Per prompt
 * the model prefills the context once, exactly; the exact continuation NLL (tokens C+1 .. T-1,
 * token C is predicted by the uncompressed context) is the reference, and its per-token
 * log-probabilities must match the corpus's (|diff| <= KVCC_COMPILERKV_LP_TOL, or _BF16 where
 * the model runs in bf16 or the corpus was captured so) or the GGUF is refused as not the
 * corpus's model. Per rollout: truncate to the context, gather the kept
 * positions of the model's own layer-l keys and values (f32), kvcc_state_set_compressed with
 * that cache for layer l and NULL (exact) elsewhere, prefill the continuation with all logits.
 * Rollouts that keep the same positions of the same (prompt, layer) share one model run
 * (memoized across budgets, phases and rounds): the run is deterministic, so the reward is the
 * same. Rollouts run one after another; the model's prefill uses the threads.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compilerkv_int.h"
#include "cpu/vexp.h" /* KVRT_SIMD_CLONES */
#include "loop.h"
#include "metrics.h"

// ----------------------------------------------------------------------------
// prompt features (shared with kvcc eval)

int ckv_prompt_features(kvcc_corpus *c, uint32_t prompt, uint32_t window, float *rho,
                        kvrt_compilerkv_prompt **out, uint32_t *context_len,
                        ckv_layer_fn each_layer, void *user, char *err, size_t errlen) {
    *out = NULL;
    kvcc_loop lp;
    if (kvcc_loop_open(&lp, c, "compilerkv", rho || each_layer ? 0 : KVCC_LOOP_NO_V, err, errlen) !=
        0)
        return -1;
    int rc = kvcc_loop_prompt(&lp, prompt, err, errlen) ? -1 : 0;
    const int64_t T = lp.T, C = lp.C;
    if (!rc && C < 2)
        rc = ckv_failf(err, errlen, -1, "corpus prompt %u: context of %lld tokens, expected >= 2",
                       prompt, (long long)C);
    float *lp_next = rc ? NULL : malloc(sizeof(float) * (size_t)(T > 1 ? T - 1 : 1));
    kvrt_compilerkv_prompt *pr = NULL;
    if (!rc && !lp_next)
        rc = ckv_failf(err, errlen, -1, "compilerkv: out of memory for %lld tokens", (long long)T);
    if (!rc && kvcc_corpus_prompt(c, prompt, &lp.info, NULL, lp_next) != 0)
        rc = ckv_failf(err, errlen, -1, "%s", kvcc_corpus_error(c));
    if (!rc && kvrt_compilerkv_prompt_create(C, window, &pr) != 0)
        rc = ckv_failf(err, errlen, -1, "compilerkv: %s", kvrt_last_error()->msg);
    for (uint32_t l = 0; l < lp.L && !rc; l++) {
        if (kvcc_loop_layer(&lp, l, err, errlen) != 0) {
            rc = -1;
            break;
        }
        if (kvrt_compilerkv_prompt_add_layer(pr, lp.q, lp.k, lp.H, lp.Hkv, lp.d) != 0 ||
            (rho &&
             kvrt_compilerkv_value_norms(lp.v, C, lp.Hkv, lp.d, rho + (size_t)l * lp.Hkv * C) != 0))
            rc = ckv_failf(err, errlen, -1, "compilerkv: prompt %u layer %u: %s", prompt, l,
                           kvrt_last_error()->msg);
        else if (each_layer && each_layer(user, prompt, l, lp.q, lp.k, lp.v, err, errlen) != 0)
            rc = -1;
    }
    if (!rc && kvrt_compilerkv_prompt_finish(pr, lp_next) != 0)
        rc =
            ckv_failf(err, errlen, -1, "compilerkv: prompt %u: %s", prompt, kvrt_last_error()->msg);
    free(lp_next);
    kvcc_loop_close(&lp);
    if (rc) {
        kvrt_compilerkv_prompt_free(pr);
        return rc;
    }
    *out = pr;
    if (context_len) *context_len = (uint32_t)C;
    return 0;
}

int kvcc_compilerkv_prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window,
                                       float *rho, kvrt_compilerkv_prompt **out,
                                       uint32_t *context_len, char *err, size_t errlen) {
    return ckv_prompt_features(c, prompt, window, rho, out, context_len, NULL, NULL, err, errlen);
}

// ----------------------------------------------------------------------------
// the attention reward: layer caches, bases, incremental errors

struct kvcc_ckv_layer {
    uint32_t C, N, H, Hkv, d;
    float *w;        /* [C, N*H] exp(z - M) of the context logits */
    float *v;        /* [C, Hkv, d] context values */
    double *cnum;    /* [N*H, d] sum over visible continuation tokens of exp(z - M) v */
    double *cden;    /* [N*H] */
    double *o_full;  /* [N*H, d] output over the full context */
    double *o_norm;  /* [N*H] ||o_full|| */
};

struct kvcc_ckv_base {
    int32_t *pos;    /* [n] ascending */
    int64_t n;
    double *num;     /* [N*H, d] */
    double *den;     /* [N*H] */
};

size_t kvcc_ckv_layer_bytes(uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv, uint32_t d) {
    const size_t NH = (size_t)N * H;
    return sizeof(struct kvcc_ckv_layer) + sizeof(float) * ((size_t)C * NH + (size_t)C * Hkv * d) +
           sizeof(double) * (2 * NH * d + 2 * NH);
}

void kvcc_ckv_layer_free(kvcc_ckv_layer *lc) {
    if (!lc) return;
    free(lc->w); free(lc->v); free(lc->cnum); free(lc->cden); free(lc->o_full); free(lc->o_norm);
    free(lc);
}

static kvcc_ckv_layer *layer_alloc(uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv, uint32_t d) {
    kvcc_ckv_layer *lc = calloc(1, sizeof *lc);
    if (!lc) return NULL;
    const size_t NH = (size_t)N * H;
    *lc = (kvcc_ckv_layer){.C = C, .N = N, .H = H, .Hkv = Hkv, .d = d};
    lc->w = malloc(sizeof(float) * (size_t)C * NH);
    lc->v = malloc(sizeof(float) * (size_t)C * Hkv * d);
    lc->cnum = malloc(sizeof(double) * NH * d);
    lc->cden = malloc(sizeof(double) * NH);
    lc->o_full = malloc(sizeof(double) * NH * d);
    lc->o_norm = malloc(sizeof(double) * NH);
    if (!lc->w || !lc->v || !lc->cnum || !lc->cden || !lc->o_full || !lc->o_norm) {
        kvcc_ckv_layer_free(lc);
        return NULL;
    }
    return lc;
}

/* The arrays of a layer cache in file order, with their byte counts. */
static int layer_parts(const kvcc_ckv_layer *lc, void *ptr[6], size_t len[6]) {
    const size_t NH = (size_t)lc->N * lc->H;
    void *p[6] = {lc->w, lc->v, lc->cnum, lc->cden, lc->o_full, lc->o_norm};
    const size_t n[6] = {sizeof(float) * (size_t)lc->C * NH,
                         sizeof(float) * (size_t)lc->C * lc->Hkv * lc->d, sizeof(double) * NH * lc->d,
                         sizeof(double) * NH, sizeof(double) * NH * lc->d, sizeof(double) * NH};
    memcpy(ptr, p, sizeof p);
    memcpy(len, n, sizeof n);
    return 6;
}

int kvcc_ckv_layer_write(int fd, uint64_t off, const kvcc_ckv_layer *lc, uint64_t *end) {
    void *ptr[6];
    size_t len[6];
    const int np = layer_parts(lc, ptr, len);
    for (int i = 0; i < np; i++) {
        const char *b = ptr[i];
        for (size_t done = 0; done < len[i];) {
            const ssize_t w = pwrite(fd, b + done, len[i] - done, (off_t)off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) return -1;
            done += (size_t)w;
            off += (uint64_t)w;
        }
    }
    *end = off;
    return 0;
}

int kvcc_ckv_layer_read(int fd, uint64_t off, uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv,
                        uint32_t d, kvcc_ckv_layer **out) {
    kvcc_ckv_layer *lc = layer_alloc(C, N, H, Hkv, d);
    if (!lc) return -1;
    void *ptr[6];
    size_t len[6];
    const int np = layer_parts(lc, ptr, len);
    for (int i = 0; i < np; i++) {
        char *b = ptr[i];
        for (size_t done = 0; done < len[i];) {
            const ssize_t r = pread(fd, b + done, len[i] - done, (off_t)off);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) { /* an error, or a file shorter than what was written */
                kvcc_ckv_layer_free(lc);
                return -1;
            }
            done += (size_t)r;
            off += (uint64_t)r;
        }
    }
    *out = lc;
    return 0;
}

/* fnum = sum_t w[t] v[t], returned: sum_t w[t], t = 0 .. C - 1 in order, zero weights skipped
 * (v row t at v + t ldv). Its own function so that it has AVX-512 and AVX2 clones: the sums are
 * elementwise over the d coordinates, so every clone adds the same terms in the same order. */
KVRT_SIMD_CLONES
static double weighted_values(const float *w, size_t C, const float *v, size_t ldv, size_t d,
                              double *restrict fnum) {
    double den = 0.0;
    for (size_t x = 0; x < d; x++) fnum[x] = 0.0;
    for (size_t t = 0; t < C; t++) {
        const float wt = w[t];
        if (wt == 0.0f) continue;
        const float *restrict vt = v + t * ldv;
        den += wt;
#pragma omp simd
        for (size_t x = 0; x < d; x++) fnum[x] += (double)wt * vt[x];
    }
    return den;
}

int kvcc_ckv_layer_build(const float *q, const float *k, const float *v, uint32_t C, uint32_t N,
                         uint32_t H, uint32_t Hkv, uint32_t d, kvcc_ckv_layer **out) {
    *out = NULL;
    if (!q || !k || !v || C < 1 || N < 1 || H < 1 || Hkv < 1 || H % Hkv || d < 1) return -1;
    kvcc_ckv_layer *lc = layer_alloc(C, N, H, Hkv, d);
    if (!lc) return -1;
    const size_t NH = (size_t)N * H, G = H / Hkv;
    memcpy(lc->v, v, sizeof(float) * (size_t)C * Hkv * d);
    const float scale = 1.0f / sqrtf((float)d);
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *z = malloc(sizeof(float) * ((size_t)C + N));
        double *fnum = malloc(sizeof(double) * d);
        if (!z || !fnum) bad = 1;
#pragma omp for schedule(static)
        for (size_t r = 0; r < NH; r++) {
            if (!z || !fnum) continue;
            const size_t i = r / H, h = r % H, hk = h / G;
            const float *qi = q + (((size_t)C + i) * H + h) * d;
            float M = -INFINITY;
            for (size_t t = 0; t < (size_t)C + i + 1;
                 t++) { /* context, then visible continuation */
                const float *kt = k + (t * Hkv + hk) * d;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (size_t x = 0; x < d; x++) s += qi[x] * kt[x];
                z[t] = s * scale;
                M = z[t] > M ? z[t] : M;
            }
            double cden = 0.0;
            double *cn = lc->cnum + r * d;
            for (size_t x = 0; x < d; x++) cn[x] = 0.0;
            for (size_t t = 0; t < C; t++) {
                const float wt = (float)exp((double)z[t] - (double)M);
                z[t] = wt;
                lc->w[t * NH + r] = wt;
            }
            const double den = weighted_values(z, C, v + hk * d, (size_t)Hkv * d, d, fnum);
            for (size_t j = 0; j <= i; j++) {
                const double wj = exp((double)z[C + j] - (double)M);
                const float *vj = v + (((size_t)C + j) * Hkv + hk) * d;
                cden += wj;
                for (size_t x = 0; x < d; x++) cn[x] += wj * vj[x];
            }
            lc->cden[r] = cden;
            double nrm = 0.0;
            for (size_t x = 0; x < d; x++) {
                const double o = (fnum[x] + cn[x]) / (den + cden);
                lc->o_full[r * d + x] = o;
                nrm += o * o;
            }
            lc->o_norm[r] = sqrt(nrm);
            if (!isfinite(lc->o_norm[r])) bad = 1;
        }
        free(z);
        free(fnum);
    }
    if (bad) {
        kvcc_ckv_layer_free(lc);
        return -1;
    }
    *out = lc;
    return 0;
}

/* Row r (query q, head h: r = q H + h) of the numerators and denominator: ar (d doubles) and den
 * += sign[b] w[t[b]] v[t[b]] and sign[b] w[t[b]], b = 0 .. n - 1 in order, zero weights skipped
 * (sign NULL: every sign +1); returns den. Tokens go four at a time where all four weights are
 * nonzero (their terms in token order in registers, ar loaded and stored once), else one by
 * one: the same additions in the same order either way. Inlined into its cloned callers; its
 * loops are elementwise over d, so every clone gives the same bits. A row at a time keeps the
 * row in L1 across the tokens (one pass over the tokens per row rather than one pass over N H d
 * doubles per token). */
static inline __attribute__((always_inline)) double
row_add_tokens(const kvcc_ckv_layer *lc, size_t r, const int32_t *t, const double *sign,
               int64_t n, double *restrict ar, double den) {
    const size_t NH = (size_t)lc->N * lc->H, d = lc->d, ldv = (size_t)lc->Hkv * d;
    const size_t vo = ((r % lc->H) / (lc->H / lc->Hkv)) * d;
    for (int64_t b0 = 0; b0 < n; b0 += 4) {
        const int nb = n - b0 < 4 ? (int)(n - b0) : 4;
        float wt[4];
        double sg[4];
        int all = nb == 4;
        for (int b = 0; b < nb; b++) {
            wt[b] = lc->w[(size_t)t[b0 + b] * NH + r];
            sg[b] = sign ? sign[b0 + b] : 1.0;
            all &= wt[b] != 0.0f;
        }
        if (all) {
            const double x0 = sg[0] * (double)wt[0], x1 = sg[1] * (double)wt[1];
            const double x2 = sg[2] * (double)wt[2], x3 = sg[3] * (double)wt[3];
            const float *restrict v0 = lc->v + (size_t)t[b0] * ldv + vo;
            const float *restrict v1 = lc->v + (size_t)t[b0 + 1] * ldv + vo;
            const float *restrict v2 = lc->v + (size_t)t[b0 + 2] * ldv + vo;
            const float *restrict v3 = lc->v + (size_t)t[b0 + 3] * ldv + vo;
            den = (((den + x0) + x1) + x2) + x3;
#pragma omp simd
            for (size_t c = 0; c < d; c++) {
                double a = ar[c];
                a += x0 * (double)v0[c];
                a += x1 * (double)v1[c];
                a += x2 * (double)v2[c];
                a += x3 * (double)v3[c];
                ar[c] = a;
            }
            continue;
        }
        for (int b = 0; b < nb; b++) {
            if (wt[b] == 0.0f) continue;
            const double x = sg[b] * (double)wt[b];
            const float *restrict vr = lc->v + (size_t)t[b0 + b] * ldv + vo;
            den += x;
#pragma omp simd
            for (size_t c = 0; c < d; c++) ar[c] += x * (double)vr[c];
        }
    }
    return den;
}

/* num/den += the tokens t[0 .. n - 1] (weights of all continuation queries and heads): four
 * tokens over every row, then the next four (row_add_tokens; the same additions in the same
 * order as a row at a time). On a 2k prompt a row at a time over all n tokens (~230) was no
 * faster (11.6% of the pass's samples against 9.8%): the v rows of three KV heads leave L1. */
KVRT_SIMD_CLONES
static void add_tokens(const kvcc_ckv_layer *lc, const int32_t *t, int64_t n, double *num,
                       double *den) {
    const size_t NH = (size_t)lc->N * lc->H;
    for (int64_t b0 = 0; b0 < n; b0 += 4) {
        const int64_t nb = n - b0 < 4 ? n - b0 : 4;
        for (size_t r = 0; r < NH; r++)
            den[r] = row_add_tokens(lc, r, t + b0, NULL, nb, num + r * lc->d, den[r]);
    }
}

static int positions_ok(const kvcc_ckv_layer *lc, const int32_t *pos, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (pos[i] < 0 || (uint32_t)pos[i] >= lc->C || (i && pos[i] <= pos[i - 1])) return 0;
    return 1;
}

/* Rows whose errors kvcc_ckv_error forms side by side (rows_error). */
#define CKV_ERR_ROWS 8

size_t kvcc_ckv_scratch_doubles_for(uint32_t C, uint32_t N, uint32_t H, uint32_t d) {
    /* the rows' errors, CKV_ERR_ROWS rows' numerators, the difference's signs and tokens */
    return (size_t)N * H + CKV_ERR_ROWS * (size_t)d + 3 * (size_t)C;
}

size_t kvcc_ckv_scratch_doubles(const kvcc_ckv_layer *lc) {
    return kvcc_ckv_scratch_doubles_for(lc->C, lc->N, lc->H, lc->d);
}

void kvcc_ckv_base_free(kvcc_ckv_base *b) {
    if (!b) return;
    free(b->pos); free(b->num); free(b->den);
    free(b);
}

int kvcc_ckv_base_create(const kvcc_ckv_layer *lc, const int32_t *pos, int64_t n,
                         kvcc_ckv_base **out) {
    *out = NULL;
    if (!lc || (n && !pos) || n < 0 || !positions_ok(lc, pos, n)) return -1;
    const size_t NH = (size_t)lc->N * lc->H;
    kvcc_ckv_base *b = calloc(1, sizeof *b);
    if (!b) return -1;
    b->pos = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    b->num = calloc(NH * lc->d, sizeof(double));
    b->den = calloc(NH, sizeof(double));
    if (!b->pos || !b->num || !b->den) {
        kvcc_ckv_base_free(b);
        return -1;
    }
    if (n) memcpy(b->pos, pos, sizeof(int32_t) * (size_t)n);
    b->n = n;
    add_tokens(lc, pos, n, b->num, b->den);
    *out = b;
    return 0;
}

/* s[k] += sum over c, in order, of ((acc + cn) inv[k] - of)^2 at row k's offset k d + c, for
 * nr rows side by side (independent chains). Inlined: called with the constant CKV_ERR_ROWS,
 * the compiler keeps the sums in registers. */
static inline __attribute__((always_inline)) void error_sums(const double *acc, const double *cn,
                                                             const double *of, const double *inv,
                                                             size_t d, int nr, double *s) {
    for (size_t c = 0; c < d; c++)
        for (int k = 0; k < nr; k++) {
            const size_t o = (size_t)k * d + c;
            const double diff = (acc[o] + cn[o]) * inv[k] - of[o];
            s[k] += diff * diff;
        }
}

/* Rows r0 .. r0 + nr - 1 (nr <= CKV_ERR_ROWS): their relative output errors into row_err, with
 * the base's numerators plus sum_b sign[b] w[t[b]] v[t[b]] (row_add_tokens, into acc: d doubles
 * per row). The rows' error sums over d are serial, as before, and run side by side
 * (independent chains). Cloned for AVX-512 and AVX2 (elementwise loops). */
KVRT_SIMD_CLONES
static void rows_error(const kvcc_ckv_layer *lc, size_t r0, int nr, const kvcc_ckv_base *base,
                       const int32_t *t, const double *sign, int64_t n, double *restrict acc,
                       double *row_err) {
    const size_t d = lc->d;
    double inv[CKV_ERR_ROWS];
    for (int k = 0; k < nr; k++) {
        const size_t r = r0 + (size_t)k;
        double *restrict ar = acc + (size_t)k * d;
        if (base) memcpy(ar, base->num + r * d, sizeof(double) * d);
        else
            for (size_t c = 0; c < d; c++) ar[c] = 0.0;
        const double den = row_add_tokens(lc, r, t, sign, n, ar, base ? base->den[r] : 0.0);
        const double dn = den + lc->cden[r];
        inv[k] = dn > 0 ? 1.0 / dn : 0.0;
    }
    double s[CKV_ERR_ROWS] = {0};
    const double *cn = lc->cnum + r0 * d, *of = lc->o_full + r0 * d; /* rows r0.. adjacent */
    if (nr == CKV_ERR_ROWS) /* a constant count: the sums stay in registers */
        error_sums(acc, cn, of, inv, d, CKV_ERR_ROWS, s);
    else
        error_sums(acc, cn, of, inv, d, nr, s);
    for (int k = 0; k < nr; k++) row_err[k] = sqrt(s[k]) / (lc->o_norm[r0 + (size_t)k] + 1e-30);
}

int kvcc_ckv_error(const kvcc_ckv_layer *lc, const kvcc_ckv_base *base, const int32_t *pos,
                   int64_t n, double *scratch, double *err) {
    if (!lc || !scratch || !err || n < 0 || (n && !pos) || !positions_ok(lc, pos, n)) return -1;
    const size_t NH = (size_t)lc->N * lc->H, d = lc->d;
    /* scratch (kvcc_ckv_scratch_doubles): the rows' errors (N H), CKV_ERR_ROWS rows' numerators
     * (d each), then the symmetric difference with the base: at most 2 C tokens (both lists
     * ascend within [0, C)), their signs, then the tokens */
    double *row_err = scratch, *acc = scratch + NH;
    double *ds = acc + CKV_ERR_ROWS * d;
    int32_t *dt = (int32_t *)(ds + 2 * (size_t)lc->C);
    const int32_t *bp = base ? base->pos : NULL;
    const int64_t bn = base ? base->n : 0;
    int64_t i = 0, j = 0, nd = 0;
    while (i < n || j < bn) { /* in ascending position order */
        if (i < n && j < bn && pos[i] == bp[j]) {
            i++;
            j++;
        } else if (j >= bn || (i < n && pos[i] < bp[j])) {
            dt[nd] = pos[i++];
            ds[nd++] = 1.0;
        } else {
            dt[nd] = bp[j++];
            ds[nd++] = -1.0;
        }
    }
    for (size_t r = 0; r < NH; r += CKV_ERR_ROWS) {
        const int nr = NH - r < CKV_ERR_ROWS ? (int)(NH - r) : CKV_ERR_ROWS;
        rows_error(lc, r, nr, base, dt, ds, nd, acc, row_err + r);
    }
    double tot = 0.0;
    for (uint32_t h = 0; h < lc->H; h++) {
        double e = 0.0;
        for (uint32_t q = 0; q < lc->N; q++) e += row_err[(size_t)q * lc->H + h];
        tot += e / lc->N;
    }
    *err = tot / lc->H;
    return 0;
}

// ----------------------------------------------------------------------------
// layer caches

/* Layer cache (p, l) into the spill file at its end. */
static int spill_write(ckv *S, uint32_t p, uint32_t l, const kvcc_ckv_layer *lc, char *err,
                       size_t errlen) {
    uint64_t end;
    if (kvcc_ckv_layer_write(S->spill_fd, S->spill_end, lc, &end) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "prompt %u layer %u: writing the layer cache to its temporary "
                         "file in %s failed: %s",
                         p, l, S->spill_dir, strerror(errno ? errno : EIO));
    S->spill_off[(size_t)p * S->L + l] = (int64_t)S->spill_end;
    S->spill_end = end;
    return 0;
}

int ckv_build_layer_cb(void *user, uint32_t p, uint32_t l, const float *q, const float *k,
                       const float *v, char *err, size_t errlen) {
    ckv *S = user;
    const ckv_prompt *P = &S->pr[p];
    kvcc_ckv_layer **slot = &S->lc[(size_t)p * S->L + l];
    if (kvcc_ckv_layer_build(q, k, v, P->C, P->N, S->H, S->Hkv, S->d, slot) != 0)
        return ckv_failf(
            err, errlen, -1,
            "compilerkv: prompt %u layer %u: out of memory (or non-finite attention) building "
            "the layer cache",
            p, l);
    if (S->spill_fd >= 0) { /* to the file; memory holds one layer cache at a time */
        const int rc = spill_write(S, p, l, *slot, err, errlen);
        kvcc_ckv_layer_free(*slot);
        *slot = NULL;
        return rc ? -1 : 0;
    }
    return 0;
}

int ckv_get_layer(ckv *S, uint32_t p, uint32_t l, kvcc_ckv_layer **out, int *owned, char *err,
                  size_t errlen) {
    kvcc_ckv_layer **slot = &S->lc[(size_t)p * S->L + l];
    *owned = 0;
    if (*slot) {
        *out = *slot;
        return 0;
    }
    const ckv_prompt *Pp = &S->pr[p];
    if (S->spill_fd >= 0 && S->spill_off[(size_t)p * S->L + l] >= 0) {
        if (kvcc_ckv_layer_read(S->spill_fd, (uint64_t)S->spill_off[(size_t)p * S->L + l], Pp->C,
                                Pp->N, S->H, S->Hkv, S->d, out) != 0)
            return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                             "prompt %u layer %u: reading the layer cache back from its "
                             "temporary file in %s failed: %s",
                             p, l, S->spill_dir, errno ? strerror(errno) : "short read");
        *owned = 1;
        return 0;
    }
    int rc = kvcc_loop_prompt(&S->walk, p, err, errlen);
    if (!rc) rc = kvcc_loop_layer(&S->walk, l, err, errlen);
    if (rc) return rc;
    const kvcc_loop *w = &S->walk;
    const ckv_prompt *P = &S->pr[p];
    if (kvcc_ckv_layer_build(w->q, w->k, w->v, P->C, P->N, S->H, S->Hkv, S->d, out) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "compilerkv: prompt %u layer %u: out of memory building the layer cache",
                         p, l);
    if (S->cache_all) *slot = *out;
    else *owned = 1;
    if (S->spill_fd >= 0 && (rc = spill_write(S, p, l, *out, err, errlen)) != 0) {
        kvcc_ckv_layer_free(*out);
        *out = NULL;
        *owned = 0;
    }
    return rc;
}

// ----------------------------------------------------------------------------
// the model reward

/* NLL of the continuation tokens C+1 .. T-1 of the state's prompt; caches NULL: the model's own
 * exact attention, else kvcc_state_set_compressed(caches). lp_diff (optional): the largest
 * |log-probability - the corpus's| over the tokens scored, maxed into *lp_diff. */
static int continuation_nll(ckv *S, uint32_t p, const kvrt_cache *const *caches, double *lp_diff,
                            double *nll) {
    const kvcc_model *m = S->lm.model;
    const int C = (int)S->pr[p].C, T = C + (int)S->pr[p].N, V = m->hp.n_vocab;
    int rc = kvcc_state_truncate(S->ms, C);
    if (!rc && caches) rc = kvcc_state_set_compressed(S->ms, caches, C, S->rt);
    double sum = 0.0;
    for (int pos = C; !rc && pos < T - 1; pos += KVCC_MODEL_CHUNK) {
        const int n = T - 1 - pos < KVCC_MODEL_CHUNK ? T - 1 - pos : KVCC_MODEL_CHUNK;
        rc = kvcc_model_prefill(m, S->ms, S->tok + pos, n, S->logits, KVCC_LOGITS_ALL);
        for (int i = 0; !rc && i < n; i++) { /* row i predicts token pos + i + 1 */
            const double lp = kvcc_logprob_token(S->logits + (size_t)i * V, V, S->tok[pos + i + 1]);
            sum -= lp;
            if (lp_diff) {
                const double df = fabs(lp - (double)S->lp[pos + i]);
                if (!(df <= *lp_diff)) *lp_diff = df; /* NaN propagates */
            }
        }
    }
    if (caches) kvcc_state_set_compressed(S->ms, NULL, 0, NULL);
    *nll = sum / (double)(T - 1 - C);
    return rc;
}

/* Make the state hold prompt p's context (exact prefill) and its exact continuation NLL. */
static int ckv_model_prompt(ckv *S, uint32_t p, char *err, size_t errlen) {
    if (S->ms_prompt == (int64_t)p) return 0;
    const kvcc_model *m = S->lm.model;
    const int C = (int)S->pr[p].C;
    kvcc_corpus_prompt_info info;
    S->ms_prompt = -1;
    if (kvcc_corpus_prompt(S->corpus, p, &info, S->tok, S->lp) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(S->corpus));
    kvcc_state_set_compressed(S->ms, NULL, 0, NULL);
    kvcc_state_reset(S->ms);
    for (int pos = 0; pos < C; pos += KVCC_MODEL_CHUNK) {
        const int n = C - pos < KVCC_MODEL_CHUNK ? C - pos : KVCC_MODEL_CHUNK;
        if (kvcc_model_prefill(m, S->ms, S->tok + pos, n, NULL, KVCC_LOGITS_NONE) != 0)
            return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                             "compilerkv: --gguf %s: the model failed on the context of prompt %u",
                             S->cx->gguf, p);
    }
    double nll, diff = 0.0;
    if (continuation_nll(S, p, NULL, &diff, &nll) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "compilerkv: --gguf %s: the model failed on the continuation of prompt %u",
                         S->cx->gguf, p);
    if (!(diff <= S->max_lp_diff)) S->max_lp_diff = diff;
    if (!(diff <= S->lp_tol))
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "--gguf %s is not the model %s was captured with: on prompt %u its "
                         "next-token log-probabilities "
                         "differ from the corpus's by up to %.3g (expected <= %g%s)",
                         S->cx->gguf, S->corpus_path, p, diff, S->lp_tol,
                         S->lp_tol == KVCC_COMPILERKV_LP_TOL_BF16 ? ", bf16" : "");
    S->nll_full[p] = nll;
    S->ms_prompt = p;
    return 0;
}

static uint64_t hash_pos(const int32_t *pos, int64_t n) {
    return kvpol_hash(pos, sizeof(int32_t) * (size_t)n) ^ (uint64_t)n;
}

int ckv_model_nll(ckv *S, uint32_t p, uint32_t l, const kvrt_selection *sel, double *nll, char *err,
                  size_t errlen) {
    int rc = ckv_model_prompt(S, p, err, errlen);
    if (rc) return rc;
    const int32_t *pos = sel->positions;
    const int64_t n = sel->offsets[1] - sel->offsets[0];
    const uint64_t h = hash_pos(pos, n);
    ckv_memo *mm = &S->memo[(size_t)p * S->L + l];
    for (size_t i = 0; i < mm->n; i++)
        if (mm->e[i].hash == h && mm->e[i].n == n &&
            !memcmp(mm->e[i].pos, pos, sizeof(int32_t) * (size_t)n)) {
            S->memo_hits++;
            *nll = mm->e[i].nll;
            return 0;
        }
    const size_t stride = (size_t)S->ms->n_ctx * S->Hkv * S->d;
    kvrt_cache *cache = NULL;
    int s = kvrt_cache_gather(S->ms->k_cache + l * stride, S->ms->v_cache + l * stride, S->pr[p].C,
                              S->Hkv, S->d, sel, KVRT_DTYPE_F32, &cache);
    if (s)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: gathering layer %u: %s", l,
                         kvrt_last_error()->msg);
    for (uint32_t j = 0; j < S->L; j++) S->caches[j] = NULL;
    S->caches[l] = cache;
    s = continuation_nll(S, p, S->caches, NULL, nll);
    S->caches[l] = NULL;
    kvrt_cache_free(cache);
    if (s)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "compilerkv: --gguf %s: the model failed with layer %u compressed "
                         "(prompt %u)",
                         S->cx->gguf, l, p);
    S->model_runs++;
    if (mm->n == mm->cap) {
        size_t cap = mm->cap ? 2 * mm->cap : 16;
        ckv_memo_ent *e = realloc(mm->e, cap * sizeof *e);
        if (!e) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        mm->e = e;
        mm->cap = cap;
    }
    int32_t *cp = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!cp) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    memcpy(cp, pos, sizeof(int32_t) * (size_t)n);
    mm->e[mm->n++] = (ckv_memo_ent){cp, n, h, *nll};
    return 0;
}

/* Shapes here; the log-probabilities per prompt in ckv_model_prompt. */
int ckv_model_open(ckv *S, char *err, size_t errlen) {
    const kvcc_compile_ctx *cx = S->cx;
    if (!cx->gguf)
        return ckv_failf(
            err, errlen, KVCC_EXIT_USAGE,
            "--reward model needs the model the corpus was captured with: --gguf FILE.gguf");
    char msg[512];
    if (kvcc_load_model_prec(cx->gguf, 0, cx->precision, &S->lm, msg, sizeof msg) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "--gguf: %s", msg);
    S->have_lm = 1;
    /* bf16 on either side moves the log-probabilities of the same model by up to ~0.06 */
    const kvcc_corpus_info *ci = kvcc_corpus_get_info(S->corpus);
    S->lp_tol = cx->precision == KVCC_PREC_BF16 || (ci && strstr(ci->options, "precision=bf16"))
                    ? KVCC_COMPILERKV_LP_TOL_BF16
                    : KVCC_COMPILERKV_LP_TOL;
    const kvcc_model *m = S->lm.model;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(S->corpus);
    if ((uint32_t)m->hp.n_layer != cm->n_layers || (uint32_t)m->hp.n_head != cm->n_heads ||
        (uint32_t)m->hp.n_head_kv != cm->n_kv_heads || (uint32_t)m->hp.head_dim != cm->head_dim ||
        (uint32_t)m->hp.n_vocab != cm->vocab_size)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "%s: the corpus was captured from a model with %u layers, %u heads, %u KV "
                         "heads, head dim %u, vocab %u; "
                         "--gguf %s has %d, %d, %d, %d, %d",
                         S->corpus_path, cm->n_layers, cm->n_heads, cm->n_kv_heads, cm->head_dim,
                         cm->vocab_size, cx->gguf, m->hp.n_layer, m->hp.n_head, m->hp.n_head_kv,
                         m->hp.head_dim, m->hp.n_vocab);
    for (uint32_t p = 0; p < S->P; p++)
        if (S->pr[p].N < 2)
            return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                             "%s: prompt %u has %u continuation tokens; the model reward scores "
                             "tokens C+1 .. T-1 and needs >= 2",
                             S->corpus_path, p, S->pr[p].N);
    const size_t V = (size_t)m->hp.n_vocab;
    const size_t rows = S->maxT < KVCC_MODEL_CHUNK ? S->maxT : KVCC_MODEL_CHUNK;
    S->tok = malloc(sizeof(int32_t) * S->maxT);
    S->lp = malloc(sizeof(float) * S->maxT);
    S->logits = malloc(sizeof(float) * rows * V);
    S->caches = calloc(S->L, sizeof *S->caches);
    S->nll_full = malloc(sizeof(double) * S->P);
    S->memo = calloc((size_t)S->P * S->L, sizeof *S->memo);
    if (!S->tok || !S->lp || !S->logits || !S->caches || !S->nll_full || !S->memo ||
        kvcc_state_create(m, (int)S->maxT, &S->ms) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "compilerkv: out of memory for the model state (%u tokens)", S->maxT);
    /* the full NLL and the compressed ones (kvrt_attend) attend alike in a bf16 model */
    kvcc_state_set_attention_f32(S->ms, 1);
    for (uint32_t p = 0; p < S->P; p++) S->nll_full[p] = NAN;
    S->ms_prompt = -1;
    kvrt_ctx_options ro = {.n_threads = 0};
    kvrt_error ke;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, &ro, &S->rt, &ke) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", ke.msg);
    return 0;
}


// ----------------------------------------------------------------------------
// one reward function for the rollouts

int ckv_reward(ckv *S, int which, uint32_t p, uint32_t l, const kvcc_ckv_layer *lc,
               const kvcc_ckv_base *base, const kvrt_selection *sel, double *scratch, double *r,
               char *err, size_t errlen) {
    if (which == CKV_REWARD_ATTENTION) {
        double e = 0.0;
        if (kvcc_ckv_error(lc, base, sel->positions, sel->offsets[1] - sel->offsets[0], scratch,
                           &e) != 0)
            return KVRT_ERR_ARG;
        *r = -e;
        return 0;
    }
    double nll;
    int rc = ckv_model_nll(S, p, l, sel, &nll, err, errlen);
    if (!rc) *r = -(nll - S->nll_full[p]);
    return rc;
}
