/*
 * cmd_capture.c: `kvcc capture [--gguf M] [--text FILE]... [--prompts N] [--context T]
 * [--continuation C] [--seed S] [--dtype f16|f32] [--precision f32|bf16] [--shard R/N] -o corpus.h5`: real calibration
 * corpora from the built-in model (calib/capture.c). Defaults suit SmolLM2-135M: the calibration
 * texts in examples/data/calib/, 16 prompts of 2048 + 128 tokens.
 *
 * Sharded: `--shard R/N` writes only shard R's block of the prompts to -o; under `mpirun -np N`
 * (an MPI build) rank R writes shard R/N to OUT.R-of-N.h5 and, once every rank has finished its
 * shard, rank 0 writes the manifest OUT listing them (docs/corpus-format.md): no manifest if any
 * rank failed.
 */
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <omp.h>

#include "hash.h"
#include "capture.h"
#include "corpus.h"
#include "dist.h"
#include "kvcc.h"
#include "loader.h"
#include "stats.h"

#define DEFAULT_GGUF "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_TEXT_DIR "examples/data/calib"
#define MAX_TEXTS 256

static void usage(FILE *out) {
    fprintf(out, "usage: kvcc capture -o OUT.h5 [options]\n"
                 "  --gguf M            llama-family GGUF (default " DEFAULT_GGUF ", see scripts/fetch-model.sh;\n"
                 "                      an installed kvcc also looks in PREFIX/share/kvcc/" DEFAULT_GGUF ")\n"
                 "  --text FILE         a text to draw windows from; repeatable (default: every .txt in " DEFAULT_TEXT_DIR ")\n"
                 "  --prompts N         windows to capture (default 16)\n"
                 "  --context T         context tokens per window (default 2048)\n"
                 "  --continuation C    continuation tokens per window (default 128)\n"
                 "  --seed S            window choice (default 1)\n"
                 "  --dtype f16|f32     activation storage (default f16)\n"
                 "  --precision P       the model's weights and products: f32 (default) or bf16 (bf16\n"
                 "                      weights and products, f32 accumulation; docs/benchmarks.md)\n"
                 "  --codec C           how datasets are stored: none, shuffle, deflate1 or deflate4 (HDF5 built-in\n"
                 "                      filters; any HDF5 reader decodes each); default %s (docs/corpus-format.md)\n"
                 "  --shard R/N         capture only shard R (0..N-1) of N: a contiguous block of the prompts;\n"
                 "                      the shards listed in order in a manifest equal the whole capture\n"
                 "                      (under mpirun -np N each rank does this itself, see docs/distributed.md)\n"
                 "  -o, --output F      corpus to write (temp file + rename)\n",
            kvcc_corpus_codec_name(KVCC_CORPUS_CODEC_DEFAULT));
}

/* OpenBLAS (libopenblas, which the model's matrix products run on). */
void openblas_set_num_threads(int n);

/* kvcc_capture_opts.agree under mpirun: before a shard is renamed into place (its file written,
 * closed and synced), every rank's status; a rank whose capture went fine drops its shard when
 * another failed. *user (int): 1 when every rank passed, so every rank reaches the check after
 * the renames. */
static int agree_all(void *user, int rc, char *err, size_t errlen) {
    char m[768];
    snprintf(m, sizeof m, "%s", rc ? err : "");
    const int all = kvcc_dist_check(rc, m, sizeof m);
    *(int *)user = !all; /* every rank goes on to its rename */
    if (rc || !all) return rc;
    kvcc_strip_rank_prefix(m, "kvcc capture: ");
    snprintf(err, errlen, "%s (so no rank keeps its shard)", m);
    return all < 0 ? all : KVCC_CORPUS_ERR_IO;
}

/* What every rank must agree on under mpirun: its arguments, and the bytes of every text and of
 * the model (XXH3-64 each, folded FNV-1a). 0, or the exit status with the message printed. */
static int inputs_digest(int argc, char **argv, char *const *texts, int n_texts,
                         uint64_t model_hash, uint64_t *out, char *msg, size_t msglen) {
    uint64_t x = kvcc_argv_digest(argc, argv);
    for (int i = -1; i < n_texts; i++) {
        uint64_t h = model_hash;
        kvpol_error e;
        if (i >= 0 && kvpol_hash_file(texts[i], &h, &e) != 0) {
            snprintf(msg, msglen, "--text %s: cannot be read: %s", texts[i], e.msg);
            fprintf(stderr, "kvcc capture: %s\n", msg);
            return KVCC_EXIT_FAILED;
        }
        x = kvcc_fnv1a(x, &h, sizeof h);
    }
    *out = x;
    return KVCC_EXIT_OK;
}

