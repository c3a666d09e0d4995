/*
 * test_threads.c: Criterion tests of libkvrt used from several threads, as kvrt.h's thread rules
 * state them: a CPU context shared by threads keeps every thread's kvrt_last_error() its own,
 * and a context's n_threads bounds the OpenMP teams of the ops it runs (not the process's
 * OMP_NUM_THREADS). From a concurrency audit (2026-12-07), whose reproducers failed on the old
 * code: ~25% of the thread-local messages were the other thread's or torn; a "CPU (1 thread)"
 * context ran Attention Matching and SnapKV on every core.
 */
#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvrt_experimental.h"
#include "test_rng.h"

static kvrt_ctx *shared;
static atomic_long wrong;

/* thread 0: kvrt_attend with NaN in q; thread 1: kvrt_softmax_rows with an infinite scale */
static void *fail_loop(void *arg) {
    const int id = (int)(intptr_t)arg;
    const char *want = id ? "kvrt_softmax_rows" : "kvrt_attend";
    float q[2 * 8] = {0}, out[2 * 8], x[16] = {0};
    q[3] = NAN;
    int64_t counts[1] = {2};
    kvrt_cache *c = NULL;
    if (kvrt_cache_create(1, 8, KVRT_DTYPE_F32, counts, &c) != KVRT_OK) return NULL;
    memset(c->keys, 0, sizeof(float) * 16);
    memset(c->values, 0, sizeof(float) * 16);
    int64_t shape[2] = {4, 4};
    kvrt_tensor t = kvrt_tensor_view(x, KVRT_DTYPE_F32, 2, shape, KVRT_DEVICE_HOST);
    for (int i = 0; i < 20000; i++) {
        const int rc = id ? kvrt_softmax_rows(shared, &t, &t, INFINITY)
                          : kvrt_attend(shared, q, 2, 1, c, NULL, NULL, 0, 1.0f, out, NULL);
        const kvrt_error *e = kvrt_last_error();
        if (rc == KVRT_OK || strncmp(e->msg, want, strlen(want)) != 0 || e->code != rc)
            atomic_fetch_add(&wrong, 1);
    }
    kvrt_cache_free(c);
    return NULL;
}

Test(threads, shared_cpu_context_keeps_each_threads_error) {
    kvrt_error err;
    kvrt_ctx_options o = {1, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &shared, &err), KVRT_OK, "%s", err.msg);
    pthread_t a, b;
    cr_assert_eq(pthread_create(&a, NULL, fail_loop, (void *)(intptr_t)0), 0);
    cr_assert_eq(pthread_create(&b, NULL, fail_loop, (void *)(intptr_t)1), 0);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    cr_expect_eq(atomic_load(&wrong), 0, "%ld of 40000 thread-local errors were another call's",
                 atomic_load(&wrong));
    /* the context's own last error is one of the two calls' */
    const char *m = kvrt_ctx_last_error(shared)->msg;
    cr_expect(strncmp(m, "kvrt_attend", 11) == 0 || strncmp(m, "kvrt_softmax_rows", 17) == 0,
              "%s", m);
    kvrt_ctx_free(shared);
}

static int os_threads(void) {
    DIR *d = opendir("/proc/self/task");
    if (d == NULL) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* One layer of uniform [-1, 1) q [T, H, D], k, v [T, HKV, D] from seed (freed by the caller). */
enum { T = 512, H = 4, HKV = 2, D = 32 };
static void random_layer(uint64_t s, float **q, float **k, float **v) {
    *q = malloc(sizeof(float) * T * H * D);
    *k = malloc(sizeof(float) * T * HKV * D);
    *v = malloc(sizeof(float) * T * HKV * D);
    cr_assert(*q && *k && *v);
    for (int i = 0; i < T * H * D; i++) (*q)[i] = rng_uniform(&s, -1, 1);
    for (int i = 0; i < T * HKV * D; i++) {
        (*k)[i] = rng_uniform(&s, -1, 1);
        (*v)[i] = rng_uniform(&s, -1, 1);
    }
}

/* With the process's OpenMP default at 4 threads, a 1-thread context's Attention Matching and
 * SnapKV scores start no thread (libgomp's team would be 3 more), and the caller's own setting
 * is unchanged after each call. */
Test(threads, context_thread_count_bounds_the_ops) {
    omp_set_num_threads(4);
    kvrt_ctx *c1 = NULL;
    kvrt_error err;
    kvrt_ctx_options o = {1, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &c1, &err), KVRT_OK, "%s", err.msg);
    float *q, *k, *v;
    random_layer(5, &q, &k, &v);
    const int before = os_threads();
    cr_assert_gt(before, 0);
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_am_compact_layer(c1, NULL, q, k, v, T, H, HKV, D, NULL, 0.2, KVRT_DTYPE_F32,
                                       &c, NULL), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_cache_free(c);
    cr_expect_eq(omp_get_max_threads(), 4, "the caller's OpenMP setting changed");
    cr_expect_eq(os_threads(), before, "AM on a 1-thread context started %d threads",
                 os_threads() - before);
    kvrt_compilerkv_prompt *p = NULL;
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, 32, &p), KVRT_OK);
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer_ctx(c1, p, q, k, H, HKV, D), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    kvrt_compilerkv_prompt_free(p);
    cr_expect_eq(omp_get_max_threads(), 4);
    cr_expect_eq(os_threads(), before, "a 1-thread context started %d threads",
                 os_threads() - before);
    kvrt_ctx_free(c1);
    free(q); free(k); free(v);
}

