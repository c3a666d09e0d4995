"""Policies: ``Policy.open`` over a ``.kvpol`` artifact and the per-policy handles.

* :class:`CompilerKV` (``kvrt_compilerkv_open``): prompt features and per-layer selection.
* :class:`AMSchedule` (``kvrt_am_open``): Attention Matching compaction with the compiled
  per-head schedule; :func:`am_compact_layer` the unscheduled call, :func:`am_compact_layer_ref`
  with reference queries the caller hands in (repeat-prefill).
* :class:`CompKVGrouping` (``kvrt_compkv_open``) and :class:`CompKVState`: decode-time
  compensated sparse attention (append tokens, step).
"""
from __future__ import annotations

import ctypes
import os
from ctypes import byref, c_double, c_float, c_int, c_int64, c_uint32, c_void_p, POINTER
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib
from ._lib import lib
from ._core import (_arg_error, _fill_opts, _addr, ArrayLike, Cache, Context, Selection, _buf, _carg, _ccache,
                    _cout, _ctx, _dtype_code, _Handle, _out, _struct_view, _uint, _number,
                    OVERRIDE_OPTIONS)
from .errors import ERR_ARG, ERR_SHAPE, KvrtError, check

#: The model presets of ``kvcc models`` (calib/presets.c): name -> dims. A test checks this
#: table against ``kvcc models``.
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama3-8b": dict(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=128256,
                      rope_theta=500000.0),
    "llama3-70b": dict(n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, vocab_size=128256,
                       rope_theta=500000.0),
    "mistral-7b": dict(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32768,
                       rope_theta=1000000.0),
    "qwen2-7b": dict(n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, vocab_size=152064,
                     rope_theta=1000000.0),
    "qwen3-8b": dict(n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0),
    "internlm2-7b": dict(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=92544,
                         rope_theta=1000000.0),
    "smollm2-135m": dict(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, vocab_size=49152,
                         rope_theta=100000.0),
}
PRESET_ALIASES = {"llama3": "llama3-8b"}

GROUPS = {1: "compilerkv", 2: "am", 3: "compkv", 4: "kv2", 5: "merge-reduce"}
_ROPE = {0: "none", 1: "linear", 2: "llama3", 3: "yarn"}
_DIM_FIELDS = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "rope_theta",
               "name", "model_hash")

ModelSpec = Union[None, str, Mapping[str, Any]]


def model_dims(model: ModelSpec) -> Optional[Dict[str, Any]]:
    """The dims a model spec stands for: a preset name (or alias) -> its dims and name; a
    mapping with any of n_layers, n_heads, n_kv_heads, head_dim, vocab_size, rope_theta, name,
    model_hash (fields left out are not checked); None -> nothing checked."""
    if model is None:
        return None
    if not isinstance(model, (str, Mapping)):
        raise KvrtError(ERR_ARG, f"kvrt.Policy.open: model: got {model!r}, expected a preset name "
                                 f"({', '.join(PRESETS)}), a dict of dims, or None")
    if isinstance(model, str):
        name = PRESET_ALIASES.get(model, model)
        if name not in PRESETS:
            raise KvrtError(ERR_ARG, f"kvrt.Policy.open: model: got {model!r}, expected a preset "
                                     f"({', '.join(PRESETS)}) or a dict of dims")
        return dict(PRESETS[name], name=name)
    bad = set(model) - set(_DIM_FIELDS)
    if bad:
        raise KvrtError(ERR_ARG, f"kvrt.Policy.open: model: unknown field(s) {sorted(bad)}, "
                                 f"expected some of {', '.join(_DIM_FIELDS)}")
    return dict(model)


def _dims_struct(d: Optional[Dict[str, Any]]):
    if d is None:
        return None, None
    s = _lib.kvrt_model_dims()
    for f in _DIM_FIELDS:
        if f == "name" or d.get(f) is None:
            continue
        # checked before ctypes wraps them (2**32 + 30 layers read as 30)
        v = d[f]
        if f == "rope_theta":
            v = _number(v, f"model['{f}']")
        else:
            v = _uint(v, f"model['{f}']", 64 if f == "model_hash" else 32)
        setattr(s, f, v)
    name = d.get("name")
    if name is not None and not isinstance(name, str):
        raise _arg_error(f"model['name']: got {name!r}, expected a str")
    keep = name.encode() if name else None
    s.name = keep
    return s, keep


def _limits(max_section_bytes: Any, max_total_bytes: Any) -> "_lib.kvrt_policy_limits":
    """The reader's limits as a kvrt_policy_limits (0: the reader's default)."""
    return _lib.kvrt_policy_limits(_uint(max_section_bytes, "max_section_bytes", 64),
                                   _uint(max_total_bytes, "max_total_bytes", 64))


