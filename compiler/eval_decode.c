/*
 * eval_decode.c: the decode-time rows of kvcc eval (the methods with a decode_step: CompKV and
 * its ablations, top-K block mass, Quest, registered by compiler/passes/compkv.c).
 *
 * Every continuation token attends through a kvrt_compkv state holding the whole sequence so far
 * (the context appended at once, then one token at a time): the row's method selects `budget`
 * blocks per KV head, the selected tokens are read exactly and (compensated methods) every other
 * block contributes its mean key and mean value. Layer-local: the output of step i is compared
 * with exact causal attention of query C + i; KL(p_comp || p_full) = log Z - log Z', Z' = sum
 * over the selected blocks' tokens of e^z + (compensated rows) sum over the other blocks of
 * |b| e^{zbar_b}: the distribution in which every unselected token's logit is replaced by its
 * block mean (zbar is that mean exactly, so the cross term vanishes); for rows without
 * compensation it is -log(mass). Mass: the exact attention mass of the selected blocks. End to
 * end: the model's attention hook (kvcc_state_set_attention_hook) from position C: per layer a
 * state built from the model's own cached context rows, then each token of the chunk appended
 * and attended right away.
 * Callers: compiler/eval_prefill.c (eval_decode_layer), compiler/eval_model.c (the hook).
 *
 * defines: eval_decode_layer, eval_decode_hook
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "eval_int.h"
#include "metrics.h"
#include "stats.h"

/* Bytes one step reads for one layer: exact K/V of the selected tokens + the summaries scored
 * (CompKV: count, mean key, mean value, r group variances per block; Quest: min and max key). */
static double step_bytes(const kvcc_eval_method *m, int64_t tokens_all_heads, int64_t nb,
                         uint32_t Hkv, uint32_t d, uint32_t r) {
    const double per_block = m->quest_summaries ? 2.0 * d : 2.0 * d + r + 1;
    return 4.0 * ((double)tokens_all_heads * 2 * d + (double)Hkv * nb * per_block);
}

/* Exact block aggregates of the loop's layer per (query i, head h, block b) over the tokens
 * [0, C + i]: es = sum e^{z - mx}, zb = mean z - mx, zv = the (population) variance of z.
 * Z: scratch [N, T]. */
static void block_aggregates(const kvcc_loop *lp, uint32_t block, int64_t nbmax, float *Z,
                             double *es, double *zb, double *zv) {
    const uint32_t H = lp->H, Hkv = lp->Hkv, d = lp->d, G = H / Hkv;
    const int64_t C = lp->C, N = lp->N, T = C + N;
    const float scale = 1.0f / sqrtf((float)d);
    for (uint32_t h = 0; h < H; h++) {
        const uint32_t hk = h / G;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)T, (int)d, scale,
                    lp->q + (size_t)C * H * d + h * d, (int)(H * d), lp->k + (size_t)hk * d,
                    (int)(Hkv * d), 0.0f, Z, (int)T);
        for (int64_t i = 0; i < N; i++) {
            const int64_t len = C + i + 1, nb = (len + block - 1) / block;
            const float *z = Z + (size_t)i * T;
            float mx = z[0];
            for (int64_t t = 1; t < len; t++) mx = z[t] > mx ? z[t] : mx;
            const size_t at = ((size_t)i * H + h) * nbmax;
            double *e = es + at, *zm = zb + at, *zs = zv + at;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t t0 = b * block, t1 = t0 + block < len ? t0 + block : len;
                double se = 0, sz = 0, sq = 0;
                for (int64_t t = t0; t < t1; t++) {
                    se += exp((double)z[t] - mx);
                    sz += (double)z[t] - mx;
                }
                const double mean = sz / (double)(t1 - t0);
                for (int64_t t = t0; t < t1; t++) sq += ((double)z[t] - mx - mean) * ((double)z[t] - mx - mean);
                e[b] = se;
                zm[b] = mean;
                zs[b] = sq / (double)(t1 - t0);
            }
        }
    }
}

typedef struct {
    double *es, *zb, *zv, *esum;
    float *Z, *out;
    int32_t *blocks;
    uint8_t *mark;
    int64_t nbmax;
} dec_scratch;

