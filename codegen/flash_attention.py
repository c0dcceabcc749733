"""FlashAttention-2-style prefill attention (device code in flash_attention.cu), on by default.

ATLAS_ATTENTION_PREFILL=fa2 (the default; "off" keeps today's kernels, attention.py, everywhere) gives
prefill-sized Attention nodes (query rows up to at least FA2_MIN_ROWS) `attention_fa2`: tensor-core tiles
(mma.sync m16n8k16, sm80+; sm < 80 and layouts it cannot read run attention_rows at run time).
`fa2_decline` names why a node keeps today's kernel: float32, softcap, present / qk outputs, a head dim
other than 16, 32, 64, 128 (Dk == Dv), symbolic or uneven head counts, a non-unit head-dim stride, too
few query rows. Measured on the H200 (docs/perf.md v10, `examples/attention_lab.py --prefill`): 5-9x
faster than the default path at 512-4096 causal keys (32-59 TFLOP/s at D = 128), GPU-validated by
tests/test_kernels_matmul_attention_gpu.py::test_attention_fa2 and tests/test_gpu_opt_in_paths.py.

Tiles (recorded per kernel in the artifact's report, codegen `kernels`): BC = 64 keys per step, NW warps
of 16 query rows each (BR = 16 NW rows per block): 4 for 64 rows or more, fewer for shorter maxima;
ATLAS_ATTENTION_FA2_WARPS (1, 2, 4, 8) overrides for timing. The same tiles on every arch (mma.sync on
sm80 and sm90 alike), where they fit the shared memory of the compile's smallest arch (atlasc/ir/archs.py:
D = 128 takes 68 KB, more than sm75's 64 KB per block, so an sm75 build keeps today's kernel). Any other
value of ATLAS_ATTENTION_PREFILL is a CodegenError.
"""

from __future__ import annotations

import os

from atlasc.codegen.generate import STRIDE_GRID, CodegenError, KernelCode, KernelContext
from atlasc.ir import symbolic as S
from atlasc.ir.archs import max_dynamic_smem
from atlasc.ir.graph import Node, Value

PREFILL_ENV = "ATLAS_ATTENTION_PREFILL"
PREFILL_PATHS = ("fa2", "off")
WARPS_ENV = "ATLAS_ATTENTION_FA2_WARPS"
FA2_BC = 64  # keys per tile (FA2_BC of flash_attention.cu)
FA2_MIN_ROWS = 16  # query rows (upper bound) from which a node counts as prefill
FA2_HEAD_DIMS = (16, 32, 64, 128)


def prefill_choice() -> str:
    """ATLAS_ATTENTION_PREFILL ("fa2" when unset, or "off"); CodegenError for anything else."""
    value = os.environ.get(PREFILL_ENV, "") or "fa2"
    if value not in PREFILL_PATHS:
        raise CodegenError(f"{PREFILL_ENV}={value!r} is not a prefill attention path (expected fa2 or off)")
    return value


def warps_override() -> int | None:
    text = os.environ.get(WARPS_ENV, "")
    if not text:
        return None
    if text not in ("1", "2", "4", "8"):
        raise CodegenError(f"{WARPS_ENV}={text!r} is not a warp count (expected 1, 2, 4 or 8)")
    return int(text)


def fa2_warps(rows_up: int) -> int:
    """NW: warps of 16 query rows per block; 4 (64 rows) from 64 rows on, fewer below."""
    forced = warps_override()
    if forced:
        return forced
    nw = 1
    while nw < 4 and 16 * nw < rows_up:
        nw *= 2
    return nw


