"""Objects over the libkvrt handles: Context, Policy, Selection, Cache, attention, baselines.

Array conventions (exactly kvrt.h's): every tensor is a C-contiguous float32 array in
row-major order; ``T`` context tokens, ``H`` query heads, ``Hkv`` KV heads, ``d`` head dim,
``G = H / Hkv`` query heads per KV head (query head ``h`` reads KV head ``h // G``).

* queries ``q``: ``[T, H, d]`` (or ``[n, H, d]`` for ``n`` new queries);
* keys and values ``k``, ``v``: ``[T, Hkv, d]``;
* token scores: ``[Hkv, T]``.

Zero-copy: numpy arrays that are C-contiguous float32 are passed to C by pointer, never
copied. torch CPU tensors are viewed through ``tensor.detach().numpy()`` (shared memory, no
copy). Anything else (float64, a transposed view, a slice with strides) is refused with
:class:`kvrt.DtypeError` / :class:`kvrt.ShapeError` naming the argument; call
:func:`kvrt.as_f32` (an explicit copy) first. Objects with ``__cuda_array_interface__`` (torch
CUDA tensors, CuPy) are passed by device pointer to calls on a CUDA :class:`Context`.
"""
from __future__ import annotations

import ctypes
import math
import threading
import sys
import weakref
from ctypes import byref, c_double, c_float, c_int, c_int64, c_uint32, c_void_p, POINTER
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib
from ._lib import lib
from .errors import (ERR_ARG, ERR_DEVICE, ERR_DTYPE, ERR_SHAPE, ERR_UNSUPPORTED, KvrtError,
                     check)

ArrayLike = Any  # numpy.ndarray, torch.Tensor, or an object with __cuda_array_interface__

DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 1, 2, 3
_DTYPES = {"f32": DTYPE_F32, "float32": DTYPE_F32, "f16": DTYPE_F16, "float16": DTYPE_F16,
           "bf16": DTYPE_BF16, "bfloat16": DTYPE_BF16}
_DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_F16: "f16", DTYPE_BF16: "bf16"}
BACKEND_CPU, BACKEND_CUDA = 0, 1
OVERRIDE_OPTIONS = 0x100

OPS = ("softmax_rows", "attend", "topk", "cache_gather", "snapkv_scores", "h2o_scores",
       "compilerkv_select", "am_compact", "am_compact_layer", "compkv_create", "compkv_scores",
       "compkv_attend_blocks", "compkv_step", "kv2_proxy", "kv2_score", "mr_reduce",
       "mr_compress", "compkv_select")


def _dtype_code(dtype: Union[str, int]) -> int:
    if isinstance(dtype, int):
        return dtype
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise KvrtError(ERR_DTYPE, f"{_api_name()}: dtype: got {dtype!r}, expected 'f32', 'f16' "
                                   "or 'bf16'") from None


def _storage_np(dtype: str):
    """The numpy element type of a cache's keys/values: bf16 has none, so its raw bits
    (uint16; :func:`bf16_to_f32` widens them)."""
    return {"f16": np.float16, "bf16": np.uint16}.get(dtype, np.float32)


def f32_to_bf16(x: ArrayLike) -> np.ndarray:
    """kvrt_f32_to_bf16 on an array: the bf16 bits (uint16), round to nearest even, NaN kept a
    quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), r)
    return r.astype(np.uint16)


def bf16_to_f32(h: ArrayLike) -> np.ndarray:
    """kvrt_bf16_to_f32 on an array of bf16 bits (uint16): exact."""
    return (np.ascontiguousarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)) \
        .view(np.float32)


# ------------------------------------------------------------------------------------------
# buffers

class _Buf:
    """A pointer to an array's data plus what keeps it alive."""
    __slots__ = ("obj", "ptr", "shape", "device")

    def __init__(self, obj, ptr: int, shape: Tuple[int, ...], device: str):
        self.obj, self.ptr, self.shape, self.device = obj, ptr, shape, device


_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _addr(x: np.ndarray) -> int:
    """The data address of a C-contiguous array (from_buffer is ~4x cheaper than
    x.ctypes.data; read-only or empty arrays take the slow path)."""
    try:
        return _addressof(_from_buffer(x))
    except (TypeError, ValueError):
        return x.ctypes.data


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def as_f32(x: ArrayLike) -> np.ndarray:
    """An explicit copy (when needed) to a C-contiguous float32 numpy array.

    The bindings never copy silently; use this when an array is float64, strided or a
    torch tensor that requires a copy. Returns ``x`` itself when it already fits.
    """
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _shape_str(expect) -> str:
    return "[" + ", ".join("*" if e is None else str(e) for e in expect) + "]"


def _buf(x: ArrayLike, name: str, fn: str, expect: Optional[Sequence[Optional[int]]] = None,
         dtype=np.float32, allow_device: bool = False) -> _Buf:
    """Validate ``x`` (dtype, contiguity, shape) and return its data pointer without copying."""
    if type(x) is not np.ndarray:
        x = _foreign(x, name, fn, expect, dtype, allow_device)
        if type(x) is _Buf:
            return x
    if x.dtype != dtype:
        raise KvrtError(ERR_DTYPE, f"{fn}: {name}: got dtype {x.dtype}, expected "
                                   f"{np.dtype(dtype).name} (kvrt.as_f32(x) copies explicitly)")
    if not x.flags.c_contiguous:
        raise KvrtError(ERR_SHAPE, f"{fn}: {name}: not C-contiguous (strides {x.strides}); "
                                   "np.ascontiguousarray(x) / kvrt.as_f32(x) copies explicitly")
    shape = x.shape
    if expect is not None:
        if len(shape) != len(expect):
            _bad_shape(shape, name, fn, expect)
        for s, e in zip(shape, expect):
            if e is not None and e != s:
                _bad_shape(shape, name, fn, expect)
    return _Buf(x, _addr(x), shape, "host")


