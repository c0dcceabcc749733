"""GPU numerics of the quantized Linear kernels (quant.cu) against the reference interpreter.

One graph per x dtype (LinearQ8, LinearQ4 and LinearF8, each with and without bias), run at M in {1, 2, 3, 8, 9,
32, 33, 100} (the J = 1 / 2 / 4 variants of the tensor-core path, M-tiles of 32 rows beyond 32), with
outputs poisoned first (kernel_harness). The cases cover, for float16 x:
- the tensor-core path: int8 K in {64, 128, 4096}; int4 K in {128, 256, 512, 4096} with group 128 / 256
  (exact per-group scales; 256: a group spans two 128-k steps) and group 32 / 64 (scales multiplied into
  the fp16 A operand); N not a multiple of 16 (33, 40, 70, 72, 1000); a 3-D x (row offsets through
  lin_row_offset);
- the fallback, chosen at code generation: K = 96 (int8 K % 64 != 0; int4 K % 128 != 0, rows of 48
  bytes: the scalar path), K = 64 int4, group 16; and at run time: a K-major x (stride != 1).
LinearQ4 with zero points (ZP_CASES, with and without bias: the bias slot None) covers both paths too.
LinearF8 (E4M3 codes) follows the int8 cases: K in {64, 128, 4096} on the tensor-core path, K = 96 the
fallback. float32 x takes the fallback everywhere. test_quant_kernels_split reruns the float16 graph with the
split-K ways forced to 1, 2 and 4 (ATLAS_QUANT_SPLIT; the table picks 8 for these narrow N, 1 for the
K = 128 int4 cases).
Weights come from the real packers on uniform weights scaled by 1/sqrt(K) so |y| is O(1).
Tolerances: float32 rtol 1e-4, atol 1e-5 (dequantization is exact in float32 on both sides, only the
summation order differs); float16 2e-2 relative to max |y| (one fp16 rounding of the output may flip;
the group 32 / 64 tensor-core path rounds q * scale to fp16 once per weight, <= 2^-11 relative).
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes.quantize import quantize_fp8, quantize_int4, quantize_int4_asym, quantize_int8

pytestmark = pytest.mark.gpu

CASES = [  # (bits, K, N, group)
    (8, 64, 40, 0), (8, 96, 33, 0), (8, 128, 72, 0), (8, 4096, 256, 0),
    (4, 64, 40, 32), (4, 96, 33, 32), (4, 128, 40, 32), (4, 128, 33, 64), (4, 256, 70, 128),
    (4, 512, 24, 256), (4, 4096, 256, 128), (4, 4096, 72, 64), (4, 4096, 1000, 32),
]
MS = (1, 2, 3, 8, 9, 32, 33, 100)
# (K, N, group) of LinearQ4 with zero points: the tensor-core path (exact scales: G 128 / 256; scales in
# the A operand: G 32 / 64) and the fallback (K = 96: scalar bytes; G = 16)
ZP_CASES = [(128, 40, 32), (256, 70, 128), (512, 24, 256), (4096, 72, 64), (4096, 1000, 128), (96, 33, 32),
            (64, 24, 16)]
# (K, N) of LinearF8 (E4M3 codes): the tensor-core path for K % 64 == 0 (the int8 route), K = 96 the fallback
F8_CASES = [(64, 40), (96, 33), (128, 72), (4096, 256), (4096, 1000)]


def _packed(bits, k, n, group, seed):
    w = (np.random.default_rng(seed).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
    return quantize_int8(w) if bits == 8 else quantize_int4(w, group)


def build_quant(dtype: str, m_max: int = 100):
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
    for i, (k, n) in enumerate(F8_CASES):
        w = (np.random.default_rng(50 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        wq, scale = quantize_fp8(w)
        if k not in xs:
            xs[k] = b.input(f"x{k}", dtype, ("m", k))
        wv = b.input(f"wf{i}", "uint8", wq.shape, gen=lambda rng, shape, a=wq: a)
        sv = b.input(f"sf{i}", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
        b.node("LinearF8", [xs[k], wv, sv])
        b.node("LinearF8", [xs[k], wv, sv, b.input(f"bf{i}", dtype, (n,))])
    for i, (k, n, group) in enumerate(ZP_CASES):  # int4 with zero points (asymmetric groups)
        w = (np.random.default_rng(70 + i).uniform(-0.5, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        wq, scale, zero = quantize_int4_asym(w, group)
        if k not in xs:
            xs[k] = b.input(f"x{k}", dtype, ("m", k))
        wv = b.input(f"wz{i}", "uint8", wq.shape, gen=lambda rng, shape, a=wq: a)
        sv = b.input(f"sz{i}", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
        zv = b.input(f"zz{i}", "uint8", zero.shape, gen=lambda rng, shape, a=zero: a)
        b.node("LinearQ4", [xs[k], wv, sv, None, zv], {"group_size": group})
        b.node("LinearQ4", [xs[k], wv, sv, b.input(f"bz{i}", dtype, (n,)), zv], {"group_size": group})
    wq, scale = _packed(8, 256, 70, 0, 99)
    w3 = b.input("wq3d", "int8", wq.shape, gen=lambda rng, shape, a=wq: a)
    s3 = b.input("s3d", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
    x3 = b.input("x3d", dtype, (2, "s", 256))
    b.node("LinearQ8", [x3, w3, s3])
    wq4, scale4 = _packed(4, 256, 40, 128, 97)
    w34 = b.input("wq3d4", "uint8", wq4.shape, gen=lambda rng, shape, a=wq4: a)
    s34 = b.input("s3d4", "float16", scale4.shape, gen=lambda rng, shape, a=scale4: a)
    b.node("LinearQ4", [x3, w34, s34, b.input("b3d4", dtype, (40,))], {"group_size": 128})
    wq4, scale4 = _packed(4, 64, 24, 16, 98)
    wt = b.input("wqt", "uint8", wq4.shape, gen=lambda rng, shape, a=wq4: a)
    st = b.input("st", "float16", scale4.shape, gen=lambda rng, shape, a=scale4: a)
    b.node("LinearQ4", [b.input("xt", dtype, ("m", 64)), wt, st], {"group_size": 16})
    wq, scale = _packed(8, 128, 40, 0, 96)
    wt8 = b.input("wqt8", "int8", wq.shape, gen=lambda rng, shape, a=wq: a)
    st8 = b.input("st8", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
    b.node("LinearQ8", [b.input("xt8", dtype, ("m", 128)), wt8, st8])  # K-major x: the run-time fallback
    return b


def _check(dtype: str, repeat: int = 1):
    import functools

    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.ir import interpret

    builder = build_quant(dtype)
    graph = builder.done()
    plan_fn = functools.partial(plan_for, transposed={"xt", "xt8"})
    rng = np.random.default_rng(5)
    for m in MS:
        env = {"m": m, "s": max(1, min(m // 4 + 1, builder.upper["s"]))}
        feeds = builder.inputs(rng, env)
        want = interpret(graph, feeds)
        got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_fn, repeat=repeat)
        for name, w in want.items():
            g, w = got[name].astype(np.float64), w.astype(np.float64)
            assert got[name].shape == w.shape and got[name].dtype == want[name].dtype, name
            if dtype == "float32":
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{name} m={m}")
            else:
                err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
                assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} m={m}: err {err}"


@pytest.mark.parametrize("path", ["simt", "table"])  # the CUDA-core kernel, the tensor-core path (default)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_quant_kernels_match_reference(dtype, path, monkeypatch):
    from atlasc.codegen import quant

    monkeypatch.setenv(quant.PATH_ENV, path)
    _check(dtype)


@pytest.mark.parametrize("split", ["1", "2", "4"])
def test_quant_kernels_split(split, monkeypatch):
    from atlasc.codegen import quant

    monkeypatch.setenv(quant.PATH_ENV, "table")
    monkeypatch.setenv(quant.SPLIT_ENV, split)
    _check("float16")


@pytest.mark.parametrize("ks", ["2", "4", "8"])
def test_quant_k_split_across_blocks(ks, monkeypatch):
    """ATLAS_QUANT_KSPLIT forced: the int8 / fp8 nodes at S = 8 (K = 4096) split K across blocks at M <= 8 (the
    partial sums meet in the scratch, the last block stores); the graph runs twice in one arena, so each
    kernel must leave its counters at 0. (auto gives KS 2 to those nodes, test_quant_kernels_match_reference.)"""
    from atlasc.codegen import quant

    monkeypatch.setenv(quant.PATH_ENV, "table")
    monkeypatch.setenv(quant.KS_ENV, ks)
    _check("float16", repeat=2)


def test_quant_kernels_without_the_int8_l2_hint(monkeypatch):
    """ATLAS_INT8_L2_HINT=0: the int8 / fp8 weight loads of the tensor-core path without the L2::256B hint (the
    default has it, tests/test_int8_l2_hint.py); a hint changes no value, so both match the reference."""
    from atlasc.codegen import quant

    monkeypatch.setenv(quant.PATH_ENV, "table")
    monkeypatch.setenv(quant.L2_HINT_ENV, "0")
    _check("float16")
