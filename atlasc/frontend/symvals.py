"""Compile-time tensor values for the importer.

An ONNX export computes shapes with small int64 programs (Shape -> Gather -> Concat -> Reshape ...).
The importer evaluates them at compile time: a `Known` holds a numpy array whose elements are plain
numbers or, for int tensors derived from symbolic shapes, dims (ints or `symbolic.Expr`, in an object
array). Folding such a program gives every Reshape/Expand target as an expression in the graph's
symbols. Comparisons are decided with the symbols' lower bounds; an undecidable one makes the
result unknown, and the node then runs at run time instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import DType, INTS, dtype_of_numpy


class Undecidable(Exception):
    """A compile-time comparison of dims depends on the symbols' values."""


@dataclass
class Known:
    """A tensor value known at compile time. `array` is numeric, or an object array of dims."""

    array: np.ndarray
    dtype: DType

    @staticmethod
    def numeric(arr) -> "Known":
        arr = np.asarray(arr)
        return Known(arr, dtype_of_numpy(arr.dtype))

    @property
    def symbolic(self) -> bool:
        return self.array.dtype == object

    @property
    def shape(self) -> tuple:
        return self.array.shape

    def dims(self) -> tuple:
        """The elements as a flat tuple of dims (int or Expr)."""
        if self.dtype not in INTS:
            raise TypeError("not an integer tensor")
        return tuple(S.dim(x) for x in self.array.reshape(-1).tolist())

    def scalar(self):
        flat = self.array.reshape(-1)
        if flat.size != 1:
            raise TypeError("not a scalar")
        x = flat[0]
        return S.dim(x) if self.symbolic or self.dtype in INTS else x.item()

    def normalized(self) -> "Known":
        """Object arrays whose elements are all ints become numeric again."""
        if self.symbolic and all(not isinstance(S.dim(x), S.Expr) for x in self.array.reshape(-1)):
            return Known(np.array([S.dim(x) for x in self.array.reshape(-1)], dtype=np.int64)
                         .reshape(self.array.shape).astype(_np(self.dtype)), self.dtype)
        return self

    def substitute(self, mapping) -> "Known":
        if not self.symbolic:
            return self
        flat = [S.substitute(x, mapping) for x in self.array.reshape(-1)]
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return Known(arr.reshape(self.array.shape), self.dtype).normalized()


def _np(dtype):
    from atlasc.ir.dtypes import to_numpy

    return to_numpy(dtype)


def dims_array(dims, shape=None) -> np.ndarray:
    """An object array holding dims."""
    arr = np.empty(len(dims), dtype=object)
    arr[:] = [S.dim(d) for d in dims]
    return arr if shape is None else arr.reshape(shape)


def _cmp(kind, bounds):
    def f(a, b):
        a, b = S.dim(a), S.dim(b)
        if kind == "eq":
            r = S.prove_eq(a, b, bounds)
        elif kind in ("lt", "gt"):
            x, y = (a, b) if kind == "lt" else (b, a)
            # x < y  <=>  y - x >= 1
            if S.prove_ge(S.sub(y, x), 1, bounds):
                r = True
            elif S.prove_ge(x, y, bounds):
                r = False
            else:
                r = None
        else:  # le / ge
            x, y = (a, b) if kind == "le" else (b, a)
            if S.prove_ge(y, x, bounds):
                r = True
            elif S.prove_ge(S.sub(x, y), 1, bounds):
                r = False
            else:
                r = None
        if r is None:
            raise Undecidable(f"{a} vs {b}")
        return r

    return np.frompyfunc(f, 2, 1)


def symbolic_eval(op: str, arrays: list, attrs: dict, bounds) -> list | None:
    """Evaluate `op` on object arrays of dims where numpy's own semantics would be wrong.

    Returns the output arrays, or None when the generic reference handles the op correctly
    (movement ops and + - * // % work on object arrays as they are). Raises Undecidable.
    """
    kinds = {"Equal": "eq", "Less": "lt", "Greater": "gt", "LessOrEqual": "le", "GreaterOrEqual": "ge"}
    if op in kinds:
        out = _cmp(kinds[op], bounds)(arrays[0], arrays[1])
        return [np.asarray(out, dtype=bool)]
    if op in ("Max", "Min"):
        fn = np.frompyfunc(lambda a, b: (S.dmax if op == "Max" else S.dmin)(a, b, bounds), 2, 1)
        out = arrays[0]
        for a in arrays[1:]:
            out = fn(out, a)
        return [np.asarray(out, dtype=object)]
    if op == "Div":
        # ONNX integer Div truncates; dims are non-negative here, so floor division agrees
        return [np.asarray(np.frompyfunc(S.floordiv, 2, 1)(arrays[0], arrays[1]), dtype=object)]
    if op == "Abs":  # symbolic dims are non-negative; plain ints take their absolute value
        return [np.asarray(np.frompyfunc(lambda x: abs(x) if isinstance(x, int) else x, 1, 1)(arrays[0]),
                           dtype=object)]
    return None
