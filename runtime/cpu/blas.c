/*
 * blas.c: the CPU backend's f32 matrix products (oneDNN or OpenBLAS) and its large scratch
 * buffers. blas.h says what each function guarantees.
 *
 * defines: kvrt_cpu_sgemm, kvrt_cpu_sgemm_1t, kvrt_cpu_sgemm_batch, kvrt_cpu_gemm_name,
 *          kvrt_cpu_openblas_hold, kvrt_cpu_openblas_restore, kvrt_cpu_gemm_is_dnnl,
 *          kvrt_cpu_expmm_get, kvrt_cpu_expmm_put, kvrt_cpu_expmm_scratch_bytes, kvrt_cpu_expmm_run,
 *          kvrt_cpu_expmm_enable, kvrt_cpu_expmm_runs, kvrt_cpu_bf16mm_batch, kvrt_cpu_bf16mm_enable,
 *          kvrt_cpu_bf16mm_runs, kvrt_cpu_bf16mm_isa, kvrt_cpu_scratch_alloc, kvrt_cpu_scratch_free
 */
#include <math.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cblas.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if KVCC_WITH_DNNL
#include <dnnl.h>
#endif

#include "core/bf16.h"
#include "cpu/blas.h"

char *openblas_get_config(void);
char *openblas_get_corename(void);
int openblas_get_num_threads(void);
void openblas_set_num_threads(int n);

/* Holds of OpenBLAS at one thread, counted process-wide: the first takes the count, the last
 * gives it back, so two threads of a program (a serving stack's workers) holding at once each
 * keep one thread until both are done (each saving and restoring its own value let the first to
 * finish hand the count back while the other still ran). */
static pthread_mutex_t openblas_hold_mu = PTHREAD_MUTEX_INITIALIZER;
static int openblas_hold_depth, openblas_hold_saved;

int kvrt_cpu_openblas_hold(void) {
#ifdef _OPENMP
    if (omp_in_parallel()) return 0;
#endif
    pthread_mutex_lock(&openblas_hold_mu);
    if (openblas_hold_depth++ == 0) {
        openblas_hold_saved = openblas_get_num_threads();
        if (openblas_hold_saved != 1) openblas_set_num_threads(1);
    }
    pthread_mutex_unlock(&openblas_hold_mu);
    return 1;
}

void kvrt_cpu_openblas_restore(int held) {
    if (!held) return;
    pthread_mutex_lock(&openblas_hold_mu);
    if (--openblas_hold_depth == 0 && openblas_hold_saved != 1)
        openblas_set_num_threads(openblas_hold_saved);
    pthread_mutex_unlock(&openblas_hold_mu);
}

/* The calling task's OpenMP thread count at 1 (oneDNN sizes its team from it, also inside an
 * active parallel region, and a primitive keeps the count it was built with), handed back with
 * omp_one_leave. */
static inline int omp_one_enter(void) {
#ifdef _OPENMP
    const int prev = omp_get_max_threads();
    if (prev != 1) omp_set_num_threads(1);
    return prev;
#else
    return 1;
#endif
}
static inline void omp_one_leave(int prev) {
#ifdef _OPENMP
    if (prev != 1) omp_set_num_threads(prev);
#else
    (void)prev;
#endif
}

int kvrt_cpu_gemm_is_dnnl(void) {
#if KVCC_WITH_DNNL
    return 1;
#else
    return 0;
#endif
}

void kvrt_cpu_sgemm(int tb, int m, int n, int k, float alpha, const float *A, int lda,
                    const float *B, int ldb, float beta, float *C, int ldc) {
    if (m <= 0 || n <= 0) return;
#if KVCC_WITH_DNNL
    if (dnnl_sgemm('N', tb ? 'T' : 'N', m, n, k, alpha, A, lda, B, ldb, beta, C, ldc) ==
        dnnl_success)
        return;
    /* only on an argument oneDNN rejects or an allocation it could not make: same product */
#endif
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A,
                lda, B, ldb, beta, C, ldc);
}

