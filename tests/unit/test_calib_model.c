/*
 * test_calib_model.c - Criterion tests of calib/model.c.
 * Without a model file: a tiny llama GGUF (F32 weights) is built in memory and the forward pass
 * is checked against a naive reference written here from the llama definition, on the GGUF
 * weight layout with adjacent-pair RoPE (so the load-time Q/K un-permutation is checked too);
 * prefill vs decode, capture, causality, log-probabilities and load errors.
 * With models/SmolLM2-135M-Instruct.Q4_1.gguf (or $KVCC_MODEL): prefill vs decode logits, a
 * greedy answer and held-out perplexity. Run by `make test`.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures.h"
#include "gguf.h"
#include "model.h"
#include "tokenizer.h"

enum { L = 2, E = 16, H = 4, HKV = 2, D = 4, F = 24, V = 40 };
#define ROPE_BASE 10000.0f
#define EPS 1e-5f

/* Reference weights in GGUF layout (row-major [rows][cols]). */
typedef struct {
    float embd[V * E], out_norm[E];
    float attn_norm[L][E], wq[L][H * D * E], wk[L][HKV * D * E], wv[L][HKV * D * E];
    float wo[L][E * H * D], ffn_norm[L][E], gate[L][F * E], up[L][F * E], down[L][E * F];
} tiny_w;

static uint32_t g_rng;
static float rnd(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return ((float)(g_rng >> 8) / 16777216.0f - 0.5f);
}
static void fill(float *p, int n, float scale, float offset) {
    for (int i = 0; i < n; i++) p[i] = offset + scale * rnd();
}

static void make_weights(tiny_w *w) {
    g_rng = 7;
    fill(w->embd, V * E, 2.0f, 0);
    fill(w->out_norm, E, 0.2f, 1.0f);
    for (int l = 0; l < L; l++) {
        fill(w->attn_norm[l], E, 0.2f, 1.0f);
        fill(w->wq[l], H * D * E, 1.0f, 0);
        fill(w->wk[l], HKV * D * E, 1.0f, 0);
        fill(w->wv[l], HKV * D * E, 1.0f, 0);
        fill(w->wo[l], E * H * D, 0.5f, 0);
        fill(w->ffn_norm[l], E, 0.2f, 1.0f);
        fill(w->gate[l], F * E, 1.0f, 0);
        fill(w->up[l], F * E, 1.0f, 0);
        fill(w->down[l], E * F, 0.5f, 0);
    }
}

typedef struct {
    const char *name;
    int cols, rows; /* rows 0: vector */
    const float *data;
} tdesc;

/* Build the GGUF; skip_tensor / bad_shape_tensor name one tensor to break (or NULL). */
static fx_buf build_tiny(const tiny_w *w, const char *arch, const char *skip_tensor,
                       const char *bad_shape_tensor) {
    tdesc t[3 + 9 * L];
    int nt = 0;
    t[nt++] = (tdesc){"token_embd.weight", E, V, w->embd};
    t[nt++] = (tdesc){"output_norm.weight", E, 0, w->out_norm};
    static char names[9 * L][64];
    for (int l = 0; l < L; l++) {
        const char *suf[9] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"};
        const float *ptr[9] = {w->attn_norm[l], w->wq[l], w->wk[l], w->wv[l], w->wo[l],
                               w->ffn_norm[l], w->gate[l], w->up[l], w->down[l]};
        int cols[9] = {E, E, E, E, H * D, E, E, E, F};
        int rows[9] = {0, H * D, HKV * D, HKV * D, E, 0, F, F, E};
        for (int k = 0; k < 9; k++) {
            char *nm = names[l * 9 + k];
            snprintf(nm, 64, "blk.%d.%s.weight", l, suf[k]);
            t[nt++] = (tdesc){nm, cols[k], rows[k], ptr[k]};
        }
    }
    int n_keep = 0;
    for (int i = 0; i < nt; i++) n_keep += !(skip_tensor && strcmp(t[i].name, skip_tensor) == 0);

    fx_buf b = {0};
    fx_u32(&b, 0x46554747u);
    fx_u32(&b, 3);
    fx_u64(&b, (uint64_t)n_keep);
    fx_u64(&b, 9);
    fx_str(&b, "general.architecture");
    fx_u32(&b, KVCC_GGUF_VT_STRING);
    fx_str(&b, arch);
    fx_kv_u32(&b, "llama.block_count", L);
    fx_kv_u32(&b, "llama.embedding_length", E);
    fx_kv_u32(&b, "llama.feed_forward_length", F);
    fx_kv_u32(&b, "llama.attention.head_count", H);
    fx_kv_u32(&b, "llama.attention.head_count_kv", HKV);
    fx_kv_u32(&b, "llama.context_length", 64);
    fx_kv_f32(&b, "llama.rope.freq_base", ROPE_BASE);
    fx_kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", EPS);
    uint64_t off = 0;
    for (int i = 0; i < nt; i++) {
        if (skip_tensor && strcmp(t[i].name, skip_tensor) == 0) continue;
        int bad = bad_shape_tensor && strcmp(t[i].name, bad_shape_tensor) == 0;
        fx_str(&b, t[i].name);
        fx_u32(&b, t[i].rows ? 2 : 1);
        fx_u64(&b, (uint64_t)t[i].cols);
        if (t[i].rows) fx_u64(&b, (uint64_t)(bad ? t[i].rows / 2 : t[i].rows));
        fx_u32(&b, KVCC_GGUF_T_F32);
        fx_u64(&b, off);
        uint64_t bytes = (uint64_t)t[i].cols * (t[i].rows ? (uint64_t)t[i].rows : 1) * 4;
        off += (bytes + 31) / 32 * 32;
    }
    static const uint8_t z[32] = {0};
    while (b.n % 32) fx_put(&b, z, 1);
    for (int i = 0; i < nt; i++) {
        if (skip_tensor && strcmp(t[i].name, skip_tensor) == 0) continue;
        size_t bytes = (size_t)t[i].cols * (t[i].rows ? (size_t)t[i].rows : 1) * 4;
        fx_put(&b, t[i].data, bytes);
        while (b.n % 32) fx_put(&b, z, 1);
    }
    return b;
}

// ---------------------------------------------------------------- naive reference forward

static void ref_rmsnorm(float *o, const float *x, const float *w) {
    double ss = 0;
    for (int i = 0; i < E; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / E) + EPS);
    for (int i = 0; i < E; i++) o[i] = x[i] * r * w[i];
}
static void ref_matvec(float *y, const float *W, const float *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)W[r * cols + c] * x[c];
        y[r] = (float)s;
    }
}
/* GGUF llama: adjacent pairs (2i, 2i+1) rotated by pos * base^(-2i/d) */
static void ref_rope_norm(float *v, int pos) {
    for (int i = 0; i < D / 2; i++) {
        double th = pos * pow(ROPE_BASE, -2.0 * i / D);
        double a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = (float)(a * cos(th) - b * sin(th));
        v[2 * i + 1] = (float)(a * sin(th) + b * cos(th));
    }
}

/* logits (n, V) for tokens, from scratch */
static void ref_forward(const tiny_w *w, const int32_t *tok, int n, float *logits) {
    static float x[64][E], k[L][64][HKV * D], v[L][64][HKV * D];
    float xb[E], q[H * D], att[H * D], tmp[E], g[F], u[F];
    for (int t = 0; t < n; t++) memcpy(x[t], w->embd + tok[t] * E, sizeof x[t]);
    for (int l = 0; l < L; l++) {
        for (int t = 0; t < n; t++) {
            ref_rmsnorm(xb, x[t], w->attn_norm[l]);
            ref_matvec(k[l][t], w->wk[l], xb, HKV * D, E);
            ref_matvec(v[l][t], w->wv[l], xb, HKV * D, E);
            for (int h = 0; h < HKV; h++) ref_rope_norm(k[l][t] + h * D, t);
        }
        for (int t = 0; t < n; t++) {
            ref_rmsnorm(xb, x[t], w->attn_norm[l]);
            ref_matvec(q, w->wq[l], xb, H * D, E);
            for (int h = 0; h < H; h++) {
                ref_rope_norm(q + h * D, t);
                int g_kv = h / (H / HKV);
                double sc[64], mx = -1e30, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double s = 0;
                    for (int i = 0; i < D; i++) s += (double)q[h * D + i] * k[l][j][g_kv * D + i];
                    sc[j] = s / sqrt((double)D);
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int j = 0; j <= t; j++) sum += (sc[j] = exp(sc[j] - mx));
                for (int i = 0; i < D; i++) {
                    double o = 0;
                    for (int j = 0; j <= t; j++) o += sc[j] / sum * v[l][j][g_kv * D + i];
                    att[h * D + i] = (float)o;
                }
            }
            ref_matvec(tmp, w->wo[l], att, E, H * D);
            for (int i = 0; i < E; i++) x[t][i] += tmp[i];
        }
        for (int t = 0; t < n; t++) {
            ref_rmsnorm(xb, x[t], w->ffn_norm[l]);
            ref_matvec(g, w->gate[l], xb, F, E);
            ref_matvec(u, w->up[l], xb, F, E);
            for (int i = 0; i < F; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            ref_matvec(tmp, w->down[l], g, E, F);
            for (int i = 0; i < E; i++) x[t][i] += tmp[i];
        }
    }
    for (int t = 0; t < n; t++) {
        ref_rmsnorm(xb, x[t], w->out_norm);
        ref_matvec(logits + t * V, w->embd, xb, V, E); /* tied head */
    }
}

