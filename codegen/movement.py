"""Data-movement and tensor-construction kernels (device code in movement.cu).

- Concat / Split: one grid-stride copy per input (Concat) or output (Split) between strided views,
  the output view shifted along the axis by the running sum of the run-time sizes; reads and writes
  are coalesced along the innermost dim, and no piece depends on another.
- Gather / GatherND: one thread per output element; coordinates map to index and data offsets in
  code generated per node (unrolled over the static ranks). Negative indices wrap; out-of-range
  indices (an error in the reference) are clamped so that no access leaves the tensor.
- ScatterND (reduction none only): block per output slot, last matching update row wins (see
  movement.cu); one kernel, no grid-wide ordering needed, in-place safe.
- Trilu: one thread per element. CumSum: one thread per line (float16 sums rounded per step like
  numpy). Range / ConstantOfShape / DimsTensor: sources whose values are compile-time literals or C
  expressions over the run-time dims buffer.
"""

from __future__ import annotations

import math

import numpy as np

from atlasc.codegen.cexpr import c_type, compute_type
from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext, emitter
from atlasc.codegen.reduce import block_size, row_grid, subview
from atlasc.ir import symbolic as S
from atlasc.ir.graph import Node
from atlasc.ir.ops import get

INT_TYPES = ("int64", "int32")


def _attrs(node: Node) -> dict:
    return get(node.op).fill_attrs(node.attrs)


