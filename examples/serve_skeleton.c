/*
 * serve_skeleton.c: how a serving stack starts libkvrt and runs a policy: open the .kvpol
 * artifact against the model it runs (refused if compiled for another model), create a backend
 * context (CUDA when this libkvrt has it and a GPU is present, else CPU), print the device, run
 * one op, then open the handle of each policy the artifact carries (it holds every option the
 * artifact was compiled with) and run it on one layer: CompilerKV (prompt features over every
 * layer, then the kept tokens of one layer), Attention Matching (one layer compacted with the
 * compiled schedule, key selection and chunk), CompKV (a decode state with the compiled
 * grouping and one decode step), KV² (the two-stage plan with the compiled rho: proxy scores of
 * every layer, the reconstruction tokens' attention, one layer's cache) and merge-reduce (one
 * layer compressed with the compiled basis, and a decode stream). The q/k/v are made up
 * (deterministic, well-formed, of the artifact's dimensions); a real server passes its own
 * post-RoPE activations of the layer.
 * Every activation a policy reads is in the context's memory (kvrt_ctx_alloc + kvrt_ctx_upload:
 * device memory on a CUDA context, host memory on a CPU one), so the same calls run on either:
 * CompilerKV (kvrt_compilerkv_prompt_add_layer_ctx, kvrt_compilerkv_select; the kept tokens
 * gathered, moved into the context's memory with kvrt_cache_to_device, then one decode query
 * through kvrt_attend), Attention Matching (kvrt_am_compact_scheduled: the cache comes back in
 * the context's memory), CompKV (kvrt_compkv_create_layer, _append, _step), KV²
 * (kvrt_kv2_plan_create_scheduled, _proxy, _score, _compress) and merge-reduce
 * (kvrt_mr_compress_scheduled, then kvrt_attend) have CUDA versions (both key selections of AM
 * included). What a backend lacks returns KVRT_ERR_UNSUPPORTED naming it (docs/cuda.md), and this
 * program then runs the policy on a CPU context, saying so.
 * Only the serving header kvrt.h is used.
 *
 * Build: `make examples` (build/examples/serve_skeleton), or by hand after `make` (CPU-only):
 *   cc -std=c11 -O2 -Iruntime/include examples/serve_skeleton.c build/libkvrt.a \
 *      build/libkvpol.a -lopenblas -llapacke -lzstd -lxxhash -lm -fopenmp -o serve_skeleton
 * With a CUDA libkvrt (USE_CUDA=1) add:
 *      -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublas -lcudart -lstdc++
 * Run:
 *   ./serve_skeleton smollm2.kvpol [--cpu] [--policy compilerkv|am|compkv|kv2|merge-reduce]
 * (default: every one of them that the artifact carries, in that order). Exit 0 when the op
 * and every policy call succeed, 1 on a failure, 2 on a usage error. The model dimensions
 * below are SmolLM2-135M's; a real server takes them from its model config.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt.h"

enum { T_CTX = 512 }; /* context tokens of the made-up request */

/* Made-up but well-formed activations of `layer`: q [T, H, d], k, v [T, Hkv, d]. Keys carry a
 * slowly drifting direction plus a per-token wiggle, and every 37th token has a larger key, so
 * that the policies have something to choose between; queries lean towards the keys. */
static void fake_layer(uint32_t layer, int64_t T, uint32_t H, uint32_t Hkv, uint32_t d, float *q,
                       float *k, float *v) {
    for (int64_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < Hkv; j++)
            for (uint32_t i = 0; i < d; i++) {
                const size_t at = ((size_t)t * Hkv + j) * d + i;
                const float peak = t % 37 == 0 ? 3.0f : 1.0f;
                k[at] = peak * (sinf(0.01f * (float)t + 0.5f * (float)(i + j + layer)) +
                                0.3f * cosf(1.7f * (float)(t * (i + 1) % 97)));
                v[at] = cosf(0.02f * (float)t * (float)(1 + i % 5) + (float)(i + 3 * j));
            }
    for (int64_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t i = 0; i < d; i++)
                q[((size_t)t * H + h) * d + i] =
                    sinf(0.01f * (float)t + 0.5f * (float)(i + h / (H / Hkv) + layer)) +
                    0.5f * sinf(0.3f * (float)(h * d + i));
}

static int fail_call(const char *what, int rc) {
    fprintf(stderr, "error: %s: %s (%s)\n", what, kvrt_last_error()->msg, kvrt_status_name(rc));
    return rc;
}

/* The same for a call on a context (its message is the context's last error). */
static int fail_ctx(kvrt_ctx *ctx, const char *what, int rc) {
    fprintf(stderr, "error: %s: %s (%s)\n", what, kvrt_ctx_last_error(ctx)->msg,
            kvrt_status_name(rc));
    return rc;
}

/* "<what>: KV head 0 keeps positions p0 p1 ... (the first 12, and the last)" */
static void print_positions(const char *what, const int32_t *pos, int64_t n) {
    printf("%s: KV head 0 keeps positions", what);
    for (int64_t i = 0; i < n && i < 12; i++) printf(" %d", pos[i]);
    if (n > 12) printf(" ... %d", pos[n - 1]);
    printf("\n");
}

/* A copy of host[0..bytes) in ctx's memory (device memory on a CUDA context). NULL on failure,
 * with the message printed. */