void kvrt_cpu_sgemm_1t(int tb, int m, int n, int k, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
#if KVCC_WITH_DNNL && defined(_OPENMP)
    /* oneDNN sizes its team from the calling task's nthreads ICV (1 inside an active parallel
     * region): set it to 1 for this call, so that an inactive region or a serial caller with
     * more threads does not split the product either */
    const int prev = omp_one_enter();
    kvrt_cpu_sgemm(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
    omp_one_leave(prev);
#else
    kvrt_cpu_sgemm(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

static void op_run(const kvrt_sgemm_op *o, int one_thread) {
    if (one_thread)
        kvrt_cpu_sgemm_1t(o->tb, o->m, o->n, o->k, o->alpha, o->A, o->lda, o->B, o->ldb, o->beta,
                          o->C, o->ldc);
    else
        kvrt_cpu_sgemm(o->tb, o->m, o->n, o->k, o->alpha, o->A, o->lda, o->B, o->ldb, o->beta,
                       o->C, o->ldc);
}

/* Whether a batch of n_ops products runs one product per OpenMP thread, each on its thread:
 * outside a parallel region with a team of two or more, on oneDNN, or on OpenBLAS held at one
 * thread (kvrt_cpu_openblas_hold). Otherwise the products run one after another, each threaded
 * by its library: OpenBLAS's threaded products of long sums depend on its thread count
 * (256 x 128 x 3989: 21820 of 32768 entries differed between 1 and 2 threads), so callers that
 * need the same bits at any thread count hold it. */
static int batch_on_team(int64_t n_ops) {
#ifdef _OPENMP
    if (n_ops < 2 || omp_in_parallel() || omp_get_max_threads() < 2) return 0;
#if KVCC_WITH_DNNL
    return 1;
#else
    return openblas_get_num_threads() == 1;
#endif
#else
    (void)n_ops;
    return 0;
#endif
}

/* oneDNN: every product on its calling thread; OpenBLAS: threaded by it unless held */
#if KVCC_WITH_DNNL
#define BATCH_ONE_THREAD 1
#else
#define BATCH_ONE_THREAD 0
#endif

void kvrt_cpu_sgemm_batch(const kvrt_sgemm_op *ops, int64_t n_ops) {
    kvrt_cpu_mark_threaded();
    if (batch_on_team(n_ops)) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_ops; i++) op_run(&ops[i], BATCH_ONE_THREAD);
        return;
    }
    for (int64_t i = 0; i < n_ops; i++) op_run(&ops[i], BATCH_ONE_THREAD);
}

/* C[i, j] = expf(C[i, j]) over m rows of n at stride ldc: the exp epilogue where oneDNN's kernel
 * did not run (libm's exp, within oneDNN's exp error of it) */
static void exp_rows(float *C, int m, int n, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) C[(size_t)i * ldc + j] = expf(C[(size_t)i * ldc + j]);
}

/* A cached matmul primitive (blas.h): the product with the exponential in its epilogue
 * (kvrt_cpu_expmm_get: f32, dense rows, exp) and the bf16 products (kvrt_cpu_bf16mm_batch). */
struct kvrt_cpu_expmm {
    int m, n, k, lda, ldb, ldc, tb, bf16, exp;
    int packed;    /* B in the primitive's own layout (format any; kvrt_cpu_bf16mm_pack) */
    float alpha;
    int cached;    /* 1: owned by mm_cache (kvrt_cpu_expmm_put hands the reference back) */
    int refs;      /* cached: the gets not yet put (an entry in use is never evicted) */
    uint64_t used; /* cached: the table's clock at the last get (eviction: least recent) */
#if KVCC_WITH_DNNL
    dnnl_primitive_t prim;
    dnnl_memory_desc_t a, b, c, scratch;
    dnnl_primitive_t reorder; /* packed: B from rows of ldb into b (built on the first pack) */
#endif
};
typedef struct kvrt_cpu_expmm mm_prim;

static int expmm_on = 1;
static int bf16mm_on = 1;
static uint64_t expmm_runs;  /* kvrt_cpu_expmm_runs */
static uint64_t bf16mm_runs; /* kvrt_cpu_bf16mm_runs */

uint64_t kvrt_cpu_expmm_runs(void) { return __atomic_load_n(&expmm_runs, __ATOMIC_RELAXED); }
uint64_t kvrt_cpu_bf16mm_runs(void) { return __atomic_load_n(&bf16mm_runs, __ATOMIC_RELAXED); }

int kvrt_cpu_expmm_enable(int on) {
    const int prev = __atomic_load_n(&expmm_on, __ATOMIC_RELAXED);
    __atomic_store_n(&expmm_on, on ? 1 : 0, __ATOMIC_RELAXED);
    return prev;
}