def _foreign(x, name, fn, expect, dtype, allow_device):
    """A torch CPU tensor -> its numpy view; a CUDA array -> a device _Buf; else refused."""
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        if not allow_device:
            raise KvrtError(ERR_DEVICE, f"{fn}: {name}: a CUDA array, but this call runs on the "
                                        "host (copy it to the CPU, or use a CUDA Context)")
        want = np.dtype(dtype).str
        if np.dtype(cai["typestr"]).str != want:
            raise KvrtError(ERR_DTYPE, f"{fn}: {name}: got dtype {cai['typestr']}, expected "
                                       f"{np.dtype(dtype).name}")
        shape = tuple(int(s) for s in cai["shape"])
        st = cai.get("strides")
        if st is not None:
            item, exp = np.dtype(dtype).itemsize, []
            acc = item
            for s in reversed(shape):
                exp.append(acc)
                acc *= s
            if tuple(st) != tuple(reversed(exp)) and math.prod(shape) > 1:
                raise KvrtError(ERR_SHAPE, f"{fn}: {name}: not C-contiguous (strides {st}); "
                                           "call .contiguous() first")
        _check_shape(shape, name, fn, expect)
        return _Buf(x, int(cai["data"][0]), shape, "cuda")
    if _is_torch(x):
        if x.device.type != "cpu":
            raise KvrtError(ERR_DEVICE, f"{fn}: {name}: a torch tensor on {x.device}: expected "
                                        "a CPU tensor (or a CUDA tensor with a CUDA Context)")
        try:
            return x.detach().numpy()  # shares memory
        except TypeError:  # a dtype numpy has not (bfloat16)
            raise KvrtError(ERR_DTYPE, f"{fn}: {name}: got dtype {x.dtype}, expected "
                                       f"{np.dtype(dtype).name} (x.float() copies)") from None
        except RuntimeError as e:  # a lazy conjugate or negative view
            raise KvrtError(ERR_ARG, f"{fn}: {name}: {e}") from None
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev = x.__dlpack_device__()
        if int(dev[0]) != 1:  # kDLCPU
            raise KvrtError(ERR_DEVICE, f"{fn}: {name}: a DLPack array on device {tuple(dev)}: "
                                        "expected a CPU array")
        return np.from_dlpack(x)  # shares memory
    raise KvrtError(ERR_ARG, f"{fn}: {name}: got {type(x).__name__}, expected a numpy "
                             "array or a torch tensor")


def _bad_shape(shape, name, fn, expect):
    raise KvrtError(ERR_SHAPE, f"{fn}: {name}: got shape {list(shape)}, expected "
                               f"{_shape_str(expect)}")


def _check_shape(shape, name, fn, expect):
    if expect is None:
        return
    if len(shape) != len(expect) or any(e is not None and e != s for s, e in zip(shape, expect)):
        raise KvrtError(ERR_SHAPE, f"{fn}: {name}: got shape {list(shape)}, expected "
                                   f"{_shape_str(expect)}")


def _out(shape, out: Optional[np.ndarray], name: str, fn: str, dtype=np.float32,
         device: str = "host") -> _Buf:
    """An output buffer: a new numpy array, or ``out`` checked (dtype, contiguity, shape, and
    that it lives on ``device``)."""
    if out is None:
        a = np.empty(shape, dtype=dtype)
        return _Buf(a, _addr(a), a.shape, "host")
    b = _on(_buf(out, name, fn, shape, dtype, allow_device=device == "cuda"), device, name, fn)
    if isinstance(b.obj, np.ndarray) and not b.obj.flags.writeable:
        # written in place: a read-only view (np.frombuffer of bytes, a broadcast) must not be
        raise KvrtError(ERR_ARG, f"{fn}: {name}: read-only (flags.writeable is False); an "
                                 "output is written in place")
    return b


def _on(b: _Buf, device: str, name: str, fn: str) -> _Buf:
    """Refuse a host buffer where a device one is needed (and the reverse)."""
    if b.device != device:
        raise KvrtError(ERR_DEVICE, f"{fn}: {name}: a {b.device} array, expected a {device} "
                                    "array for this context")
    return b


# ------------------------------------------------------------------------------------------
# handles

def _struct_view(struct_type):
    """A handle's property reading its C struct (struct_type at the handle's address), refused
    after close(): the struct's memory is freed with the handle."""
    def get(self):
        self.ptr  # ArgError after close()
        v = self.__dict__.get("_view")
        if v is None:
            v = self._view = ctypes.cast(self._ptr, POINTER(struct_type)).contents
        return v
    return property(get)


