"""LinearQ8 / LinearQ4 / LinearF8: weight-only quantized projections (quant.cu); LinearQ4 with or without
zero points (its fifth input, asymmetric groups).

The emitter binds x and y as Views of their own rank (leading dims flatten to M rows), the packed
weight and the float16 scales as contiguous arena buffers, and the optional bias [N]. Two paths:
- the tensor-core path (linear_quant_mma: float16 x, K % 128 == 0 for int4 / K % 64 == 0 for int8, and
  G % 32 == 0 for int4, all known here; LinearF8's E4M3 codes take the int8 route, decoded by
  cvt.rn.f16x2.e4m3x2; aligned pointers and unit-stride x rows checked at run time by
  qlin_mma_ok): 16-byte streaming loads of packed weights dequantized exactly into mma.sync A
  fragments. M picks J (tiles of 8 rows of x) at run time among the variants M can reach: J = 1 for
  M <= 8, 2 for M <= 16, 4 beyond (larger M loops over 32-row tiles). split_k picks S, the ways of
  split-K across a block's 8 warps, from N and K: the smallest S that gives SPLIT_TARGET blocks.
- the CUDA-core fallback (linear_quant: one warp per feature, any dtype / K / G / alignment).
LinearQ8 / LinearQ4 with act = "int8" (W8A8 / W4A8, decode only) run act_int8.cu instead (codegen/act_int8.py).

MMA_U maps (bits, J) to the 128-k (int4) / 64-k (int8) steps of weights in flight per warp (1 KB each).
Environment variables read at code generation, for A/B timing (examples/quant_lab.py --variant /
--split): ATLAS_QUANT_PATH = "table" (default: the tensor-core path where it applies, GPU-validated
by tests/test_kernels_quant_gpu.py, 4-60x faster than simt in docs/perf.md v5) or "simt" (the
CUDA-core kernel only); ATLAS_QUANT_SPLIT = 1, 2,
4 or 8 overrides split_k; ATLAS_QUANT_U = 1 .. 8 overrides MMA_U (steps_in_flight); ATLAS_QUANT_KSPLIT = 1, 2, 4
or 8 overrides quant_ks (a plain int8 / fp8 projection's K split across blocks at M <= 8); ATLAS_QUANT_OFS = auto,
1 or 0 chooses where the one-row int4 kernels take the offset dequantization (ofs_applies).
"""

from __future__ import annotations

import os

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import (MAX_GRID, STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter,
                                     weight_prefetch)
from atlasc.codegen.linear import GEMV_MAX_M, bind_bias, early_min_blocks, early_pro
from atlasc.codegen.act_int8 import act8_calls, act8_smem
from atlasc.errors import env_choice, env_switch
from atlasc.ir.archs import STATIC_SMEM_RESERVE, block_smem
from atlasc.ir.graph import Node
from atlasc.ir.ops.quant import act_int8

