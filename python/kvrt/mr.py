"""Merge-reduce: a compressed cache as a sparse reweighted measure (docs/policies/merge-reduce.md).
:func:`mr_compress_layer` (explicit basis), :class:`MRSchedule` (the compiled basis and options:
``compress_scheduled``, ``stream``) and :class:`MRStream` (decode: tokens appended one by one,
the same summaries bit for bit)."""
from __future__ import annotations

from ctypes import POINTER, byref, c_double, c_int, c_void_p
from typing import Any, Dict, List, Optional

import numpy as np

from . import _lib
from ._lib import lib
from ._core import (_arg_error, _fill_opts, ArrayLike, Cache, Context,
                    _carg, _ccache, _ctx, _dtype_code, _Handle, _uint, _number, OVERRIDE_OPTIONS)
from .errors import ERR_ARG, KvrtError, check
from .policy import _policy_dims


def _reducer(val):
    if not isinstance(val, str):
        return val
    r = lib.kvrt_mr_reducer_from_name(val.encode())
    if r < 0:
        raise _arg_error(f"merge-reduce reducer: got {val!r}, expected "
                                 "'random' or 'cluster'")
    return r


def _opts(base=None, **kw) -> _lib.kvrt_mr_opts:
    return _fill_opts(_lib.kvrt_mr_opts, lib.kvrt_mr_opts_init, base, "merge-reduce", kw,
                      {"reducer": _reducer})


def _opts_dict(o) -> Dict[str, Any]:
    d = {f: getattr(o, f) for f, _ in o._fields_}
    d["reducer"] = lib.kvrt_mr_reducer_name(o.reducer).decode()
    return d


def mr_options(**overrides) -> Dict[str, Any]:
    """kvrt_mr_opts_init's defaults with overrides (reducer 'cluster'/'random', n_sink,
    recent_frac, seed, mass_comp)."""
    return _opts_dict(_opts(**overrides))


class MRBasis:
    """A protected basis of one layer: U [Hkv, d, m_max] float32, m [Hkv] uint32 (columns
    used per head), lam [Hkv, m_max] or None (eigenvalues; needed by mass_comp)."""

    def __init__(self, U: ArrayLike, m: ArrayLike, lam: Optional[ArrayLike] = None, _keep=None):
        self.U = np.ascontiguousarray(U, dtype=np.float32)
        self.m = np.ascontiguousarray(m, dtype=np.uint32)
        self.lam = None if lam is None else np.ascontiguousarray(lam, dtype=np.float32)
        self._keep = _keep

    def _struct(self) -> _lib.kvrt_mr_basis:
        Hkv, d, mm = self.U.shape
        s = _lib.kvrt_mr_basis(n_kv_heads=Hkv, head_dim=d, m_max=mm)
        s.U = self.U.ctypes.data_as(POINTER(_lib.c_float))
        s.m = self.m.ctypes.data_as(POINTER(_lib.c_uint32))
        if self.lam is not None:
            s.lam = self.lam.ctypes.data_as(POINTER(_lib.c_float))
        return s


def mr_compress_layer(k: ArrayLike, v: ArrayLike, budget: float, *, layer: int = 0,
                      basis: Optional[MRBasis] = None, dtype: str = "f32",
                      ctx: Optional[Context] = None, **options) -> Cache:
    """kvrt_mr_compress_layer: k, v [T, Hkv, d] -> a ragged cache (sinks, the summary of the
    middle blocks with bias log w, the recent window). budget: a count per KV head or a ratio
    of T. basis required by the cluster reducer (the default); options: :func:`mr_options`."""
    fn = "kvrt.mr_compress_layer"
    c = _ctx(ctx)
    kb = _carg(c, k, "k", fn, (None, None, None))
    T, Hkv, d = kb.shape
    vb = _carg(c, v, "v", fn, kb.shape)
    o = _opts(**options)
    bs = byref(basis._struct()) if basis is not None else None
    out = c_void_p()
    check(lib.kvrt_mr_compress_layer(c.ptr, byref(o), bs, _uint(layer, "layer"), kb.ptr, vb.ptr,
                                     T, Hkv, d, _number(budget, "budget"), _dtype_code(dtype),
                                     byref(out)), ctx_ptr=c.ptr)
    return _ccache(out.value, c)


