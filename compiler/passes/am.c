/*
 * am.c: the Attention Matching pass of `kvcc compile --policies am` (docs/policies/am.md,
 * "The offline calibration"): per-(layer, KV head) sensitivity curves over a ratio grid, measured by compacting
 * each calibration context with the runtime's own kvrt_am_compact_layer (runtime/cpu/am.c), and
 * the greedy-exchange head-budget schedule for each target mean ratio. Writes sections
 * am.schedule (critical: what kvrt_am_open and kvcc eval's `am` read) and am.curves, and
 * summarizes them for `kvcc inspect`.
 * Callers: compiler/cmd_compile.c and cmd_inspect.c through the pass table (registry.c).
 *
 * defines: kvcc_pass_am (its options and its kvcc eval methods am, am-uniform, am-omp)
 *
 * Loss of a head at ratio r: the context [0, C) of every (prompt, layer) is compacted with ratio
 * r for every KV head (uniform), then the continuation queries [C, T) attend through kvrt_attend
 * to the compacted context plus the exact continuation keys (causal), as kvcc eval's layer-local
 * path does; loss = |o_c - o_full| / |o_full| averaged over continuation queries, the G query
 * heads of the KV head, and the prompts. Mass error: the same queries over the context block
 * alone, |exp(lse_c - lse_full) - 1| (the compacted block's attention mass relative to the
 * original's), averaged the same way.
 * Schedule: budgets in units of T / 1024; start uniform at the target (total units
 * round(target * 1024 * L * Hkv), spread evenly, first heads take the remainder); repeatedly move
 * one unit from the head whose interpolated loss rises least to the head whose loss falls most,
 * while that lowers the total loss (ties: lowest head index); every head keeps at least one unit.
 * Losses between grid points are interpolated linearly in log(ratio); ratio 1 has loss 0; below
 * the grid the first segment is extrapolated (never below the loss at the smallest ratio).
 * Speed: the whole ratio grid of a layer is compacted in one kvrt_am_compact_layer_multi call, which
 * computes each KV head's logits and targets once for all ratios.
 * Determinism: everything is sequential except inside the runtime calls, whose output does not
 * depend on the thread count.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "eval_methods.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "dist.h"
#include "loop.h"
#include "metrics.h"
#include "passes.h"
#include "loader.h"
#include "stats.h"

#define AM_UNITS 1024 /* budget units per head (fractions of T) */

// ----------------------------------------------------------------------------
// reference queries from the built-in model (kvrt.h, kvrt_am_compact_layer_ref):
//  - repeat-prefill: the model runs [context], then [instruction, context] at position ids
//    C .. 2C + m - 1 on top of it (rolled back); the second copy's post-RoPE queries of every
//    layer are the reference queries, each seeing the whole first copy (no positions);
//  - self-study: for each of AM_SELF_STUDY_N chat turns about the context (a detailed summary;
//    five questions with their answers) the model runs [context, instruction] and answers
//    greedily for up to AM_SELF_STUDY_TOKENS tokens (until it ends its turn); after rolling back
//    to the context, one extension pass over [instruction, answer] gives every layer's
//    post-RoPE queries; those of all turns, instructions included, are the reference queries,
//    each seeing the whole context (no positions). SmolLM2-135M's questions repeat themselves
//    (greedy, a small model); its summaries follow the text, hence both turns.

/* The instruction between the two copies: the Instruct chat turn asking for the repeat. */
#define AM_REPEAT_INSTR                                                                            \
    "<|im_end|>\n<|im_start|>user\nRepeat the text above exactly.<|im_end|>\n"                    \
    "<|im_start|>assistant\n"
/* Self-study: the chat turns about the context, and how much the model may answer to each. */
#define AM_SELF_STUDY_N 2
static const char *const am_self_study_instr[AM_SELF_STUDY_N] = {
    "<|im_end|>\n<|im_start|>user\nSummarize the text above in detail.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_end|>\n<|im_start|>user\nWrite five questions about the text above, each followed by "
    "its answer.<|im_end|>\n<|im_start|>assistant\n"};
/* per turn, by default (--am-self-tokens), and its bound: the runtime's, which reads the item */
#define AM_SELF_STUDY_TOKENS KVRT_AM_SELF_STUDY_TOKENS_DEFAULT
#define AM_SELF_STUDY_TOKENS_MAX KVRT_AM_SELF_STUDY_TOKENS_MAX
#define AM_TURN_END "<|im_end|>"

typedef struct {
    kvcc_loaded_model lm;
    int self_study;          /* 0: repeat-prefill, 1: self-study */
    int gen_tokens;          /* self-study: answer tokens per turn of the queries in qref */
    int row_tokens;          /* eval: the answer tokens per turn of every row sharing it */
    int32_t *instr;          /* [m] the instruction's token ids (repeat) */
    int m;
    int32_t *sinstr[AM_SELF_STUDY_N]; /* self-study: the turns' token ids, [sm[i]] each */
    int sm[AM_SELF_STUDY_N];
    int32_t eos;             /* self-study: the token that ends the model's turn */
    float *logits;           /* self-study: [V] */
    int64_t n_ref;           /* reference queries per layer: C (repeat) or the answer's length */
    kvcc_state *st;
    int st_cap;
    int32_t *ids;            /* [m + C] */
    float **xq;              /* [L] -> [m + C, H, d] the extension's queries */
    int64_t xcap;
    const float **qref;      /* [L] -> xq[l] + m H d: the second copy's [C, H, d] */
    int64_t C;               /* the context the queries are of (0: none yet) */
    uint64_t key;            /* kvpol_hash of its tokens */
    double gen_s;            /* seconds the last generation took (prefill + extension) */
    int refs;
} am_repeat;

static void am_repeat_free(am_repeat *R) {
    if (R == NULL) return;
    const int L = R->lm.model ? R->lm.model->hp.n_layer : 0;
    for (int l = 0; R->xq && l < L; l++) free(R->xq[l]);
    free(R->xq);
    free(R->qref);
    free(R->ids);
    free(R->instr);
    for (int i = 0; i < AM_SELF_STUDY_N; i++) free(R->sinstr[i]);
    free(R->logits);
    kvcc_state_free(R->st);
    kvcc_loaded_model_free(&R->lm);
    free(R);
}

/* Load the model of gguf and tokenize the instruction; checked against the corpus's shape
 * (L, H, Hkv, d). NULL with the message in err. */
static am_repeat *am_repeat_open(const char *gguf, int precision, uint32_t L, uint32_t H,
                                 uint32_t Hkv, uint32_t d, int self_study, char *err,
                                 size_t errlen) {
    am_repeat *R = calloc(1, sizeof *R);
    char msg[512];
    if (R == NULL) {
        snprintf(err, errlen, "am: out of memory");
        return NULL;
    }
    if (kvcc_load_model_prec(gguf, 0, precision, &R->lm, msg, sizeof msg) != 0) {
        snprintf(err, errlen, "--gguf: %s", msg);
        free(R);
        return NULL;
    }
    const kvcc_model_hparams *hp = &R->lm.model->hp;
    if ((uint32_t)hp->n_layer != L || (uint32_t)hp->n_head != H ||
        (uint32_t)hp->n_head_kv != Hkv || (uint32_t)hp->head_dim != d) {
        snprintf(err, errlen, "--gguf %s: %d layers, %d heads, %d KV heads, head dim %d; the corpus "
                 "has %u, %u, %u, %u (repeat-prefill queries need the corpus's model)", gguf,
                 hp->n_layer, hp->n_head, hp->n_head_kv, hp->head_dim, L, H, Hkv, d);
        am_repeat_free(R);
        return NULL;
    }
    size_t ni = 0, ne = 0;
    int32_t *eos = NULL;
    R->self_study = self_study;
    R->xq = calloc(L, sizeof *R->xq);
    R->qref = calloc(L, sizeof *R->qref);
    int bad = !R->xq || !R->qref ||
              kvcc_tok_encode(R->lm.tok, AM_REPEAT_INSTR, strlen(AM_REPEAT_INSTR),
                              KVCC_TOK_PARSE_SPECIAL, &R->instr, &ni) != 0 || ni < 1;
    for (int i = 0; self_study && !bad && i < AM_SELF_STUDY_N; i++) {
        size_t k = 0;
        bad = kvcc_tok_encode(R->lm.tok, am_self_study_instr[i], strlen(am_self_study_instr[i]),
                              KVCC_TOK_PARSE_SPECIAL, &R->sinstr[i], &k) != 0 || k < 1;
        R->sm[i] = (int)k;
    }
    if (bad || (self_study && (kvcc_tok_encode(R->lm.tok, AM_TURN_END, strlen(AM_TURN_END),
                                               KVCC_TOK_PARSE_SPECIAL, &eos, &ne) != 0 || ne != 1))) {
        snprintf(err, errlen, "am: tokenizing the %s instruction with %s failed",
                 self_study ? "self-study" : "repeat", gguf);
        free(eos);
        am_repeat_free(R);
        return NULL;
    }
    R->m = (int)ni;
    if (self_study) {
        R->eos = eos[0];
        free(eos);
        R->logits = malloc(sizeof(float) * (size_t)R->lm.model->hp.n_vocab);
        if (!R->logits) {
            snprintf(err, errlen, "am: out of memory");
            am_repeat_free(R);
            return NULL;
        }
    }
    return R;
}

