/*
 * progress.c: a one-line progress bar on stderr, drawn only when stderr is a terminal (CI logs
 * stay quiet). Used by long-running kvcc commands.
 */
#include <stdio.h>
#include <unistd.h>

#include "kvcc.h"
#include "stats.h"

static double t_start;
static const char *label_;

void kvcc_progress_begin(const char *label) {
    label_ = label;
    t_start = kvcc_now_s();
}

void kvcc_progress(unsigned done, unsigned total) {
    if (!isatty(STDERR_FILENO) || total == 0) return;
    int width = 30, fill = (int)((double)done / total * width);
    double el = kvcc_now_s() - t_start, eta = done ? el / done * (total - done) : 0;
    fprintf(stderr, "\r%s [", label_ ? label_ : "");
    for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %u/%u  %.1fs elapsed, ~%.1fs left ", done, total, el, eta);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

double kvcc_progress_elapsed(void) { return kvcc_now_s() - t_start; }
