"""Tiled tensor-core GEMM (gemm.cu's linear_gemm_tc) for the prefill Linear, M > 32.

Off by default: ATLAS_LINEAR_PREFILL=tc, read at code generation, makes emit_linear (linear.py) call
linear_gemm_tc instead of linear_mma_prefill in the M > 32 branch of a float16 Linear whose K is a
static multiple of 32 (others keep today's paths; ATLAS_LINEAR_PATH=simt wins: no tensor cores). Not yet
timed on a GPU: examples/kernel_lab.py --variant mma,tc compares the two.

Tiles: GEMM_BM x GEMM_BN = 128 x 128 outputs per block of 8 warps (64 x 32 each), k tiles of 32 staged
in shared memory by cp.async, GEMM_STAGES = 3 deep, rows padded to 40 halves (gemm_smem bytes of
dynamic shared memory: the runtime raises the kernel's limit above 48 KB). The grid is
ceil(M_upper / 128) x ceil(N / 128) tiles, capped at STRIDE_GRID (the blocks loop grid-stride).
"""

from __future__ import annotations

import os

from atlasc.codegen.generate import CodegenError

PREFILL_ENV = "ATLAS_LINEAR_PREFILL"
PREFILL_PATHS = ("", "tc")
GEMM_BM = 128  # rows of x per tile (GEMM_BM of gemm.cu)
GEMM_BN = 128  # output features per tile
GEMM_BK = 32  # k per stage
GEMM_STAGES = 3
GEMM_LD = GEMM_BK + 8  # halves per shared row (16-byte pad: conflict-free ldmatrix)


def prefill_choice() -> str:
    """ATLAS_LINEAR_PREFILL ("" = linear_mma_prefill, "tc" = linear_gemm_tc); CodegenError otherwise."""
    value = os.environ.get(PREFILL_ENV, "")
    if value not in PREFILL_PATHS:
        raise CodegenError(f"{PREFILL_ENV}={value!r} is not a prefill Linear path (expected tc, or unset)")
    return value


def gemm_smem() -> int:
    """Dynamic shared memory bytes of linear_gemm_tc: GEMM_STAGES x (x tile + w tile) [128][GEMM_LD] fp16."""
    return GEMM_STAGES * 2 * GEMM_BM * GEMM_LD * 2


def gemm_tiles(m_upper: int, n_upper: int) -> int:
    """Output tiles of linear_gemm_tc at the largest M and N."""
    return -(-m_upper // GEMM_BM) * -(-n_upper // GEMM_BN)


def record() -> dict:
    """What codegen_choices records of this path: nothing when it is off."""
    if not prefill_choice():
        return {}
    return {"linear_prefill": "tc", "linear_gemm_tc": {"tile": [GEMM_BM, GEMM_BN, GEMM_BK], "stages": GEMM_STAGES}}