#if KVCC_WITH_DNNL
/* Primitives are kept for the process (a shape is a few hundred microseconds to build, the
 * window mass runs it per chunk, Attention Matching per query block). The window mass uses one or
 * two shapes per call; Attention Matching's bf16 products one per (block rows, keys rounded up to
 * 256, row stride) of a chunk size, so contexts of many lengths bring new shapes: a full table
 * evicts its least recently used entry that no caller holds, and a shape oneDNN has no kernel
 * for is kept as such (NULL prim: not built again on every call). Builds run outside the lock;
 * the same shape gives the same primitive, so the same results, whichever entry runs. */
#define MM_CACHE 128
static pthread_mutex_t mm_mu = PTHREAD_MUTEX_INITIALIZER;
static mm_prim *mm_cache[MM_CACHE];
static dnnl_engine_t mm_engine;
static pthread_once_t mm_engine_once = PTHREAD_ONCE_INIT;
static void mm_engine_init(void) {
    if (dnnl_engine_create(&mm_engine, dnnl_cpu, 0) != dnnl_success) mm_engine = NULL;
}

static void mm_destroy(mm_prim *p) {
    if (p == NULL) return;
    if (p->prim) dnnl_primitive_destroy(p->prim);
    if (p->reorder) dnnl_primitive_destroy(p->reorder);
    free(p);
}

/* One matmul primitive: src A (m, k) in rows of lda, weights op(B) (k, n) (tb: read from B
 * (n, k) rows of ldb, else B (k, n) rows of ldb), dst C (m, n) f32 rows of ldc; A and B f32 or
 * bf16 (both); output scale alpha, then eltwise exp when exp; user scratchpad (the library's
 * shared scratchpad would tie the primitive to the thread that built it). Built with the calling
 * task's OpenMP thread count at 1 (inside a parallel region too) so that it computes on the
 * calling thread alone. NULL when oneDNN has no implementation (bf16 below AVX-512). */
static mm_prim *mm_build(const mm_prim *key) {
    pthread_once(&mm_engine_once, mm_engine_init);
    if (mm_engine == NULL) return NULL;
    mm_prim *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    *p = *key;
    const dnnl_data_type_t dt = p->bf16 ? dnnl_bf16 : dnnl_f32;
    dnnl_dims_t da = {p->m, p->k}, db = {p->k, p->n}, dc = {p->m, p->n};
    dnnl_dims_t sa = {p->lda, 1}, sbt = {1, p->ldb}, sbn = {p->ldb, 1}, sc = {p->ldc, 1};
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_matmul_desc_t md;
    const int prev = omp_one_enter();
    dnnl_status_t st = dnnl_memory_desc_init_by_strides(&p->a, 2, da, dt, sa);
    if (!st)
        st = p->packed ? dnnl_memory_desc_init_by_tag(&p->b, 2, db, dt, dnnl_format_tag_any)
                       : dnnl_memory_desc_init_by_strides(&p->b, 2, db, dt, p->tb ? sbt : sbn);
    if (!st) st = dnnl_memory_desc_init_by_strides(&p->c, 2, dc, dnnl_f32, sc);
    if (!st) st = dnnl_primitive_attr_create(&attr);
    if (!st && p->exp) {
        st = dnnl_post_ops_create(&po);
        if (!st) st = dnnl_post_ops_append_eltwise(po, 1.0f, dnnl_eltwise_exp, 0.0f, 0.0f);
        if (!st) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (!st && p->alpha != 1.0f) st = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &p->alpha);
    if (!st) st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (!st) st = dnnl_matmul_desc_init(&md, &p->a, &p->b, NULL, &p->c);
    if (!st) st = dnnl_primitive_desc_create(&pd, &md, attr, mm_engine, NULL);
    if (!st) {
        const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
        if (smd) p->scratch = *smd; else st = dnnl_runtime_error;
    }
    if (!st && p->packed) { /* the layout oneDNN chose for B */
        const dnnl_memory_desc_t *wmd = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        if (wmd) p->b = *wmd; else st = dnnl_runtime_error;
    }
    if (!st) st = dnnl_primitive_create(&p->prim, pd);
    omp_one_leave(prev);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (st) {
        mm_destroy(p);
        return NULL;
    }
    return p;
}

static int mm_same(const mm_prim *a, const mm_prim *b) {
    return a->m == b->m && a->n == b->n && a->k == b->k && a->lda == b->lda &&
           a->ldb == b->ldb && a->ldc == b->ldc && a->tb == b->tb && a->bf16 == b->bf16 &&
           a->exp == b->exp && a->packed == b->packed &&
           memcmp(&a->alpha, &b->alpha, sizeof a->alpha) == 0;
}