// ---------------------------------------------------------------- tiny model tests

static tiny_w g_w;

static kvcc_model *tiny_model(fx_buf *keep) {
    make_weights(&g_w);
    *keep = build_tiny(&g_w, "llama", NULL, NULL);
    kvcc_gguf *g;
    kvcc_model *m;
    char msg[512];
    cr_assert_eq(kvcc_gguf_open_memory(keep->p, keep->n, "tiny.gguf", &g, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_model_load_gguf(g, &m, msg, sizeof msg), 0, "%s", msg);
    kvcc_gguf_close(g);
    return m;
}

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates */
    }
    return m;
}

static const int32_t k_toks[] = {3, 17, 5, 39, 0, 22, 22, 8, 31, 12, 1, 30, 7, 19, 25, 2, 33, 9, 14, 6};
#define NTOK ((int)(sizeof k_toks / sizeof k_toks[0]))

Test(calib_model, tiny_matches_naive_reference) {
    fx_buf b;
    kvcc_model *m = tiny_model(&b);
    cr_assert(m->tied && m->hp.n_vocab == V && m->hp.head_dim == D && m->hp.n_head_kv == HKV);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(m, 32, &s), 0);
    static float got[NTOK * V], want[NTOK * V];
    cr_assert_eq(kvcc_model_prefill(m, s, k_toks, NTOK, got, KVCC_LOGITS_ALL), 0);
    ref_forward(&g_w, k_toks, NTOK, want);
    float d = max_abs_diff(got, want, (size_t)NTOK * V);
    cr_assert(d < 1e-4f, "max abs diff vs naive reference %g", d);
    cr_assert_eq(s->n_past, NTOK);
    kvcc_state_free(s);
    kvcc_model_free(m);
    free(b.p);
}

Test(calib_model, tiny_prefill_equals_decode) {
    fx_buf b;
    kvcc_model *m = tiny_model(&b);
    kvcc_state *s1, *s2;
    cr_assert_eq(kvcc_state_create(m, NTOK, &s1), 0);
    cr_assert_eq(kvcc_state_create(m, NTOK, &s2), 0);
    static float all[NTOK * V], one[V], last[V];
    cr_assert_eq(kvcc_model_prefill(m, s1, k_toks, NTOK, all, KVCC_LOGITS_ALL), 0);
    for (int t = 0; t < NTOK; t++) {
        cr_assert_eq(kvcc_model_decode(m, s2, k_toks[t], one), 0);
        float d = max_abs_diff(one, all + t * V, V);
        cr_assert(d < 1e-4f, "position %d: prefill vs decode diff %g", t, d);
    }
    /* full: one more token is refused */
    cr_assert_eq(kvcc_model_decode(m, s2, 0, one), KVCC_GGUF_ERR_LIMIT);
    /* LAST flag = last row of ALL; split prefill = one prefill */
    kvcc_state_reset(s1);
    cr_assert_eq(kvcc_model_prefill(m, s1, k_toks, 7, NULL, KVCC_LOGITS_NONE), 0);
    cr_assert_eq(kvcc_model_prefill(m, s1, k_toks + 7, NTOK - 7, last, KVCC_LOGITS_LAST), 0);
    cr_assert(max_abs_diff(last, all + (NTOK - 1) * V, V) < 1e-4f);
    /* bad input */
    int32_t bad = V;
    kvcc_state_reset(s1);
    cr_assert_eq(kvcc_model_prefill(m, s1, &bad, 1, last, KVCC_LOGITS_LAST), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_model_prefill(m, s1, k_toks, 0, last, KVCC_LOGITS_LAST), KVCC_GGUF_ERR_ARG);
    kvcc_state_free(s1);
    kvcc_state_free(s2);
    kvcc_state_free(NULL);
    kvcc_model_free(m);
    kvcc_model_free(NULL);
    free(b.p);
}

typedef struct {
    int calls, layers_seen[L], next_pos[L];
    const kvcc_state *s;
    int ok;
} cap_ctx;

static int capture_cb(void *user, int layer, int pos0, int n, const float *q, const float *k,
                      const float *v) {
    cap_ctx *c = user;
    c->calls++;
    c->layers_seen[layer]++;
    if (pos0 != c->next_pos[layer]) c->ok = 0;
    c->next_pos[layer] = pos0 + n;
    /* k and v are the rows just written to the cache */
    const size_t Kd = HKV * D, T = (size_t)c->s->n_ctx;
    const float *kc = c->s->k_cache + (size_t)layer * T * Kd + (size_t)pos0 * Kd;
    const float *vc = c->s->v_cache + (size_t)layer * T * Kd + (size_t)pos0 * Kd;
    if (memcmp(k, kc, (size_t)n * Kd * 4) || memcmp(v, vc, (size_t)n * Kd * 4)) c->ok = 0;
    for (int i = 0; i < n * H * D; i++)
        if (!isfinite(q[i])) c->ok = 0;
    return layer == 1 && pos0 >= 100 ? 42 : 0; /* abort path */
}

Test(calib_model, tiny_capture_and_logprobs) {
    fx_buf b;
    kvcc_model *m = tiny_model(&b);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(m, 400, &s), 0);
    cap_ctx c = {0};
    c.s = s;
    c.ok = 1;
    kvcc_state_set_capture(s, capture_cb, &c);
    float lp[NTOK - 1];
    cr_assert_eq(kvcc_model_logprobs(m, s, k_toks, NTOK, lp), 0);
    cr_assert(c.ok);
    cr_assert_eq(c.layers_seen[0], 1);
    cr_assert_eq(c.layers_seen[1], 1);
    cr_assert_eq(c.next_pos[1], NTOK);
    /* check the log-probabilities against the logits */
    static float all[NTOK * V];
    ref_forward(&g_w, k_toks, NTOK, all);
    for (int t = 0; t + 1 < NTOK; t++) {
        double mx = -1e30, sum = 0;
        for (int i = 0; i < V; i++) mx = fmax(mx, all[t * V + i]);
        for (int i = 0; i < V; i++) sum += exp(all[t * V + i] - mx);
        double want = all[t * V + k_toks[t + 1]] - mx - log(sum);
        cr_assert(fabs(lp[t] - want) < 1e-4, "t %d: %g vs %g", t, lp[t], want);
        cr_assert(lp[t] <= 0.0f);
    }
    double ppl = kvcc_perplexity(lp, NTOK - 1);
    cr_assert(isfinite(ppl) && ppl >= 1.0);
    cr_assert(isnan(kvcc_perplexity(lp, 0)));
    /* a long prefill spans chunks; the callback's nonzero return aborts it */
    enum { NMANY = KVCC_MODEL_CHUNK + 44 };
    static int32_t many[NMANY];
    for (int i = 0; i < NMANY; i++) many[i] = k_toks[i % NTOK];
    kvcc_state_free(s);
    cr_assert_eq(kvcc_state_create(m, NMANY, &s), 0);
    memset(&c, 0, sizeof c);
    c.s = s;
    c.ok = 1;
    kvcc_state_set_capture(s, capture_cb, &c);
    cr_assert_eq(kvcc_model_prefill(m, s, many, NMANY, NULL, KVCC_LOGITS_NONE), 42);
    cr_assert(c.ok);
    kvcc_state_free(s);
    kvcc_model_free(m);
    free(b.p);
}