class _Handle:
    """Owns one C handle: ``close()`` frees it (idempotent), so do ``with`` and ``__del__``.

    A handle made on a parent (a device cache on its context, a schedule on its policy) keeps
    the parent alive and is closed first when the parent is closed. The garbage collector
    finalizes a reference cycle in any order, after clearing the weak registry of children: a
    parent finalized while children are still open defers its own free to the last of them,
    so no handle is freed after what it depends on."""
    _free_fn: str = ""
    _what: str = "handle"

    def __init__(self, ptr: int, parent: Optional["_Handle"] = None):
        self._ptr = ptr
        self._parent = parent          # keeps what this handle depends on alive
        self._children: "Optional[weakref.WeakSet[_Handle]]" = None
        self._open_children = 0        # children not yet freed (the WeakSet may be cleared)
        self._deferred = None          # a freed-later C handle (see the class comment)
        if parent is not None and ptr:  # a NULL handle has nothing to free before its parent
            if parent._children is None:
                parent._children = weakref.WeakSet()
            parent._children.add(self)
            parent._open_children += 1

    @property
    def ptr(self) -> int:
        """The C handle's address; KvrtError ARG after close()."""
        if not self._ptr:
            raise KvrtError(ERR_ARG, f"kvrt.{type(self).__name__}: used after close()")
        return self._ptr

    @property
    def closed(self) -> bool:
        return not self._ptr

    def __copy__(self):
        # a copy would hold the same C handle, which both would free (a double free at exit)
        raise TypeError(f"kvrt.{type(self).__name__} cannot be copied: it owns a C handle "
                        "(make a new one; kvrt.hf: copy a model outside its apply() block)")

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):  # pickling would copy the handle the same way
        return self.__copy__()

    def close(self) -> None:
        """Free the handle (and first every handle that depends on it). Idempotent."""
        for c in list(getattr(self, "_children", None) or ()):
            c.close()
        p, self._ptr = getattr(self, "_ptr", None), None
        if not p:
            return
        if getattr(self, "_open_children", 0) > 0:  # finalized in a cycle before its children
            self._deferred = p
            return
        getattr(lib, self._free_fn)(p)
        self._child_freed()

    def _child_freed(self) -> None:
        par = getattr(self, "_parent", None)
        if par is None:
            return
        par._open_children -= 1
        if par._open_children == 0 and par._deferred:
            q, par._deferred = par._deferred, None
            getattr(lib, par._free_fn)(q)
            par._child_freed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class Context(_Handle):
    """A backend context (``kvrt_ctx``): where ops run.

    ``Context("cpu", threads=None)``: the CPU backend (threads None/0: the OpenMP default).
    ``Context("cuda", device=0)``: the CUDA backend; raises :class:`kvrt.NoCudaError` when the
    library was built without CUDA and :class:`kvrt.NoDeviceError` when no GPU is usable.
    Device caches and decode states created on a context are closed with it.
    """
    _free_fn = "kvrt_ctx_free"

    def __init__(self, backend: str = "cpu", threads: Optional[int] = None, device: int = 0):
        names = {"cpu": BACKEND_CPU, "cuda": BACKEND_CUDA}
        if backend not in names:
            raise KvrtError(ERR_ARG, f"kvrt.Context: backend: got {backend!r}, expected 'cpu' "
                                     "or 'cuda'")
        opts = _lib.kvrt_ctx_options(n_threads=_uint(threads or 0, "threads", 31),
                                     device_id=_uint(device, "device", 31))
        out, err = c_void_p(), _lib.kvrt_error()
        check(lib.kvrt_ctx_create(names[backend], byref(opts), byref(out), byref(err)), err)
        super().__init__(out.value)
        self.backend = backend

    def info(self) -> Dict[str, Any]:
        """kvrt_ctx_info: backend, name ("CPU (2 threads)", "NVIDIA H200"), device_id,
        compute capability, total_mem (bytes, 0 on CPU), n_threads."""
        di = _lib.kvrt_device_info()
        check(lib.kvrt_ctx_info(self.ptr, byref(di)), ctx_ptr=self.ptr)
        return {"backend": "cuda" if di.backend == BACKEND_CUDA else "cpu",
                "name": di.name.decode(), "device_id": di.device_id,
                "compute_capability": (di.cc_major, di.cc_minor), "total_mem": di.total_mem,
                "n_threads": di.n_threads}

    def supports(self, op: Union[str, int]) -> bool:
        """kvrt_backend_supports: whether this backend implements op (a name of :data:`OPS`)."""
        if isinstance(op, str):
            if op not in OPS:
                raise KvrtError(ERR_ARG, f"kvrt.Context.supports: op: got {op!r}, expected one "
                                         f"of {', '.join(OPS)}")
            i = OPS.index(op)
        else:
            i = _uint(op, "op")
        return bool(lib.kvrt_backend_supports(self.ptr, i))

    def sync(self) -> None:
        """kvrt_ctx_sync: wait for the queued device work."""
        check(lib.kvrt_ctx_sync(self.ptr), ctx_ptr=self.ptr)

    def __repr__(self):
        return f"kvrt.Context({self.backend!r})" if self._ptr else "kvrt.Context(closed)"


def has_cuda() -> bool:
    """kvrt_has_cuda: this libkvrt was built with the CUDA backend."""
    return bool(lib.kvrt_has_cuda())


def cuda_device_count() -> int:
    """kvrt_cuda_device_count (0 without CUDA or without a GPU)."""
    return int(lib.kvrt_cuda_device_count())


_default = threading.local()


def default_context() -> Context:
    """This thread's CPU context, used when a call is given ``ctx=None`` (one per thread, so
    that its last error is the thread's; kvrt.h's thread rules)."""
    c = getattr(_default, "ctx", None)
    if c is None or c.closed:
        c = _default.ctx = Context("cpu")
    return c


def _ctx(ctx: Optional[Context]) -> Context:
    return default_context() if ctx is None else ctx


def _where(c: Optional[Context]) -> str:
    """Where the arrays of a call on context c live: "cuda" on a CUDA context, else "host"."""
    return "cuda" if c is not None and c.backend == "cuda" else "host"


def _carg(c: Optional[Context], x, name: str, fn: str, expect, dtype=np.float32) -> _Buf:
    """An array argument of a call that runs on context c: host memory on a CPU context, device
    memory on a CUDA one (``__cuda_array_interface__``: torch CUDA tensors, CuPy); the other kind
    is refused (DeviceError) instead of handing a GPU a host pointer."""
    w = _where(c)
    return _on(_buf(x, name, fn, expect, dtype, allow_device=w == "cuda"), w, name, fn)


def _cout(c: Optional[Context], shape, out, name: str, fn: str, dtype=np.float32) -> _Buf:
    """An output array of a call on context c: new (host) or ``out`` on a CPU context; ``out``,
    a device array, required on a CUDA one."""
    if _where(c) == "cuda" and out is None:
        raise KvrtError(ERR_ARG, f"{fn}: {name}: required on a CUDA context (a device array "
                                 f"{list(shape)} of {np.dtype(dtype).name})")
    return _out(shape, out, name, fn, dtype=dtype, device=_where(c))


# ------------------------------------------------------------------------------------------
# selections and caches

class Selection(_Handle):
    """A token selection per KV head (``kvrt_selection``): CSR ``offsets [Hkv + 1]`` and
    ``positions`` ascending within each head. Read with :attr:`offsets`, :attr:`positions`,
    :meth:`head`, :meth:`to_list` (numpy copies)."""
    _free_fn = "kvrt_selection_free"

    def __init__(self, ptr: int):
        super().__init__(ptr)
        self._s = _lib.kvrt_selection.from_address(ptr)

    @classmethod
    def from_positions(cls, heads: Sequence[Sequence[int]]) -> "Selection":
        """A selection from one list of positions per KV head (kept in the given order)."""
        counts = np.array([len(h) for h in heads], dtype=np.int64)
        if len(counts) < 1:
            raise KvrtError(ERR_ARG, "kvrt.Selection.from_positions: expected >= 1 KV head")
        out = c_void_p()
        check(lib.kvrt_selection_create(len(counts), _addr(counts), byref(out)))
        sel = cls(out.value)
        n = int(counts.sum())
        if n:
            dst = np.ctypeslib.as_array(sel._s.positions, shape=(n,))
            dst[:] = np.concatenate([np.asarray(h, dtype=np.int32) for h in heads])
        return sel

    @property
    def n_kv_heads(self) -> int:
        self.ptr
        return int(self._s.n_kv_heads)

    @property
    def offsets(self) -> np.ndarray:
        """int64 [Hkv + 1] (a copy)."""
        return np.ctypeslib.as_array(self._s.offsets, shape=(self.n_kv_heads + 1,)).copy()

    @property
    def counts(self) -> np.ndarray:
        """Positions per KV head, int64 [Hkv]."""
        return np.diff(self.offsets)

    @property
    def positions(self) -> np.ndarray:
        """int32 [offsets[-1]]: every head's positions, head after head (a copy)."""
        n = int(self.offsets[-1])
        if n == 0:
            return np.empty(0, dtype=np.int32)
        return np.ctypeslib.as_array(self._s.positions, shape=(n,)).copy()

    def head(self, j: int) -> np.ndarray:
        """KV head j's positions (int32, ascending)."""
        o = self.offsets
        if not 0 <= j < self.n_kv_heads:
            raise KvrtError(ERR_ARG, f"kvrt.Selection.head: j = {j}, expected 0..{self.n_kv_heads - 1}")
        return self.positions[o[j]:o[j + 1]]

    def to_list(self) -> List[np.ndarray]:
        o, p = self.offsets, self.positions
        return [p[o[j]:o[j + 1]] for j in range(len(o) - 1)]

    def __len__(self) -> int:
        return self.n_kv_heads

    def __repr__(self):
        if not self._ptr:
            return "kvrt.Selection(closed)"
        return f"kvrt.Selection(n_kv_heads={self.n_kv_heads}, counts={self.counts.tolist()})"


