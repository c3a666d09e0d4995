"""kvcc's baselines against NVIDIA's kvpress (an independent implementation a user would
otherwise pick) on identical inputs: real post-RoPE queries and keys of the built-in model
(SmolLM2-135M, 512 tokens of bundled text, every layer), and end to end.

- scores: kvrt.method_scores against each press's ``score`` (SnapKVPress, KnormPress,
  KeyDiffPress; H2O against ObservedAttentionPress's accumulated attention). kvcc's SnapKV score
  is the window's *sum* over its queries where kvpress takes the mean (a factor of the window,
  the same ranking); kvpress's ObservedAttention divides each key's sum by the number of queries
  that saw it, kvcc's H2O does not (H2O's accumulated attention). Both are undone before
  comparing, within 1e-5 relative (f32 against torch's f32 / f64 softmax).
- selections: kvrt.method_select against the press's own ``compress`` (its top-k and gather) at
  the same kept count, with kvcc's options set to kvpress's conventions (no pinned sinks for
  Knorm / KeyDiff; window and pooling kernel passed to both). A position may differ only where
  its kvpress score ties the kept set's boundary within 1e-5 relative.
- H2O's selection is not compared: kvcc keeps H2O's equal split (recent half + heavy hitters),
  kvpress's ObservedAttentionPress keeps the top scores only (docs/algorithms.md).
- end to end: the continuation NLL (64 tokens after the 512) of `kvcc eval --gguf` (the built-in
  model attending through libkvrt's caches) against transformers on the same GGUF with the press
  compressing every layer after the prefill, and against kvrt.hf (libkvrt inside transformers),
  within 1e-4 (measured: 1e-6). SnapKV, StreamingLLM and KeyDiff, with kvcc's pinned sinks as
  scores of +inf for kvpress's KeyDiff. Knorm is left out here: layer 0's key norms tie exactly
  for repeated tokens (RoPE keeps the norm), and kvcc keeps the earliest of tied positions where
  torch's top-k keeps others: 0.003 of NLL at budget 128 on this text.

kvpress is installed without its dependencies (scripts/install-peer-deps.sh: it pins
transformers < 5.3, and its package __init__ imports `datasets` for presses not used here), so
its press modules are loaded without running that __init__."""
import importlib.util
import math
import os
import sys
import types

import numpy as np
import pytest

from conftest import GGUF, ROOT, run

torch = pytest.importorskip("torch")  # scripts/install-peer-deps.sh installs torch and kvpress
import kvrt  # noqa: E402

T_LONG, T_CONT = 512, 64
REL = 1e-5


def _load_kvpress():
    spec = importlib.util.find_spec("kvpress")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("kvpress not installed (scripts/install-peer-deps.sh installs it)")
    root = list(spec.submodule_search_locations)[0]
    # kvpress/__init__.py imports every press (DuoAttention needs `datasets`): a bare package
    # object lets the needed modules import kvpress.presses.* and kvpress.utils directly
    for name, path in (("kvpress", root), ("kvpress.presses", os.path.join(root, "presses"))):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    from kvpress.presses.keydiff_press import KeyDiffPress
    from kvpress.presses.knorm_press import KnormPress
    from kvpress.presses.observed_attention_press import ObservedAttentionPress
    from kvpress.presses.snapkv_press import SnapKVPress
    from kvpress.presses.streaming_llm_press import StreamingLLMPress
    return types.SimpleNamespace(SnapKV=SnapKVPress, Knorm=KnormPress, KeyDiff=KeyDiffPress,
                                 Streaming=StreamingLLMPress, Observed=ObservedAttentionPress)


@pytest.fixture(scope="module")
def kp():
    return _load_kvpress()


