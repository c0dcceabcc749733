"""Reduction kernels: Reduce*, ArgMax/ArgMin, Softmax/LogSoftmax, LayerNormalization, RMSNormalization,
AddRMSNormalization, AddLayerNormalization.

Each node's input is split into two strided views over the same pointer: the kept dims (one "row"
per kept coordinate) and the reduced dims (the row's elements), both carrying the input's own
strides, so transposed or KV-cache inputs are read correctly. Outputs are addressed through their
own View (row-major flat index of the kept coordinates; keepdims only inserts 1s).

Schedules (device code in reduce.cu):
- block per row when the input's innermost dim is reduced (threads walk the row: coalesced), or
  when there are few rows; block size fits the row's compile-time maximum (32..256 threads);
- thread per row otherwise (a reduction over an outer axis: adjacent threads read adjacent kept
  elements, coalesced).
LayerNormalization and RMSNormalization always normalize trailing dims: block per row.
Accumulation: float for float16/float32 (rounded once on store), double for float64, long long for
integer/bool inputs.
"""

from __future__ import annotations

import math

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.errors import env_switch
from atlasc.ir.graph import Node, Value
from atlasc.ir.ops import get

REDUCE_OPS = {
    "ReduceSum": "Sum", "ReduceMean": "Mean", "ReduceMax": "Max", "ReduceMin": "Min", "ReduceProd": "Prod",
    "ReduceSumSquare": "SumSquare", "ReduceL2": "L2",
}
ACC = {"float16": "float", "float32": "float", "float64": "double"}
FEW_ROWS = 128  # below this many rows (at the maxima), use a block per row even for outer-axis reductions
# ATLAS_NORM_VEC (default 1; 0 keeps norm_block for every normalization): the normalizations over the last axis of
# float16 / float32 rows take reduce.cu's norm_rows_vec where the rows are contiguous and 16-byte aligned (checked at
# run time; else norm_block): one 16-byte load per 8 values, the row kept in registers. At batch 32 an 8B
# AddRMSNormalization of 32 x 4096 (1 MB) took 15.2-15.8 us with norm_block, 6.1-6.3 with it; the 8-layer step 7% less
# (docs/perf.md v29).
NORM_VEC_ENV = "ATLAS_NORM_VEC"
# 16-byte pieces per thread (registers, the row held as float): rows up to 4 * 8 * 256 = 8192 float16 values (ptxas
# sm90: 5 or more spill at 255 registers with the residual add and LayerNorm)
NORM_VEC_MAX_VPT = 4


def acc_type(dtype: str) -> str:
    return ACC.get(dtype, "long long")


def float_literal(x: float, ctype: str = "float") -> str:
    """A C literal of type ctype ("float" or "double") for x (inf/nan included)."""
    x = float(x)
    if math.isnan(x):
        return f"static_cast<{ctype}>(NAN)"
    if math.isinf(x):
        return f"static_cast<{ctype}>({'-' if x < 0 else ''}INFINITY)"
    text = repr(x)
    return text + "f" if ctype == "float" else text


def subview(ctx: KernelContext, base: str, value: Value, dims, name: str) -> tuple[str, int]:
    """Declare `name`: the view `base` (of `value`) restricted to `dims` (in order); no dims: one
    element of stride 0. Returns (name, rank)."""
    dims = list(dims)
    t = c_type(value.dtype)
    r = max(len(dims), 1)
    ctx.lines.append(f"  atlas::View<{t}, {r}> {name}; {name}.p = {base}.p;")
    if not dims:
        ctx.lines.append(f"  {name}.shape[0] = 1; {name}.stride[0] = 0;")
    for i, d in enumerate(dims):
        ctx.lines.append(f"  {name}.shape[{i}] = {base}.shape[{d}]; {name}.stride[{i}] = {base}.stride[{d}];")
    return name, r


