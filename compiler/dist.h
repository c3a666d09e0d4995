/*
 * dist.h: the distribution layer of `mpirun -np N kvcc compile` (Open MPI when built with
 * USE_MPI=1; one rank otherwise). Passes call the same functions whatever the build: without MPI,
 * or when the process was not started by mpirun, there is one rank (0 of 1) and every collective
 * is a copy or a no-op. Determinism: work is split by kvcc_dist_shard (contiguous index blocks,
 * a function of (n, size) only) and every gather returns the data in rank order, which is index
 * order, so a reduction done after a gather, in index order, gives the bytes of one process.
 *
 * Failures: a collective kvcc_dist_check after each phase tells every rank whether any rank
 * failed and with what message (the lowest failing rank's), so all ranks leave together with the
 * same status; kvcc_dist_abort ends the whole job from one rank with a message.
 * Ranks other than 0 write their stderr to a private temporary file (progress and messages come
 * from rank 0 only); the tail of it is the message of a rank that failed without one.
 *
 * defines: kvcc_dist_init, kvcc_dist_finalize, kvcc_dist_rank, kvcc_dist_size,
 *          kvcc_dist_local_size, kvcc_dist_active, kvcc_dist_shard, kvcc_dist_shard_of,
 *          kvcc_dist_check, kvcc_dist_gather_rows, kvcc_dist_allgatherv, kvcc_dist_bcast,
 *          kvcc_dist_same, kvcc_dist_sum (init, row, finish, free), kvcc_dist_abort,
 *          kvcc_dist_comm_seconds
 */
#ifndef KVCC_DIST_H
#define KVCC_DIST_H
#include <stddef.h>
#include <stdint.h>

/* Start MPI when this process was launched by mpirun (and the build has MPI); else one rank.
 * Idempotent. 0, or -1 with a message in err (MPI_Init failed). */
int kvcc_dist_init(int *argc, char ***argv, char *err, size_t errlen);
/* Finalize MPI (when started); restores stderr. Idempotent. */
void kvcc_dist_finalize(void);
int kvcc_dist_rank(void);
int kvcc_dist_size(void);
/* Ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE; 1 without MPI). */
int kvcc_dist_local_size(void);
/* 1 when the job has more than one rank. */
int kvcc_dist_active(void);

/* The shard of items [0, n) of this rank (or of `rank` of `size`): the contiguous block
 * [floor(r * n / size), floor((r + 1) * n / size)). Depends on (n, size, r) only. */
void kvcc_dist_shard(uint32_t n, uint32_t *lo, uint32_t *hi);
void kvcc_dist_shard_of(uint32_t n, int rank, int size, uint32_t *lo, uint32_t *hi);

/* Collective (every rank must call it at the same point): rc is this rank's status (0: fine).
 * Returns the status of the lowest-numbered failing rank (0 when none failed); err (errlen bytes)
 * then holds that rank's message on every rank, prefixed "rank R: " when R != 0. A failing rank's
 * empty err is replaced by the last line it wrote to stderr. */
int kvcc_dist_check(int rc, char *err, size_t errlen);

/* Collective: rows [n][row_bytes], of which this rank filled its shard (kvcc_dist_shard(n));
 * on return every rank holds all n rows. 0, or -1 (message in err). */
int kvcc_dist_gather_rows(void *rows, size_t row_bytes, uint32_t n, char *err, size_t errlen);

/* Collective: every rank's blob (len bytes, may be 0), concatenated in rank order into a malloc'd
 * *all (*all_len bytes; free() it); lens (optional, [size]) receives each rank's length. Any total
 * size (above MPI's 2^31 - 1 byte count, as broadcasts of at most that much).
 * 0, or -1 (message in err). */
int kvcc_dist_allgatherv(const void *mine, size_t len, void **all, size_t *all_len, size_t *lens,
                         char *err, size_t errlen);

/* Collective: len bytes of root's buf to every rank. 0, or -1. */
int kvcc_dist_bcast(void *buf, size_t len, int root, char *err, size_t errlen);

/* Collective: whether every rank passed the same 64-bit value (e.g. a digest of the inputs);
 * 1 when they agree, else 0 with err naming the first rank that differs from rank 0. */
int kvcc_dist_same(uint64_t v, char *err, size_t errlen);

/* An ordered sum over items (prompts) sharded by kvcc_dist_shard: the exact floating-point result
 * of one process adding every item's increments in item order. Each item has row_len increments
 * (written by the pass in its serial order); increment j of a row is added to acc[map[j]] (map
 * NULL: j itself, row_len == acc_len). kvcc_dist_sum_finish replays the rows rank after rank
 * (rank r receives the sum of ranks < r, adds its rows in order, passes it on), so the result
 * does not depend on the rank count; every rank ends with it in acc. One rank without a map adds
 * in place (kvcc_dist_sum_row returns acc). */
typedef struct {
    double *acc;                    /* [acc_len], zeroed by init */
    double *rows;                   /* [hi - lo][row_len] (NULL when in place) */
    size_t acc_len, row_len;
    const uint32_t *map;
    uint32_t lo, hi;
} kvcc_dist_sum;
/* 0, or -1 (out of memory; message in err). */
int kvcc_dist_sum_init(kvcc_dist_sum *s, size_t acc_len, size_t row_len, const uint32_t *map,
                       uint32_t n_items, char *err, size_t errlen);
/* The row of item p (in this rank's shard), zeroed: the pass adds (+=) or stores its increments. */
double *kvcc_dist_sum_row(kvcc_dist_sum *s, uint32_t p);
/* Collective. 0, or -1 (message in err). */
int kvcc_dist_sum_finish(kvcc_dist_sum *s, char *err, size_t errlen);
void kvcc_dist_sum_free(kvcc_dist_sum *s);

/* End the whole job from this rank: "kvcc: rank R: MESSAGE" on the original stderr, then
 * MPI_Abort (or exit with one rank). Never returns. */
void kvcc_dist_abort(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));

/* Seconds this rank spent inside the collectives above (waiting included). */
double kvcc_dist_comm_seconds(void);
#endif