/* The repeat-prefill queries of the context tok [C] into R->qref (kept while the same tokens
 * come again); self-study: answers of up to gen_tokens tokens per turn (1 ..
 * AM_SELF_STUDY_TOKENS_MAX; repeat ignores it). 0, or a KVCC_EXIT_* status with the message in
 * err. */
static int am_repeat_run(am_repeat *R, const int32_t *tok, int64_t C, int gen_tokens, char *err,
                         size_t errlen) {
    const uint64_t key = kvpol_hash(tok, sizeof(int32_t) * (size_t)C);
    if (!R->self_study) gen_tokens = 0;
    if (R->C == C && R->key == key && R->gen_tokens == gen_tokens) return 0;
    const double t0 = kvcc_now_s();
    const kvcc_model *m = R->lm.model;
    const int L = m->hp.n_layer;
    const size_t Hd = (size_t)m->hp.n_head * m->hp.head_dim;
    int64_t n = R->m + C; /* rows of the extension buffers */
    if (R->self_study) {
        n = 0;
        for (int i = 0; i < AM_SELF_STUDY_N; i++) n += R->sm[i] + gen_tokens;
    }
    R->C = 0;
    if (C < 1 || C + n > (1 << 24)) {
        snprintf(err, errlen, "am: context of %lld tokens, expected 1..%d for repeat queries",
                 (long long)C, (1 << 23) - R->m);
        return KVCC_EXIT_USAGE;
    }
    if (C + n > R->st_cap) {
        kvcc_state_free(R->st);
        R->st = NULL;
        R->st_cap = 0;
        if (kvcc_state_create(m, (int)(C + n), &R->st) != 0) {
            snprintf(err, errlen, "am: out of memory for a model state of %lld tokens",
                     (long long)(C + n));
            return KVCC_EXIT_FAILED;
        }
        R->st_cap = (int)(C + n);
    }
    if (n > R->xcap) {
        free(R->ids);
        R->ids = malloc(sizeof(int32_t) * (size_t)n);
        int oom = R->ids == NULL;
        for (int l = 0; l < L; l++) {
            free(R->xq[l]);
            R->xq[l] = malloc(sizeof(float) * (size_t)n * Hd);
            oom |= R->xq[l] == NULL;
        }
        R->xcap = oom ? 0 : n;
        if (oom) {
            snprintf(err, errlen, "am: out of memory for %lld tokens of repeat queries",
                     (long long)n);
            return KVCC_EXIT_FAILED;
        }
    }
    kvcc_state_reset(R->st);
    int bad = kvcc_model_prefill(m, R->st, tok, (int)C, NULL, KVCC_LOGITS_NONE) != 0;
    if (!R->self_study) {
        memcpy(R->ids, R->instr, sizeof(int32_t) * (size_t)R->m);
        memcpy(R->ids + R->m, tok, sizeof(int32_t) * (size_t)C);
        bad = bad || kvcc_model_extend(m, R->st, R->ids, (int)n, R->xq, NULL) != 0;
        for (int l = 0; l < L; l++) R->qref[l] = R->xq[l] + (size_t)R->m * Hd;
        R->n_ref = C;
    } else {
        const int V = m->hp.n_vocab;
        const int show = kvcc_env_on("KVCC_AM_SHOW_SELF_STUDY"); /* a diagnostic: the answers */
        int64_t off = 0; /* rows of xq filled */
        float **qp = calloc((size_t)L, sizeof *qp);
        bad = bad || qp == NULL;
        for (int i = 0; i < AM_SELF_STUDY_N && !bad; i++) {
            /* the answer, greedy, until the end of the turn (not kept) or gen_tokens */
            int32_t *ids = R->ids + off;
            const int mi = R->sm[i];
            int64_t g = 0;
            memcpy(ids, R->sinstr[i], sizeof(int32_t) * (size_t)mi);
            bad = kvcc_model_prefill(m, R->st, ids, mi, R->logits, KVCC_LOGITS_LAST) != 0;
            while (!bad && g < gen_tokens) {
                const int32_t t = kvcc_argmax(R->logits, V);
                if (t == R->eos) break;
                ids[mi + g++] = t;
                if (g < gen_tokens) bad = kvcc_model_decode(m, R->st, t, R->logits) != 0;
            }
            bad = bad || kvcc_state_truncate(R->st, (int)C) != 0;
            char *txt = NULL;
            size_t tl = 0;
            if (!bad && show &&
                kvcc_tok_decode(R->lm.tok, ids + mi, (size_t)g, &txt, &tl) == 0)
                fprintf(stderr, "am: self-study turn %d: %lld tokens answering about a %lld-token "
                        "context:\n%.*s\n", i + 1, (long long)g, (long long)C, (int)tl, txt);
            free(txt);
            for (int l = 0; l < L; l++) qp[l] = R->xq[l] + (size_t)off * Hd;
            bad = bad || kvcc_model_extend(m, R->st, ids, (int)(mi + g), qp, NULL) != 0;
            off += mi + g;
        }
        free(qp);
        for (int l = 0; l < L; l++) R->qref[l] = R->xq[l];
        R->n_ref = off;
    }
    if (bad) {
        snprintf(err, errlen, "am: the model failed on the %s of a %lld-token context",
                 R->self_study ? "self-study generation" : "repeat-prefill", (long long)C);
        return KVCC_EXIT_FAILED;
    }
    R->C = C;
    R->key = key;
    R->gen_tokens = gen_tokens;
    R->gen_s = kvcc_now_s() - t0;
    return 0;
}

/* One model per run of kvcc eval and query source (repeat, self-study), shared by every AM row
 * that runs those queries (they then also share each context's queries). */
static am_repeat *am_repeat_shared[2];

// ----------------------------------------------------------------------------
// loss curves and the greedy exchange

/* Loss of curve y [nr] over grid r [nr] (ascending) at ratio x (> 0). */
static double curve_at(const double *r, const float *y, int nr, double x) {
    if (x >= 1.0) return 0.0;
    const double lx = log(x);
    if (x <= r[0]) {
        if (nr == 1) return y[0];
        const double s = ((double)y[1] - y[0]) / (log(r[1]) - log(r[0]));
        const double v = y[0] + s * (lx - log(r[0]));
        return v > y[0] ? v : y[0];
    }
    for (int i = 0; i + 1 < nr; i++)
        if (x <= r[i + 1]) {
            const double f = (lx - log(r[i])) / (log(r[i + 1]) - log(r[i]));
            return y[i] + f * ((double)y[i + 1] - y[i]);
        }
    /* between the last grid point and ratio 1 (loss 0) */
    const double f = (lx - log(r[nr - 1])) / (0.0 - log(r[nr - 1]));
    return y[nr - 1] * (1.0 - f);
}

