"""LinearGated and LinearRotary: linear.cu's decode paths (MMA decode, M <= 32) reading x from its View, with
the paired epilogue NormLinear uses (linear_prologue.py) instead of storing the projection's output:

- LinearGated: LinGated, the elementwise program (SwiGLU) over weight rows j and H + j, y [.., H];
- LinearRotary: LinRotary, the rotary over the q and k heads' row pairs and the KV-cache append (q to its
  output, k and v into the layer's cache views).

Each output pair is computed once, by the block that holds both of its weight rows (the MMA decode at FT 1).
Where the MMA decode cannot run (x rows not 16-byte aligned with unit stride along K; fuse-linear-epilogue makes
these ops only for float16 on sm80+), the paired GEMV runs one row at a time (LinRowsFrom): a paired GEMV over 16
or 32 rows holds 2 x 32 sums per lane (244 registers for the rotary kernel on sm90, where the MMA decode alone needs
70), and chunks of 8 or 4 rows still spilled 8-44 bytes beside the MMA decode at J = 4 (ptxas sm80 / sm90, which
chose 64-128 registers). A fallback, not a path: the compiler's plans keep x rows aligned.
"""

from __future__ import annotations

from atlasc.codegen import linear_tma
from atlasc.codegen.generate import MAX_GRID, KernelCode, KernelContext, emitter, weight_prefetch
from atlasc.codegen.linear import GEMV_CONFIG, GEMV_MAX_M, THREADS, decode_calls, decode_grid
from atlasc.codegen.linear_prologue import decode_head, gated_epilogue, rotary_epilogue
from atlasc.ir.graph import Node

GEMV_ROWS = 1  # the paired GEMV's rows per call in the fallback (see the module docstring)


def _chunked_gemv(t: str, r: int, has_bias: str) -> str:
    """The fallback: the paired GEMV over rows m0 .. m0 + GEMV_ROWS - 1 for m0 = 0, GEMV_ROWS, .. (each chunk reads
    the weights: x rows the MMA decode cannot read are not what the compiler's plans make)."""
    f, u = GEMV_CONFIG[GEMV_ROWS]
    return (f"for (long long m0 = 0; m0 < M; m0 += {GEMV_ROWS}) {{\n"
            f"    const atlas::XView<{t}> xc{{x.p, lin_xoff + m0, x.stride[{r - 1}]}};\n"
            f"    atlas::linear_gemv<{t}, {r}, {GEMV_ROWS}, 2, {u}, {has_bias}>(xc, w, bias, bias_stride, y, "
            f"M - m0 < {GEMV_ROWS} ? M - m0 : {GEMV_ROWS}, N, K, lin_yoff + m0, vec, "
            f"atlas::LinRowsFrom<decltype(lin_epi)>{{lin_epi, m0}});\n"
            "  }")


@emitter("LinearGated", "LinearRotary")
def emit_linear_epilogue(ctx: KernelContext, node: Node) -> KernelCode:
    tma = linear_tma.try_emit(ctx, node)  # an sm90-only compile's copy-engine path (linear_tma.py)
    if tma is not None:
        return tma
    x_v = node.inputs[0]
    rotary = node.op == "LinearRotary"
    proj = [v for v in node.inputs[3 if rotary else 1:] if v is not None]  # w[, bias]
    w_v, bias_v = proj[0], (proj[1] if len(proj) > 1 else None)
    # rotary: y is rows only (the epilogue writes q and the cache)
    t, r, variants, runs, has_bias, _ = decode_head(ctx, node, x_v.shape, x_v.dtype, w_v, bias_v,
                                                    None if rotary else node.outputs[0])
    ctx.view(x_v, "x", rank=r)
    ctx.lines += [
        f"  __shared__ long long lin_xoff[{GEMV_MAX_M}];",
        "  atlas::lin_offsets(x, M, lin_xoff);",
        "  __syncthreads();",
        f"  const bool vec = K % atlas::LinVec<{t}>::N == 0 && atlas::lin_vec_rows(x) && "
        "reinterpret_cast<uintptr_t>(w) % 16 == 0;",
        f"  const atlas::XView<{t}> xs{{x.p, lin_xoff, x.stride[{r - 1}]}};",
    ]
    if rotary:
        rotary_epilogue(ctx, node, x_v.dtype, node.inputs[1], node.inputs[2])
    else:
        gated_epilogue(ctx, node, x_v.dtype)
    if runs:
        ctx.lines.append(f"  const bool mma = atlas::lin_mma_ok<{t}, {r}>(x, w, K);")
    small = [mt for mt in variants if mt <= GEMV_ROWS]  # GEMVs for the buckets no MMA run serves, then the chunks
    calls = decode_calls(t, r, small, runs, has_bias, prefix="  ", src="xs", epi="lin_epi",
                         fallback=_chunked_gemv(t, r, has_bias))
    blocks = decode_grid(ctx.upper(w_v.shape[0]), variants, runs, w_v.shape[0], paired=True)
    return KernelCode("\n".join(calls), (max(1, min(MAX_GRID, blocks)), 1, 1), (THREADS, 1, 1),
                      prefetch=weight_prefetch(ctx, *proj))
