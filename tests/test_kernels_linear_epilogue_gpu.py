"""GPU numerics of LinearGated and LinearRotary (codegen/linear_epilogue.py) against the reference.

The ops fuse-linear-epilogue makes for the float16 decode rows 9..32 (the batch bucket above split-decode's
decode_small), run here at every row count the paths split on:
- LinearGated: SwiGLU over the two halves of the projection's output (either half the gate), with and without
  bias, K = 4096 and 64 (the MMA decode at J = 1, 2, 4: rows 1..8, 9..16, 17..32), N = 1000 (500 pairs) and 8;
- LinearRotary: the merged QKV projection of 4 q and 2 kv heads of 64 dims with the rotary and the KV-cache
  append: full rotary (tables shared by the batch), partial rotary (32 of 64 dims, tables per batch row) with
  bias, no rotary; rows = batch <= 16 x seq <= 2 at past 0 and 7 (q, both present views and the whole cache
  after: new rows written, nothing else touched);
- each with an x stored K-major (plan_for's `transposed`): the MMA decode cannot read it, so the paired GEMV runs
  one row at a time (linear.cu LinRowsFrom), the kernel's fallback.
Tolerances as tests/test_kernels_linear_prologue_gpu.py (float16 rtol 2e-2, atol 2e-3).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from kernel_harness import check_against_reference
from test_codegen_matmul_attention import Builder, plan_for
from test_fuse_linear import _weight
from test_kernels_linear_prologue_gpu import SWIGLU, TOL, check_with_cache

pytestmark = pytest.mark.gpu

GATED_KS, GATED_NS = (4096, 64), (1000, 8)
ROWS = (1, 5, 8, 9, 16, 17, 32)
# LinearRotary: 4 q heads, 2 kv heads of 64 dims (N = 512), one cache layer per node, batch up to 16
EPI_KV = {"layers": 4, "max_batch": 16, "kv_heads": 2, "max_seq": 16, "head_dim": 64}
EPI_HEADS = {"q_heads": 4, "kv_heads": EPI_KV["kv_heads"], "head_dim": EPI_KV["head_dim"]}
EPI_ENVS = ({"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 9, "seq": 1, "past_seq": 7},
            {"batch": 12, "seq": 2, "past_seq": 7}, {"batch": 16, "seq": 2, "past_seq": 0})


def _cast(dtype: str, gen):
    return lambda rng, shape: gen(rng, shape).astype(np.dtype(dtype))


def build_gated(dtype: str = "float16") -> Builder:
    """LinearGated nodes for every K x N of GATED_KS x GATED_NS, and one over a K-major x (see the docstring)."""
    b = Builder(f"epilogue_gated_{dtype}", {"m": (1, 32)})
    for k in GATED_KS:
        x = b.input(f"x{k}", dtype, ("m", k))
        for n in GATED_NS:
            w = b.input(f"w{k}_{n}", dtype, (n, k), gen=_cast(dtype, _weight(k)))
            b.node("LinearGated", [x, w, b.input(f"b{k}_{n}", dtype, (n,))], {"epilogue": SWIGLU, "gate_input": 0})
            b.node("LinearGated", [x, w], {"epilogue": SWIGLU, "gate_input": 1})
    k = GATED_KS[0]
    xt = b.input("xt", dtype, ("m", k))  # stored K-major: the chunked GEMV
    b.node("LinearGated", [xt, b.input("wt", dtype, (1000, k), gen=_cast(dtype, _weight(k)))],
           {"epilogue": SWIGLU, "gate_input": 0})
    return b


def build_linear_rotary(dtype: str = "float16", k: int = 4096) -> Builder:
    """LinearRotary over K (rows: batch <= 16 x seq <= 2, past_seq <= 10): full rotary, partial rotary with bias,
    no rotary, and full rotary over a K-major x (layer 3)."""
    from atlasc.ir import symbolic as S

    b = Builder(f"epilogue_rotary_{dtype}_{k}", {"batch": (1, EPI_KV["max_batch"]), "seq": (1, 2),
                                                 "past_seq": (0, 10)})
    n = (EPI_HEADS["q_heads"] + 2 * EPI_HEADS["kv_heads"]) * EPI_HEADS["head_dim"]
    x, xt = b.input("x", dtype, ("batch", "seq", k)), b.input("xt", dtype, ("batch", "seq", k))
    cos, sin = b.input("cos", dtype, (1, "seq", 64)), b.input("sin", dtype, (1, "seq", 64))
    cos_b, sin_b = b.input("cos_b", dtype, ("batch", "seq", 32)), b.input("sin_b", dtype, ("batch", "seq", 32))
    w = b.input("w", dtype, (n, k), gen=_cast(dtype, _weight(k)))
    past = S.sym("past_seq")

    def rot(layer, ins):
        b.node("LinearRotary", ins, {"layer": layer, "past": past} | EPI_HEADS, outputs=3)

    rot(0, [x, cos, sin, w])
    rot(1, [x, cos_b, sin_b, w, b.input("bias", dtype, (n,))])
    rot(2, [x, None, None, w])
    rot(3, [xt, cos, sin, w])
    return b


def test_linear_gated_matches_reference():
    builder = build_gated()
    graph = builder.done()
    rtol, atol = TOL["float16"]
    plan_fn = functools.partial(plan_for, transposed={"xt"})
    rng = np.random.default_rng(41)
    for m in ROWS:
        feeds = builder.inputs(rng, {"m": m})
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn)


@pytest.mark.parametrize("k", [4096, 64])
def test_linear_rotary_matches_reference(k):
    plan_fn = functools.partial(plan_for, transposed={"xt"}, kv=EPI_KV)
    check_with_cache(build_linear_rotary("float16", k), "float16", plan_fn, EPI_KV, np.random.default_rng(43),
                     envs=EPI_ENVS)
