"""ctypes declarations of the libkvrt calls that kvrt.hf uses.

kvrt.hf keeps its own small set of declarations so that it does not depend on the order in which
the rest of the Python package grows; every call goes straight to libkvrt (no second
implementation). The library is found as the package's loader finds it: $KVRT_LIB, else the
in-tree build (build/libkvrt.so next to python/), else the system's libkvrt.so (ldconfig).
"""
from __future__ import annotations

import ctypes as C
import ctypes.util
import os
import threading
from pathlib import Path

import numpy as np

# statuses (kvrt.h, pinned values)
STATUS_NAMES = {
    0: "KVRT_OK", -1: "KVRT_ERR_ARG", -2: "KVRT_ERR_NOMEM", -3: "KVRT_ERR_IO",
    -4: "KVRT_ERR_FORMAT", -5: "KVRT_ERR_MODEL_MISMATCH", -6: "KVRT_ERR_NO_CUDA",
    -7: "KVRT_ERR_NO_DEVICE", -8: "KVRT_ERR_CUDA", -9: "KVRT_ERR_DTYPE", -10: "KVRT_ERR_SHAPE",
    -11: "KVRT_ERR_DEVICE", -12: "KVRT_ERR_UNSUPPORTED",
}
DTYPE_F32, DTYPE_F16 = 1, 2
BACKEND_CPU = 0
METHODS = {"full": 0, "streaming": 1, "random": 2, "snapkv": 3, "h2o": 4, "knorm": 5,
           "keydiff": 6}
COMPILERKV_NEAREST_BUDGET = 0x1
MR_NEAREST_BUDGET = 0x1


class HfKvrtError(RuntimeError):
    """A libkvrt call failed: .status (int), .status_name ("KVRT_ERR_ARG", ...) and the
    runtime's own message."""

    def __init__(self, status: int, message: str, call: str = ""):
        self.status = status
        self.status_name = STATUS_NAMES.get(status, f"status {status}")
        self.message = message
        super().__init__(f"{call + ': ' if call else ''}{message} [{self.status_name}]")


class ModelDims(C.Structure):
    _fields_ = [("n_layers", C.c_uint32), ("n_heads", C.c_uint32), ("n_kv_heads", C.c_uint32),
                ("head_dim", C.c_uint32), ("vocab_size", C.c_uint32), ("rope_theta", C.c_double),
                ("name", C.c_char_p), ("model_hash", C.c_uint64)]


class Error(C.Structure):
    _fields_ = [("code", C.c_int), ("detail", C.c_int), ("msg", C.c_char * 384)]


class Cache(C.Structure):
    _fields_ = [("dtype", C.c_int), ("device", C.c_int), ("n_kv_heads", C.c_uint32),
                ("head_dim", C.c_uint32), ("n_entries", C.c_int64),
                ("offsets", C.POINTER(C.c_int64)), ("keys", C.c_void_p), ("values", C.c_void_p),
                ("bias", C.POINTER(C.c_float)), ("positions", C.POINTER(C.c_int32)),
                ("owner", C.c_void_p), ("host_offsets", C.POINTER(C.c_int64))]


class Selection(C.Structure):
    _fields_ = [("n_kv_heads", C.c_uint32), ("offsets", C.POINTER(C.c_int64)),
                ("positions", C.POINTER(C.c_int32))]


class MethodOpts(C.Structure):
    _fields_ = [("method", C.c_int), ("budget", C.c_int64), ("n_sink", C.c_uint32),
                ("window", C.c_uint32), ("pool_kernel", C.c_uint32), ("seed", C.c_uint64)]


class MrBasis(C.Structure):
    _fields_ = [("n_kv_heads", C.c_uint32), ("head_dim", C.c_uint32), ("m_max", C.c_uint32),
                ("U", C.POINTER(C.c_float)), ("m", C.POINTER(C.c_uint32)),
                ("lam", C.POINTER(C.c_float))]


_P = C.c_void_p
_FP = C.POINTER(C.c_float)
_CP = C.POINTER(Cache)
_SP = C.POINTER(Selection)

