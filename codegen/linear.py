"""Linear: the decode GEMV / tensor-core (MMA) paths and the prefill tiled / MMA paths of linear.cu.

The emitter binds x and y as Views of their own rank (leading dims flatten to M rows), w [N, K] as
a contiguous constant and the optional bias [N]. The kernel picks its path from M at run time:
- M <= 32 (decode): M falls in the bucket MT = 1, 2, 4, ... (the smallest power of two >= M); buckets
  exist up to the next power of two of M's compile-time maximum (at most 32). Each bucket runs the
  CUDA-core GEMV with MT rows, or, where DECODE_PATH says "mma", the tensor-core decode with
  J = ceil(MT / 8) tiles of 8 rows when lin_mma_ok holds at run time (float16, K % 32 == 0, aligned
  x rows and w, sm80+), the GEMV otherwise (in a kernel that also has the prefill paths, compiled for sm80+
  only: the tiled path instead, so the GEMVs behind the MMA runs are not inlined).
- M > 32 (only emitted when M may exceed 32): the tensor-core prefill (64-row tiles, split-K across
  the block's warps when the tiles alone would not fill the GPU) when lin_mma_ok holds, else the
  CUDA-core tiled path (matmul.cu). ATLAS_LINEAR_PREFILL (gemm.py; default auto) adds gemm.cu's
  linear_gemm_tc before it, for calls with at least gemm.GEMM_TC_MIN_TILES output tiles (tc: for all):
  128 x 128 output tiles, x and w k tiles staged in shared memory by cp.async (3 stages), ldmatrix
  fragments, gemm.gemm_smem() bytes of dynamic shared memory (60 KB: not in a compile for sm75, whose
  64 KB per block leave too little beside the static arrays, atlasc/ir/archs.py); where two such blocks fit
  an SM (sm90, sm100) the kernel's launch bounds ask for two, which holds it to 128 registers.
Emitting only the variants M can reach keeps the decode kernel's register count (the maximum over
its variants: it sets the occupancy) that of the small ones. float32 models and K % 32 != 0 get no
MMA code at all.

GEMV_CONFIG maps MT to (F features per warp, U 16-byte loads in flight per lane and row);
DECODE_PATH maps MT to "gemv" or "mma"; MMA_DECODE_U / MMA_PREFILL_U set the 32-k steps of weights in
flight per warp. The environment variable ATLAS_LINEAR_PATH, read at code generation, overrides
DECODE_PATH for A/B timing (examples/kernel_lab.py --variant): "simt" = GEMV + tiled only (the
CUDA-core kernels), "mma" = the MMA paths for every bucket (M = 1 too), "table" or unset = DECODE_PATH
and the MMA prefill.
"""

from __future__ import annotations

import os

from atlasc.codegen import gemm, linear_tma
from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import (MAX_GRID, STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter,
                                     weight_prefetch)
from atlasc.codegen.matmul import TILE
from atlasc.errors import env_choice, env_switch
from atlasc.ir.archs import block_smem, blocks_per_sm, min_arch
from atlasc.ir.graph import Node

