"""The Sample kernel: next-token selection on the device (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.ir.graph import Node


@emitter("Sample")
def emit_sample(ctx: KernelContext, node: Node) -> KernelCode:
    logits, fparams, iparams = node.inputs
    if ctx.plan.placement(logits).strides is not None:
        raise CodegenError(f"{node.name}: Sample needs contiguous logits")
    ctx.view(logits, "logits", rank=3)
    ctx.view(fparams, "fp", rank=1)
    ctx.view(iparams, "ip", rank=1)
    ctx.view(node.outputs[0], "out", rank=1)
    body = "\n".join([
        "  const float temperature = fp.p[0], top_p = fp.p[1];",
        "  const long long seed = ip.p[0], step = ip.p[1], top_k = ip.p[2];",
        f"  atlas::smp::sample_rows<{c_type(logits.dtype)}>(logits, temperature, top_p, seed, step, top_k, out);",
    ])
    rows = max(1, ctx.upper(logits.shape[0]))
    return KernelCode(body, (min(rows, STRIDE_GRID), 1, 1), (1024, 1, 1))
