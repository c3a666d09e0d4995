/*
 * synth.c: synthetic activations with planted structure (see synth.h). Per (layer, KV head):
 *  - keys k = s_t (mu + z_t): a shared mean direction mu plus anisotropic Gaussian noise z_t
 *    (std decaying over dimensions) and a heavy-tailed per-token scale s_t ~ lognormal(0, 0.5);
 *  - an attention sink: token 0's key points along the lowest-frequency rotary pair, which RoPE
 *    hardly rotates, and every query has a positive component there;
 *  - recency: queries share the keys' component in the high-frequency pairs, so after RoPE the
 *    logit q_t . k_s decays with |t - s| on average;
 *  - retrieval heads: `retrieval_heads` query heads per layer whose continuation queries point at
 *    one randomly chosen context key ("needle"), so their attention concentrates there;
 *  - values v ~ N(0, 1) with a heavy-tailed per-token scale.
 * RoPE is applied in the half-split (NeoX / Hugging Face) layout with the preset's theta.
 * Randomness: kvrt_rng.h's splitmix64, one stream per (seed, prompt, layer): identical output
 * whatever the thread count or the order in which prompts and layers are generated.
 */
#include "synth.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_rng.h"

/* uniform in (0, 1): the 53-bit draw offset by half a step, so log() never sees 0 (this differs
 * from kvrt_rng_u01 on purpose: corpora written before stay byte-identical) */
