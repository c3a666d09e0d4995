/*
 * test_blas.c: Criterion tests of the CPU backend's GEMM seam (runtime/cpu/blas.c): every path
 * (kvrt_cpu_sgemm, _1t, _batch; both transposes; alpha, beta, leading dimensions wider than the
 * rows) against a plain double-accumulated loop within 1e-5 relative, the batch bit-identical at
 * 1 and 2 OpenMP threads (each product on one thread), kvrt_cpu_gemm_name naming a library, and
 * the product with the exponential in its epilogue (kvrt_cpu_expmm), and the bf16 products
 * (kvrt_cpu_bf16mm_batch) against the double product of the same bf16 values, on oneDNN's bf16
 * kernel and on the widened f32 path, and with B packed once (kvrt_cpu_bf16mm_pack).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt.h" /* kvrt_f32_to_bf16, kvrt_bf16_to_f32 */
#include "cpu/blas.h"
#include "test_rng.h"

/* C (m, n) = alpha A op(B) + beta C0, in double. */
static void gemm_plain(int tb, int m, int n, int k, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, const float *C0, float *C, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double acc = 0;
            for (int p = 0; p < k; p++)
                acc += (double)A[i * lda + p] * (double)(tb ? B[j * ldb + p] : B[p * ldb + j]);
            C[i * ldc + j] = (float)(alpha * acc + (double)beta * C0[i * ldc + j]);
        }
}

static float *rand_buf(size_t n, uint64_t *s) {
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = rng_uniform(s, -1.0f, 1.0f);
    return x;
}

static double max_rel(const float *a, const float *b, int m, int n, int ld) {
    double num = 0, den = 0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const double e = fabs((double)a[i * ld + j] - b[i * ld + j]);
            num = e > num ? e : num;
            den = fabs(b[i * ld + j]) > den ? fabs(b[i * ld + j]) : den;
        }
    return num / (den > 0 ? den : 1);
}