static void *to_ctx(kvrt_ctx *ctx, const void *host, size_t bytes) {
    void *p = NULL;
    int rc = kvrt_ctx_alloc(ctx, bytes, &p);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, p, host, bytes);
    if (rc != KVRT_OK) {
        fail_ctx(ctx, "copying into the context's memory", rc);
        kvrt_ctx_dealloc(ctx, p);
        return NULL;
    }
    return p;
}

/* The next decode step over `cache` (in ctx's memory): the last token's queries q_last [H, d]
 * (standing in for the new token's) attend to it; prints "<what>: one decode query over <over>:
 * out[0][0..3] ...". */
static int decode_query(kvrt_ctx *ctx, const float *q_last, uint32_t H, uint32_t d,
                        const kvrt_cache *cache, const char *what, const char *over) {
    const size_t obytes = sizeof(float) * H * d;
    float *out = malloc(obytes);
    void *dq = out ? to_ctx(ctx, q_last, obytes) : NULL, *dout = NULL;
    int rc = dq == NULL || kvrt_ctx_alloc(ctx, obytes, &dout) != KVRT_OK
                 ? KVRT_ERR_NOMEM
                 : kvrt_attend(ctx, dq, 1, H, cache, NULL, NULL, 0, 1.0f / sqrtf((float)d), dout,
                               NULL);
    if (rc == KVRT_OK) rc = kvrt_ctx_download(ctx, out, dout, obytes);
    if (rc == KVRT_OK)
        printf("%s: one decode query over %s: out[0][0..3] %.4f %.4f %.4f %.4f\n", what, over,
               out[0], out[1], out[2], out[3]);
    else
        fail_ctx(ctx, "kvrt_attend", rc);
    kvrt_ctx_dealloc(ctx, dq);
    kvrt_ctx_dealloc(ctx, dout);
    free(out);
    return rc;
}

/* CompilerKV: the prompt's features over every layer, then the kept tokens of `layer` at the
 * smallest compiled budget, gathered into an f16 cache in the context's memory, and one decode
 * query attending to it. */
static int run_compilerkv(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                          const kvrt_model_dims *m, uint32_t layer, float *q, float *k,
                          float *v) {
    const int64_t T = T_CTX, budget = tb->budgets[0];
    const uint32_t H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    const size_t qbytes = sizeof(float) * (size_t)T * H * d;
    const size_t kbytes = sizeof(float) * (size_t)T * Hkv * d;
    printf("compilerkv: %u compiled budgets (smallest %lld tokens), window %u\n", tb->n_budgets,
           (long long)budget, tb->window);
    if (budget >= T) {
        fprintf(stderr, "error: the smallest compiled budget, %lld tokens, is not below this "
                "example's %lld context tokens\n", (long long)budget, (long long)T);
        return KVRT_ERR_ARG;
    }
    kvrt_compilerkv_prompt *pr = NULL;
    float *next_logprob = malloc(sizeof(float) * (T - 1));
    kvrt_selection *sel = NULL;
    kvrt_cache *host_cache = NULL, *cache = NULL;
    void *dq = NULL, *dk = NULL, *dv = NULL;
    kvrt_compilerkv_stats st;
    int rc = next_logprob ? kvrt_compilerkv_prompt_create(T, tb->window, &pr) : KVRT_ERR_NOMEM;
    if (rc != KVRT_OK) {
        free(next_logprob);
        return fail_call("kvrt_compilerkv_prompt_create", rc);
    }
    /* as the prefill goes: each layer's q and k, in the context's memory, add to the features */
    for (uint32_t l = 0; l < m->n_layers && rc == KVRT_OK; l++) {
        fake_layer(l, T, H, Hkv, d, q, k, v);
        dq = to_ctx(ctx, q, qbytes);
        dk = dq ? to_ctx(ctx, k, kbytes) : NULL;
        if (dk == NULL) rc = KVRT_ERR_NOMEM;
        else if ((rc = kvrt_compilerkv_prompt_add_layer_ctx(ctx, pr, dq, dk, H, Hkv, d)) != KVRT_OK)
            fail_ctx(ctx, "kvrt_compilerkv_prompt_add_layer_ctx", rc);
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, dk);
        dq = dk = NULL;
    }
    for (int64_t t = 0; t + 1 < T; t++) next_logprob[t] = -2.5f - sinf(0.1f * (float)t);
    if (rc == KVRT_OK && (rc = kvrt_compilerkv_prompt_finish(pr, next_logprob)) != KVRT_OK)
        rc = fail_call("kvrt_compilerkv_prompt_finish", rc);
    if (rc == KVRT_OK) { /* the layer's values, in the context's memory, for the value norms */
        fake_layer(layer, T, H, Hkv, d, q, k, v);
        if ((dv = to_ctx(ctx, v, kbytes)) == NULL) rc = KVRT_ERR_NOMEM;
        else if ((rc = kvrt_compilerkv_select(ctx, tb, pr, layer, dv, Hkv, d, budget, 0, &sel,
                                              &st)) != KVRT_OK)
            rc = fail_call("kvrt_compilerkv_select", rc);
    }
    /* the kept tokens: gathered on the host (the selection is host memory), then one copy of
     * what is kept, and only that, into the context's memory */
    if (rc == KVRT_OK &&
        (rc = kvrt_cache_gather(k, v, T, Hkv, d, sel, KVRT_DTYPE_F16, &host_cache)) != KVRT_OK)
        rc = fail_call("kvrt_cache_gather", rc);
    if (rc == KVRT_OK && (rc = kvrt_cache_to_device(ctx, host_cache, &cache)) != KVRT_OK)
        fail_ctx(ctx, "kvrt_cache_to_device", rc);
    if (rc == KVRT_OK) {
        printf("compilerkv: layer %u, %lld context tokens, budget %lld: kept %lld, one set for "
               "all KV heads (tau %.4g, risk bins %d/%d), f16 cache %zu bytes\n", layer,
               (long long)T, (long long)budget, (long long)st.kept, st.tau, st.b_ent, st.b_ppl,
               kvrt_cache_bytes(cache));
        print_positions("compilerkv", sel->positions, sel->offsets[1] - sel->offsets[0]);
        rc = decode_query(ctx, q + (size_t)(T - 1) * H * d, H, d, cache, "compilerkv",
                          "the kept tokens");
    }
    kvrt_ctx_dealloc(ctx, dv);
    kvrt_cache_free(cache);
    kvrt_cache_free(host_cache);
    kvrt_selection_free(sel);
    kvrt_compilerkv_prompt_free(pr);
    free(next_logprob);
    return rc;
}

