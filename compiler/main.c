/*
 * main.c: the kvcc command-line tool: dispatch to subcommands, --help, --version.
 * Each subcommand lives in compiler/cmd_*.c and parses its own options with getopt_long; what a
 * command printed on stdout is flushed and checked here (a write error exits 5).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>

#include "kvcc.h"
#include "model.h"
#include "kvrt_experimental.h"

static void usage(FILE *out) {
    fprintf(out,
            "kvcc %s: KV-cache compression compiler\n"
            "\n"
            "usage: kvcc COMMAND [OPTIONS]\n"
            "\n"
            "commands:\n"
            "  models                      list the model presets and their dimensions\n"
            "  compile --model NAME -o F   compile a .kvpol artifact for a model (see kvcc compile --help)\n"
            "  capture -o F.h5             run the built-in model on text, write a calibration corpus\n"
            "  synth --model NAME -o F.h5  write a synthetic corpus (planted structure) for any preset\n"
            "  eval --corpus F --methods L --budgets B [--gguf M]\n"
            "                              score compression methods: layer-local and end to end\n"
            "  inspect FILE [--json] [--items N]\n"
            "                              show an artifact: header, fingerprint, sections, items\n"
            "  verify FILE... [--model NAME] [--quiet]\n"
            "                              fully validate artifacts (and their model fingerprint)\n"
            "  diff A B [--json]           which header fields, sections and items differ\n"
            "  report FILE -o F.html [--eval E.json]\n"
            "                              an offline HTML page of an artifact's figures (and an eval's)\n"
            "\n"
            "options:\n"
            "  -h, --help                  this help (COMMAND --help for a command's own)\n"
            "  -V, --version               kvcc, .kvpol format and libkvrt versions, the BLAS and its kernels,\n"
            "                              threads, and whether CUDA is usable (the one check that loads it)\n"
            "\n"
            "exit status:\n"
            "   0  success\n"
            "   1  kvcc diff: the artifacts differ\n"
            "   2  usage error\n"
            "   4  the artifact was compiled for another model (verify --model)\n"
            "   5  the command failed (I/O, a full disk or stdout write error, out of memory,\n"
            "      ...; see the message)\n"
            "  10+N  the artifact is invalid or unreadable: N = -(kvpol status), e.g. 15 = bad magic;\n"
            "        the status name is printed with the message (docs/kvpol-format.md lists them)\n",
            KVCC_VERSION);
}

/* Every command's printing ends here: a write error on stdout (a full disk, /dev/full, a closed
 * pipe) fails the command with status 5 instead of passing silently. */
static int finish_stdout(const char *cmd, int ex) {
    errno = 0;
    int bad = fflush(stdout) != 0 || ferror(stdout);
    int e = errno;
    /* a closed stdout (>&-) that nothing was written to is not an error */
    if (fclose(stdout) != 0 && !bad && errno != EBADF) {
        bad = 1;
        e = errno;
    }
    if (!bad) return ex;
    fprintf(stderr, "kvcc%s%s: cannot write the output to standard output: %s\n", cmd ? " " : "",
            cmd ? cmd : "", e ? strerror(e) : "write error");
    return KVCC_EXIT_FAILED;
}

/* OpenBLAS (libopenblas, which the model's products and the CPU backend run on). */
char *openblas_get_config(void);
char *openblas_get_corename(void);
int openblas_get_num_threads(void);
int openblas_get_parallel(void);

/* kvcc --version: the versions, then what this process would compute with: the BLAS and the
 * kernels it picked for this CPU, its threads, OpenMP's threads, and whether CUDA is usable.
 * The CUDA line is the one place a CPU command loads the CUDA backend (kvrt_cuda_probe). */