static int capture_main(int argc, char **argv) {
    char gguf_buf[PATH_MAX], text_dir_buf[PATH_MAX];
    const char *gguf = NULL, *out = NULL, *dtype = "f16", *codec = NULL;
    int precision = KVCC_PREC_F32;
    char *texts[MAX_TEXTS];
    int n_texts = 0, own_texts = 0;
    unsigned n_prompts = 16, ctx = 2048, cont = 128, seed = 1, u;
    unsigned shard = 0, n_shards = 0; /* --shard R/N; 0/0: the whole capture */
    static const struct option opts[] = {
        {"gguf", required_argument, 0, 'g'}, {"text", required_argument, 0, 'x'},
        {"prompts", required_argument, 0, 'n'}, {"context", required_argument, 0, 't'},
        {"continuation", required_argument, 0, 'c'}, {"seed", required_argument, 0, 's'},
        {"dtype", required_argument, 0, 'd'}, {"output", required_argument, 0, 'o'},
        {"shard", required_argument, 0, 'S'}, {"precision", required_argument, 0, 'P'},
        {"codec", required_argument, 0, 'C'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = kvcc_getopt("capture", argc, argv, "g:x:n:t:c:s:d:o:hC:", opts)) != -1) {
        switch (ch) {
        case 'g': gguf = optarg; break;
        case 'x':
            if (n_texts == MAX_TEXTS) { fprintf(stderr, "kvcc capture: at most %d --text files\n", MAX_TEXTS); return KVCC_EXIT_USAGE; }
            texts[n_texts++] = optarg;
            break;
        case 'n': if (kvcc_parse_u32("capture", "prompts", optarg, 1, 100000, &u)) return KVCC_EXIT_USAGE; n_prompts = u; break;
        case 't': if (kvcc_parse_u32("capture", "context", optarg, 1, 1u << 20, &u)) return KVCC_EXIT_USAGE; ctx = u; break;
        case 'c': if (kvcc_parse_u32("capture", "continuation", optarg, 0, 1u << 20, &u)) return KVCC_EXIT_USAGE; cont = u; break;
        case 's': if (kvcc_parse_u32("capture", "seed", optarg, 0, 0xffffffffu, &u)) return KVCC_EXIT_USAGE; seed = u; break;
        case 'd': dtype = optarg; break;
        case 'P':
            if ((precision = kvcc_precision_parse(optarg)) < 0) {
                fprintf(stderr, "kvcc capture: --precision: got '%s', expected f32 or bf16\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            break;
        case 'C':
            if (kvcc_corpus_codec_parse(optarg) < 0) {
                fprintf(stderr, "kvcc capture: --codec: got '%s', expected none, shuffle, deflate1 or deflate4\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            codec = optarg;
            break;
        case 'o': out = optarg; break;
        case 'S': {
            char *end = NULL, *slash = strchr(optarg, '/');
            unsigned long r = 0, n = 0;
            int ok = slash && slash != optarg && optarg[0] >= '0' && optarg[0] <= '9';
            if (ok) r = strtoul(optarg, &end, 10), ok = end == slash && slash[1] >= '0' && slash[1] <= '9';
            if (ok) n = strtoul(slash + 1, &end, 10), ok = *end == 0 && n >= 1 && n <= 65536 && r < n;
            if (!ok) {
                fprintf(stderr, "kvcc capture: --shard: got '%s', expected R/N with 0 <= R < N <= 65536 (e.g. 0/4)\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            shard = (unsigned)r;
            n_shards = (unsigned)n;
            break;
        }
        case 'h': /* once under mpirun, not once per rank */
            if (kvcc_dist_rank() == 0) usage(stdout);
            return KVCC_EXIT_OK;
        default: return KVCC_EXIT_USAGE; /* kvcc_getopt said why */
        }
    }
    if (optind < argc) { fprintf(stderr, "kvcc capture: unexpected argument '%s'\n", argv[optind]); return KVCC_EXIT_USAGE; }
    if (!out) { fprintf(stderr, "kvcc capture: -o OUT.h5 is required (see kvcc capture --help)\n"); return KVCC_EXIT_USAGE; }
    if (strcmp(dtype, "f16") && strcmp(dtype, "f32")) {
        fprintf(stderr, "kvcc capture: --dtype: got '%s', expected f16 or f32\n", dtype);
        return KVCC_EXIT_USAGE;
    }
    if (ctx + cont < 2) { fprintf(stderr, "kvcc capture: --context + --continuation must be >= 2 tokens\n"); return KVCC_EXIT_USAGE; }
    const int gguf_given = gguf != NULL;
    if (!gguf_given) gguf = kvcc_data_path(DEFAULT_GGUF, gguf_buf, sizeof gguf_buf);
    /* under mpirun -np N (N > 1): this rank's shard beside OUT, and OUT the manifest */
    const unsigned rank = (unsigned)kvcc_dist_rank(), world = (unsigned)kvcc_dist_size();
    if (world > 1 && n_shards) { /* argv: the same on every rank, so every rank returns */
        fprintf(stderr, "kvcc capture: --shard %u/%u and mpirun -np %u: give one or the other (under mpirun each "
                "rank captures its own shard)\n", shard, n_shards, world);
        return KVCC_EXIT_USAGE;
    }
    char shard_out[1100], rank_tag[48] = "";
    const char *dst = out;
    if (world > 1) {
        shard = rank;
        n_shards = world;
        /* the longest rank's name decides, so that every rank returns here or none does */
        if ((size_t)snprintf(shard_out, sizeof shard_out, "%s.%u-of-%u.h5", out, world - 1, world) >= sizeof shard_out) {
            fprintf(stderr, "kvcc capture: -o %s: the path is too long\n", out);
            return KVCC_EXIT_USAGE;
        }
        snprintf(shard_out, sizeof shard_out, "%s.%u-of-%u.h5", out, rank, world);
        dst = shard_out;
        snprintf(rank_tag, sizeof rank_tag, "rank %u of %u: ", rank, world);
    }
    /* From here on the checks depend on this node's files: under mpirun a failure is this
     * rank's `ex`, which every rank learns at the agreement below (a rank that returned alone
     * would leave the others waiting in it). */
    int ex = KVCC_EXIT_OK;
    if (n_texts == 0) {
        n_texts = kvcc_list_texts(kvcc_data_path(DEFAULT_TEXT_DIR, text_dir_buf,
                                                 sizeof text_dir_buf),
                                  texts, MAX_TEXTS);
        own_texts = 1;
        if (n_texts <= 0) {
            fprintf(stderr, "kvcc capture: no --text given, and the default texts (every .txt in "
                    "%s: the repository's bundled text, relative to the current directory or, "
                    "for an installed kvcc, under PREFIX/share/kvcc) are not here: give --text "
                    "FILE (repeatable) and --gguf MODEL.gguf, or run from the repository root\n",
                    DEFAULT_TEXT_DIR);
            n_texts = 0;
            ex = KVCC_EXIT_USAGE;
        }
    }
    for (int i = 0; !ex && i < n_texts; i++) { /* before the model loads: a directory is a usage error */
        for (int j = 0; !ex && j < i; j++)
            if (kvcc_same_file(texts[i], texts[j])) { /* its windows would repeat the other's */
                fprintf(stderr, "kvcc capture: --text %s and --text %s are the same file\n",
                        texts[j], texts[i]);
                ex = KVCC_EXIT_USAGE;
            }
        struct stat ts;
        if (!ex && stat(texts[i], &ts) == 0 && !S_ISREG(ts.st_mode)) {
            fprintf(stderr, "kvcc capture: --text %s: is %s, expected a text file\n", texts[i],
                    S_ISDIR(ts.st_mode) ? "a directory" : "not a regular file");
            ex = KVCC_EXIT_USAGE;
        }
    }
    kvcc_input in[MAX_TEXTS + 1] = {{"--gguf", gguf}};
    for (int i = 0; i < n_texts; i++) in[i + 1] = (kvcc_input){"--text", texts[i]};
    if (!ex) ex = kvcc_check_output("capture", out, in, n_texts + 1);
    if (!ex && dst != out) ex = kvcc_check_output("capture", dst, in, n_texts + 1);
    if (!ex) kvcc_remove_temp_on_signal(dst);
    if (world > 1) { /* the node's cores shared among its ranks (the bytes do not depend on it) */
        const int per = omp_get_num_procs() / kvcc_dist_local_size();
        omp_set_num_threads(per > 1 ? per : 1);
        openblas_set_num_threads(per > 1 ? per : 1);
    }
    kvcc_loaded_model lm;
    int loaded = 0;
    char msg[768] = "";
    if (ex) {
        /* nothing was written; the message is printed */
    } else if (kvcc_load_model_prec(gguf, world > 1, precision, &lm, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc capture: --gguf: %s%s\n", msg,
                gguf_given ? "" : " (the default model: scripts/fetch-model.sh fetches it into a "
                                  "checkout, make install copies it into PREFIX/share/kvcc; or "
                                  "give --gguf MODEL.gguf)");
        ex = KVCC_EXIT_FAILED;
    } else if ((loaded = 1, kvcc_model_check_window(&lm.model->hp, gguf, (long)ctx + cont,
                                                   "--context + --continuation", msg, sizeof msg)) != 0) {
        fprintf(stderr, "kvcc capture: --gguf: %s\n", msg);
        ex = KVCC_EXIT_USAGE;
    }
    uint64_t digest = 0;
    if (world > 1 && !ex) /* the texts' bytes and the model file's (hashed at load) */
        ex = inputs_digest(argc, argv, texts, n_texts, lm.file_hash, &digest, msg, sizeof msg);
    if (world > 1) { /* every rank checked its output and loaded the model, or none captures */
        msg[0] = 0; /* a failing rank's message: the last line it printed */
        const int all = kvcc_dist_check(ex, msg, sizeof msg);
        kvcc_strip_rank_prefix(msg, "kvcc capture: ");
        if (all && !ex && rank == 0) fprintf(stderr, "kvcc capture: %s\n", msg);
        ex = all;
        /* the same command on the same files everywhere: a node whose copy of a text differs
         * would capture other prompts into its shard, and the manifest would join them */
        if (!ex && !kvcc_dist_same(digest, msg, sizeof msg)) {
            if (rank == 0) fprintf(stderr, "kvcc capture: %s\n", msg);
            ex = KVCC_EXIT_USAGE;
        }
    }
    const double t0 = kvcc_now_s();
    kvcc_capture_stats st = {0};
    int agreed = 0;
    if (!ex) {
        char options[512];
        /* precision=bf16 only when asked, so that an f32 capture's bytes are what they were */
        int k = snprintf(options, sizeof options, "model=%s prompts=%u context=%u continuation=%u seed=%u dtype=%s %stexts=",
                         lm.name, n_prompts, ctx, cont, seed, dtype,
                         precision == KVCC_PREC_BF16 ? "precision=bf16 " : "");
        for (int i = 0; i < n_texts && k < (int)sizeof options; i++) { /* base names: no machine paths */
            const char *b = strrchr(texts[i], '/');
            k += snprintf(options + k, sizeof options - (size_t)k, "%s%s", i ? "," : "", b ? b + 1 : texts[i]);
        }
        kvcc_capture_opts o = {.texts = (const char *const *)texts, .n_texts = n_texts, .n_prompts = n_prompts,
                               .context_len = ctx, .continuation_len = cont, .seed = seed,
                               .dtype_f16 = !strcmp(dtype, "f16"), .model_name = lm.name, .options = options, .codec = codec,
                               .shard = shard, .n_shards = n_shards, .agree = world > 1 ? agree_all : NULL,
                               .agree_user = &agreed};
        kvcc_progress_begin("capture (tokens)");
        int rc = kvcc_capture_run(lm.model, lm.tok, &o, dst, kvcc_progress, &st, msg, sizeof msg);
        if (rc) {
            /* another rank's failure reaches every rank as its message ("rank R: ..."): rank 0
             * prints it, and a rank's own failure is printed by the rank (rank 0's stderr, or
             * the rank's captured stderr, whose last line the agreement carried) */
            /* the library's messages name it ("capture: ..."); the command's prefix says it */
            const char *m = strncmp(msg, "capture: ", 9) == 0 ? msg + 9 : msg;
            fprintf(stderr, "kvcc capture: %s [%s]\n", m, kvcc_corpus_status_name(rc));
            ex = rc == KVCC_CORPUS_ERR_RANGE || rc == KVCC_CORPUS_ERR_ARG ? KVCC_EXIT_USAGE : KVCC_EXIT_FAILED;
        } else {
            struct stat sb;
            long long bytes = stat(dst, &sb) == 0 ? (long long)sb.st_size : -1;
            if (st.prompts == 0) { /* a shard of more shards than prompts */
                fprintf(stderr, "kvcc capture: %swrote %s: 0 prompts (shard %u of %u: more shards "
                        "than the %u prompts), %lld bytes\n", rank_tag, dst, shard, n_shards,
                        n_prompts, bytes);
            } else {
                fprintf(stderr,
                        "kvcc capture: %swrote %s: %u prompts x %u tokens (context %u + continuation %u), %u layers, %s, "
                        "%lld bytes (codec %s); model %s, mean next-token NLL %.3f (perplexity %.1f); %.1f s (%.0f tokens/s; "
                        "%.1f s writing, %.1f s log-probabilities)\n",
                        rank_tag, dst, st.prompts, st.tokens_per_prompt, ctx, cont, st.layers, dtype, bytes,
                        codec ? codec : kvcc_corpus_codec_name(KVCC_CORPUS_CODEC_DEFAULT), lm.name,
                        st.mean_nll, exp(st.mean_nll), st.seconds,
                        st.prompts * (double)st.tokens_per_prompt / st.seconds, st.write_seconds, st.logprob_seconds);
            }
        }
    }
    if (world > 1 && (!ex || agreed)) { /* every shard in place: rank 0 lists them (else no manifest) */
        /* every rank passed the agreement, so every rank is here, also one whose rename failed */
        if (!ex) msg[0] = 0; /* else the rank's own message, which it printed */
        const int own = ex;
        ex = kvcc_dist_check(ex, msg, sizeof msg);
        kvcc_strip_rank_prefix(msg, "kvcc capture: ");
        if (ex && !own) /* a shard without the others (or beside older ones) is no capture */
            unlink(dst);
        if (ex && rank == 0) {
            /* the old manifest at OUT would list shards of two captures */
            const int had = kvcc_corpus_is_manifest(out) && unlink(out) == 0;
            fprintf(stderr, "%s%s%skvcc capture: a rank failed after the shards were written: no "
                    "manifest written, the other ranks' new shards removed%s\n",
                    own ? "" : "kvcc capture: ", own ? "" : msg, own ? "" : "\n",
                    had ? "; the old manifest at -o was removed" : "");
        }
        int wrc = 0;
        if (!ex && rank == 0) {
            char(*names)[1100] = malloc((size_t)world * sizeof *names);
            const char **list = malloc((size_t)world * sizeof *list);
            wrc = names && list ? 0 : KVCC_CORPUS_ERR_NOMEM;
            for (unsigned r = 0; !wrc && r < world; r++) {
                snprintf(names[r], sizeof names[r], "%s.%u-of-%u.h5", out, r, world);
                list[r] = names[r];
            }
            if (!wrc) wrc = kvcc_corpus_write_manifest(out, list, world, msg, sizeof msg);
            else snprintf(msg, sizeof msg, "out of memory");
            free(names);
            free(list);
            if (wrc) fprintf(stderr, "kvcc capture: %s\n", msg);
        }
        /* every rank's shard statistics, for rank 0's summary */
        struct { double nll_sum, nll_n, seconds, prompts; } mine = {st.nll_sum, (double)st.nll_n, st.seconds,
                                                                     st.prompts}, *all = NULL;
        void *blob = NULL;
        size_t len = 0;
        if (!ex && kvcc_dist_allgatherv(&mine, sizeof mine, &blob, &len, NULL, msg, sizeof msg) == 0 &&
            len == world * sizeof mine && rank == 0 && !wrc) {
            all = blob;
            double s = 0, n = 0, slowest = 0;
            for (unsigned r = 0; r < world; r++) {
                s += all[r].nll_sum, n += all[r].nll_n;
                if (all[r].seconds > slowest) slowest = all[r].seconds;
            }
            fprintf(stderr, "kvcc capture: wrote the manifest %s: %u shards (%s.R-of-%u.h5, R = 0..%u), %u prompts "
                    "in all, mean next-token NLL %.3f; slowest rank %.1f s, %.1f s from the first prompt to the "
                    "manifest\n", out, world, out, world, world - 1, n_prompts, n ? s / n : NAN, slowest,
                    kvcc_now_s() - t0);
        }
        free(blob);
        if (!ex) {
            msg[0] = 0;
            ex = kvcc_dist_check(wrc ? KVCC_EXIT_FAILED : 0, msg, sizeof msg);
        }
    } else if (world > 1 && rank == 0) {
        fprintf(stderr, "kvcc capture: a rank failed (its message above): no manifest written; %s is unchanged\n",
                out);
    }
    if (loaded) kvcc_loaded_model_free(&lm);
    if (own_texts)
        for (int i = 0; i < n_texts; i++) free(texts[i]);
    return ex;
}

int kvcc_cmd_capture(int argc, char **argv) {
    char msg[768] = "";
    if (kvcc_dist_init(&argc, &argv, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc capture: %s\n", msg);
        return KVCC_EXIT_FAILED;
    }
    const int ex = capture_main(argc, argv);
    kvcc_dist_finalize();
    return ex;
}
