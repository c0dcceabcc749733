"""GPU numerics of the quantized Linear kernels (quant.cu) against the reference interpreter.

One graph per x dtype: LinearQ8 and LinearQ4 (group 32 and 128; K in {64, 256, 4096}; K = 96 with a
row of 48 bytes (int4) misaligned for 16-byte loads -> the scalar path), with and without bias, a
3-D x, a K-major x; run at M in {1, 3, 5, 40}. Weights come from the real packers on uniform weights
scaled by 1/sqrt(K) so |y| is O(1). Tolerances: float32 rtol 1e-4, atol 1e-5 (dequantization is exact
in float32 on both sides, only the summation order differs); float16 2e-2 relative to max |y| (one
fp16 rounding of the output may flip).
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes.quantize import quantize_int4, quantize_int8

pytestmark = pytest.mark.gpu

CASES = [  # (bits, K, N, group)
    (8, 64, 40, 0), (8, 96, 33, 0), (8, 4096, 256, 0),
    (4, 64, 40, 32), (4, 96, 33, 32), (4, 256, 70, 128), (4, 4096, 256, 128),
]


def _packed(bits, k, n, group, seed):
    w = (np.random.default_rng(seed).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
    return quantize_int8(w) if bits == 8 else quantize_int4(w, group)


def build_quant(dtype: str, m_max: int = 40):
    from test_codegen_matmul_attention import Builder

    b = Builder(f"quant_{dtype}", {"m": (1, m_max), "s": (1, max(1, m_max // 4))})
    xs = {}
    for i, (bits, k, n, group) in enumerate(CASES):
        wq, scale = _packed(bits, k, n, group, i)
        if k not in xs:
            xs[k] = b.input(f"x{k}", dtype, ("m", k))
        wv = b.input(f"wq{i}", str(wq.dtype), wq.shape, gen=lambda rng, shape, a=wq: a)
        sv = b.input(f"s{i}", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
        op, attrs = ("LinearQ8", {}) if bits == 8 else ("LinearQ4", {"group_size": group})
        b.node(op, [xs[k], wv, sv], attrs)
        b.node(op, [xs[k], wv, sv, b.input(f"b{i}", dtype, (n,))], attrs)
    wq, scale = _packed(8, 256, 70, 0, 99)
    w3 = b.input("wq3d", "int8", wq.shape, gen=lambda rng, shape, a=wq: a)
    s3 = b.input("s3d", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
    b.node("LinearQ8", [b.input("x3d", dtype, (2, "s", 256)), w3, s3])
    wq4, scale4 = _packed(4, 64, 24, 16, 98)
    wt = b.input("wqt", "uint8", wq4.shape, gen=lambda rng, shape, a=wq4: a)
    st = b.input("st", "float16", scale4.shape, gen=lambda rng, shape, a=scale4: a)
    b.node("LinearQ4", [b.input("xt", dtype, ("m", 64)), wt, st], {"group_size": 16})
    return b


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_quant_kernels_match_reference(dtype):
    import functools

    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.ir import interpret

    builder = build_quant(dtype)
    graph = builder.done()
    plan_fn = functools.partial(plan_for, transposed={"xt"})
    rng = np.random.default_rng(5)
    for m in (1, 3, 5, 40):
        env = {"m": m, "s": max(1, min(m // 4 + 1, builder.upper["s"]))}
        feeds = builder.inputs(rng, env)
        want = interpret(graph, feeds)
        got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_fn)
        for name, w in want.items():
            g, w = got[name].astype(np.float64), w.astype(np.float64)
            assert got[name].shape == w.shape and got[name].dtype == want[name].dtype, name
            if dtype == "float32":
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{name} m={m}")
            else:
                assert np.abs(g - w).max() <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} m={m}"