class Policy(_Handle):
    """An open, fully validated ``.kvpol`` artifact (``kvrt_policy``).

    ``Policy.open(path, model="smollm2-135m")`` refuses an artifact compiled for another
    model with :class:`kvrt.ModelMismatchError` carrying the runtime's message; a corrupt file
    raises :class:`kvrt.FormatError` (``.detail`` = the kvpol status) or
    :class:`kvrt.KvrtIOError`. The per-policy handles (:meth:`compilerkv`, :meth:`am`,
    :meth:`compkv`, :meth:`kv2`, :meth:`merge_reduce`) are closed with the policy.
    """
    _free_fn = "kvrt_policy_free"

    def __init__(self, ptr: int, path: Optional[str] = None, buf: Optional[bytes] = None):
        super().__init__(ptr)
        self.path = path
        self._buf = buf  # open_mem: the buffer must outlive the handle

    @classmethod
    def open(cls, path: Union[str, os.PathLike], model: ModelSpec = None, *,
             max_section_bytes: int = 0, max_total_bytes: int = 0) -> "Policy":
        """kvrt_policy_open_limited: mmap and validate ``path``; ``model`` as in
        :func:`model_dims`. ``max_section_bytes`` / ``max_total_bytes`` bound what the open may
        decode (0: the reader's defaults, 1 GiB per section and 8 GiB in all)."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise KvrtError(ERR_ARG, f"kvrt.Policy.open: path: got {type(path).__name__}, "
                                     "expected a str or os.PathLike")
        p = os.fsdecode(path)
        lim = _limits(max_section_bytes, max_total_bytes)
        dims, _keep = _dims_struct(model_dims(model))
        out, err = c_void_p(), _lib.kvrt_error()
        # the file system's bytes (os.fsencode): a name that is not UTF-8 opens too
        check(lib.kvrt_policy_open_limited(os.fsencode(path),
                                           byref(dims) if dims is not None else None, byref(lim),
                                           byref(out), byref(err)), err)
        return cls(out.value, path=p)

    @classmethod
    def from_bytes(cls, data: bytes, model: ModelSpec = None, *, max_section_bytes: int = 0,
                   max_total_bytes: int = 0) -> "Policy":
        """kvrt_policy_open_mem_limited over a bytes object (kept alive by the policy); the
        limits as in :meth:`open`."""
        data = bytes(data)
        lim = _limits(max_section_bytes, max_total_bytes)
        dims, _keep = _dims_struct(model_dims(model))
        out, err = c_void_p(), _lib.kvrt_error()
        check(lib.kvrt_policy_open_mem_limited(ctypes.c_char_p(data), len(data),
                                               byref(dims) if dims is not None else None,
                                               byref(lim), byref(out), byref(err)), err)
        return cls(out.value, buf=data)

    @property
    def model(self) -> Dict[str, Any]:
        """kvrt_policy_model: the model the artifact was compiled for."""
        d = _lib.kvrt_model_dims()
        check(lib.kvrt_policy_model(self.ptr, byref(d)))
        out = {f: getattr(d, f) for f in _DIM_FIELDS if f != "name"}
        out["name"] = d.name.decode() if d.name else ""
        return out

    @property
    def groups(self) -> List[str]:
        """The policy groups the artifact carries ("compilerkv", "am", "compkv", "kv2",
        "merge-reduce"), from kvrt_policy_groups."""
        bits = int(lib.kvrt_policy_groups(self.ptr))
        return [name for g, name in sorted(GROUPS.items()) if bits & (1 << g)]

    def has(self, group: str) -> bool:
        return group in self.groups

    def info(self) -> Dict[str, Any]:
        """What ``kvcc inspect --json`` prints: header, model fingerprint, sections with their
        items (name, kind, dtype, shape, bytes, value of scalars and strings, min/max/mean of
        numeric tensors). Read through
        libkvpol (linked into libkvrt.so), not the kvcc binary. A policy opened from bytes
        reports "file": "<memory>"."""
        if self.path is None:
            return inspect(self._buf)
        return inspect(self.path)

    # per-policy handles
    def compilerkv(self) -> "CompilerKV":
        """kvrt_compilerkv_open: the compiled CompilerKV tables (UnsupportedError without the
        section)."""
        out = POINTER(_lib.kvrt_compilerkv_tables)()
        check(lib.kvrt_compilerkv_open(self.ptr, byref(out)))
        return CompilerKV(ctypes.cast(out, c_void_p).value, self)

    def am(self) -> "AMSchedule":
        """kvrt_am_open: the compiled Attention Matching schedule."""
        out = c_void_p()
        check(lib.kvrt_am_open(self.ptr, byref(out)))
        return AMSchedule(out.value, self)

    def compkv(self) -> "CompKVGrouping":
        """kvrt_compkv_open: the compiled CompKV grouping."""
        out = POINTER(_lib.kvrt_compkv_grouping)()
        check(lib.kvrt_compkv_open(self.ptr, byref(out)))
        return CompKVGrouping(ctypes.cast(out, c_void_p).value, self)

    def kv2(self):
        """kvrt_kv2_open: the compiled KV² schedule."""
        from .kv2 import KV2Schedule
        out = c_void_p()
        check(lib.kvrt_kv2_open(self.ptr, byref(out)))
        return KV2Schedule(out.value, self)

    def merge_reduce(self):
        """kvrt_mr_open: the compiled merge-reduce schedule."""
        from .mr import MRSchedule
        out = c_void_p()
        check(lib.kvrt_mr_open(self.ptr, byref(out)))
        return MRSchedule(out.value, self)

    def __repr__(self):
        if not self._ptr:
            return "kvrt.Policy(closed)"
        return f"kvrt.Policy({self.path!r}, model={self.model['name']!r}, groups={self.groups})"


def _cstr(b: bytes) -> str:
    return b.decode(errors="replace")


def inspect(path: Union[str, os.PathLike, bytes]) -> Dict[str, Any]:
    """``kvcc inspect --json FILE`` as a dict, computed through libkvpol (validates the whole
    file, unknown optional sections included; errors raise :class:`kvrt.FormatError` with the
    kvpol message). ``path`` may also be the artifact's bytes ("file": "<memory>")."""
    f, err = c_void_p(), _lib.kvpol_error()
    opts = _lib.kvpol_open_opts(flags=1)  # KVPOL_OPEN_VERIFY_ALL
    if isinstance(path, (bytes, bytearray)):
        p, data = "<memory>", bytes(path)
        rc = lib.kvpol_open_mem(byref(f), ctypes.c_char_p(data), len(data), byref(opts),
                                byref(err))
    else:
        p = os.fspath(path)
        rc = lib.kvpol_open_path(byref(f), p.encode(), byref(opts), byref(err))
    if rc:
        raise KvrtError(-3 if rc == -3 else -4, _cstr(err.msg), detail=rc)
    try:
        h = lib.kvpol_get_header(f).contents
        m = h.model
        hx = lambda v: f"{v:016x}"  # noqa: E731
        out: Dict[str, Any] = {
            "file": p, "file_size": h.file_size,
            "format_version": f"{h.version_major}.{h.version_minor}",
            "model": {"name": _cstr(m.name), "n_layers": m.n_layers, "n_heads": m.n_heads,
                      "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim,
                      "vocab_size": m.vocab_size, "max_context": m.max_context,
                      "rope_theta": m.rope_theta,
                      "rope_scaling": _ROPE.get(m.rope_scaling_type, "unknown"),
                      "rope_scaling_factor": m.rope_scaling_factor,
                      "model_hash": hx(m.model_hash)},
            "corpus_hash": hx(h.corpus_hash), "compiler_version": _cstr(h.compiler_version),
            "compile_options": _cstr(h.compile_options), "created": h.created,
            "header_checksum": hx(h.header_checksum), "table_checksum": hx(h.table_checksum),
            "sections": []}
        for i in range(lib.kvpol_section_count(f)):
            s = lib.kvpol_section_at(f, i).contents
            sec = {"id": s.id, "name": _cstr(s.name),
                   "group": lib.kvpol_group_name(s.group).decode(),
                   "group_version": s.group_version, "critical": bool(s.flags & 1),
                   "known": bool(s.known), "codec": "zstd" if s.codec == 1 else "none",
                   "offset": s.offset, "stored_size": s.stored_size, "raw_size": s.raw_size,
                   "raw_checksum": hx(s.raw_checksum), "items": []}
            for j in range(s.n_items if s.decoded else 0):
                it = _lib.kvpol_item()
                if lib.kvpol_item_at(f, i, j, byref(it)):
                    continue
                kind = {1: "tensor", 2: "scalar"}.get(it.kind, "string")
                o: Dict[str, Any] = {"name": _cstr(it.name), "kind": kind,
                                     "dtype": lib.kvpol_dtype_name(it.dtype).decode()}
                if it.kind == 1:
                    o["shape"] = [int(it.dims[dd]) for dd in range(it.ndim)]
                o["bytes"] = it.nbytes
                if it.kind == 3:
                    o["value"] = ctypes.string_at(it.data, it.nbytes).decode(errors="replace")
                elif it.kind == 2:
                    o.update(_scalar_json(it))
                else:
                    o.update(_tensor_stats(it))
                sec["items"].append(o)
            out["sections"].append(sec)
        return out
    finally:
        lib.kvpol_close(f)


