"""GPU numerics of linear_gemm_tc (gemm.cu, ATLAS_LINEAR_PREFILL=tc) against the reference interpreter.

The Linear graph of tests/test_kernels_linear_gpu.py (tests/test_fuse_linear.build_linear) with K in {64,
4096} x N in {8, 1000, 4096}, with and without bias, a 3-D x [2, s, K] with padded rows, a 1-D x and a
K-major x (these two keep the CUDA-core paths: lin_mma_ok fails at run time), compiled once for m <= 1000
and run at M in {33, 64, 100, 130, 257, 1000}: one to eight 128-row tiles, partial ones included, and N = 8
and 1000 leave the last 128-feature tile partial (N = 8: 120 of its 128 features unstored). K = 64 is two
k tiles (fewer than the 3 stages: the pipeline's empty groups), K = 4096 is 128. M = 1000 with N = 4096 is
8 x 32 tiles on one grid-stride pass. Tolerance: float16 rtol 2e-2, atol 2e-3, as for the other Linear paths
(float32 accumulation on both sides, one rounding; another summation order may flip that rounding: one
fp16 ulp at |y| < 2 is <= 2^-10 ~ 1e-3). Weights are scaled by 1/sqrt(K), so |y| is O(1).
"""

from __future__ import annotations

import pytest
from test_fuse_linear import build_linear
from test_kernels_linear_gpu import _run

from atlasc.codegen import gemm

pytestmark = pytest.mark.gpu

MS = [33, 64, 100, 130, 257, 1000]


def test_gemm_tc_linear(monkeypatch):
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    _run(build_linear("float16", 1000, ks=(64, 4096), ns=(8, 1000, 4096)), MS, "float16", seed=21)


def test_gemm_tc_small_k(monkeypatch):
    """K = 32: a single k tile (one real stage, two empty groups)."""
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    _run(build_linear("float16", 300, ks=(32, 64), ns=(8, 136)), [33, 129, 300], "float16", seed=22)


def test_gemm_auto_linear(monkeypatch):
    """ATLAS_LINEAR_PREFILL unset (auto, the default): the same graph at M from 33 to 1000, so N = 4096 runs
    the MMA prefill at 1 x 32 tiles (M <= 128) and linear_gemm_tc from 3 x 32 (M = 257); N = 1000 (8
    tiles wide) stays on the MMA prefill until M = 1000 (64 tiles: still below GEMM_TC_MIN_TILES)."""
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    _run(build_linear("float16", 1000, ks=(64, 4096), ns=(8, 1000, 4096)), MS, "float16", seed=23)
