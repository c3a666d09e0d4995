/*
 * blas.h: libkvrt internals: the CPU backend's f32 matrix products behind one seam, and the
 * allocator of its large scratch buffers. Not installed.
 *
 * Every f32 product of the CPU policies (Attention Matching's logits and values, the window-mass
 * kernel of SnapKV / H2O / CompilerKV) goes through here: oneDNN's dnnl_sgemm when libkvrt is
 * built with it (USE_DNNL=1, the default when libdnnl-dev is installed: it dispatches on the
 * CPU's ISA itself and runs on libgomp's team, the one our OpenMP loops use), OpenBLAS's
 * cblas_sgemm otherwise (whose kernels depend on what the installed OpenBLAS recognises: 0.3.21
 * runs generic kernels on CPUs newer than it). Row-major: C (m, n) = alpha A (m, k) op(B) +
 * beta C, op(B) = B^T with B (n, k) when tb, else B (k, n).
 *
 * Determinism: in kvrt_cpu_sgemm_1t and _batch each product is computed by one thread (oneDNN never splits a product over
 * threads when it is told it has one; OpenBLAS is held at one thread by the callers that run
 * products inside their own parallel tasks), and which products are formed depends on the
 * shapes only, so results do not depend on the thread count.
 *
 * defines: kvrt_sgemm_op, kvrt_cpu_sgemm, kvrt_cpu_sgemm_1t, kvrt_cpu_sgemm_batch, kvrt_cpu_gemm_name,
 *          kvrt_cpu_openblas_hold, kvrt_cpu_openblas_restore, kvrt_cpu_gemm_is_dnnl,
 *          kvrt_cpu_expmm (type), kvrt_cpu_expmm_get, kvrt_cpu_expmm_put, kvrt_cpu_expmm_scratch_bytes,
 *          kvrt_cpu_expmm_run, kvrt_cpu_expmm_enable, kvrt_cpu_expmm_runs, kvrt_bf16mm_op,
 *          kvrt_cpu_bf16mm_batch, kvrt_cpu_bf16mm_packed_bytes, kvrt_cpu_bf16mm_pack,
 *          kvrt_cpu_bf16mm_packed_same, kvrt_cpu_bf16mm_enable, kvrt_cpu_bf16mm_runs,
 *          kvrt_cpu_bf16mm_isa, kvrt_cpu_scratch_alloc, kvrt_cpu_scratch_free, kvrt_cpu_scratch_trim,
 *          kvrt_cpu_scratch_kept_bytes; declares
 *          kvrt_cpu_att_small_ok, kvrt_cpu_att_qk_small, kvrt_cpu_att_pv_small (cpu/attend.c)
 */
#ifndef KVRT_CPU_BLAS_H
#define KVRT_CPU_BLAS_H

#include <stddef.h>
#include <stdint.h>

#include "core/backend.h"

/* One product of a batch (see kvrt_cpu_sgemm_batch). */
typedef struct {
    int tb;                 /* 1: op(B) = B^T */
    int m, n, k;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int lda, ldb, ldc;
} kvrt_sgemm_op;

/* One product, threaded by the library (oneDNN on the OpenMP team, OpenBLAS on its own threads):
 * for large single products outside parallel regions (the built-in model's layers). */
