"""KV² (query-agnostic two-stage compression): :class:`KV2Plan` per prompt and the compiled
:class:`KV2Schedule` (docs/policies/kv2.md). The second stage is a forward pass the caller runs
with its own model; the plan says which tokens to run at which position ids, and takes back
their post-RoPE queries (and keys). Usage::

    plan = sched.plan(budget=0.25, n_heads=H, head_dim=d, C=C)     # or kvrt.KV2Plan(...)
    for l in range(L): plan.proxy(l, k[l])                          # stage 1, k [C, Hkv, d]
    for r in range(plan.n_chunks):
        pos, pos_ids = plan.queries(r)       # run tokens[pos] at position ids pos_ids
        for l in range(L): plan.score(r, l, q_new[l], k[l], k_new[l])
    caches = [plan.compress(l, 0.25, k[l], v[l]) for l in range(L)]
"""
from __future__ import annotations

from ctypes import POINTER, byref, c_double, c_float, c_int, c_int64, c_void_p
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _lib
from ._lib import lib
from ._core import (_arg_error, _fill_opts, _addr, ArrayLike, Cache, Context,
                    _carg, _ccache, _ctx, _dtype_code, _Handle, _uint, _number, OVERRIDE_OPTIONS)
from .errors import ERR_ARG, KvrtError, check

_AGG = {"mean": 0, "max": 1}


def _proxy(val):
    if not isinstance(val, str):
        return val
    p = lib.kvrt_kv2_proxy_from_name(val.encode())
    if p < 0:
        raise _arg_error(f"KV2 proxy: got {val!r}, expected 'keydiff' or 'knorm'")
    return p


def _aggregate(val):
    if not isinstance(val, str):
        return val
    if val not in _AGG:
        raise _arg_error(f"KV2 aggregate: got {val!r}, expected 'mean' or 'max'")
    return _AGG[val]


def _opts(base=None, **kw) -> _lib.kvrt_kv2_opts:
    return _fill_opts(_lib.kvrt_kv2_opts, lib.kvrt_kv2_opts_init, base, "KV2", kw,
                      {"proxy": _proxy, "aggregate": _aggregate})


def _opts_dict(o) -> Dict[str, Any]:
    d = {f: getattr(o, f) for f, _ in o._fields_}
    d["proxy"] = lib.kvrt_kv2_proxy_name(o.proxy).decode()
    d["aggregate"] = {0: "mean", 1: "max"}.get(o.aggregate, o.aggregate)
    return d


def kv2_options(**overrides) -> Dict[str, Any]:
    """kvrt_kv2_opts_init's defaults with overrides (rho, n_sink, chunk, proxy 'keydiff'/'knorm',
    aggregate 'mean'/'max', passes, per_head)."""
    return _opts_dict(_opts(**overrides))


