/*
 * cql.c: horizon-1 conservative Q-learning on a tabular Q (see cql.h for the objective and the
 * choices). Callers: compiler/passes/compilerkv.c, tests/unit/test_cql.c.
 *
 * defines: kvcc_cql_opts_default, kvcc_cql_fit, kvcc_cql_argmax
 *
 * One step: draw `batch` records state-balanced; for each state s drawn n_s times in the batch
 * the conservative term contributes c * n_s * softmax(Q[s, :]) to the gradient of its row, each
 * record (s, a, r) contributes (-c + Q[s, a] - r) to Q[s, a]; the sum is divided by the batch
 * size. AdamW (decoupled weight decay, bias-corrected moments) then updates every row of a state
 * that has records (rows of states without records never receive a gradient and are not used:
 * their table cells fall back). Everything runs in one thread in a fixed order, in double.
 */
#include "cql.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_rng.h"

void kvcc_cql_opts_default(kvcc_cql_opts *o) {
    memset(o, 0, sizeof *o);
    o->lr = 3e-4;
    o->weight_decay = 0.01;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->c = 0.75;
    o->batch = 4096;
    o->epochs = 10;
    o->min_steps = 5000;
    o->standardize = 1;
    o->seed = 1;
}

/* The exact minimizer of the objective the AdamW loop samples, per state s with N records:
 *   L_s(Q) = sum_a (n_a / N) (1/2 (Q_a - rbar_a)^2 - c Q_a) + c log sum_a exp(Q_a),
 * the actions a with n_a > 0 (the others' Q goes to -inf: they are left at -1e30 and never
 * argmax, having no support). Strictly convex: Newton's method with a backtracking line search
 * from Q = rbar; the Hessian diag(w + c p) - c p p^T is solved by Sherman-Morrison. Every action
 * is treated by the same elementwise arithmetic, so actions with equal (n_a, rbar_a) get equal Q
 * bit for bit. Returns the Newton iterations summed over the states. */
static uint64_t cql_exact(const kvcc_cql_record *rec, const size_t *order, const size_t *start,
                          const double *rw, const uint32_t *active, uint32_t n_active,
                          uint32_t n_actions, double c, double *q) {
    uint64_t iters = 0;
    double *w = malloc(sizeof(double) * n_actions * 6);
    if (!w) return 0;
    double *rb = w + n_actions, *p = rb + n_actions, *g = p + n_actions, *dl = g + n_actions,
           *qn = dl + n_actions;
    for (uint32_t ai = 0; ai < n_active; ai++) {
        const uint32_t s = active[ai];
        double *qs = q + (size_t)s * n_actions;
        const double N = (double)(start[s + 1] - start[s]);
        for (uint32_t a = 0; a < n_actions; a++) w[a] = rb[a] = 0;
        for (size_t j = start[s]; j < start[s + 1]; j++) {
            const uint32_t a = rec[order[j]].action;
            w[a] += 1.0;
            rb[a] += rw[j];
        }
        for (uint32_t a = 0; a < n_actions; a++) {
            if (w[a] > 0) rb[a] /= w[a];
            w[a] /= N;
            qs[a] = w[a] > 0 ? rb[a] : -1e30;
        }
#define CQL_OBJ(Q, out)                                                                         \
    do {                                                                                        \
        double mx_ = -INFINITY, z_ = 0, f_ = 0;                                                 \
        for (uint32_t a = 0; a < n_actions; a++)                                                \
            if (w[a] > 0 && (Q)[a] > mx_) mx_ = (Q)[a];                                         \
        for (uint32_t a = 0; a < n_actions; a++)                                                \
            if (w[a] > 0) {                                                                     \
                z_ += exp((Q)[a] - mx_);                                                        \
                f_ += w[a] * (0.5 * ((Q)[a] - rb[a]) * ((Q)[a] - rb[a]) - c * (Q)[a]);          \
            }                                                                                   \
        (out) = f_ + c * (mx_ + log(z_));                                                       \
    } while (0)
        double f;
        CQL_OBJ(qs, f);
        for (int it = 0; it < 100; it++) {
            double mx = -INFINITY, z = 0, gmax = 0;
            for (uint32_t a = 0; a < n_actions; a++)
                if (w[a] > 0 && qs[a] > mx) mx = qs[a];
            for (uint32_t a = 0; a < n_actions; a++) z += (p[a] = w[a] > 0 ? exp(qs[a] - mx) : 0);
            for (uint32_t a = 0; a < n_actions; a++) {
                p[a] /= z;
                g[a] = w[a] > 0 ? w[a] * (qs[a] - rb[a] - c) + c * p[a] : 0;
                gmax = fabs(g[a]) > gmax ? fabs(g[a]) : gmax;
            }
            if (gmax < 1e-13) break;
            iters++;
            /* (A - c p p^T)^-1 g with A = diag(w + c p): A^-1 g + A^-1 p (c p^T A^-1 g) / (1 - c p^T A^-1 p) */
            double pg = 0, pp = 0;
            for (uint32_t a = 0; a < n_actions; a++)
                if (w[a] > 0) {
                    const double d = w[a] + c * p[a];
                    pg += p[a] * g[a] / d;
                    pp += p[a] * p[a] / d;
                }
            const double k = c * pg / (1.0 - c * pp);
            for (uint32_t a = 0; a < n_actions; a++)
                dl[a] = w[a] > 0 ? (g[a] + k * p[a]) / (w[a] + c * p[a]) : 0;
            double dec = 0; /* the Newton decrement g . dl */
            for (uint32_t a = 0; a < n_actions; a++) dec += g[a] * dl[a];
            double t = 1.0, fn = f;
            for (int ls = 0; ls < 60; ls++, t *= 0.5) { /* Armijo backtracking */
                for (uint32_t a = 0; a < n_actions; a++) qn[a] = w[a] > 0 ? qs[a] - t * dl[a] : qs[a];
                CQL_OBJ(qn, fn);
                if (fn <= f - 1e-4 * t * dec) break;
            }
            if (!(fn < f)) break; /* no decrease left at double precision: converged */
            memcpy(qs, qn, sizeof(double) * n_actions);
            f = fn;
        }
#undef CQL_OBJ
    }
    free(w);
    return iters;
}