/* Attention Matching: `layer` compacted at the first compiled target with the compiled
 * per-head ratios, key selection and chunk (o NULL: the compiled options). */
static int run_am(kvrt_ctx *ctx, const kvrt_am_schedule *s, const kvrt_model_dims *m,
                  uint32_t layer, float *q, float *k, float *v) {
    const double *targets;
    int n_targets;
    kvrt_am_opts o;
    const float *ratios;
    int rc = kvrt_am_schedule_targets(s, &targets, &n_targets);
    if (rc == KVRT_OK) rc = kvrt_am_schedule_opts(s, &o);
    if (rc == KVRT_OK) rc = kvrt_am_schedule_ratios(s, targets[0], layer, &ratios);
    if (rc != KVRT_OK) return fail_call("the AM schedule", rc);
    printf("am: %d compiled targets (first %g), key selection %s, chunk %lld\n", n_targets,
           targets[0], o.key_select == KVRT_AM_SELECT_OMP ? "omp" : "highest",
           (long long)o.chunk);
    const int64_t T = T_CTX;
    fake_layer(layer, T, m->n_heads, m->n_kv_heads, m->head_dim, q, k, v);
    /* the layer's q, k, v in the context's memory; the compacted cache comes back there too */
    const size_t qbytes = sizeof(float) * (size_t)T * m->n_heads * m->head_dim;
    const size_t kbytes = sizeof(float) * (size_t)T * m->n_kv_heads * m->head_dim;
    void *dq = to_ctx(ctx, q, qbytes), *dk = dq ? to_ctx(ctx, k, kbytes) : NULL;
    void *dv = dk ? to_ctx(ctx, v, kbytes) : NULL;
    kvrt_am_stats *stats = calloc(m->n_kv_heads, sizeof *stats);
    kvrt_cache *cache = NULL;
    rc = stats && dv ? kvrt_am_compact_scheduled(ctx, s, NULL, 0, targets[0], layer, dq, dk, dv,
                                                 T, m->n_heads, KVRT_DTYPE_F16, &cache, stats)
                     : KVRT_ERR_NOMEM;
    kvrt_ctx_dealloc(ctx, dq);
    kvrt_ctx_dealloc(ctx, dk);
    kvrt_ctx_dealloc(ctx, dv);
    if (rc != KVRT_OK) {
        free(stats);
        return fail_call("kvrt_am_compact_scheduled", rc);
    }
    printf("am: layer %u, %lld context tokens, target %g: f16 cache %zu bytes\n", layer,
           (long long)T, targets[0], kvrt_cache_bytes(cache));
    for (uint32_t j = 0; j < m->n_kv_heads; j++)
        printf("am: KV head %u: ratio %.4f, %lld entries asked, %lld kept, mass error %.2e, "
               "output error %.2e\n", j, ratios[j], (long long)stats[j].asked,
               (long long)stats[j].kept, stats[j].mass_relerr, stats[j].out_relerr);
    kvrt_cache_free(cache);
    free(stats);
    return KVRT_OK;
}

/* CompKV: a decode state of `layer` with the compiled grouping, the context appended, one decode
 * step that reads a quarter of the blocks exactly and the rest through their means. */
