/*
 * progress.c: progress of long-running kvcc commands on stderr. On a terminal, a one-line bar
 * redrawn in place. Elsewhere (CI logs, files, pipes), one plain line at most every
 * KVCC_PROGRESS_INTERVAL seconds (default 60; 0 turns the lines off), the first after that many
 * seconds, so a short run prints nothing and a long one shows in its log that it is alive and
 * how far it is:
 *     kvcc: compilerkv: 412/1080 (38%), 600 s elapsed, ~970 s left
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "dist.h"
#include "kvcc.h"
#include "stats.h"

static double t_start, t_last_line, line_every = 60.0;
static const char *label_;

/* The seconds between plain lines (KVCC_PROGRESS_INTERVAL; an invalid value: the default, said
 * once). */
static double line_interval(void) {
    static int warned;
    const char *s = getenv("KVCC_PROGRESS_INTERVAL");
    if (s == NULL || *s == '\0') return 60.0;
    char *end;
    const double v = strtod(s, &end);
    if (*end == '\0' && v >= 0.0 && v <= 86400.0) return v;
    if (!warned++)
        fprintf(stderr, "kvcc: warning: KVCC_PROGRESS_INTERVAL='%s', expected seconds in 0..86400; "
                "using 60\n", s);
    return 60.0;
}

void kvcc_progress_begin(const char *label) {
    static char lb[128];
    /* under mpirun only rank 0's lines reach the terminal: they count rank 0's share */
    if (kvcc_dist_size() > 1 && label) {
        snprintf(lb, sizeof lb, "%s, rank 0's share of %d ranks", label, kvcc_dist_size());
        label = lb;
    }
    label_ = label;
    t_start = t_last_line = kvcc_now_s();
    line_every = line_interval();
}

void kvcc_progress(unsigned done, unsigned total) {
    if (total == 0) return;
    const double now = kvcc_now_s(), el = now - t_start;
    const double eta = done ? el / done * (total - done) : 0;
    if (!isatty(STDERR_FILENO)) {
        if (line_every <= 0.0 || done >= total || now - t_last_line < line_every) return;
        t_last_line = now;
        fprintf(stderr, "kvcc: %s: %u/%u (%.0f%%), %.0f s elapsed, ~%.0f s left\n",
                label_ ? label_ : "progress", done, total, 100.0 * done / total, el, eta);
        fflush(stderr);
        return;
    }
    int width = 30, fill = (int)((double)done / total * width);
    fprintf(stderr, "\r%s [", label_ ? label_ : "");
    for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %u/%u  %.1fs elapsed, ~%.1fs left ", done, total, el, eta);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

double kvcc_progress_elapsed(void) { return kvcc_now_s() - t_start; }