@pytest.fixture(scope="module")
def long_acts(kvcc, work):
    """(corpus path, [(q [T, H, d], k [T, Hkv, d]) of every layer's 512 context tokens]): the
    built-in model on 512 + 64 tokens of the bundled text."""
    h5py = pytest.importorskip("h5py")
    if not os.path.exists(GGUF):
        pytest.skip(f"{GGUF} missing (scripts/fetch-model.sh)")
    out = str(work / "kvpress-512.h5")
    run([kvcc, "capture", "--gguf", GGUF, "--prompts", "1", "--context", str(T_LONG),
         "--continuation", str(T_CONT), "--dtype", "f32", "-o", out], cwd=ROOT)
    with h5py.File(out, "r") as f:
        g = f["prompts/p000000"]
        L = int(f.attrs["n_layers"])
        assert L == len(LAYERS_ALL), f"the built-in model has {L} layers, the test names {len(LAYERS_ALL)}"
        return out, [(np.ascontiguousarray(g[f"layer{l:03d}/q"][:T_LONG], np.float32),
                      np.ascontiguousarray(g[f"layer{l:03d}/k"][:T_LONG], np.float32))
                     for l in range(L)]


class Head:
    """One layer's tensors in kvpress's layout and the attention it is handed (transformers'
    eager attention: softmax of the causal logits, here in f64, returned as f32)."""

    def __init__(self, q, k):
        self.q, self.k = q, k
        self.T, self.H, self.d = q.shape
        self.Hkv = k.shape[1]
        G = self.H // self.Hkv
        self.K = torch.from_numpy(k).permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, Hkv, T, d]
        Q = torch.from_numpy(q).permute(1, 0, 2).unsqueeze(0)
        z = (Q.double() @ self.K.double().repeat_interleave(G, 1).transpose(-1, -2)) / math.sqrt(self.d)
        z = z + torch.triu(torch.full((self.T, self.T), float("-inf"), dtype=torch.float64), 1)
        self.att = torch.softmax(z, -1).float()
        self.module = types.SimpleNamespace(
            config=types.SimpleNamespace(num_attention_heads=self.H, num_key_value_heads=self.Hkv),
            head_dim=self.d)
        # values carrying their position: compress's gather returns the kept positions
        self.V = torch.arange(self.T, dtype=torch.float32).view(1, 1, self.T, 1).expand(
            1, self.Hkv, self.T, self.d).contiguous()

    def hidden(self):
        return torch.zeros(1, self.T, 1)  # only its length is read when attentions are given

    def kept(self, press):
        _, v = press.compress(self.module, self.hidden(), self.K, self.V, self.att, {})
        return [np.sort(v[0, h, :, 0].numpy().astype(np.int64)) for h in range(self.Hkv)]


def close(a, b, rel=REL):
    """Every head's scores [Hkv, T] within rel of that head's largest magnitude: (ok, worst)."""
    err = np.abs(a - b).max(axis=-1) / np.maximum(np.abs(a), np.abs(b)).max(axis=-1)
    return bool((err <= rel).all()), float(err.max())


def same_up_to_ties(ours, theirs, score, n_kept, what):
    """ours / theirs: kept positions per head; score [Hkv, T]: kvpress's scores. A position in
    one set only must tie the boundary (the n_kept-th largest score) within REL."""
    for h, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == n_kept and len(b) == n_kept, f"{what} head {h}: {len(a)}, {len(b)}"
        diff = np.setxor1d(a, b)
        if diff.size == 0:
            continue
        s = score[h]
        thr = np.sort(s)[::-1][n_kept - 1]
        gap = np.abs(s[diff] - thr)
        assert (gap <= REL * max(abs(thr), np.abs(s).max() * 1e-3)).all(), (
            f"{what} head {h}: positions {diff.tolist()} differ, scores {s[diff].tolist()} "
            f"vs boundary {thr}")


def ratio_for(T, n_kept):
    return 1.0 - (n_kept + 0.5) / T  # compute_n_kept: int(T * (1 - ratio)) == n_kept


LAYERS_ALL = range(30)
BUDGETS = (64, 128, 256)