static uint64_t mm_clock;

/* The cached primitive of key's shape (built on first use; a reference the caller hands back with
 * mm_put), or one for the caller alone (cached 0) when every entry is in use; NULL when oneDNN
 * has no kernel for the shape. */
static mm_prim *mm_get(const mm_prim *key) {
    pthread_mutex_lock(&mm_mu);
    for (int i = 0; i < MM_CACHE && mm_cache[i]; i++) {
        mm_prim *c = mm_cache[i];
        if (!mm_same(c, key)) continue;
        c->used = ++mm_clock;
        if (c->prim) c->refs++;
        pthread_mutex_unlock(&mm_mu);
        return c->prim ? c : NULL;
    }
    pthread_mutex_unlock(&mm_mu);
    mm_prim *p = mm_build(key); /* outside the lock: other shapes keep running */
    if (p == NULL && (p = calloc(1, sizeof *p)) != NULL) *p = *key; /* "no kernel" entry */
    if (p == NULL) return NULL;
    mm_prim *victim = NULL, *hit = NULL;
    pthread_mutex_lock(&mm_mu);
    int slot = -1;
    for (int i = 0; i < MM_CACHE && !hit; i++) {
        mm_prim *c = mm_cache[i];
        if (c == NULL) { /* the table fills from the front: the rest is empty */
            slot = i;
            break;
        }
        if (mm_same(c, key)) hit = c; /* built by another thread meanwhile */
        else if (c->refs == 0 && (slot < 0 || (mm_cache[slot] && c->used < mm_cache[slot]->used)))
            slot = i;
    }
    if (hit) {
        hit->used = ++mm_clock;
        if (hit->prim) hit->refs++;
        victim = p;
        p = hit->prim ? hit : NULL;
    } else if (slot >= 0) {
        victim = mm_cache[slot];
        p->cached = 1;
        p->used = ++mm_clock;
        if (p->prim) p->refs = 1;
        mm_cache[slot] = p;
        if (!p->prim) p = NULL;
    } else if (!p->prim) { /* every entry in use: a "no kernel" answer is not kept */
        victim = p;
        p = NULL;
    }
    pthread_mutex_unlock(&mm_mu);
    mm_destroy(victim);
    return p;
}

/* Hands back a reference from mm_get (destroys a primitive that was the caller's alone). */
static void mm_put(mm_prim *p) {
    if (p == NULL) return;
    if (!p->cached) {
        mm_destroy(p);
        return;
    }
    pthread_mutex_lock(&mm_mu);
    p->refs--;
    pthread_mutex_unlock(&mm_mu);
}

/* Runs p on the calling thread; nonzero when oneDNN could not allocate a stream or a memory
 * object. */
static int mm_run(const mm_prim *p, const void *A, const void *B, float *C, void *scratch) {
    dnnl_stream_t str = NULL;
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, ms = NULL;
    const int prev = omp_one_enter();
    dnnl_status_t st = dnnl_stream_create(&str, mm_engine, dnnl_stream_default_flags);
    if (!st) st = dnnl_memory_create(&ma, &p->a, mm_engine, (void *)A);
    if (!st) st = dnnl_memory_create(&mb, &p->b, mm_engine, (void *)B);
    if (!st) st = dnnl_memory_create(&mc, &p->c, mm_engine, C);
    if (!st) st = dnnl_memory_create(&ms, &p->scratch, mm_engine, scratch);
    if (!st) {
        const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma},
                                         {DNNL_ARG_WEIGHTS, mb},
                                         {DNNL_ARG_DST, mc},
                                         {DNNL_ARG_SCRATCHPAD, ms}};
        st = dnnl_primitive_execute(p->prim, str, 4, args);
        if (!st) st = dnnl_stream_wait(str);
    }
    if (ms) dnnl_memory_destroy(ms);
    if (mc) dnnl_memory_destroy(mc);
    if (mb) dnnl_memory_destroy(mb);
    if (ma) dnnl_memory_destroy(ma);
    if (str) dnnl_stream_destroy(str);
    omp_one_leave(prev);
    return st != dnnl_success;
}
#endif

