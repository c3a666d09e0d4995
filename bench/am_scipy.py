#!/usr/bin/env python3
"""am_scipy.py: the Attention Matching compaction of one head (runtime/cpu/am.c, HighestAttnKeys)
written with numpy + scipy (scipy.optimize.nnls, numpy.linalg.lstsq), timed on the inputs that
bench_am --head T --dump DIR wrote. Called by bench/am_vs_scipy.sh, which prints the ratio of
the two times; not a test.

Same algorithm as the C code: per chunk of 4096 keys with its proportional budget (cumulative
rounding), logits Q K^T / sqrt(d) (every query sees every key: bench_am passes no positions),
P = exp(z - rowmax), keys = top-t of the RMS over queries of softmax columns, weights w >= 0 by
NNLS on the rows divided by the mass (relative mass error), beta = log w, keys of weight 0
dropped, values by least squares of X = softmax(z_sel + beta) against Y = softmax(z) V.
Products in float32 (as the C code's sgemm), NNLS and least squares in float64.
"""
import math
import statistics
import sys
import time

import numpy as np
import scipy.optimize


def compact(K, V, Q, t, chunk):
    T, d = K.shape
    out = []
    mass_err, out_err, nq = 0.0, 0.0, 0
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        tc = round(t * c1 / T) - round(t * c0 / T)
        if tc == 0:
            continue
        S = (Q @ K[c0:c1].T) * np.float32(1.0 / math.sqrt(d))
        S -= S.max(axis=1, keepdims=True)
        P = np.exp(S)
        mass = P.sum(axis=1, dtype=np.float64)
        A = P / mass[:, None].astype(np.float32)
        Y = (A @ V[c0:c1]).astype(np.float64)
        score = np.sqrt((A.astype(np.float64) ** 2).mean(axis=0))
        sel = np.sort(np.argsort(-score, kind="stable")[:tc])
        M = P[:, sel].astype(np.float64) / mass[:, None]
        w, _ = scipy.optimize.nnls(M, np.ones(M.shape[0]), maxiter=3 * tc + 30)
        keep = w > 0
        sel, w = sel[keep], w[keep]
        X = P[:, sel].astype(np.float64) * w
        s = X.sum(axis=1)
        mass_err += float(np.abs(s - mass).__truediv__(mass).sum())
        X /= np.where(s > 0, s, 1.0)[:, None]
        Cv = np.linalg.lstsq(X, Y, rcond=None)[0]
        O = X @ Cv
        out_err += float((np.linalg.norm(O - Y, axis=1) / (np.linalg.norm(Y, axis=1) + 1e-30)).sum())
        nq += Q.shape[0]
        out.append((c0 + sel, np.log(w), Cv))
    kept = sum(len(o[0]) for o in out)
    return kept, mass_err / nq, out_err / nq


def main():
    if len(sys.argv) != 2:
        print("usage: am_scipy.py DIR (written by bench_am --head T --dump DIR)", file=sys.stderr)
        return 2
    d_ = sys.argv[1]
    meta = dict(line.split() for line in open(f"{d_}/meta.txt"))
    T, d, n, t, chunk = (int(meta[k]) for k in ("T", "d", "n", "t", "chunk"))
    if meta.get("select") != "highest":
        print("am_scipy.py: only HighestAttnKeys is written here", file=sys.stderr)
        return 2
    K = np.fromfile(f"{d_}/k.f32", dtype=np.float32).reshape(T, d)
    V = np.fromfile(f"{d_}/v.f32", dtype=np.float32).reshape(T, d)
    Q = np.fromfile(f"{d_}/q.f32", dtype=np.float32).reshape(n, d)
    times, cpus = [], []
    for _ in range(int(meta.get("reps", 1))):
        t0, c0 = time.perf_counter(), time.process_time()
        kept, me, oe = compact(K, V, Q, t, chunk)
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
