/*
 * cmd_capture.c: `kvcc capture [--gguf M] [--text FILE]... [--prompts N] [--context T]
 * [--continuation C] [--seed S] [--dtype f16|f32] -o corpus.h5`: real calibration corpora from
 * the built-in model (calib/capture.c). Defaults suit SmolLM2-135M: the calibration texts in
 * examples/data/calib/, 16 prompts of 2048 + 128 tokens.
 */
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "capture.h"
#include "corpus.h"
#include "kvcc.h"
#include "loader.h"

#define DEFAULT_GGUF "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_TEXT_DIR "examples/data/calib"
#define MAX_TEXTS 256

static void usage(FILE *out) {
    fprintf(out, "usage: kvcc capture -o OUT.h5 [options]\n"
                 "  --gguf M            llama-family GGUF (default " DEFAULT_GGUF ", see scripts/fetch-model.sh)\n"
                 "  --text FILE         a text to draw windows from; repeatable (default: every .txt in " DEFAULT_TEXT_DIR ")\n"
                 "  --prompts N         windows to capture (default 16)\n"
                 "  --context T         context tokens per window (default 2048)\n"
                 "  --continuation C    continuation tokens per window (default 128)\n"
                 "  --seed S            window choice (default 1)\n"
                 "  --dtype f16|f32     activation storage (default f16)\n"
                 "  -o, --output F      corpus to write (temp file + rename)\n");
}

int kvcc_cmd_capture(int argc, char **argv) {
    const char *gguf = DEFAULT_GGUF, *out = NULL, *dtype = "f16";
    char *texts[MAX_TEXTS];
    int n_texts = 0, own_texts = 0;
    unsigned n_prompts = 16, ctx = 2048, cont = 128, seed = 1, u;
    static const struct option opts[] = {
        {"gguf", required_argument, 0, 'g'}, {"text", required_argument, 0, 'x'},
        {"prompts", required_argument, 0, 'n'}, {"context", required_argument, 0, 't'},
        {"continuation", required_argument, 0, 'c'}, {"seed", required_argument, 0, 's'},
        {"dtype", required_argument, 0, 'd'}, {"output", required_argument, 0, 'o'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "g:x:n:t:c:s:d:o:h", opts, NULL)) != -1) {
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
        case 'o': out = optarg; break;
        case 'h': usage(stdout); return KVCC_EXIT_OK;
        default: usage(stderr); return KVCC_EXIT_USAGE;
        }
    }
    if (optind < argc) { fprintf(stderr, "kvcc capture: unexpected argument '%s'\n", argv[optind]); return KVCC_EXIT_USAGE; }
    if (!out) { fprintf(stderr, "kvcc capture: -o OUT.h5 is required (see kvcc capture --help)\n"); return KVCC_EXIT_USAGE; }
    if (strcmp(dtype, "f16") && strcmp(dtype, "f32")) {
        fprintf(stderr, "kvcc capture: --dtype: got '%s', expected f16 or f32\n", dtype);
        return KVCC_EXIT_USAGE;
    }
    if (ctx + cont < 2) { fprintf(stderr, "kvcc capture: --context + --continuation must be >= 2 tokens\n"); return KVCC_EXIT_USAGE; }
    if (n_texts == 0) {
        n_texts = kvcc_list_texts(DEFAULT_TEXT_DIR, texts, MAX_TEXTS);
        own_texts = 1;
        if (n_texts <= 0) {
            fprintf(stderr, "kvcc capture: no --text given and no .txt files in %s (run from the repository root)\n",
                    DEFAULT_TEXT_DIR);
            return KVCC_EXIT_USAGE;
        }
    }
    for (int i = 0; i < n_texts; i++) { /* before the model loads: a directory is a usage error */
        struct stat ts;
        if (stat(texts[i], &ts) == 0 && !S_ISREG(ts.st_mode)) {
            fprintf(stderr, "kvcc capture: --text %s: is %s, expected a text file\n", texts[i],
                    S_ISDIR(ts.st_mode) ? "a directory" : "not a regular file");
            if (own_texts)
                for (int j = 0; j < n_texts; j++) free(texts[j]);
            return KVCC_EXIT_USAGE;
        }
    }
    kvcc_input in[MAX_TEXTS + 1] = {{"--gguf", gguf}};
    for (int i = 0; i < n_texts; i++) in[i + 1] = (kvcc_input){"--text", texts[i]};
    int ex = kvcc_check_output("capture", out, in, n_texts + 1);
    if (!ex) kvcc_remove_temp_on_signal(out);
    kvcc_loaded_model lm;
    char msg[512] = "";
    if (ex) {
        /* nothing was written */
    } else if (kvcc_load_model(gguf, 0, &lm, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc capture: --gguf: %s\n", msg);
        ex = KVCC_EXIT_FAILED;
    } else {
        char options[512];
        int k = snprintf(options, sizeof options, "model=%s prompts=%u context=%u continuation=%u seed=%u dtype=%s texts=",
                         lm.name, n_prompts, ctx, cont, seed, dtype);
        for (int i = 0; i < n_texts && k < (int)sizeof options; i++) { /* base names: no machine paths */
            const char *b = strrchr(texts[i], '/');
            k += snprintf(options + k, sizeof options - (size_t)k, "%s%s", i ? "," : "", b ? b + 1 : texts[i]);
        }
        kvcc_capture_opts o = {.texts = (const char *const *)texts, .n_texts = n_texts, .n_prompts = n_prompts,
                               .context_len = ctx, .continuation_len = cont, .seed = seed,
                               .dtype_f16 = !strcmp(dtype, "f16"), .model_name = lm.name, .options = options};
        kvcc_capture_stats st;
        kvcc_progress_begin("capture");
        int rc = kvcc_capture_run(lm.model, lm.tok, &o, out, kvcc_progress, &st, msg, sizeof msg);
        if (rc) {
            fprintf(stderr, "kvcc capture: %s [%s]\n", msg, kvcc_corpus_status_name(rc));
            ex = rc == KVCC_CORPUS_ERR_RANGE || rc == KVCC_CORPUS_ERR_ARG ? KVCC_EXIT_USAGE : KVCC_EXIT_FAILED;
        } else {
            struct stat sb;
            long long bytes = stat(out, &sb) == 0 ? (long long)sb.st_size : -1;
            fprintf(stderr,
                    "kvcc capture: wrote %s: %u prompts x %u tokens (context %u + continuation %u), %u layers, %s, "
                    "%lld bytes; model %s, mean next-token NLL %.3f (perplexity %.1f); %.1f s (%.0f tokens/s)\n",
                    out, st.prompts, st.tokens_per_prompt, ctx, cont, st.layers, dtype, bytes, lm.name, st.mean_nll,
                    exp(st.mean_nll), st.seconds, st.prompts * (double)st.tokens_per_prompt / st.seconds);
        }
        kvcc_loaded_model_free(&lm);
    }
    if (own_texts)
        for (int i = 0; i < n_texts; i++) free(texts[i]);
    return ex;
}
