/*
 * progress.c: a one-line progress bar on stderr, drawn only when stderr is a terminal (CI logs
 * stay quiet). Used by long-running kvcc commands.
 */
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "kvcc.h"

static double t_start;
static const char *label_;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void kvcc_progress_begin(const char *label) {
    label_ = label;
    t_start = now_s();
}

void kvcc_progress(unsigned done, unsigned total) {
    if (!isatty(STDERR_FILENO) || total == 0) return;
    int width = 30, fill = (int)((double)done / total * width);
    double el = now_s() - t_start, eta = done ? el / done * (total - done) : 0;
    fprintf(stderr, "\r%s [", label_ ? label_ : "");
    for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %u/%u  %.1fs elapsed, ~%.1fs left ", done, total, el, eta);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

double kvcc_progress_elapsed(void) { return now_s() - t_start; }