Test(calib_model, load_errors) {
    make_weights(&g_w);
    struct { const char *arch, *skip, *bad; int want; const char *in_msg; } cases[] = {
        {"gpt2", NULL, NULL, KVCC_GGUF_ERR_ARCH, "general.architecture"},
        {"llama", "blk.1.ffn_up.weight", NULL, KVCC_GGUF_ERR_MISSING, "blk.1.ffn_up.weight"},
        {"llama", NULL, "blk.0.attn_k.weight", KVCC_GGUF_ERR_SHAPE, "blk.0.attn_k.weight"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fx_buf b = build_tiny(&g_w, cases[i].arch, cases[i].skip, cases[i].bad);
        kvcc_gguf *g;
        kvcc_model *m = (kvcc_model *)1;
        char msg[512];
        cr_assert_eq(kvcc_gguf_open_memory(b.p, b.n, "tiny.gguf", &g, msg, sizeof msg), 0, "%s", msg);
        cr_assert_eq(kvcc_model_load_gguf(g, &m, msg, sizeof msg), cases[i].want, "case %zu: %s", i, msg);
        cr_assert_null(m);
        cr_assert(strstr(msg, cases[i].in_msg) && strstr(msg, "tiny.gguf"), "case %zu: %s", i, msg);
        kvcc_gguf_close(g);
        free(b.p);
    }
    char msg[256];
    kvcc_model *m;
    cr_assert_eq(kvcc_model_load("/nonexistent/model.gguf", &m, msg, sizeof msg), KVCC_GGUF_ERR_IO);
}

// ---------------------------------------------------------------- real model (optional)

typedef struct {
    kvcc_model *m;
    kvcc_tok *t;
} real_model;

static real_model load_real(void) {
    real_model r = {0};
    FILE *f = fopen(fx_model_path(), "rb");
    if (!f) return r;
    fclose(f);
    kvcc_gguf *g;
    char msg[512];
    cr_assert_eq(kvcc_gguf_open(fx_model_path(), &g, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_tok_from_gguf(g, &r.t, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_model_load_gguf(g, &r.m, msg, sizeof msg), 0, "%s", msg);
    kvcc_gguf_close(g);
    return r;
}

static int32_t *encode(kvcc_tok *t, const char *s, size_t len, int *n) {
    int32_t *ids;
    size_t ni;
    cr_assert_eq(kvcc_tok_encode(t, s, len, KVCC_TOK_PARSE_SPECIAL, &ids, &ni), 0);
    *n = (int)ni;
    return ids;
}

Test(calib_model, real_prefill_equals_decode, .timeout = 600) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    const kvcc_model_hparams *hp = &r.m->hp;
    cr_assert(hp->n_layer == 30 && hp->n_head == 9 && hp->n_head_kv == 3 && hp->head_dim == 64 &&
              hp->n_embd == 576 && hp->n_ff == 1536 && hp->n_vocab == 49152 && r.m->tied);
    const char *text = "Call me Ishmael. Some years ago, never mind how long precisely, having "
                       "little or no money in my purse";
    int n;
    int32_t *ids = encode(r.t, text, strlen(text), &n);
    cr_assert(n > 16 && n < 40);
    kvcc_state *s1, *s2;
    cr_assert_eq(kvcc_state_create(r.m, 64, &s1), 0);
    cr_assert_eq(kvcc_state_create(r.m, 64, &s2), 0);
    float *all = malloc((size_t)n * hp->n_vocab * sizeof *all), *one = malloc(hp->n_vocab * sizeof *one);
    cr_assert_eq(kvcc_model_prefill(r.m, s1, ids, n, all, KVCC_LOGITS_ALL), 0);
    float worst = 0;
    for (int t = 0; t < n; t++) {
        cr_assert_eq(kvcc_model_decode(r.m, s2, ids[t], one), 0);
        float d = max_abs_diff(one, all + (size_t)t * hp->n_vocab, (size_t)hp->n_vocab);
        if (!(d <= worst)) worst = d;
    }
    cr_assert(worst < 1e-3f, "prefill vs decode: max abs logit diff %g", worst);
    free(all);
    free(one);
    free(ids);
    kvcc_state_free(s1);
    kvcc_state_free(s2);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

Test(calib_model, real_greedy_answer, .timeout = 600) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    const char *prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n";
    int n;
    int32_t *ids = encode(r.t, prompt, strlen(prompt), &n);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r.m, 128, &s), 0);
    float *lg = malloc(r.m->hp.n_vocab * sizeof *lg);
    cr_assert_eq(kvcc_model_prefill(r.m, s, ids, n, lg, KVCC_LOGITS_LAST), 0);
    int32_t out[12];
    for (int i = 0; i < 12; i++) {
        out[i] = kvcc_argmax(lg, r.m->hp.n_vocab);
        cr_assert_eq(kvcc_model_decode(r.m, s, out[i], lg), 0);
    }
    char *txt;
    size_t tl;
    cr_assert_eq(kvcc_tok_decode(r.t, out, 12, &txt, &tl), 0);
    cr_assert(strstr(txt, "Paris") != NULL, "greedy answer: '%s'", txt);
    /* plain continuation too */
    const char *p2 = "The capital of France is";
    free(ids);
    ids = encode(r.t, p2, strlen(p2), &n);
    kvcc_state_reset(s);
    cr_assert_eq(kvcc_model_prefill(r.m, s, ids, n, lg, KVCC_LOGITS_LAST), 0);
    int32_t nx = kvcc_argmax(lg, r.m->hp.n_vocab);
    size_t nl;
    const char *nt = kvcc_tok_text(r.t, nx, &nl);
    cr_assert(nl == 7 && memcmp(nt, "\xC4\xA0Paris", 7) == 0, "next token '%.*s'", (int)nl, nt);
    free(txt);
    free(lg);
    free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

Test(calib_model, real_heldout_perplexity, .timeout = 900) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    FILE *f = fopen("examples/data/heldout/1985_ronald_reagan_r.txt", "rb");
    if (!f) cr_skip_test("examples/data not found (run the tests from the repository root)");
    static char buf[4096];
    size_t len = fread(buf, 1, 2600, f); /* ~500 tokens */
    fclose(f);
    int n;
    int32_t *ids = encode(r.t, buf, len, &n);
    cr_assert(n >= 450 && n <= 700, "%d tokens", n);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r.m, n, &s), 0);
    float *lp = malloc((size_t)n * sizeof *lp);
    cr_assert_eq(kvcc_model_logprobs(r.m, s, ids, n, lp), 0);
    double ppl = kvcc_perplexity(lp, n - 1);
    cr_log_info("held-out perplexity (1985 address, %d tokens): %.3f", n, ppl);
    cr_assert(isfinite(ppl) && ppl > 1.0 && ppl < 100.0, "perplexity %g", ppl);
    free(lp);
    free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

/* KV² stage 2: tokens run by kvcc_model_extend after a context give the same per-layer queries
 * and keys as the same tokens appended in a fresh full forward pass, and the state is rewound. */
typedef struct {
    float *q, *k; /* [L, n, H*d], [L, n, Kd] of the tokens after `from` */
    int from, n, Hd, Kd;
} tail_grab;

static int tail_cb(void *user, int layer, int pos0, int n, const float *q, const float *k,
                   const float *v) {
    tail_grab *g = user;
    (void)v;
    for (int t = 0; t < n; t++) {
        int r = pos0 + t - g->from;
        if (r < 0 || r >= g->n) continue;
        memcpy(g->q + ((size_t)layer * g->n + r) * g->Hd, q + (size_t)t * g->Hd, sizeof(float) * g->Hd);
        memcpy(g->k + ((size_t)layer * g->n + r) * g->Kd, k + (size_t)t * g->Kd, sizeof(float) * g->Kd);
    }
    return 0;
}