/* Greedy exchange for one target: units [nh] out. curves [nh, nr]. */
static void greedy_exchange(const double *r, const float *curves, int nr, int nh, double target,
                            int *units) {
    int64_t total = llround(target * AM_UNITS * nh);
    if (total < nh) total = nh;
    if (total > (int64_t)AM_UNITS * nh) total = (int64_t)AM_UNITS * nh;
    for (int h = 0; h < nh; h++) units[h] = (int)(total / nh) + (h < total % nh ? 1 : 0);
#define LOSS(h, u) curve_at(r, curves + (size_t)(h) * nr, nr, (double)(u) / AM_UNITS)
    for (int64_t step = 0; step < 64 * total; step++) {
        int donor = -1, recv = -1;
        double rise = INFINITY, fall = 0;
        for (int h = 0; h < nh; h++) {
            const double cur = LOSS(h, units[h]);
            if (units[h] > 1) {
                const double d = LOSS(h, units[h] - 1) - cur;
                if (d < rise) { rise = d; donor = h; }
            }
            if (units[h] < AM_UNITS) {
                const double d = cur - LOSS(h, units[h] + 1);
                if (d > fall) { fall = d; recv = h; }
            }
        }
        if (donor < 0 || recv < 0 || donor == recv || !(fall - rise > 1e-12)) break;
        units[donor]--;
        units[recv]++;
    }
#undef LOSS
}

// ----------------------------------------------------------------------------
// run

/* --am-queries: "context" (default), "repeat" or "self-study" */
static const char *am_source(const kvcc_compile_ctx *cx) {
    if (cx->am_queries && !strcmp(cx->am_queries, "repeat")) return "repeat";
    if (cx->am_queries && !strcmp(cx->am_queries, "self-study")) return "self-study";
    return "context";
}

/* Repeat-prefill and self-study reference queries run the built-in model. */
static int am_uses_model(const kvcc_compile_ctx *cx) {
    return cx->gguf && strcmp(am_source(cx), "context") != 0;
}

/* --am-self-tokens: self-study's answer tokens per turn (auto: AM_SELF_STUDY_TOKENS) */
static int am_self_tokens(const kvcc_compile_ctx *cx) {
    return cx->am_self_tokens ? (int)cx->am_self_tokens : AM_SELF_STUDY_TOKENS;
}

/* The curves (f32 in the artifact) from the sums loss / merr [L, Hkv, nr], the schedule of every
 * target (greedy exchange), and the two sections. 0 or a KVCC_EXIT_* status. */
static void am_compile_opts(const kvcc_compile_ctx *cx, kvrt_am_opts *ao);
static int am_schedule_write(const kvcc_compile_ctx *cx, kvpol_writer *w, const double *loss,
                             const double *merr, uint32_t L, uint32_t Hkv, uint32_t n_prompts,
                             char *err, size_t errlen) {
    const int nr = cx->n_am_ratios, nt = cx->n_am_targets;
    const size_t nh = (size_t)L * Hkv;
    int rc = 0;
    kvrt_am_opts ao;
    am_compile_opts(cx, &ao);
    float *curves = NULL, *mcurves = NULL, *sched = NULL;
    int *units = NULL;
    {
        curves = malloc(nh * (size_t)nr * sizeof *curves);
        mcurves = malloc(nh * (size_t)nr * sizeof *mcurves);
        sched = malloc((size_t)nt * nh * sizeof *sched);
        units = malloc(nh * sizeof *units);
        if (!curves || !mcurves || !sched || !units) {
            snprintf(err, errlen, "am: out of memory");
            rc = KVCC_EXIT_FAILED;
        }
    }
    if (!rc) {
        for (size_t i = 0; i < nh * (size_t)nr; i++) {
            curves[i] = (float)loss[i];
            mcurves[i] = (float)merr[i];
            if (!isfinite(curves[i]) || !isfinite(mcurves[i])) {
                snprintf(err, errlen, "am: a sensitivity curve is not finite (head %zu)", i / (size_t)nr);
                rc = KVCC_EXIT_FAILED;
                break;
            }
        }
    }
    for (int ti = 0; ti < nt && !rc; ti++) {
        greedy_exchange(cx->am_ratios, curves, nr, (int)nh, cx->am_targets[ti], units);
        for (size_t h = 0; h < nh; h++) sched[(size_t)ti * nh + h] = (float)units[h] / AM_UNITS;
    }
    if (!rc) {
        const uint64_t dt[1] = {(uint64_t)nt}, ds[3] = {(uint64_t)nt, L, Hkv}, dr[1] = {(uint64_t)nr},
                       dc[3] = {L, Hkv, (uint64_t)nr};
        int k2 = kvpol_writer_begin_section(w, KVPOL_SEC_AM_SCHEDULE, kvpol_known_find(KVPOL_SEC_AM_SCHEDULE)->name, KVPOL_SECTION_CRITICAL,
                                            KVPOL_CODEC_ZSTD, 1);
        if (!k2) k2 = kvpol_writer_add_tensor(w, "targets", KVPOL_DTYPE_F64, 1, dt, cx->am_targets);
        if (!k2) k2 = kvpol_writer_add_tensor(w, "schedule", KVPOL_DTYPE_F32, 3, ds, sched);
        if (!k2) k2 = kvpol_writer_add_string(w, "key_select", cx->am_select, strlen(cx->am_select));
        if (!k2) k2 = kvpol_writer_add_i64(w, "chunk", cx->am_chunk);
        if (!k2) k2 = kvpol_writer_add_i64(w, "units", AM_UNITS);
        /* no beta_floor item: zero-weight keys dropped (what ran before the item existed) */
        if (!k2 && !isnan(cx->am_floor)) k2 = kvpol_writer_add_f64(w, "beta_floor", cx->am_floor);
        if (!k2) k2 = kvpol_writer_add_i64(w, "n_sink", cx->am_sinks);
        if (!k2) k2 = kvpol_writer_add_f64(w, "recent_frac", cx->am_recent);
        if (!k2) k2 = kvpol_writer_add_string(w, "query_source", am_source(cx), strlen(am_source(cx)));
        /* self-study only: its answers' bound per turn */
        if (!k2 && !strcmp(am_source(cx), "self-study"))
            k2 = kvpol_writer_add_i64(w, "self_study_tokens", am_self_tokens(cx));
        if (!k2) k2 = kvpol_writer_add_i64(w, "omp_batch", ao.omp_batch);
        /* no products item for f32: the artifact stays what it was before the item existed */
        if (!k2 && ao.products == KVRT_AM_PRODUCTS_BF16)
            k2 = kvpol_writer_add_string(w, "products", "bf16", 4);
        if (!k2) k2 = kvpol_writer_end_section(w);
        if (!k2) k2 = kvpol_writer_begin_section(w, KVPOL_SEC_AM_CURVES, kvpol_known_find(KVPOL_SEC_AM_CURVES)->name, 0, KVPOL_CODEC_ZSTD, 1);
        if (!k2) k2 = kvpol_writer_add_tensor(w, "ratios", KVPOL_DTYPE_F64, 1, dr, cx->am_ratios);
        if (!k2) k2 = kvpol_writer_add_tensor(w, "loss", KVPOL_DTYPE_F32, 3, dc, curves);
        if (!k2) k2 = kvpol_writer_add_tensor(w, "mass_err", KVPOL_DTYPE_F32, 3, dc, mcurves);
        if (!k2) k2 = kvpol_writer_add_i64(w, "prompts", n_prompts);
        if (!k2) k2 = kvpol_writer_end_section(w);
        if (k2) {
            snprintf(err, errlen, "am: writing the sections: %s", kvpol_status_str(k2));
            rc = KVCC_EXIT_FAILED;
        }
    }
    free(curves); free(mcurves); free(sched); free(units);
    return rc;
}

/* Add one compacted ratio ri of the loop's current (prompt, layer) to the loss and mass-error
 * curves [L, Hkv, nr]: per KV head, the mean over its G query heads and the N continuation
 * queries, divided by the prompt count (summed in (query head, query) order). */