THREADS = 256  # QLIN_THREADS in quant.cu
WARPS = THREADS // 32
STEP_BYTES = 64  # QLIN_STEP_BYTES: bytes of a weight row per warp step (128 int4 / 64 int8 weights)
# blocks the split-K choice aims for: ~4 per SM of an H200 (132 SMs), enough for 2-3 resident blocks
# per SM with a small tail (the decode items are 32 KB of int4 for K = 4096)
SPLIT_TARGET = 512
# (bits, J) -> steps of weights in flight per warp (1 KB each), from ptxas reports (nvcc 13.0, sm80 and
# sm90, `python examples/quant_lab.py --ptxas sm80,sm90`): the 8B decode kernels (M <= 8) take 68-76
# registers for int4 (U = 3: 3 blocks per SM; U = 4 gave 80-83 on sm90, i.e. 2) and 58-64 for int8
# (U = 2: 4 blocks; U = 4 gave 83-100). Near a register boundary ptxas spills a few bytes rather than
# give up an occupancy step: the J = 2 / 4 values are the largest without spills on the GPU test's graph
# (tests/test_quantize.py::test_quant_kernels_no_spills)
MMA_U: dict[tuple[int, int], int] = {(4, 1): 3, (4, 2): 2, (4, 4): 1, (8, 1): 2, (8, 2): 2, (8, 4): 1}
PATH_ENV = "ATLAS_QUANT_PATH"
SPLIT_ENV = "ATLAS_QUANT_SPLIT"
U_ENV = "ATLAS_QUANT_U"
# =1 .. 8: the steps in flight of the one-row int4 tensor-core kernels that read x staged in shared memory (the fused
# NormLinearQ / NormLinearRotary with float x; at batch 1 on sm90 the merged QKV + rotary), for a decode step's A/B
# without touching the plain or int8-x kernels as ATLAS_QUANT_U does; it wins over ATLAS_QUANT_U for those kernels.
# H200 lab at one row (docs/perf.md v37 run 2, v38 run 6), us at U 2 / 3 (MMA_U) / 4: 8B QKV norm 8.61 / 9.55 / 8.98,
# o norm 7.48 / 8.02 / 7.63, down norm 18.29 / 17.41 / 17.29; in v37's 8-layer step with U 2 forced everywhere the
# QKV + rotary kernels took 0.49 us less a layer. Timed alone in the 8-layer int4 step (v39 run 1, replayed): U 2
# +0.15%, U 4 +3.1%, so MMA_U stays the default.
STAGED_U_ENV = "ATLAS_QUANT_STAGED_U"
# K split across blocks (KS in quant.cu) for a plain int8 / fp8 projection at M <= 8 that S = 8 leaves with
# less than one block per SM. ATLAS_QUANT_KSPLIT: "auto" (default, quant_ks) or a forced 1, 2, 4 or 8.
# H200 lab (docs/perf.md v20), int8 at one row, us for KS 1 / 2 / 4: 1B down (128 blocks) 11.18 / 9.18 / 8.57;
# 8B o (256) 7.86 / 11.04 / 10.39, 8B down (256) 20.93 / 26.07 / 20.98, 8B qkv (384) 9.38 / 13.03 / 13.87 (the
# split takes the kernel from 60 to 74-77 registers, 4 to 3 blocks per SM); fp8 and eight rows alike
KS_ENV = "ATLAS_QUANT_KSPLIT"
KS_MAX_BLOCKS = 132  # auto splits only below this many blocks (the H200's SMs)
# The one-row int4 kernels with groups of 128k can take quant.cu's offset dequantization (OFS: x staged per block
# in fragment order, 5 instructions per 8 weights instead of 9, no x byte permutes). ATLAS_QUANT_OFS=auto (default)
# takes it for weights of at least OFS_MIN_N rows: H200 lab at one row (docs/perf.md v26), us off / on: 8B gate/up
# with SwiGLU 29.01 / 27.00, LM head 87.22 / 77.30; QKV 7.66 / 8.22, o 6.19 / 6.65, down 15.08 / 15.77 (the staging
# at the block's start costs more than the shorter steps save where a warp has few steps). 1 / 0: always / never.
# (int8's form, no subtraction and one correction of -1152 sum x per row, was measured and removed (v28): -1 to -5% on
# the wide plain kernels, +4 to +19% on the fused ones, and 4.4e-3 of max |y| off at K = 14336 for x with a mean.)
OFS_ENV = "ATLAS_QUANT_OFS"
OFS_MIN_N = 16384
OFS_MAX_K = 16384  # the staged row in static shared memory: 32 KB at most
# The one-row int4 MMA kernels take 73-80 registers (ptxas sm90, 8B shapes): 3 blocks of 8 warps per SM, against 4
# for the LM head's 64 (its plain OFS kernel reaches 83% of the bandwidth, gate/up 56%). ATLAS_QUANT_MIN_BLOCKS=N
# (2, 3 or 4; default 0: no bound) gives the one-row quantized kernels with float x __launch_bounds__(256, N):
# ptxas sm90 at 4, int4 8B QKV / o / gate/up / down plain and fused: 63-64 registers, no spills (zero-point kernels
# spill 28-54 bytes in the test's graph). H200 (docs/perf.md v28): the 8B gate/up kernel with SwiGLU 29.21 -> 26.57 us
# in the lab, but the 8-layer int4 decode step did not move (663.4 -> 662.6 us replayed), so it stays off.
MIN_BLOCKS_ENV = "ATLAS_QUANT_MIN_BLOCKS"
MIN_BLOCKS_VALUES = (0, 2, 3, 4)
# The int8 / fp8 weight loads (the tensor-core path's, linear_w8a8's) ask the L2 for the aligned 256 bytes around
# each 16-byte load (ld.global.nc.L2::256B, sm80+). H200 lab at one row (docs/perf.md v42 run 1; the hint on every
# weight load there), int8 us off / on: 8B QKV 9.37 / 9.21, o 7.84 / 7.74, down 20.93 / 20.15, LM head 137.35 /
# 128.49; int4 LM head 77.52 / 87.26 and float16 QKV 15.61 / 16.18, gate/up 57.64 / 60.95 lost, so the hint is for
# int8 weights only. The 8-layer Llama-3-8B int8 step at batch 1 (v42 run 2, replayed): 818.0 -> 782.8 us (-4.3%).
# End to end (v46 run 2, 32 layers, batch 1): 2.789 ms/step with the hint, level with v38's 2.786 without it, so that
# gain did not carry over (two sessions; an A/B in one call is v46's Next 1).
# ATLAS_INT8_L2_HINT=0 (A/B): the plain loads (the prelude defines ATLAS_INT8_L2_OFF).
L2_HINT_ENV = "ATLAS_INT8_L2_HINT"
L2_HINT = True
PATHS = ("simt", "table")
DEFAULT_PATH = "table"  # GPU-validated and 4-60x faster than "simt" (docs/perf.md v5)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def l2_hint() -> bool:
    """ATLAS_INT8_L2_HINT (default L2_HINT); CodegenError unless 0 or 1. Recorded in the artifact's codegen choices."""
    return env_switch(L2_HINT_ENV, L2_HINT, CodegenError)