Test(blas, every_path_matches_plain_loop) {
    uint64_t s = 7;
    const int shapes[][3] = {{1, 1, 1}, {3, 70, 64}, {256, 129, 64}, {65, 64, 300}, {17, 1, 5}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (int tb = 0; tb < 2; tb++)
            for (int path = 0; path < 3; path++) {
                const int m = shapes[c][0], n = shapes[c][1], k = shapes[c][2];
                const int lda = k + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
                float *A = rand_buf((size_t)m * lda, &s);
                float *B = rand_buf((size_t)(tb ? n : k) * ldb, &s);
                float *C0 = rand_buf((size_t)m * ldc, &s);
                float *C = malloc(sizeof(float) * (size_t)m * ldc);
                float *R = malloc(sizeof(float) * (size_t)m * ldc);
                memcpy(C, C0, sizeof(float) * (size_t)m * ldc);
                const float alpha = 0.75f, beta = path == 2 ? 0.0f : 0.5f;
                gemm_plain(tb, m, n, k, alpha, A, lda, B, ldb, beta, C0, R, ldc);
                if (path == 0) kvrt_cpu_sgemm(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
                else if (path == 1)
                    kvrt_cpu_sgemm_1t(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
                else {
                    kvrt_sgemm_op op = {.tb = tb, .m = m, .n = n, .k = k, .alpha = alpha,
                                        .beta = beta, .A = A, .B = B, .C = C, .lda = lda,
                                        .ldb = ldb, .ldc = ldc};
                    kvrt_cpu_sgemm_batch(&op, 1);
                }
                const double e = max_rel(C, R, m, n, ldc);
                cr_expect(e <= 1e-5, "%s shape %d x %d x %d tb %d (%s): max error %.3g of the "
                          "largest |C|, expected <= 1e-5",
                          path == 0 ? "kvrt_cpu_sgemm" : path == 1 ? "_1t" : "_batch", m, n, k,
                          tb, kvrt_cpu_gemm_name(), e);
                free(A); free(B); free(C0); free(C); free(R);
            }
}

/* A batch like Attention Matching's: row blocks of one product, run at 1 and 2 threads. */
static void batch_run(int threads, const float *Q, const float *K, float *S, int n, int T, int d) {
#ifdef _OPENMP
    const int prev = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    kvrt_sgemm_op ops[16];
    int nb = 0;
    for (int i0 = 0; i0 < n; i0 += 64, nb++)
        ops[nb] = (kvrt_sgemm_op){.tb = 1, .m = n - i0 < 64 ? n - i0 : 64, .n = T, .k = d,
                                  .alpha = 0.125f, .A = Q + (size_t)i0 * d, .lda = d, .B = K,
                                  .ldb = d, .C = S + (size_t)i0 * T, .ldc = T};
    kvrt_cpu_sgemm_batch(ops, nb);
#ifdef _OPENMP
    omp_set_num_threads(prev);
#endif
}

Test(blas, batch_is_thread_count_invariant) {
    uint64_t s = 11;
    const int n = 1000, T = 777, d = 64;
    float *Q = rand_buf((size_t)n * d, &s), *K = rand_buf((size_t)T * d, &s);
    float *S1 = calloc((size_t)n * T, sizeof(float)), *S2 = calloc((size_t)n * T, sizeof(float));
    batch_run(1, Q, K, S1, n, T, d);
    batch_run(2, Q, K, S2, n, T, d);
    cr_expect(memcmp(S1, S2, sizeof(float) * (size_t)n * T) == 0,
              "kvrt_cpu_sgemm_batch (%s): results differ between 1 and 2 OpenMP threads",
              kvrt_cpu_gemm_name());
    free(Q); free(K); free(S1); free(S2);
}

Test(blas, gemm_name_names_the_library) {
    const char *nm = kvrt_cpu_gemm_name();
    cr_expect(strstr(nm, "oneDNN") == nm || strstr(nm, "OpenBLAS") == nm,
              "kvrt_cpu_gemm_name() = '%s', expected it to start with oneDNN or OpenBLAS", nm);
    cr_expect(kvrt_cpu_gemm_is_dnnl() == (strstr(nm, "oneDNN") == nm));
}

/* kvrt_cpu_expmm: exp(alpha A B^T) against exp of the double product, within 1e-5 relative per
 * entry (|alpha a.b| <= 7.2, in practice below 3: the product's f32 rounding, times |z|, plus
 * oneDNN's exp error of a few ulp); the same primitive from two OpenMP threads at once gives
 * bitwise the serial result; get returns the cached primitive for a shape again; _enable(0)
 * turns it off. Available exactly when the products run on oneDNN. */
Test(blas, expmm_is_exp_of_the_product) {
    const int m = 37, n = 256, k = 24, ldc = 300;
    const float alpha = 0.3f;
    kvrt_cpu_expmm *p = kvrt_cpu_expmm_get(m, n, k, ldc, alpha);
    cr_assert_eq(p != NULL, kvrt_cpu_gemm_is_dnnl() != 0,
                 "kvrt_cpu_expmm_get: %s with products on %s", p ? "available" : "NULL",
                 kvrt_cpu_gemm_name());
    if (p == NULL) return;
    kvrt_cpu_expmm *p2 = kvrt_cpu_expmm_get(m, n, k, ldc, alpha);
    cr_expect_eq(p2, p, "the shape's primitive is not cached");
    kvrt_cpu_expmm_put(p2);
    uint64_t s = 17;
    float *A = rand_buf((size_t)m * k, &s), *B = rand_buf((size_t)n * k, &s);
    const size_t nc = (size_t)m * ldc;
    float *C = malloc(sizeof(float) * nc), *C2 = malloc(sizeof(float) * 2 * nc);
    const size_t sb = (kvrt_cpu_expmm_scratch_bytes(p) + 63) / 64 * 64; /* per thread */
    void *scr = aligned_alloc(64, 2 * sb + 64);
    cr_assert(C && C2 && scr);
    kvrt_cpu_expmm_run(p, A, B, C, scr);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double z = 0;
            for (int x = 0; x < k; x++) z += (double)A[i * k + x] * (double)B[j * k + x];
            const double want = exp((double)alpha * z), got = C[(size_t)i * ldc + j];
            cr_assert(fabs(got - want) <= 1e-5 * want, "[%d, %d]: %.9g, expected exp(%.6g) = %.9g",
                      i, j, got, (double)alpha * z, want);
        }
#pragma omp parallel for num_threads(2)
    for (int t = 0; t < 2; t++)
        kvrt_cpu_expmm_run(p, A, B, C2 + (size_t)t * nc, (char *)scr + (size_t)t * sb);
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < m; i++)
            cr_expect(memcmp(C2 + (size_t)t * nc + (size_t)i * ldc, C + (size_t)i * ldc,
                             sizeof(float) * n) == 0,
                      "thread %d row %d differs from the serial run", t, i);
    kvrt_cpu_expmm_put(p); /* cached: stays */
    cr_expect_eq(kvrt_cpu_expmm_enable(0), 1);
    cr_expect_null(kvrt_cpu_expmm_get(m, n, k, ldc, alpha));
    cr_expect_eq(kvrt_cpu_expmm_enable(1), 0);
    free(A); free(B); free(C); free(C2); free(scr);
}

/* kvrt_cpu_bf16mm_batch: every product of a batch (both transposes, leading dimensions wider
 * than the rows, alpha) against the double product of its bf16 operands, within 1e-5 of the
 * largest |C| (f32 sums of exact bf16 x bf16 products), with the exponential in the epilogue too;
 * on oneDNN's bf16 kernel (required to run on a CPU with AVX512-BF16: counted by
 * kvrt_cpu_bf16mm_runs) and on the widened f32 path (kvrt_cpu_bf16mm_enable(0)); the batch at 1
 * and 2 threads is bit-identical. */
Test(blas, bf16mm_is_the_product_of_the_rounded_operands) {
    enum { NOPS = 8 };
    /* m, n, k, tb, exp (C = exp(alpha A op(B)): small k and alpha keep it in range) */
    const int shapes[NOPS][5] = {{256, 300, 64, 1, 0}, {37, 128, 520, 0, 0}, {1, 1, 1, 1, 0},
                                 {64, 512, 128, 1, 0}, {200, 64, 256, 0, 0}, {5, 17, 33, 0, 0},
                                 {256, 512, 64, 1, 1}, {30, 70, 16, 1, 1}};
    uint64_t s = 23;
    kvrt_bf16mm_op ops[NOPS];
    uint16_t *A[NOPS], *B[NOPS];
    float *want[NOPS], *C[3][NOPS];
    for (int o = 0; o < NOPS; o++) {
        const int m = shapes[o][0], n = shapes[o][1], k = shapes[o][2], tb = shapes[o][3],
                  ex = shapes[o][4];
        const int lda = k + 8, ldb = (tb ? k : n) + 16, ldc = n + 3, rb = tb ? n : k;
        A[o] = malloc(sizeof(uint16_t) * (size_t)m * lda);
        B[o] = malloc(sizeof(uint16_t) * (size_t)rb * ldb);
        want[o] = malloc(sizeof(float) * (size_t)m * ldc);
        for (int r = 0; r < 3; r++) C[r][o] = calloc((size_t)m * ldc, sizeof(float));
        for (int x = 0; x < m * lda; x++) A[o][x] = kvrt_f32_to_bf16(rng_uniform(&s, -2.0f, 2.0f));
        for (int x = 0; x < rb * ldb; x++) B[o][x] = kvrt_f32_to_bf16(rng_uniform(&s, -2.0f, 2.0f));
        const float alpha = ex ? 0.05f : o % 2 ? 1.0f : 0.125f;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double acc = 0;
                for (int p = 0; p < k; p++)
                    acc += (double)kvrt_bf16_to_f32(A[o][i * lda + p]) *
                           (double)kvrt_bf16_to_f32(tb ? B[o][j * ldb + p] : B[o][p * ldb + j]);
                want[o][i * ldc + j] = (float)(ex ? exp(alpha * acc) : alpha * acc);
            }
        ops[o] = (kvrt_bf16mm_op){.tb = tb, .exp = ex, .m = m, .n = n, .k = k, .alpha = alpha, .A = A[o],
                                  .B = B[o], .lda = lda, .ldb = ldb, .ldc = ldc};
    }
    /* r = 0: the default path, 1: the same at one thread, 2: widened to f32 */
    for (int r = 0; r < 3; r++) {
        kvrt_bf16mm_op run[NOPS];
        for (int o = 0; o < NOPS; o++) {
            run[o] = ops[o];
            run[o].C = C[r][o];
        }
        const uint64_t runs = kvrt_cpu_bf16mm_runs();
        const int prev = r == 2 ? kvrt_cpu_bf16mm_enable(0) : 1;
#ifdef _OPENMP
        const int nt = omp_get_max_threads();
        if (r == 1) omp_set_num_threads(1);
#endif
        cr_assert_eq(kvrt_cpu_bf16mm_batch(run, NOPS), 0);
#ifdef _OPENMP
        omp_set_num_threads(nt);
#endif
        if (r == 2) {
            kvrt_cpu_bf16mm_enable(prev);
            cr_expect_eq(kvrt_cpu_bf16mm_runs(), runs, "the widened path ran oneDNN's kernel");
        } else if (r == 0) {
            cr_log_info("bf16mm: %llu of %d products on oneDNN's bf16 kernel (%s)",
                        (unsigned long long)(kvrt_cpu_bf16mm_runs() - runs), NOPS,
                        kvrt_cpu_gemm_name());
            if (!kvrt_cpu_gemm_is_dnnl())
                cr_expect_eq(kvrt_cpu_bf16mm_runs(), runs, "no oneDNN, yet its kernel ran");
            else if (kvrt_cpu_bf16mm_isa() > 0) /* oneDNN has bf16 kernels here */
                cr_expect_eq(kvrt_cpu_bf16mm_runs() - runs, (uint64_t)NOPS,
                             "oneDNN with a bf16 CPU: every product on its bf16 kernel");
        }
        for (int o = 0; o < NOPS; o++) {
            const double e = max_rel(C[r][o], want[o], ops[o].m, ops[o].n, ops[o].ldc);
            cr_expect(e <= 1e-5, "path %d product %d (%dx%dx%d tb %d): max error %.3g of max |C|", r,
                      o, ops[o].m, ops[o].n, ops[o].k, ops[o].tb, e);
        }
    }
    for (int o = 0; o < NOPS; o++) {
        for (int i = 0; i < ops[o].m; i++)
            cr_expect(memcmp(C[0][o] + (size_t)i * ops[o].ldc, C[1][o] + (size_t)i * ops[o].ldc,
                             sizeof(float) * (size_t)ops[o].n) == 0,
                      "product %d row %d differs between 1 and the default threads", o, i);
        free(A[o]); free(B[o]); free(want[o]);
        for (int r = 0; r < 3; r++) free(C[r][o]);
    }
}

