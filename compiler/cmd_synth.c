/*
 * cmd_synth.c: `kvcc synth --model NAME -o corpus.h5 [--prompts N] [--context T]
 * [--continuation C] [--seed S] [--dtype f16|f32] [--retrieval-heads R]`: a synthetic corpus in
 * schema v1 for any preset (calib/synth.c says what structure is planted). For tests and
 * llama3-scale shape/speed checks, never for evaluating compression quality.
 */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "corpus.h"
#include "kvcc.h"
#include "presets.h"
#include "synth.h"

static void usage(FILE *out) {
    fprintf(out, "usage: kvcc synth --model NAME -o OUT.h5 [options]\n"
                 "  --model NAME           preset (kvcc models)\n"
                 "  -o, --output F         corpus to write (temp file + rename)\n"
                 "  --prompts N            prompts (default 4)\n"
                 "  --context T            context tokens per prompt (default 512)\n"
                 "  --continuation C       continuation tokens per prompt (default 64)\n"
                 "  --seed S               RNG seed (default 1)\n"
                 "  --dtype f16|f32        activation storage (default f16)\n"
                 "  --retrieval-heads R    retrieval query heads per layer (default 2)\n");
}

int kvcc_cmd_synth(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *dtype = "f16";
    kvcc_synth_opts o = {.n_prompts = 4, .context_len = 512, .continuation_len = 64, .seed = 1, .dtype_f16 = 1,
                         .retrieval_heads = 2};
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"output", required_argument, 0, 'o'},
        {"prompts", required_argument, 0, 'n'}, {"context", required_argument, 0, 't'},
        {"continuation", required_argument, 0, 'c'}, {"seed", required_argument, 0, 's'},
        {"dtype", required_argument, 0, 'd'}, {"retrieval-heads", required_argument, 0, 'r'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch;
    unsigned u;
    optind = 1;
    while ((ch = kvcc_getopt("synth", argc, argv, "m:o:n:t:c:s:d:r:h", opts)) != -1) {
        switch (ch) {
        case 'm': model = optarg; break;
        case 'o': out = optarg; break;
        case 'n': if (kvcc_parse_u32("synth", "prompts", optarg, 1, 100000, &u)) return KVCC_EXIT_USAGE; o.n_prompts = u; break;
        case 't': if (kvcc_parse_u32("synth", "context", optarg, 2, 1u << 19, &u)) return KVCC_EXIT_USAGE; o.context_len = u; break;
        case 'c': if (kvcc_parse_u32("synth", "continuation", optarg, 0, 1u << 19, &u)) return KVCC_EXIT_USAGE; o.continuation_len = u; break;
        case 's': if (kvcc_parse_u32("synth", "seed", optarg, 0, 0xffffffffu, &u)) return KVCC_EXIT_USAGE; o.seed = u; break;
        case 'r': if (kvcc_parse_u32("synth", "retrieval-heads", optarg, 0, 1024, &u)) return KVCC_EXIT_USAGE; o.retrieval_heads = (int)u; break;
        case 'd': dtype = optarg; break;
        case 'h': usage(stdout); return KVCC_EXIT_OK;
        default: return KVCC_EXIT_USAGE; /* kvcc_getopt said why */
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvcc synth: unexpected argument '%s'\n", argv[optind]);
        return KVCC_EXIT_USAGE;
    }
    if (!model || !out) {
        fprintf(stderr, "kvcc synth: --model NAME and -o OUT.h5 are required (see kvcc synth --help)\n");
        return KVCC_EXIT_USAGE;
    }
    if (strcmp(dtype, "f16") && strcmp(dtype, "f32")) {
        fprintf(stderr, "kvcc synth: --dtype: got '%s', expected f16 or f32\n", dtype);
        return KVCC_EXIT_USAGE;
    }
    o.dtype_f16 = !strcmp(dtype, "f16");
    const kvcc_preset *p = kvcc_preset_find(model);
    if (!p) {
        fprintf(stderr, "kvcc synth: --model: unknown preset '%s' (kvcc models lists them)\n", model);
        return KVCC_EXIT_USAGE;
    }
    const uint32_t G = p->n_heads / p->n_kv_heads; /* calib/synth.c: the first R of one group */
    if ((uint32_t)o.retrieval_heads > G) {
        fprintf(stderr, "kvcc synth: --retrieval-heads: got %d, expected 0..%u (the query heads "
                "of one KV group of %s, where the retrieval heads are planted)\n",
                o.retrieval_heads, G, p->name);
        return KVCC_EXIT_USAGE;
    }
    int ex = kvcc_check_output("synth", out, NULL, 0);
    if (!ex) kvcc_remove_temp_on_signal(out);
    if (ex) return ex;
    kvcc_corpus_model m = {.n_layers = p->n_layers, .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads,
                           .head_dim = p->head_dim, .vocab_size = p->vocab_size, .rope_theta = p->rope_theta,
                           .rope_scaling_factor = 1.0f};
    snprintf(m.name, sizeof m.name, "%s", p->name);
    snprintf(m.rope_scaling, sizeof m.rope_scaling, "none");
    char options[256], err[512];
    snprintf(options, sizeof options, "model=%s prompts=%u context=%u continuation=%u seed=%llu dtype=%s retrieval_heads=%d",
             p->name, o.n_prompts, o.context_len, o.continuation_len, (unsigned long long)o.seed, dtype, o.retrieval_heads);
    kvcc_progress_begin("synth");
    int rc = kvcc_synth_write(out, &m, &o, options, kvcc_progress, err, sizeof err);
    if (rc) {
        fprintf(stderr, "kvcc synth: %s [%s]\n", err, kvcc_corpus_status_name(rc));
        return KVCC_EXIT_FAILED;
    }
    fprintf(stderr, "kvcc synth: wrote %s: %u prompts x %u tokens, %u layers, %s, %.1fs\n", out, o.n_prompts,
            o.context_len + o.continuation_len, p->n_layers, dtype, kvcc_progress_elapsed());
    return KVCC_EXIT_OK;
}