static void print_version(void) {
    printf("kvcc %s (.kvpol format %d.%d, libkvrt %s, CUDA backend %s)\n", KVCC_VERSION, KVPOL_VERSION_MAJOR,
           KVPOL_VERSION_MINOR, kvrt_version(), kvrt_has_cuda() ? "built" : "not built");
    const int par = openblas_get_parallel(); /* 0 sequential, 1 pthreads, 2 OpenMP */
    printf("BLAS: %s; kernels %s; %d thread%s (%s)\n", openblas_get_config(), openblas_get_corename(),
           openblas_get_num_threads(), openblas_get_num_threads() == 1 ? "" : "s",
           par == 0 ? "sequential build" : par == 2 ? "OpenMP build" : "pthreads build");
    const char *wait = getenv("OMP_WAIT_POLICY");
    const char *spin = getenv("GOMP_SPINCOUNT");
    printf("OpenMP: %d thread%s, %d processor%s, OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s\n",
           omp_get_max_threads(), omp_get_max_threads() == 1 ? "" : "s", omp_get_num_procs(),
           omp_get_num_procs() == 1 ? "" : "s", wait ? wait : "(unset)", spin ? spin : "(unset)");
    /* the f32 products of the built-in model and of the CPU policies (runtime/cpu/blas.c), then
     * the decode GEMV */
    printf("f32 GEMM (model, CPU policies): %s\n", kvcc_model_gemm_name());
    printf("bf16 (--precision bf16): %s\n", kvcc_model_bf16_name());
    char why[600];
    const int n = kvrt_cuda_probe(why, sizeof why);
    if (n > 0) printf("CUDA: usable, %s\n", why);
    else if (n == 0) printf("CUDA: not usable (no device): %s\n", why);
    else printf("CUDA: not usable: %s\n", why);
}

int main(int argc, char **argv) {
    /* libgomp's default (active) waiting keeps idle OpenMP workers spinning between parallel
     * regions; on a small machine they take the cores that OpenBLAS and the next region need
     * (measured on 2 cores: method selection 5-70x slower). The policy is read when libgomp
     * loads, so kvcc re-executes itself once with OMP_WAIT_POLICY=PASSIVE unless the user chose
     * a policy. If the re-exec fails, kvcc simply carries on.
     * With oneDNN the products run on the OpenMP team itself, so workers that sleep at once
     * (PASSIVE's spin count 0) pay a futex wake-up for every region of the forward pass (a dozen
     * per layer): a short spin first (GOMP_SPINCOUNT 10000, tens of microseconds) unless the user
     * set one. Measured on 2 cores (AMX Xeon): capture of 4 x 576 tokens 3.2/3.1 s -> 2.9 s,
     * an eval of six methods 4.95/5.04 s -> 4.34/4.22 s, every result column identical. */
    if (!getenv("OMP_WAIT_POLICY") && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) {
#if KVCC_WITH_DNNL
        if (!getenv("GOMP_SPINCOUNT")) setenv("GOMP_SPINCOUNT", "10000", 1);
#endif
        execv("/proc/self/exe", argv);
    }
    /* A file-size limit (ulimit -f) makes a write fail with EFBIG, which every writer reports
     * (exit 5, the temp file removed), instead of killing kvcc with SIGXFSZ mid-write and
     * leaving OUT.tmp.XXXXXX behind. */
    signal(SIGXFSZ, SIG_IGN);
    if (argc < 2) {
        usage(stderr);
        return KVCC_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return finish_stdout(NULL, KVCC_EXIT_OK);
    }
    if (!strcmp(cmd, "-V") || !strcmp(cmd, "--version")) {
        print_version();
        return finish_stdout(NULL, KVCC_EXIT_OK);
    }
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } cmds[] = {
        {"models", kvcc_cmd_models}, {"compile", kvcc_cmd_compile}, {"inspect", kvcc_cmd_inspect},
        {"verify", kvcc_cmd_verify}, {"diff", kvcc_cmd_diff}, {"synth", kvcc_cmd_synth}, {"capture", kvcc_cmd_capture}, {"eval", kvcc_cmd_eval},
        {"report", kvcc_cmd_report},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(cmd, cmds[i].name)) return finish_stdout(cmd, cmds[i].fn(argc - 1, argv + 1));
    fprintf(stderr, "kvcc: unknown command '%s' (expected one of: models, compile, capture, synth, eval, inspect, verify, diff, report; see kvcc --help)\n",
            cmd);
    return KVCC_EXIT_USAGE;
}
