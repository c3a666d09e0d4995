"""Loading libkvrt.so and the ctypes declarations of the C API (runtime/include/kvrt.h).

The library is looked up, in this order:

1. the ``KVRT_LIBRARY`` environment variable (a path to a ``libkvrt.so``);
2. the copy bundled inside the package (``kvrt/_native/libkvrt.so``, put there by
   ``pip install ./python``);
3. the in-tree build of a source checkout (``<checkout>/build/libkvrt.so``, i.e. two directories
   above this package, when those hold a kvcc checkout: its ``Makefile`` and
   ``runtime/include/kvrt.h``);
4. the system (``ctypes.util.find_library("kvrt")``: ldconfig, ``LD_LIBRARY_PATH``).

The first that exists is loaded; when none loads, :class:`LibraryNotFound` names every place
tried and why each failed. Structure layouts below mirror kvrt.h exactly (ctypes applies the C
ABI's alignment rules, as the C compiler does).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int, c_int32,
                    c_int64, c_size_t, c_uint, c_uint16, c_uint32, c_uint64, c_uint8, c_void_p)
from typing import List, Optional, Tuple

#: The kvrt.h version these bindings are written against (major, minor). A library whose
#: major.minor differs is refused at load.
API_VERSION = (0, 1)

_HERE = os.path.dirname(os.path.abspath(__file__))


class LibraryNotFound(ImportError):
    """libkvrt.so could not be found or loaded; the message lists every place tried."""


def candidates() -> List[Tuple[str, Optional[str]]]:
    """The places searched, in order, as (description, path or None when not applicable)."""
    out: List[Tuple[str, Optional[str]]] = []
    env = os.environ.get("KVRT_LIBRARY")
    out.append(("$KVRT_LIBRARY", env if env else None))
    out.append(("bundled copy", os.path.join(_HERE, "_native", "libkvrt.so")))
    # the kvcc checkout this package sits in (python/kvrt/), if it is one: not a "build"
    # directory that happens to lie two levels above an installed package
    checkout = os.path.normpath(os.path.join(_HERE, "..", ".."))
    in_tree = (os.path.join(checkout, "build", "libkvrt.so")
               if os.path.exists(os.path.join(checkout, "runtime", "include", "kvrt.h"))
               and os.path.exists(os.path.join(checkout, "Makefile")) else None)
    out.append(("in-tree build", in_tree))
    sysname = ctypes.util.find_library("kvrt")
    out.append(("system (ctypes.util.find_library('kvrt'))", sysname))
    return out


def _load() -> Tuple[ctypes.CDLL, str]:
    tried = []
    for what, path in candidates():
        if path is None:
            tried.append(f"  {what}: not set" if what.startswith("$") else
                         f"  {what}: the package is not inside a kvcc checkout"
                         if what == "in-tree build" else f"  {what}: not found")
            continue
        if os.sep in path and not os.path.exists(path):
            tried.append(f"  {what}: {path}: no such file")
            if what.startswith("$"):
                # an explicit choice that does not exist is an error, not a fallthrough
                break
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:  # exists but does not load (missing dependency, wrong arch)
            tried.append(f"  {what}: {path}: {e}")
            if what.startswith("$"):
                break
    raise LibraryNotFound("kvrt: libkvrt.so not found; tried, in order:\n" + "\n".join(tried) +
                          "\nbuild it with `make build/libkvrt.so` in the kvcc checkout, "
                          "`pip install ./python`, or set KVRT_LIBRARY=/path/to/libkvrt.so")


# ------------------------------------------------------------------------------------------
# structures (kvrt.h)

MAX_DIMS = 4


class kvrt_error(Structure):
    _fields_ = [("code", c_int), ("detail", c_int), ("msg", c_char * 384)]


class kvrt_model_dims(Structure):
    _fields_ = [("n_layers", c_uint32), ("n_heads", c_uint32), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32), ("vocab_size", c_uint32), ("rope_theta", c_double),
                ("name", c_char_p), ("model_hash", c_uint64)]


class kvrt_policy_limits(Structure):
    _fields_ = [("max_section_bytes", c_uint64), ("max_total_bytes", c_uint64)]


class kvrt_ctx_options(Structure):
    _fields_ = [("n_threads", c_int), ("device_id", c_int)]


class kvrt_device_info(Structure):
    _fields_ = [("backend", c_int), ("name", c_char * 128), ("device_id", c_int),
                ("cc_major", c_int), ("cc_minor", c_int), ("total_mem", c_uint64),
                ("n_threads", c_int)]


class kvrt_cache(Structure):
    _fields_ = [("dtype", c_int), ("device", c_int), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32), ("n_entries", c_int64), ("offsets", POINTER(c_int64)),
                ("keys", c_void_p), ("values", c_void_p), ("bias", POINTER(c_float)),
                ("positions", POINTER(c_int32)), ("owner", c_void_p),
                ("host_offsets", POINTER(c_int64))]


class kvrt_selection(Structure):
    _fields_ = [("n_kv_heads", c_uint32), ("offsets", POINTER(c_int64)),
                ("positions", POINTER(c_int32))]


class kvrt_method_opts(Structure):
    _fields_ = [("method", c_int), ("budget", c_int64), ("n_sink", c_uint32),
                ("window", c_uint32), ("pool_kernel", c_uint32), ("seed", c_uint64)]


class kvrt_quest(Structure):
    _fields_ = [("n_kv_heads", c_uint32), ("head_dim", c_uint32), ("page", c_uint32),
                ("T", c_int64), ("n_pages", c_int64), ("kmin", POINTER(c_float)),
                ("kmax", POINTER(c_float)), ("page_stride", c_int64),
                ("owner", c_void_p)]  # kvrt_quest_create's context (NULL: a host summary)


class kvrt_am_opts(Structure):
    _fields_ = [("key_select", c_int), ("chunk", c_int64), ("ridge", c_double),
                ("nnls_max_iter", c_int), ("max_queries", c_int64), ("beta_floor", c_double),
                ("n_sink", c_int64), ("recent_frac", c_double), ("omp_batch", c_int),
                ("products", c_int)]


class kvrt_am_stats(Structure):
    _fields_ = [("asked", c_int64), ("kept", c_int64), ("n_queries", c_int64),
                ("mass_relerr", c_double), ("out_relerr", c_double), ("nnls_status", c_int),
                ("nnls_iterations", c_int)]


CKV_ENT_BINS = 20
CKV_PPL_BINS = 4


class kvrt_compilerkv_tables(Structure):
    _fields_ = [("n_budgets", c_uint32), ("n_layers", c_uint32), ("n_heads", c_uint32),
                ("window", c_uint32), ("budgets", POINTER(c_int64)), ("w_head", POINTER(c_float)),
                ("t_gate", POINTER(c_float)), ("ent_edges", c_float * (CKV_ENT_BINS - 1)),
                ("ppl_edges", c_float * (CKV_PPL_BINS - 1)), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32)]


class kvrt_compilerkv_prompt(Structure):
    _fields_ = [("T", c_int64), ("window", c_uint32), ("n_layers", c_uint32),
                ("mass", POINTER(c_double)), ("alpha", POINTER(c_float)), ("entropy", c_double),
                ("ppl", c_double), ("finished", c_int), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32)]


class kvrt_compilerkv_stats(Structure):
    _fields_ = [("candidates", c_int64), ("kept", c_int64), ("tau", c_float),
                ("budget_index", c_uint32), ("b_ent", c_int), ("b_ppl", c_int)]


class kvrt_compkv_opts(Structure):
    _fields_ = [("block", c_uint32), ("r", c_uint32), ("scale", c_float), ("compensate", c_int),
                ("mass_only", c_int), ("first_order", c_int), ("n_sink_blocks", c_uint32),
                ("n_recent_blocks", c_uint32), ("offload", c_int), ("dtype", c_int)]


class kvrt_compkv_grouping(Structure):
    _fields_ = [("n_layers", c_uint32), ("n_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("r", c_uint32), ("block", c_uint32), ("scale", c_double),
                ("perm", POINTER(c_uint16)), ("offsets", POINTER(c_uint16)),
                ("learned", POINTER(c_uint8))]


class kvrt_kv2_opts(Structure):
    _fields_ = [("rho", c_double), ("n_sink", c_uint32), ("chunk", c_int64), ("proxy", c_int),
                ("aggregate", c_int), ("passes", c_uint32), ("per_head", c_int)]


class kvrt_mr_opts(Structure):
    _fields_ = [("reducer", c_int), ("n_sink", c_uint32), ("recent_frac", c_double),
                ("seed", c_uint64), ("mass_comp", c_int)]


class kvrt_mr_basis(Structure):
    _fields_ = [("n_kv_heads", c_uint32), ("head_dim", c_uint32), ("m_max", c_uint32),
                ("U", POINTER(c_float)), ("m", POINTER(c_uint32)), ("lam", POINTER(c_float))]


# kvpol.h (libkvpol is linked into libkvrt.so): what Policy.info() reads.
class kvpol_error(Structure):
    _fields_ = [("code", c_int), ("msg", c_char * 320)]


class kvpol_model(Structure):
    _fields_ = [("n_layers", c_uint32), ("n_heads", c_uint32), ("n_kv_heads", c_uint32),
                ("head_dim", c_uint32), ("vocab_size", c_uint32), ("max_context", c_uint32),
                ("rope_theta", c_double), ("rope_scaling_type", c_uint32),
                ("rope_scaling_factor", c_float), ("name", c_char * 64), ("model_hash", c_uint64)]


class kvpol_header(Structure):
    _fields_ = [("version_major", c_uint16), ("version_minor", c_uint16), ("flags", c_uint32),
                ("section_count", c_uint32), ("file_size", c_uint64),
                ("table_checksum", c_uint64), ("created", c_uint64), ("corpus_hash", c_uint64),
                ("model", kvpol_model), ("compiler_version", c_char * 32),
                ("compile_options", c_char * 256), ("header_checksum", c_uint64)]


class kvpol_open_opts(Structure):
    _fields_ = [("flags", c_uint), ("max_section_bytes", c_uint64),
                ("max_total_bytes", c_uint64)]


class kvpol_item(Structure):
    _fields_ = [("name", c_char * 40), ("kind", c_int), ("dtype", c_int), ("ndim", c_uint32),
                ("dims", c_uint64 * 4), ("count", c_uint64), ("nbytes", c_uint64),
                ("data", c_void_p)]


class kvpol_section_info(Structure):
    _fields_ = [("id", c_uint32), ("group", c_uint32), ("group_version", c_uint16),
                ("flags", c_uint16), ("codec", c_uint16), ("name", c_char * 48),
                ("offset", c_uint64), ("stored_size", c_uint64), ("raw_size", c_uint64),
                ("raw_checksum", c_uint64), ("known", c_int), ("decoded", c_int),
                ("n_items", c_uint32)]


# ------------------------------------------------------------------------------------------
# prototypes

P = c_void_p            # every data pointer is passed as a plain address (no ctypes array)
PP = POINTER(c_void_p)  # an out-handle
I, U32, I64, U64, D, F = c_int, c_uint32, c_int64, c_uint64, c_double, c_float

_PROTOS = {
    # status, version
    "kvrt_status_str": (c_char_p, [I]),
    "kvrt_status_name": (c_char_p, [I]),
    "kvrt_version": (c_char_p, []),
    "kvrt_last_error": (POINTER(kvrt_error), []),
    # policies
    "kvrt_policy_open": (I, [c_char_p, POINTER(kvrt_model_dims), PP, POINTER(kvrt_error)]),
    "kvrt_policy_open_mem": (I, [P, c_size_t, POINTER(kvrt_model_dims), PP, POINTER(kvrt_error)]),
    "kvrt_policy_open_limited": (I, [c_char_p, POINTER(kvrt_model_dims), POINTER(kvrt_policy_limits),
                                     PP, POINTER(kvrt_error)]),
    "kvrt_policy_open_mem_limited": (I, [P, c_size_t, POINTER(kvrt_model_dims),
                                         POINTER(kvrt_policy_limits), PP, POINTER(kvrt_error)]),
    "kvrt_policy_free": (None, [P]),
    "kvrt_policy_model": (I, [P, POINTER(kvrt_model_dims)]),
    "kvrt_policy_groups": (U32, [P]),
    # contexts
    "kvrt_has_cuda": (I, []),
    "kvrt_cuda_device_count": (I, []),
    "kvrt_ctx_create": (I, [I, POINTER(kvrt_ctx_options), PP, POINTER(kvrt_error)]),
    "kvrt_ctx_free": (None, [P]),
    "kvrt_ctx_info": (I, [P, POINTER(kvrt_device_info)]),
    "kvrt_ctx_last_error": (POINTER(kvrt_error), [P]),
    "kvrt_ctx_alloc": (I, [P, c_size_t, PP]),
    "kvrt_ctx_dealloc": (None, [P, P]),
    "kvrt_ctx_upload": (I, [P, P, P, c_size_t]),
    "kvrt_ctx_download": (I, [P, P, P, c_size_t]),
    "kvrt_ctx_sync": (I, [P]),
    "kvrt_op_name": (c_char_p, [I]),
    "kvrt_f32_to_bf16": (ctypes.c_uint16, [c_float]),
    "kvrt_bf16_to_f32": (c_float, [ctypes.c_uint16]),
    "kvrt_backend_supports": (I, [P, I]),
    # caches, selections
    "kvrt_cache_create": (I, [U32, U32, I, P, PP]),
    "kvrt_cache_free": (None, [P]),
    "kvrt_cache_bytes": (c_size_t, [P]),
    "kvrt_cache_gather": (I, [P, P, I64, U32, U32, P, I, PP]),
    "kvrt_cache_to_device": (I, [P, P, PP]),
    "kvrt_selection_create": (I, [U32, P, PP]),
    "kvrt_selection_free": (None, [P]),
    # attention, selection primitives
    "kvrt_attend": (I, [P, P, I64, U32, P, P, P, I64, F, P, P]),
    "kvrt_topk": (I, [P, I64, I64, P]),
    "kvrt_budget_resolve": (I, [D, I64, POINTER(c_int64)]),
    "kvrt_select_pinned": (I, [P, I64, I64, I64, I64, P]),
    # baselines
    "kvrt_method_opts_init": (None, [POINTER(kvrt_method_opts), I, I64]),
    "kvrt_method_select": (I, [POINTER(kvrt_method_opts), P, P, P, I64, U32, U32, U32, PP]),
    "kvrt_method_has_scores": (I, [I]),
    "kvrt_method_scores": (I, [P, POINTER(kvrt_method_opts), P, P, I64, U32, U32, U32, P]),
    "kvrt_method_select_scored": (I, [POINTER(kvrt_method_opts), P, I64, U32, PP]),
    "kvrt_method_name": (c_char_p, [I]),
    "kvrt_method_from_name": (I, [c_char_p]),
    # Quest
    "kvrt_quest_summarize": (I, [P, I64, U32, U32, U32, PP]),
    "kvrt_quest_create": (I, [P, U32, U32, U32, I64, PP]),
    "kvrt_quest_append": (I, [P, P, I64]),
    "kvrt_quest_free": (None, [P]),
    "kvrt_quest_scores": (I, [P, P, U32, P]),
    "kvrt_quest_select": (I, [P, P, U32, I64, P]),
    # Attention Matching
    "kvrt_am_opts_init": (None, [POINTER(kvrt_am_opts)]),
    "kvrt_am_compact": (I, [P, POINTER(kvrt_am_opts), P, P, I64, U32, P, P, I64, I64, I, PP,
                            POINTER(kvrt_am_stats)]),
    "kvrt_am_compact_layer": (I, [P, POINTER(kvrt_am_opts), P, P, P, I64, U32, U32, U32, P, D,
                                  I, PP, P]),
    "kvrt_am_compact_layer_ref": (I, [P, POINTER(kvrt_am_opts), P, P, I64, P, P, I64, U32, U32,
                                      U32, P, D, I, PP, P]),
    "kvrt_am_query_source_name": (c_char_p, [I]),
    "kvrt_am_schedule_query_source": (I, [P, POINTER(c_int)]),
    "kvrt_am_schedule_self_study_tokens": (I, [P, POINTER(c_int64)]),
    "kvrt_am_compact_scheduled_ref": (I, [P, P, POINTER(kvrt_am_opts), c_uint, D, U32, I, P, P,
                                          I64, P, P, I64, U32, I, PP, P]),
    "kvrt_am_open": (I, [P, PP]),
    "kvrt_am_schedule_free": (None, [P]),
    "kvrt_am_schedule_opts": (I, [P, POINTER(kvrt_am_opts)]),
    "kvrt_am_schedule_targets": (I, [P, POINTER(POINTER(c_double)), POINTER(c_int)]),
    "kvrt_am_schedule_ratios": (I, [P, D, U32, POINTER(POINTER(c_float))]),
    "kvrt_am_compact_scheduled": (I, [P, P, POINTER(kvrt_am_opts), c_uint, D, U32, P, P, P, I64,
                                      U32, I, PP, P]),
    # CompilerKV
    "kvrt_compilerkv_open": (I, [P, POINTER(POINTER(kvrt_compilerkv_tables))]),
    "kvrt_compilerkv_tables_free": (None, [P]),
    "kvrt_compilerkv_prompt_create": (I, [I64, U32, POINTER(POINTER(kvrt_compilerkv_prompt))]),
    "kvrt_compilerkv_prompt_free": (None, [P]),
    "kvrt_compilerkv_prompt_add_layer": (I, [P, P, P, U32, U32, U32]),
    "kvrt_compilerkv_prompt_finish": (I, [P, P]),
    "kvrt_compilerkv_budget_index": (I, [P, I64, c_uint, POINTER(c_uint32)]),
    "kvrt_compilerkv_kept_window": (I64, [U32, I64, I64]),
    "kvrt_compilerkv_select": (I, [P, P, P, U32, P, U32, U32, I64, c_uint, PP,
                                   POINTER(kvrt_compilerkv_stats)]),
    "kvrt_compilerkv_select_all": (I, [P, P, P, P, P, P, I64, U32, U32, U32, I64, c_uint, P, P]),
    # CompKV
    "kvrt_compkv_opts_init": (None, [POINTER(kvrt_compkv_opts)]),
    "kvrt_compkv_create": (I, [P, POINTER(kvrt_compkv_opts), U32, U32, I64, P, P, PP]),
    "kvrt_compkv_free": (None, [P]),
    "kvrt_compkv_append": (I, [P, P, P, I64]),
    "kvrt_compkv_length": (I64, [P]),
    "kvrt_compkv_n_blocks": (I64, [P]),
    "kvrt_compkv_groups": (U32, [P]),
    "kvrt_compkv_scores": (I, [P, P, U32, P]),
    "kvrt_compkv_select": (I, [P, P, I64, P]),
    "kvrt_compkv_attend_blocks": (I, [P, P, U32, P, I64, P]),
    "kvrt_compkv_step": (I, [P, P, U32, I64, P, P]),
    "kvrt_compkv_open": (I, [P, POINTER(POINTER(kvrt_compkv_grouping))]),
    "kvrt_compkv_grouping_opts": (I, [P, POINTER(kvrt_compkv_opts)]),
    "kvrt_compkv_create_layer": (I, [P, P, U32, I64, POINTER(kvrt_compkv_opts), c_uint, PP]),
    "kvrt_compkv_grouping_free": (None, [P]),
    # KV²
    "kvrt_kv2_opts_init": (None, [POINTER(kvrt_kv2_opts)]),
    "kvrt_kv2_proxy_name": (c_char_p, [I]),
    "kvrt_kv2_proxy_from_name": (I, [c_char_p]),
    "kvrt_kv2_plan_create": (I, [P, POINTER(kvrt_kv2_opts), U32, U32, U32, U32, I64, PP]),
    "kvrt_kv2_plan_free": (None, [P]),
    "kvrt_kv2_plan_proxy": (I, [P, U32, P]),
    "kvrt_kv2_plan_n_chunks": (I64, [P]),
    "kvrt_kv2_plan_chunk": (I, [P, I64, POINTER(c_int64), POINTER(c_int64), POINTER(c_int64)]),
    "kvrt_kv2_plan_queries": (I, [P, I64, P, P, POINTER(c_int64)]),
    "kvrt_kv2_plan_score": (I, [P, I64, U32, P, I64, P, P]),
    "kvrt_kv2_plan_next_pass": (I, [P]),
    "kvrt_kv2_plan_proxy_scores": (I, [P, POINTER(POINTER(c_float))]),
    "kvrt_kv2_plan_scores": (I, [P, U32, POINTER(POINTER(c_float))]),
    "kvrt_kv2_plan_compress": (I, [P, U32, D, P, P, I, PP]),
    "kvrt_kv2_open": (I, [P, PP]),
    "kvrt_kv2_schedule_free": (None, [P]),
    "kvrt_kv2_schedule_budgets": (I, [P, POINTER(POINTER(c_double)), POINTER(POINTER(c_double)),
                                      POINTER(c_int)]),
    "kvrt_kv2_schedule_query_source": (I, [P]),
    "kvrt_kv2_schedule_opts": (I, [P, D, c_uint, POINTER(kvrt_kv2_opts)]),
    "kvrt_kv2_plan_create_scheduled": (I, [P, P, POINTER(kvrt_kv2_opts), c_uint, D, U32, U32,
                                           I64, PP]),
    # merge-reduce
    "kvrt_mr_opts_init": (None, [POINTER(kvrt_mr_opts)]),
    "kvrt_mr_reducer_name": (c_char_p, [I]),
    "kvrt_mr_reducer_from_name": (I, [c_char_p]),
    "kvrt_mr_compress_layer": (I, [P, POINTER(kvrt_mr_opts), POINTER(kvrt_mr_basis), U32, P, P,
                                   I64, U32, U32, D, I, PP]),
    "kvrt_mr_stream_create": (I, [P, POINTER(kvrt_mr_opts), POINTER(kvrt_mr_basis), U32, U32, U32,
                                  I64, I64, PP]),
    "kvrt_mr_stream_free": (None, [P]),
    "kvrt_mr_stream_append": (I, [P, P, P, I64]),
    "kvrt_mr_stream_length": (I64, [P]),
    "kvrt_mr_stream_entries": (I64, [P]),
    "kvrt_mr_stream_bytes": (c_size_t, [P]),
    "kvrt_mr_stream_cache": (I, [P, I, I, PP]),
    "kvrt_mr_open": (I, [P, PP]),
    "kvrt_mr_schedule_free": (None, [P]),
    "kvrt_mr_schedule_opts": (I, [P, POINTER(kvrt_mr_opts)]),
    "kvrt_mr_schedule_budgets": (I, [P, POINTER(POINTER(c_double)), POINTER(c_int)]),
    "kvrt_mr_schedule_basis": (I, [P, D, c_uint, U32, POINTER(kvrt_mr_basis)]),
    "kvrt_mr_compress_scheduled": (I, [P, P, POINTER(kvrt_mr_opts), c_uint, D, U32, P, P, I64, I,
                                       PP]),
    # libkvpol (for Policy.info)
    "kvpol_open_path": (I, [PP, c_char_p, POINTER(kvpol_open_opts), POINTER(kvpol_error)]),
    "kvpol_open_mem": (I, [PP, P, c_size_t, POINTER(kvpol_open_opts), POINTER(kvpol_error)]),
    "kvpol_close": (None, [P]),
    "kvpol_status_name": (c_char_p, [I]),
    "kvpol_get_header": (POINTER(kvpol_header), [P]),
    "kvpol_section_count": (U32, [P]),
    "kvpol_section_at": (POINTER(kvpol_section_info), [P, U32]),
    "kvpol_item_at": (I, [P, U32, U32, POINTER(kvpol_item)]),
    "kvpol_item_as_f64": (I, [POINTER(kvpol_item), POINTER(c_double)]),
    "kvpol_dtype_name": (c_char_p, [I]),
    "kvpol_group_name": (c_char_p, [U32]),
}


class _Missing:
    """Stands for a C function this libkvrt does not export (an older build)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *a, **k):
        from .errors import KvrtError
        raise KvrtError(-12, f"{self.name}: not exported by the loaded libkvrt ({path})")


def _declare(lib: ctypes.CDLL):
    missing = []
    for name, (res, args) in _PROTOS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = res
        fn.argtypes = args
    return missing


lib, path = _load()
_missing = _declare(lib)
for _n in _missing:
    setattr(lib, _n, _Missing(_n))

version: str = lib.kvrt_version().decode()
_parts = tuple(int(x) for x in version.split(".")[:2])
if _parts != API_VERSION:
    raise LibraryNotFound(f"kvrt: {path}: libkvrt version {version}, these bindings need "
                          f"{API_VERSION[0]}.{API_VERSION[1]}.x (kvrt_version())")
