"""The Python calls against the C calls (tests/c/kvrt_ref.c) on the same real activations.

Both sides run the same deterministic library on the same bytes, so selections, caches and
float outputs are compared exactly (assert_array_equal); an independent numpy reference of
the attention checks the documented layouts (GQA head mapping, causal recent tokens, bias)
within 2e-5 relative."""
import numpy as np
import pytest

import kvrt
from conftest import LAYERS

eq = np.testing.assert_array_equal


def py_sel(s):
    return s.offsets, s.positions


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("method", kvrt.METHODS)
def test_method_select(acts, ref, method, layer):
    B = acts.T if method == "full" else 64
    s = kvrt.method_select(method, acts.qc[layer], acts.kc[layer], B)
    off, pos = ref.sel(f"sel_{method}_{layer}")
    eq(s.offsets, off)
    eq(s.positions, pos)
    assert s.counts.tolist() == [B] * acts.Hkv
    if kvrt.method_has_scores(method):
        sc = kvrt.method_scores(method, acts.qc[layer], acts.kc[layer])
        eq(sc, ref.arr(f"scores_{method}_{layer}.f32", np.float32, (acts.Hkv, acts.T)))
        s2 = kvrt.method_select_scored(method, sc, B)
        eq(s2.positions, pos)


def test_streamingllm_alias(acts):
    a = kvrt.method_select("streamingllm", None, acts.kc[0], 40)
    b = kvrt.method_select("streaming", None, acts.kc[0], 40)
    eq(a.positions, b.positions)
    assert a.head(0).tolist() == [0, 1, 2, 3] + list(range(acts.T - 36, acts.T))


def np_attend(q, keys, values, bias, off, kr, vr, scale):
    """Plain numpy reference of kvrt_attend (double)."""
    n, H, d = q.shape
    Hkv = len(off) - 1
    G = H // Hkv
    nr = 0 if kr is None else kr.shape[0]
    out = np.zeros((n, H, d))
    lse = np.zeros((n, H))
    for i in range(n):
        for h in range(H):
            j = h // G
            K = keys[off[j]:off[j + 1]].astype(np.float64)
            V = values[off[j]:off[j + 1]].astype(np.float64)
            z = K @ q[i, h].astype(np.float64) * scale + bias[off[j]:off[j + 1]]
            vis = nr - n + i + 1
            if nr:
                z = np.concatenate([z, kr[:vis, j].astype(np.float64) @ q[i, h] * scale])
                V = np.concatenate([V, vr[:vis, j].astype(np.float64)])
            m = z.max()
            p = np.exp(z - m)
            out[i, h] = p @ V / p.sum()
            lse[i, h] = m + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("layer", LAYERS)