/* Decode-time row ri over the loop's (prompt, layer). Failures go to the row; nonzero only when
 * out of memory. */
static int decode_row(eval_run *E, int ri, const kvcc_loop *lp, uint32_t block, dec_scratch *w) {
    kvcc_eval_row *row = &E->r->rows[ri];
    eval_acc *a = &E->acc[ri];
    const kvcc_eval_method *m = eval_row_method(E, ri);
    void *state = eval_row_prep(E, ri)->state;
    const uint32_t H = lp->H, Hkv = lp->Hkv, d = lp->d, G = H / Hkv;
    const int64_t C = lp->C, N = lp->N, T = C + N, K = (int64_t)row->budget, nbmax = w->nbmax;
    const float *q = lp->q, *k = lp->k, *v = lp->v;
    const size_t Kd = (size_t)Hkv * d;
    double t0 = kvcc_now_s();
    kvrt_compkv *st = NULL;
    int s = m->decode_create(m, state, &E->env, lp->layer, T, &st);
    if (!s) s = kvrt_compkv_append(st, k, v, C);
    a->sel_s += kvcc_now_s() - t0;
    if (s) { eval_row_fail(row, s, "compkv state"); kvrt_compkv_free(st); return 0; }
    const uint32_t rg = kvrt_compkv_groups(st);
    for (uint32_t h = 0; h < H; h++) w->esum[h] = 0;
    for (int64_t i = 0; i < N && !s; i++) {
        const int64_t len = C + i + 1;
        int64_t ns = 0;
        t0 = kvcc_now_s();
        s = kvrt_compkv_append(st, k + (size_t)(C + i) * Kd, v + (size_t)(C + i) * Kd, 1);
        if (!s)
            s = m->decode_step(m, state, st, q + (size_t)(C + i) * H * d, H, K, k, v, len,
                               w->out, w->blocks, &ns);
        a->sel_s += kvcc_now_s() - t0;
        if (s) break;
        const int64_t nb = (len + block - 1) / block;
        int64_t toks = 0;
        for (uint32_t hk = 0; hk < Hkv; hk++) {
            memset(w->mark, 0, (size_t)nb);
            for (int64_t x = 0; x < ns; x++) {
                const int32_t b = w->blocks[(size_t)hk * ns + x];
                if (b < 0 || b >= nb) continue;
                w->mark[b] = 1;
                toks += (b + 1) * (int64_t)block <= len ? block : len - (int64_t)b * block;
            }
            for (uint32_t g = 0; g < G; g++) {
                const uint32_t h = hk * G + g;
                w->esum[h] +=
                    kvcc_relerr(w->out + (size_t)h * d, lp->o_full + ((size_t)i * H + h) * d, d);
                const size_t at = ((size_t)i * H + h) * nbmax;
                const double *e = w->es + at, *zm = w->zb + at, *zs = w->zv + at;
                double tot = 0, sel = 0, cmp = 0;
                for (int64_t b = 0; b < nb; b++) {
                    tot += e[b];
                    if (w->mark[b]) sel += e[b];
                    else if (m->compensated) {
                        const int64_t cnt =
                            (b + 1) * (int64_t)block <= len ? block : len - b * (int64_t)block;
                        switch (m->compensated) {
                        case 2: cmp += e[b]; break;
                        case 3: cmp += (double)cnt * exp(zm[b] + 0.5 * zs[b]); break;
                        default: cmp += (double)cnt * exp(zm[b]); break;
                        }
                    }
                }
                a->kl_sum += log(tot) - log(sel + cmp);
                a->mass_sum += sel / tot;
                a->kl_n++;
            }
        }
        a->kept_sum += (double)toks / Hkv;
        a->kept_n++;
        a->dbytes += step_bytes(m, toks, nb, Hkv, d, rg);
        a->dsteps++;
    }
    kvrt_compkv_free(st);
    if (s) { eval_row_fail(row, s, "compkv step"); return 0; }
    for (uint32_t h = 0; h < H; h++)
        if (eval_dvec_push(&a->relerr, w->esum[h] / (double)N)) return -1;
    return 0;
}

