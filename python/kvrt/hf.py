"""kvrt.hf: a .kvpol policy applied to a Hugging Face transformers llama-family model.

    import kvrt.hf
    with kvrt.hf.apply(model, "smollm2.kvpol", method="compilerkv", budget=256):
        out = model.generate(ids, max_new_tokens=32)

Inside the `with` block every forward pass of `model` runs on a `KvrtCache` (a transformers
`Cache` subclass; one is created when the call brings none or an empty one) and the model's
attention is a registered attention function, "kvrt":

- prefill (the first forward pass on a fresh cache): exact attention (transformers' SDPA) while
  the cache collects every layer's post-RoPE keys and values (and, for the methods that need
  them, the context's queries);
- right after the prefill, each layer's context is compressed by libkvrt with the chosen
  method: a ragged per-KV-head cache (`kvrt_cache`: keys, values, per-entry bias) at the
  budget; the full keys/values and the captured queries are then dropped, so their memory is
  really freed, not masked;
- every later token attends through `kvrt_attend` over the compressed context (with its
  biases: Attention Matching's beta, merge-reduce's log weights) plus the exact keys/values of
  the tokens that came after the context (kept exactly, as `kvcc eval` does).

Methods (`METHODS`): the baselines streaming, snapkv, h2o, knorm, keydiff, random and full
(libkvrt's selection + gather; no policy needed); compilerkv (the compiled head-reliability
tables, `kvrt_compilerkv_select_all` from the prefill's queries, keys, values and next-token
log-probabilities); am (the compiled Attention Matching schedule: budget = a compiled target
ratio); mr (the compiled merge-reduce basis); compkv (decode-time: the context stays whole in
libkvrt's CompKV state, every new token reads `budget` blocks exactly and the rest through their
means: memory is not freed, bandwidth is). KV² (kv2) is not supported here (its stage 2 needs
extra model passes; see docs/python-hf.md).

Budgets: token counts per KV head (>= 1) or ratios of the context (< 1), as `kvcc eval` takes
them; am takes a compiled target ratio; compkv a number of blocks.

Scope: batch size 1 without padding, CPU tensors in float32 (libkvrt's CPU backend).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _hf_native as N
from ._hf_native import HfKvrtError

try:  # transformers >= 5
    from transformers.cache_utils import Cache, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - checked at import by the caller
    raise ImportError("kvrt.hf needs transformers >= 5 (Cache layers, AttentionInterface): "
                      f"{e}") from e

__all__ = ["apply", "KvrtCache", "KvrtSession", "METHODS", "HfKvrtError", "full_cache_bytes"]

ATTN_NAME = "kvrt"
BASELINES = ("full", "streaming", "random", "snapkv", "h2o", "knorm", "keydiff")
METHODS = BASELINES + ("compilerkv", "am", "mr", "compkv")
_NEEDS_Q = {"snapkv", "h2o", "compilerkv", "am"}
_NEEDS_POLICY = {"compilerkv": "CompilerKV", "am": "Attention Matching", "mr": "merge-reduce",
                 "compkv": "CompKV"}
# the seed kvcc eval gives the random baseline (kvcc_eval_opts default), mixed with the layer
_EVAL_SEED = 1
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

_tls = threading.local()


def _active():
    return getattr(_tls, "stack", None) and _tls.stack[-1]


# --------------------------------------------------------------------------- cache
class KvrtLayer(DynamicLayer):
    """One layer: the full keys/values during prefill (as DynamicLayer), then a libkvrt
    compressed cache + the exact recent tokens (or, for compkv, a libkvrt CompKV state)."""

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q_ctx: np.ndarray | None = None  # [C, H, d] captured during prefill
        self.ccache = None                    # POINTER(N.Cache) after compression
        self.compkv = None                    # c_void_p (kvrt_compkv *) for compkv
        self.n_ctx = 0                        # context tokens the compressed part stands for
        self.rk: np.ndarray | None = None     # [cap, Hkv, d] recent keys
        self.rv: np.ndarray | None = None
        self.n_rec = 0
        self.compressed = False

    # --- transformers Cache layer interface
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.compressed:
            return super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[0] != 1:
            raise NotImplementedError("kvrt.hf: batch size 1 only")
        k = key_states[0].transpose(0, 1).contiguous().to(torch.float32).numpy()  # [n, Hkv, d]
        v = value_states[0].transpose(0, 1).contiguous().to(torch.float32).numpy()
        if self.compkv is not None:  # appended one token at a time by the attention function
            self._pending = (k, v)
        else:
            self._append_recent(k, v)
        return key_states, value_states

    def _append_recent(self, k, v):
        n = k.shape[0]
        need = self.n_rec + n
        if self.rk is None or need > self.rk.shape[0]:
            cap = max(need, 2 * (0 if self.rk is None else self.rk.shape[0]), 64)
            rk = np.empty((cap,) + k.shape[1:], np.float32)
            rv = np.empty((cap,) + v.shape[1:], np.float32)
            if self.n_rec:
                rk[: self.n_rec] = self.rk[: self.n_rec]
                rv[: self.n_rec] = self.rv[: self.n_rec]
            self.rk, self.rv = rk, rv
        self.rk[self.n_rec: need] = k
        self.rv[self.n_rec: need] = v
        self.n_rec = need

    def get_seq_length(self) -> int:
        if not self.compressed:
            return super().get_seq_length()
        return self.n_ctx + self.n_rec

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if self.compressed:
            raise NotImplementedError("kvrt.hf: a compressed cache cannot be cropped")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self.release()
        super().reset()

    # --- memory
    def nbytes(self) -> int:
        """Bytes this layer holds now: the full keys/values (prefill) or libkvrt's compressed
        cache (kvrt_cache_bytes) + the recent buffers' allocation; compkv: its full state."""
        if not self.compressed:
            b = 0
            if self.keys is not None and self.keys.numel():
                b += self.keys.numel() * self.keys.element_size()
                b += self.values.numel() * self.values.element_size()
            return b
        b = N.cache_bytes(self.ccache)
        if self.rk is not None:
            b += self.rk.nbytes + self.rv.nbytes
        if self.compkv is not None:
            b += self._compkv_bytes
        return b

    def release(self) -> None:
        L = N.lib()
        if self.ccache:
            L.kvrt_cache_free(self.ccache)
        if self.compkv:
            L.kvrt_compkv_free(self.compkv)
        self.ccache = self.compkv = None
        self.rk = self.rv = self.q_ctx = None
        self.n_rec = self.n_ctx = 0
        self.compressed = False

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass


