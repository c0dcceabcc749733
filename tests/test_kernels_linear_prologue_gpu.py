"""GPU numerics of NormLinear and ElementwiseLinear (codegen/linear_prologue.py) against the reference.

One graph per dtype, rows m <= 8 (the decode buckets MT 1 .. 8), run at M in {1, 2, 3, 5, 8}:
- NormLinear with and without the residual add (the sum s is checked too), with and without bias, and
  with a SwiGLU epilogue over the two halves of its output (either half the gate: the gated paths);
- ElementwiseLinear with SwiGLU reading the two halves of one tensor (slices) and with two inputs;
over K in {64, 70, 4096} x N in {8, 1000}: float16 with K % 32 == 0 takes the tensor-core decode,
K = 70 is not a multiple of 8 (float16) or 4 (float32): the scalar GEMV. A NormLinear whose input
`a` is stored K-major (plan_for's `transposed`) takes the scalar path at every K.
Tolerances as tests/test_kernels_linear_gpu.py (float16 rtol 2e-2, atol 2e-3; float32 rtol 1e-4,
atol 1e-5): the prologue rounds x to the dtype as the unfused kernels store it, but its 1 / rms may
differ in the last float32 bit (another summation order), which can move an x by one ulp.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from kernel_harness import check_against_reference
from test_codegen_matmul_attention import Builder, plan_for
from test_fuse_linear import _weight

pytestmark = pytest.mark.gpu

TOL = {"float32": (1e-4, 1e-5), "float16": (2e-2, 2e-3)}
KS, NS = (64, 70, 4096), (8, 1000)
SWIGLU = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))), ("Mul", (), (("step", 1), ("in", 1))))


def build_prologue(dtype: str, m_max: int = 8) -> Builder:
    """NormLinear / ElementwiseLinear nodes for every K x N (see the module docstring)."""
    b = Builder(f"prologue_{dtype}", {"m": (1, m_max)})
    cast = (lambda g: (lambda rng, shape: g(rng, shape).astype(np.dtype(dtype))))
    for k in KS:
        a, r = b.input(f"a{k}", dtype, ("m", k)), b.input(f"r{k}", dtype, ("m", k))
        g = b.input(f"g{k}", dtype, (k,))
        gu = b.input(f"gu{k}", dtype, ("m", 2 * k))
        for n in NS:
            w = b.input(f"w{k}_{n}", dtype, (n, k), gen=cast(_weight(k)))
            bias = b.input(f"b{k}_{n}", dtype, (n,))
            b.node("NormLinear", [a, r, g, w], {"epsilon": 1e-5}, outputs=2)
            b.node("NormLinear", [a, None, g, w, bias], {"epsilon": 1e-6})
            # gated epilogues: SwiGLU over the halves [.., :N/2] (gate) and [.., N/2:] (up), or swapped
            b.node("NormLinear", [a, r, g, w, bias], {"epsilon": 1e-5, "epilogue": SWIGLU, "gate_input": 0}, outputs=2)
            b.node("NormLinear", [a, None, g, w], {"epsilon": 1e-5, "epilogue": SWIGLU, "gate_input": 1})
            elt = {"program": SWIGLU, "out_shape": (b.g.inputs[0].shape[0], k), "out_dtype": dtype, "n_in": 2}
            b.node("ElementwiseLinear", [gu, gu, w], elt | {"slices": ((0, k), (k, k))})
            b.node("ElementwiseLinear", [a, r, w, bias], elt)
    k, n = KS[-1], NS[-1]
    at = b.input("at", dtype, ("m", k))  # stored K-major: the scalar path
    b.node("NormLinear", [at, r, g, b.input("wt", dtype, (n, k), gen=cast(_weight(k)))], {"epsilon": 1e-5},
           outputs=2)  # r, g: the K = 4096 ones
    return b


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prologue_linears_match_reference(dtype):
    builder = build_prologue(dtype)
    graph = builder.done()
    rtol, atol = TOL[dtype]
    plan_fn = functools.partial(plan_for, transposed={"at"})
    rng = np.random.default_rng(21)
    for m in (1, 2, 3, 5, 8):
        feeds = builder.inputs(rng, {"m": m})
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn)