KVRT_INTERNAL void kvrt_cpu_sgemm(int tb, int m, int n, int k, float alpha, const float *A,
                                  int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* A few rows' attention products on the calling thread, in AVX2 + FMA + F16C
 * (runtime/cpu/attend.c; kvrt_attend's decode step and the built-in model's decode attention):
 * usable when kvrt_cpu_att_small_ok(d) (an x86 CPU with AVX2, FMA and F16C, d a multiple of 8;
 * elsewhere these are plain loops). K and V are stored as dtype (KVRT_DTYPE_F32, _F16 or _BF16;
 * 2-byte rows are widened exactly: with R > 1 and scratch wbuf of KVRT_ATT_WIDEN_FLOATS(d) floats
 * a few at a time into it, else as they load; the bits of the same kernels on f32 copies either
 * way), rows ldk / ldv elements apart; wbuf may be NULL (f32 rows never use it).
 * kvrt_cpu_att_qk_small: s [R, nb] (row stride nb) = scale Q [R, d] K^T; eight keys at a time,
 * one accumulator each over d, reduced together, then single keys.
 * kvrt_cpu_att_pv_small: acc [R, d] += P [R, nb] (row stride nb) V; per row the output in
 * registers (64 lanes per pass) over runs of 32 keys. Every sum in a fixed order: the same bits
 * on any thread. */
KVRT_INTERNAL int kvrt_cpu_att_small_ok(int64_t d);
KVRT_INTERNAL void kvrt_cpu_att_qk_small(const float *qt, int64_t R, int64_t d, int dtype,
                                         const void *kb, int64_t ldk, int64_t nb, float scale,
                                         float *s, float *wbuf);
KVRT_INTERNAL void kvrt_cpu_att_pv_small(const float *P, int64_t R, int64_t nb, int dtype,
                                         const void *vb, int64_t ldv, int64_t d, float *acc,
                                         float *wbuf);
#define KVRT_ATT_WIDEN_FLOATS(d) ((size_t)32 * (size_t)(d)) /* wbuf of the two above */

/* One product on the calling thread (inside or outside a parallel region). With OpenBLAS the
 * caller keeps it at one thread (openblas_set_num_threads(1), or products small enough that
 * OpenBLAS does not thread them: M N K <= 2^18). */
KVRT_INTERNAL void kvrt_cpu_sgemm_1t(int tb, int m, int n, int k, float alpha, const float *A,
                                     int lda, const float *B, int ldb, float beta, float *C,
                                     int ldc);

/* Independent products (no C overlaps another product's A, B or C). With oneDNN they run in
 * parallel on the OpenMP team, one thread per product, in any order: each C is the same whatever
 * the thread count. With OpenBLAS held at one thread (kvrt_cpu_openblas_hold) the same; with
 * OpenBLAS on several threads, one after another, each threaded by OpenBLAS, which splits a
 * product's long sums by its thread count (the bits then depend on it). Call outside a parallel
 * region (inside one, they run one after another on the caller). */
KVRT_INTERNAL void kvrt_cpu_sgemm_batch(const kvrt_sgemm_op *ops, int64_t n_ops);

/* OpenBLAS at one thread from here (its pthreads, spinning and yielding after each call, compete
 * with OpenMP's team) until the matching kvrt_cpu_openblas_restore(returned value). The count is
 * process-wide, so holds are counted: the first saves it, the last restores it (threads of a
 * program holding at once all run at one until every hold ends). Inside an enclosing parallel
 * region the caller owns the count and it is left alone (returns 0: restore does nothing). */
KVRT_INTERNAL int kvrt_cpu_openblas_hold(void);
KVRT_INTERNAL void kvrt_cpu_openblas_restore(int prev);

/* 1 when the f32 products of this file run on oneDNN (USE_DNNL=1). */
KVRT_INTERNAL int kvrt_cpu_gemm_is_dnnl(void);

/* "oneDNN 2.6.3 sgemm (isa avx512_core_amx)" or "OpenBLAS cblas_sgemm": what the products run on. */
KVRT_INTERNAL const char *kvrt_cpu_gemm_name(void);
/* The bf16 kernels oneDNN runs here (its effective ISA, which ONEDNN_MAX_CPU_ISA may cap below
 * the CPU's): 2 AMX, 1 AVX512-BF16, 0 none (or no oneDNN). */
KVRT_INTERNAL int kvrt_cpu_bf16mm_isa(void);

/* C = exp(alpha A B^T), one product with the exponential in its epilogue: A (m, k) and B (n, k)
 * in dense rows (lda = ldb = k), C (m, n) in rows of ldc. With oneDNN, a matmul primitive with an
 * output scale and an eltwise-exp post-op: on AVX-512 machines its brgemm kernel exponentiates
 * the accumulators before they are stored (the window mass's separate exp pass over the logits
 * cost 0.28 of the product's time; docs/benchmarks.md "The exponential in the product"). Only
 * dense B gets that kernel (a strided B gets gemm:jit with the exp as a second pass), so callers
 * copy strided rows first.
 * kvrt_cpu_expmm_get returns the primitive for a shape, built once per process per shape (a
 * table of 128 shared with the bf16 products, least recently used entries evicted; when every
 * entry is in use the caller gets its own), to hand back with kvrt_cpu_expmm_put after its runs,
 * and safe to run from several threads at once, each with its own scratch of
 * kvrt_cpu_expmm_scratch_bytes. NULL when libkvrt
 * has no oneDNN (USE_DNNL=0), when oneDNN refuses the shape, or after kvrt_cpu_expmm_enable(0):
 * the caller then takes its path without it. kvrt_cpu_expmm_run computes on the calling thread
 * (inside or outside a parallel region); which kernel runs depends on the shape and the CPU only,
 * so results do not depend on the thread count. Values follow expf(alpha a.b) within oneDNN's exp
 * error (a few ulp); +INF past ~88.7, 0 (or subnormal) below ~-87.3. */
typedef struct kvrt_cpu_expmm kvrt_cpu_expmm;
KVRT_INTERNAL kvrt_cpu_expmm *kvrt_cpu_expmm_get(int m, int n, int k, int ldc, float alpha);
KVRT_INTERNAL void kvrt_cpu_expmm_put(kvrt_cpu_expmm *p);
KVRT_INTERNAL size_t kvrt_cpu_expmm_scratch_bytes(const kvrt_cpu_expmm *p);
KVRT_INTERNAL void kvrt_cpu_expmm_run(const kvrt_cpu_expmm *p, const float *A, const float *B,
                                      float *C, void *scratch);
/* 0 turns kvrt_cpu_expmm_get off process-wide (it returns NULL), 1 back on (the default);
 * returns the previous setting. For tests that run the kernels' other path on the same build. */
KVRT_INTERNAL int kvrt_cpu_expmm_enable(int on);
/* How many products kvrt_cpu_expmm_run has computed in this process (tests: the path ran). */
KVRT_INTERNAL uint64_t kvrt_cpu_expmm_runs(void);

/* One product of bf16 operands (kvrt_cpu_bf16mm_batch): C (m, n) f32 = alpha A op(B), A (m, k)
 * in rows of lda, op(B) = B^T with B (n, k) rows of ldb when tb, else B (k, n) rows of ldb;
 * bf16 values as uint16_t (the high half of an f32). exp: C = exp(alpha A op(B)) instead, the
 * exponential in the kernel's epilogue (as kvrt_cpu_expmm; libm's expf on the widened path).
 * Bp (or NULL): the same B in oneDNN's layout for this shape (kvrt_cpu_bf16mm_pack), read where
 * that kernel runs; B itself is still read on every other path. */
typedef struct {
    int tb, exp;
    int m, n, k;
    float alpha;
    const uint16_t *A, *B;
    float *C;
    int lda, ldb, ldc;
    const void *Bp;
} kvrt_bf16mm_op;

/* Independent bf16 products with f32 accumulation (Attention Matching's products at
 * precision bf16): with oneDNN, its bf16 matmul (AMX or AVX512-BF16 kernels where the CPU has
 * them; about 3-4x the f32 product's rate on an AMX core: docs/benchmarks.md), one product per
 * OpenMP thread as kvrt_cpu_sgemm_batch, from a process-wide table of primitives per shape
 * (shared with kvrt_cpu_expmm_get); where oneDNN has no bf16 kernel (below AVX-512, USE_DNNL=0,
 * or after kvrt_cpu_bf16mm_enable(0)) the f32 product of the operands widened to f32 (exact),
 * which differs from the bf16 kernel by the order of the f32 sums only. Each C is the same
 * whatever the thread count. Returns 0, or -1 when out of memory (some C not written). */
KVRT_INTERNAL int kvrt_cpu_bf16mm_batch(const kvrt_bf16mm_op *ops, int64_t n_ops);
/* B packed once for many products of one shape: oneDNN's matmul given B in rows copies it into
 * its own blocked layout on every call (a product of 256 queries by 4096 keys copies all the
 * keys; AM's logit products at T 4096: 6.2 -> 5.2 ms with B packed once, docs/benchmarks.md).
 * kvrt_cpu_bf16mm_packed_bytes: the bytes of that layout for o's shape (m, n, k, tb, exp, alpha;
 * its A, B and C are not read), 0 where oneDNN has no bf16 kernel (then Bp is not read either).
 * kvrt_cpu_bf16mm_pack: o->B (rows of ldb as o says) into dst [packed_bytes]; 0, or -1 (no
 * kernel, out of memory). kvrt_cpu_bf16mm_packed_same: whether two shapes share the layout (one
 * packed B serves both). The values are the kernel's own on either layout up to the order of
 * its sums over k, which the layout may change (tests/unit am/bf16_blocks_*). */
KVRT_INTERNAL size_t kvrt_cpu_bf16mm_packed_bytes(const kvrt_bf16mm_op *o);
KVRT_INTERNAL int kvrt_cpu_bf16mm_pack(const kvrt_bf16mm_op *o, void *dst);
KVRT_INTERNAL int kvrt_cpu_bf16mm_packed_same(const kvrt_bf16mm_op *a, const kvrt_bf16mm_op *b);
/* 0 turns oneDNN's bf16 kernel off process-wide (the widened f32 path runs), 1 back on (the
 * default); returns the previous setting. For tests. */
KVRT_INTERNAL int kvrt_cpu_bf16mm_enable(int on);
/* How many bf16 products oneDNN's bf16 kernel has computed in this process (tests). */
KVRT_INTERNAL uint64_t kvrt_cpu_bf16mm_runs(void);

/* A scratch buffer of `bytes` (contents undefined), given back with kvrt_cpu_scratch_free(p,
 * the same bytes): from 2 MiB up, aligned to 2 MiB and advised into transparent huge pages (4 KiB
 * page faults on a fresh buffer of tens of MiB cost a tenth of the kernels that fill it), and
 * reused: up to 16 freed buffers, 256 MiB in all, are kept for the next request that fits (a
 * per-layer kernel then faults its scratch in once per context's life, not once per call), until
 * kvrt_cpu_scratch_trim; only while a CPU context is alive (a call that takes no context, made
 * with none alive, frees its buffers). Thread-safe. NULL when out of memory. */
KVRT_INTERNAL void *kvrt_cpu_scratch_alloc(size_t bytes);
KVRT_INTERNAL void kvrt_cpu_scratch_free(void *p, size_t bytes);
/* Give every kept scratch buffer back to the system (called when the last CPU context is freed:
 * a process that no longer runs libkvrt holds none of its memory). */
KVRT_INTERNAL void kvrt_cpu_scratch_trim(void);
/* The bytes kept now (tests). */
KVRT_INTERNAL size_t kvrt_cpu_scratch_kept_bytes(void);
/* CPU contexts alive now (runtime/cpu/backend_cpu.c). */
KVRT_INTERNAL int kvrt_cpu_contexts_live(void);
/* Record that libkvrt's threaded code has run in this process (backend_cpu.c: a child forked
 * after it runs libkvrt on one thread). Called by every path that opens OpenMP regions without
 * a context: the scratch allocator, the batched products, the value norms, the NNLS. */
KVRT_INTERNAL void kvrt_cpu_mark_threaded(void);
/* pthread_atfork handlers for libkvrt's own locks (blas.c): prepare takes them, the parent
 * releases them, the child releases them and forgets any OpenBLAS hold of a thread it lacks. */
KVRT_INTERNAL void kvrt_cpu_fork_prepare(void);
KVRT_INTERNAL void kvrt_cpu_fork_parent(void);
KVRT_INTERNAL void kvrt_cpu_fork_child(void);

#endif