/* B packed once (kvrt_cpu_bf16mm_pack) for products of one shape: the same values as B in rows
 * (bit for bit for the logit shape on AMX, where AM's tests rely on it; within 1e-5 elsewhere),
 * a packed B shared with a shorter last block only where the layout is the same, and no packed
 * layout with the bf16 kernel off (then Bp is not read: the widened path uses B). */
Test(blas, bf16mm_packed_b_gives_the_same_products) {
    /* m, n, k, tb, exp: AM's logit block (keys by rows, exp), its value block, a small one */
    const int shapes[3][5] = {{256, 700, 128, 1, 1}, {256, 128, 700, 0, 0}, {40, 24, 32, 1, 0}};
    uint64_t s = 77;
    for (int c = 0; c < 3; c++) {
        const int m = shapes[c][0], n = shapes[c][1], k = shapes[c][2], tb = shapes[c][3],
                  ex = shapes[c][4], rb = tb ? n : k, ldb = tb ? k : n;
        uint16_t *A = malloc(sizeof(uint16_t) * (size_t)m * k);
        uint16_t *B = malloc(sizeof(uint16_t) * (size_t)rb * ldb);
        float *C0 = calloc((size_t)m * n, sizeof(float)), *C1 = calloc((size_t)m * n, sizeof(float));
        for (int x = 0; x < m * k; x++) A[x] = kvrt_f32_to_bf16(rng_uniform(&s, -1.0f, 1.0f));
        for (int x = 0; x < rb * ldb; x++) B[x] = kvrt_f32_to_bf16(rng_uniform(&s, -1.0f, 1.0f));
        kvrt_bf16mm_op o = {.tb = tb, .exp = ex, .m = m, .n = n, .k = k,
                            .alpha = ex ? 0.08838834764831845f : 1.0f, .A = A, .B = B, .C = C0,
                            .lda = k, .ldb = ldb, .ldc = n};
        cr_assert_eq(kvrt_cpu_bf16mm_batch(&o, 1), 0);
        const size_t bytes = kvrt_cpu_bf16mm_packed_bytes(&o);
        if (!kvrt_cpu_gemm_is_dnnl() || kvrt_cpu_bf16mm_isa() == 0) {
            cr_expect_eq(bytes, 0u, "a packed layout without oneDNN's bf16 kernel");
        } else {
            cr_assert_gt(bytes, 0u, "shape %d: no packed layout", c);
            void *pk = malloc(bytes);
            cr_assert_eq(kvrt_cpu_bf16mm_pack(&o, pk), 0);
            kvrt_bf16mm_op p = o;
            p.C = C1;
            p.Bp = pk;
            uint16_t *Bz = calloc((size_t)rb * ldb, sizeof(uint16_t)); /* B in rows not read */
            p.B = Bz;
            cr_assert_eq(kvrt_cpu_bf16mm_batch(&p, 1), 0);
            p.B = B;
            free(Bz);
            if (c == 0 && kvrt_cpu_bf16mm_isa() == 2)
                cr_expect(memcmp(C0, C1, sizeof(float) * (size_t)m * n) == 0,
                          "the logit shape: packed B gave other bits on AMX");
            else
                cr_expect(max_rel(C1, C0, m, n, n) <= 1e-5, "shape %d: packed B: %.3g", c,
                          max_rel(C1, C0, m, n, n));
            /* a shorter last block: shares the layout only where oneDNN says so */
            kvrt_bf16mm_op last = o;
            last.m = m / 2 + 1;
            if (kvrt_cpu_bf16mm_packed_same(&o, &last)) {
                last.Bp = pk;
                last.C = C1;
                cr_assert_eq(kvrt_cpu_bf16mm_batch(&last, 1), 0);
                cr_expect(max_rel(C1, C0, last.m, n, n) <= 1e-5, "shape %d: the last block", c);
            }
            /* the kernel off: no layout, and an op with Bp reads B */
            const int prev = kvrt_cpu_bf16mm_enable(0);
            cr_expect_eq(kvrt_cpu_bf16mm_packed_bytes(&o), 0u);
            memset(C1, 0, sizeof(float) * (size_t)m * n);
            cr_assert_eq(kvrt_cpu_bf16mm_batch(&p, 1), 0);
            kvrt_cpu_bf16mm_enable(prev);
            cr_expect(max_rel(C1, C0, m, n, n) <= 1e-5, "shape %d: widened with Bp set", c);
            free(pk);
        }
        free(A); free(B); free(C0); free(C1);
    }
}

