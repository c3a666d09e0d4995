/*
 * eval_fused.c: the layer-local rows of kvcc eval computed inside the end-to-end pass (with
 * --gguf, the default; --local-from-corpus restores the separate corpus pass of
 * eval_prefill.c). Per prompt the model prefills the whole window (context + continuation)
 * once; every layer's full-context reference of the continuation queries is computed from the
 * model's own f32 queries, keys and values (the tensors the corpus stores, in f16 when captured
 * so); then every row compresses the context ONCE (eval_e2e_row: compress_all or compress_layer
 * on the model's keys) and that one set of caches gives both its layer-local measures (relerr,
 * KL, mass, kept, bytes: eval_local_score) and its end-to-end scoring (continuation NLL,
 * probes). So the memory columns are the end-to-end caches' own, and the corpus's tensors are
 * never read. The layer-local numbers differ from the corpus pass only by the corpus's storage
 * rounding (f16: |relerr difference| ~1e-3, tests/cli/run.sh checks it); the end-to-end ones are
 * the same computation as before.
 * Callers: compiler/eval_model.c (eval_e2e).
 *
 * defines: eval_fused_begin, eval_fused_layers, eval_fused_score, eval_fused_end
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_int.h"
#include "stats.h"

/* The per-layer references of the current prompt (eval_run.fused). */
typedef struct {
    uint32_t L;
    int64_t cap_n;     /* continuation rows the buffers hold */
    float **kr, **vr;  /* [L] the exact continuation keys / values [N, Hkv, d] */
    float **o_full, **lse_full; /* [L] [N, H, d], [N, H] */
    float *o_c, *lse_c; /* scratch */
} fused_state;

static void fused_free_bufs(fused_state *f) {
    for (uint32_t l = 0; l < f->L; l++) {
        if (f->kr) free(f->kr[l]);
        if (f->vr) free(f->vr[l]);
        if (f->o_full) free(f->o_full[l]);
        if (f->lse_full) free(f->lse_full[l]);
    }
    free(f->o_c);
    free(f->lse_c);
    f->o_c = f->lse_c = NULL;
    f->cap_n = 0;
}

int eval_fused_begin(eval_run *E) {
    fused_state *f = calloc(1, sizeof *f);
    if (!f) return -1;
    f->L = E->env.L;
    f->kr = calloc(f->L, sizeof *f->kr);
    f->vr = calloc(f->L, sizeof *f->vr);
    f->o_full = calloc(f->L, sizeof *f->o_full);
    f->lse_full = calloc(f->L, sizeof *f->lse_full);
    E->fused_state = f;
    return f->kr && f->vr && f->o_full && f->lse_full ? 0 : -1;
}

void eval_fused_end(eval_run *E) {
    fused_state *f = E->fused_state;
    if (!f) return;
    fused_free_bufs(f);
    free(f->kr); free(f->vr); free(f->o_full); free(f->lse_full);
    free(f);
    E->fused_state = NULL;
}

/* lp as eval_local_score and eval_decode_layer read it: layer l of x's prompt (q: the model's
 * queries of every position, k / v: the state's rows 0 .. T-1, valid until a row scores). */
static void layer_view(const eval_run *E, const e2e_prompt *x, const fused_state *f, uint32_t l,
                       kvcc_loop *lp) {
    const uint32_t H = E->env.H, Hkv = E->env.Hkv, d = E->env.d;
    const size_t Kd = (size_t)Hkv * d, T_ = (size_t)x->s->n_ctx;
    memset(lp, 0, sizeof *lp);
    lp->label = "eval";
    lp->rt = E->env.rt;
    lp->L = E->env.L; lp->H = H; lp->Hkv = Hkv; lp->d = d;
    lp->scale = 1.0f / sqrtf((float)d);
    lp->T = x->T; lp->C = x->C; lp->N = x->T - x->C;
    lp->layer = l;
    lp->q = x->q[l];
    lp->k = x->s->k_cache + (size_t)l * T_ * Kd;
    lp->v = x->s->v_cache + (size_t)l * T_ * Kd;
    lp->qc = lp->q + (size_t)x->C * H * d;
    lp->kr = f->kr[l];
    lp->vr = f->vr[l];
    lp->o_full = f->o_full[l];
    lp->lse_full = f->lse_full[l];
    lp->o_c = f->o_c;
    lp->lse_c = f->lse_c;
}