def null_view(ctx: KernelContext, ctype: str, rank: int, name: str) -> str:
    """An absent tensor: p == nullptr (device code checks)."""
    ctx.lines.append(f"  atlas::View<{ctype}, {rank}> {name}; {name}.p = nullptr;")
    ctx.lines.append(f"  for (int i = 0; i < {rank}; ++i) {{ {name}.shape[i] = 1; {name}.stride[i] = 0; }}")
    return name


def align_trailing(ctx: KernelContext, value: Value, target: str, target_dims: list, name: str) -> str:
    """Declare `name`: value broadcast (numpy rules, right-aligned) over the view `target`'s dims
    `target_dims`; broadcast dims get stride 0."""
    src = ctx.view(value, f"{name}_src") if value.shape else None
    r, k = max(len(target_dims), 1), len(value.shape)
    t = c_type(value.dtype)
    ctx.lines.append(f"  atlas::View<{t}, {r}> {name}; {name}.p = reinterpret_cast<{t}*>({ctx.address(value)});")
    if not target_dims:
        ctx.lines.append(f"  {name}.shape[0] = 1; {name}.stride[0] = 0;")
    for i, d in enumerate(target_dims):
        j = i - (len(target_dims) - k)
        if j < 0 or src is None or value.shape[j] == 1:
            stride = "0LL"
        else:
            stride = f"{src}.stride[{j}]"
        ctx.lines.append(f"  {name}.shape[{i}] = {target}.shape[{d}]; {name}.stride[{i}] = {stride};")
    return name