# name: (restype, argtypes)
_DECLS = {
    "kvrt_version": (C.c_char_p, []),
    "kvrt_last_error": (C.POINTER(Error), []),
    "kvrt_ctx_last_error": (C.POINTER(Error), [_P]),
    "kvrt_ctx_create": (C.c_int, [C.c_int, _P, C.POINTER(_P), C.POINTER(Error)]),
    "kvrt_ctx_free": (None, [_P]),
    "kvrt_policy_open": (C.c_int, [C.c_char_p, C.POINTER(ModelDims), C.POINTER(_P),
                                   C.POINTER(Error)]),
    "kvrt_policy_free": (None, [_P]),
    "kvrt_cache_free": (None, [_CP]),
    "kvrt_cache_bytes": (C.c_size_t, [_CP]),
    "kvrt_cache_gather": (C.c_int, [_FP, _FP, C.c_int64, C.c_uint32, C.c_uint32, _SP, C.c_int,
                                    C.POINTER(_CP)]),
    "kvrt_selection_free": (None, [_SP]),
    "kvrt_attend": (C.c_int, [_P, _FP, C.c_int64, C.c_uint32, _CP, _FP, _FP, C.c_int64,
                              C.c_float, _FP, _FP]),
    "kvrt_budget_resolve": (C.c_int, [C.c_double, C.c_int64, C.POINTER(C.c_int64)]),
    "kvrt_method_opts_init": (None, [C.POINTER(MethodOpts), C.c_int, C.c_int64]),
    "kvrt_method_select": (C.c_int, [C.POINTER(MethodOpts), _FP, _FP, _FP, C.c_int64, C.c_uint32,
                                     C.c_uint32, C.c_uint32, C.POINTER(_SP)]),
    # CompilerKV
    "kvrt_compilerkv_open": (C.c_int, [_P, C.POINTER(_P)]),
    "kvrt_compilerkv_tables_free": (None, [_P]),
    "kvrt_compilerkv_select_all": (C.c_int, [_P, _P, C.POINTER(_FP), C.POINTER(_FP),
                                             C.POINTER(_FP), _FP, C.c_int64, C.c_uint32,
                                             C.c_uint32, C.c_uint32, C.c_int64, C.c_uint,
                                             C.POINTER(_SP), _P]),
    # Attention Matching
    "kvrt_am_open": (C.c_int, [_P, C.POINTER(_P)]),
    "kvrt_am_schedule_free": (None, [_P]),
    "kvrt_am_schedule_targets": (C.c_int, [_P, C.POINTER(C.POINTER(C.c_double)),
                                           C.POINTER(C.c_int)]),
    "kvrt_am_compact_scheduled": (C.c_int, [_P, _P, _P, C.c_uint, C.c_double, C.c_uint32, _FP,
                                            _FP, _FP, C.c_int64, C.c_uint32, C.c_int,
                                            C.POINTER(_CP), _P]),
    # merge-reduce
    "kvrt_mr_open": (C.c_int, [_P, C.POINTER(_P)]),
    "kvrt_mr_schedule_free": (None, [_P]),
    "kvrt_mr_compress_scheduled": (C.c_int, [_P, _P, _P, C.c_uint, C.c_double, C.c_uint32, _FP,
                                             _FP, C.c_int64, C.c_int, C.POINTER(_CP)]),
    # CompKV
    "kvrt_compkv_open": (C.c_int, [_P, C.POINTER(_P)]),
    "kvrt_compkv_grouping_free": (None, [_P]),
    "kvrt_compkv_create_layer": (C.c_int, [_P, _P, C.c_uint32, C.c_int64, _P, C.c_uint,
                                           C.POINTER(_P)]),
    "kvrt_compkv_free": (None, [_P]),
    "kvrt_compkv_append": (C.c_int, [_P, _FP, _FP, C.c_int64]),
    "kvrt_compkv_length": (C.c_int64, [_P]),
    "kvrt_compkv_n_blocks": (C.c_int64, [_P]),
    "kvrt_compkv_step": (C.c_int, [_P, _FP, C.c_uint32, C.c_int64, _FP, C.POINTER(C.c_int32)]),
}


def _candidates():
    env = os.environ.get("KVRT_LIB")
    if env:
        yield env
    here = Path(__file__).resolve().parent            # python/kvrt
    yield str(here.parent.parent / "build" / "libkvrt.so")
    found = ctypes.util.find_library("kvrt")
    if found:
        yield found


_lib = None
_lock = threading.Lock()


def lib():
    """The loaded libkvrt (declared once)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} (missing)")
                continue
            try:
                L = C.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            for name, (res, args) in _DECLS.items():
                fn = getattr(L, name)
                fn.restype = res
                fn.argtypes = args
            _lib = L
            return L
        raise OSError("kvrt.hf: libkvrt.so not found; build it with `make` (build/libkvrt.so) "
                      "or set KVRT_LIB; tried: " + "; ".join(tried or ["nothing"]))


def check(status: int, call: str, err: Error | None = None, ctx=None) -> None:
    """Raise HfKvrtError with the runtime's message when status != 0."""
    if status == 0:
        return
    msg = ""
    if err is not None and err.msg:
        msg = err.msg.decode(errors="replace")
    if not msg and ctx is not None:
        e = lib().kvrt_ctx_last_error(ctx)
        if e and e.contents.code == status:
            msg = e.contents.msg.decode(errors="replace")
    if not msg:
        msg = lib().kvrt_last_error().contents.msg.decode(errors="replace")
    raise HfKvrtError(status, msg, call)


def fptr(a: np.ndarray):
    """A float* to a C-contiguous float32 array (the caller keeps the array alive)."""
    assert a.dtype == np.float32 and a.flags["C_CONTIGUOUS"], (a.dtype, a.flags)
    return a.ctypes.data_as(_FP)


def cache_bytes(c) -> int:
    return int(lib().kvrt_cache_bytes(c)) if c else 0


def cache_entries_per_head(c) -> list[int]:
    cc = c.contents
    off = [cc.offsets[i] for i in range(cc.n_kv_heads + 1)]
    return [off[i + 1] - off[i] for i in range(cc.n_kv_heads)]
