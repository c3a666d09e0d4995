"""Attention Matching's one-head compaction (kvrt.am_compact: runtime/cpu/am.c) against an
independent numpy + scipy implementation of the same algorithm (bench/am_scipy.py:
scipy.optimize.nnls for the weights, scipy.linalg's Cholesky for the values' ridge least squares)
on real SmolLM2
activations: every KV head of three layers, the context's own queries (every query sees every
key, as bench_am's one-head case), t = 32 of 128 keys, with kvrt_am_opts' defaults (exact sinks
and recent window, beta floor) and with the plain algorithm (every key compacted, zero weights
dropped).

Expected agreement: the same kept positions; the biases within 1e-4 (both NNLS solvers stop
within their tolerances); the mean mass error within 1e-7 absolute and the mean output error
within 1e-5 relative (the same functions of the same fit, summed in other orders). Measured on
2026-12-06: 2.1e-5, 2.3e-9 and 4.8e-7 at most."""
import math
import os
import sys

import numpy as np
import pytest

import kvrt
from conftest import LAYERS, ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
pytest.importorskip("scipy")  # scripts/install-peer-deps.sh installs it
import am_scipy  # noqa: E402  (bench/am_scipy.py)


@pytest.mark.parametrize("t_keep,chunk", [(32, None), (33, 48)])
@pytest.mark.parametrize("mode", ["defaults", "plain"])
def test_am_one_head_matches_numpy_scipy(acts, mode, t_keep, chunk):
    opts = {} if mode == "defaults" else dict(n_sink=0, recent_frac=0.0, beta_floor=math.nan)
    if chunk is not None:
        opts["chunk"] = chunk
    o = kvrt.am_options(**opts)
    T_KEEP = t_keep
    G, d = acts.H // acts.Hkv, acts.d
    checked = 0
    for layer in LAYERS:
        for h in range(acts.Hkv):
            K = np.ascontiguousarray(acts.kc[layer][:, h, :])
            V = np.ascontiguousarray(acts.vc[layer][:, h, :])
            Q = np.ascontiguousarray(acts.qc[layer][:, h * G:(h + 1) * G, :].reshape(-1, d))
            cache, st = kvrt.am_compact(K, V, Q, T_KEEP, **opts)
            kept, me, oe, chunks = am_scipy.compact(K, V, Q, T_KEEP, o["chunk"], o["n_sink"],
                                                    o["recent_frac"], o["beta_floor"], o["ridge"])
            where = f"layer {layer} KV head {h} ({mode}, t {T_KEEP}, chunk {o['chunk']})"
            assert st["kept"] == kept, where
            c = cache.to_numpy()
            pos, bias = c.positions.astype(np.int64), c.bias.astype(np.float64)
            # numpy's entries: the exact sinks and recent window (beta 0), then each chunk's
            ns = min(o["n_sink"], T_KEEP)
            nr = min(am_scipy.lround(o["recent_frac"] * T_KEEP), T_KEEP - ns)
            T = K.shape[0]
            want = {j: 0.0 for j in list(range(ns)) + list(range(T - nr, T))}
            for p, beta, _ in chunks:
                want.update(zip(p.tolist(), beta.tolist()))
            assert sorted(want) == pos.tolist(), f"{where}: kept positions differ"
            wb = np.array([want[j] for j in pos.tolist()])
            np.testing.assert_allclose(bias, wb, rtol=0, atol=1e-4, err_msg=where)
            assert abs(st["mass_relerr"] - me) <= 1e-7, f"{where}: mass {st['mass_relerr']} vs {me}"
            assert abs(st["out_relerr"] - oe) <= 1e-5 * oe, f"{where}: out {st['out_relerr']} vs {oe}"
            checked += 1
    assert checked == len(LAYERS) * acts.Hkv