static void check_extend(const kvcc_model *m, const int32_t *ctx, int C, const int32_t *tok, int n,
                         float tol) {
    const kvcc_model_hparams *hp = &m->hp;
    const int nl = hp->n_layer, Hd = hp->n_head * hp->head_dim, Kd = hp->n_head_kv * hp->head_dim;
    int32_t *all = malloc(sizeof(int32_t) * (size_t)(C + n));
    memcpy(all, ctx, sizeof(int32_t) * (size_t)C);
    memcpy(all + C, tok, sizeof(int32_t) * (size_t)n);
    tail_grab g = {.q = malloc(sizeof(float) * (size_t)nl * n * Hd),
                   .k = malloc(sizeof(float) * (size_t)nl * n * Kd), .from = C, .n = n, .Hd = Hd,
                   .Kd = Kd};
    kvcc_state *fresh, *s;
    cr_assert_eq(kvcc_state_create(m, C + n, &fresh), 0);
    kvcc_state_set_capture(fresh, tail_cb, &g);
    cr_assert_eq(kvcc_model_prefill(m, fresh, all, C + n, NULL, KVCC_LOGITS_NONE), 0);
    cr_assert_eq(kvcc_state_create(m, C + n, &s), 0);
    cr_assert_eq(kvcc_model_prefill(m, s, ctx, C, NULL, KVCC_LOGITS_NONE), 0);
    float **q = malloc(sizeof(float *) * (size_t)nl), **k = malloc(sizeof(float *) * (size_t)nl);
    for (int l = 0; l < nl; l++) {
        q[l] = malloc(sizeof(float) * (size_t)n * Hd);
        k[l] = l % 2 ? NULL : malloc(sizeof(float) * (size_t)n * Kd); /* some layers unwanted */
    }
    for (int rep = 0; rep < 2; rep++) { /* twice: the first left the context untouched */
        cr_assert_eq(kvcc_model_extend(m, s, tok, n, q, k), 0);
        cr_assert_eq(s->n_past, C, "the state is rewound to the context");
        for (int l = 0; l < nl; l++) {
            float dq = max_abs_diff(q[l], g.q + (size_t)l * n * Hd, (size_t)n * Hd);
            cr_assert(dq <= tol, "layer %d: queries differ from a fresh forward by %g", l, dq);
            if (k[l]) {
                float dk = max_abs_diff(k[l], g.k + (size_t)l * n * Kd, (size_t)n * Kd);
                cr_assert(dk <= tol, "layer %d: keys differ by %g", l, dk);
            }
        }
    }
    /* errors: over capacity, bad token; the state stays as it was */
    cr_assert_eq(kvcc_model_extend(m, s, all, C + n, q, k), KVCC_GGUF_ERR_LIMIT);
    int32_t bad = hp->n_vocab;
    cr_assert_eq(kvcc_model_extend(m, s, &bad, 1, q, k), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_model_extend(m, s, tok, 0, q, k), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(s->n_past, C);
    for (int l = 0; l < nl; l++) { free(q[l]); free(k[l]); }
    free(q); free(k); free(g.q); free(g.k); free(all);
    kvcc_state_free(fresh);
    kvcc_state_free(s);
}

Test(calib_model, tiny_extend_equals_fresh_forward) {
    fx_buf b;
    kvcc_model *m = tiny_model(&b);
    const int32_t tail[] = {4, 17, 9, 9, 30, 2}; /* e.g. reconstruction tokens: any ids */
    check_extend(m, k_toks, NTOK, tail, 6, 1e-4f);
    kvcc_model_free(m);
    free(b.p);
}

/* kvcc_model_prefill_segments over a compressed context (every other context token kept)
 * equals one prefill per segment after truncating to the context (the eval's batched
 * continuation + probes); the state is left at the context; bad segments are refused. */
Test(calib_model, tiny_segments_equal_separate_prefills) {
    fx_buf b;
    kvcc_model *m = tiny_model(&b);
    const int C = 12, nl = m->hp.n_layer, Hkv = m->hp.n_head_kv, d = m->hp.head_dim;
    const size_t T_ = 64, Kd = (size_t)Hkv * d;
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(m, (int)T_, &s), 0);
    cr_assert_eq(kvcc_model_prefill(m, s, k_toks, C, NULL, KVCC_LOGITS_NONE), 0);
    kvrt_ctx *rt;
    kvrt_error ke;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &rt, &ke), KVRT_OK);
    int64_t cnt[8];
    for (int h = 0; h < Hkv; h++) cnt[h] = C / 2;
    kvrt_selection *sel;
    cr_assert_eq(kvrt_selection_create((uint32_t)Hkv, cnt, &sel), KVRT_OK);
    for (int h = 0; h < Hkv; h++)
        for (int t = 0; t < C / 2; t++) sel->positions[sel->offsets[h] + t] = 2 * t + (h & 1);
    kvrt_cache **cc = calloc((size_t)nl, sizeof *cc);
    for (int l = 0; l < nl; l++)
        cr_assert_eq(kvrt_cache_gather(s->k_cache + (size_t)l * T_ * Kd,
                                       s->v_cache + (size_t)l * T_ * Kd, C, (uint32_t)Hkv,
                                       (uint32_t)d, sel, KVRT_DTYPE_F32, &cc[l]), KVRT_OK);
    cr_assert_eq(kvcc_state_set_compressed(s, (const kvrt_cache *const *)cc, C, rt), 0);
    const int seg[3] = {5, 3, 4};
    const int32_t toks[12] = {4, 17, 9, 9, 30, 2, 11, 0, 5, 39, 21, 8};
    static float got[12 * V], want[12 * V];
    cr_assert_eq(kvcc_model_prefill_segments(m, s, toks, seg, 3, got), 0);
    cr_assert_eq(s->n_past, C, "the segments are forgotten");
    for (int j = 0, o = 0; j < 3; o += seg[j], j++) {
        cr_assert_eq(kvcc_state_truncate(s, C), 0);
        cr_assert_eq(kvcc_model_prefill(m, s, toks + o, seg[j], want + (size_t)o * V,
                                        KVCC_LOGITS_ALL), 0);
    }
    float dd = max_abs_diff(got, want, (size_t)12 * V);
    cr_assert(dd < 1e-5f, "segments vs separate prefills: max abs diff %g", dd);
    /* a segment is blind to the others: the second one alone gives its rows */
    cr_assert_eq(kvcc_state_truncate(s, C), 0);
    cr_assert_eq(kvcc_model_prefill_segments(m, s, toks + 5, seg + 1, 1, got), 0);
    dd = max_abs_diff(got, want + (size_t)5 * V, (size_t)3 * V);
    cr_assert(dd < 1e-5f, "segment 2 alone: max abs diff %g", dd);
    const int zero[2] = {3, 0};
    cr_assert_eq(kvcc_model_prefill_segments(m, s, toks, zero, 2, got), KVCC_GGUF_ERR_ARG);
    const int big[1] = {60};
    static int32_t many[60];
    cr_assert_eq(kvcc_model_prefill_segments(m, s, many, big, 1, got), KVCC_GGUF_ERR_LIMIT);
    cr_assert_eq(s->n_past, C);
    kvcc_state_set_compressed(s, NULL, 0, NULL);
    for (int l = 0; l < nl; l++) kvrt_cache_free(cc[l]);
    free(cc);
    kvrt_selection_free(sel);
    kvrt_ctx_free(rt);
    kvcc_state_free(s);
    kvcc_model_free(m);
    free(b.p);
}

Test(calib_model, real_extend_equals_fresh_forward, .timeout = 600) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    const char *text = "Call me Ishmael. Some years ago, never mind how long precisely, having "
                       "little or no money in my purse, and nothing particular to interest me on "
                       "shore, I thought I would sail about a little and see the watery part of "
                       "the world.";
    int n;
    int32_t *ids = encode(r.t, text, strlen(text), &n);
    /* stage 2 runs chosen context tokens again after the context: here every third one */
    int32_t sel[32];
    int ns = 0;
    for (int i = 0; i < n && ns < 32; i += 3) sel[ns++] = ids[i];
    check_extend(r.m, ids, n, sel, ns, 2e-3f);
    free(ids);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

/* The decode GEMVs (kvcc_model_gemv_f32, kvcc_model_gemv_bf16): the fast path (AVX-512, else
 * AVX2) and the AVX2 path (run even on an AVX-512 CPU) against the plain-loop reference on the
 * model's shapes (q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down 576 x 1536, lm_head
 * 49152 x 576) and on odd ones (rows not a multiple of 4, cols not a multiple of 16 or 8, one row,
 * one column), beta 0 and 1. Tolerance: the paths sum in different orders, so |fast - ref| <=
 * 8 * cols * FLT_EPSILON * sum |w x| (a bound on the rounding of either order) + 1e-30; for bf16
 * w and x are the bf16 values (every product exact in f32). Then each path gives bit-identical
 * output at 1 and 2 threads. */
static const int gemv_shapes[][2] = {{576, 576}, {192, 576}, {1536, 576}, {576, 1536},
                                     {49152, 576}, {67, 35}, {1, 17}, {5, 1}, {130, 16}, {3, 15},
                                     {9, 7}, {6, 24}};