static void am_accumulate(const kvcc_loop *lp, int ri, int nr, double n_prompts, double *loss,
                          double *merr) {
    const uint32_t H = lp->H, Hkv = lp->Hkv, d = lp->d, G = H / Hkv;
    const int64_t N = lp->N;
    for (uint32_t hk = 0; hk < Hkv; hk++) {
        double e = 0, me = 0;
        for (uint32_t g = 0; g < G; g++) {
            const uint32_t h = hk * G + g;
            for (int64_t i = 0; i < N; i++) {
                const size_t at = (size_t)i * H + h;
                e += kvcc_relerr(lp->o_c + at * d, lp->o_full + at * d, d);
                me += fabs(exp(-kvcc_kl_lse(lp->lse_ctx[at], lp->lse_c_ctx[at])) - 1.0);
            }
        }
        const size_t at = ((size_t)lp->layer * Hkv + hk) * nr + ri;
        loss[at] += e / ((double)G * N * n_prompts);
        merr[at] += me / ((double)G * N * n_prompts);
    }
}

/* The runtime options the calibration runs (and the artifact records). */
static void am_compile_opts(const kvcc_compile_ctx *cx, kvrt_am_opts *ao) {
    kvrt_am_opts_init(ao);
    ao->chunk = cx->am_chunk;
    ao->key_select = strcmp(cx->am_select, "omp") == 0 ? KVRT_AM_SELECT_OMP
                                                        : KVRT_AM_SELECT_HIGHEST;
    ao->beta_floor = cx->am_floor;
    ao->n_sink = cx->am_sinks;
    ao->recent_frac = cx->am_recent;
    ao->products = cx->am_products && !strcmp(cx->am_products, "bf16") ? KVRT_AM_PRODUCTS_BF16
                                                                       : KVRT_AM_PRODUCTS_F32;
}

static int am_check(const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    if (!isnan(cx->am_floor) && !(cx->am_floor >= -80 && cx->am_floor <= 80)) {
        snprintf(err, errlen, "--am-floor: got %g, expected none or a bias in -80..80",
                 cx->am_floor);
        return KVCC_EXIT_USAGE;
    }
    if (strcmp(am_source(cx), "context") && !cx->gguf) {
        snprintf(err, errlen, "--am-queries %s needs --gguf M: the built-in model runs the "
                 "%s that gives the reference queries (or use --am-queries context)",
                 am_source(cx), strcmp(am_source(cx), "repeat") ? "self-study generation"
                                                               : "repeat-prefill");
        return KVCC_EXIT_USAGE;
    }
    if (cx->am_self_tokens && strcmp(am_source(cx), "self-study")) {
        snprintf(err, errlen, "--am-self-tokens %u: only with --am-queries self-study (the "
                 "reference queries are %s)", cx->am_self_tokens, am_source(cx));
        return KVCC_EXIT_USAGE;
    }
    if (!(cx->am_recent >= 0 && cx->am_recent < 1)) {
        snprintf(err, errlen, "--am-recent: got %g, expected a fraction of the budget in [0, 1)",
                 cx->am_recent);
        return KVCC_EXIT_USAGE;
    }
    return 0;
}

