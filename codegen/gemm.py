"""Tiled tensor-core GEMM (gemm.cu's linear_gemm_tc) for the prefill Linear, M > 32.

ATLAS_LINEAR_PREFILL, read at code generation, picks what the M > 32 branch of a float16 Linear whose K
is a static multiple of 32 calls (others keep today's paths; ATLAS_LINEAR_PATH=simt wins: no tensor
cores):
- "auto" (the default): both kernels are compiled in; at run time linear_gemm_tc serves a call whose
  output has at least GEMM_TC_MIN_TILES tiles of 128 x 128 (ceil(M / 128) x ceil(N / 128)),
  linear_mma_prefill the smaller ones, where 128 x 128 tiles would leave SMs idle;
- "tc": linear_gemm_tc for every M > 32; "mma": linear_mma_prefill for every M > 32.
Measured on the H200 (docs/perf.md v10, `examples/kernel_lab.py --ms 128,512,4096 --variant mma,tc`):
tc is 1.2-2.8x faster than mma wherever the output has 128 tiles or more, and slower at 32 and 48 tiles
(the 8B down and QKV projections at M = 128); GEMM_TC_MIN_TILES sits between.

Tiles: GEMM_BM x GEMM_BN = 128 x 128 outputs per block of 8 warps (64 x 32 each), k tiles of 32 staged
in shared memory by cp.async, GEMM_STAGES = 3 deep, rows padded to 40 halves (gemm_smem bytes of
dynamic shared memory: the runtime raises the kernel's limit above 48 KB). The grid is
ceil(M_upper / 128) x ceil(N / 128) tiles, capped at STRIDE_GRID (the blocks loop grid-stride).
"""

from __future__ import annotations

import os

from atlasc.codegen.generate import CodegenError

PREFILL_ENV = "ATLAS_LINEAR_PREFILL"
PREFILL_PATHS = ("auto", "tc", "mma")
GEMM_BM = 128  # rows of x per tile (GEMM_BM of gemm.cu)
GEMM_BN = 128  # output features per tile
GEMM_BK = 32  # k per stage
GEMM_STAGES = 3
GEMM_LD = GEMM_BK + 8  # halves per shared row (16-byte pad: conflict-free ldmatrix)
# auto: linear_gemm_tc from this many 128 x 128 output tiles (measured: tc won at 128 and more, lost at 32
# and 48; any value between fits those runs)
GEMM_TC_MIN_TILES = 96


def prefill_choice() -> str:
    """ATLAS_LINEAR_PREFILL: "auto" (also when unset), "tc" or "mma"; CodegenError otherwise."""
    value = os.environ.get(PREFILL_ENV, "") or "auto"
    if value not in PREFILL_PATHS:
        raise CodegenError(f"{PREFILL_ENV}={value!r} is not a prefill Linear path (expected auto, tc or mma)")
    return value


def gemm_smem() -> int:
    """Dynamic shared memory bytes of linear_gemm_tc: GEMM_STAGES x (x tile + w tile) [128][GEMM_LD] fp16."""
    return GEMM_STAGES * 2 * GEMM_BM * GEMM_LD * 2


def gemm_tiles(m_upper: int, n_upper: int) -> int:
    """Output tiles of linear_gemm_tc at the largest M and N."""
    return -(-m_upper // GEMM_BM) * -(-n_upper // GEMM_BN)


def record() -> dict:
    """What codegen_choices records of this path: the choice, and the tc tiles unless it is "mma"."""
    choice = prefill_choice()
    if choice == "mma":
        return {"linear_prefill": "mma"}
    tc = {"tile": [GEMM_BM, GEMM_BN, GEMM_BK], "stages": GEMM_STAGES}
    if choice == "auto":
        tc["min_tiles"] = GEMM_TC_MIN_TILES
    return {"linear_prefill": choice, "linear_gemm_tc": tc}
