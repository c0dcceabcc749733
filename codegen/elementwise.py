"""Elementwise and pure data-movement kernels: one thread per output element, grid-stride.

Every op here is `out[c] = f(in_0[map_0(c)], in_1[map_1(c)], ...)` for output coordinates c, where
map_k is a strided view: numpy broadcasting (stride 0), Transpose (permuted strides), Slice (start
offset, strides times steps), Expand. Reshape-like ops (Reshape, Flatten, Squeeze, Unsqueeze,
Identity) instead map the output's row-major flat index onto the input's own shape, so they also
read non-contiguous inputs (a KV-cache view) correctly. Device helpers live in elementwise.cu.
"""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type, compute_type
from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext, emitter
from atlasc.ir.graph import Node, Value

FLOAT_UNARY = {
    "Sqrt": "sqrtf(x0)", "Reciprocal": "1.0f / x0", "Exp": "expf(x0)", "Log": "logf(x0)", "Tanh": "tanhf(x0)",
    "Sigmoid": "1.0f / (1.0f + expf(-x0))", "Erf": "erff(x0)", "Cos": "cosf(x0)", "Sin": "sinf(x0)",
    "Floor": "floorf(x0)", "Ceil": "ceilf(x0)", "Softplus": "(fmaxf(x0, 0.0f) + log1pf(expf(-fabsf(x0))))",
    "IsNaN": "isnan(x0)", "IsInf": "isinf(x0)",
}
DOUBLE_UNARY = {k: v.replace("f(", "(").replace("1.0f", "1.0").replace("0.0f", "0.0") for k, v in FLOAT_UNARY.items()}
ANY_UNARY = {
    "Neg": "-x0", "Abs": "(x0 < 0 ? -x0 : x0)", "Relu": "(x0 > 0 ? x0 : 0)", "Identity": "x0",
    "Sign": "(CT)((x0 > 0) - (x0 < 0))", "Not": "!x0",
}
BINARY = {
    "Add": "x0 + x1", "Sub": "x0 - x1", "Mul": "x0 * x1", "Div": "x0 / x1",
    "Equal": "x0 == x1", "Less": "x0 < x1", "LessOrEqual": "x0 <= x1", "Greater": "x0 > x1",
    "GreaterOrEqual": "x0 >= x1", "And": "x0 && x1", "Or": "x0 || x1", "Xor": "x0 != x1",
}
VARIADIC = {"Max": "atlas::vmax", "Min": "atlas::vmin", "Sum": "atlas::vadd"}
RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _align(ctx: KernelContext, value: Value, out: Value, name: str) -> str:
    """Declare value as a View over out's rank, broadcast dims given stride 0."""
    src = ctx.view(value, f"{name}_src") if value.shape else None
    r, k = len(out.shape) or 1, len(value.shape)
    t = c_type(value.dtype)
    ctx.lines.append(f"  atlas::View<{t}, {r}> {name};")
    ctx.lines.append(f"  {name}.p = reinterpret_cast<{t}*>({ctx.address(value)});")
    for i in range(r):
        j = i - (r - k)
        out_dim = ctx.dim(out.shape[i]) if out.shape else "1LL"
        ctx.lines.append(f"  {name}.shape[{i}] = {out_dim};")
        if j < 0 or src is None:
            stride = "0LL"
        elif value.shape[j] == 1 and out.shape[i] != 1:
            stride = "0LL"
        else:
            stride = f"{src}.stride[{j}]"
        ctx.lines.append(f"  {name}.stride[{i}] = {stride};")
    return name


def _map_body(ctx: KernelContext, out: str, ins: list[str], rank: int, expr: str, in_types, out_type) -> str:
    loads = [f"    const {compute_type(t)} x{k} = atlas::load({v}.p + o{k});"
             for k, (v, t) in enumerate(zip(ins, in_types))]
    offs = "".join(f" o{k} += c[k] * {v}.stride[k];" for k, v in enumerate(ins))
    decl = ", ".join([f"o{k} = 0" for k in range(len(ins))] + ["oo = 0"])
    ct = compute_type(out_type)
    return "\n".join([
        f"  typedef {ct} CT; (void)sizeof(CT);",
        f"  const long long n = {out}.numel();",
        "  for (long long i = atlas::global_thread(); i < n; i += atlas::global_threads()) {",
        f"    long long c[{rank}]; atlas::unravel<{rank}>(i, {out}.shape, c);",
        f"    long long {decl};",
        f"    for (int k = 0; k < {rank}; ++k) {{{offs} oo += c[k] * {out}.stride[k]; }}",
        *loads,
        f"    atlas::store({out}.p + oo, static_cast<CT>({expr}));",
        "  }",
    ])


def _out_view(ctx: KernelContext, node: Node) -> str:
    return ctx.view(node.outputs[0], "out")