static int am_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    kvcc_corpus *c = cx->corpus;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const uint32_t L = m->n_layers, H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    const int nr = cx->n_am_ratios, nt = cx->n_am_targets;
    uint32_t n_prompts = kvcc_corpus_get_info(c)->n_prompts;
    if (cx->max_prompts && cx->max_prompts < n_prompts) n_prompts = cx->max_prompts;
    if (n_prompts == 0) {
        snprintf(err, errlen, "%s: the corpus holds no prompts", cx->corpus_path);
        return KVCC_EXIT_USAGE;
    }
    for (int i = 0; i < nr; i++)
        if (!(cx->am_ratios[i] > 0 && cx->am_ratios[i] < 1)) {
            snprintf(err, errlen, "--am-ratios: %g is not a ratio in (0, 1)", cx->am_ratios[i]);
            return KVCC_EXIT_USAGE;
        }
    for (int i = 0; i < nt; i++)
        if (!(cx->am_targets[i] > 0 && cx->am_targets[i] < 1)) {
            snprintf(err, errlen, "--am-targets: %g is not a ratio in (0, 1)", cx->am_targets[i]);
            return KVCC_EXIT_USAGE;
        }
    kvrt_am_opts ao;
    am_compile_opts(cx, &ao);
    const size_t nh = (size_t)L * Hkv, nc = nh * (size_t)nr;
    /* the curves, summed over prompts in prompt order: [loss | merr], one increment per prompt
     * and cell (the prompts sharded across MPI ranks; compiler/dist.h) */
    kvcc_dist_sum sum;
    char dmsg[256];
    int rc = kvcc_dist_sum_init(&sum, 2 * nc, 2 * nc, NULL, n_prompts, dmsg, sizeof dmsg);
    if (rc) {
        snprintf(err, errlen, "am: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    kvrt_cache **ccs = calloc((size_t)nr, sizeof *ccs);
    /* repeat-prefill queries: the built-in model, the context's tokens */
    const int repeat = strcmp(am_source(cx), "context") != 0; /* queries from the model */
    am_repeat *R = NULL;
    int32_t *tok = NULL;
    if (!rc && repeat &&
        !(R = am_repeat_open(cx->gguf, cx->precision, L, H, Hkv, d,
                             !strcmp(am_source(cx), "self-study"), err, errlen)))
        rc = KVCC_EXIT_USAGE;
    kvcc_loop lp;
    if (!rc) rc = kvcc_loop_open(&lp, c, "am", KVCC_LOOP_REF | KVCC_LOOP_REF_CTX, err, errlen);
    else memset(&lp, 0, sizeof lp);
    if (!rc && !ccs) {
        snprintf(err, errlen, "am: out of memory");
        rc = KVCC_EXIT_FAILED;
    }
    for (uint32_t p = sum.lo; p < sum.hi && !rc; p++) {
        if ((rc = kvcc_loop_prompt(&lp, p, err, errlen)) != 0) break;
        double *loss = kvcc_dist_sum_row(&sum, p), *merr = loss + nc;
        const int64_t C = lp.C, N = lp.N;
        if (N < 1 || C < 1) {
            snprintf(err, errlen,
                     "%s: prompt %u has %lld context and %lld continuation tokens; the am pass "
                     "needs both (continuation queries measure the loss)",
                     cx->corpus_path, p, (long long)C, (long long)N);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        if (repeat) {
            kvcc_corpus_prompt_info info;
            free(tok);
            tok = malloc(sizeof(int32_t) * (size_t)lp.T);
            if (!tok || kvcc_corpus_prompt(c, p, &info, tok, NULL) != 0) {
                snprintf(err, errlen, "%s: prompt %u: reading its tokens: %s", cx->corpus_path, p,
                         tok ? kvcc_corpus_error(c) : "out of memory");
                rc = KVCC_EXIT_FAILED;
                break;
            }
            if ((rc = am_repeat_run(R, tok, C, am_self_tokens(cx), err, errlen)) != 0) break;
        }
        for (uint32_t l = 0; l < L && !rc; l++) {
            /* the reference: the full context, with (o_full, lse_full) and without (lse_ctx) the
             * continuation; then every ratio of the grid at once (shared logits and targets) */
            if ((rc = kvcc_loop_layer(&lp, l, err, errlen)) != 0) break;
            if (repeat && l == 0) {
                /* the model must be the one the corpus came from: its own layer-0 keys of the
                 * context against the stored ones (f16 storage: ~1e-3 relative) */
                const size_t nk = (size_t)C * Hkv * d;
                double num = 0, den = 0;
                for (size_t i = 0; i < nk; i++) {
                    const double e = (double)R->st->k_cache[i] - lp.k[i];
                    num += e * e;
                    den += (double)lp.k[i] * lp.k[i];
                }
                if (!(num <= 1e-4 * den)) {
                    snprintf(err, errlen, "--gguf %s is not the model %s was captured with: on "
                             "prompt %u its layer-0 keys differ from the stored ones by %.3g "
                             "(relative)", cx->gguf, cx->corpus_path, p,
                             sqrt(num / (den + 1e-30)));
                    rc = KVCC_EXIT_USAGE;
                    break;
                }
            }
            int s = repeat ? kvrt_am_compact_layer_multi_ref(lp.rt, &ao, R->qref[l], NULL, R->n_ref, lp.k,
                                                             lp.v, C, H, Hkv, d, nr, NULL,
                                                             cx->am_ratios, KVRT_DTYPE_F32, ccs,
                                                             NULL)
                           : kvrt_am_compact_layer_multi(lp.rt, &ao, lp.q, lp.k, lp.v, C, H, Hkv,
                                                         d, nr, NULL, cx->am_ratios,
                                                         KVRT_DTYPE_F32, ccs, NULL);
            for (int ri = 0; ri < nr && !s; ri++) {
                s = kvcc_loop_attend(&lp, ccs[ri], lp.o_c, lp.lse_c, lp.lse_c_ctx);
                kvrt_cache_free(ccs[ri]);
                ccs[ri] = NULL;
                if (s) break;
                am_accumulate(&lp, ri, nr, (double)n_prompts, loss, merr);
            }
            for (int ri = 0; ri < nr; ri++) { kvrt_cache_free(ccs[ri]); ccs[ri] = NULL; }
            if (s) {
                snprintf(err, errlen, "am: prompt %u, layer %u: %s (%s)", p, l, kvrt_status_str(s),
                         kvrt_last_error()->msg);
                rc = KVCC_EXIT_FAILED;
            }
        }
        if (cx->progress) kvcc_progress(p + 1 - sum.lo, sum.hi - sum.lo);
    }
    free(ccs);
    free(tok);
    am_repeat_free(R);
    if (lp.rt) kvcc_loop_close(&lp);
    rc = kvcc_dist_check(rc, err, errlen);
    if (!rc && kvcc_dist_sum_finish(&sum, dmsg, sizeof dmsg) != 0) {
        snprintf(err, errlen, "am: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    if (!rc) rc = am_schedule_write(cx, w, sum.acc, sum.acc + nc, L, Hkv, n_prompts, err, errlen);
    kvcc_dist_sum_free(&sum);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

static void am_opts_text(const kvrt_am_opts *o, char *buf, size_t n);

static void am_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si, ci;
    kvpol_item tg, sc, rr, lo, me;
    if (kvpol_section_find(f, KVPOL_SEC_AM_SCHEDULE, &si) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "targets", KVPOL_DTYPE_F64, &tg) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "schedule", KVPOL_DTYPE_F32, &sc) != KVPOL_OK || sc.ndim != 3 ||
        tg.count != sc.dims[0]) { /* a target per schedule row (read below by that count) */
        fprintf(out, "Attention Matching: no readable am.schedule section\n");
        return;
    }
    const char *ks = "?";
    uint64_t kl = 1;
    int64_t chunk = 0;
    kvpol_get_string(f, si, "key_select", &ks, &kl);
    kvpol_get_i64(f, si, "chunk", &chunk);
    /* the optional options, absent in older artifacts: what ran before them */
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    o.key_select = kl == 3 && !memcmp(ks, "omp", 3) ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
    o.chunk = chunk;
    o.beta_floor = NAN;
    int64_t iv;
    double dv;
    if (kvpol_get_f64(f, si, "beta_floor", &dv) == KVPOL_OK) o.beta_floor = dv;
    if (kvpol_get_i64(f, si, "n_sink", &iv) == KVPOL_OK) o.n_sink = iv;
    if (kvpol_get_f64(f, si, "recent_frac", &dv) == KVPOL_OK) o.recent_frac = dv;
    if (kvpol_get_i64(f, si, "omp_batch", &iv) == KVPOL_OK) o.omp_batch = (int)iv;
    else o.omp_batch = 1;
    const char *pr = NULL;
    uint64_t pl = 0;
    if (kvpol_get_string(f, si, "products", &pr, &pl) == KVPOL_OK && pl == 4 && !memcmp(pr, "bf16", 4))
        o.products = KVRT_AM_PRODUCTS_BF16;
    char txt[200];
    am_opts_text(&o, txt, sizeof txt);
    const uint64_t nt = sc.dims[0], L = sc.dims[1], Hkv = sc.dims[2];
    const double *t = tg.data;
    const float *s = sc.data;
    const char *qs = "context";
    uint64_t ql = 7;
    if (kvpol_get_string(f, si, "query_source", &qs, &ql) != KVPOL_OK) qs = "context", ql = 7;
    char stxt[64] = "";
    if (ql == 10 && !memcmp(qs, "self-study", 10)) {
        if (kvpol_get_i64(f, si, "self_study_tokens", &iv) != KVPOL_OK) iv = AM_SELF_STUDY_TOKENS;
        snprintf(stxt, sizeof stxt, " (answers of up to %lld tokens per turn)", (long long)iv);
    }
    fprintf(out, "Attention Matching: %llu targets, %llu layers x %llu KV heads\n  options: %s, "
            "reference queries %.*s%s\n", (unsigned long long)nt, (unsigned long long)L,
            (unsigned long long)Hkv, txt, (int)(ql < 32 ? ql : 32), qs, stxt);
    fprintf(out, "  budgets (fraction of the context kept per KV head), per layer:\n  %-6s", "layer");
    for (uint64_t ti = 0; ti < nt; ti++) fprintf(out, " | target %-*.3g", (int)(Hkv * 7 - 8), t[ti]);
    fprintf(out, "\n");
    for (uint64_t l = 0; l < L; l++) {
        fprintf(out, "  %-6llu", (unsigned long long)l);
        for (uint64_t ti = 0; ti < nt; ti++) {
            fprintf(out, " |");
            for (uint64_t h = 0; h < Hkv; h++) fprintf(out, " %6.4f", s[(ti * L + l) * Hkv + h]);
        }
        fprintf(out, "\n");
    }
    if (kvpol_section_find(f, KVPOL_SEC_AM_CURVES, &ci) != KVPOL_OK ||
        kvpol_get_tensor(f, ci, "ratios", KVPOL_DTYPE_F64, &rr) != KVPOL_OK ||
        kvpol_get_tensor(f, ci, "loss", KVPOL_DTYPE_F32, &lo) != KVPOL_OK ||
        kvpol_get_tensor(f, ci, "mass_err", KVPOL_DTYPE_F32, &me) != KVPOL_OK || lo.ndim != 3 ||
        lo.dims[0] != L || lo.dims[1] != Hkv || lo.dims[2] != rr.count || me.count != lo.count)
        return;
    const uint64_t nr = rr.dims[0], nh = L * Hkv;
    const double *r = rr.data;
    const float *y = lo.data, *mz = me.data;
    /* sensitivity = mean loss over the grid; rank heads */
    double *sens = malloc(nh * sizeof *sens);
    uint32_t *ord = malloc(nh * sizeof *ord);
    if (!sens || !ord) { free(sens); free(ord); return; }
    for (uint64_t h = 0; h < nh; h++) {
        double a = 0;
        for (uint64_t i = 0; i < nr; i++) a += y[h * nr + i];
        sens[h] = a / (double)nr;
        ord[h] = (uint32_t)h;
    }
    for (uint64_t i = 1; i < nh; i++) /* insertion sort, descending, stable */
        for (uint64_t j = i; j > 0 && sens[ord[j]] > sens[ord[j - 1]]; j--) {
            uint32_t tmp = ord[j]; ord[j] = ord[j - 1]; ord[j - 1] = tmp;
        }
    fprintf(out, "  sensitivity (output rel. error after compaction at ratio");
    for (uint64_t i = 0; i < nr; i++) fprintf(out, " %.4g", r[i]);
    fprintf(out, "; mass error at the smallest ratio):\n");
    const uint64_t show = nh < 5 ? nh : 5;
    for (int part = 0; part < 2; part++) {
        fprintf(out, "  %s sensitive:\n", part ? "least" : "most");
        for (uint64_t i = 0; i < show; i++) {
            const uint32_t h = part ? ord[nh - 1 - i] : ord[i];
            fprintf(out, "    layer %2u kv head %u:", h / (uint32_t)Hkv, h % (uint32_t)Hkv);
            for (uint64_t j = 0; j < nr; j++) fprintf(out, " %.4f", y[(uint64_t)h * nr + j]);
            fprintf(out, "  (mass %.4f)\n", mz[(uint64_t)h * nr]);
        }
    }
    free(sens);
    free(ord);
}

// ----------------------------------------------------------------------------
// eval methods: am (the compiled schedule with the compiled options and query source),
// am-uniform, am-omp, am-repeat, am-omp-repeat (explicit uncompiled variants: every head at the
// row's ratio, kvrt_am_opts_init's options; the -repeat ones with repeat-prefill queries)

enum { AM_EVAL_SCHEDULED, AM_EVAL_UNIFORM, AM_EVAL_OMP, AM_EVAL_REPEAT, AM_EVAL_OMP_REPEAT,
       AM_EVAL_SELF };

/* A method's state: its options (the compiled ones for am), the schedule (am), and the model
 * that makes repeat-prefill queries (rows that run them; shared by every such row). */
typedef struct {
    kvrt_am_opts o;
    const kvrt_am_schedule *s; /* am only */
    int repeat;                /* reference queries from the model (else the context's own) */
    int self_study;            /* ... self-study (else repeat-prefill) */
    int gen_tokens;            /* self-study: answer tokens per turn */
    am_repeat *R;
} am_eval_state;

static int am_eval_open(const kvcc_eval_env *env, void **h, char *err, size_t errlen) {
    if (!env->policy) {
        snprintf(err, errlen,
                 "method am needs --policy X.kvpol compiled with kvcc compile --policies am "
                 "(or use am-uniform / am-omp / am-repeat / am-omp-repeat)");
        return KVCC_EXIT_USAGE;
    }
    kvrt_am_schedule *s = NULL;
    int rc = kvrt_am_open(env->policy, &s);
    if (rc) return kvcc_eval_policy_error(env, rc, err, errlen);
    *h = s;
    return 0;
}

static void am_eval_close(void *h) { kvrt_am_schedule_free(h); }

static const char *am_select_name(int ks) { return ks == KVRT_AM_SELECT_OMP ? "omp" : "highest"; }

/* "key selection highest, chunk 4096, beta floor -3, 4 sinks, recent 0.125 of t" */
static void am_opts_text(const kvrt_am_opts *o, char *buf, size_t n) {
    char fl[32];
    if (isnan(o->beta_floor)) snprintf(fl, sizeof fl, "none (zero weights dropped)");
    else snprintf(fl, sizeof fl, "%g", o->beta_floor);
    char sel[48];
    if (o->key_select == KVRT_AM_SELECT_OMP && o->omp_batch > 1)
        snprintf(sel, sizeof sel, "omp (%d keys per round)", o->omp_batch);
    else snprintf(sel, sizeof sel, "%s", am_select_name(o->key_select));
    snprintf(buf, n, "key selection %s, chunk %lld, beta floor %s, %lld sinks, recent %g of t, "
             "products %s", sel, (long long)o->chunk, fl, (long long)o->n_sink, o->recent_frac,
             o->products == KVRT_AM_PRODUCTS_BF16 ? "bf16" : "f32");
}

/* KVCC_AM_OPTS (a measurement knob of the uncompiled rows am-uniform / am-omp / am-repeat /
 * am-omp-repeat / am-self): comma-separated NAME=VALUE of beta_floor (a number or "none"), n_sink,
 * recent_frac, chunk, max_queries, omp_batch, products (f32 or bf16), and self_tokens (am-self's
 * answer tokens per turn, into *self_tokens). 0, or KVCC_EXIT_USAGE with the message in err. */
static int am_env_opts(kvrt_am_opts *o, int *self_tokens, char *err, size_t errlen) {
    const char *env = getenv("KVCC_AM_OPTS");
    if (env == NULL || *env == 0) return 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", env);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        char *eq = strchr(tok, '=');
        char *end = NULL;
        double v = eq ? strtod(eq + 1, &end) : 0;
        int ok = eq && end && end != eq + 1 && *end == 0 && isfinite(v);
        char item[64]; /* the item as given, for the message */
        snprintf(item, sizeof item, "%s", tok);
        if (eq) *eq = 0;
        if (eq && !strcmp(tok, "beta_floor") && !strcmp(eq + 1, "none")) {
            o->beta_floor = NAN;
            continue;
        }
        if (eq && !strcmp(tok, "products") && (!strcmp(eq + 1, "f32") || !strcmp(eq + 1, "bf16"))) {
            o->products = strcmp(eq + 1, "bf16") ? KVRT_AM_PRODUCTS_F32 : KVRT_AM_PRODUCTS_BF16;
            continue;
        }
        if (ok && !strcmp(tok, "beta_floor")) o->beta_floor = v;
        else if (ok && !strcmp(tok, "n_sink") && v >= 0) o->n_sink = (int64_t)v;
        else if (ok && !strcmp(tok, "recent_frac")) o->recent_frac = v;
        else if (ok && !strcmp(tok, "chunk")) o->chunk = (int64_t)v;
        else if (ok && !strcmp(tok, "max_queries") && v >= 0) o->max_queries = (int64_t)v;
        else if (ok && !strcmp(tok, "omp_batch") && v >= 1 && v <= 4096) o->omp_batch = (int)v;
        else if (ok && !strcmp(tok, "self_tokens") && v >= 1 && v <= AM_SELF_STUDY_TOKENS_MAX &&
                 v == floor(v))
            *self_tokens = (int)v;
        else {
            snprintf(err, errlen, "KVCC_AM_OPTS: '%s' is not NAME=VALUE with NAME beta_floor, "
                     "n_sink, recent_frac, chunk, max_queries, omp_batch (1..4096), products "
                     "(f32 or bf16) or self_tokens (1..%d)", item, AM_SELF_STUDY_TOKENS_MAX);
            return KVCC_EXIT_USAGE;
        }
    }
    return 0;
}

static void am_eval_release(void *state) {
    am_eval_state *st = state;
    if (st == NULL) return;
    if (st->R && --st->R->refs == 0) {
        for (int i = 0; i < 2; i++)
            if (am_repeat_shared[i] == st->R) am_repeat_shared[i] = NULL;
        am_repeat_free(st->R);
    }
    free(st);
}

/* The shared model of the rows with repeat-prefill or self-study queries (opened by the first
 * of each). 0 or KVCC_EXIT_*. */
static int am_eval_repeat_model(const kvcc_eval_method *m, const kvcc_eval_env *env,
                                am_eval_state *st, char *err, size_t errlen) {
    const char *what = st->self_study ? "self-study" : "repeat-prefill";
    if (!env->gguf) {
        snprintf(err, errlen, "%s: %s reference queries need the model: give --gguf M "
                 "(the layer-local rows too: the model runs the %s of every corpus "
                 "prompt)%s", m->name, what, what,
                 m->variant == AM_EVAL_SCHEDULED ? "; --policy was calibrated with them" : "");
        return KVCC_EXIT_USAGE;
    }
    am_repeat **sh = &am_repeat_shared[st->self_study ? 1 : 0];
    /* eval runs every row's prompt_begin, then every row's layers: rows sharing the model must
     * want the same queries. At most two rows share the self-study model (am with the one
     * --policy, and am-self), so the other row is the one this row is not. */
    if (*sh && st->self_study && (*sh)->row_tokens != st->gen_tokens) {
        char why[96];
        if (m->variant == AM_EVAL_SCHEDULED)
            snprintf(why, sizeof why, "KVCC_AM_OPTS self_tokens, or its default %d",
                     AM_SELF_STUDY_TOKENS);
        else
            snprintf(why, sizeof why, "the --policy's self_study_tokens");
        snprintf(err, errlen, "%s: self-study answers of up to %d tokens per turn, but another "
                 "row of this run generates up to %d (%s): rows sharing the model share one "
                 "generation; give them one count (KVCC_AM_OPTS=self_tokens=N sets am-self's) or "
                 "run them separately", m->name, st->gen_tokens, (*sh)->row_tokens, why);
        return KVCC_EXIT_USAGE;
    }
    if (!*sh) {
        char e2[600];
        *sh = am_repeat_open(env->gguf, env->precision, env->L, env->H, env->Hkv, env->d,
                             st->self_study, e2, sizeof e2);
        if (!*sh) {
            snprintf(err, errlen, "%s: %s", m->name, e2);
            return KVCC_EXIT_USAGE;
        }
        (*sh)->row_tokens = st->gen_tokens;
    }
    st->R = *sh;
    st->R->refs++;
    return 0;
}

/* am: every ratio budget must be a compiled target; the note states the options and the
 * reference queries each row runs with. */
static int am_eval_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                           kvcc_eval_prep *p, char *err, size_t errlen) {
    char txt[200];
    am_eval_state *st = calloc(1, sizeof *st);
    if (st == NULL) {
        snprintf(err, errlen, "%s: out of memory", m->name);
        return KVCC_EXIT_FAILED;
    }
    int rc = 0;
    if (m->variant != AM_EVAL_SCHEDULED) {
        kvrt_am_opts_init(&st->o);
        if (m->variant == AM_EVAL_OMP || m->variant == AM_EVAL_OMP_REPEAT)
            st->o.key_select = KVRT_AM_SELECT_OMP;
        st->repeat = m->variant == AM_EVAL_REPEAT || m->variant == AM_EVAL_OMP_REPEAT ||
                     m->variant == AM_EVAL_SELF;
        st->self_study = m->variant == AM_EVAL_SELF;
        st->gen_tokens = AM_SELF_STUDY_TOKENS;
        rc = am_env_opts(&st->o, &st->gen_tokens, err, errlen);
    } else {
        const kvrt_am_schedule *s = handle;
        int qs = KVRT_AM_QUERIES_CONTEXT;
        st->s = s;
        int k = kvrt_am_schedule_opts(s, &st->o);
        if (!k) k = kvrt_am_schedule_query_source(s, &qs);
        int64_t gt = 0;
        if (!k) k = kvrt_am_schedule_self_study_tokens(s, &gt);
        st->gen_tokens = (int)gt;
        for (int j = 0; !k && j < env->n_budgets; j++) {
            const float *ratios;
            if (env->budgets[j] < 1) k = kvrt_am_schedule_ratios(s, env->budgets[j], 0, &ratios);
        }
        if (k) rc = kvcc_eval_policy_error(env, k, err, errlen);
        st->repeat = qs == KVRT_AM_QUERIES_REPEAT || qs == KVRT_AM_QUERIES_SELF_STUDY;
        st->self_study = qs == KVRT_AM_QUERIES_SELF_STUDY;
    }
    if (!rc && st->repeat) rc = am_eval_repeat_model(m, env, st, err, errlen);
    if (rc) {
        am_eval_release(st);
        return rc;
    }
    /* am with a context-query schedule needs no whole-context pass: its end-to-end layers go
     * through compress_layer and share one call for all budgets, as am-uniform's do */
    p->layerwise = !st->repeat;
    am_opts_text(&st->o, txt, sizeof txt);
    char stxt[160];
    snprintf(stxt, sizeof stxt, "self-study reference queries from --gguf (its greedy questions "
             "and answers about the context, up to %d tokens per turn)", st->gen_tokens);
    const char *qtxt = st->self_study ? stxt
                       : st->repeat ? "repeat-prefill reference queries from --gguf"
                                    : "the context's own reference queries";
    if (m->variant == AM_EVAL_SCHEDULED)
        snprintf(p->note, sizeof p->note,
                 "am: the compiled per-head schedule with the compiled options (%s; %s)", txt,
                 qtxt);
    else
        snprintf(p->note, sizeof p->note,
                 "%s: an uncompiled variant, every KV head at the row's ratio (%s; %s)", m->name,
                 txt, qtxt);
    p->state = st;
    return 0;
}

