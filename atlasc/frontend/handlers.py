"""One handler per supported ONNX op: turns an ONNX node into IR (folded or emitted).

A handler reads the ONNX attributes, turns shape-like int64 operands (shapes, axes, starts/ends,
repeats, split sizes, Range bounds) into IR attributes of dims, and calls `Importer.emit`. Ops whose
ONNX and IR forms are the same are declared in the table at the bottom.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from atlasc.errors import ShapeError
from atlasc.frontend.symvals import Known, dims_array
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import dtype_of_numpy
from atlasc.ir.ops import get

INT64_BIG = 1 << 62  # |bound| at or above this is an "until the end" sentinel (INT64_MAX / INT64_MIN)


def _onnx_dtype(code: int) -> str:
    try:
        return dtype_of_numpy(onnx.helper.tensor_dtype_to_np_dtype(code))
    except (ValueError, TypeError, KeyError):
        raise ShapeError(f"unsupported element type {onnx.TensorProto.DataType.Name(code)}") from None


def _ir_attrs(op: str, node, rename: dict | None = None) -> dict:
    """ONNX attributes that the IR op declares (others are ignored: they do not change semantics)."""
    schema = get(op).attrs
    out = {}
    for key, value in node.attrs.items():
        key = (rename or {}).get(key, key)
        if key in schema:
            out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def passthrough(op: str, n_out: int | None = None):
    def handler(imp, node, ins):
        imp.emit(node, op, ins, _ir_attrs(op, node), n_out=n_out)

    return handler


# -- constants and shapes ------------------------------------------------------------------


def h_constant(imp, node, ins):
    a = node.attrs
    if "value" in a:
        v = a["value"]
        arr = np.asarray(v.values if isinstance(v, gs.Constant) else v)
    elif "value_float" in a:
        arr = np.array(a["value_float"], np.float32)
    elif "value_floats" in a:
        arr = np.array(a["value_floats"], np.float32)
    elif "value_int" in a:
        arr = np.array(a["value_int"], np.int64)
    elif "value_ints" in a:
        arr = np.array(a["value_ints"], np.int64)
    else:
        raise ShapeError(f"Constant with attribute(s) {sorted(a)} is not supported")
    imp.set_known(node.outputs[0].name, Known.numeric(arr))


def h_shape(imp, node, ins):
    shape = imp.shape_of(ins[0])
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end", None)
    dims = list(shape)[slice(start, end)]
    imp.set_known(node.outputs[0].name, Known(dims_array(dims), "int64").normalized())


def h_size(imp, node, ins):
    n = S.product(imp.shape_of(ins[0]))
    imp.set_known(node.outputs[0].name, Known(dims_array([n], ()), "int64").normalized())


def h_identity(imp, node, ins):
    imp.emit(node, "Identity", ins[:1], {}, n_out=1)


def h_dropout(imp, node, ins):
    if len(node.outputs) > 1 and node.outputs[1].name and node.outputs[1].outputs:
        raise ShapeError("Dropout's mask output is used; atlasc supports inference-mode Dropout only")
    imp.emit(node, "Identity", ins[:1], {}, n_out=1, out_names=[node.outputs[0].name])


def h_cast(imp, node, ins):
    imp.emit(node, "Cast", ins, {"to": _onnx_dtype(node.attrs["to"])})


def h_castlike(imp, node, ins):
    imp.emit(node, "Cast", ins[:1], {"to": imp.dtype_of(ins[1])})


def h_constant_of_shape(imp, node, ins):
    shape = imp.operand(ins[0], node, "shape").dims()
    value = node.attrs.get("value")
    arr = np.asarray(value.values if isinstance(value, gs.Constant) else (value if value is not None else
                                                                           np.zeros(1, np.float32)))
    imp.emit(node, "ConstantOfShape", [], {"shape": shape, "value": arr.reshape(-1)[:1].copy()})


def h_range(imp, node, ins):
    dtype = imp.operand(ins[0], node, "start").dtype
    vals = [imp.scalar_operand(x, node, w) for x, w in zip(ins, ("start", "limit", "delta"))]
    if dtype not in ("int64", "int32"):
        if any(isinstance(v, S.Expr) for v in vals):
            raise ShapeError("Range over floats with symbolic bounds is not supported")
    imp.emit(node, "Range", [], {"start": vals[0], "limit": vals[1], "delta": vals[2], "dtype": dtype})


# -- movement -------------------------------------------------------------------------------


def h_reshape(imp, node, ins):
    x = ins[0]
    target = list(imp.operand(ins[1], node, "target shape").dims())
    in_shape = imp.shape_of(x)
    allowzero = node.attrs.get("allowzero", 0)
    dims = []
    for i, d in enumerate(target):
        if isinstance(d, int) and d == 0 and not allowzero:
            if i >= len(in_shape):
                raise ShapeError(f"Reshape: 0 at position {i} but the input has rank {len(in_shape)}")
            dims.append(in_shape[i])
        else:
            dims.append(d)
    holes = [i for i, d in enumerate(dims) if isinstance(d, int) and d == -1]
    if len(holes) > 1:
        raise ShapeError("Reshape: more than one -1 in the target shape")
    if holes:
        rest = S.product(d for i, d in enumerate(dims) if i != holes[0])
        numel = S.product(in_shape)
        q = S.exact_div(numel, rest)
        dims[holes[0]] = q if q is not None else S.floordiv(numel, rest)
    imp.emit(node, "Reshape", ins[:1], {"shape": tuple(dims)})


def _axes(imp, node, ins, index: int, min_opset: int, what="axes"):
    """Axes from the input `index` (opset >= min_opset) or from the attribute."""
    if imp.opset >= min_opset:
        if len(ins) > index and ins[index] is not None:
            return tuple(int(a) for a in imp.operand(ins[index], node, what).dims())
        return None
    axes = node.attrs.get("axes")
    return None if axes is None else tuple(int(a) for a in axes)


def h_squeeze(imp, node, ins):
    imp.emit(node, "Squeeze", ins[:1], {"axes": _axes(imp, node, ins, 1, 13)})


def h_unsqueeze(imp, node, ins):
    axes = _axes(imp, node, ins, 1, 13)
    if axes is None:
        raise ShapeError("Unsqueeze without axes")
    imp.emit(node, "Unsqueeze", ins[:1], {"axes": axes})


def h_expand(imp, node, ins):
    imp.emit(node, "Expand", ins[:1], {"shape": imp.operand(ins[1], node, "shape").dims()})


def h_tile(imp, node, ins):
    imp.emit(node, "Tile", ins[:1], {"repeats": imp.operand(ins[1], node, "repeats").dims()})


def h_transpose(imp, node, ins):
    perm = node.attrs.get("perm")
    imp.emit(node, "Transpose", ins, {"perm": None if perm is None else tuple(int(p) for p in perm)})


def h_concat(imp, node, ins):
    parts = [i for i in ins if i is not None]
    if not parts:
        raise ShapeError("Concat without inputs")
    imp.emit(node, "Concat", parts, {"axis": int(node.attrs["axis"])})


def h_split(imp, node, ins):
    shape = imp.shape_of(ins[0])
    axis = int(node.attrs.get("axis", 0))
    axis_n = axis % len(shape)
    n = len(node.outputs)
    sizes = None
    if imp.opset >= 13 and len(ins) > 1 and ins[1] is not None:
        sizes = imp.operand(ins[1], node, "split").dims()
    elif imp.opset < 13 and node.attrs.get("split") is not None:
        sizes = tuple(int(s) for s in node.attrs["split"])
    if sizes is None:
        d = shape[axis_n]
        if "num_outputs" in node.attrs:
            n = int(node.attrs["num_outputs"])
            chunk = S.floordiv(S.add(d, n - 1), n)
            sizes = tuple([chunk] * (n - 1) + [S.sub(d, S.mul(chunk, n - 1))])
        else:
            sizes = tuple([S.floordiv(d, n)] * n)
    imp.emit(node, "Split", ins[:1], {"axis": axis, "split": tuple(sizes)})


def _slice_bound(v, d, step, is_start):
    """ONNX Slice clamping of one bound on a dim d (int or symbolic)."""
    if step > 0:
        lo, hi = 0, d
    else:
        lo, hi = (0, S.sub(d, 1)) if is_start else (-1, S.sub(d, 1))
    if isinstance(v, S.Expr):
        return v  # symbolic bounds are taken as in range (exporters compute them from the same dims)
    if v >= INT64_BIG:
        return hi
    if v <= -INT64_BIG:
        return lo
    if v < 0:
        v = S.add(d, v)
    if isinstance(v, int) and isinstance(d, int):
        return max(lo, min(v, hi))
    if isinstance(v, int):  # v >= 0 on a symbolic dim: clamp only where provable
        return v if v != 0 or step > 0 else v
    return v


def h_slice(imp, node, ins):
    shape = imp.shape_of(ins[0])
    if imp.opset >= 10:
        starts = imp.operand(ins[1], node, "starts").dims()
        ends = imp.operand(ins[2], node, "ends").dims()
        axes = imp.operand(ins[3], node, "axes").dims() if len(ins) > 3 and ins[3] is not None else None
        steps = imp.operand(ins[4], node, "steps").dims() if len(ins) > 4 and ins[4] is not None else None
    else:
        starts, ends = tuple(node.attrs["starts"]), tuple(node.attrs["ends"])
        axes, steps = node.attrs.get("axes"), None
    axes = tuple(int(a) % len(shape) for a in (axes if axes is not None else range(len(starts))))
    steps = tuple(int(s) for s in (steps if steps is not None else [1] * len(starts)))
    n_starts, n_ends = [], []
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st == 0:
            raise ShapeError("Slice step 0")
        n_starts.append(_slice_bound(s, shape[a], st, True))
        n_ends.append(_slice_bound(e, shape[a], st, False))
    imp.emit(node, "Slice", ins[:1], {"starts": tuple(n_starts), "ends": tuple(n_ends), "axes": axes,
                                      "steps": steps})


def h_gather(imp, node, ins):
    imp.emit(node, "Gather", ins, {"axis": int(node.attrs.get("axis", 0))})


def h_trilu(imp, node, ins):
    k = imp.scalar_operand(ins[1], node, "k") if len(ins) > 1 and ins[1] is not None else 0
    if isinstance(k, S.Expr):
        raise ShapeError("Trilu with a symbolic k is not supported")
    imp.emit(node, "Trilu", ins[:1], {"upper": int(node.attrs.get("upper", 1)), "k": int(k)})


def h_cumsum(imp, node, ins):
    axis = imp.scalar_operand(ins[1], node, "axis")
    imp.emit(node, "CumSum", ins[:1], {"axis": int(axis), "exclusive": int(node.attrs.get("exclusive", 0)),
                                       "reverse": int(node.attrs.get("reverse", 0))})


# -- math -----------------------------------------------------------------------------------


def h_clip(imp, node, ins):
    if imp.opset < 11:
        dt = imp.dtype_of(ins[0])
        from atlasc.ir.dtypes import to_numpy

        lo = Known.numeric(np.array(node.attrs.get("min", -np.inf), to_numpy(dt)))
        hi = Known.numeric(np.array(node.attrs.get("max", np.inf), to_numpy(dt)))
        ins = [ins[0], lo, hi]
    imp.emit(node, "Clip", ins, {})


def h_softmax(op):
    def handler(imp, node, ins):
        rank = len(imp.shape_of(ins[0]))
        axis = int(node.attrs.get("axis", -1 if imp.opset >= 13 else 1))
        if imp.opset < 13 and axis % rank != rank - 1:
            raise ShapeError(f"{op} before opset 13 with axis {axis} (flattening semantics) is not supported")
        imp.emit(node, op, ins, {"axis": axis})

    return handler


def h_reduce(op):
    def handler(imp, node, ins):
        min_opset = 13 if op == "ReduceSum" else 18
        attrs = {"axes": _axes(imp, node, ins, 1, min_opset), "keepdims": int(node.attrs.get("keepdims", 1)),
                 "noop_with_empty_axes": int(node.attrs.get("noop_with_empty_axes", 0))}
        imp.emit(node, op, ins[:1], attrs)

    return handler


def h_layernorm(imp, node, ins):
    n_out = sum(1 for o in node.outputs if o.name)
    last = max((i for i, o in enumerate(node.outputs) if o.name), default=0) + 1
    imp.emit(node, "LayerNormalization", ins, _ir_attrs("LayerNormalization", node), n_out=max(n_out, last))


def h_attention(imp, node, ins):
    if len(ins) > 6 and ins[6] is not None:
        raise ShapeError("Attention with nonpad_kv_seqlen (opset 24) is not supported yet")
    n_out = max((i for i, o in enumerate(node.outputs) if o.name), default=0) + 1
    imp.emit(node, "Attention", ins[:6], _ir_attrs("Attention", node), n_out=n_out)


def h_rotary(imp, node, ins):
    # ONNX order: X, cos_cache, sin_cache, position_ids (optional) -- the IR keeps it
    imp.emit(node, "RotaryEmbedding", ins, _ir_attrs("RotaryEmbedding", node))


def h_matmul_nbits(imp, node, ins):
    """com.microsoft MatMulNBits (4-bit) -> LinearQ4, as stored.

    MatMulNBits packs B [N, K/block, block/2] as unsigned nibbles, low nibble first, w = (q - zp) *
    scale with zp = 8 by default: exactly LinearQ4's [N, K/2] layout (q + 8), so no requantization;
    the scales become float16 (LinearQ4's scale type; exact for float16 exports). uint8 zero points
    (two per byte, low nibble first, each row padded to whole bytes) other than all 8 become LinearQ4's
    zero-point input [N, K/block]; float zero points are an error."""
    a = node.attrs
    bits, block, k, n = int(a.get("bits", 4)), int(a["block_size"]), int(a["K"]), int(a["N"])
    where = "MatMulNBits"
    if bits != 4:
        raise ShapeError(f"{where} with bits={bits} is not supported (4-bit only)")
    if len(ins) > 4 and ins[4] is not None:
        raise ShapeError(f"{where} with g_idx (act-order) is not supported")
    if block < 16 or block & (block - 1) or k % block:
        raise ShapeError(f"{where}: block_size {block} must be a power of two >= 16 dividing K = {k}")
    packed, scales = ins[1], ins[2]
    if not (isinstance(packed, Known) and isinstance(scales, Known)) or packed.symbolic or scales.symbolic:
        raise ShapeError(f"{where}: B and scales must be initializers")
    zp = ins[3] if len(ins) > 3 else None
    zero = None
    if zp is not None:
        z = np.asarray(zp.array) if isinstance(zp, Known) else None
        if z is None:
            raise ShapeError(f"{where}: zero points must be an initializer")
        blocks, row_bytes = k // block, (k // block + 1) // 2
        if z.dtype != np.uint8:  # unpacked zero points: only the symmetric default (all 8) is supported
            if not np.all(z == 8):
                raise ShapeError(f"{where} with {z.dtype} zero points is not supported (packed uint8 only)")
        elif z.size != n * row_bytes:
            raise ShapeError(f"{where}: zero points must hold N * ceil(K/block / 2) = {n * row_bytes} bytes, "
                             f"got {z.size}")
        else:
            z = z.reshape(n, row_bytes)
            unpacked = np.empty((n, 2 * row_bytes), np.uint8)
            unpacked[:, 0::2], unpacked[:, 1::2] = z & 15, z >> 4
            if np.any(unpacked[:, :blocks] != 8):  # all 8 is the symmetric default
                zero = Known.numeric(np.ascontiguousarray(unpacked[:, :blocks]))
    b = np.asarray(packed.array)
    if b.dtype != np.uint8 or b.size != n * k // 2:
        raise ShapeError(f"{where}: B must be uint8 [N, K/block, block/2] = {n} x {k // block} x {block // 2}")
    s = np.asarray(scales.array)
    if s.size != n * (k // block):
        raise ShapeError(f"{where}: scales must hold N * K/block = {n * (k // block)} values, got {s.size}")
    wq = Known.numeric(np.ascontiguousarray(b.reshape(n, k // 2)))
    scale = Known.numeric(s.reshape(n, k // block).astype(np.float16))
    bias = ins[5] if len(ins) > 5 else None
    extra = [bias] if bias is not None else []
    if zero is not None:
        extra = [bias, zero]  # LinearQ4(x, wq, scale, bias or None, zero)
    imp.emit(node, "LinearQ4", [ins[0], wq, scale] + extra, {"group_size": block})


def h_dequantize_linear(imp, node, ins):
    """DequantizeLinear of a constant (int8/uint8, or int4/uint4 widened to them): kept as a node, not
    folded to floats, so that passes/quantize.py can map a quantized MatMul weight to LinearQ4/Q8 with
    the stored integers (no requantization)."""
    x = ins[0]
    if not isinstance(x, Known) or x.symbolic:
        raise ShapeError("DequantizeLinear is supported on constant weights only")
    imp.emit(node, "DequantizeLinear", ins[:3], _ir_attrs("DequantizeLinear", node), fold=False)


_SAME = [
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "Not", "Sqrt", "Reciprocal", "Exp", "Log", "Tanh", "Sigmoid", "Erf",
    "Cos", "Sin", "Floor", "Ceil", "Softplus", "Neg", "Abs", "Relu", "Sign", "IsNaN", "IsInf", "Where", "Gelu",
    "MatMul", "Gemm", "RMSNormalization", "ScatterND", "GatherND", "Flatten", "ArgMax", "ArgMin",
]

HANDLERS = {op: passthrough(op) for op in _SAME}
HANDLERS.update({
    "Constant": h_constant,
    "Shape": h_shape,
    "Size": h_size,
    "Identity": h_identity,
    "Dropout": h_dropout,
    "Cast": h_cast,
    "CastLike": h_castlike,
    "ConstantOfShape": h_constant_of_shape,
    "Range": h_range,
    "Reshape": h_reshape,
    "Squeeze": h_squeeze,
    "Unsqueeze": h_unsqueeze,
    "Expand": h_expand,
    "Tile": h_tile,
    "Transpose": h_transpose,
    "Concat": h_concat,
    "Split": h_split,
    "Slice": h_slice,
    "Gather": h_gather,
    "Trilu": h_trilu,
    "CumSum": h_cumsum,
    "Clip": h_clip,
    "Softmax": h_softmax("Softmax"),
    "LogSoftmax": h_softmax("LogSoftmax"),
    "LayerNormalization": h_layernorm,
    "Attention": h_attention,
    "RotaryEmbedding": h_rotary,
    "com.microsoft::MatMulNBits": h_matmul_nbits,
    "DequantizeLinear": h_dequantize_linear,
    **{op: h_reduce(op) for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
                                    "ReduceSumSquare", "ReduceL2")},
})