static int run_compkv(kvrt_ctx *ctx, const kvrt_compkv_grouping *g, const kvrt_model_dims *m,
                      uint32_t layer, float *q, float *k, float *v) {
    kvrt_compkv_opts o;
    int rc = kvrt_compkv_grouping_opts(g, &o);
    if (rc != KVRT_OK) return fail_call("kvrt_compkv_grouping_opts", rc);
    uint32_t n_learned = 0;
    for (uint32_t j = 0; j < g->n_kv_heads; j++) n_learned += g->learned[layer * g->n_kv_heads + j];
    printf("compkv: block %u tokens, r %u variance groups; layer %u: learned grouping on %u of %u "
           "KV heads\n", o.block, o.r, layer, n_learned, g->n_kv_heads);
    const int64_t T = T_CTX;
    fake_layer(layer, T, m->n_heads, m->n_kv_heads, m->head_dim, q, k, v);
    kvrt_compkv *st = NULL;
    rc = kvrt_compkv_create_layer(ctx, g, layer, T, NULL, 0, &st);
    if (rc != KVRT_OK) return fail_call("kvrt_compkv_create_layer", rc);
    const int64_t n_blocks = (T + o.block - 1) / o.block;
    const int64_t k_blocks = n_blocks >= 8 ? n_blocks / 4 : (n_blocks + 1) / 2;
    /* the state lives in the context's memory, and so does every array its calls take */
    const size_t kbytes = sizeof(float) * (size_t)T * m->n_kv_heads * m->head_dim;
    const size_t obytes = sizeof(float) * m->n_heads * m->head_dim;
    const size_t bbytes = sizeof(int32_t) * m->n_kv_heads * (size_t)k_blocks;
    float *out = malloc(obytes);
    int32_t *blocks = malloc(bbytes);
    void *dk = out && blocks ? to_ctx(ctx, k, kbytes) : NULL;
    void *dv = dk ? to_ctx(ctx, v, kbytes) : NULL;
    /* the last token's queries stand in for the next decode step's */
    void *dq = dv ? to_ctx(ctx, q + (size_t)(T - 1) * m->n_heads * m->head_dim, obytes) : NULL;
    void *dout = NULL, *dblocks = NULL;
    if (dq == NULL || kvrt_ctx_alloc(ctx, obytes, &dout) != KVRT_OK ||
        kvrt_ctx_alloc(ctx, bbytes, &dblocks) != KVRT_OK)
        rc = KVRT_ERR_NOMEM;
    else if ((rc = kvrt_compkv_append(st, dk, dv, T)) != KVRT_OK)
        rc = fail_call("kvrt_compkv_append", rc);
    else if ((rc = kvrt_compkv_step(st, dq, m->n_heads, k_blocks, dout, dblocks)) != KVRT_OK)
        rc = fail_call("kvrt_compkv_step", rc);
    if (rc == KVRT_OK && ((rc = kvrt_ctx_download(ctx, out, dout, obytes)) != KVRT_OK ||
                          (rc = kvrt_ctx_download(ctx, blocks, dblocks, bbytes)) != KVRT_OK))
        fail_ctx(ctx, "kvrt_ctx_download", rc);
    if (rc == KVRT_OK) {
        printf("compkv: layer %u, %lld tokens in %lld blocks: one step reads %lld blocks per KV "
               "head\n", layer, (long long)kvrt_compkv_length(st), (long long)n_blocks,
               (long long)k_blocks);
        printf("compkv: KV head 0 reads blocks");
        for (int64_t i = 0; i < k_blocks && i < n_blocks; i++) printf(" %d", blocks[i]);
        printf("; out[0][0..3] %.4f %.4f %.4f %.4f\n", out[0], out[1], out[2], out[3]);
    }
    kvrt_ctx_dealloc(ctx, dk);
    kvrt_ctx_dealloc(ctx, dv);
    kvrt_ctx_dealloc(ctx, dq);
    kvrt_ctx_dealloc(ctx, dout);
    kvrt_ctx_dealloc(ctx, dblocks);
    free(blocks);
    free(out);
    kvrt_compkv_free(st);
    return rc;
}

/* KV head 0's positions of a cache in ctx's memory (-1: a merged entry), downloaded into a
 * malloc'd array; *n0 their count. NULL on failure, with the message printed. */
static int32_t *head0_positions(kvrt_ctx *ctx, const kvrt_cache *cache, int64_t *n0) {
    *n0 = cache->host_offsets[1] - cache->host_offsets[0];
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)(*n0 ? *n0 : 1));
    if (pos == NULL) {
        fprintf(stderr, "error: out of memory\n");
        return NULL;
    }
    int rc = *n0 > 0 ? kvrt_ctx_download(ctx, pos, cache->positions, sizeof(int32_t) * (size_t)*n0)
                     : KVRT_OK;
    if (rc != KVRT_OK) {
        fail_ctx(ctx, "kvrt_ctx_download", rc);
        free(pos);
        return NULL;
    }
    return pos;
}

/* KV²: stage 1 scores every layer's keys (the proxy); stage 2 runs, chunk by chunk, the
 * reconstruction tokens the plan names after the context through the model and scores the
 * context's keys by their attention (a real server runs its forward pass on tokens[pos[i]] at
 * position ids pos_ids[i] and hands back every layer's post-RoPE queries and keys; here the
 * made-up activations of those positions stand in for them); then `layer` is compressed at the
 * first compiled budget (a ratio of the context) and one decode query attends to its cache. */