/* Layer-local: a repeat row's queries of the prompt (the corpus's tokens through the model). */
static int am_eval_prompt_begin(void *state, kvcc_corpus *c, uint32_t prompt, void **pstate,
                                char *err, size_t errlen) {
    am_eval_state *st = state;
    *pstate = NULL;
    if (!st->repeat) return 0;
    kvcc_corpus_prompt_info info;
    int32_t *tok = NULL;
    int rc = kvcc_corpus_prompt(c, prompt, &info, NULL, NULL);
    if (!rc) rc = (tok = malloc(sizeof(int32_t) * (size_t)(info.n_tokens + 1))) ? 0 : -1;
    if (!rc) rc = kvcc_corpus_prompt(c, prompt, &info, tok, NULL);
    if (rc) {
        snprintf(err, errlen, "am: prompt %u: reading its tokens: %s", prompt,
                 tok ? kvcc_corpus_error(c) : "out of memory");
        free(tok);
        return KVCC_EXIT_FAILED;
    }
    rc = am_repeat_run(st->R, tok, (int64_t)info.context_len, st->gen_tokens, err, errlen);
    free(tok);
    if (!rc) *pstate = st->R;
    return rc;
}

static int am_eval_layer(const kvcc_eval_method *m, am_eval_state *st, const kvcc_eval_env *env,
                         const kvcc_eval_layer *x, double budget, kvrt_cache **out) {
    if (st->repeat) {
        const am_repeat *R = st->R;
        if (R->C != x->C) { /* cannot happen: prompt_begin / compress_all ran the context */
            fprintf(stderr, "%s: no repeat queries of this %lld-token context\n", m->name,
                    (long long)x->C);
            return KVRT_ERR_ARG;
        }
        if (x->shared_s) *x->shared_s += R->gen_s / env->L; /* the model's share of the row */
        const int qs = R->self_study ? KVRT_AM_QUERIES_SELF_STUDY : KVRT_AM_QUERIES_REPEAT;
        if (m->variant == AM_EVAL_SCHEDULED)
            return kvrt_am_compact_scheduled_ref(env->rt, st->s, NULL, 0, budget, x->layer, qs,
                                                 R->qref[x->layer], NULL, R->n_ref, x->k, x->v,
                                                 x->C, env->H, env->dtype, out, NULL);
        return kvrt_am_compact_layer_ref(env->rt, &st->o, R->qref[x->layer], NULL, R->n_ref,
                                         x->k, x->v, x->C, env->H, env->Hkv, env->d, NULL,
                                         budget, env->dtype, out, NULL);
    }
    if (m->variant == AM_EVAL_SCHEDULED)
        return kvrt_am_compact_scheduled(env->rt, st->s, NULL, 0, budget, x->layer, x->q, x->k,
                                         x->v, x->C, env->H, env->dtype, out, NULL);
    return kvrt_am_compact_layer(env->rt, &st->o, x->q, x->k, x->v, x->C, env->H, env->Hkv,
                                 env->d, NULL, budget, env->dtype, out, NULL);
}

