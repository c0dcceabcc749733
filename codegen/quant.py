"""LinearQ8 / LinearQ4: weight-only quantized projections (quant.cu).

The emitter binds x and y as Views of their own rank (leading dims flatten to M rows), the packed
weight and the float16 scales as contiguous arena buffers, and the optional bias [N]. One warp per
output feature; see quant.cu for the numerics. Correct for any M (rows are processed 4 at a time);
tuned paths (dp4a W4A8, tensor cores for prefill) are future work.
"""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import MAX_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.ir.graph import Node

THREADS = 256  # QLIN_THREADS in quant.cu
WARPS = THREADS // 32


@emitter("LinearQ8", "LinearQ4")
def emit_linear_quant(ctx: KernelContext, node: Node) -> KernelCode:
    x_v, wq_v, s_v = node.inputs[0], node.inputs[1], node.inputs[2]
    b_v = node.inputs[3] if len(node.inputs) > 3 else None
    y_v = node.outputs[0]
    dt = x_v.dtype
    if dt not in ("float32", "float16"):
        raise CodegenError(f"{node.name}: {node.op} on {dt} has no CUDA kernel (supported: float32, float16)")
    for v in (wq_v, s_v):
        if ctx.plan.placement(v).strides is not None:
            raise CodegenError(f"{node.name}: {node.op} needs contiguous {v.name}, it is a strided view")
    bits = 8 if node.op == "LinearQ8" else 4
    t = c_type(dt)
    r = len(x_v.shape)
    ctx.view(x_v, "x")
    ctx.view(y_v, "y", rank=r)
    n_c = ctx.dim(wq_v.shape[0])
    k_c = ctx.dim(wq_v.shape[1]) if bits == 8 else f"(2LL * ({ctx.dim(wq_v.shape[1])}))"
    group = 0 if bits == 8 else int(node.attrs["group_size"])
    ctx.lines.append(f"  const unsigned char* wq = reinterpret_cast<const unsigned char*>({ctx.address(wq_v)});")
    ctx.lines.append(f"  const __half* wscale = reinterpret_cast<const __half*>({ctx.address(s_v)});")
    if b_v is not None:
        b = ctx.view(b_v, "bias_v", rank=1)
        ctx.lines.append(f"  const {t}* bias = {b}.p; const long long bias_stride = {b}.stride[0];")
    else:
        ctx.lines.append(f"  const {t}* bias = nullptr; const long long bias_stride = 0;")
    lines = [
        f"  const long long N = {n_c}, K = {k_c};",
        "  long long M = 1;",
        *[f"  M *= x.shape[{i}];" for i in range(r - 1)],
        f"  atlas::linear_quant<{t}, {r}, {bits}, {str(b_v is not None).lower()}>("
        f"x, wq, wscale, bias, bias_stride, y, M, N, K, {group}LL);",
    ]
    blocks = -(-ctx.upper(wq_v.shape[0]) // WARPS)
    return KernelCode("\n".join(lines), (max(1, min(MAX_GRID, blocks)), 1, 1), (THREADS, 1, 1))
