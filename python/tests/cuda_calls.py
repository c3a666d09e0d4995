"""The binding's calls on a CUDA context with device arrays, against the same calls on the CPU.
Run by test_cuda_emulated.py in a fresh process with KVRT_CUDA_LIBRARY set to tests/cuda_emu's
emulated plugin (the CUDA backend's own code run on the CPU; the plugin is loaded once per
process), and by scripts/device-check.sh on a GPU. Device arrays are the context's memory seen
through ``__cuda_array_interface__``, as a torch CUDA tensor would be.
Usage: cuda_calls.py quest|calls NPZ (q [T, H, d] or, for quest, [H, d]; k, v [T, Hkv, d]);
prints "<what> on cuda: OK"."""
import ctypes
import sys

import numpy as np

import kvrt
from kvrt._lib import lib


class Dev:
    """A device array of ctx's memory holding a copy of host."""

    def __init__(self, ctx, host):
        host = np.ascontiguousarray(host)
        self.ctx, self.shape, self.dtype = ctx, host.shape, host.dtype
        p = ctypes.c_void_p()
        assert lib.kvrt_ctx_alloc(ctx.ptr, max(host.nbytes, 1), ctypes.byref(p)) == 0
        assert lib.kvrt_ctx_upload(ctx.ptr, p, host.ctypes.data, host.nbytes) == 0
        self.p = p.value
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str,
                                         "data": (p.value, False), "version": 3, "strides": None}

    @classmethod
    def empty(cls, ctx, shape, dtype=np.float32):
        return cls(ctx, np.zeros(shape, dtype))

    def get(self):
        a = np.empty(self.shape, self.dtype)
        assert lib.kvrt_ctx_download(self.ctx.ptr, a.ctypes.data, self.p, a.nbytes) == 0
        return a


def refused(call, needle):
    try:
        call()
    except kvrt.KvrtError as e:
        assert needle in str(e), e
        return
    raise SystemExit(f"accepted, expected an error naming {needle!r}")


def same_cache(got, ref, what, tol=1e-5):
    g, r = got.to_numpy(), ref.to_numpy()
    assert np.array_equal(g.offsets, r.offsets), f"{what}: offsets"
    assert np.array_equal(g.positions, r.positions), f"{what}: positions"
    for name in ("keys", "values", "bias"):
        a, b = getattr(g, name).astype(np.float64), getattr(r, name).astype(np.float64)
        err = np.abs(a - b).max() if a.size else 0.0
        assert err <= tol * (1 + np.abs(b).max() if b.size else 1), f"{what}: {name} {err}"


def quest(d, ctx):
    k, q = d["k"], d["q"]
    q = np.ascontiguousarray(q[-1]) if q.ndim == 3 else q  # one step: the last token's
    T, Hkv, D = k.shape
    qs = kvrt.Quest.create(ctx, Hkv, D, page=16, capacity=T)
    assert qs.device == "cuda"
    qs.append(Dev(ctx, k[:21]))
    qs.append(Dev(ctx, k[21:]))
    whole = kvrt.Quest(k, page=16)
    assert qs.n_pages == whole.n_pages, (qs.n_pages, whole.n_pages)
    assert np.array_equal(qs.kmin, whole.kmin) and np.array_equal(qs.kmax, whole.kmax)
    s = Dev.empty(ctx, (Hkv, qs.n_pages))
    qs.scores(Dev(ctx, q), out=s)
    assert np.array_equal(s.get(), whole.scores(q)), "scores differ"
    p = Dev.empty(ctx, (Hkv, 3), np.int32)
    qs.select(Dev(ctx, q), 3, out=p)
    assert np.array_equal(p.get(), whole.select(q, 3)), "pages differ"
    refused(lambda: qs.scores(q), "cuda")            # a host array for a device summary
    refused(lambda: qs.scores(Dev(ctx, q)), "out")   # no out
    refused(lambda: qs.append(Dev(ctx, k[:1])), "capacity")