# kvpol dtype codes (formats/kvpol.h) of the numeric types numpy reads directly; 3 is bf16
_KVPOL_NP = {1: np.float32, 2: np.float16, 4: np.float64, 5: np.int8, 6: np.uint8, 7: np.int16,
             8: np.uint16, 9: np.int32, 10: np.uint32, 11: np.int64, 12: np.uint64}


def _scalar_json(it) -> Dict[str, Any]:
    """A scalar's "value" as kvcc inspect --json writes it: a number where a double holds it
    exactly, an integer beyond 2^53 (a u64 checksum) as its decimal string."""
    if it.dtype in (1, 2, 3, 4):
        dv = c_double()
        return {"value": dv.value} if lib.kvpol_item_as_f64(byref(it), byref(dv)) == 0 else {}
    if it.dtype not in _KVPOL_NP:
        return {}
    v = int(np.frombuffer(ctypes.string_at(it.data, it.nbytes), dtype=_KVPOL_NP[it.dtype])[0])
    return {"value": float(v) if -(1 << 53) <= v <= (1 << 53) else str(v)}


def _tensor_stats(it) -> Dict[str, Any]:
    """min, max and mean of a numeric tensor as kvcc inspect --json computes them: every element
    as a double (integers through int64), summed left to right (np.cumsum is sequential);
    nothing when a u64 element is past INT64_MAX."""
    n = int(it.count)
    if n == 0 or (it.dtype != 3 and it.dtype not in _KVPOL_NP):
        return {}
    raw = ctypes.string_at(it.data, it.nbytes)
    if it.dtype == 3:
        a = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        a = np.frombuffer(raw, dtype=_KVPOL_NP[it.dtype])
    if a.dtype == np.uint64 and int(a.max()) > (1 << 63) - 1:
        return {}
    a = (a.astype(np.int64) if a.dtype.kind in "iu" else a).astype(np.float64)
    return {"min": float(a.min()), "max": float(a.max()), "mean": float(np.cumsum(a)[-1] / n)}


def _item_view(ptr, shape, dtype):
    n = int(np.prod(shape))
    if n == 0:
        return np.empty(shape, dtype=dtype)
    return np.ctypeslib.as_array(ptr, shape=(n,)).reshape(shape).copy()


# ------------------------------------------------------------------------------------------
# CompilerKV

def _ckv_stats(st: _lib.kvrt_compilerkv_stats) -> Dict[str, Any]:
    return {"candidates": st.candidates, "kept": st.kept, "tau": st.tau,
            "budget_index": st.budget_index, "b_ent": st.b_ent, "b_ppl": st.b_ppl}


class CompilerKVPrompt(_Handle):
    """Per-prompt state of CompilerKV (``kvrt_compilerkv_prompt``): add every layer's queries
    and keys (:meth:`add_layer`), then :meth:`finish` with the next-token log-probs."""
    _free_fn = "kvrt_compilerkv_prompt_free"

    _p = _struct_view(_lib.kvrt_compilerkv_prompt)

    def add_layer(self, q: ArrayLike, k: ArrayLike) -> None:
        """Step 1 for one layer: q [T, H, d] (only the last `window` rows are read), k [T, Hkv,
        d], post-RoPE."""
        fn = "kvrt.CompilerKVPrompt.add_layer"
        T = self.T
        qb = _buf(q, "q", fn, (T, None, None))
        kb = _buf(k, "k", fn, (T, None, qb.shape[2]))
        check(lib.kvrt_compilerkv_prompt_add_layer(self.ptr, qb.ptr, kb.ptr, qb.shape[1],
                                                   kb.shape[1], qb.shape[2]))

    def finish(self, next_logprob: ArrayLike) -> None:
        """alpha, entropy and ppl. next_logprob [T-1] float32: log p(token t+1 | 0..t)."""
        nb = _buf(next_logprob, "next_logprob", "kvrt.CompilerKVPrompt.finish", (self.T - 1,))
        check(lib.kvrt_compilerkv_prompt_finish(self.ptr, nb.ptr))

    @property
    def T(self) -> int:
        self.ptr
        return int(self._p.T)

    @property
    def window(self) -> int:
        return int(self._p.window)

    @property
    def n_layers(self) -> int:
        return int(self._p.n_layers)

    @property
    def finished(self) -> bool:
        return bool(self._p.finished)

    @property
    def entropy(self) -> float:
        return float(self._p.entropy)

    @property
    def ppl(self) -> float:
        return float(self._p.ppl)

    @property
    def alpha(self) -> np.ndarray:
        """float32 [T] after finish (a copy)."""
        if not self.finished:
            raise KvrtError(ERR_ARG, "kvrt.CompilerKVPrompt.alpha: call finish() first")
        return _item_view(self._p.alpha, (self.T,), np.float32)