/* More shapes than the primitive table holds (128): every get still returns a primitive that
 * computes its product, a held primitive is never evicted (its shape's next get returns it), and
 * a shape evicted earlier is built again. */
Test(blas, primitive_table_evicts_least_recent) {
    if (!kvrt_cpu_gemm_is_dnnl()) return; /* no table without oneDNN */
    const int n = 32, k = 8, NS = 200;
    uint64_t s = 29;
    float *A = rand_buf((size_t)NS * k, &s), *B = rand_buf((size_t)n * k, &s);
    float *C = malloc(sizeof(float) * (size_t)NS * n);
    kvrt_cpu_expmm *held = kvrt_cpu_expmm_get(1, n, k, n, 0.5f);
    cr_assert_not_null(held);
    for (int m = 2; m <= NS; m++) {
        kvrt_cpu_expmm *p = kvrt_cpu_expmm_get(m, n, k, n, 0.5f);
        cr_assert_not_null(p, "shape %d", m);
        void *scr = malloc(kvrt_cpu_expmm_scratch_bytes(p) + 64);
        kvrt_cpu_expmm_run(p, A, B, C, scr);
        double z = 0;
        for (int x = 0; x < k; x++) z += (double)A[(m - 1) * k + x] * B[x];
        const double want = exp(0.5 * z);
        cr_assert(fabs(C[(m - 1) * n] - want) <= 1e-5 * want, "shape %d: %g, expected %g", m,
                  (double)C[(m - 1) * n], want);
        free(scr);
        kvrt_cpu_expmm_put(p);
    }
    cr_expect_eq(kvrt_cpu_expmm_get(1, n, k, n, 0.5f), held, "a held primitive was evicted");
    kvrt_cpu_expmm_put(held);
    kvrt_cpu_expmm_put(held);
    kvrt_cpu_expmm *again = kvrt_cpu_expmm_get(2, n, k, n, 0.5f); /* evicted: built again */
    cr_assert_not_null(again);
    kvrt_cpu_expmm_put(again);
    free(A); free(B); free(C);
}

