/*
 * dist.c: the distribution layer (see dist.h). With KVCC_WITH_MPI (USE_MPI=1) and a process
 * started by mpirun, the collectives are Open MPI's over MPI_COMM_WORLD; otherwise one rank.
 * Test hooks: KVCC_DIST_INJECT_FAIL=R:K makes rank R report a failure at its K-th kvcc_dist_check
 * (the message says so), which exercises the abort path of every rank; KVCC_DIST_GATHER_MAX=B
 * makes kvcc_dist_allgatherv take its path for gathers above MPI's 2 GiB count at B bytes.
 */
#include "dist.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVCC_WITH_MPI
#include <mpi.h>
#endif

static int inited, mpi_on, rank_, size_ = 1, local_size_ = 1;
static int saved_err = -1;     /* the original stderr of a rank > 0 */
static FILE *captured;         /* where a rank > 0 writes its stderr */
static double comm_s;
static int n_checks, inject_rank = -1, inject_at;

#ifdef KVCC_WITH_MPI
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#endif

/* Whether mpirun (Open MPI, or a PMI launcher) started this process. */
static int launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

int kvcc_dist_init(int *argc, char ***argv, char *err, size_t errlen) {
    if (inited) return 0;
    inited = 1;
    const char *inj = getenv("KVCC_DIST_INJECT_FAIL");
    if (inj && *inj) {
        int r, k;
        if (sscanf(inj, "%d:%d", &r, &k) == 2 && r >= 0 && k >= 1) inject_rank = r, inject_at = k;
    }
#ifdef KVCC_WITH_MPI
    if (launched_by_mpirun()) {
        int provided = 0;
        if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
            snprintf(err, errlen, "MPI_Init_thread failed (started by mpirun, but MPI does not "
                     "start)");
            return -1;
        }
        mpi_on = 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
        MPI_Comm_size(MPI_COMM_WORLD, &size_);
        const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        local_size_ = ls && atoi(ls) > 0 ? atoi(ls) : 1;
    }
#else
    (void)argc; (void)argv; (void)err; (void)errlen; (void)launched_by_mpirun;
#endif
    if (rank_ > 0) { /* messages and progress from rank 0 only; ours kept for a failure */
        fflush(stderr);
        captured = tmpfile();
        if (captured) {
            saved_err = dup(STDERR_FILENO);
            if (saved_err < 0 || dup2(fileno(captured), STDERR_FILENO) < 0) {
                if (saved_err >= 0) close(saved_err);
                saved_err = -1;
                fclose(captured);
                captured = NULL;
            }
        }
    }
    return 0;
}

void kvcc_dist_finalize(void) {
    if (!inited) return;
    if (saved_err >= 0) {
        fflush(stderr);
        dup2(saved_err, STDERR_FILENO);
        close(saved_err);
        saved_err = -1;
    }
    if (captured) fclose(captured);
    captured = NULL;
#ifdef KVCC_WITH_MPI
    if (mpi_on) MPI_Finalize();
#endif
    mpi_on = 0;
    inited = 0;
    rank_ = 0;
    size_ = local_size_ = 1;
}

int kvcc_dist_rank(void) { return rank_; }
int kvcc_dist_size(void) { return size_; }
int kvcc_dist_local_size(void) { return local_size_; }
int kvcc_dist_active(void) { return size_ > 1; }
double kvcc_dist_comm_seconds(void) { return comm_s; }

void kvcc_dist_shard_of(uint32_t n, int rank, int size, uint32_t *lo, uint32_t *hi) {
    const uint64_t s = (uint64_t)(size > 0 ? size : 1), r = (uint64_t)(rank < 0 ? 0 : rank);
    *lo = (uint32_t)(r * n / s);
    *hi = (uint32_t)((r + 1) * n / s);
}

void kvcc_dist_shard(uint32_t n, uint32_t *lo, uint32_t *hi) {
    kvcc_dist_shard_of(n, rank_, size_, lo, hi);
}

/* src into dst (n bytes), cut to fit. */
static void copy_str(char *dst, size_t n, const char *src) {
    if (!n) return;
    size_t k = strlen(src);
    if (k >= n) k = n - 1;
    memcpy(dst, src, k);
    dst[k] = 0;
}