class KvrtCache(Cache):
    """A transformers Cache whose layers are compressed by libkvrt after the prefill."""

    def __init__(self, n_layers: int):
        super().__init__(layers=[KvrtLayer() for _ in range(n_layers)])
        self.compressed = False
        self.peak_bytes = 0
        self.stats: dict = {}

    def nbytes(self) -> int:
        """Bytes held by every layer now (KvrtLayer.nbytes)."""
        return sum(l.nbytes() for l in self.layers)

    def compressed_bytes(self) -> int:
        """kvrt_cache_bytes summed over the layers (the compressed context alone)."""
        return sum(N.cache_bytes(l.ccache) for l in self.layers)

    def entries_per_head(self) -> list[list[int]]:
        """Entries of each (layer, KV head) of the compressed context."""
        return [N.cache_entries_per_head(l.ccache) if l.ccache else [] for l in self.layers]

    def _track(self):
        self.peak_bytes = max(self.peak_bytes, self.nbytes())


def full_cache_bytes(cache) -> int:
    """Bytes held by the keys and values of a transformers DynamicCache (or any Cache whose
    layers have .keys / .values tensors)."""
    b = 0
    for l in cache.layers:
        for t in (getattr(l, "keys", None), getattr(l, "values", None)):
            if t is not None:
                b += t.numel() * t.element_size()
    return b


# --------------------------------------------------------------------------- attention
def _kvrt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    st = _active()
    layer = None
    if st is not None and isinstance(st.cache, KvrtCache):
        layer = st.cache.layers[module.layer_idx]
    if layer is None or not layer.compressed:
        if layer is not None and st.method in _NEEDS_Q:  # the context's own queries
            q = query[0].transpose(0, 1).to(torch.float32).contiguous().numpy().copy()
            layer.q_ctx = q if layer.q_ctx is None else np.concatenate([layer.q_ctx, q])
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return st._attend(layer, module, query, scaling)


AttentionInterface.register(ATTN_NAME, _kvrt_attention)


# --------------------------------------------------------------------------- session
@dataclass
class _Dims:
    L: int
    H: int
    Hkv: int
    d: int
    V: int
    theta: float