@pytest.mark.parametrize("layer", LAYERS_ALL)
def test_snapkv(kp, long_acts, layer):
    hd = Head(*long_acts[1][layer])
    for W, kern in ((32, 7), (64, 5)):  # kvcc's defaults, then kvpress's
        sp = kp.SnapKV(window_size=W, kernel_size=kern)
        theirs = sp.score(hd.module, hd.hidden(), hd.K, hd.V, hd.att, {})[0].numpy()
        ours = kvrt.method_scores("snapkv", hd.q, hd.k, window=W, pool_kernel=kern)
        ok, err = close(ours[:, :hd.T - W] / W, theirs[:, :hd.T - W])
        assert ok, f"SnapKV W={W} kernel={kern} layer {layer}: scores differ by {err:.2e} relative"
        for B in BUDGETS:
            sp.compression_ratio = ratio_for(hd.T, B)
            sel = kvrt.method_select("snapkv", hd.q, hd.k, B, window=W, pool_kernel=kern)
            same_up_to_ties([sel.head(h) for h in range(hd.Hkv)], hd.kept(sp), theirs, B,
                            f"SnapKV W={W} B={B} layer {layer}")


@pytest.mark.parametrize("layer", LAYERS_ALL)
def test_knorm_keydiff(kp, long_acts, layer):
    hd = Head(*long_acts[1][layer])
    for name, cls in (("knorm", kp.Knorm), ("keydiff", kp.KeyDiff)):
        press = cls()
        theirs = press.score(hd.module, None, hd.K, hd.V, None, {})[0].numpy()
        ours = kvrt.method_scores(name, hd.q, hd.k, n_sink=0)
        ok, err = close(ours, theirs)
        assert ok, f"{name} layer {layer}: scores differ by {err:.2e} relative"
        for B in BUDGETS:
            press.compression_ratio = ratio_for(hd.T, B)
            sel = kvrt.method_select(name, hd.q, hd.k, B, n_sink=0)
            same_up_to_ties([sel.head(h) for h in range(hd.Hkv)], hd.kept(press), theirs, B,
                            f"{name} B={B} layer {layer}")


@pytest.mark.parametrize("layer", (0, 15, 29))
def test_streaming(kp, long_acts, layer):
    hd = Head(*long_acts[1][layer])
    for B in BUDGETS:
        press = kp.Streaming(compression_ratio=ratio_for(hd.T, B), n_sink=4)
        sel = kvrt.method_select("streaming", hd.q, hd.k, B, n_sink=4)
        for h, theirs in enumerate(hd.kept(press)):
            np.testing.assert_array_equal(sel.head(h), theirs)


@pytest.mark.parametrize("layer", LAYERS_ALL)
def test_h2o_accumulated_attention(kp, long_acts, layer):
    hd = Head(*long_acts[1][layer])
    theirs = kp.Observed().score(hd.module, None, hd.K, hd.V, hd.att, {})[0].numpy()
    theirs = theirs * np.arange(hd.T, 0, -1, dtype=np.float64)[None, :]  # undo the per-key mean
    ours = kvrt.method_scores("h2o", hd.q, hd.k)
    ok, err = close(ours.astype(np.float64), theirs)
    assert ok, f"H2O layer {layer}: accumulated attention differs by {err:.2e} relative"


# ----------------------------------------------------------------------------------------------
# end to end

E2E_ROWS = [("full", 0)] + [(m, b) for m in ("snapkv", "streaming", "keydiff") for b in (64, 128)]
NLL_TOL = 1e-4


def _pinned(cls, n_sink):
    """kvpress's press with kvcc's pinned sinks: the first n_sink scores raised to +inf."""
    class Pinned(cls):
        def score(self, *a):
            s = super().score(*a).clone()
            s[..., :n_sink] = float("inf")
            return s
    return Pinned


def _press(kp, method, T, B):
    r = ratio_for(T, B)
    if method == "snapkv":
        return kp.SnapKV(compression_ratio=r, window_size=32, kernel_size=7)
    if method == "streaming":
        return kp.Streaming(compression_ratio=r, n_sink=4)
    return _pinned(kp.KeyDiff, 4)(compression_ratio=r)