static float to_bf16_f(float f, uint16_t *b) { /* round to nearest even, as model.c */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    *b = (uint16_t)(u >> 16);
    u = (uint32_t)*b << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void check_gemv(int bf16, int impl) {
    for (size_t si = 0; si < sizeof gemv_shapes / sizeof *gemv_shapes; si++) {
        const int rows = gemv_shapes[si][0], cols = gemv_shapes[si][1];
        float *W = malloc((size_t)rows * cols * sizeof *W), *x = malloc((size_t)cols * sizeof *x);
        uint16_t *Wb = malloc((size_t)rows * cols * sizeof *Wb);
        float *xr = malloc((size_t)cols * sizeof *xr); /* x as the products see it */
        float *yr = malloc((size_t)rows * sizeof *yr), *yf = malloc((size_t)rows * sizeof *yf);
        float *y2 = malloc((size_t)rows * sizeof *y2);
        cr_assert(W && x && Wb && xr && yr && yf && y2);
        g_rng = 12345u + (uint32_t)si;
        fill(W, rows * cols, 0.2f, 0.0f);
        fill(x, cols, 2.0f, 0.1f);
        for (int c = 0; c < cols; c++) {
            uint16_t b;
            xr[c] = bf16 ? to_bf16_f(x[c], &b) : x[c];
        }
        if (bf16)
            for (size_t i = 0; i < (size_t)rows * cols; i++) W[i] = to_bf16_f(W[i], &Wb[i]);
#define GEMV(im, yy) (bf16 ? kvcc_model_gemv_bf16(im, Wb, rows, cols, x, (float)beta, yy) \
                           : kvcc_model_gemv_f32(im, W, rows, cols, x, (float)beta, yy))
        for (int beta = 0; beta <= 1; beta++) {
            for (int r = 0; r < rows; r++) yr[r] = yf[r] = y2[r] = beta ? 0.5f * rnd() : NAN;
            cr_assert_eq(GEMV(KVCC_GEMV_REF, yr), 0);
            omp_set_num_threads(2);
            cr_assert_eq(GEMV(impl, yf), 0);
            omp_set_num_threads(1);
            cr_assert_eq(GEMV(impl, y2), 0);
            for (int r = 0; r < rows; r++) {
                double mag = 0;
                for (int c = 0; c < cols; c++) mag += fabs((double)W[(size_t)r * cols + c] * xr[c]);
                const double tol = 8.0 * cols * FLT_EPSILON * mag + 1e-30;
                cr_assert(fabs((double)yf[r] - yr[r]) <= tol,
                          "%s impl %d, %d x %d beta %d row %d: fast %.9g ref %.9g (tol %g)",
                          bf16 ? "bf16" : "f32", impl, rows, cols, beta, r, yf[r], yr[r], tol);
            }
            cr_assert(!memcmp(yf, y2, (size_t)rows * sizeof *yf),
                      "%s impl %d, %d x %d: GEMV differs between 2 threads and 1",
                      bf16 ? "bf16" : "f32", impl, rows, cols);
        }
#undef GEMV
        free(W); free(x); free(Wb); free(xr); free(yr); free(yf); free(y2);
    }
}

static int cpu_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

Test(calib_model, gemv_fast_matches_ref) {
    check_gemv(0, KVCC_GEMV_FAST);
    check_gemv(1, KVCC_GEMV_FAST);
    float w = 1, xx = 1, y = 0;
    cr_assert_eq(kvcc_model_gemv_f32(3, &w, 1, 1, &xx, 0.0f, &y), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_model_gemv_f32(-1, &w, 1, 1, &xx, 0.0f, &y), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_model_gemv_f32(1, NULL, 1, 1, &xx, 0.0f, &y), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_model_gemv_f32(1, &w, 0, 1, &xx, 0.0f, &y), KVCC_GGUF_ERR_ARG);
    cr_assert(strlen(kvcc_model_gemm_name()) > 0);
}

/* kvcc_logsumexp (float exp, vectorized) against the double reference on rows shaped like
 * logits: 49152 entries spread over ~40 nats, one and two entries, a row with -INF entries (a
 * masked vocabulary), all -INF, a huge max. Bound: 1e-7 relative on log z plus 1e-7 absolute
 * (each term's exp is within 8.3e-8 relative; the sum is in double). */
Test(calib_model, logsumexp_matches_ref) {
    enum { NV = 49152 };
    static float row[NV];
    uint32_t r = 12345;
    const int sizes[] = {NV, 1, 2, 17, 1000};
    for (int si = 0; si < 5; si++) {
        const int n = sizes[si];
        for (int j = 0; j < n; j++) {
            r = r * 1664525u + 1013904223u;
            row[j] = (float)((double)(r >> 8) / 16777216.0 * 40.0 - 25.0);
        }
        if (n > 3) row[n / 3] = -INFINITY;
        float mx, mr;
        const double a = kvcc_logsumexp(row, n, &mx), b = kvcc_logsumexp_ref(row, n, &mr);
        cr_assert_eq(mx, mr, "n %d: max %g vs %g", n, mx, mr);
        cr_assert(fabs(a - b) <= 1e-7 * fabs(b) + 1e-7, "n %d: %.12g vs %.12g", n, a, b);
        const int tok = n / 2;
        const double want = (double)row[tok] - mr - b;
        cr_assert(fabs(kvcc_log_softmax_at(row, n, tok) - want) <= 1e-6 * fabs(want) + 1e-6);
    }
    row[0] = 1e30f; row[1] = -1e30f; row[2] = 0.0f;
    float mx;
    cr_assert(fabs(kvcc_logsumexp(row, 3, &mx)) < 1e-12 && mx == 1e30f);
    for (int j = 0; j < 4; j++) row[j] = -INFINITY; /* nothing finite: the reference's answer */
    float mr;
    const double a = kvcc_logsumexp(row, 4, &mx), b = kvcc_logsumexp_ref(row, 4, &mr);
    cr_assert(isnan(a) == isnan(b) && (isnan(a) || a == b));
}

/* The AVX2 paths wherever the CPU has AVX2 + FMA (every x86-64 CI machine here); elsewhere the
 * call must say it is unsupported rather than run something else. */
Test(calib_model, gemv_avx2_matches_ref) {
    if (!cpu_avx2()) {
        float w = 1, xx = 1, y = 0;
        cr_assert_eq(kvcc_model_gemv_f32(KVCC_GEMV_AVX2, &w, 1, 1, &xx, 0.0f, &y),
                     KVCC_GGUF_ERR_UNSUPPORTED);
        cr_skip_test("this CPU has no AVX2 + FMA");
    }
    check_gemv(0, KVCC_GEMV_AVX2);
    check_gemv(1, KVCC_GEMV_AVX2);
}

/* Identical inputs give identical bits whatever the thread count: logits of every position of a
 * ~600-token prefill (three chunks; several attention blocks per chunk) and of 8 decode steps
 * after it, at 1 and 2 OpenMP threads (the GEMM backend of kvcc_model_gemm_name included). */
Test(calib_model, real_thread_count_invariant, .timeout = 600) {
    if (FX_SANITIZED) /* 15 s of the ASan suite's 200 on a 2-core EPYC */
        cr_skip_test("sanitizer build: the bits at 1 and 2 threads are the plain build's check (the "
                     "same prefill and decode run under ASan in real_prefill_equals_decode)");
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    FILE *f = fopen("examples/data/heldout/1985_ronald_reagan_r.txt", "rb");
    if (!f) cr_skip_test("examples/data not found (run the tests from the repository root)");
    static char buf[4096];
    size_t len = fread(buf, 1, 3000, f);
    fclose(f);
    int n;
    int32_t *ids = encode(r.t, buf, len, &n);
    cr_assert(n > 520, "%d tokens", n);
    const int np = n - 8, nv = r.m->hp.n_vocab;
    float *lg[2];
    omp_set_num_threads(2);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r.m, n, &s), 0);
    for (int k = 0; k < 2; k++) {
        omp_set_num_threads(k ? 1 : 2);
        lg[k] = malloc((size_t)n * nv * sizeof(float));
        cr_assert(lg[k]);
        kvcc_state_reset(s);
        cr_assert_eq(kvcc_model_prefill(r.m, s, ids, np, lg[k], KVCC_LOGITS_ALL), 0);
        for (int i = np; i < n; i++)
            cr_assert_eq(kvcc_model_decode(r.m, s, ids[i], lg[k] + (size_t)i * nv), 0);
    }
    omp_set_num_threads(2);
    for (int i = 0; i < n; i++)
        cr_assert(!memcmp(lg[0] + (size_t)i * nv, lg[1] + (size_t)i * nv, (size_t)nv * sizeof(float)),
                  "position %d (%s): logits differ between 2 threads and 1 (%s)", i,
                  i < np ? "prefill" : "decode", kvcc_model_gemm_name());
    free(lg[0]);
    free(lg[1]);
    free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

/* --precision bf16 end to end on real text (issue: "tests run both paths"): the bf16 model's
 * prefill (stacked q/k/v and gate/up bf16 products, vectorized bf16 rounding, AMX where oneDNN has
 * it) against the f32 model on the same 600 tokens (two chunks: 512 and 88 rows):
 *  - mean next-token NLL within 0.02 of f32's (measured: 4e-4 on 1087 held-out tokens,
 *    docs/benchmarks.md "bf16") and top-1 agreement >= 0.9;
 *  - bit-identical at 1 and 2 threads (the plain build; the sanitizer build prefills once);
 *  - its last 8 positions by decode (over the same cache, rewound) within 0.4 of the prefill's
 *    logits: the two paths sum in other orders (decode: one-row products, attention in plain
 *    loops), and a bf16 rounding that flips upstream moves the logits downstream (measured, with
 *    a fresh prefill of the first 592 tokens: 0.21 with row-major weights and f32 attention, 0.34
 *    on an AMX Xeon with prepacked weights and bf16 attention, whose one-row products are oneDNN
 *    matmuls, 0.21 with that attention's exp in the product (unnormalized weights); f32's
 *    prefill and decode agree within 1e-3). */