def _dims(model) -> _Dims:
    c = model.config
    if getattr(c, "model_type", None) not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"kvrt.hf: a llama-family model is needed, not model_type "
                         f"{getattr(c, 'model_type', None)!r}")
    H = c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    return _Dims(c.num_hidden_layers, H, getattr(c, "num_key_value_heads", H) or H, d,
                 c.vocab_size, float(getattr(c, "rope_theta", None) or
                                     (getattr(c, "rope_parameters", None) or {}).get(
                                         "rope_theta", 10000.0)))


class KvrtSession:
    """The state of one `apply` block (see the module's docstring)."""

    def __init__(self, model, policy, method="compilerkv", budget=256, *, cache_dtype="f32",
                 decode_capacity=1024, n_threads=0):
        if method not in METHODS:
            raise ValueError(f"kvrt.hf: method {method!r} is not one of {', '.join(METHODS)}"
                             + (" (kv2 needs extra model passes: not supported by kvrt.hf)"
                                if method == "kv2" else ""))
        if method in _NEEDS_POLICY and policy is None:
            raise ValueError(f"kvrt.hf: method {method} needs a .kvpol compiled with the "
                             f"{_NEEDS_POLICY[method]} policy (kvcc compile --policies ...)")
        if cache_dtype not in ("f32", "f16"):
            raise ValueError(f"kvrt.hf: cache_dtype must be 'f32' or 'f16', not {cache_dtype!r}")
        if not (isinstance(budget, (int, float)) and budget > 0):
            raise ValueError(f"kvrt.hf: budget must be > 0 (a token count >= 1 or a ratio < 1), "
                             f"not {budget!r}")
        self.model, self.method, self.budget = model, method, budget
        self.dtype = N.DTYPE_F32 if cache_dtype == "f32" else N.DTYPE_F16
        self.decode_capacity = int(decode_capacity)
        self.dims = _dims(model)
        self.cache: KvrtCache | None = None
        self._hooks = []
        self._handles = {}
        L = N.lib()
        self.ctx = N.C.c_void_p()
        opts = None
        if n_threads:
            class _O(N.C.Structure):
                _fields_ = [("n_threads", N.C.c_int), ("device_id", N.C.c_int)]
            opts = N.C.byref(_O(n_threads, 0))
        err = N.Error()
        N.check(L.kvrt_ctx_create(N.BACKEND_CPU, opts, N.C.byref(self.ctx), N.C.byref(err)),
                "kvrt_ctx_create", err)
        self.policy = N.C.c_void_p()
        if policy is not None:
            dm = self.dims
            expect = N.ModelDims(dm.L, dm.H, dm.Hkv, dm.d, 0, 0.0, None, 0)
            err = N.Error()
            st = L.kvrt_policy_open(str(policy).encode(), N.C.byref(expect),
                                    N.C.byref(self.policy), N.C.byref(err))
            N.check(st, f"kvrt_policy_open {policy}", err)
        self._open_handle()

    # --- policy handles
    def _open_handle(self):
        L, m = N.lib(), self.method
        name = {"compilerkv": "kvrt_compilerkv_open", "am": "kvrt_am_open",
                "mr": "kvrt_mr_open", "compkv": "kvrt_compkv_open"}.get(m)
        if not name:
            return
        h = N.C.c_void_p()
        N.check(getattr(L, name)(self.policy, N.C.byref(h)), name)
        self._handles[m] = h
        if m == "am":
            t = N.C.POINTER(N.C.c_double)()
            n = N.C.c_int()
            N.check(L.kvrt_am_schedule_targets(h, N.C.byref(t), N.C.byref(n)),
                    "kvrt_am_schedule_targets")
            self.am_targets = [t[i] for i in range(n.value)]

    def close(self):
        self._remove_hooks()
        L = N.lib()
        free = {"compilerkv": L.kvrt_compilerkv_tables_free, "am": L.kvrt_am_schedule_free,
                "mr": L.kvrt_mr_schedule_free, "compkv": L.kvrt_compkv_grouping_free}
        if self.cache is not None:
            for l in self.cache.layers:
                l.release()
        for m, h in self._handles.items():
            free[m](h)
        self._handles = {}
        if self.policy:
            L.kvrt_policy_free(self.policy)
            self.policy = N.C.c_void_p()
        if self.ctx:
            L.kvrt_ctx_free(self.ctx)
            self.ctx = N.C.c_void_p()

    # --- hooks on the model
    def _install(self):
        m = self.model
        self._saved_attn = m.config._attn_implementation
        m.set_attn_implementation(ATTN_NAME)
        self._hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._post, with_kwargs=True))
        if not hasattr(_tls, "stack"):
            _tls.stack = []
        _tls.stack.append(self)

    def _remove_hooks(self):
        for h in self._hooks:
            h.remove()
        if self._hooks:
            self.model.set_attn_implementation(self._saved_attn)
            if getattr(_tls, "stack", None) and self in _tls.stack:
                _tls.stack.remove(self)
        self._hooks = []

    @staticmethod
    def _cache_key(kwargs):
        for k in ("cache", "past_key_values"):
            if k in kwargs:
                return k
        return "cache"

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        n_batch = (ids if ids is not None else emb).shape[0]
        if n_batch != 1:
            raise NotImplementedError(f"kvrt.hf: batch size 1 only (got {n_batch})")
        am = kwargs.get("attention_mask")
        if am is not None and am.ndim == 2 and not bool(am.all()):
            raise NotImplementedError("kvrt.hf: padded inputs are not supported (batch size 1, "
                                      "attention_mask all ones)")
        key = self._cache_key(kwargs)
        c = kwargs.get(key)
        if c is None and key == "cache":
            c = kwargs.get("past_key_values")
            kwargs.pop("past_key_values", None)
        if not isinstance(c, KvrtCache):
            if c is not None and c.get_seq_length() > 0:
                raise ValueError("kvrt.hf: the call brings a cache that already holds tokens; "
                                 "start from an empty cache inside kvrt.hf.apply")
            if kwargs.get("use_cache") is False:
                raise ValueError("kvrt.hf: use_cache=False: nothing to compress")
            c = KvrtCache(self.dims.L)
            kwargs[key] = c
        self.cache = c
        self._prefill = not c.compressed and c.get_seq_length() == 0
        if self._prefill and self.method == "compilerkv":
            w = self._ckv_window()
            ltk = kwargs.get("logits_to_keep", 0)
            if isinstance(ltk, int) and ltk != 0 and ltk < w + 1:
                kwargs["logits_to_keep"] = w + 1
        self._input_ids = ids
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        c = self.cache
        if self._prefill and not c.compressed:
            logits = getattr(output, "logits", None)
            c._track()
            self.compress(c, self._input_ids, logits)
        c._track()
        return output

    def _ckv_window(self) -> int:
        h = self._handles["compilerkv"]
        # kvrt_compilerkv_tables: n_budgets, n_layers, n_heads, window (4 x uint32)
        return N.C.cast(h, N.C.POINTER(N.C.c_uint32))[3]

    # --- compression
    def resolve_budget(self, C_: int) -> int:
        B = N.C.c_int64()
        N.check(N.lib().kvrt_budget_resolve(float(self.budget), C_, N.C.byref(B)),
                "kvrt_budget_resolve")
        return B.value

    def compress(self, cache: KvrtCache, input_ids=None, logits=None):
        """Compress every layer of a prefilled cache (called after the prefill)."""
        L, dm, m = N.lib(), self.dims, self.method
        C_ = cache.get_seq_length()
        if C_ < 1:
            raise ValueError("kvrt.hf: nothing to compress (empty cache)")
        k = [l.keys[0].transpose(0, 1).to(torch.float32).contiguous().numpy() for l in cache.layers]
        v = [l.values[0].transpose(0, 1).to(torch.float32).contiguous().numpy()
             for l in cache.layers]
        q = [l.q_ctx for l in cache.layers]
        if m in _NEEDS_Q and any(x is None or x.shape[0] != C_ for x in q):
            raise RuntimeError("kvrt.hf: the prefill's queries were not captured (was the "
                               "prefill run inside kvrt.hf.apply?)")
        outs = [N.C.POINTER(N.Cache)() for _ in range(dm.L)]
        st = {"method": m, "budget": self.budget, "context": C_}
        if m == "compkv":
            self._start_compkv(cache, k, v, C_)
        elif m == "compilerkv":
            if logits is None or input_ids is None:
                raise RuntimeError("kvrt.hf: compilerkv needs the prefill's logits and ids")
            B = self.resolve_budget(C_)
            lp = self._next_logprob(input_ids, logits, C_)
            FPA = N._FP * dm.L
            qa, ka, va = (FPA(*[N.fptr(x) for x in arr]) for arr in (q, k, v))
            sels = (N._SP * dm.L)()
            N.check(L.kvrt_compilerkv_select_all(self.ctx, self._handles[m], qa, ka, va,
                                                 N.fptr(lp), C_, dm.H, dm.Hkv, dm.d, B,
                                                 N.COMPILERKV_NEAREST_BUDGET, sels, None),
                    "kvrt_compilerkv_select_all")
            try:
                for l in range(dm.L):
                    N.check(L.kvrt_cache_gather(N.fptr(k[l]), N.fptr(v[l]), C_, dm.Hkv, dm.d,
                                                sels[l], self.dtype, N.C.byref(outs[l])),
                            "kvrt_cache_gather")
            finally:
                for l in range(dm.L):
                    L.kvrt_selection_free(sels[l])
            st["tokens"] = B
        else:
            for l in range(dm.L):
                outs[l] = self._compress_layer(l, q[l], k[l], v[l], C_)
        for l, layer in enumerate(cache.layers):
            layer.ccache = outs[l] if outs[l] else None
            layer.n_ctx = C_
            layer.compressed = True
            layer.keys = layer.values = None  # the full context is freed here
            layer.q_ctx = None
        cache.compressed = True
        if m != "compkv":
            st["entries_per_head"] = cache.entries_per_head()
            st["compressed_bytes"] = cache.compressed_bytes()
        st["full_bytes"] = int(dm.L * C_ * dm.Hkv * dm.d * 2 * 4)
        cache.stats = st
        return cache

    def _next_logprob(self, input_ids, logits, C_):
        """next_logprob[t] = log p(token t+1 | 0..t), t in [0, C-1) (entries the logits cover;
        the others NaN and unread: CompilerKV reads the last window only)."""
        ids = input_ids[0].to(torch.long)
        lg = logits[0].to(torch.float32)
        n = lg.shape[0]               # logits of positions C-n .. C-1
        lp = np.full(C_ - 1 if C_ > 1 else 1, np.nan, np.float32)
        ls = torch.log_softmax(lg[:-1], dim=-1) if n > 1 else None
        if ls is not None:
            pos = torch.arange(C_ - n, C_ - 1)
            lp[C_ - n: C_ - 1] = ls.gather(1, ids[pos + 1].unsqueeze(1))[:, 0].numpy()
        return lp

    def _compress_layer(self, l, q, k, v, C_):
        L, dm, m = N.lib(), self.dims, self.method
        out = N.C.POINTER(N.Cache)()
        if m in BASELINES:
            B = self.resolve_budget(C_) if m != "full" else C_
            mo = N.MethodOpts()
            L.kvrt_method_opts_init(N.C.byref(mo), N.METHODS[m], B)
            mo.seed = (_EVAL_SEED ^ ((_GOLDEN * (l + 1)) & _MASK64)) & _MASK64
            sel = N.C.POINTER(N.Selection)()
            qp = N.fptr(q) if q is not None else None
            N.check(L.kvrt_method_select(N.C.byref(mo), qp, N.fptr(k), N.fptr(v), C_, dm.H,
                                         dm.Hkv, dm.d, N.C.byref(sel)), f"kvrt_method_select {m}")
            try:
                N.check(L.kvrt_cache_gather(N.fptr(k), N.fptr(v), C_, dm.Hkv, dm.d, sel,
                                            self.dtype, N.C.byref(out)), "kvrt_cache_gather")
            finally:
                L.kvrt_selection_free(sel)
        elif m == "am":
            N.check(L.kvrt_am_compact_scheduled(self.ctx, self._handles[m], None, 0,
                                                float(self.budget), l, N.fptr(q), N.fptr(k),
                                                N.fptr(v), C_, dm.H, self.dtype, N.C.byref(out),
                                                None), "kvrt_am_compact_scheduled")
        elif m == "mr":
            B = self.resolve_budget(C_)
            N.check(L.kvrt_mr_compress_scheduled(self.ctx, self._handles[m], None, 0, float(B), l,
                                                 N.fptr(k), N.fptr(v), C_, self.dtype,
                                                 N.C.byref(out)), "kvrt_mr_compress_scheduled")
        return out

    def _start_compkv(self, cache, k, v, C_):
        L, dm = N.lib(), self.dims
        cap = C_ + self.decode_capacity
        for l, layer in enumerate(cache.layers):
            s = N.C.c_void_p()
            N.check(L.kvrt_compkv_create_layer(self.ctx, self._handles["compkv"], l, cap, None, 0,
                                               N.C.byref(s)), "kvrt_compkv_create_layer")
            layer.compkv = s
            N.check(L.kvrt_compkv_append(s, N.fptr(k[l]), N.fptr(v[l]), C_), "kvrt_compkv_append")
            # the state's own allocation: raw K/V [Hkv, cap, d] x 2 (f32) + block summaries
            nb = (cap + 15) // 16
            layer._compkv_bytes = int(cap * dm.Hkv * dm.d * 8 + nb * dm.Hkv * (2 * dm.d + 16) * 4)
            layer._cap = cap

    # --- attention of the tokens after the context
    def _attend(self, layer, module, query, scaling):
        L, dm = N.lib(), self.dims
        n = query.shape[2]
        q = query[0].transpose(0, 1).to(torch.float32).contiguous().numpy()  # [n, H, d]
        out = np.empty((n, dm.H, dm.d), np.float32)
        scale = float(scaling) if scaling is not None else 1.0 / np.sqrt(dm.d)
        if layer.compkv is not None:
            k, v = layer._pending
            if layer.n_ctx + layer.n_rec + n > layer._cap:
                raise HfKvrtError(-10, f"the CompKV state holds {layer._cap} tokens "
                                  f"(context + decode_capacity {self.decode_capacity}); pass a "
                                  "larger decode_capacity to kvrt.hf.apply", "kvrt.hf compkv")
            for i in range(n):
                N.check(L.kvrt_compkv_append(layer.compkv, N.fptr(np.ascontiguousarray(k[i:i + 1])),
                                             N.fptr(np.ascontiguousarray(v[i:i + 1])), 1),
                        "kvrt_compkv_append")
                qi = np.ascontiguousarray(q[i])
                N.check(L.kvrt_compkv_step(layer.compkv, N.fptr(qi), dm.H, int(self.budget),
                                           N.fptr(out[i]), None), "kvrt_compkv_step")
            layer.n_rec += n
        else:
            rk = layer.rk[: layer.n_rec]
            rv = layer.rv[: layer.n_rec]
            N.check(L.kvrt_attend(self.ctx, N.fptr(q), n, dm.H, layer.ccache,
                                  N.fptr(np.ascontiguousarray(rk)),
                                  N.fptr(np.ascontiguousarray(rv)), layer.n_rec, scale,
                                  N.fptr(out), None), "kvrt_attend", ctx=self.ctx)
        return torch.from_numpy(out).unsqueeze(0).to(query.dtype), None

    # --- context manager
    def __enter__(self):
        self._install()
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def apply(model, policy=None, method: str = "compilerkv", budget: float = 256, **kw) -> KvrtSession:
    """A context manager that compresses `model`'s KV cache after each prefill with libkvrt.

    model: a transformers llama-family causal LM (float32, CPU, batch size 1).
    policy: path of a .kvpol artifact compiled for this model (None for the baselines).
    method: one of METHODS. budget: tokens per KV head (>= 1) or a ratio of the context (< 1);
    am: a compiled target ratio; compkv: blocks read per decode step.
    Keywords: cache_dtype ("f32" or "f16" storage of the compressed cache), decode_capacity
    (compkv: tokens the decode state holds after the context, default 1024), n_threads.

    The returned session's .cache is the KvrtCache of the latest call (bytes:
    .cache.nbytes(), .cache.compressed_bytes(), .cache.peak_bytes, .cache.stats).
    """
    return KvrtSession(model, policy, method, budget, **kw)


