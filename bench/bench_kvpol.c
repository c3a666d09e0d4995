/*
 * bench_kvpol.c: open + validate + decode throughput of a ~100 MB .kvpol artifact (`make bench`).
 * The artifact mixes what policies will store: smooth f32 tables (zstd) and noisy f32 tensors
 * (uncompressed). Reported against the machine's own limits measured in the same run: memcpy
 * bandwidth, XXH3-64 hashing and raw zstd decompression of the same payloads. Medians of runs.
 *
 * usage: bench_kvpol [--mb N] [--runs R] [--dir D]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include <unistd.h>
#include <zstd.h>

#include "kvpol.h"

int main(int argc, char **argv) {
    int mb = 100, runs = 7;
    const char *dir = "build/bench";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mb")) mb = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--runs")) runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
    }
    if (mb < 1 || runs < 1 || runs > 99) {
        fprintf(stderr, "usage: bench_kvpol [--mb N>=1] [--runs 1..99] [--dir D]\n");
        return 2;
    }
    const int n_secs = 8;
    const uint64_t per = (uint64_t)mb * (1u << 20) / n_secs / 4; /* floats per section */
    float *data = malloc(per * sizeof(float));
    if (!data) return 1;
    char path[1024];
    snprintf(path, sizeof path, "%s/bench_%dmb.kvpol", dir, mb);

    kvpol_header h;
    kvpol_header_init(&h);
    h.model.n_layers = 32; h.model.n_heads = 32; h.model.n_kv_heads = 8; h.model.head_dim = 128;
    h.model.vocab_size = 128256; h.model.rope_theta = 500000.0;
    strcpy(h.model.name, "llama3-8b");
    kvpol_writer *w;
    kvpol_error err;
    double t0 = now_s();
    if (kvpol_writer_create(&w, &h, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (int s = 0; s < n_secs; s++) {
        int zstd = s % 2 == 0;
        for (uint64_t i = 0; i < per; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            float noise = (float)((state >> 40) & 0xffff) / 65536.0f - 0.5f;
            /* zstd sections: quantized smooth tables (compress well); others: noise. */
            data[i] = zstd ? (float)((int)(i / 4096) % 29) * 0.025f + 0.8f : noise;
        }
        char name[32];
        snprintf(name, sizeof name, "bench.s%d", s);
        uint64_t dims[2] = {per / 1024, 1024};
        int rc = kvpol_writer_begin_section(w, KVPOL_SEC_SELFTEST - (uint32_t)(n_secs - s), name, 0,
                                            zstd ? KVPOL_CODEC_ZSTD : KVPOL_CODEC_NONE, 1);
        if (!rc) rc = kvpol_writer_add_tensor(w, "t", KVPOL_DTYPE_F32, 2, dims, data);
        if (!rc) rc = kvpol_writer_end_section(w);
        if (rc) { fprintf(stderr, "writer: %s\n", kvpol_status_str(rc)); return 1; }
    }
    if (kvpol_writer_finish(w, path, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
    kvpol_writer_free(w);
    double t_write = now_s() - t0;

    /* Time open+validate+decode, all sections decoded (VERIFY_ALL: they are unknown ids). */
    double *t = malloc((size_t)runs * sizeof *t);
    uint64_t raw_total = 0, file_size = 0, zstd_raw = 0, zstd_stored = 0;
    for (int r = 0; r < runs; r++) {
        kvpol_file *f;
        kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
        double a = now_s();
        if (kvpol_open_path(&f, path, &o, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
        t[r] = now_s() - a;
        file_size = kvpol_get_header(f)->file_size;
        raw_total = zstd_raw = zstd_stored = 0;
        for (uint32_t s = 0; s < kvpol_section_count(f); s++) {
            const kvpol_section_info *si = kvpol_section_at(f, s);
            raw_total += si->raw_size;
            if (si->codec == KVPOL_CODEC_ZSTD) zstd_raw += si->raw_size, zstd_stored += si->stored_size;
        }
        kvpol_close(f);
    }
    double t_open = median(t, runs);

    /* Machine limits on the same bytes: memcpy, XXH3, raw zstd decompression. */
    size_t nb = (size_t)raw_total;
    char *src = malloc(nb), *dst = malloc(nb);
    memset(src, 1, nb);
    memset(dst, 2, nb);
    for (int r = 0; r < runs; r++) { double a = now_s(); memcpy(dst, src, nb); t[r] = now_s() - a; }
    double t_memcpy = median(t, runs);
    volatile uint64_t sink = 0;
    for (int r = 0; r < runs; r++) { double a = now_s(); sink ^= kvpol_hash(dst, nb); t[r] = now_s() - a; }
    double t_hash = median(t, runs);
    /* zstd alone over one compressed section of this artifact, scaled to all zstd bytes. */
    size_t one = (size_t)(per * sizeof(float));
    for (uint64_t i = 0; i < per; i++) data[i] = (float)((int)(i / 4096) % 29) * 0.025f + 0.8f;
    size_t cap = ZSTD_compressBound(one);
    char *z = malloc(cap);
    size_t zn = ZSTD_compress(z, cap, data, one, 9);
    for (int r = 0; r < runs; r++) { double a = now_s(); sink ^= ZSTD_decompress(dst, one, z, zn); t[r] = now_s() - a; }
    double t_zstd = median(t, runs) * (double)zstd_raw / (double)one;

    double MB = 1e6;
    printf("bench_kvpol: artifact %s, %.1f MB on disk, %.1f MB decoded (%d sections: %.1f MB zstd -> %.1f MB, rest uncompressed)\n",
           path, file_size / MB, raw_total / MB, n_secs, zstd_stored / MB, zstd_raw / MB);
    printf("  write (build + compress + atomic write)   %8.3f s\n", t_write);
    printf("  open + validate + decode (median of %d)    %8.4f s  = %7.0f MB/s of decoded payload\n", runs, t_open,
           raw_total / MB / t_open);
    printf("  machine: memcpy of the same bytes         %8.4f s  = %7.0f MB/s\n", t_memcpy, raw_total / MB / t_memcpy);
    printf("  machine: XXH3-64 of the same bytes        %8.4f s  = %7.0f MB/s\n", t_hash, raw_total / MB / t_hash);
    printf("  machine: zstd decompress of zstd sections %8.4f s  = %7.0f MB/s\n", t_zstd, zstd_raw / MB / t_zstd);
    printf("  ratios: open time / memcpy = %.2f, / (XXH3 + zstd floor) = %.2f\n", t_open / t_memcpy,
           t_open / (t_hash + t_zstd));
    unlink(path);
    free(data); free(src); free(dst); free(z); free(t);
    return (int)(sink & 0);
}
