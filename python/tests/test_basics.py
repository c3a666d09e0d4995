"""Library loading, errors, contexts, buffers (zero-copy and refusals), handle lifetimes."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import kvrt
from conftest import BUILD, ROOT

PY = os.path.join(ROOT, "python")


def py(code, env_extra=None, env_drop=()):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = PY
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_loaded_in_tree_library():
    assert kvrt.library_version == "0.1.0"
    assert os.path.samefile(kvrt.library_path, os.path.join(BUILD, "libkvrt.so"))
    places = [w for w, _ in kvrt._lib.candidates()]
    assert places[0] == "$KVRT_LIBRARY" and places[1] == "bundled copy" and \
        places[2] == "in-tree build" and places[3].startswith("system")


def test_kvrt_library_env_missing_names_every_place():
    p = py("import kvrt", {"KVRT_LIBRARY": "/nonexistent/libkvrt.so"})
    assert p.returncode != 0
    assert "LibraryNotFound" in p.stderr and "/nonexistent/libkvrt.so: no such file" in p.stderr
    assert "tried, in order" in p.stderr and "KVRT_LIBRARY" in p.stderr


def test_without_env_finds_the_in_tree_build():
    # no KVRT_LIBRARY, no bundled copy in a source checkout: the in-tree build/libkvrt.so
    if os.path.exists(os.path.join(PY, "kvrt", "_native", "libkvrt.so")):
        pytest.skip("a bundled copy is present")
    if not os.path.exists(os.path.join(ROOT, "build", "libkvrt.so")):
        pytest.skip("no build/libkvrt.so (another BUILDDIR)")
    p = py("import kvrt; print(kvrt.library_path)", env_drop=("KVRT_LIBRARY",))
    assert p.returncode == 0, p.stderr
    assert os.path.samefile(p.stdout.strip(), os.path.join(ROOT, "build", "libkvrt.so"))


def test_installed_package_ignores_an_unrelated_build_dir(tmp_path):
    # an application's layout app/pylib/kvrt beside an unrelated app/build/libkvrt.so: not a
    # kvcc checkout, so the in-tree candidate is not tried (it was loaded before)
    import shutil
    app = tmp_path / "app"
    shutil.copytree(os.path.join(PY, "kvrt"), app / "pylib" / "kvrt",
                    ignore=shutil.ignore_patterns("_native", "__pycache__"))
    (app / "build").mkdir()
    shutil.copy(os.path.join(BUILD, "libkvrt.so"), app / "build" / "libkvrt.so")
    env = {k: v for k, v in os.environ.items() if k != "KVRT_LIBRARY"}
    env["PYTHONPATH"] = str(app / "pylib")
    p = subprocess.run([sys.executable, "-c", "import kvrt; print(kvrt.library_path)"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert str(app / "build") not in out, out
    assert p.returncode == 0 or "LibraryNotFound" in p.stderr, out


def test_not_a_library():
    p = py("import kvrt", {"KVRT_LIBRARY": os.path.join(ROOT, "README.md")})
    assert p.returncode != 0 and "README.md" in p.stderr and "LibraryNotFound" in p.stderr


def test_status_names_and_classes():
    names = {s: kvrt.status_name(s) for s in range(-12, 0)}
    assert names[-5] == "KVRT_ERR_MODEL_MISMATCH" and names[-12] == "KVRT_ERR_UNSUPPORTED"
    for s, cls in [(-1, kvrt.ArgError), (-2, kvrt.NoMemError), (-3, kvrt.KvrtIOError),
                   (-4, kvrt.FormatError), (-5, kvrt.ModelMismatchError), (-6, kvrt.NoCudaError),
                   (-7, kvrt.NoDeviceError), (-8, kvrt.CudaError), (-9, kvrt.DtypeError),
                   (-10, kvrt.ShapeError), (-11, kvrt.DeviceError), (-12, kvrt.UnsupportedError)]:
        e = kvrt.KvrtError(s, "m")
        assert type(e) is cls and isinstance(e, kvrt.KvrtError)
        assert e.status == s and e.name == names[s] and str(e) == f"m [{names[s]}]"
    assert isinstance(kvrt.KvrtError(-1), ValueError)


def test_bf16_cache_storage():
    from kvrt._lib import lib
    rng = np.random.default_rng(3)
    # the numpy conversion equals the C one on specials and random values
    x = np.concatenate([np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -0.0, np.inf, -np.inf, np.nan,
                                  3.4028235e38, 1e-40], np.float32),
                        rng.standard_normal(2000).astype(np.float32) * 100])
    b = kvrt.f32_to_bf16(x)
    for xi, bi in zip(x, b):
        assert int(bi) == lib.kvrt_f32_to_bf16(float(xi)), xi
    back = kvrt.bf16_to_f32(b)
    assert np.all(np.isnan(back) == np.isnan(x))
    fin = np.isfinite(x) & (np.abs(x) < 3e38) & (np.abs(x) > 1e-37)  # normal: 2^-8 relative
    assert np.all(np.abs(back[fin] - x[fin]) <= np.abs(x[fin]) * 2**-8)
    # gather into bf16: the bits of each element; attention equals the f32 cache of them
    T, Hkv, H, d = 40, 2, 4, 16
    k = rng.standard_normal((T, Hkv, d)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, d)).astype(np.float32)
    q = rng.standard_normal((3, H, d)).astype(np.float32)
    s = kvrt.method_select("knorm", rng.standard_normal((T, H, d)).astype(np.float32), k, 12)
    cb = kvrt.Cache.gather(k, v, s, dtype="bf16")
    assert cb.dtype == "bf16" and cb.nbytes == 2 * cb.n_entries * d * 2 + 8 * cb.n_entries + 8 * (Hkv + 1)
    a = cb.to_numpy()
    assert a.keys.dtype == np.uint16
    pos = a.positions
    heads = np.repeat(np.arange(Hkv), np.diff(a.offsets))
    np.testing.assert_array_equal(a.keys, kvrt.f32_to_bf16(k[pos, heads]))
    cf = kvrt.Cache.from_arrays(a.offsets, kvrt.bf16_to_f32(a.keys), kvrt.bf16_to_f32(a.values),
                                a.bias, a.positions)
    np.testing.assert_allclose(kvrt.attend(q, cb), kvrt.attend(q, cf), rtol=1e-5, atol=1e-6)
    c2 = kvrt.Cache.from_arrays(a.offsets, kvrt.bf16_to_f32(a.keys), kvrt.bf16_to_f32(a.values),
                                dtype="bf16")
    np.testing.assert_array_equal(c2.to_numpy().keys, a.keys)
    with pytest.raises(kvrt.DtypeError, match="bf16"):
        kvrt.Cache.create(2, 8, [1, 1], dtype="f8")


def test_context_cpu():
    with kvrt.Context("cpu", threads=1) as c:
        info = c.info()
        assert info["backend"] == "cpu" and info["n_threads"] == 1 and "CPU" in info["name"]
        assert c.supports("attend") and c.supports("am_compact_layer")
        with pytest.raises(kvrt.ArgError, match=r"kvrt\.Context\.supports: op: got 'bogus', expected one of softmax_rows, attend"):
            c.supports("bogus")
    assert c.closed
    with pytest.raises(kvrt.ArgError, match="after close"):
        c.info()
    with pytest.raises(kvrt.ArgError, match="backend"):
        kvrt.Context("tpu")


def test_context_cuda_clean_error_or_device():
    if kvrt.has_cuda() and kvrt.cuda_device_count() > 0:
        with kvrt.Context("cuda") as c:
            assert c.info()["backend"] == "cuda"
        return
    with pytest.raises((kvrt.NoCudaError, kvrt.NoDeviceError)) as ei:
        kvrt.Context("cuda")
    assert ei.value.name in ("KVRT_ERR_NO_CUDA", "KVRT_ERR_NO_DEVICE") and ei.value.message


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def test_zero_copy_numpy_and_torch():
    from kvrt._core import _buf
    a = rnd(10, 3, 8)
    assert _buf(a, "a", "t").ptr == a.ctypes.data
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(a)
    assert _buf(t, "t", "t").ptr == t.data_ptr() == a.ctypes.data
    tg = torch.zeros(4, 3, 8, requires_grad=True)
    assert _buf(tg, "tg", "t").ptr == tg.data_ptr()
    # the same selection from a torch tensor as from numpy
    k = rnd(50, 3, 8)
    s1 = kvrt.method_select("knorm", None, k, 20)
    s2 = kvrt.method_select("knorm", None, torch.from_numpy(k), 20)
    np.testing.assert_array_equal(s1.positions, s2.positions)


def test_refusals_name_the_argument():
    k = rnd(50, 3, 8)
    with pytest.raises(kvrt.DtypeError, match=r"k: got dtype float64, expected float32"):
        kvrt.method_select("knorm", None, k.astype(np.float64), 20)
    with pytest.raises(kvrt.ShapeError, match="k: not C-contiguous"):
        kvrt.method_select("knorm", None, np.swapaxes(k, 0, 1), 2)
    with pytest.raises(kvrt.ShapeError, match=r"q: got shape \[40, 9, 8\], expected \[50, \*, 8\]"):
        kvrt.method_select("snapkv", rnd(40, 9, 8), k, 20)
    with pytest.raises(kvrt.ArgError, match="method"):
        kvrt.method_select("nope", None, k, 20)
    with pytest.raises(kvrt.ArgError, match="list"):
        kvrt.method_select("knorm", None, [[1.0]], 20)
    # the explicit copy is accepted
    s = kvrt.method_select("knorm", None, kvrt.as_f32(np.swapaxes(k, 0, 1).astype(np.float64)), 2, n_sink=1)
    assert s.counts.tolist() == [2] * 50
    # integers and numbers are checked before ctypes wraps or parses them
    # (the message names the function the user called, not the helper that checks; without
    # co_qualname, Python < 3.11, the class comes from self or cls)
    from types import SimpleNamespace as NS
    from kvrt._core import _frame_name
    code = NS(co_name="ratios")
    assert _frame_name(NS(f_code=code, f_globals={"__name__": "kvrt.policy"},
                          f_locals={"self": kvrt.Context("cpu", threads=1)})) == "kvrt.Context.ratios"
    assert _frame_name(NS(f_code=NS(co_name="create"), f_globals={"__name__": "kvrt._core"},
                          f_locals={"cls": kvrt.Cache})) == "kvrt.Cache.create"
    assert _frame_name(NS(f_code=NS(co_name="apply"), f_globals={"__name__": "kvrt.hf"},
                          f_locals={})) == "kvrt.hf.apply"
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.method_select: window: got -1, expected an integer in 0\.\.4294967295"):
        kvrt.method_select("snapkv", rnd(50, 9, 8), k, 20, window=-1)
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.method_select: budget: got '16', expected a number"):
        kvrt.method_select("knorm", None, k, "16")
    with pytest.raises(kvrt.ArgError, match=r"q: got None, but snapkv scores the keys by the queries"):
        kvrt.method_select("snapkv", None, k, 20)
    with pytest.raises(kvrt.ArgError, match=r"model: got 5, expected a preset name"):
        kvrt.Policy.open("x.kvpol", model=5)


def test_runtime_messages_come_through():
    k = rnd(50, 3, 8)
    with pytest.raises(kvrt.ArgError) as ei:
        kvrt.method_select("snapkv", rnd(50, 9, 8), k, 10)  # budget below the window of 32
    assert "kvrt_method_select" in ei.value.message or "window" in ei.value.message
    c = kvrt.Cache.create(3, 8, [2, 0, 1])
    with pytest.raises(kvrt.ShapeError) as ei:
        kvrt.attend(rnd(1, 8, 8), c)  # 8 query heads over 3 KV heads
    assert ei.value.name == "KVRT_ERR_SHAPE" and "3" in ei.value.message


def test_cuda_arrays_on_a_cpu_context_are_refused():
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (1, 3, 8), "typestr": "<f4", "data": (1234, False),
                                    "version": 3, "strides": None}
    c = kvrt.Cache.create(3, 8, [1, 1, 1])
    with pytest.raises(kvrt.DeviceError, match="CUDA"):
        kvrt.attend(FakeCuda(), c)


def test_selection_and_cache_roundtrip():
    s = kvrt.Selection.from_positions([[0, 3, 5], [], [7]])
    assert s.counts.tolist() == [3, 0, 1] and s.head(0).tolist() == [0, 3, 5]
    assert [x.tolist() for x in s.to_list()] == [[0, 3, 5], [], [7]]
    k, v = rnd(8, 3, 4, seed=1), rnd(8, 3, 4, seed=2)
    c = kvrt.Cache.gather(k, v, s)
    a = c.to_numpy()
    assert c.counts.tolist() == [3, 0, 1] and c.n_entries == 4
    np.testing.assert_array_equal(a.keys[:3], k[[0, 3, 5], 0])
    np.testing.assert_array_equal(a.values[3], v[7, 2])
    assert a.positions.tolist() == [0, 3, 5, 7] and a.bias.tolist() == [0, 0, 0, 0]
    assert c.nbytes == 2 * 4 * 4 * 4 + 4 * 4 + 4 * 4 + 8 * 4
    with pytest.raises(kvrt.ArgError):
        kvrt.Cache.gather(k, v, kvrt.Selection.from_positions([[9], [], []]))  # position >= T
    # from_arrays: bias and positions as given; attention sees the bias
    c2 = kvrt.Cache.from_arrays(a.offsets, a.keys, a.values, bias=[0, 0, np.log(2.0), 0],
                                positions=[0, 3, -1, 7])
    b = c2.to_numpy()
    assert b.positions.tolist() == [0, 3, -1, 7] and b.bias[2] == np.float32(np.log(2.0))
    q = rnd(1, 3, 4, seed=3)
    o1 = kvrt.attend(q, c)
    o2 = kvrt.attend(q, c2)
    assert not np.allclose(o1[0, 0], o2[0, 0]) and np.allclose(o1[0, 2], o2[0, 2])
    # an empty head with no recent token: zero row, lse -inf
    o, l = kvrt.attend(q, c, return_lse=True)
    assert np.all(o[0, 1] == 0) and l[0, 1] == -np.inf


def test_lifetimes():
    ctx = kvrt.Context("cpu")
    c = kvrt.Cache.create(2, 4, [1, 1]).to_device(ctx)
    assert c.device == "host" and c.counts.tolist() == [1, 1]
    ctx.close()  # closes what lives in its memory first
    assert c.closed
    with pytest.raises(kvrt.ArgError, match="after close"):
        c.nbytes
    c.close()  # idempotent
    # handles dropped without close are freed by __del__ (no crash, no leak in a loop)
    for _ in range(200):
        kvrt.Cache.create(2, 4, [100, 100])
    gc.collect()


def test_budget_and_topk():
    assert kvrt.budget_resolve(0.25, 100) == 25 and kvrt.budget_resolve(7, 100) == 7
    with pytest.raises(kvrt.ArgError, match="exceeds"):
        kvrt.budget_resolve(101, 100)
    s = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.float32)
    assert kvrt.topk(s, 3).tolist() == [4, 5, 7]


def test_torch_out_is_written_in_place():
    torch = pytest.importorskip("torch")
    k, v = rnd(20, 3, 8, seed=4), rnd(20, 3, 8, seed=5)
    c = kvrt.Cache.gather(k, v, kvrt.method_select("streaming", None, k, 10))
    q = torch.from_numpy(rnd(2, 6, 8, seed=6))
    out = torch.empty(2, 6, 8)
    r = kvrt.attend(q, c, torch.from_numpy(k[-2:].copy()), torch.from_numpy(v[-2:].copy()), out=out)
    assert r is out
    np.testing.assert_array_equal(out.numpy(), kvrt.attend(q.numpy(), c, k[-2:].copy(), v[-2:].copy()))


def test_read_only_out_is_refused():
    """out= is written in place: a read-only array (np.frombuffer of bytes) is refused, never
    written through (from an audit: attend changed an immutable bytes object)."""
    k, v = rnd(20, 3, 8, seed=4), rnd(20, 3, 8, seed=5)
    c = kvrt.Cache.gather(k, v, kvrt.method_select("streaming", None, k, 10))
    q = rnd(2, 6, 8, seed=6)
    raw = bytes(2 * 6 * 8 * 4)
    ro = np.frombuffer(raw, dtype=np.float32).reshape(2, 6, 8)
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.attend: out: read-only"):
        kvrt.attend(q, c, out=ro)
    assert raw == bytes(2 * 6 * 8 * 4)
    sc = np.zeros((3, 20), np.float32)
    sc.flags.writeable = False
    with pytest.raises(kvrt.ArgError, match="out: read-only"):
        kvrt.method_scores("knorm", None, k, out=sc)


def test_integers_and_types_checked_before_c():
    """From an audit of python.md's promise ("-1 is refused, 3.0 is refused, '16' is refused"):
    counts went to numpy or ctypes unchecked (wrapping, truncating, numpy's messages), and some
    wrong types surfaced as AttributeError / TypeError instead of a kvrt error naming the call."""
    s = np.array([3, 1, 4, 1, 5], np.float32)
    for bad in (-1, "3", 2.7, True):
        with pytest.raises(kvrt.ArgError, match=r"^kvrt\.topk: k: got"):
            kvrt.topk(s, bad)
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.select_pinned: budget: got -1"):
        kvrt.select_pinned(s, 5, -1)
    with pytest.raises(kvrt.ArgError, match="threads"):
        kvrt.Context("cpu", threads=2 ** 32 + 1)
    with pytest.raises(kvrt.ArgError, match="threads"):
        kvrt.Context("cpu", threads="2")
    k, v = rnd(20, 3, 8, seed=4), rnd(20, 3, 8, seed=5)
    sel = kvrt.method_select("streaming", None, k, 10)
    with pytest.raises(kvrt.DtypeError, match=r"^kvrt\.Cache\.gather: dtype: got 'float64'"):
        kvrt.Cache.gather(k, v, sel, dtype="float64")
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.method_select: method: got None"):
        kvrt.method_select(None, None, k, 10)
    with pytest.raises(kvrt.ArgError, match=r"^kvrt\.attend: cache: got Selection"):
        kvrt.attend(rnd(1, 6, 8), sel)
    with pytest.raises(kvrt.ShapeError, match=r"from_arrays: bias: got shape \[3\], expected \[4\]"):
        kvrt.Cache.from_arrays([0, 4], rnd(4, 8), rnd(4, 8), bias=[0, 0, 0])
    import copy
    with pytest.raises(TypeError, match="cannot be copied"):  # both would free one C handle
        copy.deepcopy(kvrt.Context("cpu"))
    torch = pytest.importorskip("torch")
    with pytest.raises(kvrt.DtypeError, match=r"k: got dtype torch\.bfloat16, expected float32"):
        kvrt.method_select("knorm", None, torch.from_numpy(k).to(torch.bfloat16), 10)


def test_pip_install_target_bundles_the_library(tmp_path):
    """pip install ./python (offline, --no-build-isolation): the build hook runs make on the
    checkout (a no-op when build/libkvrt.so is current) and bundles the library, which the
    installed package then loads first. KVRT_TEST_FRESH_CLONE=1 also installs from a fresh
    clone of HEAD, where the hook builds the library from scratch (minutes)."""
    src = ROOT
    if os.environ.get("KVRT_TEST_FRESH_CLONE") == "1":
        src = str(tmp_path / "clone")
        subprocess.run(["git", "clone", "-q", ROOT, src], check=True)
    tgt = tmp_path / "site"
    env = dict(os.environ, KVRT_USE_CUDA=os.environ.get("KVRT_USE_CUDA", "0" if src != ROOT else ""))
    if not env["KVRT_USE_CUDA"]:
        del env["KVRT_USE_CUDA"]
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-build-isolation", "--no-index", "--no-deps", "--target", str(tgt),
                        os.path.join(src, "python")], capture_output=True, text=True, env=env)
    if p.returncode and "No module named pip" in p.stderr:
        pytest.skip("pip not available")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tgt / "kvrt" / "_native" / "libkvrt.so").exists()
    env = {k: v for k, v in os.environ.items() if k != "KVRT_LIBRARY"}
    env["PYTHONPATH"] = str(tgt)
    r = subprocess.run([sys.executable, "-c", "import kvrt; print(kvrt.library_path)"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tgt / "kvrt" / "_native" / "libkvrt.so")


def test_cuda_out_on_a_cpu_context_is_refused():
    class FakeCudaOut:
        __cuda_array_interface__ = {"shape": (1, 3, 8), "typestr": "<f4", "data": (1234, False),
                                    "version": 3, "strides": None}
    c = kvrt.Cache.create(3, 8, [1, 1, 1])
    with pytest.raises(kvrt.DeviceError, match="out"):
        kvrt.attend(rnd(1, 3, 8), c, out=FakeCudaOut())


def test_threads_release_the_gil_and_keep_their_own_errors():
    from concurrent.futures import ThreadPoolExecutor
    k = rnd(300, 3, 16, seed=7)
    q = rnd(300, 6, 16, seed=8)
    want = kvrt.method_select("h2o", q, k, 50).positions

    def work(i):
        if i % 2:
            try:
                kvrt.budget_resolve(1000 + i, 10)
            except kvrt.ArgError as e:
                return str(1000 + i) in e.message
            return False
        return bool(np.array_equal(kvrt.method_select("h2o", q, k, 50).positions, want))
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(16)))


def test_threads_get_their_own_messages():
    """Two threads failing at once each read their own error message: ctx=None gives each thread
    its own default context (kvrt.default_context; a kvrt_ctx is one thread's at a time, so the
    shared default context of before mixed the two threads' messages ~4% of the time)."""
    import threading
    k, v = rnd(40, 3, 8, seed=4), rnd(40, 3, 8, seed=5)
    c = kvrt.Cache.gather(k, v, kvrt.method_select("streaming", None, k, 10))
    q = rnd(1, 6, 8, seed=6)
    wrong = {"nan": 0, "inf": 0}

    def work(scale, tag):
        for _ in range(3000):
            try:
                kvrt.attend(q, c, scale=scale)
            except kvrt.ArgError as e:
                wrong[tag] += f"scale {tag}" not in e.message
    ts = [threading.Thread(target=work, args=(float(t), t)) for t in ("nan", "inf")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert wrong == {"nan": 0, "inf": 0}
    mine = []
    th = threading.Thread(target=lambda: mine.append(kvrt.default_context()))
    th.start()
    th.join()
    assert mine[0] is not kvrt.default_context()


def test_unclosed_handles_at_exit():
    code = ("import kvrt, numpy as np\n"
            "ctx = kvrt.Context('cpu')\n"
            "k = np.ones((8, 2, 4), np.float32)\n"
            "c = kvrt.Cache.gather(k, k, kvrt.method_select('full', None, k, 8)).to_device(ctx)\n"
            "s = kvrt.method_select('full', None, k, 8)\n"
            "print('ok')\n")
    p = py(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok" and not p.stderr, p.stderr


def test_compkv_offload_is_a_cuda_mode():
    """opts.offload (K, V in pinned host memory, the paper's schedule) reaches the C library
    through the ctypes struct, which a CPU context refuses by name."""
    o = kvrt.compkv_options(offload=1)
    assert o["offload"] == 1 and kvrt.compkv_options()["offload"] == 0
    with pytest.raises(kvrt.UnsupportedError, match="offload = 1.*CUDA mode"):
        kvrt.CompKVState.create(2, 16, 64, offload=1)


def test_handles_in_a_gc_cycle_free_children_first(monkeypatch):
    """The garbage collector clears weak references before it finalizes a cycle, in any order:
    a parent (a context, a policy) finalized before its open children must not be freed before
    them (a device cache freed after its context is a use after free)."""
    import gc
    import kvrt._core as core
    freed = []

    class FakeLib:
        def __getattr__(self, name):
            return lambda p: freed.append((name, p))

    gc.collect()  # earlier tests' garbage (handles of finished threads) freed by the real library
    monkeypatch.setattr(core, "lib", FakeLib())

    class Parent(core._Handle):
        _free_fn = "parent_free"

    class Child(core._Handle):
        _free_fn = "child_free"

    for parent_in_cycle in (True, False):
        freed.clear()
        p = Parent(1)
        kids = [Child(2, p), Child(3, p)]
        cyc = [p, kids]
        cyc.append(cyc)
        (p if parent_in_cycle else kids[0])._cycle = cyc
        del p, kids, cyc
        gc.collect()
        mine = [f for f in freed if f[0] in ("child_free", "parent_free")]
        assert sorted(mine) == [("child_free", 2), ("child_free", 3), ("parent_free", 1)]
        assert freed[-1] == ("parent_free", 1), freed
    # explicit closes still free at once, children first
    freed.clear()
    p = Parent(4)
    c = Child(5, p)
    c.close()
    assert freed == [("child_free", 5)]
    p.close()
    assert freed == [("child_free", 5), ("parent_free", 4)]
    q = Parent(6)
    Child(7, q)  # dropped at once: freed by refcount, before q
    q.close()
    assert freed[-1] == ("parent_free", 6)