static int am_eval_compress(const kvcc_eval_method *m, void *state, void *pstate,
                            const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                            int64_t B, kvrt_cache **out) {
    (void)pstate; (void)B;
    return am_eval_layer(m, state, env, x, budget, out);
}

/* Every budget of a layer in one kvrt_am_compact_layer_multi call (the per-head logits,
 * masses, targets and key scores once): the same caches as am_eval_compress per budget. Rows
 * with repeat-prefill queries are not shared (KVRT_ERR_UNSUPPORTED: eval then compresses each
 * row on its own). */
static int am_eval_compress_multi(const kvcc_eval_method *m, void *state, void *pstate,
                                  const kvcc_eval_env *env, const kvcc_eval_layer *x, int n,
                                  const double *budgets, const int64_t *B, kvrt_cache **out) {
    am_eval_state *st = state;
    (void)pstate; (void)B;
    if (st->repeat) return KVRT_ERR_UNSUPPORTED;
    if (m->variant != AM_EVAL_SCHEDULED)
        return kvrt_am_compact_layer_multi(env->rt, &st->o, x->q, x->k, x->v, x->C, env->H,
                                           env->Hkv, env->d, n, NULL, budgets, env->dtype, out,
                                           NULL);
    kvrt_am_opts o;
    float *ratios = malloc(sizeof(float) * (size_t)n * env->Hkv);
    int rc = ratios ? kvrt_am_schedule_opts(st->s, &o) : KVRT_ERR_NOMEM;
    for (int j = 0; !rc && j < n; j++) {
        const float *r;
        rc = kvrt_am_schedule_ratios(st->s, budgets[j], x->layer, &r);
        if (!rc) memcpy(ratios + (size_t)j * env->Hkv, r, sizeof(float) * env->Hkv);
    }
    if (!rc)
        rc = kvrt_am_compact_layer_multi(env->rt, &o, x->q, x->k, x->v, x->C, env->H, env->Hkv,
                                         env->d, n, ratios, budgets, env->dtype, out, NULL);
    free(ratios);
    return rc;
}