class KV2Plan(_Handle):
    """One prompt's KV² plan (``kvrt_kv2_plan``): holds only scores, never K/V."""
    _free_fn = "kvrt_kv2_plan_free"

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, C: int, *,
                 ctx: Optional[Context] = None, _ptr: Optional[int] = None, **options):
        c = _ctx(ctx)
        C = _uint(C, "C", 63)
        if _ptr is None:
            o = _opts(**options)
            out = c_void_p()
            n_layers, n_heads = _uint(n_layers, "n_layers"), _uint(n_heads, "n_heads")
            n_kv_heads, head_dim = _uint(n_kv_heads, "n_kv_heads"), _uint(head_dim, "head_dim")
            check(lib.kvrt_kv2_plan_create(c.ptr, byref(o), n_layers, n_heads, n_kv_heads,
                                           head_dim, C, byref(out)), ctx_ptr=c.ptr)
            _ptr = out.value
        super().__init__(_ptr, c)
        self.ctx = c
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.C = \
            n_layers, n_heads, n_kv_heads, head_dim, int(C)

    def proxy(self, layer: int, k: ArrayLike) -> None:
        """Stage 1 for one layer: k [C, Hkv, d]."""
        kb = _carg(self.ctx, k, "k", "kvrt.KV2Plan.proxy", (self.C, self.n_kv_heads, self.head_dim))
        check(lib.kvrt_kv2_plan_proxy(self.ptr, _uint(layer, "layer"), kb.ptr))

    @property
    def n_chunks(self) -> int:
        return int(lib.kvrt_kv2_plan_n_chunks(self.ptr))

    def chunk(self, r: int) -> Tuple[int, int, int]:
        """Chunk r's positions [lo, hi) and its number of reconstruction queries."""
        lo, hi, n = c_int64(), c_int64(), c_int64()
        check(lib.kvrt_kv2_plan_chunk(self.ptr, _uint(r, "r", 63), byref(lo), byref(hi), byref(n)))
        return lo.value, hi.value, n.value

    def queries(self, r: int) -> Tuple[np.ndarray, np.ndarray]:
        """Chunk r's reconstruction queries: (pos, pos_ids) int32 [n_q]: run tokens[pos[i]] at
        position id pos_ids[i] (= C + i) after the full context, causal among themselves."""
        n = self.chunk(r)[2]
        pos, ids = np.empty(n, np.int32), np.empty(n, np.int32)
        nq = c_int64()
        check(lib.kvrt_kv2_plan_queries(self.ptr, _uint(r, "r", 63), _addr(pos), _addr(ids),
                                        byref(nq)))
        return pos[:nq.value], ids[:nq.value]

    def score(self, r: int, layer: int, q: ArrayLike, k: ArrayLike,
              k_new: Optional[ArrayLike] = None) -> None:
        """Stage 2 of chunk r, layer: q [n_q, H, d], k [C, Hkv, d] the context keys, k_new
        [n_q, Hkv, d] the reconstruction tokens' keys (or None: the context only)."""
        fn = "kvrt.KV2Plan.score"
        qb = _carg(self.ctx, q, "q", fn, (None, self.n_heads, self.head_dim))
        kb = _carg(self.ctx, k, "k", fn, (self.C, self.n_kv_heads, self.head_dim))
        kn = None
        if k_new is not None:
            kn = _carg(self.ctx, k_new, "k_new", fn,
                       (qb.shape[0], self.n_kv_heads, self.head_dim)).ptr
        check(lib.kvrt_kv2_plan_score(self.ptr, _uint(r, "r", 63), _uint(layer, "layer"), qb.ptr,
                                      qb.shape[0], kb.ptr, kn))

    def next_pass(self) -> None:
        """Refinement: this pass's stage-2 scores become the proxy of the next."""
        check(lib.kvrt_kv2_plan_next_pass(self.ptr))

    def proxy_scores(self) -> np.ndarray:
        """The token scores p [C] of the current pass (a copy)."""
        p = POINTER(c_float)()
        check(lib.kvrt_kv2_plan_proxy_scores(self.ptr, byref(p)))
        return np.ctypeslib.as_array(p, shape=(self.C,)).copy()

    def scores(self, layer: int) -> np.ndarray:
        """Stage-2 scores of a layer [Hkv, C] (a copy)."""
        p = POINTER(c_float)()
        check(lib.kvrt_kv2_plan_scores(self.ptr, _uint(layer, "layer"), byref(p)))
        return np.ctypeslib.as_array(p, shape=(self.n_kv_heads, self.C)).copy()

    def compress(self, layer: int, budget: float, k: ArrayLike, v: ArrayLike,
                 dtype: str = "f32") -> Cache:
        """Layer's compressed cache at budget (a count per KV head or a ratio of C); k, v
        [C, Hkv, d]."""
        fn = "kvrt.KV2Plan.compress"
        kb = _carg(self.ctx, k, "k", fn, (self.C, self.n_kv_heads, self.head_dim))
        vb = _carg(self.ctx, v, "v", fn, kb.shape)
        out = c_void_p()
        check(lib.kvrt_kv2_plan_compress(self.ptr, _uint(layer, "layer"),
                                         _number(budget, "budget"), kb.ptr, vb.ptr,
                                         _dtype_code(dtype), byref(out)))
        return _ccache(out.value, self.ctx)


class KV2Schedule(_Handle):
    """The compiled KV² schedule (``kvrt_kv2_schedule``): rho per compiled final budget."""
    _free_fn = "kvrt_kv2_schedule_free"
    NEAREST_BUDGET = 0x1

    def __init__(self, ptr: int, policy=None):
        super().__init__(ptr, policy)
        self.policy = policy

    def budgets(self) -> List[Tuple[float, float]]:
        """The compiled (budget ratio, rho) pairs, ascending."""
        b, r, n = POINTER(c_double)(), POINTER(c_double)(), c_int()
        check(lib.kvrt_kv2_schedule_budgets(self.ptr, byref(b), byref(r), byref(n)))
        return [(b[i], r[i]) for i in range(n.value)]

    @property
    def query_source(self) -> str:
        """'model' (stage 2 ran the model) or 'rerotated' (stored queries re-rotated)."""
        return {0: "model", 1: "rerotated"}.get(lib.kvrt_kv2_schedule_query_source(self.ptr), "unknown")

    def options(self, budget: float, nearest: bool = False) -> Dict[str, Any]:
        """The compiled options for a final budget ratio (kvrt_kv2_schedule_opts)."""
        o = _lib.kvrt_kv2_opts()
        check(lib.kvrt_kv2_schedule_opts(self.ptr, _number(budget, "budget"),
                                         self.NEAREST_BUDGET if nearest else 0, byref(o)))
        return _opts_dict(o)

    def plan(self, budget: float, n_heads: int, head_dim: int, C: int, *,
             ctx: Optional[Context] = None, override: bool = False, **options) -> KV2Plan:
        """kvrt_kv2_plan_create_scheduled: a plan with the compiled options for budget."""
        c = _ctx(ctx)
        op = None
        if options:
            base = _lib.kvrt_kv2_opts()
            check(lib.kvrt_kv2_schedule_opts(self.ptr, _number(budget, "budget"),
                                             self.NEAREST_BUDGET, byref(base)))
            op = byref(_opts(base, **options))
        out = c_void_p()
        H, d, C = _uint(n_heads, "n_heads"), _uint(head_dim, "head_dim"), _uint(C, "C", 63)
        check(lib.kvrt_kv2_plan_create_scheduled(c.ptr, self.ptr, op,
                                                 OVERRIDE_OPTIONS if override else 0,
                                                 _number(budget, "budget"), H, d, C, byref(out)),
              ctx_ptr=c.ptr)
        m = self.policy.model if self.policy is not None else {}
        return KV2Plan(m.get("n_layers", 0), H, m.get("n_kv_heads", 0), d, C, ctx=c,
                       _ptr=out.value)