def fa2_smem(d: int, nw: int) -> int:
    """Bytes of shared memory: two stages of K and V tiles [FA2_BC][d + 8] fp16, or attention_rows'
    (the run-time fallback) with nw warps, whichever is larger."""
    return max(2 * 2 * FA2_BC * (d + 8) * 2, 4 * (((d + 3) // 4) * 4 + nw * (d + 2)))


def record() -> dict:
    """What codegen_choices records of this path: its choice, and fa2's tiles when it is on."""
    if prefill_choice() == "off":
        return {"attention_prefill": "off"}
    return {"attention_prefill": "fa2", "attention_fa2": {"bc": FA2_BC, "min_rows": FA2_MIN_ROWS,
                                                           "warps": warps_override() or "auto"}}


def _static_int(d) -> int | None:
    return None if S.is_symbolic(d) else int(d)


def _placed(ctx: KernelContext, value: Value | None) -> bool:
    return value is not None and value.name in ctx.plan.placements


def _unit_last_stride(ctx: KernelContext, value: Value) -> bool:
    strides = ctx.plan.placement(value).strides
    return strides is None or (len(strides) > 0 and _static_int(strides[-1]) == 1)


def _geometry(node: Node) -> tuple[int | None, int | None, object, object, object]:
    """(q heads, kv heads, Dk, Dv, query rows) of an Attention node, rank 3 or 4."""
    q_v, k_v, v_v = node.inputs[:3]
    if len(q_v.shape) == 3:
        hq, hk = int(node.attrs.get("q_num_heads", 0) or 0), int(node.attrs.get("kv_num_heads", 0) or 0)
        if not hq or not hk:
            return None, None, None, None, q_v.shape[1]
        return hq, hk, S.floordiv(k_v.shape[2], hk), S.floordiv(v_v.shape[2], hk), q_v.shape[1]
    return _static_int(q_v.shape[1]), _static_int(k_v.shape[1]), k_v.shape[3], v_v.shape[3], q_v.shape[2]


def fa2_decline(ctx: KernelContext, node: Node) -> str | None:
    """Why attention_fa2 does not serve this node (None: it does)."""
    ins = list(node.inputs) + [None] * (6 - len(node.inputs))
    q_v, k_v, v_v, _mask_v, pk_v, pv_v = ins[:6]
    if q_v.dtype != "float16":
        return f"{q_v.dtype} (float16 only)"
    if (node.attrs.get("softcap", 0.0) or 0.0) > 0:
        return "softcap"
    if any(_placed(ctx, o) for o in list(node.outputs)[1:]):
        return "present or qk outputs"
    hq, hk, dk, dv, sq = _geometry(node)
    if hq is None or hk is None or hk <= 0 or hq % hk:
        return "head counts (static, q heads a multiple of kv heads)"
    d, d_v = _static_int(dk), _static_int(dv)
    if d is None or d != d_v or d not in FA2_HEAD_DIMS:
        return f"head dims {dk} / {dv} (equal, one of {', '.join(map(str, FA2_HEAD_DIMS))})"
    rows = ctx.upper(sq)
    if rows < FA2_MIN_ROWS:
        return f"{rows} query rows at most (prefill from {FA2_MIN_ROWS})"
    smem, limit = fa2_smem(d, fa2_warps(rows)), max_dynamic_smem(ctx.archs)
    if smem > limit:
        return f"its tiles need {smem} bytes of shared memory, over the {limit} of the compile's smallest arch"
    for value in (q_v, k_v, v_v, pk_v, pv_v):
        if value is not None and not _unit_last_stride(ctx, value):
            return f"{value.name} has a non-unit stride along the head dim"
    return None


def emit_fa2(ctx: KernelContext, node: Node, flags: tuple[str, ...], acc: int, keys: bool) -> KernelCode:
    """attention_fa2 for a node fa2_decline accepted (its AttnArgs `args` already bound)."""
    hq, hk, d, _, sq = _geometry(node)
    d = int(d)
    rows_up = ctx.upper(sq)
    nw = fa2_warps(rows_up)
    mask_t, has_past, has_mask, causal = flags
    tmpl = f"{mask_t}, {d}, {nw}, {acc}, {has_past}, {has_mask}, {causal}, {str(keys).lower()}"
    body = f"  atlas::attention_fa2<{tmpl}>(args);"
    batch = node.inputs[0].shape[0]
    items = ctx.upper(batch) * hq * max(1, -(-rows_up // (16 * nw)))
    choice = {"attention": "fa2", "br": 16 * nw, "bc": FA2_BC, "warps": nw, "head_dim": d}
    # "at least 1 block per SM" in a declaration of the wrapper: without it ptxas (nvcc 13, sm80) capped
    # the causal-with-past kernel at 168 registers and spilled; with it no variant spills (ptxas -v:
    # 120 to 255 registers, tests/test_flash_attention.py)
    preamble = (f'extern "C" __global__ void __launch_bounds__({32 * nw}, 1) {ctx.kernel}'
                f"(unsigned char* __restrict__ arena);")
    return KernelCode(body, (max(1, min(STRIDE_GRID, items)), 1, 1), (32 * nw, 1, 1), fa2_smem(d, nw), preamble,
                      choice=choice)