static int run_kv2(kvrt_ctx *ctx, const kvrt_kv2_schedule *s, const kvrt_model_dims *m,
                   uint32_t layer, float *q, float *k, float *v) {
    const double *budgets, *rho;
    int n_budgets;
    kvrt_kv2_opts o;
    int rc = kvrt_kv2_schedule_budgets(s, &budgets, &rho, &n_budgets);
    if (rc == KVRT_OK) rc = kvrt_kv2_schedule_opts(s, budgets[0], 0, &o);
    if (rc != KVRT_OK) return fail_call("the KV2 schedule", rc);
    const int64_t T = T_CTX;
    const uint32_t L = m->n_layers, H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    printf("kv2: %d compiled budgets (first %g, rho %g), proxy %s, %u pass%s, %u sinks\n",
           n_budgets, budgets[0], rho[0], kvrt_kv2_proxy_name(o.proxy), o.passes,
           o.passes == 1 ? "" : "es", o.n_sink);
    kvrt_kv2_plan *pl = NULL;
    if ((rc = kvrt_kv2_plan_create_scheduled(ctx, s, NULL, 0, budgets[0], H, d, T, &pl)) != KVRT_OK)
        return fail_call("kvrt_kv2_plan_create_scheduled", rc);
    const size_t qrow = (size_t)H * d, krow = (size_t)Hkv * d, kbytes = sizeof(float) * T * krow;
    int32_t *pos = malloc(sizeof(int32_t) * T);
    float *qn = malloc(sizeof(float) * T * qrow), *kn = malloc(sizeof(float) * T * krow);
    void *dq = NULL, *dk = NULL, *dkn = NULL, *dv = NULL;
    kvrt_cache *cache = NULL;
    if (pos == NULL || qn == NULL || kn == NULL) {
        fprintf(stderr, "error: out of memory\n");
        rc = KVRT_ERR_NOMEM;
    }
    /* stage 1, as the prefill goes: each layer's keys in the context's memory */
    for (uint32_t l = 0; rc == KVRT_OK && l < L; l++) {
        fake_layer(l, T, H, Hkv, d, q, k, v);
        if ((dk = to_ctx(ctx, k, kbytes)) == NULL) rc = KVRT_ERR_NOMEM;
        else if ((rc = kvrt_kv2_plan_proxy(pl, l, dk)) != KVRT_OK)
            fail_call("kvrt_kv2_plan_proxy", rc);
        kvrt_ctx_dealloc(ctx, dk);
        dk = NULL;
    }
    /* stage 2: per chunk, the reconstruction tokens' queries and keys of every layer */
    for (uint32_t pass = 1; rc == KVRT_OK && pass <= o.passes; pass++) {
        for (int64_t r = 0; rc == KVRT_OK && r < kvrt_kv2_plan_n_chunks(pl); r++) {
            int64_t n = 0;
            if ((rc = kvrt_kv2_plan_queries(pl, r, pos, NULL, &n)) != KVRT_OK) {
                fail_call("kvrt_kv2_plan_queries", rc);
                break;
            }
            for (uint32_t l = 0; rc == KVRT_OK && l < L; l++) {
                fake_layer(l, T, H, Hkv, d, q, k, v);
                for (int64_t i = 0; i < n; i++) {
                    memcpy(qn + (size_t)i * qrow, q + (size_t)pos[i] * qrow, sizeof(float) * qrow);
                    memcpy(kn + (size_t)i * krow, k + (size_t)pos[i] * krow, sizeof(float) * krow);
                }
                dq = to_ctx(ctx, qn, sizeof(float) * (size_t)n * qrow);
                dk = dq ? to_ctx(ctx, k, kbytes) : NULL;
                dkn = dk ? to_ctx(ctx, kn, sizeof(float) * (size_t)n * krow) : NULL;
                if (dkn == NULL) rc = KVRT_ERR_NOMEM;
                else if ((rc = kvrt_kv2_plan_score(pl, r, l, dq, n, dk, dkn)) != KVRT_OK)
                    fail_call("kvrt_kv2_plan_score", rc);
                kvrt_ctx_dealloc(ctx, dq);
                kvrt_ctx_dealloc(ctx, dk);
                kvrt_ctx_dealloc(ctx, dkn);
                dq = dk = dkn = NULL;
            }
        }
        if (rc == KVRT_OK && pass < o.passes && (rc = kvrt_kv2_plan_next_pass(pl)) != KVRT_OK)
            fail_call("kvrt_kv2_plan_next_pass", rc);
    }
    /* the layer's cache at the budget, in the context's memory */
    if (rc == KVRT_OK) {
        fake_layer(layer, T, H, Hkv, d, q, k, v);
        dk = to_ctx(ctx, k, kbytes);
        dv = dk ? to_ctx(ctx, v, kbytes) : NULL;
        if (dv == NULL) rc = KVRT_ERR_NOMEM;
        else if ((rc = kvrt_kv2_plan_compress(pl, layer, budgets[0], dk, dv, KVRT_DTYPE_F16,
                                              &cache)) != KVRT_OK)
            fail_call("kvrt_kv2_plan_compress", rc);
    }
    int64_t n0 = 0;
    int32_t *kept = rc == KVRT_OK ? head0_positions(ctx, cache, &n0) : NULL;
    if (rc == KVRT_OK && kept == NULL) rc = KVRT_ERR_NOMEM;
    if (rc == KVRT_OK) {
        printf("kv2: layer %u, %lld context tokens, budget %g: %lld entries per KV head, f16 "
               "cache %zu bytes\n", layer, (long long)T, budgets[0], (long long)n0,
               kvrt_cache_bytes(cache));
        print_positions("kv2", kept, n0);
        rc = decode_query(ctx, q + (size_t)(T - 1) * qrow, H, d, cache, "kv2", "the cache");
    }
    kvrt_ctx_dealloc(ctx, dk);
    kvrt_ctx_dealloc(ctx, dv);
    kvrt_cache_free(cache);
    kvrt_kv2_plan_free(pl);
    free(kept);
    free(pos);
    free(qn);
    free(kn);
    return rc;
}