def prelude_defines() -> list[str]:
    """The lines generate_module puts before the kernel templates for this family's switches: `#define
    ATLAS_INT8_L2_OFF 1` when l2_hint() is off, else nothing (the default's text has no define)."""
    return [] if l2_hint() else ["#define ATLAS_INT8_L2_OFF 1"]


def path_choice() -> str:
    """ATLAS_QUANT_PATH (default DEFAULT_PATH); CodegenError for an unknown value."""
    path = os.environ.get(PATH_ENV, "") or DEFAULT_PATH
    if path not in PATHS:
        raise CodegenError(f"{PATH_ENV}={path!r} is not a quantized Linear path (expected one of: {', '.join(PATHS)})")
    return path


def mma_applies(dtype: str, bits: int, k, group: int) -> bool:
    """Whether the tensor-core path is emitted: float16 x, a static K that whole steps cover, and for int4
    a group size that keeps each lane's 32 k inside one group."""
    if dtype != "float16" or not isinstance(k, int) or k <= 0:
        return False
    if bits == 8:
        return k % STEP_BYTES == 0
    return k % (2 * STEP_BYTES) == 0 and group % 32 == 0


def min_blocks_choice() -> int:
    """ATLAS_QUANT_MIN_BLOCKS as an int (0 when unset); CodegenError unless one of MIN_BLOCKS_VALUES. Recorded in
    the artifact's codegen choices."""
    text = os.environ.get(MIN_BLOCKS_ENV, "") or "0"
    if not text.isdigit() or int(text) not in MIN_BLOCKS_VALUES:
        raise CodegenError(f"{MIN_BLOCKS_ENV}={text!r} is not a block count (expected one of "
                           f"{', '.join(map(str, MIN_BLOCKS_VALUES))})")
    return int(text)


def one_row_min_blocks(m_upper: int, early_bound: int = 0) -> int:
    """The launch bound's blocks per SM of a quantized projection kernel with float x of at most m_upper rows: the
    larger of min_blocks_choice() (one row only) and early_bound (linear.py early_min_blocks; 0: none)."""
    return max(min_blocks_choice() if m_upper == 1 else 0, early_bound)


def ofs_choice() -> str:
    """ATLAS_QUANT_OFS as given ("auto" when unset); CodegenError unless auto, 0 or 1. Recorded in the artifact's
    codegen choices."""
    mode = os.environ.get(OFS_ENV, "") or "auto"
    if mode not in ("auto", "0", "1"):
        raise CodegenError(f"{OFS_ENV}={mode!r} is not a choice (expected auto, 0 or 1)")
    return mode