int eval_decode_layer(eval_run *E, const kvcc_loop *lp) {
    const kvcc_eval_result *r = E->r;
    uint32_t bmin = 0;
    for (int ri = 0; ri < r->n_rows; ri++)
        if (eval_is_decode(eval_row_method(E, ri)) && !r->rows[ri].status) {
            const uint32_t b = eval_row_prep(E, ri)->block;
            if (!bmin || b < bmin) bmin = b;
        }
    if (!bmin) return 0;
    const uint32_t H = lp->H, Hkv = lp->Hkv, d = lp->d;
    const int64_t N = lp->N, T = lp->C + N, nbmax = (T + bmin - 1) / bmin;
    dec_scratch w = {.nbmax = nbmax};
    w.es = malloc((size_t)N * H * nbmax * sizeof *w.es);
    w.zb = malloc((size_t)N * H * nbmax * sizeof *w.zb);
    w.zv = malloc((size_t)N * H * nbmax * sizeof *w.zv);
    w.Z = malloc((size_t)N * T * sizeof *w.Z);
    w.out = malloc((size_t)H * d * sizeof *w.out);
    w.blocks = malloc((size_t)Hkv * nbmax * sizeof *w.blocks);
    w.mark = malloc((size_t)nbmax);
    w.esum = malloc((size_t)H * sizeof *w.esum);
    int oom = !w.es || !w.zb || !w.zv || !w.Z || !w.out || !w.blocks || !w.mark || !w.esum;
    uint32_t have = 0; /* the block size the aggregates hold */
    for (int ri = 0; ri < r->n_rows && !oom; ri++) {
        if (!eval_is_decode(eval_row_method(E, ri)) || r->rows[ri].status) continue;
        const uint32_t block = eval_row_prep(E, ri)->block;
        if (block != have) {
            block_aggregates(lp, block, nbmax, w.Z, w.es, w.zb, w.zv);
            have = block;
        }
        const double t0 = kvcc_now_s();
        oom = decode_row(E, ri, lp, block, &w) != 0;
        E->r->rows[ri].t_local_s += kvcc_now_s() - t0;
    }
    free(w.es); free(w.zb); free(w.zv); free(w.Z); free(w.out); free(w.blocks); free(w.mark); free(w.esum);
    return oom ? -1 : 0;
}

int eval_decode_hook(void *user, int layer, int pos0, int n, const float *q, const float *k,
                     const float *v, float *out) {
    eval_dec_hook *hk = user;
    eval_run *E = hk->E;
    const kvcc_eval_method *m = eval_row_method(E, hk->ri);
    void *state = eval_row_prep(E, hk->ri)->state;
    const uint32_t H = E->env.H, Hkv = E->env.Hkv, d = E->env.d;
    const size_t Kd = (size_t)Hkv * d, T_ = (size_t)hk->s->n_ctx;
    const float *kc = hk->s->k_cache + (size_t)layer * T_ * Kd,
                *vc = hk->s->v_cache + (size_t)layer * T_ * Kd;
    int s = 0;
    kvrt_compkv *st = hk->st[layer];
    if (!st ||
        kvrt_compkv_length(st) != pos0) { /* first call, or the sequence was rewound (probes) */
        kvrt_compkv_free(st);
        hk->st[layer] = st = NULL;
        s = m->decode_create(m, state, &E->env, (uint32_t)layer, hk->s->n_ctx, &st);
        if (!s && pos0 > 0) s = kvrt_compkv_append(st, kc, vc, pos0);
        if (s) kvrt_compkv_free(st);
        else hk->st[layer] = st;
    }
    const int64_t K = (int64_t)E->r->rows[hk->ri].budget;
    for (int i = 0; i < n && !s; i++) {
        int64_t ns;
        s = kvrt_compkv_append(st, k + (size_t)i * Kd, v + (size_t)i * Kd, 1);
        if (!s)
            s = m->decode_step(m, state, st, q + (size_t)i * H * d, H, K, kc, vc, pos0 + i + 1,
                               out + (size_t)i * H * d, hk->blocks, &ns);
    }
    if (s) hk->status = s;
    return s ? 1 : 0;
}