int eval_fused_layers(eval_run *E, e2e_prompt *x, uint32_t p, char *err, size_t errlen) {
    fused_state *f = E->fused_state;
    kvcc_eval_result *r = E->r;
    const uint32_t L = E->env.L, H = E->env.H, Hkv = E->env.Hkv, d = E->env.d;
    const int64_t C = x->C, N = x->T - x->C;
    const size_t Kd = (size_t)Hkv * d;
    if (N < 1) {
        snprintf(err, errlen,
                 "%s: prompt %u has no continuation tokens; eval needs continuation queries",
                 E->o->corpus, p);
        return KVCC_EXIT_USAGE;
    }
    if (N > f->cap_n) {
        fused_free_bufs(f);
        int oom = !(f->o_c = malloc(sizeof(float) * (size_t)N * H * d)) ||
                  !(f->lse_c = malloc(sizeof(float) * (size_t)N * H));
        for (uint32_t l = 0; !oom && l < L; l++)
            oom = !(f->kr[l] = malloc(sizeof(float) * (size_t)N * Kd)) ||
                  !(f->vr[l] = malloc(sizeof(float) * (size_t)N * Kd)) ||
                  !(f->o_full[l] = malloc(sizeof(float) * (size_t)N * H * d)) ||
                  !(f->lse_full[l] = malloc(sizeof(float) * (size_t)N * H));
        if (oom) {
            fused_free_bufs(f);
            snprintf(err, errlen, "eval: out of memory for %lld continuation tokens", (long long)N);
            return KVCC_EXIT_FAILED;
        }
        f->cap_n = N;
    }
    for (int ri = 0; ri < r->n_rows; ri++)
        if (eval_add_reference(E, ri, C, L)) {
            snprintf(err, errlen, "eval: out of memory");
            return KVCC_EXIT_FAILED;
        }
    r->full_bytes_mean += (double)C * Kd * 2 * sizeof(float) * L / E->n_prompts;
    for (uint32_t l = 0; l < L; l++) {
        double t0 = kvcc_now_s();
        kvcc_loop lp;
        layer_view(E, x, f, l, &lp);
        memcpy(f->kr[l], lp.k + (size_t)C * Kd, sizeof(float) * (size_t)N * Kd);
        memcpy(f->vr[l], lp.v + (size_t)C * Kd, sizeof(float) * (size_t)N * Kd);
        /* the reference exactly as kvcc_loop_layer computes it */
        kvrt_cache *full = NULL;
        int s = kvcc_full_cache(lp.k, lp.v, C, Hkv, d, &full);
        if (!s)
            s = kvrt_attend(lp.rt, lp.qc, N, H, full, lp.kr, lp.vr, N, lp.scale, lp.o_full,
                            lp.lse_full);
        kvrt_cache_free(full);
        r->phase_s[KVCC_PH_LOCAL_READ] += kvcc_now_s() - t0;
        if (s) {
            snprintf(err, errlen, "eval: prompt %u, layer %u: the full-context reference: %s (%s)",
                     p, l, kvrt_status_str(s), kvrt_last_error()->msg);
            return KVCC_EXIT_FAILED;
        }
        t0 = kvcc_now_s();
        s = eval_decode_layer(E, &lp); /* the layer-local decode-time rows */
        r->phase_s[KVCC_PH_LOCAL_DECODE] += kvcc_now_s() - t0;
        if (s) {
            snprintf(err, errlen, "eval: out of memory (decode-time rows)");
            return KVCC_EXIT_FAILED;
        }
    }
    return 0;
}

int eval_fused_score(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user) {
    fused_state *f = E->fused_state;
    if (caches) { /* a prefill row: its layer-local measures from the same caches */
        eval_acc *a = &E->acc[ri];
        double bytes = 0;
        a->sel_s += x->compress_s + x->shared_s;
        for (uint32_t l = 0; l < E->env.L; l++) {
            kvcc_loop lp;
            layer_view(E, x, f, l, &lp);
            if (eval_local_score(E, ri, &lp, caches[l], &bytes)) return KVRT_ERR_NOMEM;
            if (E->r->rows[ri].status) return 0; /* failed (its message set) */
        }
        a->bytes_sum += bytes;
    }
    return eval_score_corpus_row(E, ri, x, caches, user);
}
