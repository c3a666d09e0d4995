"""Quest pages (host, and on a context: CPU, emulated CUDA), pinned selection, one-head AM,
explicit-basis merge-reduce, DLPack inputs."""
import os

import numpy as np
import pytest

import kvrt
from conftest import LAYERS

eq = np.testing.assert_array_equal


def test_quest_against_numpy(acts):
    l = LAYERS[1]
    k = acts.kc[l]
    qs = kvrt.Quest(k, page=16)
    assert qs.n_pages == acts.T // 16
    kp = k.reshape(qs.n_pages, 16, acts.Hkv, acts.d)
    eq(qs.kmin, kp.min(axis=1).transpose(1, 0, 2))
    eq(qs.kmax, kp.max(axis=1).transpose(1, 0, 2))
    q = acts.q[l][acts.T]
    s = qs.scores(q)
    G = acts.H // acts.Hkv
    want = np.zeros((acts.Hkv, qs.n_pages))
    for h in range(acts.H):
        j = h // G
        want[j] += np.maximum(q[h] * qs.kmin[j], q[h] * qs.kmax[j]).sum(axis=1)
    np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-5)
    p = qs.select(q, 3)
    for j in range(acts.Hkv):
        assert p[j, 0] == 0 and p[j, -1] == qs.n_pages - 1
        mid = [x for x in np.argsort(-s[j], kind="stable") if x not in (0, qs.n_pages - 1)][0]
        assert p[j, 1] == mid


def test_quest_append_equals_summarize(acts):
    """Appended token by token and in uneven pieces (partial pages, room growing): the same
    pages, scores and selection as one summary of the whole sequence."""
    l = LAYERS[1]
    k = acts.kc[l]
    whole = kvrt.Quest(k, page=16)
    inc = kvrt.Quest(k[:5], page=16)
    t = 5
    for n in (1, 1, 9, 17, 0, 3):
        inc.append(k[t:t + n])
        t += n
    for i in range(t, min(t + 40, acts.T)):
        inc.append(k[i:i + 1])
    inc.append(k[min(t + 40, acts.T):])
    assert inc.n_pages == whole.n_pages
    eq(inc.kmin, whole.kmin)
    eq(inc.kmax, whole.kmax)
    q = acts.q[l][acts.T]
    eq(inc.scores(q), whole.scores(q))
    eq(inc.select(q, 4), whole.select(q, 4))
    with pytest.raises(kvrt.ShapeError):
        inc.append(k[:1, :, :-1])


def test_select_pinned():
    s = np.array([0, 9, 1, 8, 2, 7, 3, 6, 4, 5], np.float32)
    assert kvrt.select_pinned(s, 10, 5, n_sink=1, n_recent=2).tolist() == [0, 1, 3, 8, 9]
    assert kvrt.select_pinned(None, 10, 3, n_sink=1, n_recent=2).tolist() == [0, 8, 9]
    with pytest.raises(kvrt.ArgError):
        kvrt.select_pinned(s, 10, 2, n_sink=1, n_recent=2)


def test_am_compact_one_head(acts):
    l, j, t = LAYERS[1], 1, 24
    k = np.ascontiguousarray(acts.kc[l][:, j])
    v = np.ascontiguousarray(acts.vc[l][:, j])
    G = acts.H // acts.Hkv
    qref = np.ascontiguousarray(acts.qc[l][:, j * G:(j + 1) * G].reshape(-1, acts.d))
    qpos = np.repeat(np.arange(acts.T, dtype=np.int32), G)
    c, st = kvrt.am_compact(k, v, qref, t, q_pos=qpos)
    a = c.to_numpy()
    assert c.n_kv_heads == 1 and st["asked"] == t and c.n_entries == st["kept"] <= t
    # sinks and the recent window are exact (original key, value; bias 0)
    n_rec = int(np.floor(0.5 * t + 0.5))
    assert a.positions[:4].tolist() == [0, 1, 2, 3]
    assert a.positions[-n_rec:].tolist() == list(range(acts.T - n_rec, acts.T))
    exact = np.r_[0:4, c.n_entries - n_rec:c.n_entries]
    eq(a.keys[exact], k[a.positions[exact]])
    eq(a.values[exact], v[a.positions[exact]])
    assert np.all(a.bias[exact] == 0)
    # the compacted middle: original keys, fitted beta >= the floor
    mid = np.r_[4:c.n_entries - n_rec]
    eq(a.keys[mid], k[a.positions[mid]])
    assert np.all(a.bias[mid] >= -3.0)
    with pytest.raises(kvrt.ArgError):
        kvrt.am_compact(k, v, qref, acts.T + 1)