THREADS = 256  # LIN_THREADS in linear.cu (also matmul_tiled's block)
WARPS = THREADS // 32
GEMV_MAX_M = 32
MMA_M = 64  # LIN_MMA_M: rows of x per MMA prefill tile
MMA_ITEMS = 512  # LIN_MMA_ITEMS: the MMA prefill splits K until it has this many items
# chosen from ptxas reports (sm90, fp16, K=4096): registers of the kernel with variants up to MT are
# 62 (MT 1), 66 (2), 78 (4), 78 (8), 80 (16), 128 + 32 bytes of spills (32): larger F or U for MT >= 4
# hoists more x loads than the register file holds
GEMV_CONFIG: dict[int, tuple[int, int]] = {1: (2, 4), 2: (2, 4), 4: (1, 4), 8: (1, 2), 16: (1, 1), 32: (1, 1)}
# which decode path serves bucket MT when the MMA path applies. Kernel lab, H200 (8B qkv / 8B down /
# 1B o / 8B gate_up, us simt vs mma): M=1 15.1/15.4, 35.1/30.6, 4.5/3.8, 58.1/63.9 (a tie: GEMV kept);
# M=2 a tie (114 us in all for both); M>=4 MMA by 1.5x (M=4) to 20x (M=32)
DECODE_PATH: dict[int, str] = {1: "gemv", 2: "mma", 4: "mma", 8: "mma", 16: "mma", 32: "mma"}
# ... except that M = 1 takes the MMA path too when N is at most this: there the GEMV's one warp per
# row pair leaves too few blocks and bytes in flight, and the MMA decode's split-K across 8 warps wins
# (H200 lab, v3 in docs/perf.md: 1B o 4.52 -> 3.84 us, 8B down 35.1 -> 30.6; 8B qkv N=6144 a tie,
# 8B gate_up N=28672 9% slower)
MMA_M1_MAX_N = 4096
# J -> 32-k steps (1 KB of weights each) in flight per warp. ptxas, sm90, each variant alone: J=1 78
# registers, J=2 76, J=4 110, the prefill 168 (U=2), no spills
MMA_DECODE_U: dict[int, int] = {1: 4, 2: 4, 4: 4}
MMA_PREFILL_U = 2
# feature tiles of 16 per warp in the MMA decode (FT in linear.cu): FT tiles share each x fragment, so x
# (at M = 32 twice the weight bytes per 16 features) is read from L2 FT times less. ATLAS_LINEAR_FT: "auto"
# (default, the rule below), "1", "2" or "4"
FT_ENV = "ATLAS_LINEAR_FT"
# auto: FT = 2 where that leaves at least 2 blocks per H200 SM, or (J = 4: 32-row x tiles) at least 1; else 1.
# From the kernel lab on the H200 (docs/perf.md v10: `kernel_lab.py --ms 16,32 --variant mma --ft 1,2,4`),
# FT 2 was faster on every Llama-3-8B shape this picks it for (gate/up and LM head at M = 16 and 32, merged
# QKV at 32) and slower where it leaves 1 (QKV at 16, 192 blocks at FT 2; down at 16 and 32, 128 blocks).
# FT 4 never won (ptxas, sm90: 255 registers, one block per SM)
FT_AUTO_MIN_BLOCKS = 264
FT_AUTO_MIN_BLOCKS_J4 = 132
# K split across blocks in the MMA decode (KS in linear.cu), plain Linear. ATLAS_LINEAR_KSPLIT: "auto" (default,
# decode_ks) or a forced 1, 2, 4 or 8 (every MMA decode run of a plain Linear; examples/kernel_lab.py --ks).
# Narrow projections are one block per 16 outputs: Llama-3.2-1B's down projection (N = 2048) ran 128 blocks,
# 8 warps per SM, at 54% of 4.30 TB/s at one row. Kernel lab (H200, docs/perf.md v18), us, KS = 1 / 2 / 4:
# one row: 1B down 14.33 / 12.47 / 14.68, 1B o 5.26 / 6.13 / 8.43, 8B o 11.27 / 14.81, 8B down 31.01 / 37.99;
# eight rows: 1B down 19.16 / 15.13 / 12.06, 1B o 5.41 / 6.29, 8B o 12.87 / 12.21, 8B down 37.93 / 32.79;
# v19: eight rows, 8B qkv (384 blocks) 15.95 / 20.22 / 20.02; the kernel of batches 1-8 at one row
# (kernel_lab --bucket 8): 1B down 18.83 / 15.12 / 12.03, 8B o 12.53 / 12.08 / 14.17 (auto, 1: 11.58).
# So auto doubles KS while the feature blocks times KS stay under KS_MIN_BLOCKS and each warp keeps at least
# two rounds of U steps of its run; at one row only a projection of under KS_MIN_BLOCKS_M1 blocks (less than
# one wave on the H200's 132 SMs) splits at all, and in a kernel for one row alone (max batch 1: other code,
# 78 registers) only to KS_MIN_BLOCKS_M1 (v18 lab, M = 1 kernel: 1B down 14.50 / 12.70 / 14.79).
KS_ENV = "ATLAS_LINEAR_KSPLIT"
KS_MIN_BLOCKS = 384
KS_MIN_BLOCKS_M1 = 132
# Early weights (linear.cu LinPro): a decode projection kernel of at most EARLY_MAX_M rows issues each warp's first
# round of weight loads before it waits for the previous kernel (pdl_enter) and stages x. ATLAS_EARLY_WEIGHTS:
# "0" off, "1" on, "2" (default) on and each block lets the next kernel launch as it starts its last item (the
# attention right after its wait), so the next projection's first loads overlap this kernel's tail. H200, the
# decode step at batch 1 and 256 keys replayed alone (examples/step_ab.sh, docs/perf.md v23): Llama-3.2-1B (16
# layers) 931.8 / 941.6 / 898.4 us for 0 / 1 / 2 before the launch bounds of early_min_blocks, 938.8 -> 846.0 us
# (0 -> 2) with them; 8 layers of Llama-3-8B shapes 1280.1 -> 1260.9 us.
EARLY_ENV = "ATLAS_EARLY_WEIGHTS"
EARLY_MODES = ("0", "1", "2")
# the batch-1 kernels only: the preload adds ~30 registers (ptxas sm90, Llama-3.2-1B shapes: 70-76 -> 100-106 with
# the MMA decode), which would leave 2 blocks per SM where an 8-row kernel's 384 blocks need 3
EARLY_MAX_M = 1
# ATLAS_EARLY_QUANT=1 (opt-in): the same for the quantized projections with float x (quant.cu linear_quant_mma: the
# first round of packed weights and scales before the wait and the staging); H200: faster only for Llama-3.2-1B
# int8, slower for its int4 and for 8B-shape int8 (docs/perf.md v24), so off by default
EARLY_QUANT_ENV = "ATLAS_EARLY_QUANT"
EARLY_WAVE_SMS = 132  # an H200's SMs (early_min_blocks)
PATH_ENV = "ATLAS_LINEAR_PATH"
U_ENV = "ATLAS_LINEAR_U"  # overrides MMA_DECODE_U for every J (examples/kernel_lab.py --u: bytes in flight)
PATHS = ("table", "simt", "mma")


