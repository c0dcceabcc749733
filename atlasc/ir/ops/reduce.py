"""Reductions: ReduceMean/Sum/Max/Min/Prod/SumSquare/L2 and ArgMax/ArgMin (axes as attributes).

float16 sums accumulate in float32 and round once, like onnxruntime's CPU kernels.
"""

from __future__ import annotations

import numpy as np

from atlasc.ir.ops.common import norm_axis
from atlasc.ir.ops.registry import Attr, TensorType, register


def _axes(attrs, rank, op):
    axes = attrs["axes"]
    if axes is None or len(axes) == 0:
        return None if attrs["noop_with_empty_axes"] else tuple(range(rank))
    return tuple(sorted({norm_axis(a, rank, op) for a in axes}))


def _reduce_infer(op):
    def infer(ins, attrs):
        shape = ins[0].shape
        axes = _axes(attrs, len(shape), op)
        if axes is None:
            return [ins[0]]
        if attrs["keepdims"]:
            out = tuple(1 if i in axes else d for i, d in enumerate(shape))
        else:
            out = tuple(d for i, d in enumerate(shape) if i not in axes)
        return [TensorType(ins[0].dtype, out)]

    return infer


def _wide(x):
    return x.astype(np.float32) if x.dtype == np.float16 else x


_REDUCE = {
    "ReduceMean": lambda x, axes, kd: np.mean(_wide(x), axis=axes, keepdims=kd),
    "ReduceSum": lambda x, axes, kd: np.sum(_wide(x), axis=axes, keepdims=kd),
    "ReduceMax": lambda x, axes, kd: np.max(x, axis=axes, keepdims=kd),
    "ReduceMin": lambda x, axes, kd: np.min(x, axis=axes, keepdims=kd),
    "ReduceProd": lambda x, axes, kd: np.prod(_wide(x), axis=axes, keepdims=kd),
    "ReduceSumSquare": lambda x, axes, kd: np.sum(np.square(_wide(x)), axis=axes, keepdims=kd),
    "ReduceL2": lambda x, axes, kd: np.sqrt(np.sum(np.square(_wide(x)), axis=axes, keepdims=kd)),
}


def _make_ref(fn, op):
    def ref(ins, attrs):
        x = ins[0]
        axes = _axes(attrs, x.ndim, op)
        if axes is None:  # noop_with_empty_axes: reduce over no axis (still squares for SumSquare/L2)
            axes = ()
        return [np.asarray(fn(x, axes, bool(attrs["keepdims"]))).astype(x.dtype)]

    return ref


for _name, _fn in _REDUCE.items():
    register(_name, inputs=1, kind="reduction",
             attrs={"axes": Attr("ints", None), "keepdims": Attr("int", 1), "noop_with_empty_axes": Attr("int", 0)},
             infer=_reduce_infer(_name), reference=_make_ref(_fn, _name), doc=f"ONNX {_name} (axes as attribute)")


def _arg_infer(op):
    def infer(ins, attrs):
        shape = ins[0].shape
        axis = norm_axis(attrs["axis"], len(shape), op)
        out = tuple(1 if i == axis else d for i, d in enumerate(shape)) if attrs["keepdims"] else \
            tuple(d for i, d in enumerate(shape) if i != axis)
        return [TensorType("int64", out)]

    return infer


def _arg_ref(fn):
    def ref(ins, attrs):
        x = ins[0]
        axis = attrs["axis"] % x.ndim
        if attrs["select_last_index"]:
            flipped = np.flip(x, axis)
            idx = x.shape[axis] - 1 - fn(flipped, axis=axis)
        else:
            idx = fn(x, axis=axis)
        if attrs["keepdims"]:
            idx = np.expand_dims(idx, axis)
        return [idx.astype(np.int64)]

    return ref


for _name, _fn in (("ArgMax", np.argmax), ("ArgMin", np.argmin)):
    register(_name, inputs=1, kind="reduction",
             attrs={"axis": Attr("int", 0), "keepdims": Attr("int", 1), "select_last_index": Attr("int", 0)},
             infer=_arg_infer(_name), reference=_arg_ref(_fn), doc=f"ONNX {_name}")