/* merge-reduce: `layer` compressed at the first compiled budget with the compiled basis and
 * options (sinks, the summary of the middle blocks with bias log w, the recent window), the
 * cache in the context's memory, and one decode query attending to it; then the same tokens
 * through a decode stream (kvrt_mr_stream_*: device rows in, a device cache out on CUDA) and a
 * decode query over its cache. */
static int run_mr(kvrt_ctx *ctx, const kvrt_mr_schedule *s, const kvrt_model_dims *m,
                  uint32_t layer, float *q, float *k, float *v) {
    const double *budgets;
    int n_budgets;
    kvrt_mr_opts o;
    int rc = kvrt_mr_schedule_budgets(s, &budgets, &n_budgets);
    if (rc == KVRT_OK) rc = kvrt_mr_schedule_opts(s, &o);
    if (rc != KVRT_OK) return fail_call("the merge-reduce schedule", rc);
    printf("merge-reduce: %d compiled budgets (first %g), reducer %s, %u sinks, recent %g of "
           "the budget%s\n", n_budgets, budgets[0], kvrt_mr_reducer_name(o.reducer), o.n_sink,
           o.recent_frac, o.mass_comp ? ", mass compensation" : "");
    const int64_t T = T_CTX;
    const uint32_t H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    fake_layer(layer, T, H, Hkv, d, q, k, v);
    const size_t kbytes = sizeof(float) * (size_t)T * Hkv * d;
    void *dk = to_ctx(ctx, k, kbytes), *dv = dk ? to_ctx(ctx, v, kbytes) : NULL;
    kvrt_cache *cache = NULL;
    rc = dv ? kvrt_mr_compress_scheduled(ctx, s, NULL, 0, budgets[0], layer, dk, dv, T,
                                         KVRT_DTYPE_F16, &cache)
            : KVRT_ERR_NOMEM;
    if (rc != KVRT_OK && rc != KVRT_ERR_NOMEM) fail_call("kvrt_mr_compress_scheduled", rc);
    /* KV head 0's positions (-1: merged entries), read from the context's memory */
    int64_t n0 = 0;
    int32_t *pos = rc == KVRT_OK ? head0_positions(ctx, cache, &n0) : NULL;
    if (rc == KVRT_OK && pos == NULL) rc = KVRT_ERR_NOMEM;
    if (rc == KVRT_OK) {
        int64_t merged = 0;
        for (int64_t i = 0; i < n0; i++) merged += pos[i] < 0;
        printf("merge-reduce: layer %u, %lld context tokens, budget %g: %lld entries per KV "
               "head (%lld merged), f16 cache %zu bytes\n", layer, (long long)T, budgets[0],
               (long long)n0, (long long)merged, kvrt_cache_bytes(cache));
        print_positions("merge-reduce", pos, n0);
        /* the summary's bias log w weighs the merged entries */
        rc = decode_query(ctx, q + (size_t)(T - 1) * H * d, H, d, cache, "merge-reduce",
                          "the cache");
    }
    /* decode: a stream with the compiled basis takes the tokens as they come (here the
     * context's, 64 at a time, from the context's memory) and keeps sinks, dyadic buckets of
     * MR_K merged entries, the filling block and MR_RECENT exact tokens */
    kvrt_mr_basis basis;
    kvrt_mr_stream *st = NULL;
    kvrt_cache *sc = NULL;
    enum { MR_K = 32, MR_RECENT = 16 };
    if (rc == KVRT_OK && (rc = kvrt_mr_schedule_basis(s, budgets[0], 0, layer, &basis)) != KVRT_OK)
        fail_call("kvrt_mr_schedule_basis", rc);
    if (rc == KVRT_OK &&
        (rc = kvrt_mr_stream_create(ctx, &o, &basis, layer, Hkv, d, MR_K, MR_RECENT, &st)) != KVRT_OK)
        fail_call("kvrt_mr_stream_create", rc);
    for (int64_t t = 0; rc == KVRT_OK && t < T; t += 64) {
        const int64_t n = T - t < 64 ? T - t : 64;
        const size_t at = (size_t)t * Hkv * d;
        if ((rc = kvrt_mr_stream_append(st, (const float *)dk + at, (const float *)dv + at, n)) != KVRT_OK)
            fail_call("kvrt_mr_stream_append", rc);
    }
    if (rc == KVRT_OK && (rc = kvrt_mr_stream_cache(st, 0, KVRT_DTYPE_F16, &sc)) != KVRT_OK)
        fail_call("kvrt_mr_stream_cache", rc);
    if (rc == KVRT_OK) {
        printf("merge-reduce: decode stream, %lld tokens appended: %lld entries per KV head "
               "(K %d, %d recent)\n", (long long)kvrt_mr_stream_length(st),
               (long long)kvrt_mr_stream_entries(st), MR_K, MR_RECENT);
        rc = decode_query(ctx, q + (size_t)(T - 1) * H * d, H, d, sc, "merge-reduce",
                          "the stream's cache");
    }
    kvrt_cache_free(sc);
    kvrt_mr_stream_free(st);
    kvrt_ctx_dealloc(ctx, dk);
    kvrt_ctx_dealloc(ctx, dv);
    kvrt_cache_free(cache);
    free(pos);
    return rc;
}