/* The first 600 tokens of a held-out text (the bf16 tests' input); skips the test without it */
static int32_t *heldout_600(kvcc_tok *t) {
    FILE *f = fopen("examples/data/heldout/1985_ronald_reagan_r.txt", "rb");
    if (!f) cr_skip_test("examples/data not found (run the tests from the repository root)");
    static char buf[8192];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    int n;
    int32_t *ids = encode(t, buf, len, &n);
    cr_assert(n >= 600, "%d tokens", n);
    return ids;
}

static double mean_nll(const float *lg, const int32_t *ids, int n, int nv) {
    double s = 0;
    for (int t = 0; t + 1 < n; t++) s -= kvcc_log_softmax_at(lg + (size_t)t * nv, nv, ids[t + 1]);
    return s / (n - 1);
}

Test(calib_model, real_bf16_close_to_f32, .timeout = 900) {
    real_model r = load_real(), rb = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    char msg[512];
    const int st = kvcc_model_set_precision(rb.m, KVCC_PREC_BF16, msg, sizeof msg);
    if (st) cr_skip_test("bf16 not available in this build: %s", msg);
    int n = 600;
    int32_t *ids = heldout_600(r.t);
    const int nv = r.m->hp.n_vocab, np = n - 8;
    float *l32 = malloc((size_t)n * nv * sizeof(float)), *lb[2], *dec = malloc((size_t)nv * sizeof(float));
    cr_assert(l32 && dec);
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r.m, n, &s), 0);
    cr_assert_eq(kvcc_model_prefill(r.m, s, ids, n, l32, KVCC_LOGITS_ALL), 0);
    kvcc_state_free(s);
    cr_assert_eq(kvcc_state_create(rb.m, n, &s), 0);
    lb[1] = NULL;
    for (int k = 0; k < 2 - FX_SANITIZED; k++) { /* ASan: the 2-thread prefill only */
        omp_set_num_threads(k ? 1 : 2);
        lb[k] = malloc((size_t)n * nv * sizeof(float));
        cr_assert(lb[k]);
        kvcc_state_reset(s);
        cr_assert_eq(kvcc_model_prefill(rb.m, s, ids, n, lb[k], KVCC_LOGITS_ALL), 0);
    }
    omp_set_num_threads(2);
    cr_assert(!lb[1] || !memcmp(lb[0], lb[1], (size_t)n * nv * sizeof(float)),
              "bf16 prefill logits differ between 2 threads and 1");
    const double n32 = mean_nll(l32, ids, n, nv), nb = mean_nll(lb[0], ids, n, nv);
    cr_assert(fabs(nb - n32) < 0.02, "mean NLL bf16 %.5f vs f32 %.5f", nb, n32);
    int agree = 0;
    for (int t = 0; t < n; t++) {
        const float *a = l32 + (size_t)t * nv, *b = lb[0] + (size_t)t * nv;
        int ia = 0, ib = 0;
        for (int j = 1; j < nv; j++) {
            if (a[j] > a[ia]) ia = j;
            if (b[j] > b[ib]) ib = j;
        }
        agree += ia == ib;
    }
    cr_assert(agree >= (int)(0.9 * n), "top-1 agreement bf16 vs f32: %d of %d", agree, n);
    /* the decode steps continue the last prefill's cache, rewound to np tokens (its logits are
     * lb[0]'s bits) instead of another prefill */
    cr_assert_eq(kvcc_state_truncate(s, np), 0);
    float worst = 0;
    for (int t = np; t < n; t++) {
        cr_assert_eq(kvcc_model_decode(rb.m, s, ids[t], dec), 0);
        const float d = max_abs_diff(dec, lb[0] + (size_t)t * nv, (size_t)nv);
        if (!(d <= worst)) worst = d;
    }
    cr_assert(worst < 0.4f, "bf16 decode vs bf16 prefill: max abs logit diff %g", worst);
    cr_log_info("bf16 vs f32 on %d tokens: NLL %.5f vs %.5f, top-1 %d/%d; decode vs prefill %g (%s)",
                n, nb, n32, agree, n, worst, kvcc_model_bf16_name());
    free(l32); free(lb[0]); free(lb[1]); free(dec); free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(r.t); kvcc_tok_free(rb.t);
    kvcc_model_free(r.m); kvcc_model_free(rb.m);
}

/* Decode's attention (attend_row1) against its reference attend_ref (KVCC_DECODE_ATTEND=ref),
 * 24 decode steps after a 300-token prefill of held-out text (three chunks of keys), in each of
 * its paths: the default (chunks of keys per KV head, combined), one query head at a time in AVX2
 * ("heads") and in the SIMD clones ("clones"; the path of CPUs without AVX2, where "heads" and
 * the default run it too). Each: logits within 2e-4 of the reference (the exp differs by <= 1.4
 * ulp and the dot products sum in other orders; measured 1.9e-5 to 2.3e-5 on a 2-core AVX2 EPYC),
 * the same argmax at every step; the default and the clones also bit-identical at 1 and 2
 * threads (the heads path splits nothing a thread count could change). The sanitizer build runs
 * 8 steps (the same paths over the same three chunks; 24 steps are the plain build's). */
/* A state of np + nd tokens prefilled with ids[0, np) (on the threads OpenMP has now: the state
 * keeps that count), for decode_steps. */
static kvcc_state *prefilled(real_model *r, const int32_t *ids, int np, int nd) {
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r->m, np + nd, &s), 0);
    cr_assert_eq(kvcc_model_prefill(r->m, s, ids, np, NULL, KVCC_LOGITS_NONE), 0);
    return s;
}
/* Rewound to its np prefilled tokens, s decodes ids[np, np + nd): logits to out [nd, V]. */
static void decode_steps(real_model *r, kvcc_state *s, const int32_t *ids, int np, int nd,
                         float *out) {
    cr_assert_eq(kvcc_state_truncate(s, np), 0);
    for (int t = 0; t < nd; t++)
        cr_assert_eq(kvcc_model_decode(r->m, s, ids[np + t], out + (size_t)t * r->m->hp.n_vocab), 0);
}

Test(calib_model, real_decode_attention_matches_ref, .timeout = 600) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    int32_t *ids = heldout_600(r.t);
    const int np = 300, nd = FX_SANITIZED ? 8 : 24, nv = r.m->hp.n_vocab;
    const size_t bytes = (size_t)nd * nv * sizeof(float);
    float *fast = malloc(bytes), *one = malloc(bytes), *ref = malloc(bytes), *prev = malloc(bytes);
    cr_assert(fast && one && ref && prev);
    /* one prefill per thread count (the modes differ in decode only) */
    omp_set_num_threads(1);
    kvcc_state *s1 = prefilled(&r, ids, np, nd);
    omp_set_num_threads(2);
    kvcc_state *s2 = prefilled(&r, ids, np, nd);
    setenv("KVCC_DECODE_ATTEND", "ref", 1);
    decode_steps(&r, s2, ids, np, nd, ref);
    const char *modes[] = {"clones", "heads", NULL}; /* NULL: unset, the default */
    for (int k = 0; k < 3; k++) {
        const char *mode = modes[k] ? modes[k] : "default";
        if (modes[k]) setenv("KVCC_DECODE_ATTEND", modes[k], 1);
        else unsetenv("KVCC_DECODE_ATTEND");
        decode_steps(&r, s2, ids, np, nd, fast);
        if (k != 1) {
            omp_set_num_threads(1);
            decode_steps(&r, s1, ids, np, nd, one);
            omp_set_num_threads(2);
            cr_assert(!memcmp(fast, one, bytes), "%s: decode logits differ between 2 threads and 1",
                      mode);
        }
        cr_assert(memcmp(fast, ref, bytes), "%s: the same bits as the reference (switch ignored?)",
                  mode);
        float worst = 0;
        for (int t = 0; t < nd; t++) {
            const float *a = fast + (size_t)t * nv, *b = ref + (size_t)t * nv;
            const float d = max_abs_diff(a, b, (size_t)nv);
            if (!(d <= worst)) worst = d;
            cr_assert_eq(kvcc_argmax(a, nv), kvcc_argmax(b, nv), "%s, step %d: argmax differs",
                         mode, t);
        }
        cr_assert(worst < 2e-4f, "decode attention (%s) vs its reference: max abs logit diff %g",
                  mode, worst);
        cr_log_info("decode attention (%s) vs attend_ref, %d steps after %d tokens: max abs logit "
                    "diff %g", mode, nd, np, worst);
        if (k == 1 && cpu_avx2())
            cr_assert(memcmp(fast, prev, bytes), "the heads path gave the bits of the clones");
        if (k == 2 && cpu_avx2())
            cr_assert(memcmp(fast, prev, bytes), "the default gave the bits of the heads path");
        memcpy(prev, fast, bytes);
    }
    kvcc_state_free(s1);
    kvcc_state_free(s2);
    free(fast); free(one); free(ref); free(prev); free(ids);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
}

