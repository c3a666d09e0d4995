/*
 * svg.c: the growable text buffer and the inline SVG heat maps and line charts of `kvcc report`
 * (svg.h). Plain SVG 1.1 elements only (rect, polyline, circle, line, text, linearGradient), so
 * the figures render in any browser or SVG rasterizer without script or network.
 */
#include "svg.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int buf_reserve(kvcc_buf *b, size_t extra) {
    if (b->oom) return -1;
    if (b->n + extra + 1 <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + extra + 1) {
        if (cap > ((size_t)-1) / 2) { b->oom = 1; return -1; }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return -1; }
    b->p = p;
    b->cap = cap;
    return 0;
}

void kvcc_buf_printf(kvcc_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char tmp[512];
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) { b->oom = 1; return; }
    if (buf_reserve(b, (size_t)k)) return;
    if ((size_t)k < sizeof tmp) memcpy(b->p + b->n, tmp, (size_t)k + 1);
    else {
        va_start(ap, fmt);
        vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
        va_end(ap);
    }
    b->n += (size_t)k;
}

void kvcc_buf_puts(kvcc_buf *b, const char *s) {
    size_t k = strlen(s);
    if (buf_reserve(b, k)) return;
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

void kvcc_buf_escape(kvcc_buf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '&': kvcc_buf_puts(b, "&amp;"); break;
        case '<': kvcc_buf_puts(b, "&lt;"); break;
        case '>': kvcc_buf_puts(b, "&gt;"); break;
        case '"': kvcc_buf_puts(b, "&quot;"); break;
        case '\'': kvcc_buf_puts(b, "&#39;"); break;
        default:
            if ((c >= 32 && c < 127) || c == '\n' || c == '\t') {
                if (buf_reserve(b, 1)) return;
                b->p[b->n++] = (char)c;
                b->p[b->n] = 0;
            } else kvcc_buf_puts(b, "&#xFFFD;");
        }
    }
}

static void esc(kvcc_buf *b, const char *s) { if (s) kvcc_buf_escape(b, s, strlen(s)); }

/* ------------------------------------------------------------------ colors */
static const unsigned char viridis[10][3] = {
    {0x44, 0x01, 0x54}, {0x48, 0x28, 0x78}, {0x3e, 0x49, 0x89}, {0x31, 0x68, 0x8e}, {0x26, 0x82, 0x8e},
    {0x1f, 0x9e, 0x89}, {0x35, 0xb7, 0x79}, {0x6e, 0xce, 0x58}, {0xb5, 0xde, 0x2b}, {0xfd, 0xe7, 0x25}};
static const char *const palette[10] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

