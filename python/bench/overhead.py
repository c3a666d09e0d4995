"""Per-call overhead of the Python layer over libkvrt on small inputs.

For each call: the C call timed in C (overhead.c, built here against the in-tree library), the
same C function called through ctypes directly (lib.kvrt_*), and the kvrt Python call (argument
checks, handle objects). Median of 15 repetitions, microseconds per call, one CPU thread
(the context of the attention is created with threads=1).

    python3 python/bench/overhead.py         # from the checkout, after `make`
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("KVCC_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("KVRT_LIBRARY", os.path.join(BUILD, "libkvrt.so"))
import kvrt  # noqa: E402
from kvrt import _lib  # noqa: E402

T, H, HKV, D = 128, 9, 3, 64


def med(fn, iters):
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ts.append((time.perf_counter() - t0) / iters * 1e6)
    return sorted(ts)[7]


def c_times():
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "overhead")
        subprocess.check_call(["cc", "-std=c11", "-O2", "-I", os.path.join(ROOT, "runtime", "include"),
                               os.path.join(HERE, "overhead.c"), "-o", exe, "-L", BUILD, "-lkvrt",
                               f"-Wl,-rpath,{BUILD}", "-lm"])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.check_output([exe], text=True, env=env)
    return {l.split()[0]: float(l.split()[1]) for l in out.splitlines()}


def main():
    rng = np.random.default_rng(1)
    q = (rng.random((T, H, D), dtype=np.float32) - 0.5)
    k = (rng.random((T, HKV, D), dtype=np.float32) - 0.5)
    v = k * 0.5
    ctx = kvrt.Context("cpu", threads=1)
    sel = kvrt.method_select("streaming", None, k, 64)
    cache = kvrt.Cache.gather(k, v, sel)
    q1 = np.ascontiguousarray(q[:1])
    out = np.empty((1, H, D), np.float32)
    scores = np.ascontiguousarray(q.reshape(-1)[:128])
    idx = np.empty(16, np.int32)
    lib = _lib.lib
    scale = 1 / np.sqrt(D)
    o = _lib.kvrt_method_opts()
    lib.kvrt_method_opts_init(ctypes.byref(o), 1, 64)
    qp, kp, vp, op, sp, ip = (a.ctypes.data for a in (q1, k, v, out, scores, idx))

    def raw_select():
        s = ctypes.c_void_p()
        lib.kvrt_method_select(ctypes.byref(o), None, kp, None, T, H, HKV, D, ctypes.byref(s))
        lib.kvrt_selection_free(s)

    def raw_gather():
        c = ctypes.c_void_p()
        lib.kvrt_cache_gather(kp, vp, T, HKV, D, sel.ptr, 1, ctypes.byref(c))
        lib.kvrt_cache_free(c)

    rows = [
        ("kvrt_version", 200000, lambda: lib.kvrt_version(), lambda: kvrt._lib.lib.kvrt_version()),
        ("kvrt_topk", 20000, lambda: lib.kvrt_topk(sp, 128, 16, ip), lambda: kvrt.topk(scores, 16)),
        ("kvrt_attend", 5000,
         lambda: lib.kvrt_attend(ctx.ptr, qp, 1, H, cache.ptr, None, None, 0, scale, op, None),
         lambda: kvrt.attend(q1, cache, ctx=ctx, out=out)),
        ("kvrt_method_select", 5000, raw_select,
         lambda: kvrt.method_select("streaming", None, k, 64).close()),
        ("kvrt_cache_gather", 5000, raw_gather, lambda: kvrt.Cache.gather(k, v, sel).close()),
    ]
    ct = c_times()
    print(f"T={T} H={H} Hkv={HKV} d={D}, one thread; median of 15, microseconds per call")
    print(f"{'call':22s} {'C':>9s} {'ctypes':>9s} {'kvrt':>9s} {'kvrt - C':>9s}")
    for name, iters, raw, wrapped in rows:
        tr, tw = med(raw, iters), med(wrapped, iters)
        print(f"{name:22s} {ct[name]:9.2f} {tr:9.2f} {tw:9.2f} {tw - ct[name]:9.2f}")


if __name__ == "__main__":
    main()