def bind_bias(ctx: KernelContext, b_v, t: str) -> str:
    """Declare `bias` / `bias_stride` (nullptr / 0 without a bias); returns the HAS_BIAS template flag."""
    if b_v is not None:
        b = ctx.view(b_v, "bias_v", rank=1)
        ctx.lines.append(f"  const {t}* bias = {b}.p; const long long bias_stride = {b}.stride[0];")
    else:
        ctx.lines.append(f"  const {t}* bias = nullptr; const long long bias_stride = 0;")
    return str(b_v is not None).lower()


def gemv_variants(m_upper: int) -> list[int]:
    """The MT values compiled for rows up to m_upper: powers of two through min(32, next_pow2(m_upper))."""
    out, mt = [], 1
    while True:
        out.append(mt)
        if mt >= min(m_upper, GEMV_MAX_M):
            return out
        mt *= 2


def decode_u(j: int) -> int:
    """MMA_DECODE_U[j], or ATLAS_LINEAR_U when set (CodegenError unless 1 .. 8)."""
    forced = os.environ.get(U_ENV, "")
    if forced:
        if forced not in tuple("12345678"):
            raise CodegenError(f"{U_ENV}={forced!r} is not a step count (expected 1 .. 8)")
        return int(forced)
    return MMA_DECODE_U[j]


def ft_choice() -> str:
    """ATLAS_LINEAR_FT as given ("auto" when unset; CodegenError unless 1, 2, 4 or auto): recorded in the artifact's
    codegen choices, so it is checked whether or not a kernel of this compile reads it."""
    return env_choice(FT_ENV, "auto", ("1", "2", "4", "auto"), "a feature-tile count", CodegenError)