/* Decode's attention on shapes the built-in model does not have (head_dim 24 and 72: value
 * blocks of 16 + 8 and 64 + 8 lanes; groups of 3 and 4 query heads per KV head), over 300
 * tokens (three chunks of 128 keys, the last partial): a model of random f32 weights written
 * as a GGUF in memory (each matrix scaled so that its outputs have about unit scale). Each decode
 * path (the default chunks, heads, clones, the reference) against the prefill's logits at every
 * position (the prefill's attention is another implementation: attend_tiles or attend_blas)
 * within 4e-6 of the largest logit, the paths against the reference within 2e-6 of it (measured
 * on a 2-core AVX2 EPYC: at most 4.7e-7 and 2.1e-7), and the default bit-identical at 1 and 2
 * threads; so is the prefill, whose products here include matrices of <= 64 rows. */
static fx_buf build_shaped(int nl, int e, int h, int hkv, int d, int f, int v, float **keep) {
    cr_assert(nl >= 1 && nl <= 4, "build_shaped: at most 4 layers (its name table)");
    const int per_layer = e + h * d * e + 2 * hkv * d * e + e * h * d + e + 3 * f * e;
    float *w = malloc(sizeof(float) * (size_t)(v * e + e + nl * per_layer));
    cr_assert(w);
    *keep = w;
    g_rng = 99u + (uint32_t)d;
    tdesc t[2 + 9 * 4];
    static char names[9 * 4][64];
    int nt = 0;
    float *p = w;
    fill(p, v * e, 2.0f, 0);
    t[nt++] = (tdesc){"token_embd.weight", e, v, p};
    p += v * e;
    fill(p, e, 0.2f, 1.0f);
    t[nt++] = (tdesc){"output_norm.weight", e, 0, p};
    p += e;
    for (int l = 0; l < nl; l++) {
        const char *suf[9] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"};
        const int cols[9] = {e, e, e, e, h * d, e, e, e, f};
        const int rows[9] = {0, h * d, hkv * d, hkv * d, e, 0, f, f, e};
        for (int k = 0; k < 9; k++) {
            const int n = cols[k] * (rows[k] ? rows[k] : 1);
            if (rows[k]) fill(p, n, 3.0f / sqrtf((float)cols[k]), 0); /* outputs of unit scale */
            else fill(p, n, 0.2f, 1.0f);
            snprintf(names[l * 9 + k], 64, "blk.%d.%s.weight", l, suf[k]);
            t[nt++] = (tdesc){names[l * 9 + k], cols[k], rows[k], p};
            p += n;
        }
    }
    fx_buf b = {0};
    fx_u32(&b, 0x46554747u);
    fx_u32(&b, 3);
    fx_u64(&b, (uint64_t)nt);
    fx_u64(&b, 9);
    fx_str(&b, "general.architecture");
    fx_u32(&b, KVCC_GGUF_VT_STRING);
    fx_str(&b, "llama");
    fx_kv_u32(&b, "llama.block_count", (uint32_t)nl);
    fx_kv_u32(&b, "llama.embedding_length", (uint32_t)e);
    fx_kv_u32(&b, "llama.feed_forward_length", (uint32_t)f);
    fx_kv_u32(&b, "llama.attention.head_count", (uint32_t)h);
    fx_kv_u32(&b, "llama.attention.head_count_kv", (uint32_t)hkv);
    fx_kv_u32(&b, "llama.context_length", 512);
    fx_kv_f32(&b, "llama.rope.freq_base", ROPE_BASE);
    fx_kv_f32(&b, "llama.attention.layer_norm_rms_epsilon", EPS);
    uint64_t off = 0;
    for (int i = 0; i < nt; i++) {
        fx_str(&b, t[i].name);
        fx_u32(&b, t[i].rows ? 2 : 1);
        fx_u64(&b, (uint64_t)t[i].cols);
        if (t[i].rows) fx_u64(&b, (uint64_t)t[i].rows);
        fx_u32(&b, KVCC_GGUF_T_F32);
        fx_u64(&b, off);
        const uint64_t bytes = (uint64_t)t[i].cols * (t[i].rows ? (uint64_t)t[i].rows : 1) * 4;
        off += (bytes + 31) / 32 * 32;
    }
    static const uint8_t z[32] = {0};
    while (b.n % 32) fx_put(&b, z, 1);
    for (int i = 0; i < nt; i++) {
        fx_put(&b, t[i].data, (size_t)t[i].cols * (t[i].rows ? (size_t)t[i].rows : 1) * 4);
        while (b.n % 32) fx_put(&b, z, 1);
    }
    return b;
}

static void shaped_decode(kvcc_model *m, const int32_t *tok, int n, const char *mode, float *out) {
    if (mode) setenv("KVCC_DECODE_ATTEND", mode, 1);
    else unsetenv("KVCC_DECODE_ATTEND");
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(m, n, &s), 0);
    for (int t = 0; t < n; t++)
        cr_assert_eq(kvcc_model_decode(m, s, tok[t], out + (size_t)t * m->hp.n_vocab), 0);
    kvcc_state_free(s);
    unsetenv("KVCC_DECODE_ATTEND");
}

Test(calib_model, decode_attention_other_shapes) {
    const int shapes[2][3] = {{6, 2, 24}, {4, 1, 72}}; /* heads, KV heads, head_dim */
    enum { NT = 300, NV = 50 };
    int32_t tok[NT];
    for (int i = 0; i < NT; i++) tok[i] = (int32_t)((i * 37 + 11) % NV);
    const size_t bytes = sizeof(float) * NT * NV;
    float *pre = malloc(bytes), *ref = malloc(bytes), *got = malloc(bytes), *one = malloc(bytes);
    cr_assert(pre && ref && got && one);
    for (int si = 0; si < 2; si++) {
        const int h = shapes[si][0], hkv = shapes[si][1], d = shapes[si][2];
        float *w;
        fx_buf b = build_shaped(2, h * d, h, hkv, d, 64, NV, &w); /* the loader: E = H d */
        kvcc_gguf *g;
        kvcc_model *m;
        char msg[512];
        cr_assert_eq(kvcc_gguf_open_memory(b.p, b.n, "shaped.gguf", &g, msg, sizeof msg), 0, "%s",
                     msg);
        cr_assert_eq(kvcc_model_load_gguf(g, &m, msg, sizeof msg), 0, "%s", msg);
        kvcc_gguf_close(g);
        cr_assert_eq(m->hp.head_dim, d);
        kvcc_state *s;
        omp_set_num_threads(1);
        cr_assert_eq(kvcc_state_create(m, NT, &s), 0);
        cr_assert_eq(kvcc_model_prefill(m, s, tok, NT, one, KVCC_LOGITS_ALL), 0);
        kvcc_state_free(s);
        omp_set_num_threads(2);
        cr_assert_eq(kvcc_state_create(m, NT, &s), 0);
        cr_assert_eq(kvcc_model_prefill(m, s, tok, NT, pre, KVCC_LOGITS_ALL), 0);
        kvcc_state_free(s);
        /* matrices of <= 64 rows (k, v, gate, up, the head here) in the prefill's products */
        cr_assert(!memcmp(pre, one, bytes), "d %d: prefill logits differ between 2 threads and 1",
                  d);
        float big = 0; /* tolerances relative to the largest logit */
        for (int i = 0; i < NT * NV; i++) big = fabsf(pre[i]) > big ? fabsf(pre[i]) : big;
        const float tp = 4e-6f * big, tr = 2e-6f * big; /* measured 4.7e-7 and 2.1e-7 of it */
        omp_set_num_threads(2);
        shaped_decode(m, tok, NT, "ref", ref);
        cr_assert(max_abs_diff(ref, pre, (size_t)NT * NV) < tp,
                  "d %d: decode (reference attention) vs prefill %g (largest logit %g)", d,
                  max_abs_diff(ref, pre, (size_t)NT * NV), big);
        const char *modes[] = {"clones", "heads", NULL};
        for (int k = 0; k < 3; k++) {
            shaped_decode(m, tok, NT, modes[k], got);
            const float dp = max_abs_diff(got, pre, (size_t)NT * NV);
            const float dr = max_abs_diff(got, ref, (size_t)NT * NV);
            cr_assert(dp < tp && dr < tr, "d %d, %s: vs prefill %g, vs reference %g (largest %g)",
                      d, modes[k] ? modes[k] : "default", dp, dr, big);
            cr_log_info("decode attention, d %d, %d/%d heads, %s: vs prefill %g, vs reference %g "
                        "(largest logit %g)", d, h, hkv, modes[k] ? modes[k] : "default", dp, dr,
                        big);
        }
        omp_set_num_threads(1);
        shaped_decode(m, tok, NT, NULL, one);
        omp_set_num_threads(2);
        cr_assert(!memcmp(got, one, bytes), "d %d: the default differs between 2 threads and 1", d);
        kvcc_model_free(m);
        free(b.p);
        free(w);
    }
    free(pre); free(ref); free(got); free(one);
}