/* Waits for a forked child: it must exit 0 (SIGALRM: it hung). */
static void check_child(pid_t pid) {
    int st = 0;
    pid_t w;
    while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR) {
    }
    cr_assert_eq(w, pid);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child %s",
              WIFSIGNALED(st) ? (WTERMSIG(st) == SIGALRM ? "hung (killed by its alarm)"
                                                          : "was killed by a signal")
                              : "gave other bits or failed");
}

/* The same after a context-less call only (the window mass's value norms open an OpenMP region
 * with no context made: the child hung until those paths were counted too, a review). */
Test(threads, a_forked_child_after_a_context_less_call) {
    omp_set_num_threads(2);
    const int64_t NT = 4096;
    const uint32_t NKV = 2, ND = 64;
    float *v = malloc(sizeof(float) * NT * NKV * ND), *a = malloc(sizeof(float) * NT * NKV),
          *b = malloc(sizeof(float) * NT * NKV);
    cr_assert(v && a && b);
    uint64_t s = 3;
    for (int64_t i = 0; i < NT * NKV * ND; i++) v[i] = rng_uniform(&s, -1, 1);
    cr_assert_eq(kvrt_compilerkv_value_norms(v, NT, NKV, ND, a), KVRT_OK);
    const pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        alarm(120);
        const int ok = kvrt_compilerkv_value_norms(v, NT, NKV, ND, b) == KVRT_OK &&
                       memcmp(a, b, sizeof(float) * NT * NKV) == 0;
        _exit(ok ? 0 : 1);
    }
    check_child(pid);
    free(v); free(a); free(b);
}

/* A child forked after the parent ran a 2-thread AM compaction runs the same call to the same
 * bits (on one thread) instead of hanging in GNU OpenMP's pool, which fork does not copy (the
 * audit's reproducer hung; a Python multiprocessing pool with the default fork did too). */
Test(threads, a_forked_child_runs_instead_of_hanging) {
    float *q, *k, *v;
    random_layer(9, &q, &k, &v);
    kvrt_ctx *c2 = NULL;
    kvrt_error err;
    kvrt_ctx_options o = {2, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &c2, &err), KVRT_OK, "%s", err.msg);
    kvrt_cache *a = NULL;
    cr_assert_eq(kvrt_am_compact_layer(c2, NULL, q, k, v, T, H, HKV, D, NULL, 0.2, KVRT_DTYPE_F32,
                                       &a, NULL), KVRT_OK, "%s", kvrt_last_error()->msg);
    const pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        alarm(120); /* a hang ends the child (SIGALRM), not the suite */
        kvrt_cache *b = NULL;
        int ok = kvrt_am_compact_layer(c2, NULL, q, k, v, T, H, HKV, D, NULL, 0.2,
                                       KVRT_DTYPE_F32, &b, NULL) == KVRT_OK &&
                 b->n_entries == a->n_entries &&
                 memcmp(b->values, a->values, sizeof(float) * (size_t)(a->n_entries * D)) == 0;
        _exit(ok ? 0 : 1);
    }
    check_child(pid);
    kvrt_cache_free(a);
    kvrt_ctx_free(c2);
    free(q); free(k); free(v);
}