def decode_ft(j: int, n_static) -> int:
    """Feature tiles per warp for the MMA decode run with J x-row tiles and N = n_static outputs
    (ATLAS_LINEAR_FT; CodegenError for an unknown value). auto: 1 for J = 1 (M <= 8: x is at most half the
    weight bytes) and for unknown N; else 2 where that gives >= FT_AUTO_MIN_BLOCKS blocks (J = 4:
    FT_AUTO_MIN_BLOCKS_J4), else 1."""
    mode = ft_choice()
    if mode != "auto":
        return int(mode)
    if j < 2 or not isinstance(n_static, int):
        return 1
    return 2 if -(-n_static // 32) >= (FT_AUTO_MIN_BLOCKS_J4 if j >= 4 else FT_AUTO_MIN_BLOCKS) else 1


def ks_choice() -> str:
    """ATLAS_LINEAR_KSPLIT as given ("auto" when unset; CodegenError unless 1, 2, 4, 8 or auto): recorded in the
    artifact's codegen choices, so it is checked whether or not a kernel of this compile reads it."""
    return env_choice(KS_ENV, "auto", ("1", "2", "4", "8", "auto"), "a K split", CodegenError)


def decode_ks(j: int, n_static, k_static, one_row: bool = False, alone: bool = False) -> int:
    """Blocks a plain Linear's MMA decode run with J x-row tiles splits K across (KS in linear.cu), for a
    weight [n_static, k_static] (`one_row`: at M = 1; `alone`: in a kernel for one row only); 1 for unknown
    shapes and where feature tiles are shared (decode_ft > 1). CodegenError for an unknown ATLAS_LINEAR_KSPLIT."""
    mode = ks_choice()
    if not isinstance(n_static, int) or not isinstance(k_static, int) or decode_ft(j, n_static) != 1:
        return 1
    if mode != "auto":
        return int(mode)
    if j != 1:
        return 1
    blocks, steps, ks = -(-n_static // 16), k_static // 32, 1
    if one_row and blocks >= KS_MIN_BLOCKS_M1:
        return 1
    target = KS_MIN_BLOCKS_M1 if alone else KS_MIN_BLOCKS
    while blocks * ks < target and steps // (2 * ks) >= 2 * WARPS * decode_u(j):
        ks *= 2
    return ks


def run_ks(lo: int, hi: int, j: int, n_static, k_static) -> tuple[int, int]:
    """(KS at M = 1, KS at M > 1) of the MMA decode run lo < M <= hi (decode_ks; a value the run never takes
    repeats the other). One call serves the run: KS, the kernel's template bound, is the larger, and the
    run-time ks_n picks between them (linear.cu linear_mma_decode)."""
    if k_static is None:
        return 1, 1
    one = decode_ks(j, n_static, k_static, one_row=True, alone=hi == 1) if lo == 0 else None
    rest = decode_ks(j, n_static, k_static) if hi > 1 else None
    return (one or rest), (rest or one)


def early_mode() -> str:
    """ATLAS_EARLY_WEIGHTS (default "2"); CodegenError for an unknown value."""
    mode = os.environ.get(EARLY_ENV, "") or "2"
    if mode not in EARLY_MODES:
        raise CodegenError(f"{EARLY_ENV}={mode!r} is not one of {', '.join(EARLY_MODES)}")
    return mode


def early_quant() -> bool:
    """ATLAS_EARLY_QUANT (default 0); CodegenError for a value not 0 or 1."""
    return env_switch(EARLY_QUANT_ENV, False, CodegenError)


def early_pro(m_upper: int, body: str = "", quantized: bool = False) -> list[str]:
    """Statements declaring `lin_pro` (linear.cu LinPro: pdl_enter, then `body`) for a decode projection kernel
    of at most m_upper rows when early weights apply (early_mode, m_upper <= EARLY_MAX_M; `quantized`: a
    quantized projection with float x, only with ATLAS_EARLY_QUANT=1, quant.py); [] otherwise. The kernel must
    then pass lin_pro to every decode call (and run it before any other path) and be emitted without the
    wrapper's pdl_enter (KernelCode.waits_inside)."""
    mode = early_mode()
    if mode == "0" or m_upper > EARLY_MAX_M or (quantized and not early_quant()):
        return []
    return ["  auto lin_pro_f = [&] {", "    atlas::pdl_enter();", *([body] if body else []), "  };",
            f"  const atlas::LinPro<decltype(lin_pro_f), {'true' if mode == '2' else 'false'}> lin_pro{{lin_pro_f}};"]


def early_min_blocks(blocks: int) -> int:
    """__launch_bounds__'s blocks per SM for an early-weights kernel of `blocks` blocks (0: no bound). The preload's
    registers must not push a grid that one wave of an H200 (EARLY_WAVE_SMS) held at 3 or 4 blocks per SM into a
    second wave: ceil(blocks / EARLY_WAVE_SMS) when that is 3 or more (at most 4: 64 registers), else 0 (the MMA
    decode kernels, ~100 registers, run at most 2 blocks per SM). ptxas sm90 (8B and 1B shapes): no spills."""
    need = -(-blocks // EARLY_WAVE_SMS)
    return min(need, 4) if need >= 3 else 0


def path_choice() -> str:
    """ATLAS_LINEAR_PATH (default "table"); CodegenError for an unknown value."""
    path = os.environ.get(PATH_ENV, "") or "table"
    if path not in PATHS:
        raise CodegenError(f"{PATH_ENV}={path!r} is not a Linear path (expected one of: {', '.join(PATHS)})")
    return path


def mma_runs(variants: list[int], use_mma: dict[int, bool]) -> list[tuple[int, int, int]]:
    """(lo, hi, J): M ranges lo < M <= hi served by the MMA decode with J tiles (consecutive MMA buckets
    with the same J merged, so that each J is inlined once per run)."""
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for mt in variants:
        j = -(-mt // 8)
        if use_mma[mt]:
            if runs and runs[-1][1] == lo and runs[-1][2] == j:
                runs[-1] = (runs[-1][0], mt, j)
            else:
                runs.append((lo, mt, j))
        lo = mt
    return runs


def gemv_buckets(variants: list[int], runs: list[tuple[int, int, int]], fallback: bool) -> list[int]:
    """The buckets that get a GEMV call: all of them, or with a `fallback` path for calls the MMA decode
    cannot take, only those no MMA run serves."""
    return [mt for mt in variants if not (fallback and any(lo < mt <= hi for lo, hi, _ in runs))]


def decode_calls(t: str, r: int, variants: list[int], runs: list[tuple[int, int, int]], has_bias: str,
                 prefix: str = "    ", src: str = "xs", epi: str = "", n_static=None, k_static=None,
                 fallback: str = "", pro: str = "") -> list[str]:
    """The decode paths' if / else chain over M for the x source `src` (bools `vec` and, with MMA runs,
    `mma` declared before): MMA decode runs first, then one GEMV per bucket, the last unconditional.
    With `fallback` (a call statement for any M) the GEMVs are only those of gemv_buckets and the fallback
    ends the chain. With `epi` (a gated epilogue functor) every call gets it and the GEMV holds two rows (F = 2).
    Without it the MMA decode runs FT = decode_ft(J, n_static) feature tiles per warp, U / FT steps, and with
    `k_static` (a plain Linear) K split across KS = decode_ks(...) blocks (`lin_ws`, `lin_cnt` declared before:
    split_scratch). With `pro` (early_pro's object; no fallback) every call gets it."""
    args = f"{src}, w, bias, bias_stride, y, M, N, K, lin_yoff"
    lines, first = [], prefix
    for run_lo, run_hi, j in runs:
        ft = 1 if epi else decode_ft(j, n_static)
        one, rest = run_ks(run_lo, run_hi, j, n_static, None if epi else k_static)
        ks = max(one, rest)
        cond = f"mma && M <= {run_hi}" if run_lo == 0 else f"mma && M > {run_lo} && M <= {run_hi}"
        tile = f", {ft}, {ks}" if ks > 1 else f", {ft}" if ft > 1 else ""
        tail = ", atlas::LinNoEpi(), lin_ws, lin_cnt" if ks > 1 else ""
        tail += f", M == 1 ? {one} : {rest}" if one != rest else ""
        if pro:  # every argument up to pro spelled out
            ks_n = f"M == 1 ? {one} : {rest}" if one != rest else str(ks)
            tail = (f", lin_ws, lin_cnt, {ks_n}" if ks > 1 else f", nullptr, nullptr, {ks_n}") + f", {pro}"
            tail = ("" if epi else ", atlas::LinNoEpi()") + tail
        lines.append(f"{prefix}if ({cond}) atlas::linear_mma_decode<{t}, {r}, {j}, {max(1, decode_u(j) // ft)}, "
                     f"{has_bias}{tile}>({args}, lin_red{', ' + epi if epi else ''}{tail});")
        prefix = first + "else "
    gemvs = gemv_buckets(variants, runs, bool(fallback))
    for i, mt in enumerate(gemvs):
        f, u = GEMV_CONFIG[mt]
        f = 2 if epi else f
        cond = "" if i == len(gemvs) - 1 and not fallback else f"if (M <= {mt}) "
        pro_arg = f"{', ' + epi if epi else ', atlas::LinNoEpi()'}, {pro}" if pro else f"{', ' + epi if epi else ''}"
        lines.append(f"{prefix}{cond}atlas::linear_gemv<{t}, {r}, {mt}, {f}, {u}, {has_bias}>({args}, vec{pro_arg});")
        prefix = first + "else "
    if fallback:
        lines.append(f"{prefix}{fallback}")
    return lines


def decode_choice(dtype: str, k_static, n_static, variants: list[int]) -> list[tuple[int, int, int]]:
    """The MMA decode runs (mma_runs) for a Linear of this dtype and weight shape [N, K]."""
    path = path_choice()
    mma = dtype == "float16" and isinstance(k_static, int) and k_static % 32 == 0 and path != "simt"
    narrow = isinstance(n_static, int) and n_static <= MMA_M1_MAX_N
    use_mma = {mt: mma and (path == "mma" or DECODE_PATH[mt] == "mma" or (mt == 1 and narrow and path == "table"))
               for mt in variants}
    return mma_runs(variants, use_mma)


def split_scratch(runs: list, n_static, k_static) -> tuple[int, int]:
    """(counters, work-space bytes) of a plain Linear's K-split MMA decode runs (decode_ks): a counter per
    feature block, [blocks x KS][4J x 32] float32 partial sums; (0, 0) without a split."""
    need = [(j, max(run_ks(lo, hi, j, n_static, k_static))) for lo, hi, j in runs]
    if all(ks == 1 for _, ks in need):
        return 0, 0
    blocks = -(-n_static // 16)
    return blocks, max(4 * blocks * ks * 4 * j * 32 for j, ks in need if ks > 1)


def decode_grid(n_upper: int, variants: list[int], runs: list, n_static=None, m_lower: int = 0,
                paired: bool = False, k_static=None) -> int:
    """Blocks for the decode paths the kernel takes for M > m_lower: a warp per GEMV feature group for the
    buckets no MMA run serves, a block per 16 * FT MMA features for the others (FT = 1 when paired: a gated
    epilogue). Any grid is correct (the loops are grid-stride); blocks beyond the path's need would only
    exit, at the kernel's tail."""
    served = {mt for lo, hi, _ in runs for mt in variants if lo < mt <= hi}
    reach = [mt for mt in variants if mt > m_lower] or variants
    blocks = 1
    for mt in reach:
        if mt in served:
            j = -(-mt // 8)
            run = next((lo, hi) for lo, hi, rj in runs if rj == j and lo < mt <= hi)
            ks = 1 if paired or k_static is None else run_ks(*run, j, n_static, k_static)[mt > 1]
            blocks = max(blocks, ks * -(-n_upper // (16 * (1 if paired else decode_ft(j, n_static)))))
        else:
            blocks = max(blocks, -(-n_upper // (WARPS * GEMV_CONFIG[mt][0])))
    return blocks


def red_floats(runs: list) -> int:
    """Shared floats for the MMA decode's partial C fragments (0 without MMA runs)."""
    return 4 * WARPS * 32 * max([j for _, _, j in runs], default=0)


# linear_tiled's static tiles (matmul.cu: float As[MM_BK][MM_BM + 1], Bs[MM_BK][MM_BN + 1], MM_BK 16, MM_BM = MM_BN 64)
TILED_STATIC_BYTES = 2 * 16 * (64 + 1) * 4


def static_smem(rows: int, red: int, tiled: bool) -> int:
    """Bytes of a Linear kernel's __shared__ arrays: lin_xoff and lin_yoff (`rows` each), lin_red (`red`
    floats) and, with the tiled fallback, its two tiles (ptxas: 43136 bytes for a float16 prefill kernel
    with both MMA paths, the figure a compile for sm86 counts against its 99 KB)."""
    return 2 * 8 * rows + 4 * red + (TILED_STATIC_BYTES if tiled else 0)


@emitter("Linear")
def emit_linear(ctx: KernelContext, node: Node) -> KernelCode:
    tma = linear_tma.try_emit(ctx, node)  # the batch-9..32 kernels of an sm90-only compile (linear_tma.py)
    if tma is not None:
        return tma
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
    has_bias = bind_bias(ctx, b_v, t)
    m_upper = 1
    for d in x_v.shape[:-1]:
        m_upper *= ctx.upper(d)
    variants = gemv_variants(m_upper)
    tiled = r >= 2 and m_upper > GEMV_MAX_M
    k_static = w_v.shape[1]
    runs = decode_choice(dt, k_static, w_v.shape[0], variants)
    mma_prefill = tiled and dt == "float16" and isinstance(k_static, int) and k_static % 32 == 0 \
        and path_choice() != "simt"
    prefill = gemm.prefill_choice() if mma_prefill else "mma"
    mma_red = 4 * WARPS * 32 * (MMA_M // 8)  # linear_mma_prefill's partial C fragments (J = 8)
    if prefill != "mma" and gemm.gemm_smem() + static_smem(
            gemm.GEMM_BM, max(red_floats(runs), mma_red if prefill == "auto" else 0), tiled) > block_smem(ctx.archs):
        prefill = "mma"  # the tiled GEMM's stages do not fit beside the kernel's own arrays on the smallest arch
    tc = prefill in ("tc", "auto")  # linear_gemm_tc (auto: by output tiles at run time) ...
    mma_big = mma_prefill and prefill in ("mma", "auto")  # ... and / or linear_mma_prefill
    args = "x, w, bias, bias_stride, y, M, N, K, lin_xoff, lin_yoff"
    rows = gemm.GEMM_BM if tc else MMA_M if mma_prefill else GEMV_MAX_M
    lines = [
        f"  const long long N = {n_c}, K = {k_c};",
        "  long long M = 1;",
        *[f"  M *= x.shape[{i}];" for i in range(r - 1)],
        f"  __shared__ long long lin_xoff[{rows}], lin_yoff[{rows}];",
    ]
    red = max(red_floats(runs), mma_red if mma_big else 0)  # partial C fragments: 4J floats x 8 warps x 32 lanes
    if red:  # (J = 8: prefill)
        lines.append(f"  __shared__ float lin_red[{red}];")
    # a prefill kernel's decode paths (M <= 32) fall back to the tiled path where the MMA decode cannot run
    # (misaligned rows) instead of a GEMV per bucket: the GEMVs behind the MMA runs took most of the module's
    # ptxas time (docs/perf.md v20). Not on sm75, where the MMA code compiles to nothing and the GEMVs are
    # the decode path.
    fallback = (f"atlas::linear_tiled<{t}, {r}, {has_bias}>(x, w, bias, bias_stride, y, N, K);"
                if tiled and runs and min_arch(ctx.archs) >= 80 else "")
    setup = f"atlas::linear_gemv_setup<{t}, {r}>(x, w, y, M, K, lin_xoff, lin_yoff);"
    early = [] if tiled else early_pro(m_upper)
    lines += early
    lines += [
        f"  if (M <= {min(variants[-1], GEMV_MAX_M)}) {{",
        f"    const bool vec = {setup}" if gemv_buckets(variants, runs, bool(fallback)) else f"    {setup}",
        f"    const atlas::XView<{t}> xs{{x.p, lin_xoff, x.stride[{r - 1}]}};",
    ]
    if runs:
        lines.append(f"    const bool mma = atlas::lin_mma_ok<{t}, {r}>(x, w, K);")
    counters, scratch = split_scratch(runs, w_v.shape[0], k_static)
    if scratch:  # the K split's counters and partial sums (linear.cu KS)
        lines.insert(0, f"  unsigned int* lin_cnt = reinterpret_cast<unsigned int*>({ctx.counters_address()});")
        lines.insert(1, f"  float* lin_ws = reinterpret_cast<float*>({ctx.scratch_address(0)});")
    lines += decode_calls(t, r, variants, runs, has_bias, n_static=w_v.shape[0], k_static=k_static, fallback=fallback,
                          pro="lin_pro" if early else "")
    lines.append("  }")
    if tc:
        tiles = (f" && ((M + {gemm.GEMM_BM - 1}) / {gemm.GEMM_BM}) * ((N + {gemm.GEMM_BN - 1}) / {gemm.GEMM_BN}) >= "
                 f"{gemm.GEMM_TC_MIN_TILES}" if mma_big else "")
        lines.append(f"  else if (atlas::lin_mma_ok<{t}, {r}>(x, w, K){tiles}) "
                     f"atlas::linear_gemm_tc<{t}, {r}, {has_bias}>({args});")
    if mma_big:
        lines.append(f"  else if (atlas::lin_mma_ok<{t}, {r}>(x, w, K)) "
                     f"atlas::linear_mma_prefill<{t}, {r}, {MMA_PREFILL_U}, {has_bias}>({args}, lin_red);")
    if tiled:
        lines.append(f"  else atlas::linear_tiled<{t}, {r}, {has_bias}>(x, w, bias, bias_stride, y, N, K);")
    n_upper = ctx.upper(w_v.shape[0])
    m_lower = 1
    for d in x_v.shape[:-1]:
        m_lower *= ctx.lower(d)
    blocks = decode_grid(n_upper, variants, runs, w_v.shape[0], m_lower, k_static=k_static)
    if tiled:
        batch = 1
        for d in y_v.shape[:-2]:
            batch *= ctx.upper(d)
        blocks = max(blocks, min(STRIDE_GRID, batch * -(-ctx.upper(y_v.shape[-2]) // TILE) * -(-n_upper // TILE)))
    if tc:  # one block per 128 x 128 output tile at the largest M
        blocks = max(blocks, min(STRIDE_GRID, gemm.gemm_tiles(m_upper, n_upper)))
    if mma_big:  # items at S = 1 for the largest M; smaller M split K into up to ~2 * MMA_ITEMS items
        tiles_m, n16 = -(-m_upper // MMA_M), -(-n_upper // 16)
        blocks = max(blocks, min(STRIDE_GRID, n16 * tiles_m, max(-(-n16 // WARPS) * tiles_m, 2 * MMA_ITEMS)))
    grid = (max(1, min(MAX_GRID, blocks)), 1, 1)
    prefetch = weight_prefetch(ctx, w_v) if m_upper <= GEMV_MAX_M else ""  # decode only: prefill reuses tiles
    # where two blocks of the tiled GEMM's shared memory fit an SM (sm90, sm100), registers must let them:
    # ptxas alone gave the sm90 kernel 128 or 176 registers depending on which other paths it inlined
    smem_block = gemm.gemm_smem() + static_smem(rows, red, tiled) if tc else 0
    min_blocks = 2 if tc and blocks_per_sm(ctx.archs, smem_block) >= 2 else early_min_blocks(grid[0]) if early else 0
    return KernelCode("\n".join(lines), grid, (THREADS, 1, 1), smem=gemm.gemm_smem() if tc else 0, prefetch=prefetch,
                      scratch=scratch, counters=counters, min_blocks=min_blocks, waits_inside=bool(early))