def ofs_smem(k: int, zp: bool) -> int:
    """Static shared bytes of the offset dequantization's arrays for K = k: the staged row (qlin_ofs_x) and the
    steps' sums (qlin_ofs_c)."""
    return 2 * k + 4 * (k // 128) * (2 if zp else 1)


def ofs_applies(bits: int, group: int, zp: bool, k_static, m_upper: int, ks: int, n_upper: int, room: int) -> bool:
    """Whether the tensor-core call takes the offset dequantization (quant.cu OFS): int4 (not int8 or FP8) with groups
    of a multiple of 128, one row of x (m_upper 1), K static up to OFS_MAX_K with its arrays (ofs_smem) within `room`
    bytes of the block's shared memory, no K split across blocks; under ATLAS_QUANT_OFS 1, or auto with a weight of at
    least OFS_MIN_N rows."""
    mode = ofs_choice()
    chosen = bits == 4 and group % 128 == 0 and (mode == "1" or (mode == "auto" and n_upper >= OFS_MIN_N))
    return (chosen and m_upper == 1 and ks == 1 and isinstance(k_static, int)
            and k_static <= OFS_MAX_K and ofs_smem(k_static, zp) <= room)


def ofs_room(archs: tuple[str, ...], dynamic: int = 0) -> int:
    """The shared bytes a kernel with `dynamic` bytes of dynamic shared memory has left for the offset
    dequantization's arrays on every arch of the compile (beside the STATIC_SMEM_RESERVE its other arrays keep)."""
    return block_smem(archs) - dynamic - STATIC_SMEM_RESERVE


def mma_variants(m_upper: int) -> list[int]:
    """The J values (8-row tiles of x per pass) compiled for rows up to m_upper: 1, then 2, then 4."""
    out = [1]
    if m_upper > 8:
        out.append(2)
    if m_upper > 16:
        out.append(4)
    return out


def split_k(n: int, steps: int) -> int:
    """Ways of split-K across the block's 8 warps: the smallest S in 1, 2, 4, 8 that makes at least
    SPLIT_TARGET blocks of 8 / S 16-feature blocks, and no more ways than there are steps
    (ATLAS_QUANT_SPLIT overrides)."""
    forced = os.environ.get(SPLIT_ENV, "")
    if forced:
        if forced not in ("1", "2", "4", "8"):
            raise CodegenError(f"{SPLIT_ENV}={forced!r} is not a split (expected 1, 2, 4 or 8)")
        return int(forced)
    blocks = _ceil(n, 16)
    s = 1
    while s < WARPS and 2 * s <= steps and _ceil(blocks, WARPS // s) < SPLIT_TARGET:
        s *= 2
    return s


def ks_choice() -> str:
    """ATLAS_QUANT_KSPLIT as given ("auto" when unset; CodegenError unless 1, 2, 4, 8 or auto): recorded in the
    artifact's codegen choices, so it is checked whether or not a kernel of this compile reads it."""
    return env_choice(KS_ENV, "auto", ("1", "2", "4", "8", "auto"), "a K split", CodegenError)


def quant_ks(bits: int, n: int, steps: int, split: int, u: int) -> int:
    """Blocks the M <= 8 call of a plain projection splits K across (KS in quant.cu): auto, for an int8 / fp8
    weight of n rows that has fewer than KS_MAX_BLOCKS blocks of 16 rows at S = 8 ways, doubles KS from 1
    while the blocks stay under SPLIT_TARGET and each run keeps two rounds of S x u steps; 1 for int4, where
    S < 8 and for wider weights. ATLAS_QUANT_KSPLIT forces it (where it applies); CodegenError for an unknown
    value."""
    mode = ks_choice()
    if bits != 8 or split != WARPS:
        return 1
    if mode != "auto":
        return int(mode)
    blocks, ks = _ceil(n, 16), 1
    while blocks < KS_MAX_BLOCKS and blocks * ks < SPLIT_TARGET and steps // (2 * ks) >= 2 * split * u:
        ks *= 2
    return ks


def ks_scratch(n: int, ks: int) -> tuple[int, int]:
    """(counters, work-space bytes) of a K split across ks blocks: a counter per 16-row feature block and
    its ks runs' partial sums (4 x 32 floats each, one 8-row tile of x); (0, 0) without a split."""
    if ks == 1:
        return 0, 0
    return _ceil(n, 16), 4 * _ceil(n, 16) * ks * 4 * 32


def steps_in_flight(bits: int, j: int, staged_one_row: bool = False) -> int:
    """MMA_U[bits, j], or ATLAS_QUANT_U when set; for an int4 kernel of one row reading x staged in shared memory
    (staged_one_row), ATLAS_QUANT_STAGED_U first when set. CodegenError for a set value outside 1 .. 8."""
    for env in ((STAGED_U_ENV, U_ENV) if staged_one_row and bits == 4 else (U_ENV,)):
        forced = os.environ.get(env, "")
        if forced:
            if forced not in tuple("12345678"):
                raise CodegenError(f"{env}={forced!r} is not a step count (expected 1 .. 8)")
            return int(forced)
    return MMA_U[bits, j]


def staged_u_choice() -> int:
    """ATLAS_QUANT_STAGED_U as an int (0 when unset), validated: recorded in the artifact's codegen choices."""
    return steps_in_flight(4, 1, True) if os.environ.get(STAGED_U_ENV) else 0


def quant_calls(t: str, r: int, dt: str, bits: int, f8: bool, zp: bool, group: int, has_bias: str, k_static,
                n_upper: int, m_upper: int, x: str = "x", xsmem: bool = False, epi: str = "",
                ks: int = 1, pro: str = "", room: int = 0) -> tuple[list[str], int]:
    """(statements, blocks): the tensor-core path (when it applies) with the fallback, for the x View `x`
    (xsmem: in shared memory), `epi` a gated epilogue functor or "". Declares qlin_red; expects N, K, M,
    wq, wscale, wzero, bias, bias_stride and y declared, and with ks > 1 (a plain int8 / fp8 projection's K
    split across blocks at M <= 8, quant_ks) qlin_ws and qlin_cnt (ks_scratch). With `pro` (linear.early_pro's
    object) every tensor-core call takes it and the fallback runs it first. room: the shared bytes left for the
    offset dequantization's arrays (ofs_room; 0: none)."""
    zero = "wzero" if zp else "nullptr"
    tail = f", {zero}, {epi}" if epi else (", wzero" if zp else "")
    fallback = (f"atlas::linear_quant<{t}, {r}, {bits}, {has_bias}{', true' if f8 else ''}>("
                f"{x}, wq, wscale, bias, bias_stride, y, M, N, K, {group}LL{tail});")
    if pro:
        fallback = f"{pro}(); {fallback}"
    outs = n_upper // 2 if epi else n_upper
    lines, blocks = [], _ceil(outs, WARPS)
    if path_choice() == "table" and mma_applies(dt, bits, k_static, group):
        js = mma_variants(m_upper)
        staged = xsmem and m_upper == 1  # ATLAS_QUANT_STAGED_U's kernels (with bits == 4)
        split = split_k(n_upper, k_static * bits // 8 // STEP_BYTES)  # gated: N / 16 blocks of 8 outputs too
        if split > 1:
            lines.append(f"  __shared__ float qlin_red[{1024 * js[-1]}];")
        else:
            lines.append("  float* qlin_red = nullptr;")
        args = f"{x}, wq, wscale, bias, bias_stride, y, M, N, K, qlin_red{tail}"
        ofs = ofs_applies(bits, group, zp, k_static, m_upper, ks, n_upper, room)
        if ofs:  # the staged row and the steps' offset sums (quant.cu QlinOfs; float2 pairs with ZP)
            lines += [f"  __shared__ __align__(16) __half qlin_ofs_x[{k_static}];",
                      f"  __shared__ __align__(8) float qlin_ofs_c[{k_static // 128 * (2 if zp else 1)}];"]
        flags = (f", {str(f8).lower()}, {str(zp).lower()}, true" if xsmem else
                 f"{', true' if f8 else ''}{', false, true' if zp else ''}")
        # (OFS: a kernel for one row; any other M, e.g. 0, takes the fallback)
        lines.append(f"  if (atlas::qlin_mma_ok<{t}, {r}, {bits}>({x}, wq, M, N, K){' && M == 1' if ofs else ''}) {{")
        for i, j in enumerate(js):
            cond = "" if i == len(js) - 1 else f"if (M <= {8 * j}) "
            prefix = "    " if i == 0 else "    else "
            if ofs:  # m_upper 1: the only call; the arguments up to ofs spelled out (EPI, PRO and OFS deduced)
                lines.append(f"{prefix}atlas::linear_quant_mma<{t}, {r}, {bits}, {group}, 1, {split}, "
                             f"{steps_in_flight(bits, j, staged)}, {has_bias}, false, {str(zp).lower()}, "
                             f"{str(xsmem).lower()}>({x}, wq, wscale, bias, bias_stride, y, M, N, K, qlin_red, "
                             f"{zero}, {epi or 'atlas::LinNoEpi()'}, nullptr, nullptr, 1, "
                             f"{pro or 'atlas::LinNoPro()'}, atlas::QlinOfs{{qlin_ofs_x, qlin_ofs_c}});")
                continue
            if j == 1 and ks > 1:  # plain int8 / fp8 only (quant_ks): no zero points, x in global memory
                lines.append(f"{prefix}{cond}atlas::linear_quant_mma<{t}, {r}, {bits}, {group}, 1, {split}, "
                             f"{steps_in_flight(bits, j, staged)}, {has_bias}, {str(f8).lower()}, false, false, "
                             f"atlas::LinNoEpi, {ks}>({args}, nullptr, atlas::LinNoEpi(), qlin_ws, qlin_cnt"
                             f"{f', {ks}, {pro}' if pro else ''});")
                continue
            if pro:  # the call arguments up to pro spelled out (EPI and PRO deduced from them, KS = 1)
                lines.append(f"{prefix}{cond}atlas::linear_quant_mma<{t}, {r}, {bits}, {group}, {j}, {split}, "
                             f"{steps_in_flight(bits, j, staged)}, {has_bias}, {str(f8).lower()}, {str(zp).lower()}, "
                             f"{str(xsmem).lower()}>({x}, wq, wscale, bias, bias_stride, y, M, N, K, qlin_red, "
                             f"{zero}, {epi or 'atlas::LinNoEpi()'}, nullptr, nullptr, 1, {pro});")
                continue
            lines.append(f"{prefix}{cond}atlas::linear_quant_mma<{t}, {r}, {bits}, {group}, {j}, {split}, "
                         f"{steps_in_flight(bits, j, staged)}, {has_bias}{flags}>({args});")
        lines += ["  } else {", f"    {fallback}", "  }"]
        fb = 8 if epi else 16
        items = _ceil(_ceil(outs, fb), WARPS // split)
        # row tiles beyond the first only while the grid stays under STRIDE_GRID (both loops are grid-stride)
        blocks = max(items * ks, min(STRIDE_GRID, items * _ceil(m_upper, 8 * js[-1])))
    else:
        lines.append(f"  {fallback}")
    return lines, blocks


@emitter("LinearQ8", "LinearQ4", "LinearF8")
def emit_linear_quant(ctx: KernelContext, node: Node) -> KernelCode:
    x_v = node.inputs[0]
    y_v = node.outputs[0]
    dt = x_v.dtype
    if dt not in ("float32", "float16"):
        raise CodegenError(f"{node.name}: {node.op} on {dt} has no CUDA kernel (supported: float32, float16)")
    t = c_type(dt)
    r = len(x_v.shape)
    ctx.view(x_v, "x")
    ctx.view(y_v, "y", rank=r)
    bits, f8, zp, group, has_bias, k_static, n_upper = bind_quant_weights(ctx, node, node.inputs[1:], t)
    m_upper = 1
    for d in x_v.shape[:-1]:
        m_upper *= ctx.upper(d)
    lines = ["  long long M = 1;", *[f"  M *= x.shape[{i}];" for i in range(r - 1)]]
    prefetch = weight_prefetch(ctx, *node.inputs[1:3], *node.inputs[4:5]) if m_upper <= GEMV_MAX_M else ""
    if act_int8(node.attrs.get("act", ""), m_upper):  # W4A8 / W8A8 (decode): x quantized per row to int8
        lines.append("  extern __shared__ __align__(16) unsigned char lin_dyn[];")
        calls, blocks = act8_calls(node.name, t, r, bits, group, zp, has_bias, k_static, m_upper, "x", 0,
                                   n_upper=n_upper)
        grid = blocks or _ceil(n_upper, WARPS)
        return KernelCode("\n".join(lines + calls), (max(1, min(MAX_GRID, grid)), 1, 1), (THREADS, 1, 1),
                          smem=act8_smem(m_upper, k_static), prefetch=prefetch)
    from atlasc.codegen import quant_bulk

    if quant_bulk.eligible(ctx, node, m_upper, zp, group, k_static, n_upper):  # ATLAS_QUANT_BULK (quant_bulk.serves)
        return quant_bulk.emit(ctx, node, has_bias, k_static, n_upper, lines)
    ks = 1
    if path_choice() == "table" and mma_applies(dt, bits, k_static, group):
        steps = k_static * bits // 8 // STEP_BYTES
        ks = quant_ks(bits, n_upper, steps, split_k(n_upper, steps), steps_in_flight(bits, 1))
    counters, scratch = ks_scratch(n_upper, ks)
    if ks > 1:
        lines.append(f"  unsigned int* qlin_cnt = reinterpret_cast<unsigned int*>({ctx.counters_address()});")
        lines.append(f"  float* qlin_ws = reinterpret_cast<float*>({ctx.scratch_address(0)});")
    early = early_pro(m_upper, quantized=True)  # ATLAS_EARLY_QUANT=1 (opt-in)
    calls, blocks = quant_calls(t, r, dt, bits, f8, zp, group, has_bias, k_static, n_upper, m_upper, ks=ks,
                                pro="lin_pro" if early else "", room=ofs_room(ctx.archs))
    grid = max(1, min(MAX_GRID, blocks))
    return KernelCode("\n".join(lines + early + calls), (grid, 1, 1), (THREADS, 1, 1), prefetch=prefetch,
                      scratch=scratch, counters=counters, waits_inside=bool(early),
                      min_blocks=one_row_min_blocks(m_upper, early_min_blocks(grid) if early else 0))


def bind_quant_weights(ctx: KernelContext, node: Node, weights: list, t: str):
    """Declare wq, wscale, wzero, bias / bias_stride, N and K for a quantized projection's inputs after x
    (wq, scale[, bias[, zero]]) of the op `node.attrs["linear"]` or node.op; returns (bits, f8, zp, group,
    has_bias, K if static, N upper bound)."""
    op = node.attrs.get("linear", node.op)
    wq_v, s_v = weights[0], weights[1]
    b_v = weights[2] if len(weights) > 2 else None
    z_v = weights[3] if op == "LinearQ4" and len(weights) > 3 else None
    for v in (wq_v, s_v) + ((z_v,) if z_v is not None else ()):
        if ctx.plan.placement(v).strides is not None:
            raise CodegenError(f"{node.name}: {node.op} needs contiguous {v.name}, it is a strided view")
    bits = 4 if op == "LinearQ4" else 8
    f8 = op == "LinearF8"  # E4M3 codes in the int8 layout
    n_c = ctx.dim(wq_v.shape[0])
    k_c = ctx.dim(wq_v.shape[1]) if bits == 8 else f"(2LL * ({ctx.dim(wq_v.shape[1])}))"
    group = 0 if bits == 8 else int(node.attrs["group_size"])
    ctx.lines.append(f"  const unsigned char* wq = reinterpret_cast<const unsigned char*>({ctx.address(wq_v)});")
    ctx.lines.append(f"  const __half* wscale = reinterpret_cast<const __half*>({ctx.address(s_v)});")
    has_bias = bind_bias(ctx, b_v, t)
    zp = z_v is not None
    ctx.lines.append(f"  const unsigned char* wzero = "
                     f"{f'reinterpret_cast<const unsigned char*>({ctx.address(z_v)})' if zp else 'nullptr'};")
    ctx.lines.append(f"  const long long N = {n_c}, K = {k_c};")
    k_static = wq_v.shape[1] * 2 if bits == 4 and isinstance(wq_v.shape[1], int) else wq_v.shape[1]
    return bits, f8, zp, group, has_bias, k_static, ctx.upper(wq_v.shape[0])
