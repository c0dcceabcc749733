"""FusedElementwise: a straight-line program of elementwise ops evaluated per output element.

`program` is a tuple of steps `(op, attrs, refs)`: `op` names a registered op of kind "elementwise",
`attrs` is a tuple of `(name, value)` pairs (hashable, JSON-able), `refs` a tuple of input refs:
`("in", i)` the i-th external input, `("step", j)` an earlier step's result, or None (an omitted
optional input, Clip's min/max). The last step is the output, of type `out_dtype[out_shape]`.

The reference runs each step with that op's OWN reference, in order, with numpy broadcasting, so a
fused group computes bit-identically to the nodes it replaced. The shape rule checks the program
(known elementwise ops, refs to earlier steps, every step's own shape/dtype rule) and that the
external inputs broadcast exactly to `out_shape`: every step is then computable per output element.

`slices` (optional, one entry per input) reads input i as `x[..., start:start + length]` where entry
i is `(start, length)` (None: the whole input): a Split or Slice along the last axis feeding the group
is absorbed this way (e.g. SwiGLU reading the gate and up halves of one merged projection).
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.ops.common import broadcast_shapes
from atlasc.ir.ops.registry import OPS, Attr, TensorType, register


def step_attrs(step) -> dict:
    """A step's attributes as a dict (defaults not filled)."""
    return dict(step[1])


def freeze(x):
    """Lists -> tuples, recursively (attribute values must be hashable)."""
    if isinstance(x, (list, tuple)):
        return tuple(freeze(v) for v in x)
    return x


def _check_ref(ref, k: int, n_inputs: int, where: str):
    if ref is None:
        return
    if not (isinstance(ref, tuple) and len(ref) == 2 and ref[0] in ("in", "step") and isinstance(ref[1], int)):
        raise ShapeError(f"{where}: bad input ref {ref!r}")
    kind, i = ref
    if kind == "in" and not 0 <= i < n_inputs:
        raise ShapeError(f"{where}: input ref {i} out of range ({n_inputs} inputs)")
    if kind == "step" and not 0 <= i < k:
        raise ShapeError(f"{where}: step ref {i} does not name an earlier step")


def step_types(ins: list, program) -> list[TensorType]:
    """Each step's output type, by the step op's own rule over the external input types `ins`."""
    if not program:
        raise ShapeError("FusedElementwise: empty program")
    types: list[TensorType] = []
    for k, step in enumerate(program):
        if not (isinstance(step, tuple) and len(step) == 3):
            raise ShapeError(f"FusedElementwise: step {k} is not (op, attrs, refs)")
        op_name, attrs, refs = step
        op = OPS.get(op_name)
        where = f"FusedElementwise step {k} ({op_name})"
        if op is None or op.kind != "elementwise" or op_name == "FusedElementwise":
            raise ShapeError(f"{where}: only registered elementwise ops (not nested programs) may be fused")
        if op.stateful or op.dim_attrs:
            raise ShapeError(f"{where}: ops with state or dim attributes cannot be fused")
        lo, hi = op.num_inputs
        if not (lo <= len(refs) and (hi < 0 or len(refs) <= hi)):
            raise ShapeError(f"{where}: takes {lo}..{hi} inputs, got {len(refs)}")
        for ref in refs:
            _check_ref(ref, k, len(ins), where)
        args = [None if r is None else (ins[r[1]] if r[0] == "in" else types[r[1]]) for r in refs]
        types.append(op.infer(args, op.fill_attrs(dict(attrs)))[0])
    return types


def sliced_types(ins: list, slices) -> list:
    """The input types as the program sees them (last axis cut to each input's slice)."""
    if not slices:
        return list(ins)
    if len(slices) != len(ins):
        raise ShapeError(f"FusedElementwise: {len(slices)} slices for {len(ins)} inputs")
    out = []
    for t, sl in zip(ins, slices):
        if sl is None:
            out.append(t)
            continue
        start, length = sl
        last = t.shape[-1] if t.shape else None
        if not isinstance(last, int) or not (0 <= start and 0 < length and start + length <= last):
            raise ShapeError(f"FusedElementwise: slice {sl} does not fit an input of last dim {last}")
        out.append(TensorType(t.dtype, tuple(t.shape[:-1]) + (length,)))
    return out


def _infer(ins, attrs):
    if any(t is None for t in ins):
        raise ShapeError("FusedElementwise: inputs may not be omitted")
    ins = sliced_types(ins, attrs.get("slices"))
    out_shape = tuple(attrs["out_shape"])
    types = step_types(ins, attrs["program"])
    if broadcast_shapes(*(t.shape for t in ins), context="FusedElementwise: ") != out_shape:
        raise ShapeError(f"FusedElementwise: inputs broadcast to {broadcast_shapes(*(t.shape for t in ins))}, "
                         f"not to out_shape {out_shape}")
    last = types[-1]
    if last.dtype != attrs["out_dtype"]:
        raise ShapeError(f"FusedElementwise: last step gives {last.dtype}, out_dtype is {attrs['out_dtype']}")
    if broadcast_shapes(last.shape, out_shape) != out_shape:
        raise ShapeError(f"FusedElementwise: last step's shape {last.shape} does not broadcast to {out_shape}")
    return [TensorType(attrs["out_dtype"], out_shape)]


def _reference(ins, attrs):
    if attrs.get("slices"):
        ins = [x if sl is None else x[..., sl[0]:sl[0] + sl[1]] for x, sl in zip(ins, attrs["slices"])]
    results = []
    for op_name, step_attr, refs in attrs["program"]:
        op = OPS[op_name]
        args = [None if r is None else (ins[r[1]] if r[0] == "in" else results[r[1]]) for r in refs]
        results.append(op.reference(args, op.fill_attrs(dict(step_attr)))[0])
    out = np.asarray(results[-1])
    shape = tuple(attrs["out_shape"])
    if out.shape != shape:
        out = np.ascontiguousarray(np.broadcast_to(out, shape))
    return [out.astype(to_numpy(attrs["out_dtype"]), copy=False)]


register("FusedElementwise", inputs=(1, -1), kind="elementwise",
         attrs={"program": Attr("steps"), "out_shape": Attr("dims"), "out_dtype": Attr("dtype"),
                "slices": Attr("any", ())},
         infer=_infer, reference=_reference,
         doc="a chain of elementwise ops computed per output element (steps run their own references)")
