"""Element types of the IR: names, numpy equivalents, sizes."""

from __future__ import annotations

import numpy as np

DType = str  # one of DTYPES

_NUMPY = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
DTYPES = tuple(_NUMPY)
FLOATS = ("float32", "float16", "float64")
INTS = ("int64", "int32", "int16", "int8", "uint8")


def to_numpy(dtype: DType) -> np.dtype:
    """The numpy dtype for an IR dtype."""
    return np.dtype(_NUMPY[dtype])


def dtype_of_numpy(dt) -> DType:
    """The IR dtype for a numpy dtype (ValueError if unsupported)."""
    dt = np.dtype(dt)
    for name, np_type in _NUMPY.items():
        if dt == np.dtype(np_type):
            return name
    raise ValueError(f"unsupported numpy dtype {dt}")


def itemsize(dtype: DType) -> int:
    return to_numpy(dtype).itemsize
