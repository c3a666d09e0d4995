#!/usr/bin/env python3
"""am_scipy.py: the Attention Matching compaction of one head (runtime/cpu/am.c, HighestAttnKeys)
written with numpy + scipy (scipy.optimize.nnls, scipy.linalg.cho_factor), timed on the inputs that
bench_am --head T --dump DIR wrote. Called by bench/am_vs_scipy.sh, which prints the ratio of
the two times, and imported by python/tests/test_am_scipy.py, which checks the C compaction
against it on real SmolLM2 activations.

Same algorithm and options as the C call it is timed against (the defaults of kvrt_am_opts, read
from DIR/meta.txt; docs/policies/am.md): the first n_sink keys and the last
round(recent_frac * t) keys kept exactly, the middle compacted to the rest of t; the middle in
chunks of `chunk` keys with proportional budgets (cumulative rounding); per chunk logits
Q K^T / sqrt(d) (every query sees every key: bench_am passes no positions), P = exp(z - rowmax),
keys = top-t of the RMS over queries of softmax columns, weights w >= 0 by NNLS on the rows
divided by the mass (relative mass error); with a beta floor every selected key stays with
w = max(w, exp(floor)) (beta_floor nan: keys of weight 0 dropped); values by the ridge least
squares of X = softmax(z_sel + beta) against Y = softmax(z) V (lambda = ridge * trace(X^T X) / t,
Cholesky, x100 on failure, as kvrt_cpu_ridge_solve). Errors as kvrt_am_stats: chunk-local, the
exact keys not in them. Products in float32 (as the C code's sgemm), NNLS and least squares in
float64. What differs: the order of the sums, and the NNLS solvers' stopping rules, so the
results agree to several digits, not bit for bit.
"""
import math
import statistics
import sys
import time

import numpy as np
import scipy.linalg
import scipy.optimize


def lround(x):
    """C's llround for x >= 0 (halves away from zero; Python's round() goes to even; floor(x + 0.5)
    is off just below a half and for odd values past 2^52)."""
    f = math.floor(x)
    return int(f) + (1 if x - f >= 0.5 else 0)


def ridge_values(X, Y, ridge):
    """argmin ||X C - Y||^2 + lam ||C||^2, lam = ridge * trace(X^T X) / t, by Cholesky of the
    normal equations; where the factor fails, lam x 100, up to three times (kvrt_cpu_ridge_solve)."""
    G, R = X.T @ X, X.T @ Y
    t = G.shape[0]
    tr = float(np.trace(G))
    scale = (tr if tr > 0 else 1.0) / t
    lam = (ridge if ridge > 0 else 1e-12) * scale
    for attempt in range(4):
        if attempt:
            lam = lam * 100 if lam > 0 else 1e-12 * scale
        try:
            c = scipy.linalg.cho_factor(G + lam * np.eye(t), lower=True)
        except np.linalg.LinAlgError:
            continue
        C = scipy.linalg.cho_solve(c, R)
        if np.isfinite(C).all():
            return C
    raise np.linalg.LinAlgError("the values' least squares is singular")


def compact_chunk(K, V, Q, tc, floor, ridge):
    T, d = K.shape
    S = (Q @ K.T) * np.float32(1.0 / math.sqrt(d))
    S -= S.max(axis=1, keepdims=True)
    P = np.exp(S)
    mass = P.sum(axis=1, dtype=np.float64)
    A = P / mass[:, None].astype(np.float32)
    Y = (A @ V).astype(np.float64)
    score = np.sqrt((A.astype(np.float64) ** 2).mean(axis=0))
    sel = np.sort(np.argsort(-score, kind="stable")[:tc])
    M = P[:, sel].astype(np.float64) / mass[:, None]
    w, _ = scipy.optimize.nnls(M, np.ones(M.shape[0]), maxiter=3 * tc + 30)
    pos = (w > 0) & np.isfinite(np.log(np.where(w > 0, w, 1.0)))
    if not pos.any():
        w = np.ones_like(w)
    elif math.isnan(floor):
        sel, w = sel[pos], w[pos]
    else:
        wmin = math.exp(floor)
        w = np.where(pos & (w > wmin), w, wmin)
    X = P[:, sel].astype(np.float64) * w
    s = X.sum(axis=1)
    mass_err = float((np.abs(s - mass) / mass).sum())
    X /= np.where(s > 0, s, 1.0)[:, None]
    Cv = ridge_values(X, Y, ridge)
    O = X @ Cv
    out_err = float((np.linalg.norm(O - Y, axis=1) / (np.linalg.norm(Y, axis=1) + 1e-30)).sum())
    return sel, np.log(w), Cv, mass_err, out_err