/* End to end (and the needle task): every layer from the model's own keys and values; repeat
 * rows first run the repeat-prefill of the context's tokens (once per context for all rows). */
static int am_eval_compress_all(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                                const kvcc_eval_all *x, double budget, int64_t B,
                                kvrt_cache **out) {
    am_eval_state *st = state;
    (void)B;
    if (st->repeat) {
        char err[600];
        int rc = am_repeat_run(st->R, x->tokens, x->C, st->gen_tokens, err, sizeof err);
        if (rc) { /* the row fails with the status; the reason goes to stderr */
            fprintf(stderr, "%s: %s\n", m->name, err);
            return rc == KVCC_EXIT_FAILED ? KVRT_ERR_NOMEM : KVRT_ERR_ARG;
        }
    }
    int rc = KVRT_OK;
    for (uint32_t l = 0; l < env->L && rc == KVRT_OK; l++) {
        const kvcc_eval_layer xl = {.layer = l, .q = x->q[l], .k = x->k[l], .v = x->v[l],
                                    .C = x->C};
        rc = am_eval_layer(m, st, env, &xl, budget, &out[l]);
    }
    if (rc)
        for (uint32_t l = 0; l < env->L; l++) { kvrt_cache_free(out[l]); out[l] = NULL; }
    return rc;
}

/* am opens the schedule (once per run); the uncompiled variants need no policy. */
/* all: am_eval_compress_all where the row may need repeat-prefill queries end to end (am: its
 * artifact says; the -repeat rows), NULL for the context-query rows, whose end-to-end layers
 * then go through compress_layer and share one call for all budgets (compress_layer_multi). */
#define AM_EVAL_METHOD(nm, var, open, close, all)                                                  \
    {.name = nm, .family = "Attention Matching", .budget = KVCC_BUDGET_RATIO, .variant = var,      \
     .open_handle = open, .close_handle = close, .prepare = am_eval_prepare,                       \
     .release = am_eval_release, .prompt_begin = am_eval_prompt_begin,                             \
     .compress_layer = am_eval_compress, .compress_layer_multi = am_eval_compress_multi,           \
     .compress_all = all}
static const kvcc_eval_method am_eval_methods[] = {
    AM_EVAL_METHOD("am", AM_EVAL_SCHEDULED, am_eval_open, am_eval_close, am_eval_compress_all),
    AM_EVAL_METHOD("am-uniform", AM_EVAL_UNIFORM, NULL, NULL, NULL),
    AM_EVAL_METHOD("am-omp", AM_EVAL_OMP, NULL, NULL, NULL),
    AM_EVAL_METHOD("am-repeat", AM_EVAL_REPEAT, NULL, NULL, am_eval_compress_all),
    AM_EVAL_METHOD("am-omp-repeat", AM_EVAL_OMP_REPEAT, NULL, NULL, am_eval_compress_all),
    AM_EVAL_METHOD("am-self", AM_EVAL_SELF, NULL, NULL, am_eval_compress_all),
    {.name = NULL},
};

#define AM_OPT(f) offsetof(kvcc_compile_ctx, f)
static const kvcc_pass_option am_options[] = {
    {"am-targets", KVCC_OPT_LIST, "LIST", "0.02,0.05,0.1,0.2",
     "target mean ratios of the context kept per KV head", AM_OPT(am_targets), AM_OPT(n_am_targets),
     0, 0, NULL, 0},
    {"am-ratios", KVCC_OPT_LIST, "LIST", "0.015625,0.03125,0.0625,0.125,0.25,0.5",
     "ratio grid of the sensitivity curves (1/64 ... 1/2)", AM_OPT(am_ratios), AM_OPT(n_am_ratios),
     0, 0, NULL, 0},
    {"am-chunk", KVCC_OPT_U32, "N", "4096",
     "keys per chunk of the compaction (written; eval runs it)", AM_OPT(am_chunk), 0, 16,
     1u << 20, NULL, 0},
    {"am-select", KVCC_OPT_CHOICE, "highest|omp", "highest",
     "key selection (written; eval runs it)", AM_OPT(am_select), 0, 0, 0, "highest|omp", 0},
    {"am-floor", KVCC_OPT_F64, "F|none", "-3",
     "bias floor: every selected key is kept with beta = max(log w, F), so a head holds its whole "
     "budget; none: keys of NNLS weight 0 are dropped (written; eval runs it)", AM_OPT(am_floor),
     0, 0, 0, NULL, KVCC_OPT_NONE},
    {"am-sinks", KVCC_OPT_U32, "N", "4",
     "first N keys of every head kept exactly (beta 0), inside its budget (written; eval runs it)",
     AM_OPT(am_sinks), 0, 0, 1u << 20, NULL, 0},
    {"am-queries", KVCC_OPT_CHOICE, "context|repeat|self-study", "context",
     "reference queries of the calibration: the context's own (causal), repeat-prefill (the "
     "model runs the context, an instruction to repeat it and the context again; the second "
     "copy's queries) or self-study (the model's greedy questions and answers about the context, "
     "up to --am-self-tokens tokens per turn; their queries); the last two need --gguf (written; "
     "eval runs it)",
     AM_OPT(am_queries), 0, 0, 0, "context|repeat|self-study", 0},
    {"am-self-tokens", KVCC_OPT_U32, "N|auto", "auto",
     "with --am-queries self-study: answer tokens the model may generate per turn (two turns "
     "per prompt; the generation is most of the pass's time on short contexts). auto: 256 "
     "(written; eval runs it)", AM_OPT(am_self_tokens), 0, 1, AM_SELF_STUDY_TOKENS_MAX, NULL,
     KVCC_OPT_AUTO},
    {"am-recent", KVCC_OPT_F64, "F", "0.5",
     "fraction of every head's budget kept as the exact recent window, in [0, 1) (written; eval "
     "runs it)", AM_OPT(am_recent), 0, 0, 0, NULL, 0},
    {"am-products", KVCC_OPT_CHOICE, "f32|bf16", "f32",
     "precision of the compaction's two large products (logits, P V): bf16 rounds queries, keys, "
     "values and P to bf16 with f32 sums (AMX or AVX512-BF16 kernels, 3-4x the f32 rate on an AMX "
     "core; the calibration runs it too; written; eval runs it)", AM_OPT(am_products), 0, 0, 0,
     "f32|bf16", 0},
    {NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0},
};

const kvcc_pass kvcc_pass_am = {
    .name = "am",
    .title = "Attention Matching",
    .group = KVPOL_GROUP_AM,
    .needs_corpus = 1,
    .options = am_options,
    .check = am_check,
    .uses_model = am_uses_model,
    .run = am_run,
    .inspect = am_inspect,
    .eval_methods = am_eval_methods,
};