static double uniform(uint64_t *r) {
    return ((double)(kvrt_rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double gauss(uint64_t *r) {
    return sqrt(-2.0 * log(uniform(r))) * cos(6.283185307179586 * uniform(r));
}
/* the stream keyed by (seed, a, b, c), advanced once */
static uint64_t stream(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
    uint64_t r = seed ^ (a * 0xd1b54a32d192ed03ull) ^ (b * 0x8cb92ba72f3d8dd7ull) ^
                 (c * 0x9e3779b97f4a7c15ull);
    kvrt_rng_next(&r);
    return r;
}

/* Rotate x [d] at position pos, half-split layout: pairs (i, i + d/2), frequency theta^(-2i/d). */
static void rope(float *x, uint32_t d, uint32_t pos, double theta) {
    uint32_t h = d / 2;
    for (uint32_t i = 0; i < h; i++) {
        double ang = pos * pow(theta, -2.0 * i / d);
        double c = cos(ang), s = sin(ang);
        double a = x[i], b = x[i + h];
        x[i] = (float)(a * c - b * s);
        x[i + h] = (float)(a * s + b * c);
    }
}

void kvcc_synth_layer(const kvcc_corpus_model *m, const kvcc_synth_opts *o, uint32_t prompt,
                      uint32_t layer, float *q, float *k, float *v) {
    const uint32_t T = o->context_len + o->continuation_len, H = m->n_heads, Hkv = m->n_kv_heads,
                   d = m->head_dim;
    const uint32_t G = H / Hkv, half = d / 2;
    const double sd = sqrt((double)d);
    float *mu = malloc(sizeof(float) * d), *qmean = malloc(sizeof(float) * d),
          *sigma = malloc(sizeof(float) * d);
    /* Per-(layer, head) structure comes from a stream that does not depend on the prompt. */
    for (uint32_t j = 0; j < Hkv; j++) {
        uint64_t hr = stream(o->seed, 0xffffffffu, layer, j);
        for (uint32_t i = 0; i < d; i++) {
            mu[i] = (float)(gauss(&hr) * 0.6);
            sigma[i] = (float)(1.2 * exp(-2.0 * (double)(i % half) / half) + 0.15);
        }
        /* Sink direction: the lowest-frequency pair (i = half-1, half-1+half). */
        uint64_t tr = stream(o->seed, prompt, layer, 1000 + j);
        for (uint32_t t = 0; t < T; t++) {
            float *kt = k + ((size_t)t * Hkv + j) * d, *vt = v + ((size_t)t * Hkv + j) * d;
            double s = exp(0.5 * gauss(&tr));
            for (uint32_t i = 0; i < d; i++) kt[i] = (float)(s * (mu[i] + sigma[i] * gauss(&tr)));
            if (t == 0) {
                kt[half - 1] = (float)(4.0 * sd);
                kt[d - 1] = 0;
            }
            double vs = exp(0.4 * gauss(&tr));
            for (uint32_t i = 0; i < d; i++) vt[i] = (float)(vs * gauss(&tr));
            rope(kt, d, t, m->rope_theta);
        }
        for (uint32_t g = 0; g < G; g++) {
            uint32_t h = j * G + g;
            uint64_t qr = stream(o->seed, 0xfffffffeu, layer, h);
            for (uint32_t i = 0; i < d; i++) qmean[i] = (float)(0.8 * mu[i] + 0.5 * gauss(&qr));
            qmean[half - 1] = (float)(1.0 + 0.3 * uniform(&qr)); /* sink affinity: logit +4..5 */
            int retrieval = (int)g < o->retrieval_heads && j == layer % Hkv;
            uint64_t pr = stream(o->seed, prompt, layer, 2000 + h);
            uint32_t needle =
                o->context_len > 2 ? 1 + (uint32_t)(uniform(&pr) * (o->context_len - 2)) : 0;
            for (uint32_t t = 0; t < T; t++) {
                float *qt = q + ((size_t)t * H + h) * d;
                if (retrieval && t >= o->context_len) {
                    const float *kn = k + ((size_t)needle * Hkv + j) * d; /* post-RoPE needle key */
                    double nn = 0;
                    for (uint32_t i = 0; i < d; i++) nn += (double)kn[i] * kn[i];
                    double sc = 6.0 * sd / sqrt(nn + 1e-12);
                    for (uint32_t i = 0; i < d; i++) qt[i] = (float)(sc * kn[i] + 0.3 * gauss(&pr));
                    continue;
                }
                for (uint32_t i = 0; i < d; i++)
                    qt[i] = (float)(qmean[i] + 0.7 * sigma[i] * gauss(&pr));
                rope(qt, d, t, m->rope_theta);
            }
        }
    }
    free(mu);
    free(qmean);
    free(sigma);
}

void kvcc_synth_tokens(const kvcc_corpus_model *m, const kvcc_synth_opts *o, uint32_t prompt,
                       int32_t *tokens, float *next_logprob) {
    const uint32_t T = o->context_len + o->continuation_len;
    uint64_t r = stream(o->seed, prompt, 0xfffffffdu, 0);
    uint32_t vocab = m->vocab_size ? m->vocab_size : 32000;
    for (uint32_t t = 0; t < T; t++) tokens[t] = (int32_t)(kvrt_rng_next(&r) % vocab);
    for (uint32_t t = 0; t + 1 < T; t++) next_logprob[t] = (float)(-2.5 * -log(uniform(&r)));
}

int kvcc_synth_write(const char *path, const kvcc_corpus_model *m, const kvcc_synth_opts *o,
                     const char *options, void (*progress)(uint32_t, uint32_t), char *err,
                     size_t errlen) {
    const uint32_t T = o->context_len + o->continuation_len;
    kvcc_corpus *c;
    int rc =
        kvcc_corpus_create(&c, path, m, o->dtype_f16, "kvcc synth 0.1.0", options, err, errlen);
    if (rc) return rc;
    size_t nq = (size_t)T * m->n_heads * m->head_dim, nk = (size_t)T * m->n_kv_heads * m->head_dim;
    float *q = malloc(nq * sizeof *q), *k = malloc(nk * sizeof *k), *v = malloc(nk * sizeof *v);
    int32_t *tok = malloc(T * sizeof *tok);
    float *lp = malloc(T * sizeof *lp);
    if (!q || !k || !v || !tok || !lp) rc = KVCC_CORPUS_ERR_NOMEM;
    for (uint32_t p = 0; !rc && p < o->n_prompts; p++) {
        kvcc_corpus_prompt_info info = {.n_tokens = T, .context_len = o->context_len,
                                        .continuation_len = o->continuation_len};
        snprintf(info.source, sizeof info.source, "synth:seed=%llu:prompt=%u",
                 (unsigned long long)o->seed, p);
        kvcc_synth_tokens(m, o, p, tok, lp);
        rc = kvcc_corpus_write_prompt(c, &info, tok, lp);
        for (uint32_t l = 0; !rc && l < m->n_layers; l++) {
            kvcc_synth_layer(m, o, p, l, q, k, v);
            rc = kvcc_corpus_write_layer(c, l, q, k, v);
        }
        if (!rc && progress) progress(p + 1, o->n_prompts);
    }
    free(q); free(k); free(v); free(tok); free(lp);
    if (rc) {
        if (err && errlen)
            snprintf(err, errlen, "%s",
                     rc == KVCC_CORPUS_ERR_NOMEM ? "out of memory" : kvcc_corpus_error(c));
        kvcc_corpus_close(c);
        return rc;
    }
    return kvcc_corpus_finish(c, err, errlen);
}