class CompilerKV(_Handle):
    """The compiled CompilerKV tables (``kvrt_compilerkv_tables``)."""
    _free_fn = "kvrt_compilerkv_tables_free"
    NEAREST_BUDGET = 0x1

    _t = _struct_view(_lib.kvrt_compilerkv_tables)

    @property
    def window(self) -> int:
        self.ptr
        return int(self._t.window)

    @property
    def budgets(self) -> np.ndarray:
        """Compiled budgets (tokens, ascending), int64 [n_budgets]."""
        self.ptr
        return _item_view(self._t.budgets, (self._t.n_budgets,), np.int64)

    @property
    def w_head(self) -> np.ndarray:
        """Head-reliability weights float32 [n_budgets, n_layers, n_heads] (a copy)."""
        t = self._t
        self.ptr
        return _item_view(t.w_head, (t.n_budgets, t.n_layers, t.n_heads), np.float32)

    @property
    def t_gate(self) -> np.ndarray:
        """Thresholds float32 [n_budgets, n_layers, 20, 4] (a copy)."""
        t = self._t
        self.ptr
        return _item_view(t.t_gate, (t.n_budgets, t.n_layers, _lib.CKV_ENT_BINS,
                                     _lib.CKV_PPL_BINS), np.float32)

    @property
    def n_layers(self) -> int:
        return int(self._t.n_layers)

    @property
    def n_heads(self) -> int:
        return int(self._t.n_heads)

    def budget_index(self, budget: int, nearest: bool = False) -> int:
        """kvrt_compilerkv_budget_index (UnsupportedError listing the compiled budgets)."""
        i = c_uint32()
        check(lib.kvrt_compilerkv_budget_index(self.ptr, _uint(budget, "budget", 63),
                                               self.NEAREST_BUDGET if nearest else 0, byref(i)))
        return int(i.value)

    def kept_window(self, budget: int, T: int) -> int:
        """kvrt_compilerkv_kept_window: the always-kept recent tokens at budget."""
        return int(lib.kvrt_compilerkv_kept_window(self.window, _uint(budget, "budget", 63),
                                                   _uint(T, "T", 63)))

    def prompt(self, T: int) -> CompilerKVPrompt:
        """kvrt_compilerkv_prompt_create(T, window)."""
        out = POINTER(_lib.kvrt_compilerkv_prompt)()
        check(lib.kvrt_compilerkv_prompt_create(_uint(T, "T", 63), self.window, byref(out)))
        return CompilerKVPrompt(ctypes.cast(out, c_void_p).value, self)

    def select(self, prompt: CompilerKVPrompt, layer: int, v: ArrayLike, budget: int, *,
               nearest: bool = False, ctx: Optional[Context] = None
               ) -> Tuple[Selection, Dict[str, Any]]:
        """kvrt_compilerkv_select: steps 2-7 for one layer of a finished prompt; v [T, Hkv, d]
        (the context part); budget in tokens. Returns (selection, stats). The kept set is shared
        by all KV heads of the layer and may hold fewer than budget tokens (elastic)."""
        c = _ctx(ctx)
        vb = _carg(c, v, "v", "kvrt.CompilerKV.select", (prompt.T, None, None))
        out, st = c_void_p(), _lib.kvrt_compilerkv_stats()
        check(lib.kvrt_compilerkv_select(c.ptr, self.ptr, prompt.ptr, _uint(layer, "layer"), vb.ptr,
                                         vb.shape[1], vb.shape[2], _uint(budget, "budget", 63),
                                         self.NEAREST_BUDGET if nearest else 0, byref(out),
                                         byref(st)), ctx_ptr=c.ptr)
        return Selection(out.value), _ckv_stats(st)

    def select_all(self, q: Sequence[ArrayLike], k: Sequence[ArrayLike],
                   v: Sequence[ArrayLike], next_logprob: ArrayLike, budget: int, *,
                   nearest: bool = False, ctx: Optional[Context] = None
                   ) -> Tuple[List[Selection], List[Dict[str, Any]]]:
        """kvrt_compilerkv_select_all: every layer at once. q, k, v: one array per layer
        ([T, H, d], [T, Hkv, d], [T, Hkv, d]; device arrays on a CUDA context); next_logprob
        [T-1] (host)."""
        fn = "kvrt.CompilerKV.select_all"
        c = _ctx(ctx)
        L = len(q)
        if len(k) != L or len(v) != L or L == 0:
            raise KvrtError(ERR_SHAPE, f"{fn}: q, k, v: got {len(q)}, {len(k)}, {len(v)} layers, "
                                       "expected the same number >= 1")
        qb0 = _carg(c, q[0], "q[0]", fn, (None, None, None))
        T, H, d = qb0.shape
        kb0 = _carg(c, k[0], "k[0]", fn, (T, None, d))
        Hkv = kb0.shape[1]
        qs = [_carg(c, q[i], f"q[{i}]", fn, (T, H, d)) for i in range(L)]
        ks = [_carg(c, k[i], f"k[{i}]", fn, (T, Hkv, d)) for i in range(L)]
        vs = [_carg(c, v[i], f"v[{i}]", fn, (T, Hkv, d)) for i in range(L)]
        nb = _buf(next_logprob, "next_logprob", fn, (T - 1,))
        arr = lambda bs: (c_void_p * L)(*[b.ptr for b in bs])  # noqa: E731
        qa, ka, va = arr(qs), arr(ks), arr(vs)
        sels = (c_void_p * L)()
        stats = (_lib.kvrt_compilerkv_stats * L)()
        check(lib.kvrt_compilerkv_select_all(c.ptr, self.ptr, qa, ka, va, nb.ptr, T, H, Hkv, d,
                                             _uint(budget, "budget", 63),
                                             self.NEAREST_BUDGET if nearest else 0,
                                             sels, stats), ctx_ptr=c.ptr)
        return [Selection(s) for s in sels], [_ckv_stats(s) for s in stats]