/* A kvrt_*_open status: KVRT_ERR_UNSUPPORTED says the artifact does not carry that policy (not
 * an error here: the caller tries the next one); other failures are reported. 1 when open. */
static int opened(const char *fn, int rc, int *found) {
    *found = rc != KVRT_ERR_UNSUPPORTED;
    if (*found && rc != KVRT_OK) fail_call(fn, rc);
    return rc == KVRT_OK;
}

/* The policies this program runs, in the order it runs them. */
static const char *const POLICIES[] = {"compilerkv", "am", "compkv", "kv2", "merge-reduce"};
enum { N_POLICIES = sizeof POLICIES / sizeof POLICIES[0] };

/* Opens the handle of policy `name` (one of POLICIES) and runs it on the middle layer.
 * *found: 0 when the artifact does not carry it (the status is then KVRT_ERR_UNSUPPORTED). */
static int run_policy(kvrt_ctx *ctx, const kvrt_policy *pol, const char *name, int *found) {
    kvrt_model_dims m;
    kvrt_policy_model(pol, &m);
    const uint32_t layer = m.n_layers / 2;
    const size_t nq = (size_t)T_CTX * m.n_heads * m.head_dim;
    const size_t nk = (size_t)T_CTX * m.n_kv_heads * m.head_dim;
    float *q = malloc(sizeof(float) * nq), *k = malloc(sizeof(float) * nk);
    float *v = malloc(sizeof(float) * nk);
    int rc = KVRT_ERR_NOMEM;
    *found = 0;
    if (q == NULL || k == NULL || v == NULL) {
        fprintf(stderr, "error: out of memory\n");
    } else if (!strcmp(name, "compilerkv")) {
        kvrt_compilerkv_tables *tb = NULL;
        if (opened("kvrt_compilerkv_open", rc = kvrt_compilerkv_open(pol, &tb), found))
            rc = run_compilerkv(ctx, tb, &m, layer, q, k, v);
        kvrt_compilerkv_tables_free(tb);
    } else if (!strcmp(name, "am")) {
        kvrt_am_schedule *s = NULL;
        if (opened("kvrt_am_open", rc = kvrt_am_open(pol, &s), found))
            rc = run_am(ctx, s, &m, layer, q, k, v);
        kvrt_am_schedule_free(s);
    } else if (!strcmp(name, "compkv")) {
        kvrt_compkv_grouping *g = NULL;
        if (opened("kvrt_compkv_open", rc = kvrt_compkv_open(pol, &g), found))
            rc = run_compkv(ctx, g, &m, layer, q, k, v);
        kvrt_compkv_grouping_free(g);
    } else if (!strcmp(name, "kv2")) {
        kvrt_kv2_schedule *s = NULL;
        if (opened("kvrt_kv2_open", rc = kvrt_kv2_open(pol, &s), found))
            rc = run_kv2(ctx, s, &m, layer, q, k, v);
        kvrt_kv2_schedule_free(s);
    } else {
        kvrt_mr_schedule *s = NULL;
        if (opened("kvrt_mr_open", rc = kvrt_mr_open(pol, &s), found))
            rc = run_mr(ctx, s, &m, layer, q, k, v);
        kvrt_mr_schedule_free(s);
    }
    free(q);
    free(k);
    free(v);
    return rc;
}