static void seq_color(double t, char out[8]) {
    if (!(t >= 0)) t = 0;
    if (t > 1) t = 1;
    double x = t * 9;
    int i = (int)x;
    if (i >= 9) i = 8;
    double f = x - i;
    int rgb[3];
    for (int k = 0; k < 3; k++) rgb[k] = (int)lround(viridis[i][k] * (1 - f) + viridis[i + 1][k] * f);
    snprintf(out, 8, "#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

static void cat_color(int k, int n, char out[8]) {
    if (n <= 10) snprintf(out, 8, "%s", palette[((k % 10) + 10) % 10]);
    else seq_color(n > 1 ? (double)k / (n - 1) : 0, out);
}

/* ------------------------------------------------------------------ heat map */
static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

void kvcc_svg_heatmap_write(kvcc_buf *b, const kvcc_svg_heatmap *h) {
    const int rows = h->rows, cols = h->cols;
    if (rows <= 0 || cols <= 0) return;
    const char *fmt = h->fmt ? h->fmt : "%.4g";
    double lo = h->lo, hi = h->hi;
    if (!(lo < hi) && !h->n_categories) {
        lo = INFINITY, hi = -INFINITY;
        for (long i = 0; i < (long)rows * cols; i++)
            if (isfinite(h->v[i]) && (!h->log_color || h->v[i] > 0)) {
                if (h->v[i] < lo) lo = h->v[i];
                if (h->v[i] > hi) hi = h->v[i];
            }
        if (!(lo <= hi)) lo = 0, hi = 1;
    }
    const int cw = clampi(640 / cols, 3, 36), chh = clampi(460 / rows, 3, 22);
    const int left = h->row_names ? 110 : 56, top = 34, legend_w = h->n_categories ? 120 : 90;
    int W = left + cols * cw + 16 + legend_w;
    const int H = top + rows * chh + 44, title_w = left + (int)(h->title ? strlen(h->title) : 0) * 8 + 12;
    if (W < title_w) W = title_w; /* the title is not cut */
    kvcc_buf_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"figure heatmap\" id=\"");
    esc(b, h->id);
    kvcc_buf_printf(b, "\" data-rows=\"%d\" data-cols=\"%d\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n",
                    rows, cols, W, H, W, H);
    kvcc_buf_printf(b, "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", W, H);
    kvcc_buf_printf(b, "<text x=\"%d\" y=\"18\" class=\"ftitle\">", left);
    esc(b, h->title);
    kvcc_buf_puts(b, "</text>\n");
    /* cells */
    char col[8];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            double v = h->v[(long)r * cols + c];
            if (!isfinite(v)) snprintf(col, sizeof col, "#cccccc");
            else if (h->n_categories) cat_color((int)lround(v), h->n_categories, col);
            else if (h->log_color && lo > 0)
                seq_color(v > 0 && hi > lo ? (log10(v) - log10(lo)) / (log10(hi) - log10(lo)) : 0, col);
            else seq_color(hi > lo ? (v - lo) / (hi - lo) : 0.5, col);
            kvcc_buf_printf(b, "<rect class=\"cell\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" data-r=\"%d\" data-c=\"%d\" data-v=\"%.6g\"><title>",
                            left + c * cw, top + r * chh, cw, chh, col, r, c, v);
            if (h->row_names) esc(b, h->row_names[r]);
            else { esc(b, h->row_label); kvcc_buf_printf(b, " %d", r); }
            kvcc_buf_puts(b, ", ");
            if (h->col_names) esc(b, h->col_names[c]);
            else { esc(b, h->col_label); kvcc_buf_printf(b, " %d", c); }
            kvcc_buf_puts(b, ": ");
            char vs[64];
            snprintf(vs, sizeof vs, fmt, v);
            esc(b, vs);
            kvcc_buf_puts(b, "</title></rect>\n");
        }
    /* separators */
    for (int c = h->col_group; h->col_group > 0 && c < cols; c += h->col_group)
        kvcc_buf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ffffff\" stroke-width=\"2\"/>\n",
                        left + c * cw, top, left + c * cw, top + rows * chh);
    for (int r = h->row_group; h->row_group > 0 && r < rows; r += h->row_group)
        kvcc_buf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ffffff\" stroke-width=\"1\"/>\n",
                        left, top + r * chh, left + cols * cw, top + r * chh);
    /* row labels: every row when they fit, else every k-th */
    int rstep = chh >= 10 ? 1 : (10 + chh - 1) / chh;
    if (h->row_group > 1 && rstep > 1) rstep = ((rstep + h->row_group - 1) / h->row_group) * h->row_group;
    for (int r = 0; r < rows; r += rstep) {
        kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\" text-anchor=\"end\">", left - 4,
                        top + r * chh + chh / 2 + 4);
        if (h->row_names) esc(b, h->row_names[r]);
        else kvcc_buf_printf(b, "%d", r);
        kvcc_buf_puts(b, "</text>\n");
    }
    int cstep = cw >= 18 ? 1 : (18 + cw - 1) / cw;
    if (h->col_group > 1 && cstep > 1) cstep = ((cstep + h->col_group - 1) / h->col_group) * h->col_group;
    for (int c = 0; c < cols; c += h->col_ticks ? 1 : cstep) {
        if (h->col_ticks && (!h->col_ticks[c] || !h->col_ticks[c][0])) continue;
        kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\" text-anchor=\"%s\">",
                        h->col_ticks ? left + c * cw + 2 : left + c * cw + cw / 2, top + rows * chh + 13,
                        h->col_ticks ? "start" : "middle");
        if (h->col_ticks) esc(b, h->col_ticks[c]);
        else if (h->col_names) esc(b, h->col_names[c]);
        else kvcc_buf_printf(b, "%d", c);
        kvcc_buf_puts(b, "</text>\n");
    }
    kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"axis\" text-anchor=\"middle\">", left + cols * cw / 2,
                    top + rows * chh + 32);
    esc(b, h->col_label);
    kvcc_buf_printf(b, "</text>\n<text x=\"12\" y=\"%d\" class=\"axis\" transform=\"rotate(-90 12 %d)\" text-anchor=\"middle\">",
                    top + rows * chh / 2, top + rows * chh / 2);
    esc(b, h->row_label);
    kvcc_buf_puts(b, "</text>\n");
    /* legend */
    const int lx = left + cols * cw + 16;
    if (h->n_categories) {
        for (int k = 0; k < h->n_categories && k < 24; k++) {
            cat_color(k, h->n_categories, col);
            kvcc_buf_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%d\" y=\"%d\" class=\"tick\">",
                            lx, top + k * 16, col, lx + 16, top + k * 16 + 10);
            char vs[64];
            snprintf(vs, sizeof vs, fmt, (double)k);
            esc(b, vs);
            kvcc_buf_puts(b, "</text>\n");
        }
    } else {
        const int bh = rows * chh < 120 ? rows * chh : 120 + (rows * chh - 120) / 2;
        kvcc_buf_puts(b, "<defs><linearGradient id=\"");
        esc(b, h->id);
        kvcc_buf_puts(b, "-grad\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">");
        for (int k = 0; k < 10; k++) {
            seq_color(k / 9.0, col);
            kvcc_buf_printf(b, "<stop offset=\"%.3f\" stop-color=\"%s\"/>", k / 9.0, col);
        }
        kvcc_buf_printf(b, "</linearGradient></defs>\n<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"%d\" fill=\"url(#", lx,
                        top, bh);
        esc(b, h->id);
        kvcc_buf_puts(b, "-grad)\" class=\"colorbar\"/>\n");
        if (h->log_color && lo > 0)
            kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\">(log scale)</text>\n", lx, top + bh + 14);
        char vs[64];
        snprintf(vs, sizeof vs, fmt, hi);
        kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\">", lx + 18, top + 9);
        esc(b, vs);
        snprintf(vs, sizeof vs, fmt, lo);
        kvcc_buf_printf(b, "</text>\n<text x=\"%d\" y=\"%d\" class=\"tick\">", lx + 18, top + bh);
        esc(b, vs);
        kvcc_buf_puts(b, "</text>\n");
    }
    kvcc_buf_puts(b, "</svg>\n");
}