def test_mr_explicit_basis_equals_scheduled(acts, artifact):
    l = LAYERS[2]
    with kvrt.Policy.open(artifact) as p:
        mr = p.merge_reduce()
        o = mr.options()
        b = mr.basis(0.25, l)
        assert b.U.shape == (acts.Hkv, acts.d, b.U.shape[2]) and np.all(b.m >= 1)
        c1 = mr.compress_scheduled(acts.kc[l], acts.vc[l], 0.25, l)
        c2 = kvrt.mr_compress_layer(acts.kc[l], acts.vc[l], 0.25, layer=l, basis=b, **o)
        for x, y in zip(c1.to_numpy(), c2.to_numpy()):
            eq(x, y)
        with pytest.raises(kvrt.ArgError):
            kvrt.mr_compress_layer(acts.kc[l], acts.vc[l], 0.25, layer=l, reducer="cluster")
        cr = kvrt.mr_compress_layer(acts.kc[l], acts.vc[l], 0.25, layer=l, reducer="random")
        assert cr.counts.tolist() == [32] * acts.Hkv


class DL:
    """A foreign CPU array that only speaks DLPack."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_zero_copy(acts):
    from kvrt._core import _buf
    k = acts.kc[0]
    assert _buf(DL(k), "k", "t").ptr == k.ctypes.data
    eq(kvrt.method_select("knorm", None, DL(k), 32).positions,
       kvrt.method_select("knorm", None, k, 32).positions)


def test_quest_create_on_a_cpu_context(acts):
    """kvrt_quest_create on a CPU context: a host summary that append fills, equal to
    summarize's; past its capacity it grows (a CPU summary)."""
    l = LAYERS[0]
    k = acts.kc[l]
    ctx = kvrt.Context("cpu")
    qs = kvrt.Quest.create(ctx, acts.Hkv, acts.d, page=16, capacity=8)
    assert qs.device == "host" and qs.n_pages == 0 and qs.n_tokens == 0
    qs.append(k[:7])
    qs.append(k[7:])
    whole = kvrt.Quest(k, page=16)
    assert qs.n_tokens == acts.T and qs.n_pages == whole.n_pages
    eq(qs.kmin, whole.kmin)
    eq(qs.kmax, whole.kmax)
    q = acts.q[l][acts.T]
    eq(qs.scores(q), whole.scores(q))
    eq(qs.select(q, 3), whole.select(q, 3))
    with pytest.raises(kvrt.KvrtError, match="head_dim"):
        kvrt.Quest.create(ctx, acts.Hkv, 0, page=16, capacity=8)
    ctx.close()
    assert qs.closed  # closed with its context


def _am_values(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((512, 4, 32), dtype=np.float32)
    k = rng.standard_normal((512, 2, 32), dtype=np.float32)
    v = rng.standard_normal((512, 2, 32), dtype=np.float32)
    c, _ = kvrt.am_compact_layer(q, k, v, ratio=0.2, ctx=kvrt.Context("cpu", threads=2))
    return c.to_numpy().values.tobytes()


def test_forked_workers_run_after_the_parent_used_kvrt():
    """A fork pool (multiprocessing's default start method on Linux before Python 3.14): a
    worker forked after the parent ran a 2-thread compaction hung in GNU OpenMP's pool before
    2026-12; now it runs (on one thread) to the same bits."""
    import multiprocessing as mp
    want = _am_values(3)
    with mp.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_am_values, [3, 3]).get(timeout=120)
    assert got == [want, want]
