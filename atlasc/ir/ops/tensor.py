"""Data-movement and tensor-construction ops.

Where ONNX passes a shape, axes, starts/ends or repeats as an int64 input tensor, the IR holds it as
an attribute of dims (ints or symbolic expressions), resolved by the frontend: a Reshape target has
no 0 or -1 left, Slice bounds are normalized to in-range non-negative positions, and so on. The
references evaluate those dims with the run's symbol bindings before they are called.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import InputError, ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.ops.common import broadcast_shapes, norm_axis, same_dtype
from atlasc.ir.ops.registry import Attr, DimMismatch, TensorType, register

# -- Reshape ---------------------------------------------------------------------------------


def _reshape_infer(ins, attrs):
    shape = tuple(attrs["shape"])
    if S.prove_eq(S.product(ins[0].shape), S.product(shape)) is False:
        raise ShapeError(f"Reshape: cannot reshape {S.shape_str(ins[0].shape)} to {S.shape_str(shape)}")
    return [TensorType(ins[0].dtype, shape)]


register("Reshape", inputs=1, kind="movement", attrs={"shape": Attr("dims")}, infer=_reshape_infer,
         reference=lambda ins, attrs: [ins[0].reshape(attrs["shape"])],
         doc="Reshape to a fully resolved target (no 0 / -1 left)")

# -- Transpose -------------------------------------------------------------------------------


def _transpose_infer(ins, attrs):
    perm = attrs["perm"]
    if perm is None:
        perm = tuple(reversed(range(ins[0].rank if hasattr(ins[0], "rank") else len(ins[0].shape))))
    if sorted(perm) != list(range(len(ins[0].shape))):
        raise ShapeError(f"Transpose: perm {perm} does not fit rank {len(ins[0].shape)}")
    return [TensorType(ins[0].dtype, tuple(ins[0].shape[p] for p in perm))]


register("Transpose", inputs=1, kind="movement", attrs={"perm": Attr("ints", None)}, infer=_transpose_infer,
         reference=lambda ins, attrs: [np.transpose(ins[0], attrs["perm"])], doc="ONNX Transpose")

# -- Squeeze / Unsqueeze / Flatten -----------------------------------------------------------


def _squeeze_infer(ins, attrs):
    shape = ins[0].shape
    axes = attrs["axes"]
    if axes is None:
        axes = [i for i, d in enumerate(shape) if d == 1]
    axes = {norm_axis(a, len(shape), "Squeeze") for a in axes}
    for a in axes:
        if shape[a] != 1:
            raise ShapeError(f"Squeeze: dim {a} of {S.shape_str(shape)} is not 1")
    return [TensorType(ins[0].dtype, tuple(d for i, d in enumerate(shape) if i not in axes))]


def _squeeze_ref(ins, attrs):
    axes = attrs["axes"]
    x = ins[0]
    if axes is None:
        return [np.squeeze(x)]
    return [np.squeeze(x, axis=tuple(a % x.ndim for a in axes))]


register("Squeeze", inputs=1, kind="movement", attrs={"axes": Attr("ints", None)}, infer=_squeeze_infer,
         reference=_squeeze_ref, doc="ONNX Squeeze (axes as attribute)")


def _unsqueeze_infer(ins, attrs):
    shape = list(ins[0].shape)
    rank = len(shape) + len(attrs["axes"])
    axes = sorted(norm_axis(a, rank, "Unsqueeze") for a in attrs["axes"])
    for a in axes:
        shape.insert(a, 1)
    return [TensorType(ins[0].dtype, tuple(shape))]


def _unsqueeze_ref(ins, attrs):
    x = ins[0]
    rank = x.ndim + len(attrs["axes"])
    return [np.expand_dims(x, tuple(sorted(a % rank for a in attrs["axes"])))]


register("Unsqueeze", inputs=1, kind="movement", attrs={"axes": Attr("ints")}, infer=_unsqueeze_infer,
         reference=_unsqueeze_ref, doc="ONNX Unsqueeze (axes as attribute)")


def _flatten_infer(ins, attrs):
    shape = ins[0].shape
    axis = attrs["axis"] + len(shape) if attrs["axis"] < 0 else attrs["axis"]
    return [TensorType(ins[0].dtype, (S.product(shape[:axis]), S.product(shape[axis:])))]


def _flatten_ref(ins, attrs):
    x = ins[0]
    axis = attrs["axis"] + x.ndim if attrs["axis"] < 0 else attrs["axis"]
    return [x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))]


register("Flatten", inputs=1, kind="movement", attrs={"axis": Attr("int", 1)}, infer=_flatten_infer,
         reference=_flatten_ref, doc="ONNX Flatten")

# -- Expand / Tile ---------------------------------------------------------------------------


def _expand_infer(ins, attrs):
    return [TensorType(ins[0].dtype, broadcast_shapes(ins[0].shape, tuple(attrs["shape"]), context="Expand: "))]


def _expand_ref(ins, attrs):
    x = ins[0]
    shape = np.broadcast_shapes(x.shape, tuple(attrs["shape"]))
    return [np.broadcast_to(x, shape).copy()]


register("Expand", inputs=1, kind="movement", attrs={"shape": Attr("dims")}, infer=_expand_infer,
         reference=_expand_ref, doc="ONNX Expand (target shape as attribute; bidirectional broadcast)")


def _tile_infer(ins, attrs):
    reps = tuple(attrs["repeats"])
    if len(reps) != len(ins[0].shape):
        raise ShapeError("Tile: repeats length differs from rank")
    return [TensorType(ins[0].dtype, tuple(S.mul(d, r) for d, r in zip(ins[0].shape, reps)))]


register("Tile", inputs=1, kind="movement", attrs={"repeats": Attr("dims")}, infer=_tile_infer,
         reference=lambda ins, attrs: [np.tile(ins[0], tuple(attrs["repeats"]))], doc="ONNX Tile")

# -- Concat / Split --------------------------------------------------------------------------


def _concat_infer(ins, attrs):
    dt = same_dtype(ins, "Concat")
    rank = len(ins[0].shape)
    axis = norm_axis(attrs["axis"], rank, "Concat")
    out = list(ins[0].shape)
    out[axis] = 0
    for t in ins:
        if len(t.shape) != rank:
            raise ShapeError("Concat: inputs differ in rank")
        for i, d in enumerate(t.shape):
            if i == axis:
                out[axis] = S.add(out[axis], d)
            elif d != out[i]:
                raise DimMismatch(out[i], d, "Concat: ")
    return [TensorType(dt, tuple(out))]


register("Concat", inputs=(1, -1), kind="movement", attrs={"axis": Attr("int")}, infer=_concat_infer,
         reference=lambda ins, attrs: [np.concatenate(ins, axis=attrs["axis"])], doc="ONNX Concat")


def _split_infer(ins, attrs):
    shape = ins[0].shape
    axis = norm_axis(attrs["axis"], len(shape), "Split")
    sizes = tuple(attrs["split"])
    if S.prove_eq(_sum_dims(sizes), shape[axis]) is False:
        raise ShapeError(f"Split: sizes {sizes} do not add up to {shape[axis]}")
    outs = []
    for s in sizes:
        o = list(shape)
        o[axis] = s
        outs.append(TensorType(ins[0].dtype, tuple(o)))
    return outs


def _sum_dims(dims):
    total = 0
    for d in dims:
        total = S.add(total, d)
    return total


def _split_ref(ins, attrs):
    cuts = np.cumsum(attrs["split"])[:-1]
    return [p.copy() for p in np.split(ins[0], cuts, axis=attrs["axis"])]


register("Split", inputs=1, outputs=(1, -1), kind="movement", attrs={"axis": Attr("int", 0), "split": Attr("dims")},
         infer=_split_infer, reference=_split_ref, doc="ONNX Split (sizes resolved to an attribute)")

# -- Slice -----------------------------------------------------------------------------------


def _slice_len(start, end, step):
    if step > 0:
        n = S.floordiv(S.add(S.sub(end, start), step - 1), step) if step != 1 else S.sub(end, start)
    else:
        n = S.floordiv(S.add(S.sub(start, end), -step - 1), -step)
    return max(n, 0) if isinstance(n, int) else n  # start past end: empty, not negative


def _slice_infer(ins, attrs):
    shape = list(ins[0].shape)
    for start, end, axis, step in zip(attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"]):
        if step == 0:
            raise ShapeError("Slice: step 0")
        shape[norm_axis(axis, len(shape), "Slice")] = _slice_len(start, end, step)
    return [TensorType(ins[0].dtype, tuple(shape))]


def _slice_ref(ins, attrs):
    x = ins[0]
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"]):
        stop = end if end >= 0 else None  # normalized: -1 only with a negative step, meaning "past 0"
        index[axis] = slice(start, stop, step)
    return [x[tuple(index)].copy()]


register("Slice", inputs=1, kind="movement",
         attrs={"starts": Attr("dims"), "ends": Attr("dims"), "axes": Attr("ints"), "steps": Attr("ints")},
         infer=_slice_infer, reference=_slice_ref,
         doc="ONNX Slice with bounds normalized to 0 <= start, end <= dim (end -1: before 0, negative steps)")

# -- Gather / ScatterND ----------------------------------------------------------------------


def _gather_infer(ins, attrs):
    data, idx = ins
    if idx.dtype not in ("int64", "int32"):
        raise ShapeError(f"Gather: indices must be int32/int64, got {idx.dtype}")
    axis = norm_axis(attrs["axis"], len(data.shape), "Gather")
    return [TensorType(data.dtype, data.shape[:axis] + tuple(idx.shape) + data.shape[axis + 1:])]


def _gather_ref(ins, attrs):
    data, idx = ins
    axis = attrs["axis"] % data.ndim
    n = data.shape[axis]
    idx = np.asarray(idx)
    if idx.dtype != object and idx.size and (idx.min() < -n or idx.max() >= n):  # ONNX: indices in [-n, n-1]
        bad = idx.min() if idx.min() < -n else idx.max()
        raise InputError(f"index {bad} is out of range for axis {axis} of size {n} (valid: {-n} .. {n - 1})")
    idx = np.where(idx < 0, idx + n, idx)
    return [np.take(data, idx, axis=axis)]


register("Gather", inputs=2, kind="opaque", attrs={"axis": Attr("int", 0)}, infer=_gather_infer,
         reference=_gather_ref, doc="ONNX Gather (negative indices wrap)")


_SCATTER_REDUCE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatternd_ref(ins, attrs):
    data, idx, upd = ins
    out = data.copy()
    idx = idx.reshape(-1, idx.shape[-1])
    upd = upd.reshape((idx.shape[0],) + out.shape[idx.shape[1]:])
    combine = _SCATTER_REDUCE.get(attrs["reduction"])
    for i, ix in enumerate(idx):
        ix = tuple(ix)
        out[ix] = upd[i] if combine is None else combine(out[ix], upd[i])
    return [out]


def _scatternd_infer(ins, attrs):
    if attrs["reduction"] not in ("none", *_SCATTER_REDUCE):
        raise ShapeError(f"ScatterND: unknown reduction '{attrs['reduction']}'")
    return [ins[0]]


register("ScatterND", inputs=3, kind="opaque", attrs={"reduction": Attr("str", "none")},
         infer=_scatternd_infer, reference=_scatternd_ref, doc="ONNX ScatterND (reduction none/add/mul/max/min)")

# -- Trilu / CumSum --------------------------------------------------------------------------


def _trilu_ref(ins, attrs):
    x, k = ins[0], attrs["k"]
    return [np.triu(x, k) if attrs["upper"] else np.tril(x, k)]


register("Trilu", inputs=1, kind="opaque", attrs={"upper": Attr("int", 1), "k": Attr("int", 0)},
         infer=lambda ins, attrs: [ins[0]], reference=_trilu_ref, doc="ONNX Trilu (k as attribute)")


def _cumsum_ref(ins, attrs):
    x = ins[0]
    axis = attrs["axis"] % x.ndim
    if attrs["reverse"]:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis=axis, dtype=x.dtype)
    if attrs["exclusive"]:
        y = y - x
    if attrs["reverse"]:
        y = np.flip(y, axis)
    return [np.ascontiguousarray(y)]


register("CumSum", inputs=1, kind="opaque",
         attrs={"axis": Attr("int"), "exclusive": Attr("int", 0), "reverse": Attr("int", 0)},
         infer=lambda ins, attrs: [ins[0]], reference=_cumsum_ref, doc="ONNX CumSum (axis as attribute)")

# -- sources: Range, ConstantOfShape, DimsTensor ---------------------------------------------


def _range_infer(ins, attrs):
    start, limit, delta = attrs["start"], attrs["limit"], attrs["delta"]
    if all(isinstance(v, (int, float)) and not isinstance(v, S.Expr) for v in (start, limit, delta)):
        n = max(int(np.ceil((limit - start) / delta)), 0)
    elif delta == 1:
        n = S.sub(limit, start)
    elif isinstance(delta, int) and delta < 0:  # ceil((limit - start) / delta) for a negative delta
        n = S.floordiv(S.add(S.sub(limit, start), delta + 1), delta)
    else:
        n = S.floordiv(S.add(S.sub(limit, start), delta - 1), delta)
    return [TensorType(attrs["dtype"], (n,))]


register("Range", inputs=0, kind="source",
         attrs={"start": Attr("dim"), "limit": Attr("dim"), "delta": Attr("dim"), "dtype": Attr("dtype")},
         infer=_range_infer,
         reference=lambda ins, attrs: [np.arange(attrs["start"], attrs["limit"], attrs["delta"],
                                                 dtype=to_numpy(attrs["dtype"]))],
         doc="ONNX Range with start/limit/delta as (symbolic) attributes")


def _cos_ref(ins, attrs):
    value = np.asarray(attrs["value"]).reshape(())
    return [np.full(tuple(attrs["shape"]), value, dtype=value.dtype)]


register("ConstantOfShape", inputs=0, kind="source", attrs={"shape": Attr("dims"), "value": Attr("array")},
         infer=lambda ins, attrs: [TensorType(_dt(attrs["value"]), tuple(attrs["shape"]))],
         reference=_cos_ref, doc="ONNX ConstantOfShape (shape as attribute)")


def _dt(arr):
    from atlasc.ir.dtypes import dtype_of_numpy

    return dtype_of_numpy(np.asarray(arr).dtype)


def _dims_tensor_infer(ins, attrs):
    n = len(attrs["dims"])
    if attrs["scalar"] and n != 1:
        raise ShapeError("DimsTensor: a scalar holds exactly one dim")
    return [TensorType(attrs["dtype"], () if attrs["scalar"] else (n,))]


def _dims_tensor_ref(ins, attrs):
    arr = np.array(list(attrs["dims"]), dtype=to_numpy(attrs["dtype"]))
    return [arr.reshape(()) if attrs["scalar"] else arr]


register("DimsTensor", inputs=0, kind="source",
         attrs={"dims": Attr("dims"), "dtype": Attr("dtype", "int64"), "scalar": Attr("bool", False)},
         infer=_dims_tensor_infer, reference=_dims_tensor_ref,
         doc="A small int tensor whose elements are dims (what ONNX Shape/Size programs compute)")


def _gathernd_infer(ins, attrs):
    data, idx = ins
    b = attrs["batch_dims"]
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise ShapeError("GatherND: the last dim of indices must be static")
    return [TensorType(data.dtype, tuple(idx.shape[:-1]) + tuple(data.shape[b + k:]))]


def _gathernd_ref(ins, attrs):
    data, idx = ins
    b = attrs["batch_dims"]
    batch_shape = data.shape[:b]
    nb = int(np.prod(batch_shape, dtype=np.int64))
    k = idx.shape[-1]
    d = data.reshape((nb,) + data.shape[b:])
    ix = idx.reshape((nb, -1, k))
    ix = np.where(ix < 0, ix + np.array(data.shape[b:b + k]), ix)
    out = np.stack([d[i][tuple(ix[i].T)] for i in range(nb)]) if nb else np.zeros((0, ix.shape[1]) + data.shape[b + k:],
                                                                                  data.dtype)
    return [out.reshape(idx.shape[:-1] + data.shape[b + k:])]


register("GatherND", inputs=2, kind="opaque", attrs={"batch_dims": Attr("int", 0)}, infer=_gathernd_infer,
         reference=_gathernd_ref, doc="ONNX GatherND")