/* ------------------------------------------------------------------ line chart */
/* Nice linear ticks over [lo, hi]: at most ~6, multiples of 1, 2 or 5 x 10^k. */
static int nice_ticks(double lo, double hi, double *t, int max) {
    double span = hi - lo;
    if (!(span > 0)) { t[0] = lo; return 1; }
    double raw = span / 5, p = pow(10, floor(log10(raw))), f = raw / p;
    double step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
    int n = 0;
    for (double v = ceil(lo / step) * step; v <= hi + step * 1e-9 && n < max; v += step)
        t[n++] = fabs(v) < step * 1e-9 ? 0 : v;
    return n;
}

/* Ticks of a log axis over [lo, hi] (log10 units): the powers of ten, with 2 and 5 when the
 * range holds fewer than three decades, else every k-th power. Values in log10 units. */
static int log_ticks(double lo, double hi, double *t, int max) {
    int n = 0;
    int a = (int)floor(lo), z = (int)ceil(hi);
    if (z - a < 3) {
        for (int e = a; e <= z && n < max; e++) {
            const double m[3] = {1, 2, 5};
            for (int k = 0; k < 3 && n < max; k++) {
                double v = e + log10(m[k]);
                if (v >= lo - 1e-9 && v <= hi + 1e-9) t[n++] = v;
            }
        }
    } else {
        int step = (z - a + 5) / 6;
        for (int e = a; e <= z && n < max; e += step)
            if (e >= lo - 1e-9 && e <= hi + 1e-9) t[n++] = e;
    }
    if (n < 2) { /* a narrow range: nice ticks of the values themselves, placed on the log axis */
        double v[32];
        int k = nice_ticks(pow(10, lo), pow(10, hi), v, max < 32 ? max : 32);
        n = 0;
        for (int i = 0; i < k; i++)
            if (v[i] > 0) t[n++] = log10(v[i]);
    }
    return n;
}

