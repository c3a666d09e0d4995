"""Fixtures of the kvrt binding tests: a real corpus captured from the built-in model (or a
synthetic one without the model), an artifact compiled from it with every policy, the
activations as numpy arrays, and the C reference driver (tests/c/kvrt_ref.c) run on them."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KVCC_BUILD", os.path.join(ROOT, "build"))
if not os.path.isabs(BUILD):
    BUILD = os.path.join(ROOT, BUILD)
KVCC = os.path.join(BUILD, "kvcc")
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
sys.path.insert(0, os.path.join(ROOT, "python"))
# the in-tree library of this build tree (not an installed or bundled copy)
os.environ.setdefault("KVRT_LIBRARY", os.path.join(BUILD, "libkvrt.so"))

T_CTX, T_CONT = 128, 16
LAYERS = (0, 15, 29)


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="session")
def kvcc():
    if not os.path.exists(KVCC):
        pytest.skip(f"{KVCC} not built (make)")
    return KVCC


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("kvrt")


@pytest.fixture(scope="session")
def corpus(kvcc, work):
    """A corpus of one window: real activations of SmolLM2-135M on the bundled text when the
    model is present, else synthetic (kvcc synth)."""
    out = str(work / "corpus.h5")
    if os.path.exists(GGUF):
        run([kvcc, "capture", "--gguf", GGUF, "--prompts", "1", "--context", str(T_CTX),
             "--continuation", str(T_CONT), "--dtype", "f32", "-o", out], cwd=ROOT)
    else:
        run([kvcc, "synth", "--model", "smollm2-135m", "--prompts", "1", "--context", str(T_CTX),
             "--continuation", str(T_CONT), "--dtype", "f32", "-o", out], cwd=ROOT)
    return out


@pytest.fixture(scope="session")
def artifact(kvcc, corpus, work):
    """Every policy compiled against the corpus (small grids: a test fixture, not a benchmark)."""
    out = str(work / "all.kvpol")
    run([kvcc, "compile", "--model", "smollm2-135m", "--corpus", corpus, "--policies",
         "compilerkv,am,compkv,kv2,merge-reduce", "--budgets", "32,64", "--am-targets", "0.1,0.2",
         "--compkv-r", "4", "--compkv-block", "16", "--kv2-budgets", "0.1,0.2", "--kv2-rho",
         "0.1,0.2", "--kv2-proxies", "keydiff", "--kv2-max-passes", "1", "--mr-budgets", "0.25",
         "--mr-m", "16", "--mr-report-queries", "0", "-o", out], cwd=ROOT)
    return out


@pytest.fixture(scope="session")
def bare_artifact(kvcc, work):
    """An artifact with no policy group (kvcc compile --model smollm2-135m)."""
    out = str(work / "bare.kvpol")
    run([kvcc, "compile", "--model", "smollm2-135m", "-o", out], cwd=ROOT)
    return out


@pytest.fixture(scope="session")
def hf_model():
    """transformers' model from the GGUF, float32, eval mode, converted once
    (tests/peer/hf_cache.py: the peer check of make test converts it first; the weights are
    transformers' own dequantization)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not os.path.exists(GGUF):
        pytest.skip(f"{GGUF} not fetched (make test fetches it)")
    torch.set_grad_enabled(False)
    sys.path.insert(0, os.path.join(ROOT, "tests", "peer"))
    import hf_cache
    m, _ = hf_cache.load(GGUF, os.path.join(BUILD, "peer", "hf-cache"), tokenizer=False)
    return m


class Acts:
    pass


@pytest.fixture(scope="session")
def acts(corpus):
    """q [TTOT, H, d], k, v [TTOT, Hkv, d] per layer and next_logprob [TTOT-1] (float32)."""
    h5py = pytest.importorskip("h5py")
    a = Acts()
    with h5py.File(corpus, "r") as f:
        g = f["prompts/p000000"]
        a.L = int(f.attrs["n_layers"])
        a.q = [np.ascontiguousarray(g[f"layer{l:03d}/q"][:], np.float32) for l in range(a.L)]
        a.k = [np.ascontiguousarray(g[f"layer{l:03d}/k"][:], np.float32) for l in range(a.L)]
        a.v = [np.ascontiguousarray(g[f"layer{l:03d}/v"][:], np.float32) for l in range(a.L)]
        a.nl = np.ascontiguousarray(g["next_logprob"][:], np.float32)
        a.tokens = g["tokens"][:]
    a.T, a.TT = T_CTX, T_CTX + T_CONT
    a.H, a.Hkv, a.d = a.q[0].shape[1], a.k[0].shape[1], a.q[0].shape[2]
    # contiguous context parts
    a.qc = [np.ascontiguousarray(x[:a.T]) for x in a.q]
    a.kc = [np.ascontiguousarray(x[:a.T]) for x in a.k]
    a.vc = [np.ascontiguousarray(x[:a.T]) for x in a.v]
    return a


@pytest.fixture(scope="session")
def ref(acts, artifact, work):
    """The C reference results (tests/c/kvrt_ref.c through kvrt.h only) on the same inputs."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if not cc:
        pytest.skip("no C compiler")
    exe = str(work / "kvrt_ref")
    run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Wshadow", "-I", os.path.join(ROOT, "runtime", "include"),
         os.path.join(ROOT, "python", "tests", "c", "kvrt_ref.c"), "-o", exe, "-L", BUILD,
         "-lkvrt", f"-Wl,-rpath,{BUILD}", "-lm"])
    d = work / "acts"
    d.mkdir(exist_ok=True)
    for l in range(acts.L):
        acts.q[l].tofile(d / f"q{l}.f32")
        acts.k[l].tofile(d / f"k{l}.f32")
        acts.v[l].tofile(d / f"v{l}.f32")
    acts.nl.tofile(d / "nl.f32")
    out = work / "ref"
    out.mkdir(exist_ok=True)
    run([exe, str(d), str(acts.L), str(acts.T), str(acts.TT), str(acts.H), str(acts.Hkv),
         str(acts.d), artifact, str(out)] + [str(l) for l in LAYERS])

    class Ref:
        dir = out

        def arr(self, name, dtype, shape=None):
            a = np.fromfile(out / name, dtype=dtype)
            return a.reshape(shape) if shape is not None else a

        def sel(self, stem):
            return self.arr(stem + ".off", np.int64), self.arr(stem + ".pos", np.int32)

        def cache(self, stem, d, f16=False):
            et = np.float16 if f16 else np.float32
            return (self.arr(stem + ".off", np.int64), self.arr(stem + ".keys", et).reshape(-1, d),
                    self.arr(stem + ".values", et).reshape(-1, d), self.arr(stem + ".bias", np.float32),
                    self.arr(stem + ".pos", np.int32))
    return Ref()