class CacheArrays:
    """Host copies of a cache's arrays: ``offsets`` int64 [Hkv + 1], ``keys`` and ``values``
    [n_entries, d] (float32; float16 for f16 storage; for bf16 storage the raw bits as uint16,
    :func:`kvrt.bf16_to_f32` widens them), ``bias`` float32 [n_entries] (the
    additive logit bias: 0 for plain tokens, AM beta, log weight), ``positions`` int32
    [n_entries] (original token position, -1 for synthetic entries)."""

    def __init__(self, offsets, keys, values, bias, positions):
        self.offsets, self.keys, self.values, self.bias, self.positions = \
            offsets, keys, values, bias, positions

    def head(self, j: int) -> Dict[str, np.ndarray]:
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return {"keys": self.keys[a:b], "values": self.values[a:b], "bias": self.bias[a:b],
                "positions": self.positions[a:b]}

    def __iter__(self):
        return iter((self.offsets, self.keys, self.values, self.bias, self.positions))


class Cache(_Handle):
    """One layer's compressed KV cache (``kvrt_cache``): per KV head a ragged list of entries
    (key, value, bias, position). Created by :meth:`gather`, :meth:`create`,
    :meth:`from_arrays`, or returned by the policy calls; :meth:`to_device` copies it into a
    context's memory. Only what is kept is allocated: :attr:`nbytes` is kvrt_cache_bytes."""
    _free_fn = "kvrt_cache_free"

    def __init__(self, ptr: int, ctx: Optional[Context] = None):
        super().__init__(ptr, parent=ctx)
        self._c = _lib.kvrt_cache.from_address(ptr)
        self.ctx = ctx

    # constructors
    @classmethod
    def create(cls, n_kv_heads: int, head_dim: int, counts: Sequence[int],
               dtype: str = "f32") -> "Cache":
        """kvrt_cache_create: counts[j] zeroed entries for head j (bias 0, positions -1)."""
        n_kv_heads, head_dim = _uint(n_kv_heads, "n_kv_heads"), _uint(head_dim, "head_dim")
        cnt = np.ascontiguousarray(counts, dtype=np.int64)
        if cnt.shape != (n_kv_heads,):
            raise KvrtError(ERR_SHAPE, f"kvrt.Cache.create: counts: got shape {list(cnt.shape)}, "
                                       f"expected [{n_kv_heads}]")
        out = c_void_p()
        check(lib.kvrt_cache_create(n_kv_heads, head_dim, _dtype_code(dtype), _addr(cnt),
                                    byref(out)))
        return cls(out.value)

    @classmethod
    def from_arrays(cls, offsets, keys, values, bias=None, positions=None,
                    dtype: str = "f32") -> "Cache":
        """A host cache holding the given entries (copied in): offsets [Hkv + 1], keys and
        values [n_entries, d] float32, bias [n_entries] (default 0), positions [n_entries]
        (default -1). f16 and bf16 storage round the keys and values to nearest even."""
        off = np.asarray(offsets, dtype=np.int64)
        keys = np.asarray(keys, dtype=np.float32)
        values = np.asarray(values, dtype=np.float32)
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or np.any(np.diff(off) < 0):
            raise KvrtError(ERR_ARG, "kvrt.Cache.from_arrays: offsets: expected [Hkv + 1] "
                                     "non-decreasing from 0")
        n = int(off[-1])
        if keys.ndim != 2 or keys.shape[0] != n or values.shape != keys.shape:
            raise KvrtError(ERR_SHAPE, f"kvrt.Cache.from_arrays: keys/values: got "
                                       f"{list(keys.shape)}/{list(values.shape)}, expected [{n}, d]")
        c = cls.create(len(off) - 1, keys.shape[1], np.diff(off), dtype)
        if n:
            a = c._arrays_view()
            if c.dtype == "f16":
                a["keys"][:] = keys.astype(np.float16)
                a["values"][:] = values.astype(np.float16)
            elif c.dtype == "bf16":
                a["keys"][:] = f32_to_bf16(keys)
                a["values"][:] = f32_to_bf16(values)
            else:
                a["keys"][:] = keys
                a["values"][:] = values
            for nm, arr, dt in (("bias", bias, np.float32), ("positions", positions, np.int32)):
                if arr is None:
                    continue
                arr = np.asarray(arr, dtype=dt)
                if arr.shape != (n,):
                    c.close()
                    raise KvrtError(ERR_SHAPE, f"kvrt.Cache.from_arrays: {nm}: got shape "
                                               f"{list(arr.shape)}, expected [{n}]")
                a[nm][:] = arr
        return c

    @classmethod
    def gather(cls, k: ArrayLike, v: ArrayLike, selection: Selection,
               dtype: str = "f32") -> "Cache":
        """kvrt_cache_gather: the selected tokens of a full cache k, v [T, Hkv, d] (float32)
        into a new cache allocating only what is kept (bias 0, positions = the selection)."""
        fn = "kvrt.Cache.gather"
        kb = _buf(k, "k", fn, (None, selection.n_kv_heads, None))
        T, Hkv, d = kb.shape
        vb = _buf(v, "v", fn, (T, Hkv, d))
        out = c_void_p()
        check(lib.kvrt_cache_gather(kb.ptr, vb.ptr, T, Hkv, d, selection.ptr, _dtype_code(dtype),
                                    byref(out)))
        return cls(out.value)

    def to_device(self, ctx: Context) -> "Cache":
        """kvrt_cache_to_device: a copy in ctx's memory (CUDA: device memory; CPU: a host
        copy). It is closed when ctx is."""
        out = c_void_p()
        check(lib.kvrt_cache_to_device(ctx.ptr, self.ptr, byref(out)), ctx_ptr=ctx.ptr)
        return Cache(out.value, ctx)

    # properties
    @property
    def n_kv_heads(self) -> int:
        self.ptr
        return int(self._c.n_kv_heads)

    @property
    def head_dim(self) -> int:
        self.ptr
        return int(self._c.head_dim)

    @property
    def n_entries(self) -> int:
        self.ptr
        return int(self._c.n_entries)

    @property
    def dtype(self) -> str:
        self.ptr
        return _DTYPE_NAMES.get(self._c.dtype, str(self._c.dtype))

    @property
    def device(self) -> str:
        self.ptr
        return "cuda" if self._c.device == 1 else "host"

    @property
    def offsets(self) -> np.ndarray:
        """int64 [Hkv + 1] (host copy of the CSR offsets)."""
        self.ptr
        return np.ctypeslib.as_array(self._c.host_offsets, shape=(self._c.n_kv_heads + 1,)).copy()

    @property
    def counts(self) -> np.ndarray:
        """Entries per KV head, int64 [Hkv]."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        """kvrt_cache_bytes: keys + values + bias + positions + offsets, on the cache's device."""
        return int(lib.kvrt_cache_bytes(self.ptr))

    def _arrays_view(self) -> Dict[str, np.ndarray]:
        """Views (no copy) of a host cache's arrays; valid while the cache lives."""
        c, n, d = self._c, self.n_entries, self.head_dim
        if self.device != "host" or (self.ctx is not None and self.ctx.backend != "cpu"):
            raise KvrtError(ERR_DEVICE, "kvrt.Cache: a device cache has no host views (to_numpy copies)")
        et = _storage_np(self.dtype)
        if n == 0:
            z = np.empty((0, d), dtype=et)
            return {"keys": z, "values": z.copy(), "bias": np.empty(0, np.float32),
                    "positions": np.empty(0, np.int32)}
        nb = n * d * np.dtype(et).itemsize
        keys = np.frombuffer((ctypes.c_char * nb).from_address(c.keys), dtype=et).reshape(n, d)
        values = np.frombuffer((ctypes.c_char * nb).from_address(c.values), dtype=et).reshape(n, d)
        return {"keys": keys, "values": values,
                "bias": np.ctypeslib.as_array(c.bias, shape=(n,)),
                "positions": np.ctypeslib.as_array(c.positions, shape=(n,))}

    def to_numpy(self) -> CacheArrays:
        """Host copies of offsets, keys, values, bias, positions (:class:`CacheArrays`);
        keys/values are float16 for f16 storage, the bits (uint16) for bf16. Device caches are
        downloaded."""
        if self.device == "host" and (self.ctx is None or self.ctx.backend == "cpu"):
            a = self._arrays_view()
            return CacheArrays(self.offsets, a["keys"].copy(), a["values"].copy(),
                               a["bias"].copy(), a["positions"].copy())
        n, d = self.n_entries, self.head_dim
        et = _storage_np(self.dtype)
        keys, values = np.empty((n, d), et), np.empty((n, d), et)
        bias, pos = np.empty(n, np.float32), np.empty(n, np.int32)
        c, cp = self._c, self.ctx.ptr
        for dst, src in ((keys, c.keys), (values, c.values),
                         (bias, ctypes.cast(c.bias, c_void_p).value),
                         (pos, ctypes.cast(c.positions, c_void_p).value)):
            if dst.nbytes:
                check(lib.kvrt_ctx_download(cp, _addr(dst), src, dst.nbytes), ctx_ptr=cp)
        return CacheArrays(self.offsets, keys, values, bias, pos)

    def __repr__(self):
        if not self._ptr:
            return "kvrt.Cache(closed)"
        return (f"kvrt.Cache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, device={self.device!r}, counts={self.counts.tolist()}, "
                f"nbytes={self.nbytes})")