static void fmt_num(double v, char *out, size_t n) {
    if (v == 0) { snprintf(out, n, "0"); return; }
    double a = fabs(v);
    if (a >= 1e5 || a < 1e-3) snprintf(out, n, "%.2g", v);
    else snprintf(out, n, "%.4g", v);
}

static int usable(double v, int logax) { return isfinite(v) && (!logax || v > 0); }

void kvcc_svg_chart_write(kvcc_buf *b, const kvcc_svg_chart *c) {
    const int legend_w = c->legend ? 190 : 0;
    const int PW = 520, PH = 300, left = 72, top = 34, right = 20, bottom = 52;
    const int W = left + PW + right + legend_w, H = top + PH + bottom + (c->note ? 18 : 0);
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    long drawn = 0;
    for (int s = 0; s < c->n_series; s++)
        for (int i = 0; i < c->s[s].n; i++) {
            double x = c->s[s].x[i], y = c->s[s].y[i];
            if (!usable(x, c->logx) || !usable(y, c->logy)) continue;
            x = c->logx ? log10(x) : x;
            y = c->logy ? log10(y) : y;
            if (x < x0) x0 = x;
            if (x > x1) x1 = x;
            if (y < y0) y0 = y;
            if (y > y1) y1 = y;
            drawn++;
        }
    if (!drawn) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
    if (x1 - x0 < 1e-12) x0 -= 0.5, x1 += 0.5;
    if (y1 - y0 < 1e-12) {
        double d = fabs(y0) > 0 ? fabs(y0) * 0.1 : 0.5;
        y0 -= d, y1 += d;
    }
    double px = (x1 - x0) * 0.04, py = (y1 - y0) * 0.06;
    x0 -= px, x1 += px, y0 -= py, y1 += py;
    if (!c->logy && y0 < 0 && y0 > -py * 1.01) y0 = 0; /* do not dip below 0 for padding only */
    if (!c->logy && c->ylo < c->yhi) {
        double pad = (c->yhi - c->ylo) * 0.04;
        y0 = c->ylo - pad, y1 = c->yhi + pad;
    }
#define SX(v) (left + ((v) - x0) / (x1 - x0) * PW)
#define SY(v) (top + PH - ((v) - y0) / (y1 - y0) * PH)
    kvcc_buf_puts(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"figure chart\" id=\"");
    esc(b, c->id);
    kvcc_buf_printf(b, "\" data-series=\"%d\" data-points=\"%ld\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n",
                    c->n_series, drawn, W, H, W, H);
    kvcc_buf_printf(b, "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", W, H);
    kvcc_buf_printf(b, "<text x=\"%d\" y=\"18\" class=\"ftitle\">", left);
    esc(b, c->title);
    kvcc_buf_puts(b, "</text>\n");
    kvcc_buf_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#888888\"/>\n", left, top,
                    PW, PH);
    double t[32];
    char lab[64];
    int nt = c->logx ? log_ticks(x0, x1, t, 32) : nice_ticks(x0, x1, t, 32);
    for (int i = 0; i < nt; i++) {
        double X = SX(t[i]);
        fmt_num(c->logx ? pow(10, t[i]) : t[i], lab, sizeof lab);
        kvcc_buf_printf(b, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" class=\"grid\"/><text x=\"%.2f\" y=\"%d\" class=\"tick\" text-anchor=\"middle\">%s</text>\n",
                        X, top, X, top + PH, X, top + PH + 14, lab);
    }
    nt = c->logy ? log_ticks(y0, y1, t, 32) : nice_ticks(y0, y1, t, 32);
    for (int i = 0; i < nt; i++) {
        double Y = SY(t[i]);
        fmt_num(c->logy ? pow(10, t[i]) : t[i], lab, sizeof lab);
        kvcc_buf_printf(b, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" class=\"grid\"/><text x=\"%d\" y=\"%.2f\" class=\"tick\" text-anchor=\"end\">%s</text>\n",
                        left, Y, left + PW, Y, left - 4, Y + 4, lab);
    }
    kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"axis\" text-anchor=\"middle\">", left + PW / 2, top + PH + 34);
    esc(b, c->xlabel);
    if (c->logx) kvcc_buf_puts(b, " (log scale)");
    kvcc_buf_printf(b, "</text>\n<text x=\"14\" y=\"%d\" class=\"axis\" transform=\"rotate(-90 14 %d)\" text-anchor=\"middle\">",
                    top + PH / 2, top + PH / 2);
    esc(b, c->ylabel);
    if (c->logy) kvcc_buf_puts(b, " (log)");
    kvcc_buf_puts(b, "</text>\n");
    char col[8];
    for (int s = 0; s < c->n_series; s++) {
        const kvcc_svg_series *se = &c->s[s];
        if (se->shade >= 0) seq_color(se->shade * 0.92, col);
        else cat_color(s, 10, col);
        kvcc_buf_puts(b, "<g class=\"series\" data-name=\"");
        esc(b, se->name);
        kvcc_buf_printf(b, "\" stroke=\"%s\" fill=\"%s\">\n", col, col);
        /* earlier series drawn wider, so a later one lying on top of it leaves it visible */
        const double under = c->n_series > 1 ? (double)(c->n_series - 1 - s) / (c->n_series - 1) : 0;
        /* the line, broken at unusable points */
        int open = 0;
        for (int i = 0; i <= se->n; i++) {
            int ok = i < se->n && usable(se->x[i], c->logx) && usable(se->y[i], c->logy);
            if (ok) {
                double X = SX(c->logx ? log10(se->x[i]) : se->x[i]), Y = SY(c->logy ? log10(se->y[i]) : se->y[i]);
                if (!open) {
                    kvcc_buf_printf(b, "<polyline fill=\"none\" stroke-width=\"%.2f\"%s points=\"",
                                    se->no_markers ? 1.0 : 1.5 + 2.5 * under, se->dashed ? " stroke-dasharray=\"6 4\"" : "");
                    open = 1;
                }
                kvcc_buf_printf(b, "%.2f,%.2f ", X, Y);
            } else if (open) {
                kvcc_buf_puts(b, "\"/>\n");
                open = 0;
            }
        }
        for (int i = 0; !se->no_markers && i < se->n; i++) {
            if (!usable(se->x[i], c->logx) || !usable(se->y[i], c->logy)) continue;
            double X = SX(c->logx ? log10(se->x[i]) : se->x[i]), Y = SY(c->logy ? log10(se->y[i]) : se->y[i]);
            kvcc_buf_printf(b, "<circle class=\"pt\" cx=\"%.2f\" cy=\"%.2f\" r=\"%.2f\" data-x=\"%.6g\" data-y=\"%.6g\"><title>",
                            X, Y, 3 + 3 * under, se->x[i], se->y[i]);
            esc(b, se->name);
            kvcc_buf_printf(b, ": %.6g, %.6g</title></circle>\n", se->x[i], se->y[i]);
        }
        kvcc_buf_puts(b, "</g>\n");
    }
    if (c->legend) {
        const int lx = left + PW + right + 6;
        for (int s = 0; s < c->n_series && s < 18; s++) {
            if (c->s[s].shade >= 0) seq_color(c->s[s].shade * 0.92, col);
            else cat_color(s, 10, col);
            kvcc_buf_printf(b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"%s/><text x=\"%d\" y=\"%d\" class=\"tick\">",
                            lx, top + 8 + s * 16, lx + 22, top + 8 + s * 16, col,
                            c->s[s].dashed ? " stroke-dasharray=\"6 4\"" : "", lx + 28, top + 12 + s * 16);
            esc(b, c->s[s].name);
            kvcc_buf_puts(b, "</text>\n");
        }
        if (c->n_series > 18)
            kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\">... %d more</text>\n", lx, top + 12 + 18 * 16,
                            c->n_series - 18);
    }
    if (c->note) {
        kvcc_buf_printf(b, "<text x=\"%d\" y=\"%d\" class=\"tick\">", left, H - 6);
        esc(b, c->note);
        kvcc_buf_puts(b, "</text>\n");
    }
    kvcc_buf_puts(b, "</svg>\n");
#undef SX
#undef SY
}
