"""FusedElementwise: one thread per output element (grid-stride), the program's steps in registers.

Each external input is read through a View aligned to the output's rank (broadcast dims stride 0,
as in elementwise.py; a sliced input keeps its strides and starts at its slice); the steps are a
straight line of C statements using elementwise.py's per-op expressions, each in its own scope with
`x0..` bound to its operands and `CT` to its result's compute type. Numerics match the unfused kernels:
- a float16 step result is rounded to float16 (atlas::round_f16) where the unfused graph stored it;
- float Add/Sub/Mul/Div use the `__f*_rn` intrinsics, which nvcc never contracts into an FMA with a
  neighbouring step (the unfused kernels round every step to memory; an FMA would not).
Helpers live in fused.cu.
"""

from __future__ import annotations

from atlasc.codegen.cexpr import compute_type
from atlasc.codegen.elementwise import _align, _expr
from atlasc.codegen.generate import CodegenError, KernelCode, KernelContext, emitter
from atlasc.errors import AtlasError
from atlasc.ir.graph import Node, Value
from atlasc.ir.ops import TensorType
from atlasc.ir.ops.fused import sliced_types, step_types

# float arithmetic that must not be contracted across steps (float16 computes in float too)
NO_CONTRACT = {
    "float": {"Add": "__fadd_rn(x0, x1)", "Sub": "__fsub_rn(x0, x1)", "Mul": "__fmul_rn(x0, x1)",
              "Div": "__fdiv_rn(x0, x1)"},
}


def step_expr(node: Node, k: int, op: str, attrs: dict, in_dtypes: list, out_dtype: str) -> str:
    """The C expression of one step over x0.. (elementwise.py's, with the no-contraction overrides)."""
    ins = [None if dt is None else Value(f"x{i}", dt, ()) for i, dt in enumerate(in_dtypes)]
    probe = Node(op, ins, [Value("y", out_dtype, ())], attrs, name=f"{node.name} step {k}")
    expr = _expr(probe)
    ct = compute_type(in_dtypes[0]) if in_dtypes and in_dtypes[0] else None
    return NO_CONTRACT.get(ct, {}).get(op, expr)


def fused_lines(node: Node, program, in_dtypes: list[str], step_dtypes: list[str], indent: str) -> list[str]:
    """Statements computing every step `t<k>` from the loaded external inputs `a<i>`."""
    lines = []
    for k, ((op, attrs, refs), dt) in enumerate(zip(program, step_dtypes)):
        ct = compute_type(dt)
        binds, dts = [], []
        for i, r in enumerate(refs):
            if r is None:
                dts.append(None)
                continue
            src_dt = in_dtypes[r[1]] if r[0] == "in" else step_dtypes[r[1]]
            src = f"a{r[1]}" if r[0] == "in" else f"t{r[1]}"
            dts.append(src_dt)
            binds.append(f"const {compute_type(src_dt)} x{i} = {src};")
        expr = step_expr(node, k, op, dict(attrs), dts, dt)
        value = f"static_cast<CT>({expr})"
        if dt == "float16":
            value = f"atlas::round_f16({value})"
        lines.append(f"{indent}{ct} t{k};  // {op}")
        lines.append(f"{indent}{{ typedef {ct} CT; (void)sizeof(CT); {' '.join(binds)} t{k} = {value}; }}")
    return lines


@emitter("FusedElementwise")
def emit_fused(ctx: KernelContext, node: Node) -> KernelCode:
    out_v = node.outputs[0]
    program = node.attrs["program"]
    try:
        slices = node.attrs.get("slices") or ()
        steps = step_types(sliced_types([TensorType(v.dtype, v.shape) for v in node.inputs], slices), program)
    except AtlasError as e:
        raise CodegenError(f"{node.name}: {e.message}") from None
    out = ctx.view(out_v, "out")
    names = [_align(ctx, v, out_v, f"in{k}") for k, v in enumerate(node.inputs)]
    for name, sl in zip(names, slices):
        if sl is not None:  # a last-axis slice: same strides, the start offset added
            ctx.lines.append(f"  {name}.p += {int(sl[0])}LL * {name}_src.stride[{len(out_v.shape) - 1}];")
    in_dtypes = [v.dtype for v in node.inputs]
    rank = len(out_v.shape) or 1
    offs = "".join(f" o{k} += c[k] * {v}.stride[k];" for k, v in enumerate(names))
    decl = ", ".join([f"o{k} = 0" for k in range(len(names))] + ["oo = 0"])
    loads = [f"    const {compute_type(dt)} a{k} = atlas::load({v}.p + o{k});"
             for k, (v, dt) in enumerate(zip(names, in_dtypes))]
    body = "\n".join([
        f"  const long long n = {out}.numel();",
        "  for (long long i = atlas::global_thread(); i < n; i += atlas::global_threads()) {",
        f"    long long c[{rank}]; atlas::unravel<{rank}>(i, {out}.shape, c);",
        f"    long long {decl};",
        f"    for (int k = 0; k < {rank}; ++k) {{{offs} oo += c[k] * {out}.stride[k]; }}",
        *loads,
        *fused_lines(node, program, in_dtypes, [t.dtype for t in steps], "    "),
        f"    atlas::store({out}.p + oo, t{len(program) - 1});",
        "  }",
    ])
    return KernelCode(body, ctx.grid_for(ctx.numel_upper(out_v)))
