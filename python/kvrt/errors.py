"""Exceptions: every non-zero kvrt_status becomes a :class:`KvrtError` (one subclass per status).

``err.status`` is the C status (negative int), ``err.name`` the runtime's ``kvrt_status_name``
("KVRT_ERR_MODEL_MISMATCH", ...) and ``err.message`` the runtime's own message (from the
``kvrt_error`` the call filled, the thread's ``kvrt_last_error``, or the context's last error).
``str(err)`` is ``"<message> [<name>]"``.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from . import _lib

OK = 0
ERR_ARG = -1
ERR_NOMEM = -2
ERR_IO = -3
ERR_FORMAT = -4
ERR_MODEL_MISMATCH = -5
ERR_NO_CUDA = -6
ERR_NO_DEVICE = -7
ERR_CUDA = -8
ERR_DTYPE = -9
ERR_SHAPE = -10
ERR_DEVICE = -11
ERR_UNSUPPORTED = -12


class KvrtError(Exception):
    """A libkvrt call returned a non-zero status.

    Constructing ``KvrtError(status, msg)`` gives the subclass of that status.
    """

    status: int = 0

    def __new__(cls, status: int = 0, message: str = "", detail: int = 0):
        sub = _BY_STATUS.get(status, cls) if cls is KvrtError else cls
        return super().__new__(sub)

    def __init__(self, status: int = 0, message: str = "", detail: int = 0):
        self.status = status
        self.name = status_name(status)
        self.message = message or status_str(status)
        self.detail = detail
        #: for FORMAT / IO errors of an artifact: the kvpol status name of ``detail``
        #: ("KVPOL_ERR_TRUNCATED", ...), else None
        self.kvpol_status: Optional[str] = None
        if status in (ERR_FORMAT, ERR_IO) and detail < 0:
            self.kvpol_status = _lib.lib.kvpol_status_name(detail).decode()
        super().__init__(f"{self.message} [{self.name}]")


def status_name(status: int) -> str:
    """kvrt_status_name: "KVRT_ERR_ARG", ..."""
    return _lib.lib.kvrt_status_name(status).decode()


def status_str(status: int) -> str:
    """kvrt_status_str: "invalid argument", ..."""
    return _lib.lib.kvrt_status_str(status).decode()


class ArgError(KvrtError, ValueError):
    """KVRT_ERR_ARG: invalid argument (NULL, bad option value, out of range)."""


class NoMemError(KvrtError):
    """KVRT_ERR_NOMEM."""


class KvrtIOError(KvrtError):
    """KVRT_ERR_IO: the artifact could not be read."""


class FormatError(KvrtError):
    """KVRT_ERR_FORMAT: the artifact is invalid (``detail``: the kvpol status, named by
    ``kvpol_status``, e.g. "KVPOL_ERR_SECTION_CHECKSUM")."""


class ModelMismatchError(KvrtError):
    """KVRT_ERR_MODEL_MISMATCH: the artifact was compiled for another model."""


class NoCudaError(KvrtError):
    """KVRT_ERR_NO_CUDA: this libkvrt was built without CUDA."""


class NoDeviceError(KvrtError):
    """KVRT_ERR_NO_DEVICE: built with CUDA, but no usable GPU (or a bad device id)."""


class CudaError(KvrtError):
    """KVRT_ERR_CUDA: a CUDA / cuBLAS call failed (``detail``: the CUDA error)."""


class DtypeError(KvrtError, TypeError):
    """KVRT_ERR_DTYPE: dtype not supported (the bindings raise it for non-float32 arrays)."""


class ShapeError(KvrtError, ValueError):
    """KVRT_ERR_SHAPE: shapes or strides do not fit the op."""


class DeviceError(KvrtError):
    """KVRT_ERR_DEVICE: tensor on the wrong device for this context."""


class UnsupportedError(KvrtError):
    """KVRT_ERR_UNSUPPORTED: a valid request this build or backend cannot do."""


_BY_STATUS: Dict[int, Type[KvrtError]] = {
    ERR_ARG: ArgError, ERR_NOMEM: NoMemError, ERR_IO: KvrtIOError, ERR_FORMAT: FormatError,
    ERR_MODEL_MISMATCH: ModelMismatchError, ERR_NO_CUDA: NoCudaError,
    ERR_NO_DEVICE: NoDeviceError, ERR_CUDA: CudaError, ERR_DTYPE: DtypeError,
    ERR_SHAPE: ShapeError, ERR_DEVICE: DeviceError, ERR_UNSUPPORTED: UnsupportedError,
}


def _raise(status: int, err: Optional[_lib.kvrt_error] = None, ctx_ptr=None) -> None:
    """Raise the KvrtError of a failed call with the most specific message the runtime left."""
    msg, detail = "", 0
    if err is not None and err.code == status and err.msg:
        msg, detail = err.msg.decode(errors="replace"), err.detail
    # the thread's own error first: every failure sets it (kvrt.h's error rule), while a Context
    # passed to calls from several threads holds whichever failed last (seen: another thread's
    # message ~4% of the time under two threads)
    if not msg:
        le = _lib.lib.kvrt_last_error()
        if le and le.contents.code == status and le.contents.msg:
            msg, detail = le.contents.msg.decode(errors="replace"), le.contents.detail
    if not msg and ctx_ptr:
        ce = _lib.lib.kvrt_ctx_last_error(ctx_ptr)
        if ce and ce.contents.code == status and ce.contents.msg:
            msg, detail = ce.contents.msg.decode(errors="replace"), ce.contents.detail
    raise KvrtError(status, msg, detail)


def check(status: int, err: Optional[_lib.kvrt_error] = None, ctx_ptr=None) -> None:
    """Raise when status is non-zero (see :func:`_raise`)."""
    if status:
        _raise(status, err, ctx_ptr)