def calls(d, ctx):
    q, k, v = d["q"], d["k"], d["v"]  # [T, H, d], [T, Hkv, d] x 2
    T, H, D = q.shape
    Hkv = k.shape[1]
    dq, dk, dv = Dev(ctx, q), Dev(ctx, k), Dev(ctx, v)
    # Attention Matching, the layer call with both key selections
    for sel in ("highest", "omp"):
        ref, rs = kvrt.am_compact_layer(q, k, v, ratio=0.2, key_select=sel)
        got, gs = kvrt.am_compact_layer(dq, dk, dv, ratio=0.2, key_select=sel, ctx=ctx)
        assert got.device == "cuda" and got.ctx is ctx
        same_cache(got, ref, f"am_compact_layer {sel}")
        assert [s["kept"] for s in gs] == [s["kept"] for s in rs]
    refused(lambda: kvrt.am_compact_layer(q, k, v, ratio=0.2, ctx=ctx), "cuda")
    # one head with reference queries and positions
    qr = np.ascontiguousarray(q[:, 0, :])
    pos = np.arange(T, dtype=np.int32)
    k0, v0 = np.ascontiguousarray(k[:, 0, :]), np.ascontiguousarray(v[:, 0, :])
    ref, _ = kvrt.am_compact(k0, v0, qr, T // 5, q_pos=pos)
    got, _ = kvrt.am_compact(Dev(ctx, k0), Dev(ctx, v0), Dev(ctx, qr), T // 5,
                             q_pos=Dev(ctx, pos), ctx=ctx)
    same_cache(got, ref, "am_compact")
    # merge-reduce, the random reducer (no basis)
    ref = kvrt.mr_compress_layer(k, v, 0.25, reducer=0)
    got = kvrt.mr_compress_layer(dk, dv, 0.25, reducer=0, ctx=ctx)
    same_cache(got, ref, "mr_compress_layer", tol=0)
    # the decode stream: device rows in, device caches out (its state on the host)
    sc = kvrt.MRStream(Hkv, D, 8, 6, reducer=0, n_sink=2)
    sg = kvrt.MRStream(Hkv, D, 8, 6, reducer=0, n_sink=2, ctx=ctx)
    for t in range(0, T, 17):
        kk, vv = np.ascontiguousarray(k[t:t + 17]), np.ascontiguousarray(v[t:t + 17])
        sc.append(kk, vv)
        sg.append(Dev(ctx, kk), Dev(ctx, vv))
    for fold in (False, True):
        got = sg.cache(fold)
        assert got.device == "cuda"
        same_cache(got, sc.cache(fold), f"MRStream fold {fold}", tol=0)
    refused(lambda: sg.append(k[:1], v[:1]), "cuda")
    # baseline scores on the device
    for m in ("snapkv", "h2o", "knorm", "keydiff"):
        ref = kvrt.method_scores(m, q, k)
        out = Dev.empty(ctx, ref.shape)
        kvrt.method_scores(m, dq, dk, ctx=ctx, out=out)
        np.testing.assert_allclose(out.get(), ref, rtol=1e-4, atol=1e-6, err_msg=m)
    refused(lambda: kvrt.method_scores("snapkv", dq, dk, ctx=ctx), "out")
    # KV2's plan: stage 1, stage 2 over the context only, compress
    plans = []
    for c, kk, vv in ((None, k, v), (ctx, dk, dv)):
        pl = kvrt.KV2Plan(1, H, Hkv, D, T, ctx=c, chunk=32)
        pl.proxy(0, kk)
        for r in range(pl.n_chunks):
            pos_r, _ = pl.queries(r)
            qq = np.ascontiguousarray(q[pos_r])
            pl.score(r, 0, qq if c is None else Dev(ctx, qq), kk)
        plans.append((pl, pl.compress(0, 0.25, kk, vv)))
    np.testing.assert_allclose(plans[1][0].scores(0), plans[0][0].scores(0), rtol=1e-5,
                               atol=1e-7)
    same_cache(plans[1][1], plans[0][1], "KV2Plan.compress", tol=0)
    # CompKV: a state in device memory (f32 and bf16 K, V), one step
    for dtype in (1, 3):  # KVRT_DTYPE_F32, KVRT_DTYPE_BF16
        st_ref = kvrt.CompKVState.create(Hkv, D, T)
        st_ref.append(k, v)
        st = kvrt.CompKVState.create(Hkv, D, T, ctx=ctx, dtype=dtype)
        st.append(dk, dv)
        qq = np.ascontiguousarray(q[-1])
        ref_out, ref_blocks = st_ref.step(qq, 4)
        out, blocks = Dev.empty(ctx, ref_out.shape), Dev.empty(ctx, ref_blocks.shape, np.int32)
        st.step(Dev(ctx, qq), 4, out=out, blocks_out=blocks)
        assert np.array_equal(blocks.get(), ref_blocks), "CompKV blocks differ"
        np.testing.assert_allclose(out.get(), ref_out, rtol=0, atol=1e-5 if dtype == 1 else 2e-2)
        refused(lambda: st.step(Dev(ctx, qq), 4), "out")
        refused(lambda: st.append(k, v), "cuda")


def main():
    what, path = sys.argv[1], sys.argv[2]
    d = np.load(path)
    ctx = kvrt.Context("cuda")
    print("device:", ctx.info()["name"])
    {"quest": quest, "calls": calls}[what](d, ctx)
    print(f"{what} on cuda: OK")


if __name__ == "__main__":
    main()
