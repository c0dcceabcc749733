"""GPU numerics of int8 activations at decode (LinearQ4 / LinearQ8 with act = "int8", codegen/act_int8.cu)
against the reference.

build_act8: plain LinearQ4 (groups of 32 and 128, with and without zero points and bias) and LinearQ8,
NormLinearQ with the SwiGLU epilogue (int4 and int8), NormLinearRotary (the QKV projection with rotary + KV-
cache append; int4 groups of 64 and of 128, int8), at rows 1 .. 8 (batch x seq). The int4 nodes with groups of
128 take the tensor-core W4A8 kernel (linear_w4a8_mma), the others the dp4a kernels. The integer parts are
exact; W4A8's y differs from the reference only by float32 summation order before its rounding to the dtype,
W8A8's not at all; so the tolerances are those of the other quantized kernels (float16 rtol 2e-2, atol 2e-3;
float32 rtol 1e-4, atol 1e-5: TOL in test_kernels_linear_prologue_gpu.py), and the x quantization itself is
exact (a different 1 / amax would move many outputs).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_codegen_matmul_attention import Builder, plan_for
from test_kernels_linear_prologue_gpu import SWIGLU, check_with_cache

pytestmark = pytest.mark.gpu

ROT_KV = {"layers": 3, "max_batch": 4, "kv_heads": 2, "max_seq": 16, "head_dim": 64}
KV_SHAPE = (ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"], ROT_KV["head_dim"])


def _codes(lo, hi, dt):
    return lambda rng, shape: rng.integers(lo, hi, shape).astype(dt)


def _scales(k, spread):
    return lambda rng, shape: (rng.uniform(0.5, 1.5, shape) / np.sqrt(k) / spread).astype(np.float16)


def build_act8(dtype: str, k: int = 1024, one_row: bool = False) -> Builder:
    """The nodes above; one_row: batch and seq fixed at 1 (the kernels a batch-1 decode step compiles)."""
    from atlasc.ir import symbolic as S

    rows = {"batch": (1, 1), "seq": (1, 1)} if one_row else {"batch": (1, ROT_KV["max_batch"]), "seq": (1, 2)}
    b = Builder(f"act8_{dtype}", rows | {"past_seq": (0, 10)})
    x = b.input("x", dtype, ("batch", "seq", k))
    r, g = b.input("r", dtype, ("batch", "seq", k)), b.input("g", dtype, (k,))

    def q4(name, n, group):
        return [b.input(f"{name}w", "uint8", (n, k // 2), gen=_codes(0, 256, np.uint8)),
                b.input(f"{name}s", "float16", (n, k // group), gen=_scales(k, 4.6))]

    w32, w128 = q4("a", 200, 32), q4("b", 96, 128)
    act = {"act": "int8"}
    b.node("LinearQ4", [x, *w32], {"group_size": 32} | act)
    b.node("LinearQ4", [x, *w128, b.input("bias", dtype, (96,)),
                        b.input("bz", "uint8", (96, k // 128), gen=_codes(0, 16, np.uint8))], {"group_size": 128} | act)
    norm = {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128} | act
    b.node("NormLinearQ", [x, r, g, *w128], norm | {"epilogue": SWIGLU, "gate_input": 0}, outputs=2)
    n_qkv = (4 + 2 * ROT_KV["kv_heads"]) * ROT_KV["head_dim"]
    cos, sin = b.input("cos", dtype, (1, "seq", 64)), b.input("sin", dtype, (1, "seq", 64))
    heads = {"q_heads": 4, "kv_heads": 2, "head_dim": 64, "past": S.sym("past_seq")}
    b.node("NormLinearRotary", [x, None, g, cos, sin, *q4("c", n_qkv, 64)],
           norm | {"group_size": 64, "layer": 0} | heads, outputs=3)
    # groups of 128: the tensor-core W4A8 kernel with the rotary epilogue
    b.node("NormLinearRotary", [x, r, g, cos, sin, *q4("f", n_qkv, 128)], norm | {"layer": 2} | heads, outputs=4)

    def q8(name, n):
        return [b.input(f"{name}w", "int8", (n, k), gen=_codes(-127, 128, np.int8)),
                b.input(f"{name}s", "float16", (n,), gen=_scales(k, 73))]

    w8 = q8("d", 96)
    b.node("LinearQ8", [x, *w8, b.input("bias8", dtype, (96,))], act)
    norm8 = {"epsilon": 1e-5, "linear": "LinearQ8"} | act
    b.node("NormLinearQ", [x, r, g, *w8], norm8 | {"epilogue": SWIGLU, "gate_input": 1}, outputs=2)
    b.node("NormLinearRotary", [x, r, g, cos, sin, *q8("e", n_qkv)], norm8 | {"layer": 1} | heads, outputs=4)
    return b


def act8_plan(graph, upper, kv_cache=None):
    return plan_for(graph, upper, kv_cache, kv=ROT_KV)


@pytest.mark.parametrize("dtype, w8a8_early", [("float32", "1"), ("float16", "1"), ("float16", "0")])
def test_act8_kernels_match_reference(monkeypatch, dtype, w8a8_early):
    """Every node against the reference; the int8 ones of float16 x in W8A8's early form (the block quantizes x after
    its first weight loads; the default) and in the v5 form (ATLAS_W8A8_EARLY=0; float32 x always)."""
    monkeypatch.setenv("ATLAS_W8A8_EARLY", w8a8_early)
    check_with_cache(build_act8(dtype), dtype, act8_plan, ROT_KV, np.random.default_rng(41))


@pytest.mark.parametrize("act8_grid", ["", "2"])
def test_one_row_act8_kernels_match_reference(monkeypatch, act8_grid):
    """The kernels of one row (batch 1, seq 1: a batch-1 decode step's), float16, against the reference, at their
    default grids and (act8_grid 2: ATLAS_PROLOGUE_ACT8_GRID) with 2 blocks, so the fused int8-x kernels loop over
    their items as the 8B shapes' do under their one-row caps of 264 / 396 (these shapes' grids are below both)."""
    if act8_grid:
        monkeypatch.setenv("ATLAS_PROLOGUE_ACT8_GRID", act8_grid)
    envs = ({"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 1, "seq": 1, "past_seq": 7})
    check_with_cache(build_act8("float16", one_row=True), "float16", act8_plan, ROT_KV, np.random.default_rng(43),
                     envs=envs)


def test_act8_kernels_without_the_int8_l2_hint(monkeypatch):
    """ATLAS_INT8_L2_HINT=0: linear_w8a8's and the tensor-core path's int8 weight loads without the L2::256B hint
    (the default has it, tests/test_int8_l2_hint.py); every node still matches the reference, at any rows and at one
    row."""
    monkeypatch.setenv("ATLAS_INT8_L2_HINT", "0")
    check_with_cache(build_act8("float16"), "float16", act8_plan, ROT_KV, np.random.default_rng(47))
    envs = ({"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 1, "seq": 1, "past_seq": 7})
    check_with_cache(build_act8("float16", one_row=True), "float16", act8_plan, ROT_KV, np.random.default_rng(48),
                     envs=envs)
