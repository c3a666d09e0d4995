/*
 * compilerkv_int.h: the CompilerKV pass's own state, shared by its three files and nobody else:
 * compilerkv.c (setup, rounds, the section writer, inspect), compilerkv_reward.c (prompt
 * features, the attention and model rewards behind ckv_reward) and compilerkv_report.c
 * (--reward-check, --transfer-check). What other parts of kvcc use is in compilerkv.h.
 *
 * defines: ckv (the pass state), ckv_prompt, ckv_result, the action grids, ckv_* functions
 */
#ifndef KVCC_COMPILERKV_INT_H
#define KVCC_COMPILERKV_INT_H
#include <math.h>
#include <stdint.h>

#include "compilerkv.h"
#include "cql.h"
#include "kvcc.h"
#include "loader.h"
#include "loop.h"
#include "stats.h"

#define CKV_HEAD_ACTIONS 29 /* weights 0.8 .. 1.5 */
#define CKV_GATE_ACTIONS 21 /* thresholds 0.8 .. 1.0 */
#define CKV_HEAD_FALLBACK 8 /* 0.8 + 8 * 0.025 = 1.0 */
#define CKV_GATE_FALLBACK 0 /* 0.8: lowest threshold, keeps the most */
#define CKV_HEAD_K 29       /* defaults of --head-actions / --gate-actions: actions per state */
#define CKV_GATE_K 8        /* per prompt, the incumbent included */
#define CKV_GROUP_DEFAULT 1 /* default of --head-states: 1 group, 0 head */
#define CKV_CHECK_K 8       /* reward check: actions per head state (incumbent + 7) */
#define CKV_MAX_ROUNDS 3
#define CKV_DEFAULT_CACHE_MB 0 /* MB of layer caches kept in memory; the rest: a temporary file */
#define CKV_ENT_BINS KVRT_COMPILERKV_ENT_BINS
#define CKV_PPL_BINS KVRT_COMPILERKV_PPL_BINS

static inline float ckv_head_grid(uint32_t a) {
    return (float)(0.8 + 0.7 * a / (CKV_HEAD_ACTIONS - 1));
}
static inline float ckv_gate_grid(uint32_t a) {
    return (float)(0.8 + 0.2 * a / (CKV_GATE_ACTIONS - 1));
}
/* The grid action of a table value (tables read back from an artifact). */
static inline uint32_t ckv_head_action_of(float w) {
    long a = lround((w - 0.8) / 0.7 * (CKV_HEAD_ACTIONS - 1));
    return (uint32_t)(a < 0 ? 0 : a >= CKV_HEAD_ACTIONS ? CKV_HEAD_ACTIONS - 1 : a);
}

typedef struct {
    uint32_t C, N;
    float *alpha;  /* [C] */
    float *rho;    /* [L, Hkv, C] */
    double ent, ppl;
    int be, bp;
} ckv_prompt;

typedef struct {
    int32_t *pos;
    int64_t n;
    uint64_t hash;
    double nll;
} ckv_memo_ent;
typedef struct {
    ckv_memo_ent *e;
    size_t n, cap;
} ckv_memo;

typedef struct {
    const kvcc_compile_ctx *cx;
    kvcc_corpus *corpus;
    const char *corpus_path;
    uint32_t L, H, Hkv, d, P, nB, window;
    uint32_t head_k, gate_k;        /* actions per state per prompt (incumbent included) */
    int group;                      /* head states per KV group (--head-states group) */
    uint32_t ent_bins, ppl_bins;    /* risk bins in use (--ent-bins, --ppl-bins); the rest of the
                                     * 20 x 4 bins are unreachable (their edges are FLT_MAX) */
    int64_t budgets[64];
    char skipped[256];              /* budgets >= the context, skipped */
    ckv_prompt *pr;                 /* [P] */
    kvrt_compilerkv_tables *tb;
    uint32_t *head_act;             /* [nB, L, H] current actions */
    uint32_t *gate_act;             /* [nB, L, CKV_ENT_BINS, CKV_PPL_BINS] */
    uint32_t *head_sup, *gate_sup;  /* [.., actions] support of the last round */
    kvcc_cql_record *rec;
    size_t n_rec, cap_rec;
    int n_threads;
    double **scratch;               /* per thread: kvcc_ckv_scratch_doubles of the largest layer */
    size_t scratch_doubles;
    /* attention reward: layer caches [P, L] (all kept when cache_all) */
    int attention;                  /* the attention reward is needed */
    kvcc_ckv_layer **lc;
    int cache_all;
    size_t cache_bytes;
    int spill_fd;                   /* the layer caches' temporary file (unlinked), or -1 */
    int64_t *spill_off;             /* [P * L] offset of (p, l) in it, -1: not written yet */
    uint64_t spill_end;
    char spill_dir[256];            /* where it is ($TMPDIR or /tmp), for messages */
    uint32_t maxT;
    kvcc_loop walk;                 /* the corpus walk of the rebuilds (when not cached) */
    int have_walk;
    /* model reward */
    int model;                      /* the model reward is needed */
    kvcc_loaded_model lm;
    int have_lm;
    kvcc_state *ms;
    int64_t ms_prompt;              /* prompt whose context the state holds, or -1 */
    kvrt_ctx *rt;
    int32_t *tok;                   /* [maxT] tokens of ms_prompt */
    float *lp;                      /* [maxT] corpus next_logprob of ms_prompt */
    float *logits;                  /* [min(chunk, maxT), V] */
    const kvrt_cache **caches;      /* [L] all NULL but the rolled-out layer */
    double *nll_full;               /* [P] exact continuation NLL (NAN until computed) */
    double max_lp_diff;             /* largest |log p model - log p corpus| seen */
    double lp_tol;                  /* the most it may be: KVCC_COMPILERKV_LP_TOL(_BF16) */
    ckv_memo *memo;                 /* [P, L] */
    uint64_t model_runs, memo_hits;
    uint64_t n_head_rec, n_gate_rec;
    uint32_t flat_head, flat_gate;  /* last round: states whose every record has paired reward 0 */
    unsigned progress_done, progress_total;
    /* MPI (compiler/dist.h): the prompts [plo, phi) this rank rolls out; dist: records and
     * features gathered after each phase (the pass itself; the reports run on one rank) */
    uint32_t plo, phi;
    int dist;
} ckv;

