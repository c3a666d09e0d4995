/*
 * test_dist.c: Criterion tests of compiler/dist.c as one rank (the tests do not run under
 * mpirun; tests/cli/mpi.sh runs 2 and 4 ranks): the shard rule covers [0, n) in contiguous,
 * balanced blocks for every rank count; the ordered sum (with and without a map) gives the bits
 * of a plain serial accumulation; the collective check passes the status and message through;
 * the blob gather copies.
 */
#include <criterion/criterion.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"
#include "test_rng.h"

Test(dist, shard_rule_covers_every_item_once_in_order) {
    for (uint32_t n = 0; n < 40; n++)
        for (int size = 1; size <= 9; size++) {
            uint32_t next = 0, mn = UINT32_MAX, mx = 0;
            for (int r = 0; r < size; r++) {
                uint32_t lo, hi;
                kvcc_dist_shard_of(n, r, size, &lo, &hi);
                cr_assert_eq(lo, next, "n %u size %d rank %d: starts at %u, expected %u", n, size,
                             r, lo, next);
                cr_assert_geq(hi, lo);
                next = hi;
                if (hi - lo < mn) mn = hi - lo;
                if (hi - lo > mx) mx = hi - lo;
            }
            cr_assert_eq(next, n, "n %u size %d: the shards end at %u", n, size, next);
            cr_assert_leq(mx - mn, 1, "n %u size %d: shards of %u and %u items", n, size, mn, mx);
        }
    uint32_t lo, hi;
    kvcc_dist_shard(17, &lo, &hi); /* one rank: everything */
    cr_assert(lo == 0 && hi == 17);
    cr_assert_eq(kvcc_dist_size(), 1);
    cr_assert_eq(kvcc_dist_rank(), 0);
}

/* increments of widely different magnitudes, several per cell per item: the order matters */
static double incr(uint64_t *s) {
    const double u = rng_u(s);
    return (u - 0.3) * (u < 0.5 ? 1e-9 : 1e6);
}

Test(dist, ordered_sum_with_map_is_the_serial_sum_bit_for_bit) {
    enum { P = 13, ROW = 40, CELLS = 7 };
    uint32_t map[ROW];
    for (int j = 0; j < ROW; j++) map[j] = (uint32_t)((j * 5 + j / 3) % CELLS);
    double serial[CELLS] = {0};
    uint64_t s = 99;
    kvcc_dist_sum sum;
    char err[256];
    cr_assert_eq(kvcc_dist_sum_init(&sum, CELLS, ROW, map, P, err, sizeof err), 0, "%s", err);
    for (uint32_t p = sum.lo; p < sum.hi; p++) {
        double *row = kvcc_dist_sum_row(&sum, p);
        for (int j = 0; j < ROW; j++) {
            row[j] = incr(&s);
            serial[map[j]] += row[j];
        }
    }
    cr_assert_eq(kvcc_dist_sum_finish(&sum, err, sizeof err), 0, "%s", err);
    cr_assert_eq(memcmp(serial, sum.acc, sizeof serial), 0, "the ordered sum differs from the serial one");
    /* the same increments summed per item first differ: what the rows avoid */
    double per_item[CELLS] = {0};
    s = 99;
    for (uint32_t p = 0; p < P; p++) {
        double part[CELLS] = {0};
        for (int j = 0; j < ROW; j++) part[map[j]] += incr(&s);
        for (int c = 0; c < CELLS; c++) per_item[c] += part[c];
    }
    cr_assert_neq(memcmp(serial, per_item, sizeof serial), 0,
                  "the test's increments do not depend on the order (make them harder)");
    kvcc_dist_sum_free(&sum);
}

Test(dist, ordered_sum_in_place_without_map) {
    enum { P = 5, N = 9 };
    kvcc_dist_sum sum;
    char err[256];
    cr_assert_eq(kvcc_dist_sum_init(&sum, N, N, NULL, P, err, sizeof err), 0);
    double serial[N] = {0};
    uint64_t s = 7;
    for (uint32_t p = sum.lo; p < sum.hi; p++) {
        double *row = kvcc_dist_sum_row(&sum, p);
        for (int j = 0; j < N; j++) {
            const double x = incr(&s);
            row[j] += x;
            serial[j] += x;
        }
    }
    cr_assert_eq(kvcc_dist_sum_finish(&sum, err, sizeof err), 0);
    cr_assert_eq(memcmp(serial, sum.acc, sizeof serial), 0);
    kvcc_dist_sum_free(&sum);
}

Test(dist, check_gather_and_bcast_as_one_rank) {
    char err[64] = "corpus.h5: prompt 3: bad";
    cr_assert_eq(kvcc_dist_check(5, err, sizeof err), 5);
    cr_assert_str_eq(err, "corpus.h5: prompt 3: bad");
    err[0] = 0;
    cr_assert_eq(kvcc_dist_check(0, err, sizeof err), 0);
    const char blob[] = "records";
    void *all = NULL;
    size_t n = 0, lens[1] = {0};
    cr_assert_eq(kvcc_dist_allgatherv(blob, sizeof blob, &all, &n, lens, err, sizeof err), 0);
    cr_assert(n == sizeof blob && lens[0] == sizeof blob && !memcmp(all, blob, n));
    free(all);
    double rows[3] = {1, 2, 3};
    cr_assert_eq(kvcc_dist_gather_rows(rows, sizeof(double), 3, err, sizeof err), 0);
    cr_assert(rows[0] == 1 && rows[2] == 3);
    int x = 4;
    cr_assert_eq(kvcc_dist_bcast(&x, sizeof x, 0, err, sizeof err), 0);
    cr_assert_eq(x, 4);
    cr_assert(kvcc_dist_same(0x1234, err, sizeof err));
}