def block_size(n_upper: int, cap: int = 256) -> int:
    """Threads for a block that walks a row of at most n_upper elements: a multiple of 32."""
    return max(32, min(cap, (n_upper + 31) // 32 * 32))


def row_grid(rows_upper: int) -> tuple[int, int, int]:
    return (max(1, min(STRIDE_GRID, rows_upper)), 1, 1)


def _upper_prod(ctx: KernelContext, value: Value, dims) -> int:
    n = 1
    for d in dims:
        n *= ctx.upper(value.shape[d])
    return n


def _norm_axis(axis: int, rank: int, node: Node) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise CodegenError(f"{node.name}: axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _schedule(ctx: KernelContext, x: Value, kept: list, red: list) -> tuple[str, tuple, tuple]:
    """('block' | 'thread', grid, block) for rows over `kept` reducing `red`."""
    rows, n = _upper_prod(ctx, x, kept), _upper_prod(ctx, x, red)
    rank = len(x.shape)
    if (rank and rank - 1 in red) or rows < FEW_ROWS:
        return "block", row_grid(rows), (block_size(n), 1, 1)
    return "thread", ctx.grid_for(rows), (256, 1, 1)


@emitter(*REDUCE_OPS)
def emit_reduce(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    attrs = get(node.op).fill_attrs(node.attrs)
    rank = len(x.shape)
    axes = attrs["axes"]
    if axes is None or len(axes) == 0:
        red = [] if attrs["noop_with_empty_axes"] else list(range(rank))
    else:
        red = sorted({_norm_axis(a, rank, node) for a in axes})
    kept = [i for i in range(rank) if i not in red]
    ctx.view(x, "x")
    ctx.view(y, "y")
    subview(ctx, "x", x, kept, "xk")
    subview(ctx, "x", x, red, "xr")
    a = acc_type(x.dtype)
    mode, grid, block = _schedule(ctx, x, kept, red)
    body = f"  atlas::rd::reduce_{mode}<atlas::rd::{REDUCE_OPS[node.op]}<{a}>, {a}>(xk, xr, y);"
    return KernelCode(body, grid, block)


@emitter("ArgMax", "ArgMin")
def emit_arg(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    attrs = get(node.op).fill_attrs(node.attrs)
    rank = len(x.shape)
    if rank == 0:
        raise CodegenError(f"{node.name}: {node.op} of a scalar")
    axis = _norm_axis(attrs["axis"], rank, node)
    kept = [i for i in range(rank) if i != axis]
    ctx.view(x, "x")
    ctx.view(y, "y")
    subview(ctx, "x", x, kept, "xk")
    subview(ctx, "x", x, [axis], "xr")
    is_max = "true" if node.op == "ArgMax" else "false"
    last = "true" if attrs["select_last_index"] else "false"
    mode, grid, block = _schedule(ctx, x, kept, [axis])
    body = f"  atlas::rd::arg_{mode}<{is_max}, {last}, {acc_type(x.dtype)}>(xk, xr, y);"
    return KernelCode(body, grid, block)


@emitter("Softmax", "LogSoftmax")
def emit_softmax(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    if x.dtype not in ACC:
        raise CodegenError(f"{node.name}: {node.op} on {x.dtype}")
    attrs = get(node.op).fill_attrs(node.attrs)
    rank = len(x.shape)
    if rank == 0:
        raise CodegenError(f"{node.name}: {node.op} of a scalar")
    axis = _norm_axis(attrs["axis"], rank, node)
    kept = [i for i in range(rank) if i != axis]
    ctx.view(x, "x")
    ctx.view(y, "y")
    subview(ctx, "x", x, kept, "xk")
    subview(ctx, "x", x, [axis], "xr")
    subview(ctx, "y", y, kept, "yk")
    subview(ctx, "y", y, [axis], "yr")
    log = "true" if node.op == "LogSoftmax" else "false"
    mode, grid, block = _schedule(ctx, x, kept, [axis])
    body = f"  atlas::rd::softmax_{mode}<{log}, {ACC[x.dtype]}>(xk, xr, yk, yr);"
    return KernelCode(body, grid, block)


def _norm_axes(node: Node, x: Value) -> tuple[dict, list[int], list[int], str]:
    """(attrs, kept dims, normalized dims, accumulator type) of a normalization of x."""
    if x.dtype not in ACC:
        raise CodegenError(f"{node.name}: {node.op} on {x.dtype}")
    attrs = get(node.op).fill_attrs(node.attrs)
    rank = len(x.shape)
    if rank == 0:
        raise CodegenError(f"{node.name}: {node.op} of a scalar")
    axis = _norm_axis(attrs["axis"], rank, node)
    return attrs, list(range(axis)), list(range(axis, rank)), ACC[x.dtype]


def norm_vec_choice() -> bool:
    """ATLAS_NORM_VEC (default 1); CodegenError unless 0 or 1. Recorded in the artifact's codegen choices."""
    return env_switch(NORM_VEC_ENV, True, CodegenError)


def norm_vec_pieces(dtype: str, red: list, n_upper: int) -> int:
    """16-byte pieces per thread of norm_rows_vec for rows of at most n_upper `dtype` values normalized over the dims
    `red` (0: no vectorized path: ATLAS_NORM_VEC off, another dtype, more than one normalized dim, or rows too long)."""
    if not norm_vec_choice() or dtype not in ("float16", "float32") or len(red) != 1 or n_upper < 1:
        return 0
    per_piece = 16 // (2 if dtype == "float16" else 4)
    pieces = -(-n_upper // (per_piece * block_size(n_upper)))
    return pieces if pieces <= NORM_VEC_MAX_VPT else 0


@emitter("LayerNormalization", "RMSNormalization")
def emit_norm(ctx: KernelContext, node: Node) -> KernelCode:
    x, y = node.inputs[0], node.outputs[0]
    attrs, kept, red, a = _norm_axes(node, x)
    ctx.view(x, "x")
    ctx.view(y, "y")
    _, kr = subview(ctx, "x", x, kept, "xk")
    subview(ctx, "x", x, red, "xr")
    subview(ctx, "y", y, kept, "yk")
    subview(ctx, "y", y, red, "yr")
    rr = max(len(red), 1)
    align_trailing(ctx, node.inputs[1], "x", red, "scale")
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None:
        align_trailing(ctx, bias, "x", red, "bias")
    else:
        null_view(ctx, "float", rr, "bias")
    stats = node.op == "LayerNormalization" and len(node.outputs) > 1
    for k, name in ((1, "mean"), (2, "inv")):
        if k < len(node.outputs) and node.outputs[k] is not None:
            ctx.view(node.outputs[k], f"{name}_all")
            subview(ctx, f"{name}_all", node.outputs[k], kept, f"{name}_k")
        else:
            null_view(ctx, "float", kr, f"{name}_k")
    rms = "true" if node.op == "RMSNormalization" else "false"
    flags = f"{rms}, {'true' if bias is not None else 'false'}, {'true' if stats else 'false'}, {a}"
    eps = float_literal(attrs["epsilon"], a)
    body = f"  atlas::rd::norm_block<{flags}>(xk, xr, yk, yr, scale, bias, mean_k, inv_k, {eps});"
    rows, n = _upper_prod(ctx, x, kept), _upper_prod(ctx, x, red)
    vpt = norm_vec_pieces(x.dtype, red, n)
    if vpt:
        vec = f"{rms}, {'true' if bias is not None else 'false'}, {'true' if stats else 'false'}, false, {vpt}, {a}"
        body = "\n".join([
            f"  if (atlas::rd::norm_vec_rows(xk, xr, {vpt}) && atlas::rd::norm_vec_rows(yk, yr, {vpt}))",
            f"    atlas::rd::norm_rows_vec<{vec}>(xk, xk, xk, yk, scale, bias, mean_k, inv_k, xr.shape[0], {eps});",
            "  else",
            "  " + body])
    return KernelCode(body, row_grid(rows), (block_size(n), 1, 1))


@emitter("AddRMSNormalization", "AddLayerNormalization")
def emit_add_norm(ctx: KernelContext, node: Node) -> KernelCode:
    a, b, w = node.inputs[:3]
    bias = node.inputs[3] if len(node.inputs) > 3 else None
    rms = node.op == "AddRMSNormalization"
    y, s = node.outputs
    attrs, kept, red, acc = _norm_axes(node, a)
    for value, name in ((a, "a"), (b, "b"), (s, "s"), (y, "y")):
        ctx.view(value, name)
        subview(ctx, name, value, kept, f"{name}k")
        subview(ctx, name, value, red, f"{name}r")
    kr = max(len(kept), 1)
    rr = max(len(red), 1)
    align_trailing(ctx, w, "s", red, "scale")
    if bias is not None:
        align_trailing(ctx, bias, "s", red, "bias")
    else:
        null_view(ctx, "float", rr, "bias")
    null_view(ctx, "float", kr, "mean_k")
    null_view(ctx, "float", kr, "inv_k")
    eps = float_literal(attrs["epsilon"], acc)
    flags = f"{str(rms).lower()}, {str(bias is not None).lower()}, false, {acc}"
    generic = [
        f"  atlas::rd::add_rows<{acc}>(ak, ar, bk, br, sk, sr);",
        f"  atlas::rd::norm_block<{flags}>(sk, sr, yk, yr, scale, bias, mean_k, inv_k, {eps});",
    ]
    rows, n = _upper_prod(ctx, a, kept), _upper_prod(ctx, a, red)
    vpt = norm_vec_pieces(a.dtype, red, n)
    if vpt:
        ok = " && ".join(f"atlas::rd::norm_vec_rows({v}k, {v}r, {vpt})" for v in "absy")
        vec = f"{str(rms).lower()}, {str(bias is not None).lower()}, false, true, {vpt}, {acc}"
        call = f"atlas::rd::norm_rows_vec<{vec}>(ak, bk, sk, yk, scale, bias, mean_k, inv_k, ar.shape[0], {eps});"
        generic = [f"  if ({ok})", f"    {call}", "  else {", *["  " + line for line in generic], "  }"]
    return KernelCode("\n".join(generic), row_grid(rows), (block_size(n), 1, 1))