kvrt_cpu_expmm *kvrt_cpu_expmm_get(int m, int n, int k, int ldc, float alpha) {
    if (!__atomic_load_n(&expmm_on, __ATOMIC_RELAXED) || m <= 0 || n <= 0 || k <= 0 || ldc < n)
        return NULL;
#if KVCC_WITH_DNNL
    const mm_prim key = {.m = m, .n = n, .k = k, .lda = k, .ldb = k, .ldc = ldc, .tb = 1,
                         .exp = 1, .alpha = alpha};
    return mm_get(&key);
#else
    (void)alpha;
    return NULL;
#endif
}

void kvrt_cpu_expmm_put(kvrt_cpu_expmm *p) {
#if KVCC_WITH_DNNL
    mm_put(p);
#else
    (void)p;
#endif
}

size_t kvrt_cpu_expmm_scratch_bytes(const kvrt_cpu_expmm *p) {
#if KVCC_WITH_DNNL
    return p ? dnnl_memory_desc_get_size(&p->scratch) : 0;
#else
    (void)p;
    return 0;
#endif
}

void kvrt_cpu_expmm_run(const kvrt_cpu_expmm *p, const float *A, const float *B, float *C,
                        void *scratch) {
    __atomic_add_fetch(&expmm_runs, 1, __ATOMIC_RELAXED);
#if KVCC_WITH_DNNL
    if (mm_run(p, A, B, C, scratch) == 0) return;
    /* only when oneDNN could not allocate a stream or a memory object: the same values from the
     * plain product and libm's exp (within oneDNN's exp error of them) */
    kvrt_cpu_sgemm_1t(1, p->m, p->n, p->k, p->alpha, A, p->k, B, p->k, 0.0f, C, p->ldc);
    exp_rows(C, p->m, p->n, p->ldc);
#else
    (void)p; (void)A; (void)B; (void)C; (void)scratch;
#endif
}

/* bf16 rows widened to f32 (exact), dense */
static float *widen_rows(const uint16_t *src, int rows, int cols, int ld) {
    float *o = malloc(sizeof(float) * (size_t)rows * (size_t)cols + 1);
    if (o == NULL) return NULL;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            o[(size_t)r * cols + c] = kvrt_f32_of_bf16(src[(size_t)r * ld + c]);
    return o;
}

#if KVCC_WITH_DNNL
/* A scratch buffer of at least `bytes` for the calling thread, kept for its next call (oneDNN's
 * bf16 kernels pack B into it; a fresh buffer per product cost 8% of Attention Matching's CPU
 * time in page faults). One per thread, grown when needed, freed when the thread exits (a
 * pthread key's destructor; OpenMP's threads live as long as the process). NULL when out of
 * memory. */