def _axis(node: Node, axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise CodegenError(f"{node.name}: axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _grid(ctx: KernelContext, node: Node):
    return ctx.grid_for(max((ctx.numel_upper(v) for v in [*node.inputs, *node.outputs] if v is not None),
                            default=1))


@emitter("Concat")
def emit_concat(ctx: KernelContext, node: Node) -> KernelCode:
    y = node.outputs[0]
    rank = len(y.shape)
    axis = _axis(node, _attrs(node)["axis"], rank)
    t = c_type(y.dtype)
    ctx.view(y, "y")
    lines = ["  long long shift = 0;"]
    for k, v in enumerate(node.inputs):
        ctx.view(v, f"in{k}")
        lines += [
            f"  {{ atlas::View<{t}, {rank}> dst = y; dst.p += shift * y.stride[{axis}];",
            f"    dst.shape[{axis}] = in{k}.shape[{axis}]; atlas::mv::copy(dst, in{k});",
            f"    shift += in{k}.shape[{axis}]; }}",
        ]
    return KernelCode("\n".join(lines), ctx.grid_for(ctx.numel_upper(y)))


@emitter("Split")
def emit_split(ctx: KernelContext, node: Node) -> KernelCode:
    x = node.inputs[0]
    rank = len(x.shape)
    axis = _axis(node, _attrs(node)["axis"], rank)
    t = c_type(x.dtype)
    ctx.view(x, "x")
    lines = ["  long long shift = 0;"]
    for k, v in enumerate(node.outputs):
        ctx.view(v, f"out{k}")
        lines += [
            f"  {{ atlas::View<{t}, {rank}> src = x; src.p += shift * x.stride[{axis}];",
            f"    src.shape[{axis}] = out{k}.shape[{axis}]; atlas::mv::copy(out{k}, src);",
            f"    shift += out{k}.shape[{axis}]; }}",
        ]
    return KernelCode("\n".join(lines), ctx.grid_for(ctx.numel_upper(x)))


def _index_load(expr_off: str, name: str, bound: str, var: str) -> list[str]:
    """Read index `name.p[off]`, wrap a negative one by `bound`, clamp into [0, bound)."""
    return [
        f"    long long {var} = static_cast<long long>({name}.p[{expr_off}]);",
        f"    if ({var} < 0) {var} += {bound};",
        f"    {var} = {var} < 0 ? 0 : ({var} >= {bound} ? {bound} - 1 : {var});",
    ]


def _sum(terms: list[str]) -> str:
    return " + ".join(terms) if terms else "0"


@emitter("Gather")
def emit_gather(ctx: KernelContext, node: Node) -> KernelCode:
    data, idx = node.inputs
    y = node.outputs[0]
    if idx.dtype not in INT_TYPES:
        raise CodegenError(f"{node.name}: Gather indices of type {idx.dtype}")
    r, q = len(data.shape), len(idx.shape)
    axis = _axis(node, _attrs(node)["axis"], r)
    orank = max(len(y.shape), 1)
    ctx.view(data, "data")
    ctx.view(idx, "ix")
    ctx.view(y, "y")
    # output coords: data[:axis] | idx[0:q] | data[axis+1:]
    ioff = _sum([f"c[{axis + t}] * ix.stride[{t}]" for t in range(q)])
    doff = [f"c[{t}] * data.stride[{t}]" for t in range(axis)]
    doff.append(f"j * data.stride[{axis}]")
    doff += [f"c[{axis + q + t - axis - 1}] * data.stride[{t}]" for t in range(axis + 1, r)]
    body = [
        "  const long long n = y.numel();",
        "  for (long long f = atlas::global_thread(); f < n; f += atlas::global_threads()) {",
        f"    long long c[{orank}]; atlas::unravel<{orank}>(f, y.shape, c); (void)c;",
        *_index_load(ioff, "ix", f"data.shape[{axis}]", "j"),
        f"    *y.at_flat(f) = data.p[{_sum(doff)}];",
        "  }",
    ]
    return KernelCode("\n".join(body), ctx.grid_for(ctx.numel_upper(y)))


@emitter("GatherND")
def emit_gathernd(ctx: KernelContext, node: Node) -> KernelCode:
    data, idx = node.inputs
    y = node.outputs[0]
    if idx.dtype not in INT_TYPES:
        raise CodegenError(f"{node.name}: GatherND indices of type {idx.dtype}")
    b = _attrs(node)["batch_dims"]
    r, q = len(data.shape), len(idx.shape)
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise CodegenError(f"{node.name}: GatherND needs a static index depth")
    orank = max(len(y.shape), 1)
    ctx.view(data, "data")
    ctx.view(idx, "ix")
    ctx.view(y, "y")
    # output coords: idx[:q-1] (the first b of them are data's batch coords) | data[b+k:]
    row = _sum([f"c[{t}] * ix.stride[{t}]" for t in range(q - 1)])
    body = [
        "  const long long n = y.numel();",
        "  for (long long f = atlas::global_thread(); f < n; f += atlas::global_threads()) {",
        f"    long long c[{orank}]; atlas::unravel<{orank}>(f, y.shape, c); (void)c;",
        f"    const long long row = {row};",
    ]
    doff = [f"c[{t}] * data.stride[{t}]" for t in range(b)]
    for j in range(k):
        body += _index_load(f"row + {j}LL * ix.stride[{q - 1}]", "ix", f"data.shape[{b + j}]", f"j{j}")
        doff.append(f"j{j} * data.stride[{b + j}]")
    doff += [f"c[{q - 1 + t - b - k}] * data.stride[{t}]" for t in range(b + k, r)]
    body += [f"    *y.at_flat(f) = data.p[{_sum(doff)}];", "  }"]
    return KernelCode("\n".join(body), ctx.grid_for(ctx.numel_upper(y)))


@emitter("ScatterND")
def emit_scatternd(ctx: KernelContext, node: Node) -> KernelCode:
    data, idx, upd = node.inputs
    y = node.outputs[0]
    if _attrs(node)["reduction"] != "none":
        raise CodegenError(f"{node.name}: ScatterND reduction '{node.attrs['reduction']}' has no CUDA kernel")
    if idx.dtype not in INT_TYPES:
        raise CodegenError(f"{node.name}: ScatterND indices of type {idx.dtype}")
    r, q = len(data.shape), len(idx.shape)
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise CodegenError(f"{node.name}: ScatterND needs a static index depth")
    ctx.view(data, "data")
    ctx.view(idx, "ix")
    ctx.view(upd, "upd")
    ctx.view(y, "y")
    subview(ctx, "y", y, range(k), "y_slot")
    subview(ctx, "data", data, range(k), "d_slot")
    subview(ctx, "y", y, range(k, r), "y_slice")
    subview(ctx, "data", data, range(k, r), "d_slice")
    subview(ctx, "ix", idx, range(q - 1), "ix_rows")
    subview(ctx, "upd", upd, range(q - 1), "u_rows")
    subview(ctx, "upd", upd, range(q - 1, len(upd.shape)), "u_slice")
    body = (f"  atlas::mv::scatter_nd<{k}>(y_slot, d_slot, y_slice, d_slice, ix_rows, ix.stride[{q - 1}], "
            "u_rows, u_slice);")
    slots = 1
    for d in data.shape[:k]:
        slots *= ctx.upper(d)
    slice_n = 1
    for d in data.shape[k:]:
        slice_n *= ctx.upper(d)
    return KernelCode(body, row_grid(slots), (block_size(slice_n), 1, 1))


@emitter("Trilu")
def emit_trilu(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    if len(x.shape) < 2:
        raise CodegenError(f"{node.name}: Trilu needs rank >= 2")
    attrs = _attrs(node)
    ctx.view(x, "x")
    ctx.view(y, "y")
    body = f"  atlas::mv::trilu(y, x, {int(attrs['k'])}LL, {'true' if attrs['upper'] else 'false'});"
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(y)))


@emitter("CumSum")
def emit_cumsum(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    if x.dtype == "bool":
        raise CodegenError(f"{node.name}: CumSum on bool")
    attrs = _attrs(node)
    rank = len(x.shape)
    if rank == 0:
        raise CodegenError(f"{node.name}: CumSum of a scalar")
    axis = _axis(node, attrs["axis"], rank)
    kept = [i for i in range(rank) if i != axis]
    ctx.view(x, "x")
    ctx.view(y, "y")
    subview(ctx, "x", x, kept, "xk")
    subview(ctx, "x", x, [axis], "xr")
    subview(ctx, "y", y, kept, "yk")
    subview(ctx, "y", y, [axis], "yr")
    flags = f"{'true' if attrs['exclusive'] else 'false'}, {'true' if attrs['reverse'] else 'false'}"
    lines = 1
    for i in kept:
        lines *= ctx.upper(x.shape[i])
    return KernelCode(f"  atlas::mv::cumsum<{flags}>(xk, xr, yk, yr);", ctx.grid_for(lines))


# -- sources ------------------------------------------------------------------------------------


def _is_float(v) -> bool:
    return isinstance(v, (float, np.floating))


def _double(ctx: KernelContext, v) -> str:
    """C expression of type double for a number or a (symbolic) dim."""
    if _is_float(v):
        v = float(v)
        if math.isnan(v):
            return "static_cast<double>(NAN)"
        if math.isinf(v):
            return f"static_cast<double>({'-' if v < 0 else ''}INFINITY)"
        return repr(v)
    return f"static_cast<double>({ctx.dim(v)})"


def _literal(value: np.ndarray) -> str:
    """C literal (in the compute type) for a one-element numpy array."""
    v = np.asarray(value).reshape(-1)
    if v.size != 1:
        raise CodegenError(f"ConstantOfShape value has {v.size} elements")
    x = v[0]
    if v.dtype == np.bool_:
        return "true" if x else "false"
    if np.issubdtype(v.dtype, np.floating):
        f = float(x)
        if math.isnan(f):
            return "NAN"
        if math.isinf(f):
            return "-INFINITY" if f < 0 else "INFINITY"
        return repr(f) if v.dtype == np.float64 else repr(f) + "f"
    i = int(x)
    if i == -(2 ** 63):
        return "(-9223372036854775807LL - 1)"
    return f"{i}LL"


@emitter("Range")
def emit_range(ctx: KernelContext, node: Node) -> KernelCode:
    y = node.outputs[0]
    attrs = _attrs(node)
    start, delta = attrs["start"], attrs["delta"]
    ct = compute_type(y.dtype)
    ctx.view(y, "y")
    head = ["  const long long n = y.numel();"]
    if y.dtype in ("float16", "float32", "float64"):
        # numpy's arange: buffer[0] = T(start), buffer[1] = T(start + delta), then
        # buffer[i] = start' + i * (buffer[1] - start') in the fill type (float for float16)
        t = c_type(y.dtype)
        s, d = _double(ctx, start), _double(ctx, delta)
        head += [
            f"  const {ct} s0 = static_cast<{ct}>(static_cast<{t}>({s}));",
            f"  const {ct} s1 = static_cast<{ct}>(static_cast<{t}>({s} + {d}));",
            f"  const {ct} step = s1 - s0;",
        ]
        value = f"(i == 0 ? s0 : (i == 1 ? s1 : s0 + static_cast<{ct}>(i) * step))"
    else:
        if _is_float(start) or _is_float(delta):
            raise CodegenError(f"{node.name}: Range of {y.dtype} with float bounds")
        head += [f"  const long long s0 = {ctx.dim(start)}, step = {ctx.dim(delta)};"]
        value = f"static_cast<{ct}>(s0 + i * step)"
    body = [
        *head,
        "  for (long long i = atlas::global_thread(); i < n; i += atlas::global_threads())",
        f"    atlas::store(y.at_flat(i), {value});",
    ]
    return KernelCode("\n".join(body), ctx.grid_for(ctx.numel_upper(y)))


@emitter("ConstantOfShape")
def emit_constant_of_shape(ctx: KernelContext, node: Node) -> KernelCode:
    y = node.outputs[0]
    ct = compute_type(y.dtype)
    ctx.view(y, "y")
    body = [
        f"  const {ct} v = {_literal(node.attrs['value'])};",
        "  const long long n = y.numel();",
        "  for (long long i = atlas::global_thread(); i < n; i += atlas::global_threads())",
        "    atlas::store(y.at_flat(i), v);",
    ]
    return KernelCode("\n".join(body), ctx.grid_for(ctx.numel_upper(y)))


@emitter("DimsTensor")
def emit_dims_tensor(ctx: KernelContext, node: Node) -> KernelCode:
    y = node.outputs[0]
    if y.dtype not in INT_TYPES:
        raise CodegenError(f"{node.name}: DimsTensor of type {y.dtype}")
    ct = compute_type(y.dtype)
    ctx.view(y, "y")
    body = ["  if (atlas::global_thread() == 0) {"]
    for k, d in enumerate(_attrs(node)["dims"]):
        body.append(f"    atlas::store(y.at_flat({k}), static_cast<{ct}>({ctx.dim(S.dim(d))}));")
    body.append("  }")
    return KernelCode("\n".join(body), (1, 1, 1), (32, 1, 1))
