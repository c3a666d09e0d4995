/*
 * loop.c: the (prompt, layer) corpus walk with the full-context reference (see loop.h).
 * Callers: the passes (compiler/passes/) and kvcc eval's layer-local rows.
 *
 * defines: kvcc_loop_open, kvcc_loop_prompt, kvcc_loop_layer, kvcc_loop_attend, kvcc_loop_close
 */
#include "loop.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcc.h"

static void free_buffers(kvcc_loop *lp) {
    free(lp->q); free(lp->k); free(lp->v); free(lp->o_full); free(lp->lse_full); free(lp->lse_ctx);
    free(lp->o_c); free(lp->lse_c); free(lp->lse_c_ctx);
    lp->q = lp->k = lp->v = lp->o_full = lp->lse_full = lp->lse_ctx = NULL;
    lp->o_c = lp->lse_c = lp->lse_c_ctx = NULL;
    lp->cap = 0;
}

int kvcc_loop_open(kvcc_loop *lp, kvcc_corpus *c, const char *label, unsigned flags, char *err,
                   size_t errlen) {
    memset(lp, 0, sizeof *lp);
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    lp->corpus = c;
    lp->label = label;
    lp->flags = flags;
    lp->L = m->n_layers;
    lp->H = m->n_heads;
    lp->Hkv = m->n_kv_heads;
    lp->d = m->head_dim;
    lp->scale = 1.0f / sqrtf((float)lp->d);
    kvrt_error ke;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &lp->rt, &ke) != KVRT_OK) {
        snprintf(err, errlen, "%s: %s", label, ke.msg);
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

int kvcc_loop_prompt(kvcc_loop *lp, uint32_t p, char *err, size_t errlen) {
    if (kvcc_corpus_prompt(lp->corpus, p, &lp->info, NULL, NULL) != 0) {
        snprintf(err, errlen, "%s", kvcc_corpus_error(lp->corpus));
        return KVCC_EXIT_FAILED;
    }
    lp->prompt = p;
    lp->T = lp->info.n_tokens;
    lp->C = lp->info.context_len;
    lp->N = lp->info.continuation_len;
    if ((size_t)lp->T <= lp->cap) return 0;
    free_buffers(lp);
    const size_t T = (size_t)lp->T, H = lp->H, Kd = (size_t)lp->Hkv * lp->d, Qd = H * lp->d;
    const int ref = (lp->flags & (KVCC_LOOP_REF | KVCC_LOOP_REF_CTX)) != 0;
    const int ctx = (lp->flags & KVCC_LOOP_REF_CTX) != 0;
    lp->q = malloc(T * Qd * sizeof(float));
    lp->k = malloc(T * Kd * sizeof(float));
    lp->v = lp->flags & KVCC_LOOP_NO_V ? NULL : malloc(T * Kd * sizeof(float));
    if (ref) {
        lp->o_full = malloc(T * Qd * sizeof(float));
        lp->o_c = malloc(T * Qd * sizeof(float));
        lp->lse_full = malloc(T * H * sizeof(float));
        lp->lse_c = malloc(T * H * sizeof(float));
    }
    if (ctx) {
        lp->lse_ctx = malloc(T * H * sizeof(float));
        lp->lse_c_ctx = malloc(T * H * sizeof(float));
    }
    if (!lp->q || !lp->k || (!lp->v && !(lp->flags & KVCC_LOOP_NO_V)) ||
        (ref && (!lp->o_full || !lp->o_c || !lp->lse_full || !lp->lse_c)) ||
        (ctx && (!lp->lse_ctx || !lp->lse_c_ctx))) {
        free_buffers(lp);
        snprintf(err, errlen, "%s: out of memory for %lld tokens", lp->label, (long long)T);
        return KVCC_EXIT_FAILED;
    }
    lp->cap = T;
    return 0;
}

int kvcc_loop_layer(kvcc_loop *lp, uint32_t l, char *err, size_t errlen) {
    if (kvcc_corpus_read_layer(lp->corpus, lp->prompt, l, lp->q, lp->k, lp->v) != 0) {
        snprintf(err, errlen, "%s", kvcc_corpus_error(lp->corpus));
        return KVCC_EXIT_FAILED;
    }
    lp->layer = l;
    const size_t C = (size_t)lp->C, Kd = (size_t)lp->Hkv * lp->d;
    lp->qc = lp->q + C * lp->H * lp->d;
    lp->kr = lp->k + C * Kd;
    lp->vr = lp->v ? lp->v + C * Kd : NULL;
    if (!(lp->flags & (KVCC_LOOP_REF | KVCC_LOOP_REF_CTX)) || lp->N < 1) return 0;
    kvrt_cache *full = NULL;
    int s = kvcc_full_cache(lp->k, lp->v, lp->C, lp->Hkv, lp->d, &full);
    if (!s && (lp->flags & KVCC_LOOP_REF))
        s = kvrt_attend(lp->rt, lp->qc, lp->N, lp->H, full, lp->kr, lp->vr, lp->N, lp->scale,
                        lp->o_full, lp->lse_full);
    if (!s && (lp->flags & KVCC_LOOP_REF_CTX))
        s = kvrt_attend(lp->rt, lp->qc, lp->N, lp->H, full, NULL, NULL, 0, lp->scale, lp->o_c,
                        lp->lse_ctx);
    kvrt_cache_free(full);
    if (s) {
        snprintf(err, errlen, "%s: prompt %u, layer %u: the full-context reference: %s (%s)",
                 lp->label, lp->prompt, l, kvrt_status_str(s), kvrt_last_error()->msg);
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

int kvcc_loop_attend_on(const kvcc_loop *lp, kvrt_ctx *rt, const kvrt_cache *cc, float *o,
                        float *lse, float *lse_ctx) {
    int s = 0;
    if (lse_ctx)
        s = kvrt_attend(rt, lp->qc, lp->N, lp->H, cc, NULL, NULL, 0, lp->scale, o, lse_ctx);
    if (!s)
        s = kvrt_attend(rt, lp->qc, lp->N, lp->H, cc, lp->kr, lp->vr, lp->N, lp->scale, o, lse);
    return s;
}

int kvcc_loop_attend(const kvcc_loop *lp, const kvrt_cache *cc, float *o, float *lse,
                     float *lse_ctx) {
    return kvcc_loop_attend_on(lp, lp->rt, cc, o, lse, lse_ctx);
}

void kvcc_loop_close(kvcc_loop *lp) {
    free_buffers(lp);
    kvrt_ctx_free(lp->rt);
    memset(lp, 0, sizeof *lp);
}