def continuation_nll(model, ids, context_len: int, policy=None, method: str = "compilerkv",
                     budget: float = 256, **kw) -> tuple[float, KvrtSession]:
    """kvcc eval's end-to-end NLL through transformers: prefill ids[:context_len] inside
    apply(...), compress, run the continuation ids[context_len:] over the compressed cache, and
    return the mean NLL of tokens context_len+1 .. T-1 (token context_len is predicted from the
    uncompressed context, so kvcc eval leaves it out) with the session (its .cache holds the
    sizes). ids: a 1-D sequence of token ids."""
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64)).unsqueeze(0)
    C_, T = int(context_len), t.shape[1]
    if not 1 <= C_ < T - 1:
        raise ValueError(f"kvrt.hf: context_len {C_} must leave at least 2 continuation tokens "
                         f"of {T}")
    with torch.no_grad(), apply(model, policy, method, budget, **kw) as s:
        out = model(input_ids=t[:, :C_], use_cache=True, logits_to_keep=1)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        out2 = model(input_ids=t[:, C_:], cache=cache, use_cache=True)
        lg = torch.log_softmax(out2.logits[0, :-1].to(torch.float32), dim=-1)
        tgt = t[0, C_ + 1:]
        nll = float(-lg.gather(1, tgt.unsqueeze(1)).mean())
        s.stats = dict(cache.stats, bytes_after=cache.nbytes(), peak_bytes=cache.peak_bytes)
    return nll, s