# ------------------------------------------------------------------------------------------
# Attention Matching

_KEY_SELECT = {"highest": 0, "omp": 1}
_PRODUCTS = {"f32": 0, "bf16": 1}


def _choice(name: str, table: Dict[str, int]):
    """A converter for _fill_opts: a name in table to its code (codes pass through)."""
    def conv(val):
        if not isinstance(val, str):
            return val
        if val not in table:
            names = " or ".join(repr(k) for k in table)
            raise _arg_error(f"AM {name}: got {val!r}, expected {names}")
        return table[val]
    return conv


def _am_opts(base: Optional[_lib.kvrt_am_opts] = None, **kw) -> _lib.kvrt_am_opts:
    return _fill_opts(_lib.kvrt_am_opts, lib.kvrt_am_opts_init, base, "AM", kw,
                      {"key_select": _choice("key_select", _KEY_SELECT),
                       "products": _choice("products", _PRODUCTS)})


def _am_opts_dict(o: _lib.kvrt_am_opts) -> Dict[str, Any]:
    d = {f: getattr(o, f) for f, _ in o._fields_}
    d["key_select"] = {v: k for k, v in _KEY_SELECT.items()}.get(o.key_select, o.key_select)
    d["products"] = {v: k for k, v in _PRODUCTS.items()}.get(o.products, o.products)
    return d


def am_options(**overrides) -> Dict[str, Any]:
    """kvrt_am_opts_init's defaults, with overrides (key_select 'highest'/'omp', chunk, ridge,
    nnls_max_iter, max_queries, beta_floor, n_sink, recent_frac, omp_batch, products
    'f32'/'bf16')."""
    return _am_opts_dict(_am_opts(**overrides))


def _am_stats(s: _lib.kvrt_am_stats) -> Dict[str, Any]:
    return {f: getattr(s, f) for f, _ in s._fields_}


def am_compact(k: ArrayLike, v: ArrayLike, q_ref: ArrayLike, t: int, *,
               q_pos: Optional[ArrayLike] = None, dtype: str = "f32",
               ctx: Optional[Context] = None, **options) -> Tuple[Cache, Dict[str, Any]]:
    """kvrt_am_compact: one (layer, KV head). k, v [T, d] (key j at position j), q_ref [n, d]
    reference queries, q_pos [n] int32 their positions (a query sees keys j <= q_pos[i]) or
    None (every key), 1 <= t <= T. Returns (a one-head cache of at most t entries, stats)."""
    fn = "kvrt.am_compact"
    c = _ctx(ctx)
    kb = _carg(c, k, "k", fn, (None, None))
    T, d = kb.shape
    vb = _carg(c, v, "v", fn, (T, d))
    qb = _carg(c, q_ref, "q_ref", fn, (None, d))
    pp = None
    if q_pos is not None:
        pp = _carg(c, q_pos, "q_pos", fn, (qb.shape[0],), dtype=np.int32).ptr
    o = _am_opts(**options)
    out, st = c_void_p(), _lib.kvrt_am_stats()
    check(lib.kvrt_am_compact(c.ptr, byref(o), kb.ptr, vb.ptr, T, d, qb.ptr, pp, qb.shape[0],
                              int(t), _dtype_code(dtype), byref(out), byref(st)), ctx_ptr=c.ptr)
    return _ccache(out.value, c), _am_stats(st)


def am_compact_layer(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, ratio: float = 0.0,
                     ratios: Optional[ArrayLike] = None, dtype: str = "f32",
                     ctx: Optional[Context] = None, **options
                     ) -> Tuple[Cache, List[Dict[str, Any]]]:
    """kvrt_am_compact_layer (unscheduled): q [T, H, d] (the context's own queries), k, v [T,
    Hkv, d]; budget of head h: round(ratios[h] * T) (ratios [Hkv] in (0, 1]) or ratio for
    every head. options: see :func:`am_options`. Returns (cache, per-head stats)."""
    fn = "kvrt.am_compact_layer"
    c = _ctx(ctx)
    kb = _carg(c, k, "k", fn, (None, None, None))
    T, Hkv, d = kb.shape
    qb = _carg(c, q, "q", fn, (T, None, d))
    vb = _carg(c, v, "v", fn, (T, Hkv, d))
    rp = None
    if ratios is not None:
        rb = _buf(np.ascontiguousarray(ratios, dtype=np.float32), "ratios", fn, (Hkv,))
        rp = rb.ptr
    o = _am_opts(**options)
    out, stats = c_void_p(), (_lib.kvrt_am_stats * Hkv)()
    check(lib.kvrt_am_compact_layer(c.ptr, byref(o), qb.ptr, kb.ptr, vb.ptr, T, qb.shape[1], Hkv,
                                    d, rp, float(ratio), _dtype_code(dtype), byref(out), stats),
          ctx_ptr=c.ptr)
    return _ccache(out.value, c), [_am_stats(s) for s in stats]


_QUERY_SOURCE = {"context": 0, "repeat": 1, "self-study": 2}


def _query_source(val) -> int:
    if not isinstance(val, str):
        return int(val)
    if val not in _QUERY_SOURCE:
        raise _arg_error(f"AM query_source: got {val!r}, expected 'context', "
                                 "'repeat' or 'self-study'")
    return _QUERY_SOURCE[val]