typedef struct { void *p; size_t n; } thread_buf;
static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static int tl_ok;
static void tl_free(void *v) {
    thread_buf *b = v;
    free(b->p);
    free(b);
}
static void tl_init(void) { tl_ok = pthread_key_create(&tl_key, tl_free) == 0; }
static void *thread_scratch(size_t bytes) {
    pthread_once(&tl_once, tl_init);
    if (!tl_ok) return NULL;
    thread_buf *b = pthread_getspecific(tl_key);
    if (b == NULL) {
        if ((b = calloc(1, sizeof *b)) == NULL) return NULL;
        if (pthread_setspecific(tl_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (b->n < bytes) {
        free(b->p);
        b->p = malloc(bytes);
        b->n = b->p ? bytes : 0;
    }
    return b->p;
}
#endif

#if KVCC_WITH_DNNL
/* The primitive table's key of a bf16 op (packed: B in the primitive's own layout) */
static mm_prim bf16_key(const kvrt_bf16mm_op *o, int packed) {
    return (mm_prim){.m = o->m, .n = o->n, .k = o->k, .lda = o->lda, .ldb = o->ldb,
                     .ldc = o->ldc, .tb = o->tb, .bf16 = 1, .exp = o->exp != 0,
                     .alpha = o->alpha, .packed = packed};
}
#endif

/* One bf16 product (kvrt_cpu_bf16mm_batch): on oneDNN's bf16 kernel when it has one (on the
 * calling thread), else the f32 product of the widened operands (one_thread: on the calling
 * thread, else threaded by the library). Nonzero when out of memory. */
static int bf16_op_run(const kvrt_bf16mm_op *o, int one_thread) {
    if (o->m <= 0 || o->n <= 0) return 0;
#if KVCC_WITH_DNNL
    const mm_prim key = bf16_key(o, o->Bp != NULL);
    mm_prim *p = __atomic_load_n(&bf16mm_on, __ATOMIC_RELAXED) ? mm_get(&key) : NULL;
    if (p != NULL) {
        const size_t sb = dnnl_memory_desc_get_size(&p->scratch);
        void *scr = sb ? thread_scratch(sb) : NULL;
        if (sb && scr == NULL) { /* not the widened path: it would round the sums apart */
            mm_put(p);
            return -1;
        }
        const int bad = mm_run(p, o->A, o->Bp ? o->Bp : (const void *)o->B, o->C, scr);
        mm_put(p);
        if (!bad) {
            __atomic_add_fetch(&bf16mm_runs, 1, __ATOMIC_RELAXED);
            return 0;
        }
    }
#endif
    const int rb = o->tb ? o->n : o->k, cb = o->tb ? o->k : o->n;
    float *a = widen_rows(o->A, o->m, o->k, o->lda), *b = widen_rows(o->B, rb, cb, o->ldb);
    if (a && b) {
        const kvrt_sgemm_op f = {.tb = o->tb, .m = o->m, .n = o->n, .k = o->k, .alpha = o->alpha,
                                 .beta = 0.0f, .A = a, .B = b, .C = o->C, .lda = o->k,
                                 .ldb = cb, .ldc = o->ldc};
        op_run(&f, one_thread);
        if (o->exp) exp_rows(o->C, o->m, o->n, o->ldc);
    }
    free(a);
    free(b);
    return a && b ? 0 : -1;
}

int kvrt_cpu_bf16mm_batch(const kvrt_bf16mm_op *ops, int64_t n_ops) {
    kvrt_cpu_mark_threaded();
    int bad = 0;
    if (batch_on_team(n_ops)) {
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
        for (int64_t i = 0; i < n_ops; i++) bad |= bf16_op_run(&ops[i], BATCH_ONE_THREAD);
        return bad ? -1 : 0;
    }
    for (int64_t i = 0; i < n_ops; i++) bad |= bf16_op_run(&ops[i], BATCH_ONE_THREAD);
    return bad ? -1 : 0;
}

#if KVCC_WITH_DNNL
/* The packed primitive of o's shape (mm_get; NULL without a kernel or with bf16mm off) */
static mm_prim *packed_get(const kvrt_bf16mm_op *o) {
    if (!__atomic_load_n(&bf16mm_on, __ATOMIC_RELAXED) || o->m <= 0 || o->n <= 0 || o->k <= 0)
        return NULL;
    const mm_prim key = bf16_key(o, 1);
    return mm_get(&key);
}
#endif

size_t kvrt_cpu_bf16mm_packed_bytes(const kvrt_bf16mm_op *o) {
#if KVCC_WITH_DNNL
    mm_prim *p = packed_get(o);
    const size_t n = p ? dnnl_memory_desc_get_size(&p->b) : 0;
    mm_put(p);
    return n;
#else
    (void)o;
    return 0;
#endif
}

int kvrt_cpu_bf16mm_packed_same(const kvrt_bf16mm_op *a, const kvrt_bf16mm_op *b) {
#if KVCC_WITH_DNNL
    mm_prim *pa = packed_get(a), *pb = packed_get(b);
    const int same = pa && pb && dnnl_memory_desc_equal(&pa->b, &pb->b);
    mm_put(pa);
    mm_put(pb);
    return same;
#else
    (void)a; (void)b;
    return 0;
#endif
}

int kvrt_cpu_bf16mm_pack(const kvrt_bf16mm_op *o, void *dst) {
#if KVCC_WITH_DNNL
    mm_prim *p = packed_get(o);
    if (p == NULL) return -1;
    dnnl_memory_desc_t src;
    dnnl_dims_t db = {o->k, o->n}, sbt = {1, o->ldb}, sbn = {o->ldb, 1};
    dnnl_status_t st = dnnl_memory_desc_init_by_strides(&src, 2, db, dnnl_bf16, o->tb ? sbt : sbn);
    /* the reorder is built once per cached primitive (under the table's lock: a build is a
     * JIT compilation, ~0.1 ms) */
    dnnl_primitive_t ro = NULL;
    if (!st) {
        pthread_mutex_lock(&mm_mu);
        if (p->reorder == NULL) {
            dnnl_primitive_desc_t rpd = NULL;
            st = dnnl_reorder_primitive_desc_create(&rpd, &src, mm_engine, &p->b, mm_engine, NULL);
            if (!st) st = dnnl_primitive_create(&p->reorder, rpd);
            if (rpd) dnnl_primitive_desc_destroy(rpd);
        }
        ro = p->reorder;
        pthread_mutex_unlock(&mm_mu);
    }
    dnnl_stream_t str = NULL;
    dnnl_memory_t ms = NULL, md = NULL;
    if (!st && ro) st = dnnl_stream_create(&str, mm_engine, dnnl_stream_default_flags);
    if (!st) st = dnnl_memory_create(&ms, &src, mm_engine, (void *)o->B);
    if (!st) st = dnnl_memory_create(&md, &p->b, mm_engine, dst);
    if (!st) {
        const dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, ms}, {DNNL_ARG_TO, md}};
        st = dnnl_primitive_execute(ro, str, 2, args);
        if (!st) st = dnnl_stream_wait(str);
    }
    if (md) dnnl_memory_destroy(md);
    if (ms) dnnl_memory_destroy(ms);
    if (str) dnnl_stream_destroy(str);
    mm_put(p);
    return st == dnnl_success && ro ? 0 : -1;
#else
    (void)o; (void)dst;
    return -1;
#endif
}

int kvrt_cpu_bf16mm_enable(int on) {
    const int prev = __atomic_load_n(&bf16mm_on, __ATOMIC_RELAXED);
    __atomic_store_n(&bf16mm_on, on ? 1 : 0, __ATOMIC_RELAXED);
    return prev;
}

static char gemm_name[160];
static void gemm_name_init(void) {
#if KVCC_WITH_DNNL
    const dnnl_version_t *v = dnnl_version();
    const char *isa = "?";
    switch ((int)dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: isa = "sse41"; break;
    case dnnl_cpu_isa_avx: isa = "avx"; break;
    case dnnl_cpu_isa_avx2: isa = "avx2"; break;
    case dnnl_cpu_isa_avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl_cpu_isa_avx512_core: isa = "avx512_core"; break;
    case dnnl_cpu_isa_avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl_cpu_isa_avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl_cpu_isa_avx512_core_amx: isa = "avx512_core_amx"; break;
    default: break;
    }
    snprintf(gemm_name, sizeof gemm_name, "oneDNN %d.%d.%d sgemm (isa %s)", v->major, v->minor,
             v->patch, isa);
#else
    char cfg[96];
    snprintf(cfg, sizeof cfg, "%s", openblas_get_config()); /* "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." */
    char *sp = strchr(cfg, ' ');
    if (sp && (sp = strchr(sp + 1, ' '))) *sp = 0; /* keep name and version */
    snprintf(gemm_name, sizeof gemm_name, "%s sgemm (%s)", cfg, openblas_get_corename());
#endif
}

int kvrt_cpu_bf16mm_isa(void) {
#if KVCC_WITH_DNNL
    switch ((int)dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: return 2;
    case dnnl_cpu_isa_avx512_core_bf16: return 1;
    default: return 0;
    }
#else
    return 0;
#endif
}

const char *kvrt_cpu_gemm_name(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, gemm_name_init);
    return gemm_name;
}