def _ccache(ptr: int, c: Optional[Context]) -> Cache:
    """A cache made by a call on context c: on a CUDA context a device cache of c (closed with
    it; :meth:`Cache.to_numpy` downloads it), else a host cache."""
    return Cache(ptr, c if _where(c) == "cuda" else None)


# ------------------------------------------------------------------------------------------
# attention

def attend(q: ArrayLike, cache: Cache, k_recent: Optional[ArrayLike] = None,
           v_recent: Optional[ArrayLike] = None, *, scale: Optional[float] = None,
           ctx: Optional[Context] = None, return_lse: bool = False, out: Optional[ArrayLike] = None,
           lse_out: Optional[ArrayLike] = None):
    """kvrt_attend: attention of ``n`` queries over a compressed cache plus exact recent tokens.

    ``q [n, H, d]``; ``cache`` with Hkv KV heads (``H`` a multiple of Hkv: query head h reads KV
    head h // G, GQA); ``k_recent``, ``v_recent`` ``[n_recent, Hkv, d]`` or None: query i sees
    recent tokens ``j < n_recent - n + i + 1`` (causal; the last query sees all). Logits are
    ``q.k * scale + bias`` over the cache entries (``scale`` default ``1/sqrt(d)``) and
    ``q.k_recent * scale`` over the recent tokens. Returns ``out [n, H, d]`` (float32), and with
    ``return_lse`` also ``lse [n, H]`` (natural log-sum-exp of the scaled, biased logits; an empty
    row gives out 0 and lse -inf). On a CUDA context, q, the recent tokens and ``out`` (required
    then) are device arrays and the cache one of :meth:`Cache.to_device` on that context.
    """
    fn = "kvrt.attend"
    if not isinstance(cache, Cache):
        raise KvrtError(ERR_ARG, f"{fn}: cache: got {type(cache).__name__}, expected a "
                                 "kvrt.Cache (Cache.gather(k, v, selection) makes one)")
    c = _ctx(ctx)
    dev = c.backend == "cuda"
    d = cache.head_dim
    where = "cuda" if dev else "host"
    qb = _on(_buf(q, "q", fn, (None, None, d), allow_device=dev), where, "q", fn)
    n, H, _ = qb.shape
    if (k_recent is None) != (v_recent is None):
        raise KvrtError(ERR_ARG, f"{fn}: k_recent and v_recent: give both or neither")
    kp = vp = None
    n_recent = 0
    if k_recent is not None:
        kb = _on(_buf(k_recent, "k_recent", fn, (None, cache.n_kv_heads, d), allow_device=dev),
                 where, "k_recent", fn)
        n_recent = kb.shape[0]
        vb = _on(_buf(v_recent, "v_recent", fn, kb.shape, allow_device=dev), where, "v_recent", fn)
        kp, vp = kb.ptr, vb.ptr
    if dev and (out is None or (return_lse and lse_out is None)):
        raise KvrtError(ERR_ARG, f"{fn}: out (and lse_out with return_lse): required on a CUDA "
                                 f"context (device arrays [{n}, {H}, {d}] and [{n}, {H}])")
    if dev and cache.device != "cuda":
        raise KvrtError(ERR_DEVICE, f"{fn}: cache: a host cache on a CUDA context (use "
                                    "cache.to_device(ctx))")
    ob = _out((n, H, d), out, "out", fn, device=where)
    lb = (_out((n, H), lse_out, "lse_out", fn, device=where)
          if (return_lse or lse_out is not None) else None)
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    check(lib.kvrt_attend(c.ptr, qb.ptr, n, H, cache.ptr, kp, vp, n_recent, s, ob.ptr,
                          lb.ptr if lb else None), ctx_ptr=c.ptr)
    o = ob.obj if out is None else out
    if return_lse:
        return o, (lb.obj if lse_out is None else lse_out)
    return o


