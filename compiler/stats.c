/*
 * stats.c: the compiler's statistics and timing helpers (see stats.h).
 * Callers: the passes (compiler/passes/), kvcc eval, compiler/progress.c, tests/unit/test_cql.c.
 *
 * defines: kvcc_now_s, kvcc_rng_mix, kvcc_cmp_double, kvcc_quantile7, kvcc_spearman
 */
#include "stats.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

double kvcc_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

uint64_t kvcc_rng_mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
    uint64_t s = seed;
    uint64_t h = kvrt_rng_next(&s);
    s = h ^ (a * 0xD6E8FEB86659FD93ull);
    h = kvrt_rng_next(&s);
    s = h ^ (b * 0xA0761D6478BD642Full);
    h = kvrt_rng_next(&s);
    s = h ^ (c * 0xE7037ED1A0B428DBull);
    return kvrt_rng_next(&s);
}

int kvcc_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvcc_quantile7(const double *x, size_t n, double f) {
    double h = (double)(n - 1) * f;
    size_t lo = (size_t)floor(h);
    if (lo + 1 >= n) return x[n - 1];
    return x[lo] + (h - (double)lo) * (x[lo + 1] - x[lo]);
}

// ----------------------------------------------------------------------------
// Spearman rank correlation (average ranks for ties)

typedef struct {
    double v;
    size_t i;
} rank_item;

static int cmp_rank_item(const void *a, const void *b) {
    const rank_item *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* r [n] = 1-based ranks of x, ties get their mean rank. */
static void avg_ranks(const double *x, size_t n, rank_item *tmp, double *r) {
    for (size_t i = 0; i < n; i++) tmp[i] = (rank_item){x[i], i};
    qsort(tmp, n, sizeof *tmp, cmp_rank_item);
    for (size_t a = 0; a < n;) {
        size_t b = a + 1;
        while (b < n && tmp[b].v == tmp[a].v) b++;
        const double mean = 0.5 * (double)(a + 1 + b); /* mean of ranks a+1 .. b */
        for (size_t j = a; j < b; j++) r[tmp[j].i] = mean;
        a = b;
    }
}

int kvcc_spearman(const double *x, const double *y, size_t n, double *rho) {
    *rho = NAN;
    for (size_t i = 0; i < n; i++)
        if (isnan(x[i]) || isnan(y[i])) return -1;
    if (n < 2) return 0;
    rank_item *tmp = malloc(n * sizeof *tmp);
    double *rx = malloc(n * sizeof *rx), *ry = malloc(n * sizeof *ry);
    if (!tmp || !rx || !ry) {
        free(tmp); free(rx); free(ry);
        return -1;
    }
    avg_ranks(x, n, tmp, rx);
    avg_ranks(y, n, tmp, ry);
    const double mean = 0.5 * (double)(n + 1); /* the mean of average ranks is always (n+1)/2 */
    double sxy = 0.0, sxx = 0.0, syy = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double a = rx[i] - mean, b = ry[i] - mean;
        sxy += a * b;
        sxx += a * a;
        syy += b * b;
    }
    if (sxx > 0 && syy > 0) *rho = sxy / sqrt(sxx * syy);
    free(tmp); free(rx); free(ry);
    return 0;
}