/* Freed large buffers kept for the next call (kvrt_cpu_scratch_free): a kernel called once per
 * layer (the window mass, AM's logits, bf16 probabilities, targets and fit matrix) otherwise faults in and zeroes tens of MiB of fresh pages
 * on every call (at 32k keys, llama3-8b shapes: ~5% of the window mass's CPU time in
 * clear_page). At most SCRATCH_SLOTS buffers and SCRATCH_KEEP bytes are kept; a request takes
 * the smallest kept buffer that fits. kvrt_cpu_scratch_trim (the last CPU context freed) gives
 * them all back, and none is kept while no CPU context lives. */
#define SCRATCH_HUGE ((size_t)2 << 20)
#define SCRATCH_SLOTS 16
#define SCRATCH_KEEP ((size_t)256 << 20)
static pthread_mutex_t scratch_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { void *p; size_t n; } scratch_kept[SCRATCH_SLOTS];

static size_t scratch_round(size_t bytes) {
    return (bytes + SCRATCH_HUGE - 1) / SCRATCH_HUGE * SCRATCH_HUGE;
}

void *kvrt_cpu_scratch_alloc(size_t bytes) {
    kvrt_cpu_mark_threaded(); /* its users run OpenMP regions */
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= SCRATCH_HUGE) {
        const size_t n = scratch_round(bytes);
        void *p = NULL;
        pthread_mutex_lock(&scratch_mu);
        int best = -1;
        for (int i = 0; i < SCRATCH_SLOTS; i++)
            if (scratch_kept[i].p && scratch_kept[i].n >= n &&
                (best < 0 || scratch_kept[i].n < scratch_kept[best].n))
                best = i;
        if (best >= 0) {
            p = scratch_kept[best].p;
            scratch_kept[best].p = NULL;
        }
        pthread_mutex_unlock(&scratch_mu);
        if (p != NULL) return p;
        p = aligned_alloc(SCRATCH_HUGE, n);
        if (p != NULL) (void)madvise(p, n, MADV_HUGEPAGE); /* advice only: failure is harmless */
        return p;
    }
