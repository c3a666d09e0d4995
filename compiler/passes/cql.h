/*
 * cql.h: horizon-1 conservative Q-learning on a tabular Q[s, a] (docs/policies/compilerkv.md,
 * "The offline calibration", horizon-1 conservative Q-learning). Retention is a one-step contextual bandit, so there is no
 * bootstrap: minimize over experience records (s, a, r)
 *     c * (logsumexp_a' Q[s, a'] - Q[s, a]) + 0.5 * (Q[s, a] - r)^2
 * with AdamW on state-balanced minibatches, then read the table off by argmax.
 * Callers: compiler/passes/compilerkv.c (head and gate tables, the reward and transfer reports),
 * tests/unit/test_cql.c.
 *
 * defines: kvcc_cql_opts_default, kvcc_cql_fit, kvcc_cql_argmax (its RNG: kvrt_rng.h)
 */
#ifndef KVCC_CQL_H
#define KVCC_CQL_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t state;   /* 0 .. n_states-1 */
    uint32_t action;  /* 0 .. n_actions-1 */
    float reward;
} kvcc_cql_record;

typedef struct {
    double lr;            /* AdamW learning rate (3e-4) */
    double weight_decay;  /* decoupled weight decay (0.01) */
    double beta1, beta2, eps; /* Adam moments (0.9, 0.999, 1e-8) */
    double c;             /* conservative weight (0.75) */
    uint32_t batch;       /* records per step (4096) */
    uint32_t epochs;      /* passes: steps = epochs * ceil(n / batch) (10) */
    uint32_t min_steps;   /* (kvcc) at least this many steps (5000): a tabular Q moves at most
                           * ~lr per step, so 10 epochs of a few thousand records (a few dozen
                           * steps) would leave it at its initial value */
    int standardize;      /* (kvcc, 1) rewards minus their state's mean, divided by the pooled
                           * within-state standard deviation: puts the squared term on the
                           * scale the weight c assumes; argmax is invariant to the per-state shift */
    uint64_t seed;
    int exact;            /* (kvcc, 0) 1: the objective's minimizer per state by Newton's method
                           * instead of AdamW minibatches (no sampling, no weight decay): the
                           * tables stop depending on the seed's minibatch order */
} kvcc_cql_opts;

typedef struct {
    uint64_t steps;
    double reward_scale;  /* the pooled within-state std divided out (1 when not standardized) */
    double final_loss;    /* mean loss of the last minibatch */
    uint32_t states_with_data;
} kvcc_cql_info;

void kvcc_cql_opts_default(kvcc_cql_opts *o);

/* Fit Q [n_states, n_actions] (written; starts at 0). Sampling: a state uniformly among the
 * states with records, then one of its records uniformly (= weights inversely proportional to
 * the state's record count), from a splitmix64 stream seeded by o->seed. Single-threaded, fixed
 * accumulation order: the result is bit-identical for identical inputs.
 * Returns 0, or -1 with a message in err (bad arguments, out of memory). */
int kvcc_cql_fit(const kvcc_cql_record *rec, size_t n_rec, uint32_t n_states, uint32_t n_actions,
                 const kvcc_cql_opts *o, float *Q, kvcc_cql_info *info, char *err, size_t errlen);

/* best [n_states]: argmax over the actions with support[s, a] > 0 (support [n_states,
 * n_actions] record counts; NULL: all actions); exact ties go to `fallback`, then to the lower
 * index. States without any support get `fallback` (the conservative action). */
void kvcc_cql_argmax(const float *Q, const uint32_t *support, uint32_t n_states,
                     uint32_t n_actions, uint32_t fallback, uint32_t *best);

#endif