# ------------------------------------------------------------------------------------------
# selection primitives and baseline methods

METHODS = ("full", "streaming", "random", "snapkv", "h2o", "knorm", "keydiff")
_METHOD_ALIASES = {"streamingllm": "streaming"}


def _method_code(method: Union[str, int]) -> int:
    if isinstance(method, int) and not isinstance(method, bool):
        return method
    if not isinstance(method, str):
        raise _arg_error(f"method: got {method!r}, expected one of {', '.join(METHODS)}")
    m = lib.kvrt_method_from_name(_METHOD_ALIASES.get(method, method).encode())
    if m < 0:
        raise _arg_error(f"method: got {method!r}, expected one of "
                                 f"{', '.join(METHODS)} (or 'streamingllm')")
    return m


def _frame_name(f) -> str:
    """kvrt.[hf.]Class.method (or kvrt.function) of frame f: a constructor names the class of
    the object it builds; without co_qualname (Python < 3.11) the class comes from self/cls."""
    code, mod = f.f_code, f.f_globals.get("__name__", "")
    prefix = "kvrt.hf." if mod == "kvrt.hf" else "kvrt."
    obj = f.f_locals.get("self", f.f_locals.get("cls"))
    if code.co_name == "__init__" and obj is not None:
        return prefix + type(obj).__name__
    q = getattr(code, "co_qualname", None)
    if q is None:
        q = code.co_name
        if obj is not None:
            q = (obj.__name__ if isinstance(obj, type) else type(obj).__name__) + "." + q
    return prefix + q


def _api_name() -> str:
    """The public kvrt function the user called, as "kvrt.Class.method" (or "kvrt.function"):
    the outermost frame of the kvrt package on the stack whose function name is not private (a
    public function that another one calls is not what the user called). "kvrt" when there is
    none. For the messages of the argument checks that many calls share (_uint, _number, option
    fields)."""
    name, f = "kvrt", sys._getframe(1)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod != "kvrt" and not mod.startswith("kvrt."):
            break
        if not f.f_code.co_name.startswith("_") or f.f_code.co_name == "__init__":
            name = _frame_name(f)
        f = f.f_back
    return name


def _arg_error(msg: str) -> KvrtError:
    """An ArgError whose message starts with the function the user called (_api_name)."""
    return KvrtError(ERR_ARG, f"{_api_name()}: {msg}")


def _uint(v, name: str, bits: int = 32) -> int:
    """An unsigned integer argument (a layer, a count, an option) checked before ctypes wraps
    it: -1 would reach C as 4294967295. ArgError naming the argument."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or \
            not 0 <= int(v) < (1 << bits):
        raise _arg_error(f"{name}: got {v!r}, expected an integer in "
                                 f"0..{(1 << bits) - 1}")
    return int(v)


def _number(v, name: str) -> float:
    """A real argument (a budget, a ratio, a target): a str such as "16" is refused, not parsed."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise _arg_error(f"{name}: got {v!r}, expected a number")
    return float(v)


def budget_resolve(budget: float, T: int) -> int:
    """kvrt_budget_resolve: budget >= 1 is a token count (rounded to nearest), 0 < budget < 1 a
    ratio of T (at least 1); refused (ArgError) when <= 0, not finite, or a count > T."""
    out = c_int64()
    check(lib.kvrt_budget_resolve(_number(budget, "budget"), _uint(T, "T", 63), byref(out)))
    return int(out.value)


def topk(scores: ArrayLike, k: int) -> np.ndarray:
    """kvrt_topk: indices (int32, ascending) of the k largest scores[0..n) (ties: lower index;
    NaN lowest)."""
    sb = _buf(scores, "scores", "kvrt.topk", (None,))
    k = _uint(k, "k", 63)
    idx = np.empty(k, dtype=np.int32)
    check(lib.kvrt_topk(sb.ptr, sb.shape[0], k, _addr(idx)))
    return idx


def select_pinned(scores: Optional[ArrayLike], T: int, budget: int, n_sink: int = 0,
                  n_recent: int = 0) -> np.ndarray:
    """kvrt_select_pinned: ``budget`` positions of [0, T) (int32, ascending): the first n_sink
    and last n_recent pinned (inside the budget), the rest the highest scores [T] among the
    unpinned (topk rules). scores may be None when the pins fill the budget."""
    sp = None
    T, budget = _uint(T, "T", 63), _uint(budget, "budget", 63)
    n_sink, n_recent = _uint(n_sink, "n_sink", 63), _uint(n_recent, "n_recent", 63)
    if scores is not None:
        sp = _buf(scores, "scores", "kvrt.select_pinned", (T,)).ptr
    idx = np.empty(budget, dtype=np.int32)
    check(lib.kvrt_select_pinned(sp, T, budget, n_sink, n_recent, _addr(idx)))
    return idx