typedef struct {
    uint32_t rounds;
    int64_t round_changes[CKV_MAX_ROUNDS * 2];
    kvcc_cql_opts co;
    kvcc_cql_info hi, gi;
    double t_collect, t_fit;
} ckv_result;

/* Which reward scores a rollout (ckv_reward). */
enum { CKV_REWARD_ATTENTION = 0, CKV_REWARD_MODEL = 1 };

/* vsnprintf into err (err may be NULL with errlen 0); returns code. */
__attribute__((format(printf, 4, 5)))
int ckv_failf(char *err, size_t errlen, int code, const char *fmt, ...);

/* compilerkv.c: the pass state from a corpus (attention / model: which rewards to prepare),
 * the alternating rounds, the rollout selection, the seeded action draws. */
int ckv_setup(ckv *S, const kvcc_compile_ctx *cx, kvcc_corpus *corpus, const char *corpus_path,
              int attention, int model, char *err, size_t errlen);
void ckv_free_state(ckv *S);
int ckv_compile_rounds(ckv *S, const char *label, ckv_result *res, char *err, size_t errlen);
int ckv_select_rollout(const ckv *S, const ckv_prompt *P, uint32_t l, const float *w_row, float tau,
                       int64_t B, kvrt_selection **sel, kvrt_compilerkv_stats *st);
const float *ckv_incumbent_row(const ckv *S, uint32_t b, uint32_t l);
float ckv_incumbent_tau(const ckv *S, const ckv_prompt *P, uint32_t b, uint32_t l);
uint32_t ckv_draw_actions(uint64_t seed, uint32_t n, uint32_t k, uint32_t incumbent, uint32_t *out);

/* compilerkv_reward.c */
typedef int (*ckv_layer_fn)(void *user, uint32_t prompt, uint32_t layer, const float *q,
                            const float *k, const float *v, char *err, size_t errlen);
/* kvcc_compilerkv_prompt_from_corpus, calling each_layer (optional) with every layer read. */
int ckv_prompt_features(kvcc_corpus *c, uint32_t prompt, uint32_t window, float *rho,
                        kvrt_compilerkv_prompt **out, uint32_t *context_len,
                        ckv_layer_fn each_layer, void *user, char *err, size_t errlen);
/* The features pass's callback: builds the layer cache of (prompt, layer) into S->lc. */
int ckv_build_layer_cb(void *user, uint32_t p, uint32_t l, const float *q, const float *k,
                       const float *v, char *err, size_t errlen);
/* The layer cache of (p, l): cached, or read and built (*owned = 1: free it after use). */
int ckv_get_layer(ckv *S, uint32_t p, uint32_t l, kvcc_ckv_layer **out, int *owned, char *err,
                  size_t errlen);
/* Load --gguf into S and check it against the corpus's model. */
int ckv_model_open(ckv *S, char *err, size_t errlen);
/* The continuation NLL with layer l's context cut to the kept positions (memoized per (p, l)). */
int ckv_model_nll(ckv *S, uint32_t p, uint32_t l, const kvrt_selection *sel, double *nll, char *err,
                  size_t errlen);
/* The reward of the kept set sel [1 KV head row] of (prompt p, layer l): CKV_REWARD_ATTENTION
 * minus the relative attention-output error against base (lc, scratch: that rollout's thread's;
 * thread-safe, no message: returns KVRT_ERR_ARG), or CKV_REWARD_MODEL minus the continuation
 * NLL increase (serial; a KVCC_EXIT_* status with the message in err). */
int ckv_reward(ckv *S, int which, uint32_t p, uint32_t l, const kvcc_ckv_layer *lc,
               const kvcc_ckv_base *base, const kvrt_selection *sel, double *scratch, double *r,
               char *err, size_t errlen);
#endif
