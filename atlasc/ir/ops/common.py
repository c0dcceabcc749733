"""Helpers shared by the op definitions: broadcasting and axis handling over symbolic dims."""

from __future__ import annotations

from atlasc.errors import ShapeError
from atlasc.ir.ops.registry import DimMismatch


def broadcast_dims(a, b, context: str = ""):
    """The numpy-broadcast result of two dims; DimMismatch if neither is 1 and they differ."""
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    if isinstance(a, int) and isinstance(b, int):
        raise ShapeError(f"{context}cannot broadcast dims {a} and {b}")
    raise DimMismatch(a, b, context)


def broadcast_shapes(*shapes, context: str = "") -> tuple:
    """Multidirectional (numpy) broadcast of shapes of dims."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        d = 1
        for s in shapes:
            k = i - (rank - len(s))
            if k >= 0:
                d = broadcast_dims(d, s[k], context)
        out.append(d)
    return tuple(out)


def norm_axis(axis: int, rank: int, op: str = "") -> int:
    """axis in [-rank, rank) -> [0, rank); ShapeError otherwise."""
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def same_dtype(types, op: str) -> str:
    """The common dtype of the given inputs (ShapeError if they differ)."""
    dts = {t.dtype for t in types if t is not None}
    if len(dts) != 1:
        raise ShapeError(f"{op}: input dtypes differ: {sorted(dts)}")
    return dts.pop()