def _am_ref_bufs(fn: str, c: Context, q_ref: ArrayLike, k: ArrayLike, v: ArrayLike,
                 q_pos: Optional[ArrayLike], dims: Tuple[Optional[int], ...] = (None,) * 3):
    """The checked buffers of a call on c with caller-given reference queries: (q_ref [n, H, d],
    k and v [T, Hkv, d], the q_pos pointer or None), device arrays on a CUDA context. dims: (H,
    Hkv, d) the arrays must have (a schedule's model), None where any will do."""
    H, Hkv, d = dims
    kb = _carg(c, k, "k", fn, (None, Hkv, d))
    T, Hkv, d = kb.shape
    qb = _carg(c, q_ref, "q_ref", fn, (None, H, d))
    vb = _carg(c, v, "v", fn, (T, Hkv, d))
    pp = None
    if q_pos is not None:
        pp = _carg(c, q_pos, "q_pos", fn, (qb.shape[0],), dtype=np.int32).ptr
    return qb, kb, vb, pp


def am_compact_layer_ref(q_ref: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                         q_pos: Optional[ArrayLike] = None, ratio: float = 0.0,
                         ratios: Optional[ArrayLike] = None, dtype: str = "f32",
                         ctx: Optional[Context] = None, **options
                         ) -> Tuple[Cache, List[Dict[str, Any]]]:
    """kvrt_am_compact_layer_ref: one layer with reference queries the caller hands in:
    q_ref [n, H, d] (e.g. the repeat-prefill queries of the context's second copy, see kvrt.h),
    q_pos [n] int32 their positions (a row sees keys j <= q_pos[i]) or None (every key), k, v
    [T, Hkv, d] the context. Budgets and options as :func:`am_compact_layer`."""
    fn = "kvrt.am_compact_layer_ref"
    c = _ctx(ctx)
    qb, kb, vb, pp = _am_ref_bufs(fn, c, q_ref, k, v, q_pos)
    T, Hkv, d = kb.shape
    rp = None
    if ratios is not None:
        rb = _buf(np.ascontiguousarray(ratios, dtype=np.float32), "ratios", fn, (Hkv,))
        rp = rb.ptr
    o = _am_opts(**options)
    out, stats = c_void_p(), (_lib.kvrt_am_stats * Hkv)()
    check(lib.kvrt_am_compact_layer_ref(c.ptr, byref(o), qb.ptr, pp, qb.shape[0], kb.ptr, vb.ptr,
                                        T, qb.shape[1], Hkv, d, rp, float(ratio),
                                        _dtype_code(dtype), byref(out), stats), ctx_ptr=c.ptr)
    return _ccache(out.value, c), [_am_stats(s) for s in stats]


def _policy_dims(policy: Optional[Policy], fn: str) -> Tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim) of the model a schedule was opened from."""
    if policy is None:
        raise KvrtError(ERR_ARG, f"{fn}: the schedule was not opened from a kvrt.Policy "
                                 "(Policy.am() / Policy.merge_reduce()), so its model's shape "
                                 "is unknown")
    m = policy.model
    return int(m["n_heads"]), int(m["n_kv_heads"]), int(m["head_dim"])


class AMSchedule(_Handle):
    """The compiled Attention Matching schedule (``kvrt_am_schedule``)."""
    _free_fn = "kvrt_am_schedule_free"

    def __init__(self, ptr: int, policy: Optional[Policy] = None):
        super().__init__(ptr, policy)
        self.policy = policy

    def _dims(self, fn: str) -> Tuple[int, int, int]:
        """(n_heads, n_kv_heads, head_dim) of the policy's model: the C calls size q, k, v
        and the stats by them, so arrays of another shape are refused here."""
        return _policy_dims(self.policy, fn)

    @property
    def targets(self) -> List[float]:
        """The compiled target mean ratios."""
        t, n = POINTER(c_double)(), c_int()
        check(lib.kvrt_am_schedule_targets(self.ptr, byref(t), byref(n)))
        return [t[i] for i in range(n.value)]

    def options(self) -> Dict[str, Any]:
        """The compiled options (kvrt_am_schedule_opts)."""
        o = _lib.kvrt_am_opts()
        check(lib.kvrt_am_schedule_opts(self.ptr, byref(o)))
        return _am_opts_dict(o)

    def _opts_arg(self, options: Dict[str, Any]):
        """The options argument of a scheduled call: None (the compiled ones), or the compiled
        ones with ``options`` applied on top."""
        if not options:
            return None
        base = _lib.kvrt_am_opts()
        check(lib.kvrt_am_schedule_opts(self.ptr, byref(base)))
        return byref(_am_opts(base, **options))

    @property
    def query_source(self) -> str:
        """The reference queries the schedule was calibrated with: 'context', 'repeat' or
        'self-study' (kvrt_am_schedule_query_source)."""
        qs = c_int()
        check(lib.kvrt_am_schedule_query_source(self.ptr, byref(qs)))
        return lib.kvrt_am_query_source_name(qs.value).decode()

    @property
    def self_study_tokens(self) -> int:
        """Self-study schedules: the answer tokens per turn the calibration generated
        (``kvcc compile --am-self-tokens``; 256 in artifacts without the item); 0 for the other
        query sources (kvrt_am_schedule_self_study_tokens)."""
        n = c_int64()
        check(lib.kvrt_am_schedule_self_study_tokens(self.ptr, byref(n)))
        return n.value

    def compact_scheduled_ref(self, q_ref: ArrayLike, k: ArrayLike, v: ArrayLike, target: float,
                              layer: int, *, query_source="repeat",
                              q_pos: Optional[ArrayLike] = None, dtype: str = "f32",
                              ctx: Optional[Context] = None, override: bool = False, **options
                              ) -> Tuple[Cache, List[Dict[str, Any]]]:
        """kvrt_am_compact_scheduled_ref: one layer with the compiled ratios and reference
        queries q_ref [n, H, d] (q_pos [n] or None) of the stated query_source; a source other
        than the schedule's (:attr:`query_source`) is refused unless override."""
        fn = "kvrt.AMSchedule.compact_scheduled_ref"
        c = _ctx(ctx)
        qb, kb, vb, pp = _am_ref_bufs(fn, c, q_ref, k, v, q_pos, self._dims(fn))
        T, Hkv, _ = kb.shape
        op = self._opts_arg(options)
        out, stats = c_void_p(), (_lib.kvrt_am_stats * Hkv)()
        check(lib.kvrt_am_compact_scheduled_ref(c.ptr, self.ptr, op,
                                                OVERRIDE_OPTIONS if override else 0,
                                                _number(target, "target"), _uint(layer, "layer"),
                                                _query_source(query_source), qb.ptr, pp,
                                                qb.shape[0], kb.ptr, vb.ptr, T, qb.shape[1],
                                                _dtype_code(dtype), byref(out), stats),
              ctx_ptr=c.ptr)
        return _ccache(out.value, c), [_am_stats(s) for s in stats]

    def ratios(self, target: float, layer: int) -> np.ndarray:
        """Per-KV-head ratios float32 [Hkv] of layer for a compiled target."""
        r = POINTER(c_float)()
        check(lib.kvrt_am_schedule_ratios(self.ptr, _number(target, "target"), _uint(layer, "layer"), byref(r)))
        hkv = self.policy.model["n_kv_heads"] if self.policy else 0
        return _item_view(r, (hkv,), np.float32)

    def compact_scheduled(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, target: float,
                          layer: int, *, dtype: str = "f32", ctx: Optional[Context] = None,
                          override: bool = False, **options
                          ) -> Tuple[Cache, List[Dict[str, Any]]]:
        """kvrt_am_compact_scheduled: one layer with the compiled ratios of ``layer`` for
        ``target``. q [T, H, d], k, v [T, Hkv, d]. options (as :func:`am_options`) that differ
        from the compiled ones are refused (ArgError naming the option) unless override."""
        fn = "kvrt.AMSchedule.compact_scheduled"
        c = _ctx(ctx)
        H, Hkv, d = self._dims(fn)
        kb = _carg(c, k, "k", fn, (None, Hkv, d))
        T = kb.shape[0]
        qb = _carg(c, q, "q", fn, (T, H, d))
        vb = _carg(c, v, "v", fn, (T, Hkv, d))
        op = self._opts_arg(options)
        out, stats = c_void_p(), (_lib.kvrt_am_stats * Hkv)()
        check(lib.kvrt_am_compact_scheduled(c.ptr, self.ptr, op,
                                            OVERRIDE_OPTIONS if override else 0, _number(target, "target"),
                                            _uint(layer, "layer"), qb.ptr, kb.ptr, vb.ptr, T, qb.shape[1],
                                            _dtype_code(dtype), byref(out), stats), ctx_ptr=c.ptr)
        return _ccache(out.value, c), [_am_stats(s) for s in stats]

    compact = compact_scheduled