class MRStream(_Handle):
    """Decode-time merge-reduce of one layer (``kvrt_mr_stream``). Its state and REDUCEs live on
    the host; on a CUDA context :meth:`append` takes device arrays and :meth:`cache` returns a
    device cache of the context."""
    _free_fn = "kvrt_mr_stream_free"

    def __init__(self, n_kv_heads: int, head_dim: int, K: int, n_recent: int, *, layer: int = 0,
                 basis: Optional[MRBasis] = None, ctx: Optional[Context] = None, **options):
        c = _ctx(ctx)
        o = _opts(**options)
        bs = byref(basis._struct()) if basis is not None else None
        out = c_void_p()
        Hkv, d = _uint(n_kv_heads, "n_kv_heads"), _uint(head_dim, "head_dim")
        check(lib.kvrt_mr_stream_create(c.ptr, byref(o), bs, _uint(layer, "layer"), Hkv, d,
                                        _uint(K, "K", 63), _uint(n_recent, "n_recent", 63),
                                        byref(out)), ctx_ptr=c.ptr)
        super().__init__(out.value, c)
        self.ctx = c
        self.n_kv_heads, self.head_dim = Hkv, d

    def append(self, k: ArrayLike, v: ArrayLike) -> None:
        """Append n tokens k, v [n, Hkv, d]."""
        fn = "kvrt.MRStream.append"
        kb = _carg(self.ctx, k, "k", fn, (None, self.n_kv_heads, self.head_dim))
        vb = _carg(self.ctx, v, "v", fn, kb.shape)
        check(lib.kvrt_mr_stream_append(self.ptr, kb.ptr, vb.ptr, kb.shape[0]),
              ctx_ptr=self.ctx.ptr)

    @property
    def length(self) -> int:
        return int(lib.kvrt_mr_stream_length(self.ptr))

    @property
    def entries(self) -> int:
        return int(lib.kvrt_mr_stream_entries(self.ptr))

    @property
    def nbytes(self) -> int:
        return int(lib.kvrt_mr_stream_bytes(self.ptr))

    def cache(self, fold: bool = False, dtype: str = "f32") -> Cache:
        """The stream's cache now: fold False: sinks, buckets, partial block, recent window (what
        decode attends over); fold True: folded into the summary kvrt_mr_compress_layer gives."""
        out = c_void_p()
        check(lib.kvrt_mr_stream_cache(self.ptr, int(bool(fold)), _dtype_code(dtype), byref(out)),
              ctx_ptr=self.ctx.ptr)
        return _ccache(out.value, self.ctx)


class MRSchedule(_Handle):
    """The compiled merge-reduce policy (``kvrt_mr_schedule``)."""
    _free_fn = "kvrt_mr_schedule_free"
    NEAREST_BUDGET = 0x1

    def __init__(self, ptr: int, policy=None):
        super().__init__(ptr, policy)
        self.policy = policy

    def options(self) -> Dict[str, Any]:
        o = _lib.kvrt_mr_opts()
        check(lib.kvrt_mr_schedule_opts(self.ptr, byref(o)))
        return _opts_dict(o)

    @property
    def budgets(self) -> List[float]:
        """The compiled budgets (ratios of the context, ascending)."""
        b, n = POINTER(c_double)(), c_int()
        check(lib.kvrt_mr_schedule_budgets(self.ptr, byref(b), byref(n)))
        return [b[i] for i in range(n.value)]

    def basis(self, budget: float, layer: int, nearest: bool = False) -> MRBasis:
        """The basis of layer with the m of a compiled budget (copies)."""
        s = _lib.kvrt_mr_basis()
        check(lib.kvrt_mr_schedule_basis(self.ptr, _number(budget, "budget"),
                                         self.NEAREST_BUDGET if nearest else 0, _uint(layer, "layer"),
                                         byref(s)))
        Hkv, d, mm = s.n_kv_heads, s.head_dim, s.m_max
        U = np.ctypeslib.as_array(s.U, shape=(Hkv * d * mm,)).reshape(Hkv, d, mm).copy()
        m = np.ctypeslib.as_array(s.m, shape=(Hkv,)).copy()
        lam = (np.ctypeslib.as_array(s.lam, shape=(Hkv * mm,)).reshape(Hkv, mm).copy()
               if s.lam else None)
        return MRBasis(U, m, lam)

    def compress_scheduled(self, k: ArrayLike, v: ArrayLike, budget: float, layer: int, *,
                           dtype: str = "f32", ctx: Optional[Context] = None,
                           override: bool = False, **options) -> Cache:
        """kvrt_mr_compress_scheduled: one layer with the compiled basis and options; k, v [T,
        Hkv, d]; budget a compiled ratio (or a count: the m of the nearest compiled ratio)."""
        fn = "kvrt.MRSchedule.compress_scheduled"
        c = _ctx(ctx)
        _, Hkv, d = _policy_dims(self.policy, fn)  # the C call reads k, v by the model's shape
        kb = _carg(c, k, "k", fn, (None, Hkv, d))
        vb = _carg(c, v, "v", fn, kb.shape)
        op = None
        if options:
            base = _lib.kvrt_mr_opts()
            check(lib.kvrt_mr_schedule_opts(self.ptr, byref(base)))
            op = byref(_opts(base, **options))
        out = c_void_p()
        check(lib.kvrt_mr_compress_scheduled(c.ptr, self.ptr, op,
                                             OVERRIDE_OPTIONS if override else 0, _number(budget, "budget"),
                                             _uint(layer, "layer"), kb.ptr, vb.ptr, kb.shape[0],
                                             _dtype_code(dtype), byref(out)), ctx_ptr=c.ptr)
        return _ccache(out.value, c)

    compress = compress_scheduled

    def stream(self, budget: float, layer: int, K: int, n_recent: int, *,
               ctx: Optional[Context] = None, **options) -> MRStream:
        """A decode stream of layer with the compiled basis (at budget's m) and options; K the
        summary size and n_recent the exact recent window (as compress would choose for a
        context: K = B - n_sink - n_recent)."""
        base = _lib.kvrt_mr_opts()
        check(lib.kvrt_mr_schedule_opts(self.ptr, byref(base)))
        o = _opts_dict(_opts(base, **options))
        b = self.basis(budget, layer)
        return MRStream(b.U.shape[0], b.U.shape[1], K, n_recent, layer=layer, basis=b, ctx=ctx,
                        **o)