def compact(K, V, Q, t, chunk, n_sink, recent_frac, floor, ridge=1e-6):
    """Returns (entries kept, mean mass error, mean output error, [(positions, beta, values) per
    compacted chunk]); python/tests/test_am_scipy.py compares it with kvrt.am_compact."""
    T, d = K.shape
    ns = min(n_sink, t)
    nr = min(lround(recent_frac * t), t - ns)
    tm, a, Tm = t - ns - nr, ns, T - ns - nr
    out = []
    mass_err, out_err, nq = 0.0, 0.0, 0
    kept = ns + nr  # the exact keys
    if tm > 0 and Tm > 0:
        ch = chunk if 0 < chunk < Tm else Tm
        for c0 in range(0, Tm, ch):
            c1 = min(Tm, c0 + ch)
            tc = lround(tm * c1 / Tm) - lround(tm * c0 / Tm)
            if tc == 0:
                continue
            if tc >= c1 - c0:  # a share of every key: the keys themselves (kvrt's rule)
                sel, beta = np.arange(c1 - c0), np.zeros(c1 - c0)
                Cv, me, oe = V[a + c0:a + c1].astype(np.float64), 0.0, 0.0
            else:
                sel, beta, Cv, me, oe = compact_chunk(K[a + c0:a + c1], V[a + c0:a + c1], Q, tc,
                                                      floor, ridge)
            mass_err += me
            out_err += oe
            nq += Q.shape[0]
            kept += len(sel)
            out.append((a + c0 + sel, beta, Cv))
    return kept, (mass_err / nq if nq else 0.0), (out_err / nq if nq else 0.0), out


def main():
    if len(sys.argv) != 2:
        print("usage: am_scipy.py DIR (written by bench_am --head T --dump DIR)", file=sys.stderr)
        return 2
    d_ = sys.argv[1]
    meta = dict(line.split() for line in open(f"{d_}/meta.txt"))
    T, d, n, t, chunk = (int(meta[k]) for k in ("T", "d", "n", "t", "chunk"))
    # older dumps had no options: the call then compacted all T keys, dropping zero weights
    n_sink = int(meta.get("n_sink", 0))
    recent_frac = float(meta.get("recent_frac", 0.0))
    floor = float(meta.get("beta_floor", "nan"))
    ridge = float(meta.get("ridge", 1e-6))
    if meta.get("select") != "highest":
        print("am_scipy.py: only HighestAttnKeys is written here", file=sys.stderr)
        return 2
    K = np.fromfile(f"{d_}/k.f32", dtype=np.float32).reshape(T, d)
    V = np.fromfile(f"{d_}/v.f32", dtype=np.float32).reshape(T, d)
    Q = np.fromfile(f"{d_}/q.f32", dtype=np.float32).reshape(n, d)
    times, cpus = [], []
    for _ in range(int(meta.get("reps", 1))):
        t0, c0 = time.perf_counter(), time.process_time()
        kept, me, oe, _ = compact(K, V, Q, t, chunk, n_sink, recent_frac, floor, ridge)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    med, best, cmed = statistics.median(times), min(times), statistics.median(cpus)
    print(f"am head (numpy {np.__version__} + scipy {scipy.__version__}): T {T} d {d} queries {n} "
          f"t {t} (kept {kept}): {med:.3f} s (median of {len(times)}, best {best:.3f} s; CPU {cmed:.3f} s)  "
          f"mass relerr {me:.4f}  out relerr {oe:.4f}")
    print(f"py_seconds {med:.6f}")
    print(f"py_cpu_seconds {cmed:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