# ------------------------------------------------------------------------------------------
# CompKV

def _compkv_opts(base: Optional[_lib.kvrt_compkv_opts] = None, **kw) -> _lib.kvrt_compkv_opts:
    o = _lib.kvrt_compkv_opts()
    names = [f for f, _ in o._fields_]
    return _fill_opts(_lib.kvrt_compkv_opts, lib.kvrt_compkv_opts_init, base, "CompKV", kw,
                      {f: (float if f == "scale" else int) for f in names})


def compkv_options(**overrides) -> Dict[str, Any]:
    """kvrt_compkv_opts_init's defaults with overrides (block, r, scale, compensate, mass_only,
    first_order, n_sink_blocks, n_recent_blocks)."""
    o = _compkv_opts(**overrides)
    return {f: getattr(o, f) for f, _ in o._fields_}


class CompKVState(_Handle):
    """One layer's CompKV decode state (``kvrt_compkv``): the full cache plus per-block
    summaries; :meth:`append` tokens as they arrive, :meth:`step` per decode step. On a CUDA
    context the state is device memory and so is every array of its calls (k, v, q, scores,
    blocks, and the ``out`` arrays, required there)."""
    _free_fn = "kvrt_compkv_free"

    def __init__(self, ptr: int, ctx: Context, n_kv_heads: int, head_dim: int):
        super().__init__(ptr, ctx)
        self.ctx, self.n_kv_heads, self.head_dim = ctx, n_kv_heads, head_dim

    @classmethod
    def create(cls, n_kv_heads: int, head_dim: int, capacity: int, *,
               perm: Optional[ArrayLike] = None, offsets: Optional[ArrayLike] = None,
               ctx: Optional[Context] = None, **options) -> "CompKVState":
        """kvrt_compkv_create: a state for up to ``capacity`` tokens; perm [Hkv, d] and offsets
        [Hkv, r + 1] (uint16, both or neither) the grouping; options: :func:`compkv_options`."""
        c = _ctx(ctx)
        o = _compkv_opts(**options)
        pp = op = None
        keep = []
        if perm is not None or offsets is not None:
            pa = np.ascontiguousarray(perm, dtype=np.uint16)
            oa = np.ascontiguousarray(offsets, dtype=np.uint16)
            keep = [pa, oa]
            pp, op = _addr(pa), _addr(oa)
        out = c_void_p()
        check(lib.kvrt_compkv_create(c.ptr, byref(o), _uint(n_kv_heads, "n_kv_heads"), _uint(head_dim, "head_dim"),
                                     int(capacity), pp, op, byref(out)), ctx_ptr=c.ptr)
        del keep
        return cls(out.value, c, _uint(n_kv_heads, "n_kv_heads"), _uint(head_dim, "head_dim"))

    def append(self, k: ArrayLike, v: ArrayLike) -> None:
        """Append n tokens k, v [n, Hkv, d] (ShapeError past capacity; nothing appended)."""
        fn = "kvrt.CompKVState.append"
        kb = _carg(self.ctx, k, "k", fn, (None, self.n_kv_heads, self.head_dim))
        vb = _carg(self.ctx, v, "v", fn, kb.shape)
        check(lib.kvrt_compkv_append(self.ptr, kb.ptr, vb.ptr, kb.shape[0]))

    @property
    def length(self) -> int:
        return int(lib.kvrt_compkv_length(self.ptr))

    @property
    def n_blocks(self) -> int:
        return int(lib.kvrt_compkv_n_blocks(self.ptr))

    @property
    def groups(self) -> int:
        return int(lib.kvrt_compkv_groups(self.ptr))

    def _q(self, q, fn):
        return _carg(self.ctx, q, "q", fn, (None, self.head_dim))

    def _res(self, r, out):
        return r.obj if out is None else out

    def scores(self, q: ArrayLike, *, out: Optional[ArrayLike] = None):
        """Block scores float32 [Hkv, n_blocks] for one decode step, q [H, d]."""
        fn = "kvrt.CompKVState.scores"
        qb = self._q(q, fn)
        sb = _cout(self.ctx, (self.n_kv_heads, self.n_blocks), out, "out", fn)
        check(lib.kvrt_compkv_scores(self.ptr, qb.ptr, qb.shape[0], sb.ptr))
        return self._res(sb, out)

    def select(self, scores: ArrayLike, k_blocks: int, *, out: Optional[ArrayLike] = None):
        """Blocks to read per KV head, int32 [Hkv, min(k_blocks, n_blocks)] ascending."""
        fn = "kvrt.CompKVState.select"
        nb = self.n_blocks
        sb = _carg(self.ctx, scores, "scores", fn, (self.n_kv_heads, nb))
        k_blocks = _uint(k_blocks, "k_blocks")
        ob = _cout(self.ctx, (self.n_kv_heads, min(k_blocks, nb)), out, "out", fn, np.int32)
        check(lib.kvrt_compkv_select(self.ptr, sb.ptr, k_blocks, ob.ptr))
        return self._res(ob, out)

    def attend_blocks(self, q: ArrayLike, blocks: ArrayLike, *, out: Optional[ArrayLike] = None):
        """Attention of one step over blocks [Hkv, n_sel] (strictly ascending per head); out
        [H, d], unselected blocks compensated by their means when the options say so."""
        fn = "kvrt.CompKVState.attend_blocks"
        qb = self._q(q, fn)
        bb = _carg(self.ctx, blocks, "blocks", fn, (self.n_kv_heads, None), dtype=np.int32)
        ob = _cout(self.ctx, (qb.shape[0], self.head_dim), out, "out", fn)
        check(lib.kvrt_compkv_attend_blocks(self.ptr, qb.ptr, qb.shape[0], bb.ptr, bb.shape[1],
                                            ob.ptr))
        return self._res(ob, out)

    def step(self, q: ArrayLike, k_blocks: int, *, out: Optional[ArrayLike] = None,
             blocks_out: Optional[ArrayLike] = None):
        """kvrt_compkv_step: scores, select k_blocks, attend. Returns (out [H, d], blocks [Hkv,
        min(k_blocks, n_blocks)]); on a CUDA context both are device arrays the caller gives."""
        fn = "kvrt.CompKVState.step"
        qb = self._q(q, fn)
        k_blocks = _uint(k_blocks, "k_blocks")
        ob = _cout(self.ctx, (qb.shape[0], self.head_dim), out, "out", fn)
        bb = _cout(self.ctx, (self.n_kv_heads, min(k_blocks, self.n_blocks)), blocks_out,
                   "blocks_out", fn, np.int32)
        check(lib.kvrt_compkv_step(self.ptr, qb.ptr, qb.shape[0], k_blocks, ob.ptr, bb.ptr))
        return self._res(ob, out), self._res(bb, blocks_out)