/* The last non-empty line this rank wrote to its captured stderr (rank > 0), into out. */
static void captured_tail(char *out, size_t n) {
    if (!n) return;
    out[0] = 0;
    if (!captured) return;
    fflush(stderr);
    const int fd = fileno(captured);
    const off_t end = lseek(fd, 0, SEEK_END);
    char buf[2048];
    const off_t from = end > (off_t)sizeof buf - 1 ? end - (off_t)sizeof buf + 1 : 0;
    const ssize_t got = end > 0 ? pread(fd, buf, (size_t)(end - from), from) : 0;
    if (got <= 0) return;
    size_t k = (size_t)got;
    while (k && (buf[k - 1] == '\n' || buf[k - 1] == '\r')) k--;
    buf[k] = 0;
    const char *line = strrchr(buf, '\n');
    copy_str(out, n, line ? line + 1 : buf);
}

int kvcc_dist_check(int rc, char *err, size_t errlen) {
    n_checks++;
    char own[1024];
    if (!rc && rank_ == inject_rank && n_checks == inject_at) {
        rc = 5; /* KVCC_EXIT_FAILED */
        snprintf(own, sizeof own, "injected failure at check %d (KVCC_DIST_INJECT_FAIL=%d:%d)",
                 n_checks, inject_rank, inject_at);
    } else if (rc) {
        if (err && errlen && err[0]) copy_str(own, sizeof own, err);
        else captured_tail(own, sizeof own);
        if (!own[0]) snprintf(own, sizeof own, "failed with status %d (no message)", rc);
    }
    if (!mpi_on || size_ == 1) {
        if (rc && err && errlen) copy_str(err, errlen, own);
        return rc;
    }
#ifdef KVCC_WITH_MPI
    const double t0 = now_s();
    int mine = rc ? rank_ : size_, first = size_;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int out = 0;
    if (first < size_) {
        struct { int rc; char msg[1020]; } m;
        memset(&m, 0, sizeof m);
        if (rank_ == first) {
            m.rc = rc;
            char pre[32] = "";
            if (first) snprintf(pre, sizeof pre, "rank %d: ", first);
            copy_str(m.msg, sizeof m.msg, pre);
            copy_str(m.msg + strlen(m.msg), sizeof m.msg - strlen(m.msg), own);
        }
        MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, first, MPI_COMM_WORLD);
        out = m.rc;
        if (err && errlen) copy_str(err, errlen, m.msg);
    }
    comm_s += now_s() - t0;
    return out;
#else
    return rc;
#endif
}

int kvcc_dist_gather_rows(void *rows, size_t row_bytes, uint32_t n, char *err, size_t errlen) {
    if (!mpi_on || size_ == 1 || n == 0 || row_bytes == 0) return 0;
#ifdef KVCC_WITH_MPI
    if (row_bytes > (size_t)0x7fffffff) {
        snprintf(err, errlen, "dist: a row of %zu bytes is over MPI's 2 GiB count", row_bytes);
        return -1;
    }
    const double t0 = now_s();
    int *cnt = malloc(sizeof(int) * (size_t)size_), *dsp = malloc(sizeof(int) * (size_t)size_);
    if (!cnt || !dsp) {
        free(cnt); free(dsp);
        snprintf(err, errlen, "dist: out of memory");
        return -1;
    }
    for (int r = 0; r < size_; r++) {
        uint32_t lo, hi;
        kvcc_dist_shard_of(n, r, size_, &lo, &hi);
        cnt[r] = (int)(hi - lo);
        dsp[r] = (int)lo;
    }
    MPI_Datatype row;
    int s = MPI_Type_contiguous((int)row_bytes, MPI_BYTE, &row);
    if (s == MPI_SUCCESS) s = MPI_Type_commit(&row);
    if (s == MPI_SUCCESS) {
        s = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rows, cnt, dsp, row, MPI_COMM_WORLD);
        MPI_Type_free(&row);
    }
    free(cnt); free(dsp);
    comm_s += now_s() - t0;
    if (s != MPI_SUCCESS) {
        snprintf(err, errlen, "dist: MPI_Allgatherv of %u rows of %zu bytes failed", n, row_bytes);
        return -1;
    }
    return 0;
#else
    (void)rows; (void)err; (void)errlen;
    return 0;
#endif
}

