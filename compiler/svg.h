/*
 * svg.h: a growable text buffer and the inline SVG figures of `kvcc report` (compiler/svg.c):
 * heat maps and line charts written as plain SVG elements, no script, no external resource, so
 * the HTML page they go into reads offline. Every plotted element carries its value in a data-
 * attribute and a <title> tooltip, so a test (or a reader) can check what was drawn.
 *
 * defines: kvcc_buf, kvcc_buf_printf, kvcc_buf_puts, kvcc_buf_escape, kvcc_svg_heatmap,
 *          kvcc_svg_heatmap_write, kvcc_svg_series, kvcc_svg_chart, kvcc_svg_chart_write
 */
#ifndef KVCC_SVG_H
#define KVCC_SVG_H
#include <stddef.h>

/* A text buffer; `oom` is set (and further writes are dropped) when an allocation fails. */
typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} kvcc_buf;
void kvcc_buf_printf(kvcc_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvcc_buf_puts(kvcc_buf *b, const char *s);
/* s (n bytes) escaped for HTML text and attribute values (& < > " '); bytes that are not
 * printable ASCII are written as U+FFFD unless they are tab or newline. */
void kvcc_buf_escape(kvcc_buf *b, const char *s, size_t n);

/* A heat map of rows x cols values (row-major). Cells are <rect class="cell"> with data-r,
 * data-c and data-v; categorical maps (n_categories > 0) color value k with palette entry k.
 * lo/hi: the color range (lo >= hi: the data's min and max). Non-finite values are drawn gray. */
typedef struct {
    const char *id, *title, *row_label, *col_label;
    int rows, cols;
    const double *v;
    double lo, hi;
    const char *fmt;             /* tooltip value format, e.g. "%.4g" (NULL: "%.4g") */
    const char *const *row_names; /* optional [rows] */
    const char *const *col_names; /* optional [cols] (tooltips; tick labels unless col_ticks) */
    const char *const *col_ticks; /* optional [cols]: tick labels ("" or NULL entries: none) */
    int n_categories;             /* > 0: categorical */
    int col_group;                /* > 0: a thin separator every col_group columns */
    int row_group;                /* > 0: the same every row_group rows */
    int log_color;                /* 1: color by log10 of the value (values > 0; heavy-tailed errors) */
} kvcc_svg_heatmap;
void kvcc_svg_heatmap_write(kvcc_buf *b, const kvcc_svg_heatmap *h);

/* One line of a chart: n points; non-finite points (and <= 0 ones on a log axis) are skipped
 * and break the line. color < 0: the palette entry of its index; a shade of the sequential map
 * when shade in [0, 1] (many lines colored by, e.g., layer). */
typedef struct {
    const char *name;
    int n;
    const double *x, *y;
    int dashed;
    double shade;    /* < 0: palette by index; else [0, 1] on the sequential map */
    int no_markers;  /* 1: the line only (many-line charts) */
} kvcc_svg_series;
/* Line chart. Each series is a <g class="series" data-name>, with <polyline> and one
 * <circle class="pt" data-x data-y> per drawn point (unless no_markers). */
typedef struct {
    const char *id, *title, *xlabel, *ylabel;
    int logx, logy;
    int n_series;
    const kvcc_svg_series *s;
    int legend;       /* 1: a legend of the series' names (0: none, e.g. 90 heads) */
    double ylo, yhi;  /* ylo < yhi: a fixed y range (linear axis), e.g. 0..1 for a fraction */
    const char *note; /* optional caption under the chart */
} kvcc_svg_chart;
void kvcc_svg_chart_write(kvcc_buf *b, const kvcc_svg_chart *c);
#endif