class CompKVGrouping(_Handle):
    """The compiled CompKV grouping (``kvrt_compkv_grouping``) of every layer."""
    _free_fn = "kvrt_compkv_grouping_free"

    _g = _struct_view(_lib.kvrt_compkv_grouping)

    n_layers = property(lambda self: int(self._g.n_layers))
    n_kv_heads = property(lambda self: int(self._g.n_kv_heads))
    head_dim = property(lambda self: int(self._g.head_dim))
    r = property(lambda self: int(self._g.r))
    block = property(lambda self: int(self._g.block))
    scale = property(lambda self: float(self._g.scale))

    @property
    def perm(self) -> np.ndarray:
        """uint16 [n_layers, n_kv_heads, head_dim] (a copy)."""
        g = self._g
        return _item_view(g.perm, (g.n_layers, g.n_kv_heads, g.head_dim), np.uint16)

    @property
    def offsets(self) -> np.ndarray:
        """uint16 [n_layers, n_kv_heads, r + 1] (a copy)."""
        g = self._g
        return _item_view(g.offsets, (g.n_layers, g.n_kv_heads, g.r + 1), np.uint16)

    @property
    def learned(self) -> np.ndarray:
        g = self._g
        return _item_view(g.learned, (g.n_layers, g.n_kv_heads), np.uint8).astype(bool)

    def options(self) -> Dict[str, Any]:
        """The compiled options (kvrt_compkv_grouping_opts)."""
        o = _lib.kvrt_compkv_opts()
        check(lib.kvrt_compkv_grouping_opts(self.ptr, byref(o)))
        return {f: getattr(o, f) for f, _ in o._fields_}

    def create_layer(self, layer: int, capacity: int, *, ctx: Optional[Context] = None,
                     override: bool = False, **options) -> CompKVState:
        """kvrt_compkv_create_layer: a decode state for ``layer`` with the compiled grouping.
        options (as :func:`compkv_options`): block or scale differing from the compiled ones are
        refused unless override, and another r always (the compiled offsets fix it);
        compensate, mass_only, first_order, forced blocks are run-time choices."""
        c = _ctx(ctx)
        op = None
        if options:
            base = _lib.kvrt_compkv_opts()
            check(lib.kvrt_compkv_grouping_opts(self.ptr, byref(base)))
            op = byref(_compkv_opts(base, **options))
        out = c_void_p()
        check(lib.kvrt_compkv_create_layer(c.ptr, self.ptr, _uint(layer, "layer"), int(capacity), op,
                                           OVERRIDE_OPTIONS if override else 0, byref(out)),
              ctx_ptr=c.ptr)
        return CompKVState(out.value, c, self.n_kv_heads, self.head_dim)