int main(int argc, char **argv) {
    const char *path = NULL, *policy = NULL;
    int force_cpu = 0, usage = argc < 2;
    for (int i = 1; i < argc && !usage; i++) {
        if (strcmp(argv[i], "--cpu") == 0) force_cpu = 1;
        else if (strcmp(argv[i], "--policy") == 0 && i + 1 < argc) policy = argv[++i];
        else if (argv[i][0] != '-' && !path) path = argv[i];
        else usage = 1;
    }
    int known = policy == NULL;
    for (int i = 0; i < N_POLICIES && !known; i++) known = !strcmp(policy, POLICIES[i]);
    if (usage || !path || !known) {
        fprintf(stderr, "usage: %s MODEL.kvpol [--cpu] [--policy "
                "compilerkv|am|compkv|kv2|merge-reduce]\n", argv[0]);
        return 2;
    }
    printf("libkvrt %s\n", kvrt_version());

    // --- 1. the policy artifact, checked against the model this server runs
    kvrt_model_dims model = {0};
    model.n_layers = 30;
    model.n_heads = 9;
    model.n_kv_heads = 3;
    model.head_dim = 64;
    model.vocab_size = 49152;
    model.rope_theta = 100000.0;
    model.name = NULL; // names are free-form; dimensions are what must agree

    kvrt_error err;
    kvrt_policy *pol = NULL;
    // what the open may decode: a server holds artifacts to what its models need (this model's
    // decodes to ~2 MB); 0 would be the reader's defaults, 1 GiB per section and 8 GiB in all
    const kvrt_policy_limits lim = {.max_section_bytes = 64u << 20, .max_total_bytes = 256u << 20};
    int rc = kvrt_policy_open_limited(path, &model, &lim, &pol, &err);
    if (rc != KVRT_OK) {
        // e.g. "smollm2.kvpol: model field 'n_kv_heads': artifact has 3, caller runs 8 (...)"
        fprintf(stderr, "error: %s (%s)\n", err.msg, kvrt_status_name(rc));
        return 1;
    }
    kvrt_model_dims got;
    kvrt_policy_model(pol, &got);
    printf("policy: %s compiled for '%s' (%u layers, %u/%u heads, head_dim %u), groups 0x%x\n",
           path, got.name, got.n_layers, got.n_heads, got.n_kv_heads, got.head_dim,
           kvrt_policy_groups(pol));

    // --- 2. a backend context: CUDA when available, else CPU
    int backend = KVRT_BACKEND_CPU;
    if (!force_cpu && kvrt_has_cuda() && kvrt_cuda_device_count() > 0) backend = KVRT_BACKEND_CUDA;
    kvrt_ctx_options opts = {0, 0}; // OpenMP default threads; CUDA device 0
    kvrt_ctx *ctx = NULL;
    rc = kvrt_ctx_create(backend, &opts, &ctx, &err);
    if (rc != KVRT_OK && backend == KVRT_BACKEND_CUDA) {
        fprintf(stderr, "warning: %s; falling back to the CPU\n", err.msg);
        backend = KVRT_BACKEND_CPU;
        rc = kvrt_ctx_create(backend, &opts, &ctx, &err);
    }
    if (rc != KVRT_OK) {
        fprintf(stderr, "error: %s (%s)\n", err.msg, kvrt_status_name(rc));
        kvrt_policy_free(pol);
        return 1;
    }
    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    if (info.backend == KVRT_BACKEND_CUDA)
        printf("device: CUDA %d: %s, compute capability %d.%d, %.1f GiB\n", info.device_id,
               info.name, info.cc_major, info.cc_minor,
               (double)info.total_mem / (1024.0 * 1024.0 * 1024.0));
    else
        printf("device: %s\n", info.name);

    // --- 3. one op on the context's device: attention weights of one head, scale 1/sqrt(d)
    enum { ROWS = 4, COLS = 8 };
    float scores[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) scores[i] = (float)((i * 37) % 11) - 5.0f;
    const int64_t shape[2] = {ROWS, COLS};
    void *buf = scores;
    int dev = KVRT_DEVICE_HOST;
    if (info.backend == KVRT_BACKEND_CUDA) {
        dev = KVRT_DEVICE_CUDA;
        rc = kvrt_ctx_alloc(ctx, sizeof scores, &buf);
        if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, buf, scores, sizeof scores);
    }
    kvrt_tensor t = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 2, shape, dev);
    t.device_id = info.device_id;
    if (rc == KVRT_OK) rc = kvrt_softmax_rows(ctx, &t, &t, 0.125f); // in place
    if (rc == KVRT_OK && dev == KVRT_DEVICE_CUDA)
        rc = kvrt_ctx_download(ctx, scores, buf, sizeof scores);
    if (rc != KVRT_OK)
        fail_ctx(ctx, "softmax", rc);
    else
        printf("softmax row 0: %.4f %.4f %.4f %.4f ...\n", scores[0], scores[1], scores[2],
               scores[3]);
    if (dev == KVRT_DEVICE_CUDA) kvrt_ctx_dealloc(ctx, buf);

    // --- 4. per request / per layer: each policy's handle from the artifact, run on one layer
    // (every policy the artifact carries, or the one --policy names). Every policy runs on
    // either backend; what this CUDA backend lacks (AM's OMP key selection, docs/cuda.md) says
    // KVRT_ERR_UNSUPPORTED naming it, and the policy then runs on a CPU context (its arrays in
    // host memory: run_policy copies into the context's).
    int n_run = 0;
    for (int i = 0; rc == KVRT_OK && i < N_POLICIES; i++) {
        if (policy && strcmp(policy, POLICIES[i])) continue;
        int found;
        rc = run_policy(ctx, pol, POLICIES[i], &found);
        if (found && rc == KVRT_ERR_UNSUPPORTED && info.backend == KVRT_BACKEND_CUDA) {
            kvrt_ctx *cpu = NULL;
            fprintf(stderr, "note: %s; running the policy on a CPU context instead\n",
                    kvrt_last_error()->msg);
            rc = kvrt_ctx_create(KVRT_BACKEND_CPU, &opts, &cpu, &err);
            if (rc == KVRT_OK) rc = run_policy(cpu, pol, POLICIES[i], &found);
            else fprintf(stderr, "error: %s (%s)\n", err.msg, kvrt_status_name(rc));
            kvrt_ctx_free(cpu);
        }
        if (!found && rc == KVRT_ERR_UNSUPPORTED) rc = KVRT_OK; /* not carried: the next one */
        else n_run++;
    }
    if (rc == KVRT_OK && n_run == 0) {
        fprintf(stderr, "error: %s carries no %s policy group\n", path,
                policy ? policy : "CompilerKV, Attention Matching, CompKV, KV2 or merge-reduce");
        rc = KVRT_ERR_UNSUPPORTED;
    }

    kvrt_ctx_free(ctx);
    kvrt_policy_free(pol);
    return rc == KVRT_OK ? 0 : 1;
}