/* kvrt_cpu_scratch_alloc / _free: a freed large buffer serves the next request that fits (no
 * fresh page faults per call), two live buffers are distinct, small requests are plain malloc,
 * and more frees than the cache keeps release the rest (LeakSanitizer checks that in SAN runs). */
Test(blas, scratch_buffers_are_reused) {
    kvrt_ctx *live = NULL; /* buffers are kept only while a CPU context lives */
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &live, &err), KVRT_OK, "%s", err.msg);
    const size_t big = (size_t)8 << 20;
    unsigned char *a = kvrt_cpu_scratch_alloc(big);
    cr_assert_not_null(a);
    cr_assert_eq((uintptr_t)a % ((size_t)2 << 20), 0, "not 2 MiB aligned");
    memset(a, 7, big);
    kvrt_cpu_scratch_free(a, big);
    unsigned char *b = kvrt_cpu_scratch_alloc(big - 4096); /* fits the kept buffer */
    cr_assert_eq(b, a, "the kept buffer was not reused");
    unsigned char *c = kvrt_cpu_scratch_alloc(big);        /* b is in use: a new one */
    cr_assert_not_null(c);
    cr_assert_neq(c, b);
    kvrt_cpu_scratch_free(b, big - 4096);
    kvrt_cpu_scratch_free(c, big);
    /* a kept buffer handed to a much smaller request is counted at its own size when it comes
     * back (counted at the request's, the kept total could pass its cap many times over) */
    const size_t before = kvrt_cpu_scratch_kept_bytes();
    unsigned char *sm = kvrt_cpu_scratch_alloc((size_t)2 << 20);
    cr_assert(sm == a || sm == c, "a kept buffer serves the small request");
    kvrt_cpu_scratch_free(sm, (size_t)2 << 20);
    cr_expect_eq(kvrt_cpu_scratch_kept_bytes(), before, "kept %zu, was %zu",
                 kvrt_cpu_scratch_kept_bytes(), before);
    void *many[10]; /* more than the 256 MiB the cache keeps */
    for (int i = 0; i < 10; i++) {
        many[i] = kvrt_cpu_scratch_alloc(big * (size_t)(i + 1));
        cr_assert_not_null(many[i]);
    }
    for (int i = 0; i < 10; i++) kvrt_cpu_scratch_free(many[i], big * (size_t)(i + 1));
    void *s = kvrt_cpu_scratch_alloc(100); /* below the threshold: malloc'ed, freed at once */
    cr_assert_not_null(s);
    kvrt_cpu_scratch_free(s, 100);
    kvrt_cpu_scratch_free(NULL, big);
    kvrt_ctx_free(live);
}

