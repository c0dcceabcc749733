"""GPU numerics of the Linear kernels (linear.cu) against the reference interpreter.

One graph per dtype (tests/test_fuse_linear.build_linear: K in {64, 72, 4096} x N in {8, 1000, 4096},
with and without bias, a 3-D x with padded rows, a 1-D x, a K-major x), compiled once for m <= 130
and run at M in {1, 3, 8, 9, 16, 32, 33, 64, 100, 130}: every decode bucket's edges (MT 1 .. 32) and
the prefill path with one, two and three 64-row tiles, partial ones included. float16 with K % 32 == 0
(K = 64, 4096) takes the tensor-core (MMA) paths where linear.DECODE_PATH says so; K = 72, the K-major
x, float32 and M = 1 (the GEMV in the default table) keep the CUDA-core paths. N = 8 and 1000 are not
multiples of 16 (partial MMA feature blocks). test_linear_paths forces each path for every bucket
(ATLAS_LINEAR_PATH=simt / mma), so whichever the table picks is checked. Weights are scaled by
1/sqrt(K), so |y| is O(1). Tolerances:
- float32: rtol 1e-4, atol 1e-5 (float32 accumulation in another order than numpy's, K up to 4096:
  errors ~1e-6 at |y| ~ 1);
- float16: rtol 2e-2, atol 2e-3 (both sides accumulate in float32 and round once; a different
  summation order may flip that rounding: one fp16 ulp at |y| < 2 is <= 2^-10 ~ 1e-3).
A second, decode-sized graph (m <= 4) checks the kernel without the prefill paths at M in {1, 2, 4}.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from kernel_harness import check_against_reference
from test_codegen_matmul_attention import plan_for
from test_fuse_linear import STRIDED_PLAN, build_linear

from atlasc.codegen import linear

pytestmark = pytest.mark.gpu

TOL = {"float32": (1e-4, 1e-5), "float16": (2e-2, 2e-3)}
MS = [1, 3, 8, 9, 16, 32, 33, 64, 100, 130]


def _run(builder, ms, dtype, seed, repeat=1):
    graph = builder.done()
    rtol, atol = TOL[dtype]
    plan_fn = functools.partial(plan_for, **STRIDED_PLAN)
    rng = np.random.default_rng(seed)
    for m in ms:
        env = {"m": m, "s": max(1, min(m // 4 + 1, builder.upper["s"]))}
        feeds = builder.inputs(rng, env)
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn,
                                repeat=repeat)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_linear_prefill_sized(dtype):
    _run(build_linear(dtype, 130), MS, dtype, seed=11)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_linear_decode_sized(dtype):
    _run(build_linear(dtype, 4, ks=(72, 4096), ns=(1000, 4096)), [1, 2, 4], dtype, seed=12)


@pytest.mark.parametrize("path", ["simt", "mma"])
def test_linear_paths(path, monkeypatch):
    """float16 with every bucket forced onto one path (the kernel lab's --variant)."""
    monkeypatch.setenv(linear.PATH_ENV, path)
    _run(build_linear("float16", 130, ks=(64, 72, 4096), ns=(8, 1000)), [1, 2, 5, 8, 12, 17, 32, 33, 130],
         "float16", seed=13)


@pytest.mark.parametrize("ft", ["2", "4"])
def test_linear_mma_feature_tiles(ft, monkeypatch):
    """The MMA decode with FT feature tiles of 16 per warp (ATLAS_LINEAR_FT: 2 where auto picks it) for every bucket:
    N = 8 and 1000 leave the block's last tiles partial or empty, N = 4096 fills them."""
    monkeypatch.setenv(linear.PATH_ENV, "mma")
    monkeypatch.setenv(linear.FT_ENV, ft)
    _run(build_linear("float16", 32, ks=(64, 4096), ns=(8, 1000, 4096)), [1, 2, 8, 9, 17, 32], "float16", seed=14)


@pytest.mark.parametrize("ks", ["2", "4", "8", "auto"])
def test_linear_mma_k_split(ks, monkeypatch):
    """The MMA decode with K split across KS blocks (ATLAS_LINEAR_KSPLIT; a forced value applies to every bucket,
    auto to M <= 8 of the wide-K shapes) for every bucket: K = 64 (two 32-k steps: at KS 4 and 8 some runs have
    none), K = 4096; N = 8 and 1000 leave feature blocks partial; the partial sums go through the scratch and
    the last block of each feature block adds them (the kernel runs twice: the counters must be back at 0)."""
    monkeypatch.setenv(linear.PATH_ENV, "mma")
    monkeypatch.setenv(linear.KS_ENV, ks)
    _run(build_linear("float16", 32, ks=(64, 4096), ns=(8, 1000, 4096)), [1, 2, 8, 9, 17, 32], "float16", seed=15,
         repeat=2)
