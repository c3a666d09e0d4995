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
ratio); mr (the compiled merge-reduce basis); kv2 (the compiled KV² schedule: stage 1 on the
keys, stage 2 by running the plan's reconstruction tokens through the model after the full
context, as kvcc eval does; budget = a compiled ratio); compkv (decode-time: the context stays
whole in libkvrt's CompKV state, every new token reads `budget` blocks exactly and the rest
through their means: memory is not freed, bandwidth is).

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

from . import _core
from ._core import Cache as KvrtNativeCache, Context, attend, budget_resolve, method_select
from .errors import KvrtError, ShapeError
from .policy import Policy

try:  # transformers >= 5
    from transformers.cache_utils import Cache, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - checked at import by the caller
    raise ImportError("kvrt.hf needs transformers >= 5 (Cache layers, AttentionInterface): "
                      f"{e}") from e

__all__ = ["apply", "KvrtCache", "KvrtSession", "METHODS", "full_cache_bytes"]

ATTN_NAME = "kvrt"
BASELINES = ("full", "streaming", "random", "snapkv", "h2o", "knorm", "keydiff")
METHODS = BASELINES + ("compilerkv", "am", "mr", "kv2", "compkv")
_NEEDS_Q = {"snapkv", "h2o", "compilerkv", "am"}
_NEEDS_POLICY = {"compilerkv": "CompilerKV", "am": "Attention Matching", "mr": "merge-reduce",
                 "kv2": "KV\u00b2", "compkv": "CompKV"}
# the seed kvcc eval gives the random baseline (kvcc_eval_opts default), mixed with the layer
_EVAL_SEED = 1
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

# The session of a model's attention call: each attention module of a model inside apply()
# holds the stack of its model's open sessions (the innermost last). Not a thread-local: the
# hooks and the attention interface are process-wide, and a server enters apply() once and
# generates from worker threads; not a global stack either: two models in nested blocks each
# keep their own session.
_STACK = "_kvrt_sessions"
_RELEASED = ("kvrt.hf: this KvrtCache was released when its kvrt.hf.apply() block ended (a "
             "KvrtCache is valid inside its block only; start from an empty cache)")


def _session_of(module):
    stack = getattr(module, _STACK, None)
    return stack[-1] if stack else None