/* The kept buffers go back to the system when the last CPU context is freed (a server that is
 * done with libkvrt holds none of its scratch), not while another context lives. */
Test(blas, scratch_released_with_the_last_cpu_context) {
    kvrt_ctx *a = NULL, *b = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &a, &err), KVRT_OK, "%s", err.msg);
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &b, &err), KVRT_OK, "%s", err.msg);
    const size_t big = (size_t)8 << 20;
    void *p = kvrt_cpu_scratch_alloc(big);
    cr_assert_not_null(p);
    kvrt_cpu_scratch_free(p, big);
    cr_assert_geq(kvrt_cpu_scratch_kept_bytes(), big);
    kvrt_ctx_free(a);
    cr_assert_geq(kvrt_cpu_scratch_kept_bytes(), big, "released while a context lives");
    kvrt_ctx_free(b);
    cr_assert_eq(kvrt_cpu_scratch_kept_bytes(), 0, "kept after the last context was freed");
    /* and a call that takes no context, made with none alive, keeps nothing (a concurrency audit:
     * ctx-less selections after the last free kept 69 MiB) */
    p = kvrt_cpu_scratch_alloc(big);
    cr_assert_not_null(p);
    kvrt_cpu_scratch_free(p, big);
    cr_assert_eq(kvrt_cpu_scratch_kept_bytes(), 0, "kept with no context alive");
}