class Quest(_Handle):
    """Quest pages (``kvrt_quest``): per page of ``page`` tokens and KV head the elementwise
    min and max of the keys, k [T, Hkv, d]; decode-time page scores and selection.

    ``Quest(k, page)`` summarizes a host array (``kvrt_quest_summarize``); ``Quest.create(ctx,
    ...)`` makes an empty summary in a context's memory (``kvrt_quest_create``) that
    :meth:`append` fills. On a CUDA context the summary lives in device memory and k, q and the
    ``out`` arrays of :meth:`scores` and :meth:`select` (required then) are device arrays
    (``__cuda_array_interface__``: torch CUDA tensors, CuPy); :attr:`kmin` and :attr:`kmax`
    download."""
    _free_fn = "kvrt_quest_free"

    def __init__(self, k: ArrayLike, page: int = 16):
        kb = _buf(k, "k", "kvrt.Quest", (None, None, None))
        T, Hkv, d = kb.shape
        out = c_void_p()
        check(lib.kvrt_quest_summarize(kb.ptr, T, Hkv, d, _uint(page, "page"), byref(out)))
        super().__init__(out.value)
        self._init(Hkv, d, page, None)

    def _init(self, Hkv, d, page, ctx):
        self._q = _lib.kvrt_quest.from_address(self._ptr)
        self.n_kv_heads, self.head_dim, self.page = int(Hkv), int(d), int(page)
        self._ctx = ctx
        self.device = "cuda" if ctx is not None and ctx.backend == "cuda" else "host"

    @classmethod
    def create(cls, ctx: Context, n_kv_heads: int, head_dim: int, page: int = 16,
               capacity: int = 1 << 20) -> "Quest":
        """kvrt_quest_create: an empty summary in ctx's memory with room for ``capacity``
        tokens (appending past it raises; on a CPU context the room grows). Closed when ctx
        is."""
        out = c_void_p()
        check(lib.kvrt_quest_create(ctx.ptr, _uint(n_kv_heads, "n_kv_heads"),
                                    _uint(head_dim, "head_dim"), _uint(page, "page"),
                                    int(capacity), byref(out)), ctx_ptr=ctx.ptr)
        self = cls.__new__(cls)
        _Handle.__init__(self, out.value, ctx)
        self._init(n_kv_heads, head_dim, page, ctx)
        return self

    @property
    def n_pages(self) -> int:
        self.ptr
        return int(self._q.n_pages)

    @property
    def n_tokens(self) -> int:
        self.ptr
        return int(self._q.T)

    def _arg(self, x, name, fn, expect):
        return _carg(self._ctx, x, name, fn, expect)

    def _result(self, shape, out, name, fn, dtype):
        return _cout(self._ctx, shape, out, name, fn, dtype)

    def append(self, k: ArrayLike) -> None:
        """Summarize new tokens k [n, Hkv, d] (what a server does per decoded token)."""
        kb = self._arg(k, "k", "kvrt.Quest.append", (None, self.n_kv_heads, self.head_dim))
        check(lib.kvrt_quest_append(self.ptr, kb.ptr, kb.shape[0]),
              ctx_ptr=self._ctx.ptr if self._ctx is not None else None)

    def _pages(self, ptr) -> np.ndarray:
        stride = int(self._q.page_stride)
        n = self.n_kv_heads * stride * self.head_dim
        if self.device == "cuda":
            a = np.empty(n, np.float32)
            check(lib.kvrt_ctx_download(self._ctx.ptr, _addr(a), ptr, a.nbytes),
                  ctx_ptr=self._ctx.ptr)
        else:
            a = np.ctypeslib.as_array(ptr, shape=(n,))
        return a.reshape(self.n_kv_heads, stride, self.head_dim)[:, :self.n_pages].copy()

    @property
    def kmin(self) -> np.ndarray:
        """float32 [Hkv, n_pages, d] (a host copy); kmax likewise."""
        self.ptr
        return self._pages(self._q.kmin)

    @property
    def kmax(self) -> np.ndarray:
        self.ptr
        return self._pages(self._q.kmax)

    def scores(self, q: ArrayLike, out: Optional[ArrayLike] = None):
        """Upper-bound scores [Hkv, n_pages] for one step q [H, d]."""
        fn = "kvrt.Quest.scores"
        qb = self._arg(q, "q", fn, (None, self.head_dim))
        ob = self._result((self.n_kv_heads, self.n_pages), out, "out", fn, np.float32)
        check(lib.kvrt_quest_scores(self.ptr, qb.ptr, qb.shape[0], ob.ptr),
              ctx_ptr=self._ctx.ptr if self._ctx is not None else None)
        return ob.obj if out is None else out

    def select(self, q: ArrayLike, budget_pages: int, out: Optional[ArrayLike] = None):
        """Pages [Hkv, budget_pages] ascending per head: first and last always, then top
        scores."""
        fn = "kvrt.Quest.select"
        qb = self._arg(q, "q", fn, (None, self.head_dim))
        budget_pages = _uint(budget_pages, "budget_pages", 63)
        ob = self._result((self.n_kv_heads, budget_pages), out, "out", fn, np.int32)
        check(lib.kvrt_quest_select(self.ptr, qb.ptr, qb.shape[0], budget_pages, ob.ptr),
              ctx_ptr=self._ctx.ptr if self._ctx is not None else None)
        return ob.obj if out is None else out

    def __repr__(self):
        if not self._ptr:
            return "kvrt.Quest(closed)"
        return (f"kvrt.Quest(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"page={self.page}, n_pages={self.n_pages}, device={self.device!r})")


def _method_opts(method, budget: int, n_sink=None, window=None, pool_kernel=None,
                 seed=None) -> _lib.kvrt_method_opts:
    o = _lib.kvrt_method_opts()
    lib.kvrt_method_opts_init(byref(o), _method_code(method), int(budget))
    if n_sink is not None:
        o.n_sink = _uint(n_sink, "n_sink")
    if window is not None:
        o.window = _uint(window, "window")
    if pool_kernel is not None:
        o.pool_kernel = _uint(pool_kernel, "pool_kernel")
    if seed is not None:
        o.seed = _uint(seed, "seed", 64)
    return o