class _pressed:
    """Every attention layer's cache compressed by the press after the prefill: kvpress's own
    forward hook (BasePress.forward_hook), handed the arguments under the names it reads.
    kvpress 0.5.5 targets transformers < 5.3; later versions pass the cache as `cache` (was
    `past_key_values`) and no cache_position to the attention (a fresh cache: 0 .. q_len-1)."""

    def __init__(self, press, model):
        self.press, self.model, self.hooks = press, model, []

    def _hook(self, mod, args, kwargs, out):
        kw = dict(kwargs)
        kw.setdefault("past_key_values", kw.get("cache"))
        kw.setdefault("cache_position", torch.arange(kw["hidden_states"].shape[1]))
        return self.press.forward_hook(mod, args, kw, out)

    _MISSING = object()

    def __enter__(self):
        lm = self.model.model
        # the model is shared with test_hf (a session fixture): whatever is set here is undone,
        # also when setting it up fails part-way
        self.saved = [(l.self_attn, getattr(l.self_attn, "rotary_emb", self._MISSING))
                      for l in lm.layers]
        try:
            self.press.post_init_from_model(self.model)
            for layer in lm.layers:
                layer.self_attn.rotary_emb = lm.rotary_emb
                self.hooks.append(layer.self_attn.register_forward_hook(self._hook,
                                                                        with_kwargs=True))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for attn, old in self.saved:
            if old is self._MISSING:
                attn.__dict__.pop("rotary_emb", None)
                attn._modules.pop("rotary_emb", None)
            else:
                attn.rotary_emb = old


def _kvpress_nll(model, ids, C, press):
    """NLL of tokens C+1 .. T-1 (kvcc eval's measure) with the context cache pressed."""
    from transformers import DynamicCache
    t = torch.as_tensor(ids).unsqueeze(0)
    cache = DynamicCache()
    if press is None:
        model(input_ids=t[:, :C], cache=cache, use_cache=True)
    else:
        with _pressed(press, model):
            model(input_ids=t[:, :C], cache=cache, use_cache=True)
    kept = cache.get_seq_length()
    out = model(input_ids=t[:, C:], cache=cache, use_cache=True,
                position_ids=torch.arange(C, t.shape[1]).unsqueeze(0))
    lg = torch.log_softmax(out.logits[0, :-1].double(), -1)
    return float(-lg.gather(1, t[0, C + 1:].unsqueeze(1)).mean()), kept


@pytest.fixture(scope="module")
def e2e_rows(kvcc, long_acts):
    import json
    p = run([kvcc, "eval", "--corpus", long_acts[0], "--gguf", GGUF, "--methods",
             ",".join(dict.fromkeys(m for m, _ in E2E_ROWS)), "--budgets", "64,128",
             "--no-probes", "--json"], cwd=ROOT)
    return {(r["method"], r.get("budget", 0) if r["method"] != "full" else 0): r
            for r in json.loads(p.stdout)["rows"]}


@pytest.fixture(scope="module")
def long_window(long_acts):
    h5py = pytest.importorskip("h5py")
    with h5py.File(long_acts[0], "r") as f:
        g = f["prompts/p000000"]
        return g["tokens"][:].astype(np.int64), int(g.attrs["context_len"])


@pytest.mark.parametrize("method,budget", E2E_ROWS, ids=[f"{m}-{b}" for m, b in E2E_ROWS])
def test_end_to_end_nll(kp, hf_model, e2e_rows, long_window, method, budget):
    import kvrt.hf as khf
    ids, C = long_window
    row = e2e_rows[(method, budget)]
    press = None if method == "full" else _press(kp, method, C, budget)
    theirs, kept = _kvpress_nll(hf_model, ids, C, press)
    assert kept == (C if method == "full" else budget)
    assert abs(row["nll"] - theirs) < NLL_TOL, (method, budget, row["nll"], theirs)
    hf, _ = khf.continuation_nll(hf_model, ids, C, None, method, budget or 1)
    assert abs(hf - theirs) < NLL_TOL, (method, budget, hf, theirs)
    if method != "full":  # the compression moved the NLL: the agreement is not the full cache's
        assert abs(theirs - e2e_rows[("full", 0)]["nll"]) > 10 * NLL_TOL, (method, budget, theirs)