#endif
    return malloc(bytes > 0 ? bytes : 1);
}

size_t kvrt_cpu_scratch_kept_bytes(void) {
    size_t n = 0;
    pthread_mutex_lock(&scratch_mu);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_kept[i].p) n += scratch_kept[i].n;
    pthread_mutex_unlock(&scratch_mu);
    return n;
}

void kvrt_cpu_scratch_trim(void) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    void *drop[SCRATCH_SLOTS];
    pthread_mutex_lock(&scratch_mu);
    for (int i = 0; i < SCRATCH_SLOTS; i++) {
        drop[i] = scratch_kept[i].p;
        scratch_kept[i].p = NULL;
    }
    pthread_mutex_unlock(&scratch_mu);
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(drop[i]);
#endif
}

void kvrt_cpu_scratch_free(void *p, size_t bytes) {
    if (p == NULL) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= SCRATCH_HUGE) {
        /* the buffer's own size: a request may have been served by a larger kept buffer, and
         * counting it at the caller's smaller size let the kept total pass SCRATCH_KEEP many
         * times over (a server's AM calls of varying T: 240 MiB counted, 1.3 GB held) */
        const size_t usable = malloc_usable_size(p);
        const size_t n = usable > bytes ? usable : scratch_round(bytes);
        pthread_mutex_lock(&scratch_mu);
        size_t kept = 0;
        int slot = -1, small = -1;
        for (int i = 0; i < SCRATCH_SLOTS; i++) {
            if (!scratch_kept[i].p) {
                if (slot < 0) slot = i;
                continue;
            }
            kept += scratch_kept[i].n;
            if (small < 0 || scratch_kept[i].n < scratch_kept[small].n) small = i;
        }
        void *drop = NULL;
        if (slot < 0 && small >= 0 && scratch_kept[small].n < n) { /* full: keep the larger */
            drop = scratch_kept[small].p;
            kept -= scratch_kept[small].n;
            scratch_kept[small].p = NULL;
            slot = small;
        }
        /* kept only while a CPU context lives: the last one's free trims after its count
         * drops, under this mutex, so a buffer kept before that is dropped and none after */
        if (slot >= 0 && kept + n <= SCRATCH_KEEP && kvrt_cpu_contexts_live() > 0) {
            scratch_kept[slot].p = p;
            scratch_kept[slot].n = n;
            p = NULL;
        }
        pthread_mutex_unlock(&scratch_mu);
        free(drop);
    }
#else
    (void)bytes;
#endif
    free(p);
}

// ----------------------------------------------------------------------------
// fork: the locks above, taken by the forking thread (backend_cpu.c registers these)

#if KVCC_WITH_DNNL
#define MM_LOCK() pthread_mutex_lock(&mm_mu)
#define MM_UNLOCK() pthread_mutex_unlock(&mm_mu)
#else /* no primitive cache */
#define MM_LOCK() ((void)0)
#define MM_UNLOCK() ((void)0)
#endif
void kvrt_cpu_fork_prepare(void) {
    pthread_mutex_lock(&openblas_hold_mu);
    MM_LOCK();
    pthread_mutex_lock(&scratch_mu);
}
void kvrt_cpu_fork_parent(void) {
    pthread_mutex_unlock(&scratch_mu);
    MM_UNLOCK();
    pthread_mutex_unlock(&openblas_hold_mu);
}
void kvrt_cpu_fork_child(void) {
    /* a hold of another thread, which the child lacks, would never end: the child's holds
     * count from 0 (OpenBLAS may stay at one thread then, harmless in a one-thread child) */
    openblas_hold_depth = 0;
    pthread_mutex_unlock(&scratch_mu);
    MM_UNLOCK();
    pthread_mutex_unlock(&openblas_hold_mu);
}
