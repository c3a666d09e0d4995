"""kvrt: Python bindings (ctypes) over libkvrt, the kvcc runtime.

The real runtime runs underneath: every call goes to the C library, no policy is
re-implemented in Python. Quick tour::

    import kvrt, numpy as np
    pol = kvrt.Policy.open("smollm2.kvpol", model="smollm2-135m")   # refuses another model
    sel = kvrt.method_select("snapkv", q, k, budget=128)            # q [T,H,d], k [T,Hkv,d]
    cache = kvrt.Cache.gather(k, v, sel)                            # only what is kept
    out = kvrt.attend(q_new, cache, k_recent, v_recent)             # [n, H, d]

Layouts are kvrt.h's (row-major float32, C-contiguous; see kvrt._core). Errors raise
:class:`KvrtError` subclasses carrying ``.status``, ``.name`` and the runtime's message.
The library is found via $KVRT_LIBRARY, the bundled copy, the in-tree build/libkvrt.so, then
the system (see kvrt._lib).
"""
from . import _lib
from ._lib import LibraryNotFound, API_VERSION
from .errors import (KvrtError, ArgError, NoMemError, KvrtIOError, FormatError,
                     ModelMismatchError, NoCudaError, NoDeviceError, CudaError, DtypeError,
                     ShapeError, DeviceError, UnsupportedError, status_name, status_str)
from ._core import (Context, Selection, Cache, CacheArrays, attend, as_f32, budget_resolve, topk,
                    method_select, method_scores, method_select_scored, method_has_scores, select_pinned, Quest,
                    has_cuda, cuda_device_count, default_context, METHODS, OPS, f32_to_bf16,
                    bf16_to_f32)
from .policy import (Policy, PRESETS, model_dims, inspect, CompilerKV, CompilerKVPrompt,
                     AMSchedule, am_compact, am_compact_layer, am_compact_layer_ref, am_options, CompKVGrouping, CompKVState,
                     compkv_options)
from .kv2 import KV2Plan, KV2Schedule, kv2_options
from .mr import MRBasis, MRSchedule, MRStream, mr_compress_layer, mr_options

__version__ = "0.1.0"
#: The loaded library's kvrt_version() and path.
library_version: str = _lib.version
library_path: str = _lib.path

__all__ = [n for n in dir() if not n.startswith("_")]