int kvcc_dist_allgatherv(const void *mine, size_t len, void **all, size_t *all_len, size_t *lens,
                         char *err, size_t errlen) {
    *all = NULL;
    *all_len = 0;
    if (!mpi_on || size_ == 1) {
        void *b = malloc(len ? len : 1);
        if (!b) { snprintf(err, errlen, "dist: out of memory for %zu bytes", len); return -1; }
        if (len) memcpy(b, mine, len);
        *all = b;
        *all_len = len;
        if (lens) lens[0] = len;
        return 0;
    }
#ifdef KVCC_WITH_MPI
    const double t0 = now_s();
    long long ml = (long long)len;
    long long *ls = malloc(sizeof(long long) * (size_t)size_);
    int *cnt = malloc(sizeof(int) * (size_t)size_), *dsp = malloc(sizeof(int) * (size_t)size_);
    int rc = 0;
    /* a few ints per rank: without them this rank cannot take part in the exchange at all */
    if (!ls || !cnt || !dsp) kvcc_dist_abort(5, "dist: out of memory for %d ranks", size_);
    MPI_Allgather(&ml, 1, MPI_LONG_LONG, ls, 1, MPI_LONG_LONG, MPI_COMM_WORLD);
    int bad = 0, any_bad = 0;
    long long tot = 0;
    for (int r = 0; r < size_; r++) tot += ls[r];
    /* MPI counts are ints: above gather_max (2^31 - 1 bytes; KVCC_DIST_GATHER_MAX lowers it for
     * tests) every rank's bytes go out as broadcasts of at most gather_max each, in rank order:
     * the same bytes in the same place either way */
    long long gather_max = 0x7fffffffLL;
    const char *gm = getenv("KVCC_DIST_GATHER_MAX");
    if (gm && atoll(gm) > 0 && atoll(gm) < gather_max) gather_max = atoll(gm);
    char *b = malloc(tot ? (size_t)tot : 1);
    bad = b == NULL;
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!any_bad && tot <= gather_max) {
        for (int r = 0, at = 0; r < size_; r++) { cnt[r] = (int)ls[r]; dsp[r] = at; at += cnt[r]; }
        if (MPI_Allgatherv(mine, (int)len, MPI_BYTE, b, cnt, dsp, MPI_BYTE, MPI_COMM_WORLD) !=
            MPI_SUCCESS)
            any_bad = 3;
    } else if (!any_bad) {
        size_t at = 0;
        for (int r = 0; !any_bad && r < size_; r++) {
            if (r == rank_ && len) memcpy(b + at, mine, len);
            for (long long off = 0; !any_bad && off < ls[r]; off += gather_max) {
                const int n = (int)(ls[r] - off < gather_max ? ls[r] - off : gather_max);
                if (MPI_Bcast(b + at + (size_t)off, n, MPI_BYTE, r, MPI_COMM_WORLD) != MPI_SUCCESS)
                    any_bad = 3;
            }
            at += (size_t)ls[r];
        }
    }
    if (any_bad) {
        snprintf(err, errlen, "dist: gathering %lld bytes from %d ranks failed (%s)", tot, size_,
                 any_bad == 3 ? "MPI_Allgatherv / MPI_Bcast" : "out of memory");
        free(b);
        rc = -1;
    } else {
        *all = b;
        *all_len = (size_t)tot;
        if (lens) for (int r = 0; r < size_; r++) lens[r] = (size_t)ls[r];
    }
    free(ls); free(cnt); free(dsp);
    comm_s += now_s() - t0;
    return rc;
#else
    return -1;
#endif
}

int kvcc_dist_bcast(void *buf, size_t len, int root, char *err, size_t errlen) {
    if (!mpi_on || size_ == 1 || len == 0) return 0;
#ifdef KVCC_WITH_MPI
    if (len > (size_t)0x7fffffff) {
        snprintf(err, errlen, "dist: a broadcast of %zu bytes is over MPI's 2 GiB count", len);
        return -1;
    }
    const double t0 = now_s();
    const int s = MPI_Bcast(buf, (int)len, MPI_BYTE, root, MPI_COMM_WORLD);
    comm_s += now_s() - t0;
    if (s != MPI_SUCCESS) { snprintf(err, errlen, "dist: MPI_Bcast failed"); return -1; }
    return 0;
#else
    (void)buf; (void)root; (void)err; (void)errlen;
    return 0;
#endif
}