def method_select(method: Union[str, int], q: Optional[ArrayLike], k: ArrayLike,
                  budget: float, *, n_sink: Optional[int] = None, window: Optional[int] = None,
                  pool_kernel: Optional[int] = None, seed: Optional[int] = None,
                  n_heads: Optional[int] = None) -> Selection:
    """kvrt_method_select: a baseline's selection of ``budget`` tokens per KV head.

    ``method``: one of :data:`METHODS` ('streamingllm' is accepted for 'streaming'). ``q [T, H,
    d]`` the context's own post-RoPE queries (needed by snapkv and h2o; may be None for the
    others, then give ``n_heads`` or H = Hkv is assumed); ``k [T, Hkv, d]``. ``budget``: a
    token count, or a ratio of T in (0, 1) (:func:`budget_resolve`; ignored by full). Options
    default to kvrt_method_opts_init's: n_sink 4, window 32, pool_kernel 7, seed 0.
    """
    fn = "kvrt.method_select"
    kb = _buf(k, "k", fn, (None, None, None))
    T, Hkv, d = kb.shape
    qp, H = None, _uint(n_heads, "n_heads") if n_heads else Hkv
    _need_queries(fn, method, q)
    if q is not None:
        qb = _buf(q, "q", fn, (T, None, d))
        qp, H = qb.ptr, qb.shape[1]
    m = _method_code(method)
    b = T if m == 0 else budget_resolve(budget, T)
    o = _method_opts(m, b, n_sink, window, pool_kernel, seed)
    out = c_void_p()
    check(lib.kvrt_method_select(byref(o), qp, kb.ptr, None, T, H, Hkv, d, byref(out)))
    return Selection(out.value)


def _need_queries(fn: str, method, q) -> None:
    """snapkv and h2o score keys by the queries' attention: q None is refused by name."""
    if q is None and _method_code(method) in (_method_code("snapkv"), _method_code("h2o")):
        raise KvrtError(ERR_ARG, f"{fn}: q: got None, but {method} scores the keys by the "
                                 "queries' attention: pass the context's queries q [T, H, d]")


def method_has_scores(method: Union[str, int]) -> bool:
    """kvrt_method_has_scores: snapkv, h2o, knorm and keydiff score tokens."""
    return bool(lib.kvrt_method_has_scores(_method_code(method)))


def method_scores(method: Union[str, int], q: Optional[ArrayLike], k: ArrayLike, *,
                  ctx: Optional[Context] = None, n_sink: Optional[int] = None,
                  window: Optional[int] = None, pool_kernel: Optional[int] = None,
                  seed: Optional[int] = None, n_heads: Optional[int] = None,
                  out: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """kvrt_method_scores: the budget-independent token scores ``[Hkv, T]`` (higher = keep) of
    snapkv, h2o, knorm, keydiff (None for full, streaming, random). ``ctx`` None: the CPU
    paths; with a context the score ops run through its backend table (a CUDA context: q, k and
    ``out``, required, are device arrays)."""
    fn = "kvrt.method_scores"
    kb = _carg(ctx, k, "k", fn, (None, None, None))
    T, Hkv, d = kb.shape
    qp, H = None, _uint(n_heads, "n_heads") if n_heads else Hkv
    _need_queries(fn, method, q)
    if q is not None:
        qb = _carg(ctx, q, "q", fn, (T, None, d))
        qp, H = qb.ptr, qb.shape[1]
    m = _method_code(method)
    o = _method_opts(m, T, n_sink, window, pool_kernel, seed)
    has = lib.kvrt_method_has_scores(m)
    ob = _cout(ctx, (Hkv, T), out, "out", fn) if has else None
    cp = ctx.ptr if ctx is not None else None
    check(lib.kvrt_method_scores(cp, byref(o), qp, kb.ptr, T, H, Hkv, d,
                                 ob.ptr if ob else None), ctx_ptr=cp)
    return ob.obj if ob else None


def method_select_scored(method: Union[str, int], scores: Optional[ArrayLike], budget: float, *,
                         T: Optional[int] = None, n_kv_heads: Optional[int] = None,
                         n_sink: Optional[int] = None, window: Optional[int] = None,
                         pool_kernel: Optional[int] = None,
                         seed: Optional[int] = None) -> Selection:
    """kvrt_method_select_scored: the selection at ``budget`` from :func:`method_scores`'
    scores ``[Hkv, T]`` with the same options (scores None for full/streaming/random: then give
    T and n_kv_heads). Equals :func:`method_select`'s, position for position."""
    fn = "kvrt.method_select_scored"
    sp = None
    if scores is not None:
        sb = _buf(scores, "scores", fn, (n_kv_heads, T))
        n_kv_heads, T = sb.shape
        sp = sb.ptr
    if T is None or n_kv_heads is None:
        raise KvrtError(ERR_ARG, f"{fn}: without scores, give T and n_kv_heads")
    m = _method_code(method)
    b = T if m == 0 else budget_resolve(budget, T)
    o = _method_opts(m, b, n_sink, window, pool_kernel, seed)
    out = c_void_p()
    check(lib.kvrt_method_select_scored(byref(o), sp, T, n_kv_heads, byref(out)))
    return Selection(out.value)


def _fill_opts(struct_type, init, base, what: str, kw: Dict[str, Any],
               convert: Optional[Dict[str, Callable[[Any], Any]]] = None):
    """An options struct of the C API: a copy of `base`, or the library's defaults (`init`, e.g.
    lib.kvrt_mr_opts_init), with the keyword overrides set (None: left as is). `convert` maps a
    field to a function turning a Python value (a name, ...) into the field's value, raising
    KvrtError for a bad one. An unknown field raises KvrtError naming the known ones."""
    o = struct_type()
    if base is None:
        init(byref(o))
    else:
        ctypes.pointer(o)[0] = base
    names = [f for f, _ in o._fields_]
    for key, val in kw.items():
        if val is None:
            continue
        if key not in names:
            raise _arg_error(f"{what} option {key!r} unknown, expected one of "
                                     f"{', '.join(names)}")
        if convert and key in convert:
            val = convert[key](val)
        val = _field_value(dict(o._fields_)[key], val, f"{what} option {key}")
        setattr(o, key, val)
    return o


_UNSIGNED = {ctypes.c_uint8: 8, ctypes.c_uint16: 16, ctypes.c_uint32: 32, ctypes.c_uint64: 64}
_SIGNED = {ctypes.c_int8: 8, ctypes.c_int16: 16, ctypes.c_int32: 32, ctypes.c_int64: 64}


def _field_value(ftype, val, name: str):
    """A value for a ctypes struct field of type ftype, checked as ctypes does not: an unsigned
    field refuses -1 (which would wrap), an integer field a float or str, a real field a str."""
    if ftype in _UNSIGNED:
        return _uint(val, name, _UNSIGNED[ftype])
    if ftype in _SIGNED:
        bits = _SIGNED[ftype]
        if not isinstance(val, (int, np.integer, np.bool_)) or \
                not -(1 << (bits - 1)) <= int(val) < (1 << (bits - 1)):  # bools: flags
            raise _arg_error(f"{name}: got {val!r}, expected an integer")
        return int(val)
    if ftype in (ctypes.c_double, ctypes.c_float):
        return _number(val, name)
    return val