# --------------------------------------------------------------------------- cache
class KvrtLayer(DynamicLayer):
    """One layer: the full keys/values during prefill (as DynamicLayer), then a libkvrt
    compressed cache + the exact recent tokens (or, for compkv, a libkvrt CompKV state)."""

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q_ctx: np.ndarray | None = None  # [C, H, d] captured during prefill
        self.ccache: KvrtNativeCache | None = None  # the compressed context (kvrt_cache)
        self.compkv = None                    # kvrt.CompKVState (method compkv)
        self.n_ctx = 0                        # context tokens the compressed part stands for
        self.rk: np.ndarray | None = None     # [cap, Hkv, d] recent keys
        self.rv: np.ndarray | None = None
        self.n_rec = 0
        self.compressed = False
        self.released = False                 # freed when its apply() block ended
        self._pending = None
        self._cap = 0
        self._compkv_bytes = 0

    def _check_live(self):
        if self.released:
            raise RuntimeError(_RELEASED)

    # --- transformers Cache layer interface
    def update(self, key_states, value_states, *args, **kwargs):
        self._check_live()
        if not self.compressed:
            return super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[0] != 1:
            raise NotImplementedError("kvrt.hf: batch size 1 only")
        k = key_states[0].transpose(0, 1).to(torch.float32).contiguous().numpy()  # [n, Hkv, d]
        v = value_states[0].transpose(0, 1).to(torch.float32).contiguous().numpy()
        if self.compkv is not None:  # appended token by token by the attention function
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
        self._check_live()
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
        """Bytes this layer holds now: the full keys/values (prefill), else libkvrt's compressed
        cache (kvrt_cache_bytes) + the allocation of the recent buffers; compkv: its state."""
        if not self.compressed:
            b = 0
            if self.keys is not None and self.keys.numel():
                b += self.keys.numel() * self.keys.element_size()
                b += self.values.numel() * self.values.element_size()
            return b
        b = self.ccache.nbytes if self.ccache is not None else 0
        if self.rk is not None:
            b += self.rk.nbytes + self.rv.nbytes
        return b + self._compkv_bytes

    def release(self) -> None:
        for h in (self.ccache, self.compkv):
            if h is not None:
                h.close()
        self.ccache = self.compkv = None
        self.rk = self.rv = self.q_ctx = self._pending = None
        self.n_rec = self.n_ctx = 0
        self.compressed = False
        self.released = True


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
        return sum(l.ccache.nbytes for l in self.layers if l.ccache is not None)

    def entries_per_head(self) -> list[list[int]]:
        """Entries of each (layer, KV head) of the compressed context."""
        return [[int(c) for c in l.ccache.counts] if l.ccache is not None else []
                for l in self.layers]

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
    st = _session_of(module)
    layer = None
    if st is not None and isinstance(st.cache, KvrtCache):
        layer = st.cache.layers[module.layer_idx]
    if layer is not None and st._extending is not None:  # KV\u00b2 stage 2 (see _kv2_extend)
        n, kv = query.shape[2], key.shape[2]
        st._extending[module.layer_idx] = (
            query[0].transpose(0, 1).to(torch.float32).contiguous().numpy().copy(),
            key[0, :, kv - n:].transpose(0, 1).to(torch.float32).contiguous().numpy().copy())
        i = torch.arange(n).unsqueeze(1)
        j = torch.arange(kv).unsqueeze(0)
        mask = (j < kv - n) | (j - (kv - n) <= i)  # the whole context, causal among the new
        return sdpa_attention_forward(module, query, key, value, mask[None, None],
                                      dropout=dropout, scaling=scaling, **kwargs)
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
            raise ValueError(f"kvrt.hf: method {method!r} is not one of {', '.join(METHODS)}")
        if method in _NEEDS_POLICY and policy is None:
            raise ValueError(f"kvrt.hf: method {method} needs a .kvpol compiled with the "
                             f"{_NEEDS_POLICY[method]} policy (kvcc compile --policies ...)")
        if cache_dtype not in ("f32", "f16", "bf16"):
            raise ValueError(f"kvrt.hf: cache_dtype must be 'f32', 'f16' or 'bf16', not "
                             f"{cache_dtype!r}")
        if isinstance(budget, (bool, np.bool_)) or \
                not isinstance(budget, (int, float, np.integer, np.floating)) or not budget > 0:
            raise ValueError(f"kvrt.hf: budget must be > 0 (a token count >= 1 or a ratio < 1), "
                             f"not {budget!r}")
        budget = int(budget) if isinstance(budget, (int, np.integer)) else float(budget)
        if method == "compkv" and (budget < 1 or budget != int(budget)):
            raise ValueError(f"kvrt.hf: compkv's budget is a number of blocks (an integer >= 1), "
                             f"not {budget!r}")
        self.model, self.method, self.budget = model, method, budget
        self.dtype = cache_dtype
        self.decode_capacity = int(decode_capacity)
        self.dims = _dims(model)
        self.cache: KvrtCache | None = None
        self.stats: dict = {}
        self._hooks = []
        self._attn_modules = []
        self._running = None  # the thread whose forward pass is between _pre and _done
        self._run_lock = threading.Lock()
        self._prefill = False
        self._input_ids = None
        self._extending = None
        self.ctx = Context("cpu", threads=n_threads or None)
        self.policy = None
        self.handle = None
        try:
            if policy is not None:
                dm = self.dims
                self.policy = Policy.open(policy, model=dict(n_layers=dm.L, n_heads=dm.H,
                                                             n_kv_heads=dm.Hkv, head_dim=dm.d))
                opener = {"compilerkv": self.policy.compilerkv, "am": self.policy.am,
                          "mr": self.policy.merge_reduce, "kv2": self.policy.kv2,
                          "compkv": self.policy.compkv}.get(method)
                if opener is not None:
                    self.handle = opener()
        except Exception:
            self.close()
            raise

    def close(self):
        """Remove the hooks, restore the model's attention and free everything libkvrt holds
        (the cache's compressed layers included: a KvrtCache is valid inside its block only).
        The last cache's sizes stay in self.stats (bytes_held, compressed_bytes, peak_bytes)."""
        try:
            self._remove_hooks()
            c = self.cache
            if c is not None and not any(l.released for l in c.layers):
                if c.compressed:
                    self.stats = dict(c.stats, bytes_held=c.nbytes(), peak_bytes=c.peak_bytes,
                                      seq_length=c.get_seq_length())
                for l in c.layers:
                    l.release()
        finally:  # the policy (which closes its per-policy handles) and the context, always
            for h in (self.policy, self.ctx):
                if h is not None:
                    h.close()
            self.handle = None

    # --- hooks on the model
    def _install(self):
        m = self.model
        self._saved_attn = m.config._attn_implementation
        m.set_attn_implementation(ATTN_NAME)
        self._hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._post, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._done, always_call=True))  # on errors too
        self._attn_modules = [mod for mod in m.modules()
                              if isinstance(getattr(mod, "layer_idx", None), int)]
        for mod in self._attn_modules:
            if _STACK not in mod.__dict__:
                object.__setattr__(mod, _STACK, [])
            mod.__dict__[_STACK].append(self)

    def _remove_hooks(self):
        for h in self._hooks:
            h.remove()
        if self._hooks:
            self.model.set_attn_implementation(self._saved_attn)
            for mod in self._attn_modules:
                stack = mod.__dict__.get(_STACK)
                if stack and self in stack:
                    stack.remove(self)
            self._attn_modules = []
        self._hooks = []

    def _pre(self, module, args, kwargs):
        if self._extending is not None:
            return args, kwargs
        me = threading.get_ident()
        with self._run_lock:  # check and claim at once
            if self._running is not None and self._running != me:
                raise RuntimeError("kvrt.hf: a forward pass of this model is already running in "
                                   "another thread; one session runs one forward pass at a time "
                                   "(serialize the generate() calls, or use one model per "
                                   "worker)")
            self._running = me
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        n_batch = (ids if ids is not None else emb).shape[0]
        if n_batch != 1:
            raise NotImplementedError(f"kvrt.hf: batch size 1 only (got {n_batch})")
        am = kwargs.get("attention_mask")
        if am is not None and am.ndim == 2 and not bool(am.all()):
            raise NotImplementedError("kvrt.hf: padded inputs are not supported (batch size 1, "
                                      "attention_mask all ones)")
        c = kwargs.pop("past_key_values", None)
        if kwargs.get("cache") is not None:
            c = kwargs["cache"]
        if isinstance(c, KvrtCache) and any(l.released for l in c.layers):
            raise ValueError(_RELEASED)
        if not isinstance(c, KvrtCache):
            if c is not None and c.get_seq_length() > 0:
                raise ValueError("kvrt.hf: the call brings a cache that already holds tokens; "
                                 "start from an empty cache inside kvrt.hf.apply")
            if kwargs.get("use_cache") is False:
                raise ValueError("kvrt.hf: use_cache=False: there is no cache to compress")
            c = KvrtCache(self.dims.L)
        kwargs["cache"] = c
        self.cache = c
        self._prefill = not c.compressed and c.get_seq_length() == 0
        if self._prefill and self.method == "compilerkv":
            w = self.handle.window  # the log-probabilities of the last w context tokens
            ltk = kwargs.get("logits_to_keep", 0)
            if isinstance(ltk, int) and ltk != 0 and ltk < w + 1:
                kwargs["logits_to_keep"] = w + 1
        self._input_ids = ids
        return args, kwargs

    def _done(self, module, args, output):
        # also after a refused or failed call (always_call): only the running thread's own end
        # releases the claim, not a second thread's refusal
        with self._run_lock:
            if self._extending is None and self._running == threading.get_ident():
                self._running = None

    def _post(self, module, args, kwargs, output):
        if self._extending is not None:
            return output
        c = self.cache
        if self._prefill and not c.compressed:
            c._track()
            self.compress(c, self._input_ids, getattr(output, "logits", None))
        c._track()
        return output

    # --- compression
    def compress(self, cache: KvrtCache, input_ids=None, logits=None) -> KvrtCache:
        """Compress every layer of a prefilled cache (called right after the prefill)."""
        dm, m = self.dims, self.method
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
        st = {"method": m, "budget": self.budget, "context": C_,
              "full_bytes": int(dm.L * C_ * dm.Hkv * dm.d * 2 * 4)}
        short = m not in ("compkv", "am", "full") and self.budget >= 1 and self.budget >= C_
        if m == "compkv":
            self._start_compkv(cache, k, v, C_)
            outs = [None] * dm.L
        elif short:  # the context is no longer than the budget: every token is kept exactly
            outs = [KvrtNativeCache.gather(k[l], v[l], method_select("full", None, k[l], C_),
                                           dtype=self.dtype) for l in range(dm.L)]
            st["note"] = f"context of {C_} tokens <= budget {self.budget}: kept exactly"
        elif m == "compilerkv":
            if logits is None or input_ids is None:
                raise RuntimeError("kvrt.hf: compilerkv needs the prefill's logits and token ids")
            B = budget_resolve(self.budget, C_)
            lp = self._next_logprob(input_ids, logits, C_)
            sels, _ = self.handle.select_all(q, k, v, lp, B, nearest=True, ctx=self.ctx)
            outs = []
            for l in range(dm.L):
                outs.append(KvrtNativeCache.gather(k[l], v[l], sels[l], dtype=self.dtype))
                sels[l].close()
            st["tokens"] = B
        elif m == "kv2":
            outs = self._kv2(cache, input_ids, k, v, C_)
        else:
            outs = [self._compress_layer(l, q[l], k[l], v[l], C_) for l in range(dm.L)]
        for l, layer in enumerate(cache.layers):
            layer.ccache = outs[l]
            layer.n_ctx = C_
            layer.compressed = True
            layer.keys = layer.values = None  # the full context is freed here
            layer.q_ctx = None
        cache.compressed = True
        if m != "compkv":
            st["entries_per_head"] = cache.entries_per_head()
            st["compressed_bytes"] = cache.compressed_bytes()
        cache.stats = st
        self.stats = dict(st)
        return cache

    @staticmethod
    def _next_logprob(input_ids, logits, C_):
        """next_logprob[t] = log p(token t+1 | 0..t), t in [0, C-1), where the prefill's logits
        cover it (NaN elsewhere: CompilerKV reads the last window only)."""
        ids = input_ids[0].to(torch.long)
        lg = logits[0].to(torch.float32)
        n = lg.shape[0]  # logits of positions C-n .. C-1
        lp = np.full(max(C_ - 1, 1), np.nan, np.float32)
        if n > 1:
            ls = torch.log_softmax(lg[:-1], dim=-1)
            pos = torch.arange(C_ - n, C_ - 1)
            lp[C_ - n: C_ - 1] = ls.gather(1, ids[pos + 1].unsqueeze(1))[:, 0].numpy()
        return lp

    def _compress_layer(self, l, q, k, v, C_):
        m = self.method
        if m in BASELINES:
            seed = (_EVAL_SEED ^ ((_GOLDEN * (l + 1)) & _MASK64)) & _MASK64
            sel = method_select(m, q, k, self.budget, seed=seed, n_heads=self.dims.H)
            try:
                return KvrtNativeCache.gather(k, v, sel, dtype=self.dtype)
            finally:
                sel.close()
        if m == "am":
            c, _ = self.handle.compact_scheduled(q, k, v, float(self.budget), l, dtype=self.dtype,
                                                 ctx=self.ctx)
            return c
        if m == "mr":
            return self.handle.compress_scheduled(k, v, float(budget_resolve(self.budget, C_)), l,
                                                  dtype=self.dtype, ctx=self.ctx)
        raise AssertionError(m)

    def _kv2(self, cache, input_ids, k, v, C_):
        """KV\u00b2 as kvcc eval runs it end to end: the compiled plan for the budget, stage 1 on
        every layer's keys, then per pass and chunk its reconstruction tokens run through the
        model after the full context (position ids C + i, causal among themselves; their
        queries and keys scored by the plan, their cache rows dropped), then compress."""
        dm = self.dims
        if input_ids is None:
            raise RuntimeError("kvrt.hf: kv2 needs the prefill's token ids")
        passes = int(self.handle.options(float(self.budget))["passes"])
        pl = self.handle.plan(float(self.budget), dm.H, dm.d, C_, ctx=self.ctx)
        try:
            for l in range(dm.L):
                pl.proxy(l, k[l])
            for p in range(passes):
                if p:
                    pl.next_pass()
                for r in range(pl.n_chunks):
                    pos, pos_ids = pl.queries(r)
                    got = self._kv2_extend(cache, input_ids[0, torch.as_tensor(pos, dtype=torch.long)],
                                           pos_ids)
                    for l in range(dm.L):
                        pl.score(r, l, got[l][0], k[l], got[l][1])
            return [pl.compress(l, float(self.budget), k[l], v[l], dtype=self.dtype)
                    for l in range(dm.L)]
        finally:
            pl.close()

    def _kv2_extend(self, cache, tokens, pos_ids):
        """A forward pass of tokens after the cached context without keeping it: each layer's
        post-RoPE queries [n, H, d] and keys [n, Hkv, d]."""
        n = tokens.shape[0]
        self._extending = [None] * self.dims.L
        try:
            with torch.no_grad():
                self.model(input_ids=tokens.unsqueeze(0).to(torch.long),
                           position_ids=torch.as_tensor(pos_ids, dtype=torch.long).unsqueeze(0),
                           cache=cache, use_cache=True, logits_to_keep=1)
            got = self._extending
        finally:
            self._extending = None
            for layer in cache.layers:  # drop the n rows the pass appended
                if layer.keys is not None and layer.keys.shape[-2] > 0:
                    layer.crop(-n)
        return got

    def _start_compkv(self, cache, k, v, C_):
        dm = self.dims
        cap = C_ + self.decode_capacity
        blk = int(self.handle.options().get("block", 16))
        r = int(self.handle.options().get("r", 4))
        for l, layer in enumerate(cache.layers):
            s = self.handle.create_layer(l, cap, ctx=self.ctx)
            s.append(k[l], v[l])
            layer.compkv = s
            # the state's allocation: K/V [Hkv, cap, d] x 2 (f32) and per block and KV head the
            # mean key, mean value, r variances (+ the shared count)
            nb = (cap + blk - 1) // blk
            layer._compkv_bytes = int(cap * dm.Hkv * dm.d * 8 + nb * (dm.Hkv * (2 * dm.d + r) + 1) * 4)
            layer._cap = cap

    # --- attention of the tokens after the context
    def _attend(self, layer, module, query, scaling):
        dm = self.dims
        n = query.shape[2]
        q = query[0].transpose(0, 1).to(torch.float32).contiguous().numpy()  # [n, H, d]
        out = np.empty((n, dm.H, dm.d), np.float32)
        if layer.compkv is not None:
            k, v = layer._pending
            if layer.n_ctx + layer.n_rec + n > layer._cap:
                raise ShapeError(-10, f"kvrt.hf compkv: the decode state holds {layer._cap} "
                                 f"tokens (context + decode_capacity {self.decode_capacity}); "
                                 "pass a larger decode_capacity to kvrt.hf.apply")
            for i in range(n):
                layer.compkv.append(k[i:i + 1], v[i:i + 1])
                layer.compkv.step(q[i], int(self.budget), out=out[i])
            layer.n_rec += n
        else:
            nr = layer.n_rec
            attend(q, layer.ccache, layer.rk[:nr], layer.rv[:nr], scale=scaling, ctx=self.ctx,
                   out=out)
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
    Keywords: cache_dtype ("f32", "f16" or "bf16" storage of the compressed cache; compkv keeps
    the context in f32), decode_capacity
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
    return nll, s
