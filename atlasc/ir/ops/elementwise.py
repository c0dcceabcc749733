"""Elementwise ops: numpy-broadcasting binary ops, unary math, comparisons, Where, Cast, Clip, Gelu.

References follow ONNX semantics: the result dtype is the inputs' dtype (booleans for comparisons);
float16 math is computed by numpy in float16 with float32 internals, like onnxruntime's CPU kernels.
"""

from __future__ import annotations

import math

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.dtypes import DTYPES, FLOATS, to_numpy
from atlasc.ir.ops.common import broadcast_shapes, same_dtype
from atlasc.ir.ops.registry import Attr, TensorType, register


def _int_div(a, b):
    # ONNX integer division truncates toward zero (C semantics), numpy's // floors
    q = np.floor_divide(a, b)
    fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return (q + fix).astype(a.dtype)


def _div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return _int_div(a, b)
    return np.divide(a, b).astype(a.dtype)


def _pow(a, b):
    return np.power(a, b.astype(a.dtype) if a.dtype.kind == "f" else b).astype(a.dtype)


def _mod(a, b, fmod):
    return (np.fmod(a, b) if fmod else np.mod(a, b)).astype(a.dtype)


_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _div,
}
_COMPARE = {
    "Equal": np.equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
}
_LOGICAL = {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_ref(x):
    return _erf(x.astype(np.float64)).astype(x.dtype)


def _sigmoid(x):
    xf = x.astype(np.float64)
    return (1.0 / (1.0 + np.exp(-xf))).astype(x.dtype)


_UNARY_FLOAT = {
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Exp": np.exp,
    "Log": np.log,
    "Tanh": np.tanh,
    "Sigmoid": _sigmoid,
    "Erf": _erf_ref,
    "Cos": np.cos,
    "Sin": np.sin,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Softplus": lambda x: np.logaddexp(0, x.astype(np.float64)).astype(x.dtype),
}
_UNARY_ANY = {
    "Neg": np.negative,
    "Abs": np.abs,
    "Relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "Sign": np.sign,
    "Identity": lambda x: x,
}


def _binary_infer(op):
    def infer(ins, attrs):
        dt = same_dtype(ins, op)
        return [TensorType(dt, broadcast_shapes(ins[0].shape, ins[1].shape, context=f"{op}: "))]

    return infer


def _variadic_infer(op):
    def infer(ins, attrs):
        dt = same_dtype(ins, op)
        return [TensorType(dt, broadcast_shapes(*(t.shape for t in ins), context=f"{op}: "))]

    return infer


def _compare_infer(op):
    def infer(ins, attrs):
        same_dtype(ins, op)
        return [TensorType("bool", broadcast_shapes(ins[0].shape, ins[1].shape, context=f"{op}: "))]

    return infer


def _unary_infer(op, floats_only=False, out_dtype=None):
    def infer(ins, attrs):
        if floats_only and ins[0].dtype not in FLOATS:
            raise ShapeError(f"{op}: expects a float input, got {ins[0].dtype}")
        return [TensorType(out_dtype or ins[0].dtype, ins[0].shape)]

    return infer


for _name, _fn in _BINARY.items():
    register(_name, inputs=2, kind="elementwise", infer=_binary_infer(_name),
             reference=lambda ins, attrs, _fn=_fn: [_fn(ins[0], ins[1])], doc=f"ONNX {_name}")

def _pow_infer(ins, attrs):
    # ONNX Pow: base T, exponent T1 (any numeric type); the result has the base's type
    if ins[1].dtype == "bool" or ins[0].dtype == "bool":
        raise ShapeError("Pow: bool operands")
    return [TensorType(ins[0].dtype, broadcast_shapes(ins[0].shape, ins[1].shape, context="Pow: "))]


register("Pow", inputs=2, kind="elementwise", infer=_pow_infer,
         reference=lambda ins, attrs: [_pow(ins[0], ins[1])], doc="ONNX Pow (exponent may have another type)")

register("Mod", inputs=2, kind="elementwise", attrs={"fmod": Attr("int", 0)}, infer=_binary_infer("Mod"),
         reference=lambda ins, attrs: [_mod(ins[0], ins[1], attrs["fmod"])], doc="ONNX Mod")

for _name, _fn in (("Max", np.maximum), ("Min", np.minimum), ("Sum", np.add)):
    register(_name, inputs=(1, -1), kind="elementwise", infer=_variadic_infer(_name),
             reference=lambda ins, attrs, _fn=_fn: [_reduce_variadic(_fn, ins)], doc=f"ONNX {_name} (variadic)")


def _reduce_variadic(fn, ins):
    out = ins[0]
    for x in ins[1:]:
        out = fn(out, x)
    return np.asarray(out)


for _name, _fn in _COMPARE.items():
    register(_name, inputs=2, kind="elementwise", infer=_compare_infer(_name),
             reference=lambda ins, attrs, _fn=_fn: [np.asarray(_fn(ins[0], ins[1]))], doc=f"ONNX {_name}")

for _name, _fn in _LOGICAL.items():
    register(_name, inputs=2, kind="elementwise", infer=_compare_infer(_name),
             reference=lambda ins, attrs, _fn=_fn: [np.asarray(_fn(ins[0], ins[1]))], doc=f"ONNX {_name}")

register("Not", inputs=1, kind="elementwise", infer=_unary_infer("Not"),
         reference=lambda ins, attrs: [np.logical_not(ins[0])], doc="ONNX Not")

for _name, _fn in _UNARY_FLOAT.items():
    register(_name, inputs=1, kind="elementwise", infer=_unary_infer(_name, floats_only=True),
             reference=lambda ins, attrs, _fn=_fn: [np.asarray(_fn(ins[0])).astype(ins[0].dtype)],
             doc=f"ONNX {_name}")

for _name, _fn in _UNARY_ANY.items():
    register(_name, inputs=1, kind="elementwise", infer=_unary_infer(_name),
             reference=lambda ins, attrs, _fn=_fn: [np.asarray(_fn(ins[0])).astype(ins[0].dtype)],
             doc=f"ONNX {_name}")

register("IsNaN", inputs=1, kind="elementwise", infer=_unary_infer("IsNaN", out_dtype="bool"),
         reference=lambda ins, attrs: [np.asarray(np.isnan(ins[0]))], doc="ONNX IsNaN")


def _isinf_ref(ins, attrs):
    x = ins[0]
    pos = np.isposinf(x) if attrs["detect_positive"] else np.zeros(x.shape, bool)
    neg = np.isneginf(x) if attrs["detect_negative"] else np.zeros(x.shape, bool)
    return [np.asarray(pos | neg)]


register("IsInf", inputs=1, kind="elementwise",
         attrs={"detect_negative": Attr("int", 1), "detect_positive": Attr("int", 1)},
         infer=_unary_infer("IsInf", out_dtype="bool"), reference=_isinf_ref, doc="ONNX IsInf")


def _where_infer(ins, attrs):
    if ins[0].dtype != "bool":
        raise ShapeError(f"Where: condition must be bool, got {ins[0].dtype}")
    dt = same_dtype(ins[1:], "Where")
    return [TensorType(dt, broadcast_shapes(ins[0].shape, ins[1].shape, ins[2].shape, context="Where: "))]


register("Where", inputs=3, kind="elementwise", infer=_where_infer,
         reference=lambda ins, attrs: [np.where(ins[0], ins[1], ins[2])], doc="ONNX Where")


def _cast_ref(ins, attrs):
    x, to = ins[0], to_numpy(attrs["to"])
    if x.dtype.kind == "f" and to.kind in "iub" and to != np.bool_:
        with np.errstate(invalid="ignore"):
            return [np.trunc(x).astype(to)]
    return [x.astype(to)]


register("Cast", inputs=1, kind="elementwise", attrs={"to": Attr("dtype")},
         infer=lambda ins, attrs: [TensorType(_check_dtype(attrs["to"]), ins[0].shape)],
         reference=_cast_ref, doc="ONNX Cast (saturate ignored: no float8 here)")


def _check_dtype(dt):
    if dt not in DTYPES:
        raise ShapeError(f"unsupported dtype {dt}")
    return dt


def _clip_ref(ins, attrs):
    x = ins[0]
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else None
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else None
    if lo is not None:
        x = np.maximum(x, lo)
    if hi is not None:
        x = np.minimum(x, hi)
    return [np.asarray(x).astype(ins[0].dtype)]


register("Clip", inputs=(1, 3), kind="elementwise", infer=lambda ins, attrs: [ins[0]],
         reference=_clip_ref, doc="ONNX Clip (opset >= 11: min/max as optional scalar inputs)")


def _gelu_ref(ins, attrs):
    x = ins[0].astype(np.float64)
    if attrs["approximate"] == "tanh":
        y = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    else:
        y = 0.5 * x * (1 + _erf(x / math.sqrt(2)).astype(np.float64))
    return [y.astype(ins[0].dtype)]


register("Gelu", inputs=1, kind="elementwise", attrs={"approximate": Attr("str", "none")},
         infer=_unary_infer("Gelu", floats_only=True), reference=_gelu_ref, doc="ONNX Gelu (opset 20)")