int kvcc_cql_fit(const kvcc_cql_record *rec, size_t n_rec, uint32_t n_states, uint32_t n_actions,
                 const kvcc_cql_opts *o, float *Q, kvcc_cql_info *info, char *err, size_t errlen) {
    if (!o || !Q || n_states == 0 || n_actions == 0 || (n_rec && !rec) || o->batch == 0 ||
        !(o->lr > 0) || !(o->c >= 0)) {
        snprintf(err, errlen, "cql: bad arguments (states %u, actions %u, batch %u, lr %g, c %g)",
                 n_states, n_actions, o ? o->batch : 0, o ? o->lr : 0.0, o ? o->c : 0.0);
        return -1;
    }
    const size_t SA = (size_t)n_states * n_actions;
    for (size_t i = 0; i < SA; i++) Q[i] = 0.0f;
    kvcc_cql_info inf = {.reward_scale = 1.0};
    for (size_t i = 0; i < n_rec; i++)
        if (rec[i].state >= n_states || rec[i].action >= n_actions || !isfinite(rec[i].reward)) {
            snprintf(err, errlen, "cql: record %zu: state %u / action %u / reward %g out of range",
                     i, rec[i].state, rec[i].action, (double)rec[i].reward);
            return -1;
        }
    if (n_rec == 0) {
        if (info) *info = inf;
        return 0;
    }
    /* records grouped by state (counting sort keeps the input order within a state) */
    size_t *start = calloc((size_t)n_states + 1, sizeof *start);
    size_t *order = malloc(n_rec * sizeof *order);
    double *rw = malloc(n_rec * sizeof *rw);          /* rewards used, by grouped index */
    double *q = calloc(SA, sizeof *q), *m = calloc(SA, sizeof *m), *v = calloc(SA, sizeof *v);
    double *g = calloc(SA, sizeof *g);
    uint32_t *active = malloc((size_t)n_states * sizeof *active);
    uint32_t *bcount = calloc(n_states, sizeof *bcount);
    uint32_t *touched = malloc((size_t)n_states * sizeof *touched);
    size_t *bsamp = malloc((size_t)o->batch * sizeof *bsamp);
    double *p = malloc((size_t)n_actions * sizeof *p);
    int rc = 0;
    if (!start || !order || !rw || !q || !m || !v || !g || !active || !bcount || !touched || !bsamp || !p) {
        snprintf(err, errlen, "cql: out of memory (%u states x %u actions, %zu records)", n_states, n_actions, n_rec);
        rc = -1;
        goto done;
    }
    for (size_t i = 0; i < n_rec; i++) start[rec[i].state + 1]++;
    for (uint32_t s = 0; s < n_states; s++) start[s + 1] += start[s];
    {
        size_t *fill = malloc((size_t)n_states * sizeof *fill);
        if (!fill) {
            snprintf(err, errlen, "cql: out of memory");
            rc = -1;
            goto done;
        }
        memcpy(fill, start, (size_t)n_states * sizeof *fill);
        for (size_t i = 0; i < n_rec; i++) order[fill[rec[i].state]++] = i;
        free(fill);
    }
    uint32_t n_active = 0;
    for (uint32_t s = 0; s < n_states; s++)
        if (start[s + 1] > start[s]) active[n_active++] = s;
    inf.states_with_data = n_active;
    /* rewards: standardized within state (pooled scale) */
    {
        double ss = 0.0;
        for (uint32_t ai = 0; ai < n_active; ai++) {
            uint32_t s = active[ai];
            double mean = 0.0;
            for (size_t j = start[s]; j < start[s + 1]; j++) mean += rec[order[j]].reward;
            mean /= (double)(start[s + 1] - start[s]);
            for (size_t j = start[s]; j < start[s + 1]; j++) {
                rw[j] = o->standardize ? rec[order[j]].reward - mean : rec[order[j]].reward;
                ss += (rec[order[j]].reward - mean) * (rec[order[j]].reward - mean);
            }
        }
        double sd = sqrt(ss / (double)n_rec);
        if (o->standardize && sd > 1e-12) {
            inf.reward_scale = sd;
            for (size_t j = 0; j < n_rec; j++) rw[j] /= sd;
        }
    }
    if (o->exact) {
        inf.steps = cql_exact(rec, order, start, rw, active, n_active, n_actions, o->c, q);
        goto finish;
    }
    const uint64_t per_epoch = (n_rec + o->batch - 1) / o->batch;
    uint64_t steps = (uint64_t)o->epochs * per_epoch;
    if (steps < o->min_steps) steps = o->min_steps;
    uint64_t rng = o->seed ^ 0x43514C00ull; /* "CQL" */
    double b1t = 1.0, b2t = 1.0;
    const double inv_b = 1.0 / (double)o->batch;
    for (uint64_t step = 1; step <= steps; step++) {
        /* draw the batch: a state uniformly, then one of its records */
        uint32_t n_touched = 0;
        for (uint32_t i = 0; i < o->batch; i++) {
            uint32_t s = active[kvrt_rng_below(&rng, n_active)];
            size_t j = start[s] + (size_t)kvrt_rng_below(&rng, start[s + 1] - start[s]);
            bsamp[i] = j;
            if (bcount[s]++ == 0) touched[n_touched++] = s;
        }
        double loss = 0.0;
        /* conservative term per touched state (in first-touch order) */
        for (uint32_t ti = 0; ti < n_touched; ti++) {
            uint32_t s = touched[ti];
            const double *qs = q + (size_t)s * n_actions;
            double mx = qs[0];
            for (uint32_t a = 1; a < n_actions; a++) mx = qs[a] > mx ? qs[a] : mx;
            double z = 0.0;
            for (uint32_t a = 0; a < n_actions; a++) z += (p[a] = exp(qs[a] - mx));
            const double w = o->c * bcount[s] * inv_b;
            double *gs = g + (size_t)s * n_actions;
            for (uint32_t a = 0; a < n_actions; a++) gs[a] += w * p[a] / z;
            loss += w * (mx + log(z));
        }
        for (uint32_t i = 0; i < o->batch; i++) {
            const kvcc_cql_record *r = &rec[order[bsamp[i]]];
            const size_t at = (size_t)r->state * n_actions + r->action;
            const double d = q[at] - rw[bsamp[i]];
            g[at] += (-o->c + d) * inv_b;
            loss += (-o->c * q[at] + 0.5 * d * d) * inv_b;
        }
        for (uint32_t ti = 0; ti < n_touched; ti++) bcount[touched[ti]] = 0;
        inf.final_loss = loss;
        /* AdamW over the rows of states with data */
        b1t *= o->beta1;
        b2t *= o->beta2;
        const double c1 = 1.0 / (1.0 - b1t), c2 = 1.0 / (1.0 - b2t);
        for (uint32_t ai = 0; ai < n_active; ai++) {
            const size_t base = (size_t)active[ai] * n_actions;
            for (uint32_t a = 0; a < n_actions; a++) {
                const size_t at = base + a;
                const double gr = g[at];
                g[at] = 0.0;
                m[at] = o->beta1 * m[at] + (1.0 - o->beta1) * gr;
                v[at] = o->beta2 * v[at] + (1.0 - o->beta2) * gr * gr;
                q[at] *= 1.0 - o->lr * o->weight_decay;
                q[at] -= o->lr * (m[at] * c1) / (sqrt(v[at] * c2) + o->eps);
            }
        }
    }
    inf.steps = steps;
finish:
    for (size_t i = 0; i < SA; i++) Q[i] = (float)q[i];
    if (info) *info = inf;
done:
    free(start); free(order); free(rw); free(q); free(m); free(v); free(g);
    free(active); free(bcount); free(touched); free(bsamp); free(p);
    return rc;
}

void kvcc_cql_argmax(const float *Q, const uint32_t *support, uint32_t n_states,
                     uint32_t n_actions, uint32_t fallback, uint32_t *best) {
    for (uint32_t s = 0; s < n_states; s++) {
        const float *qs = Q + (size_t)s * n_actions;
        const uint32_t *sp = support ? support + (size_t)s * n_actions : NULL;
        int64_t b = -1;
        for (uint32_t a = 0; a < n_actions; a++) {
            if (sp && sp[a] == 0) continue;
            if (b < 0 || qs[a] > qs[b] || (qs[a] == qs[b] && a == fallback)) b = a;
        }
        best[s] = b < 0 ? fallback : (uint32_t)b;
    }
}