def _expr(node: Node) -> str:
    op, dt = node.op, node.inputs[0].dtype
    if op in FLOAT_UNARY:
        if dt not in ("float32", "float16", "float64"):
            raise CodegenError(f"{node.name}: {op} on {dt}")
        return DOUBLE_UNARY[op] if dt == "float64" else FLOAT_UNARY[op]
    if op in ANY_UNARY:
        return ANY_UNARY[op]
    if op in BINARY:
        return BINARY[op]
    if op == "Pow":
        return "(CT)pow((double)x0, (double)x1)" if dt not in ("float32", "float16") else "powf(x0, (float)x1)"
    if op == "Mod":
        if node.attrs.get("fmod", 0):
            return "fmod((double)x0, (double)x1)"
        return "atlas::pymod(x0, x1)"
    if op == "Where":
        return "(x0 ? x1 : x2)"
    if op == "Cast":
        return f"atlas::cast_to<{compute_type(node.attrs['to'])}>(x0)"
    if op == "Gelu":
        if node.attrs.get("approximate", "none") == "tanh":
            return "(0.5f * x0 * (1.0f + tanhf(0.7978845608028654f * (x0 + 0.044715f * x0 * x0 * x0))))"
        return "(0.5f * x0 * (1.0f + erff(x0 * 0.7071067811865476f)))"
    if op == "Clip":
        e = "x0"
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            e = f"atlas::vmax({e}, x1)"
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            e = f"atlas::vmin({e}, x2)"
        return e
    if op in VARIADIC:
        e = "x0"
        for k in range(1, len(node.inputs)):
            e = f"{VARIADIC[op]}({e}, x{k})"
        return e
    raise CodegenError(f"{node.name}: no elementwise expression for {op}")


ELEMENTWISE_OPS = (*FLOAT_UNARY, *ANY_UNARY, *BINARY, "Pow", "Mod", "Where", "Cast", "Gelu", "Clip", *VARIADIC)


@emitter(*ELEMENTWISE_OPS)
def emit_elementwise(ctx: KernelContext, node: Node) -> KernelCode:
    out_v = node.outputs[0]
    out = _out_view(ctx, node)
    present = [(k, v) for k, v in enumerate(node.inputs) if v is not None]
    # Clip's optional inputs keep their positions (x1 = min, x2 = max)
    names = []
    types = []
    for k, v in present:
        names.append(_align(ctx, v, out_v, f"in{k}"))
        types.append(v.dtype)
    expr = _expr(node)
    if node.op == "Clip":
        for pos, (k, _) in enumerate(present):
            expr = expr.replace(f"x{k}", f"X{pos}")
        expr = expr.replace("X", "x")
    rank = len(out_v.shape) or 1
    body = _map_body(ctx, out, names, rank, expr, types, out_v.dtype)
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(out_v)))


@emitter("Expand")
def emit_expand(ctx: KernelContext, node: Node) -> KernelCode:
    out_v = node.outputs[0]
    out = _out_view(ctx, node)
    src = _align(ctx, node.inputs[0], out_v, "in0")
    rank = len(out_v.shape) or 1
    return KernelCode(_map_body(ctx, out, [src], rank, "x0", [node.inputs[0].dtype], out_v.dtype),
                      ctx.grid_for(ctx.numel_upper(out_v)))


@emitter("Transpose")
def emit_transpose(ctx: KernelContext, node: Node) -> KernelCode:
    x, out_v = node.inputs[0], node.outputs[0]
    perm = node.attrs.get("perm") or tuple(reversed(range(len(x.shape))))
    out = _out_view(ctx, node)
    ctx.view(x, "src")
    r = len(out_v.shape) or 1
    t = c_type(x.dtype)
    ctx.lines.append(f"  atlas::View<{t}, {r}> in0; in0.p = src.p;")
    for i, p in enumerate(perm):
        ctx.lines.append(f"  in0.shape[{i}] = src.shape[{p}]; in0.stride[{i}] = src.stride[{p}];")
    return KernelCode(_map_body(ctx, out, ["in0"], r, "x0", [x.dtype], out_v.dtype),
                      ctx.grid_for(ctx.numel_upper(out_v)))


@emitter("Slice")
def emit_slice(ctx: KernelContext, node: Node) -> KernelCode:
    x, out_v = node.inputs[0], node.outputs[0]
    out = _out_view(ctx, node)
    ctx.view(x, "src")
    r = len(out_v.shape)
    t = c_type(x.dtype)
    ctx.lines.append(f"  atlas::View<{t}, {r}> in0; in0.p = src.p;")
    steps = {a % r: (s, st) for s, a, st in zip(node.attrs["starts"], node.attrs["axes"], node.attrs["steps"])}
    for i in range(r):
        start, step = steps.get(i, (0, 1))
        ctx.lines.append(f"  in0.p += {ctx.dim(start)} * src.stride[{i}];")
        ctx.lines.append(f"  in0.shape[{i}] = out.shape[{i}]; in0.stride[{i}] = src.stride[{i}] * {step}LL;")
    return KernelCode(_map_body(ctx, out, ["in0"], r, "x0", [x.dtype], out_v.dtype),
                      ctx.grid_for(ctx.numel_upper(out_v)))


@emitter(*RESHAPES)
def emit_reshape(ctx: KernelContext, node: Node) -> KernelCode:
    x, out_v = node.inputs[0], node.outputs[0]
    out = _out_view(ctx, node)
    src = ctx.view(x, "src")
    ct = compute_type(out_v.dtype)
    body = "\n".join([
        f"  const long long n = {out}.numel();",
        "  for (long long i = atlas::global_thread(); i < n; i += atlas::global_threads()) {",
        f"    const {ct} x0 = atlas::load({src}.at_flat(i));",
        f"    atlas::store({out}.at_flat(i), x0);",
        "  }",
    ])
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(out_v)))
