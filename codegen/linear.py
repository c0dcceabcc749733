"""Linear: the decode GEMV / skinny GEMM and the prefill tiled path of linear.cu.

The emitter binds x and y as Views of their own rank (leading dims flatten to M rows), w [N, K] as
a contiguous constant and the optional bias [N]. The kernel picks its path from M at run time: the
GEMV variants with MT = 1, 2, 4, ... (the smallest power of two >= M) up to the next power of two of
M's compile-time maximum (at most 32), and the tiled path (matmul.cu) only when M may exceed 32.
Emitting only the variants M can reach keeps the decode kernel's register count (the maximum over
its variants: it sets the occupancy) that of the small ones.

GEMV_CONFIG maps MT to (F features per warp, U 16-byte loads in flight per lane and row); the kernel
lab (examples/kernel_lab.py) times alternatives by replacing it.
"""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import MAX_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.codegen.matmul import TILE
from atlasc.ir.graph import Node

THREADS = 256  # LIN_THREADS in linear.cu (also matmul_tiled's block)
WARPS = THREADS // 32
GEMV_MAX_M = 32
# chosen from ptxas reports (sm90, fp16, K=4096): registers of the kernel with variants up to MT are
# 62 (MT 1), 66 (2), 78 (4), 78 (8), 80 (16), 128 + 32 bytes of spills (32): larger F or U for MT >= 4
# hoists more x loads than the register file holds
GEMV_CONFIG: dict[int, tuple[int, int]] = {1: (2, 4), 2: (2, 4), 4: (1, 4), 8: (1, 2), 16: (1, 1), 32: (1, 1)}


def gemv_variants(m_upper: int) -> list[int]:
    """The MT values compiled for rows up to m_upper: powers of two through min(32, next_pow2(m_upper))."""
    out, mt = [], 1
    while True:
        out.append(mt)
        if mt >= min(m_upper, GEMV_MAX_M):
            return out
        mt *= 2


@emitter("Linear")
def emit_linear(ctx: KernelContext, node: Node) -> KernelCode:
    x_v, w_v = node.inputs[0], node.inputs[1]
    b_v = node.inputs[2] if len(node.inputs) > 2 else None
    y_v = node.outputs[0]
    dt = x_v.dtype
    if dt not in ("float32", "float16"):
        raise CodegenError(f"{node.name}: Linear on {dt} has no CUDA kernel (supported: float32, float16)")
    if ctx.plan.placement(w_v).strides is not None:
        raise CodegenError(f"{node.name}: Linear needs a contiguous weight, {w_v.name} is a strided view")
    t = c_type(dt)
    r = len(x_v.shape)
    ctx.view(x_v, "x")
    ctx.view(y_v, "y", rank=r)
    n_c, k_c = ctx.dim(w_v.shape[0]), ctx.dim(w_v.shape[1])
    ctx.lines.append(f"  const {t}* w = reinterpret_cast<const {t}*>({ctx.address(w_v)});")
    if b_v is not None:
        b = ctx.view(b_v, "bias_v", rank=1)
        ctx.lines.append(f"  const {t}* bias = {b}.p; const long long bias_stride = {b}.stride[0];")
    else:
        ctx.lines.append(f"  const {t}* bias = nullptr; const long long bias_stride = 0;")
    has_bias = str(b_v is not None).lower()
    m_upper = 1
    for d in x_v.shape[:-1]:
        m_upper *= ctx.upper(d)
    variants = gemv_variants(m_upper)
    tiled = r >= 2 and m_upper > GEMV_MAX_M
    lines = [
        f"  const long long N = {n_c}, K = {k_c};",
        "  long long M = 1;",
        *[f"  M *= x.shape[{i}];" for i in range(r - 1)],
        f"  __shared__ long long lin_xoff[{GEMV_MAX_M}], lin_yoff[{GEMV_MAX_M}];",
        f"  if (M <= {min(variants[-1], GEMV_MAX_M)}) {{",
        f"    const bool vec = atlas::linear_gemv_setup<{t}, {r}>(x, w, y, M, K, lin_xoff, lin_yoff);",
    ]
    for i, mt in enumerate(variants):
        f, u = GEMV_CONFIG[mt]
        cond = "" if i == len(variants) - 1 else f"if (M <= {mt}) "
        prefix = "    " if i == 0 else "    else "
        lines.append(f"{prefix}{cond}atlas::linear_gemv<{t}, {r}, {mt}, {f}, {u}, {has_bias}>("
                     "x, w, bias, bias_stride, y, M, N, K, lin_xoff, lin_yoff, vec);")
    lines.append("  }")
    if tiled:
        lines.append(f"  else atlas::linear_tiled<{t}, {r}, {has_bias}>(x, w, bias, bias_stride, y, N, K);")
    n_upper = ctx.upper(w_v.shape[0])
    f_min = min(GEMV_CONFIG[mt][0] for mt in variants)
    blocks = -(-n_upper // (WARPS * f_min))
    if tiled:
        batch = 1
        for d in y_v.shape[:-2]:
            batch *= ctx.upper(d)
        blocks = max(blocks, batch * -(-ctx.upper(y_v.shape[-2]) // TILE) * -(-n_upper // TILE))
    grid = (max(1, min(MAX_GRID, blocks)), 1, 1)
    return KernelCode("\n".join(lines), grid, (THREADS, 1, 1))
