/*
 * kvcc.h: internals shared by the kvcc command-line tool's subcommands (compiler/).
 * Each `kvcc NAME` is one `int kvcc_cmd_NAME(int argc, char **argv)` returning the process
 * exit status; errors go to stderr naming the file, the field and the expected value.
 */
#ifndef KVCC_H
#define KVCC_H

#include <stdio.h>

#include "kvpol.h"
#include "kvrt_experimental.h"

#define KVCC_VERSION "0.1.0"

/* Exit statuses (documented in `kvcc --help` and docs/cli.md). */
enum {
    KVCC_EXIT_OK = 0,
    KVCC_EXIT_DIFFER = 1,         /* kvcc diff: the artifacts differ */
    KVCC_EXIT_USAGE = 2,          /* bad command line */
    KVCC_EXIT_MISMATCH = 4,       /* artifact compiled for another model (verify --model, eval --policy) */
    KVCC_EXIT_FAILED = 5,         /* the command could not do its job (see message) */
    KVCC_EXIT_ARTIFACT_BASE = 10, /* 10 + |kvpol status|: the artifact is unreadable/invalid */
};
static inline int kvcc_exit_for_kvpol(int status) { return status == 0 ? 0 : KVCC_EXIT_ARTIFACT_BASE - status; }
/* The exit status for a libkvrt failure on an artifact: KVRT_ERR_FORMAT / _IO 10 + |kvpol status|
 * (10 alone when a policy's tables fail libkvrt's own checks: no kvpol status), a model mismatch
 * 4, a bad argument 2, anything else 5. */
int kvcc_exit_for_kvrt(int status, int detail);
/* Every policy group the artifact carries, opened as a serving stack opens it (kvrt_am_open,
 * ...), each reported to each(user, "kvrt_am_open", status, message or NULL) when each is given:
 * KVRT_OK, or the first failure's status with its "kvrt_X_open: message" in msg. */
int kvcc_open_policy_groups(kvrt_policy *p, void (*each)(void *, const char *, int, const char *),
                            void *user, char *msg, size_t msglen);

int kvcc_cmd_models(int argc, char **argv);
int kvcc_cmd_inspect(int argc, char **argv);
int kvcc_cmd_verify(int argc, char **argv);
int kvcc_cmd_diff(int argc, char **argv);
int kvcc_cmd_compile(int argc, char **argv);
int kvcc_cmd_synth(int argc, char **argv);
int kvcc_cmd_capture(int argc, char **argv);
int kvcc_cmd_eval(int argc, char **argv);
int kvcc_cmd_report(int argc, char **argv);

/* Shared helpers (compiler/util.c). */
const char *kvcc_group_name(uint32_t group);
const char *kvcc_rope_name(uint32_t type);
/* Print s (n bytes) with non-printable bytes escaped, cut at max bytes with "...". */
void kvcc_print_escaped(FILE *out, const char *s, size_t n, size_t max);
/* Whether a switch in the environment is on: set, not empty and not "0" (KVCC_DIST_TIMES=1, ...). */
int kvcc_env_on(const char *name);
/* Open an artifact with full validation; prints the error on failure. */
int kvcc_open_artifact(const char *path, kvpol_file **out);
/* Progress on stderr when it is a terminal (compiler/progress.c). */
void kvcc_progress_begin(const char *label);
void kvcc_progress(unsigned done, unsigned total);
double kvcc_progress_elapsed(void);
/* Every regular *.txt file of dir, sorted (so results do not depend on readdir order): malloc'd
 * paths into paths[cap]; -1 when dir cannot be opened. */
int kvcc_list_texts(const char *dir, char **paths, int cap);
/* Where the bundled data file or directory `rel` (a path relative to a checkout's root, e.g.
 * "examples/data/calib") is: `rel` itself when it exists from the current directory, else
 * <directory of the kvcc executable>/../share/kvcc/<rel> (make install puts the texts and a
 * fetched model there), else <that directory>/../<rel> or /../../<rel> where that directory is
 * a checkout's root (it holds compiler/kvcc.h: kvcc in build/ or build/san/), else `rel`
 * (so that messages name the documented default). buf receives a path found that way. */
const char *kvcc_data_path(const char *rel, char *buf, size_t cap);
/* getopt_long for command CMD, with kvcc's messages instead of getopt's: an unknown option, a
 * missing value, or a value that is itself an option (`--model -o x`: not a number, starts with
 * "--" or "-" and a letter) prints "kvcc CMD: ..." with a pointer to CMD --help and returns '?'. */
struct option;
int kvcc_getopt(const char *cmd, int argc, char **argv, const char *shortopts,
                const struct option *longopts);
/* 1 when list is a comma-separated list of non-empty items shorter than cap bytes (no leading,
 * trailing or doubled comma), else 0; the caller says what it expected. */
int kvcc_list_ok(const char *list, size_t cap);
/* Parse an unsigned integer option in [lo, hi]; prints "kvcc CMD: --NAME: ..." and returns -1 on error. */
int kvcc_parse_u32(const char *cmd, const char *opt, const char *s, unsigned lo, unsigned hi, unsigned *out);
/* An input file of a command that writes one: the option that named it, its path (NULL: none). */
typedef struct {
    const char *opt, *path;
} kvcc_input;
/* Before any work: refuse an output path that is empty, a directory, a device, FIFO or socket,
 * the same file as one of the n_in inputs (same path, or same st_dev/st_ino), or in a directory
 * that does not exist or is not writable. Prints "kvcc CMD: ..." naming the paths;
 * KVCC_EXIT_USAGE, or 0 when it is fine. */
int kvcc_check_output(const char *cmd, const char *out, const kvcc_input *in, int n_in);
/* 1 when a and b are the same path, or both exist with the same device and inode. */
int kvcc_same_file(const char *a, const char *b);
/* A failing rank's message as kvcc_dist_check carries it ("rank R: LINE"), without the command
 * prefix `pre` ("kvcc compile: ") that LINE starts with when it is the last line the rank
 * printed, so that the command's own prefix is not said twice. */
void kvcc_strip_rank_prefix(char *msg, const char *pre);
/* FNV-1a 64 (calib/hash.h) of the command line, each argument with its NUL: the part of the
 * digest every MPI rank compares that its options make. */
uint64_t kvcc_argv_digest(int argc, char **argv);
/* On SIGINT, SIGTERM, SIGHUP, SIGQUIT or SIGPIPE, remove the OUT.tmp.XXXXXX this process has
 * open (found through /proc/self/fd with async-signal-safe calls), then die of the signal. */
void kvcc_remove_temp_on_signal(const char *out);
/* The uncompressed reference: a host f32 cache holding every one of the C context tokens of
 * k, v [C, Hkv, d] for every KV head (the same gather every compressed row goes through).
 * kvrt status; message in kvrt_last_error(). */
int kvcc_full_cache(const float *k, const float *v, int64_t C, uint32_t Hkv, uint32_t d, kvrt_cache **out);
#endif