def test_attend(acts, ref, layer):
    T, TT, H, Hkv, d = acts.T, acts.TT, acts.H, acts.Hkv, acts.d
    s = kvrt.method_select("snapkv", acts.qc[layer], acts.kc[layer], 64)
    c = kvrt.Cache.gather(acts.kc[layer], acts.vc[layer], s)
    qn = np.ascontiguousarray(acts.q[layer][T:])
    kr = np.ascontiguousarray(acts.k[layer][T:])
    vr = np.ascontiguousarray(acts.v[layer][T:])
    out, lse = kvrt.attend(qn, c, kr, vr, return_lse=True)
    eq(out, ref.arr(f"att_{layer}.f32", np.float32, (TT - T, H, d)))
    eq(lse, ref.arr(f"lse_{layer}.f32", np.float32, (TT - T, H)))
    a = c.to_numpy()
    ro, rl = np_attend(qn, a.keys, a.values, a.bias, a.offsets, kr, vr, 1 / np.sqrt(d))
    np.testing.assert_allclose(out, ro, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(lse, rl, rtol=2e-5, atol=2e-6)
    # f16 storage, no recent tokens
    c16 = kvrt.Cache.gather(acts.kc[layer], acts.vc[layer], s, dtype="f16")
    assert c16.dtype == "f16" and c16.nbytes == 2 * c16.n_entries * d * 2 + 8 * c16.n_entries + 8 * (Hkv + 1)
    eq(kvrt.attend(qn, c16), ref.arr(f"att16_{layer}.f32", np.float32, (TT - T, H, d)))
    r16 = ref.cache(f"cache16_{layer}", d, f16=True)
    for x, y in zip(c16.to_numpy(), r16):
        eq(x, y)


def test_compilerkv(acts, ref, artifact):
    with kvrt.Policy.open(artifact, model="smollm2-135m") as p:
        ck = p.compilerkv()
        sels, stats = ck.select_all(acts.qc, acts.kc, acts.vc, acts.nl[:acts.T - 1], 64)
        rs = ref.arr("ckv_stats.i64", np.int64, (acts.L, 2))
        assert [[s["candidates"], s["kept"]] for s in stats] == rs.tolist()
        for l in LAYERS:
            off, pos = ref.sel(f"ckv_{l}")
            eq(sels[l].offsets, off)
            eq(sels[l].positions, pos)
        # the streaming form (prompt per layer, then select) gives the same selections
        pr = ck.prompt(acts.T)
        for l in range(acts.L):
            pr.add_layer(acts.qc[l], acts.kc[l])
        pr.finish(acts.nl[:acts.T - 1])
        assert pr.finished and pr.alpha.shape == (acts.T,) and 0 < pr.entropy <= 1
        for l in LAYERS:
            s, st = ck.select(pr, l, acts.vc[l], 64)
            eq(s.positions, sels[l].positions)
            assert st["kept"] == stats[l]["kept"] <= 64
        assert ck.budgets.tolist() == [32, 64] and ck.budget_index(64) == 1
        with pytest.raises(kvrt.UnsupportedError, match="32"):
            ck.budget_index(48)
        assert ck.budget_index(48, nearest=True) == 0


@pytest.mark.parametrize("layer", LAYERS)
def test_am(acts, ref, artifact, layer):
    with kvrt.Policy.open(artifact) as p:
        am = p.am()
        assert am.targets == pytest.approx([0.1, 0.2])
        c, stats = am.compact_scheduled(acts.qc[layer], acts.kc[layer], acts.vc[layer], 0.1, layer)
        for x, y in zip(c.to_numpy(), ref.cache(f"am_{layer}", acts.d)):
            eq(x, y)
        r = am.ratios(0.1, layer)
        assert c.counts.tolist() == [max(1, min(acts.T, int(np.floor(x * acts.T + 0.5)))) for x in r]
        assert len(stats) == acts.Hkv and all(s["kept"] == s["asked"] for s in stats)
        with pytest.raises(kvrt.ArgError, match="chunk"):
            am.compact_scheduled(acts.qc[layer], acts.kc[layer], acts.vc[layer], 0.1, layer, chunk=64)
        with pytest.raises(kvrt.ArgError, match="0.1"):
            am.compact_scheduled(acts.qc[layer], acts.kc[layer], acts.vc[layer], 0.15, layer)
    cu, _ = kvrt.am_compact_layer(acts.qc[layer], acts.kc[layer], acts.vc[layer], ratio=0.2)
    for x, y in zip(cu.to_numpy(), ref.cache(f"amu_{layer}", acts.d)):
        eq(x, y)


@pytest.mark.parametrize("layer", LAYERS)
def test_compkv(acts, ref, artifact, layer):
    T, TT, H, Hkv, d = acts.T, acts.TT, acts.H, acts.Hkv, acts.d
    with kvrt.Policy.open(artifact) as p:
        g = p.compkv()
        assert (g.r, g.block) == (4, 16) and g.perm.shape == (acts.L, Hkv, d)
        st = g.create_layer(layer, TT)
        st.append(acts.kc[layer], acts.vc[layer])
        assert st.length == T and st.n_blocks == T // 16
        outs, blocks = [], []
        for t in range(T, TT):
            sc = st.scores(acts.q[layer][t])
            o, b = st.step(acts.q[layer][t], 4)
            eq(b, st.select(sc, 4))
            eq(o, st.attend_blocks(acts.q[layer][t], b))
            outs.append(o)
            blocks.append(b)
            st.append(acts.k[layer][t:t + 1], acts.v[layer][t:t + 1])
        eq(np.stack(outs), ref.arr(f"compkv_{layer}.f32", np.float32, (TT - T, H, d)))
        eq(np.stack(blocks), ref.arr(f"compkv_blocks_{layer}.i32", np.int32, (TT - T, Hkv, 4)))
        with pytest.raises(kvrt.ArgError, match="block"):
            g.create_layer(layer, TT, block=32)
        st2 = g.create_layer(layer, 8)
        with pytest.raises(kvrt.ShapeError):
            st2.append(acts.kc[layer], acts.vc[layer])  # past capacity


@pytest.mark.parametrize("layer", LAYERS)
def test_merge_reduce(acts, ref, artifact, layer):
    with kvrt.Policy.open(artifact) as p:
        mr = p.merge_reduce()
        assert mr.budgets == pytest.approx([0.25])
        c = mr.compress_scheduled(acts.kc[layer], acts.vc[layer], 0.25, layer)
        for x, y in zip(c.to_numpy(), ref.cache(f"mr_{layer}", acts.d)):
            eq(x, y)
        # the decode stream folds to the same cache, bit for bit
        o = mr.options()
        B = 32
        n_recent = int(np.floor(o["recent_frac"] * B + 0.5))
        K = B - o["n_sink"] - n_recent
        s = mr.stream(0.25, layer, K, n_recent)
        for t in range(acts.T):
            s.append(acts.kc[layer][t:t + 1], acts.vc[layer][t:t + 1])
        assert s.length == acts.T
        for x, y in zip(s.cache(fold=True).to_numpy(), c.to_numpy()):
            eq(x, y)


def test_kv2(acts, ref, artifact):
    T, H, d = acts.T, acts.H, acts.d
    with kvrt.Policy.open(artifact) as p:
        sch = p.kv2()
        bud = sch.budgets()
        assert [b for b, _ in bud] == pytest.approx([0.1, 0.2])
        pl = sch.plan(bud[0][0], H, d, T)
        for l in range(acts.L):
            pl.proxy(l, acts.kc[l])
        for r in range(pl.n_chunks):
            pos, ids = pl.queries(r)
            assert ids.tolist() == list(range(T, T + len(pos)))
            for l in range(acts.L):
                pl.score(r, l, np.ascontiguousarray(acts.q[l][pos]), acts.kc[l],
                         np.ascontiguousarray(acts.k[l][pos]))
        for l in LAYERS:
            c = pl.compress(l, bud[0][0], acts.kc[l], acts.vc[l])
            for x, y in zip(c.to_numpy(), ref.cache(f"kv2_{l}", d)):
                eq(x, y)