/* The two bf16 speed-ups where oneDNN has a bf16 matmul (docs/cli.md, "The built-in model's
 * precision"), each against the path it replaced, on 600 held-out tokens (512 + 88 rows):
 *  - weights reordered into oneDNN's layout keep the mean NLL of row-major weights within 0.005
 *    (the same products: oneDNN reorders row-major weights inside each call; bit for bit at
 *    256-row chunks, at 512 rows it sums them in another order: NLL 3.31201 vs 3.31481 on an AMX
 *    Xeon);
 *  - converting while loading (kvcc_model_load_gguf_prec, so that the f32 model never exists
 *    whole) gives the model kvcc_model_set_precision makes: the same logits bit for bit;
 *  - a state with kvcc_state_set_attention_f32 (eval, the needle task, the model reward) gives
 *    the logits of f32 attention bit for bit, set before its first forward pass or after one;
 *  - attention in bf16 (attend_bf16) keeps the mean NLL within 0.005 of f32 attention in the
 *    same bf16 model and top-1 agreement >= 0.95 (measured on an AMX Xeon: NLL 3.31201 vs
 *    3.31335, 595 and 596 of 600 against f32's);
 *  - its path for rows past the float range (logits against the row's max in plain loops,
 *    KVCC_BF16_ATTENTION_SHIFTED sends every row there) within 0.002 of the mean NLL of its
 *    unshifted weights, and not the same logits (the switch works).
 * Where oneDNN has no bf16 matmul the switches change nothing: only the conversion at load is
 * checked there. */
/* at_load: kvcc_model_load_gguf_prec (converted tensor by tensor while loading), else
 * kvcc_model_load_gguf then kvcc_model_set_precision */
static float *bf16_logits(const int32_t *ids, int n, const char *env, int at_load) {
    /* "state": kvcc_state_set_attention_f32 before the first forward, "late": after one */
    const int late = env && !strcmp(env, "late"), state_f32 = late || (env && !strcmp(env, "state"));
    if (env && !state_f32) setenv(env, "1", 1);
    real_model r = {0};
    char msg[512];
    if (at_load) {
        kvcc_gguf *g;
        cr_assert_eq(kvcc_gguf_open(fx_model_path(), &g, msg, sizeof msg), 0, "%s", msg);
        cr_assert_eq(kvcc_model_load_gguf_prec(g, KVCC_PREC_BF16, &r.m, msg, sizeof msg), 0, "%s",
                     msg);
        kvcc_gguf_close(g);
        cr_assert_eq(r.m->precision, KVCC_PREC_BF16);
    } else {
        r = load_real();
        const int st = kvcc_model_set_precision(r.m, KVCC_PREC_BF16, msg, sizeof msg);
        cr_assert_eq(st, 0, "bf16: %s", msg);
    }
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(r.m, n, &s), 0);
    float *lg = malloc((size_t)n * r.m->hp.n_vocab * sizeof(float));
    cr_assert(lg);
    if (late) {
        cr_assert_eq(kvcc_model_prefill(r.m, s, ids, n, lg, KVCC_LOGITS_ALL), 0);
        kvcc_state_reset(s);
    }
    if (state_f32) kvcc_state_set_attention_f32(s, 1);
    cr_assert_eq(kvcc_model_prefill(r.m, s, ids, n, lg, KVCC_LOGITS_ALL), 0);
    if (env && !state_f32) unsetenv(env);
    kvcc_state_free(s);
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
    return lg;
}

Test(calib_model, real_bf16_packed_weights_attention_and_load, .timeout = 900) {
    real_model r = load_real();
    if (!r.m) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    char msg[512];
    if (kvcc_model_set_precision(r.m, KVCC_PREC_BF16, msg, sizeof msg))
        cr_skip_test("bf16 not available in this build: %s", msg);
    int n = 600;
    int32_t *ids = heldout_600(r.t);
    const int nv = r.m->hp.n_vocab;
    kvcc_tok_free(r.t);
    kvcc_model_free(r.m);
    if (!strstr(kvcc_model_bf16_name(), "attention in bf16")) {
        /* no bf16 matmul here (the widened fallback): the switches have nothing to switch, so
         * only converting at load is checked (the test took 57 s under ASan on a 2-core AVX2
         * EPYC with the five other prefills), on the first 160 tokens: the same weights give
         * the same bits at any length (27 s under ASan at 600 tokens) */
        n = 160;
        float *now = bf16_logits(ids, n, NULL, 0), *atload = bf16_logits(ids, n, NULL, 1);
        cr_assert(!memcmp(now, atload, (size_t)n * nv * sizeof(float)),
                  "bf16 prefill logits differ between converting at load and after");
        cr_log_info("%s: converting at load checked; the bf16 attention and packed-weight "
                    "switches do not apply", kvcc_model_bf16_name());
        free(now); free(atload); free(ids);
        return;
    }
    float *now = bf16_logits(ids, n, NULL, 0), *rowmajor = bf16_logits(ids, n, "KVCC_BF16_ROWMAJOR", 0),
          *f32att = bf16_logits(ids, n, "KVCC_BF16_ATTENTION_F32", 0),
          *atload = bf16_logits(ids, n, NULL, 1), *statef32 = bf16_logits(ids, n, "state", 0),
          *late = bf16_logits(ids, n, "late", 0),
          *shifted = bf16_logits(ids, n, "KVCC_BF16_ATTENTION_SHIFTED", 0);
    const double np_ = mean_nll(now, ids, n, nv), nr_ = mean_nll(rowmajor, ids, n, nv);
    cr_assert(fabs(np_ - nr_) < 0.005, "mean NLL prepacked %.5f vs row-major %.5f", np_, nr_);
    cr_assert(!memcmp(now, atload, (size_t)n * nv * sizeof(float)),
              "bf16 prefill logits differ between converting at load and after");
    cr_assert(!memcmp(f32att, statef32, (size_t)n * nv * sizeof(float)) &&
                  !memcmp(f32att, late, (size_t)n * nv * sizeof(float)),
              "kvcc_state_set_attention_f32 does not give the f32 attention's logits");
    cr_assert(memcmp(now, f32att, (size_t)n * nv * sizeof(float)) || !strstr(kvcc_model_bf16_name(), "attention in bf16"),
              "bf16 attention gave f32 attention's logits bit for bit");
    const double a = mean_nll(now, ids, n, nv), b = mean_nll(f32att, ids, n, nv);
    cr_assert(fabs(a - b) < 0.005, "mean NLL with bf16 attention %.5f vs f32 attention %.5f", a, b);
    int agree = 0;
    for (int t = 0; t < n; t++) {
        const float *x = now + (size_t)t * nv, *y = f32att + (size_t)t * nv;
        int ix = 0, iy = 0;
        for (int j = 1; j < nv; j++) {
            if (x[j] > x[ix]) ix = j;
            if (y[j] > y[iy]) iy = j;
        }
        agree += ix == iy;
    }
    cr_assert(agree >= (int)(0.95 * n), "top-1 agreement bf16 vs f32 attention: %d of %d", agree, n);
    /* the shifted path of bf16 attention on every row (what rows past the float range take) */
    const double sh = mean_nll(shifted, ids, n, nv);
    cr_assert(fabs(a - sh) < 0.002, "mean NLL bf16 attention %.5f vs its shifted path %.5f", a, sh);
    cr_assert(memcmp(now, shifted, (size_t)n * nv * sizeof(float)) || !strstr(kvcc_model_bf16_name(), "attention in bf16"),
              "KVCC_BF16_ATTENTION_SHIFTED changed nothing");
    cr_log_info("bf16 attention vs f32 attention on %d tokens: NLL %.5f vs %.5f, top-1 %d/%d; "
                "row-major weights NLL %.5f; the shifted path on every row %.5f (%s)", n, a, b,
                agree, n, nr_, sh, kvcc_model_bf16_name());
    free(now); free(rowmajor); free(f32att); free(atload); free(statef32); free(late); free(shifted);
    free(ids);
}