/* Holds of OpenBLAS at one thread are counted process-wide: with two holds open (two threads of
 * a serving program inside libkvrt at once), ending the first keeps the count at one until the
 * second ends, and then the count from before the first comes back. Inside an active parallel
 * region a hold leaves the count alone. */
int openblas_get_num_threads(void);
void openblas_set_num_threads(int n);
Test(blas, openblas_holds_are_counted) {
    const int before = openblas_get_num_threads();
    openblas_set_num_threads(2);
    cr_assert_eq(openblas_get_num_threads(), 2, "OpenBLAS took no second thread");
    const int a = kvrt_cpu_openblas_hold();
    cr_assert_eq(openblas_get_num_threads(), 1);
    const int b = kvrt_cpu_openblas_hold();
    kvrt_cpu_openblas_restore(a);
    cr_assert_eq(openblas_get_num_threads(), 1, "the first restore ended the second hold too");
    kvrt_cpu_openblas_restore(b);
    cr_assert_eq(openblas_get_num_threads(), 2);
    int inside = -1, count = -1, active = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        {
            active = omp_in_parallel();
            inside = kvrt_cpu_openblas_hold();
            count = openblas_get_num_threads();
            kvrt_cpu_openblas_restore(inside);
        }
    }
    if (active) { /* the region got two threads */
        cr_assert_eq(inside, 0, "a hold inside a parallel region changed the count");
        cr_assert_eq(count, 2);
    }
    cr_assert_eq(openblas_get_num_threads(), 2);
    openblas_set_num_threads(before);
}

/* The small attention kernels over 2-byte rows give the same bits with the widening scratch
 * (groups of keys widened into it) and without (widened as loaded), for several rows. */
Test(blas, att_small_kernels_same_bits_with_and_without_scratch) {
    if (!kvrt_cpu_att_small_ok(8)) cr_skip_test("no AVX2 + FMA + F16C: the kernels are not used");
    const int64_t R = 4, d = 72, nb = 45, ld = 80;
    uint64_t s = 3;
    float *q = malloc(sizeof(float) * R * d), *p = malloc(sizeof(float) * R * nb);
    uint16_t *kv = malloc(sizeof(uint16_t) * nb * ld);
    float *s1 = malloc(sizeof(float) * R * nb), *s2 = malloc(sizeof(float) * R * nb);
    float *a1 = calloc((size_t)(R * d), sizeof(float)), *a2 = calloc((size_t)(R * d), sizeof(float));
    float *wb = malloc(sizeof(float) * KVRT_ATT_WIDEN_FLOATS(d));
    for (int64_t i = 0; i < R * d; i++) q[i] = rng_uniform(&s, -0.5f, 0.5f);
    for (int64_t i = 0; i < R * nb; i++) p[i] = rng_uniform(&s, 0.0f, 1.0f);
    for (int dt = KVRT_DTYPE_F16; dt <= KVRT_DTYPE_BF16; dt++) {
        for (int64_t i = 0; i < nb * ld; i++) {
            const float x = rng_uniform(&s, -2.0f, 2.0f);
            kv[i] = dt == KVRT_DTYPE_F16 ? kvrt_f32_to_f16(x) : kvrt_f32_to_bf16(x);
        }
        kvrt_cpu_att_qk_small(q, R, d, dt, kv, ld, nb, 0.3f, s1, NULL);
        kvrt_cpu_att_qk_small(q, R, d, dt, kv, ld, nb, 0.3f, s2, wb);
        cr_assert(memcmp(s1, s2, sizeof(float) * R * nb) == 0, "dtype %d: scores", dt);
        kvrt_cpu_att_pv_small(p, R, nb, dt, kv, ld, d, a1, NULL);
        kvrt_cpu_att_pv_small(p, R, nb, dt, kv, ld, d, a2, wb);
        cr_assert(memcmp(a1, a2, sizeof(float) * R * d) == 0, "dtype %d: P V", dt);
    }
    free(q); free(p); free(kv); free(s1); free(s2); free(a1); free(a2); free(wb);
}
