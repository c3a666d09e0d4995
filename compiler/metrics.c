/*
 * metrics.c: the fidelity measures of the passes and kvcc eval (see metrics.h).
 * Callers: compiler/passes/am.c, compiler/passes/compilerkv_reward.c, kvcc eval.
 *
 * defines: kvcc_relerr, kvcc_logsumexp_row, kvcc_nll_token, kvcc_logprob_token
 */
#include "metrics.h"

#include <math.h>

#include "model.h" /* kvcc_logsumexp */

double kvcc_relerr(const float *a, const float *b, uint32_t d) {
    double num = 0, den = 0;
    for (uint32_t x = 0; x < d; x++) {
        num += ((double)a[x] - b[x]) * ((double)a[x] - b[x]);
        den += (double)b[x] * b[x];
    }
    return sqrt(num) / (sqrt(den) + 1e-30);
}

double kvcc_logsumexp_row(const float *row, int V, float *mx) {
    return kvcc_logsumexp(row, V, mx); /* calib/model.c: vectorized float exp, double sums */
}

double kvcc_nll_token(const float *row, int V, int32_t tok) {
    float mx;
    const double lz = kvcc_logsumexp_row(row, V, &mx);
    return lz + mx - row[tok];
}

double kvcc_logprob_token(const float *row, int V, int32_t tok) {
    float mx;
    const double lz = kvcc_logsumexp_row(row, V, &mx);
    return (double)row[tok] - mx - lz;
}