int kvcc_dist_same(uint64_t v, char *err, size_t errlen) {
    if (!mpi_on || size_ == 1) return 1;
#ifdef KVCC_WITH_MPI
    const double t0 = now_s();
    unsigned long long mine = v, root = v;
    MPI_Bcast(&root, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    int diff = mine != root ? rank_ : size_, first = size_;
    MPI_Allreduce(&diff, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    comm_s += now_s() - t0;
    if (first == size_) return 1;
    snprintf(err, errlen, "rank %d was given other inputs than rank 0 (different options, or "
             "input files - corpus, texts, model - whose bytes differ: every rank must run the "
             "same command on the same files)", first);
    return 0;
#else
    (void)err; (void)errlen;
    return 1;
#endif
}

int kvcc_dist_sum_init(kvcc_dist_sum *s, size_t acc_len, size_t row_len, const uint32_t *map,
                       uint32_t n_items, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    s->acc_len = acc_len;
    s->row_len = row_len;
    s->map = map;
    kvcc_dist_shard(n_items, &s->lo, &s->hi);
    s->acc = calloc(acc_len ? acc_len : 1, sizeof(double));
    const int in_place = size_ == 1 && !map;
    if (!in_place && s->hi > s->lo)
        s->rows = calloc((size_t)(s->hi - s->lo) * (row_len ? row_len : 1), sizeof(double));
    if (!s->acc || (!in_place && s->hi > s->lo && !s->rows)) {
        snprintf(err, errlen, "out of memory for %u prompts x %zu statistics", s->hi - s->lo,
                 row_len);
        kvcc_dist_sum_free(s);
        return -1;
    }
    return 0;
}

double *kvcc_dist_sum_row(kvcc_dist_sum *s, uint32_t p) {
    if (!s->rows) return s->acc;
    return s->rows + (size_t)(p - s->lo) * s->row_len;
}

/* acc += this rank's rows, in item order. */
static void sum_replay(kvcc_dist_sum *s) {
    if (!s->rows) return;
    for (uint32_t p = s->lo; p < s->hi; p++) {
        const double *r = s->rows + (size_t)(p - s->lo) * s->row_len;
        if (s->map)
            for (size_t j = 0; j < s->row_len; j++) s->acc[s->map[j]] += r[j];
        else
            for (size_t j = 0; j < s->row_len; j++) s->acc[j] += r[j];
    }
}

int kvcc_dist_sum_finish(kvcc_dist_sum *s, char *err, size_t errlen) {
    if (!mpi_on || size_ == 1) {
        sum_replay(s);
        return 0;
    }
#ifdef KVCC_WITH_MPI
    if (s->acc_len > (size_t)0x7fffffff) {
        snprintf(err, errlen, "dist: %zu statistics are over MPI's 2 GiB count", s->acc_len);
        return -1;
    }
    const double t0 = now_s();
    const int n = (int)s->acc_len;
    int st = MPI_SUCCESS;
    if (rank_ > 0) st = MPI_Recv(s->acc, n, MPI_DOUBLE, rank_ - 1, 0x5eed, MPI_COMM_WORLD,
                                 MPI_STATUS_IGNORE);
    const double t1 = now_s();
    sum_replay(s);
    const double t2 = now_s();
    if (st == MPI_SUCCESS && rank_ + 1 < size_)
        st = MPI_Send(s->acc, n, MPI_DOUBLE, rank_ + 1, 0x5eed, MPI_COMM_WORLD);
    if (st == MPI_SUCCESS) st = MPI_Bcast(s->acc, n, MPI_DOUBLE, size_ - 1, MPI_COMM_WORLD);
    comm_s += (t1 - t0) + (now_s() - t2);
    if (st != MPI_SUCCESS) {
        snprintf(err, errlen, "dist: the ordered sum of %zu statistics failed (MPI)", s->acc_len);
        return -1;
    }
    return 0;
#else
    (void)err; (void)errlen;
    return 0;
#endif
}

void kvcc_dist_sum_free(kvcc_dist_sum *s) {
    free(s->acc);
    free(s->rows);
    memset(s, 0, sizeof *s);
}

void kvcc_dist_abort(int code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fflush(stderr);
    char line[1100];
    const int n = snprintf(line, sizeof line, "kvcc: rank %d: %s\n", rank_, msg);
    const int fd = saved_err >= 0 ? saved_err : STDERR_FILENO;
    if (n > 0 && write(fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1)) < 0) {
        /* nowhere left to say it */
    }
#ifdef KVCC_WITH_MPI
    if (mpi_on) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    _exit(code);
}
