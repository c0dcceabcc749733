"""GPU numerics of NormLinear and ElementwiseLinear (codegen/linear_prologue.py) against the reference.

One graph per dtype, rows m <= 8 (the decode buckets MT 1 .. 8), run at M in {1, 2, 3, 5, 8}:
- NormLinear with and without the residual add (the sum s is checked too), with and without bias, and
  with a SwiGLU epilogue over the two halves of its output (either half the gate: the gated paths);
- ElementwiseLinear with SwiGLU reading the two halves of one tensor (slices) and with two inputs;
- NormLinearQ over int8, FP8 and int4 weights (groups of 32, with and without zero points), with and
  without the SwiGLU epilogue (float16 K % 128 == 0 / 64 takes quant.cu's tensor-core path reading
  the staged rows from shared memory; float32 and K = 70 its fallback);
over K in {64, 70, 4096} x N in {8, 1000}: float16 with K % 32 == 0 takes the tensor-core decode,
and NormLinearRotary (the merged QKV projection with rotary + KV-cache append as its paired epilogue;
build_rotary: full, partial and no rotary, GQA, bias, float and quantized, rows = batch x seq <= 8 at
a past > 0; q, both present views and the whole cache afterwards are compared);
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


def build_prologue(dtype: str, m_max: int = 8, ks=KS) -> Builder:
    """NormLinear / ElementwiseLinear / NormLinearQ nodes for every K in ks x N (see the module docstring)."""
    b = Builder(f"prologue_{dtype}", {"m": (1, m_max)})
    cast = (lambda g: (lambda rng, shape: g(rng, shape).astype(np.dtype(dtype))))
    for k in ks:
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
        _quantized_nodes(b, dtype, k, a, r, g)
    k, n = ks[-1], NS[-1]
    at = b.input("at", dtype, ("m", k))  # stored K-major: the scalar path
    b.node("NormLinear", [at, r, g, b.input("wt", dtype, (n, k), gen=cast(_weight(k)))], {"epsilon": 1e-5},
           outputs=2)  # r, g: the K = 4096 ones
    return b


def _quantized_nodes(b: Builder, dtype: str, k: int, a, r, g) -> None:
    """NormLinearQ over int8, FP8 and int4 (groups of 32; symmetric and with zero points) weights of
    N = 1000 (random codes, scales that make |w| ~ 1 / sqrt(K)), with and without SwiGLU."""
    n = NS[-1]
    unit = 1 / np.sqrt(k)

    def codes(lo, hi, dt):
        return lambda rng, shape: rng.integers(lo, hi, shape).astype(dt)

    def scales(spread):
        return lambda rng, shape: (rng.uniform(0.5, 1.5, shape) * unit / spread).astype(np.float16)

    def e4m3(rng, shape):  # finite codes up to 30 in magnitude (0x7F / 0xFF are NaN), random signs
        return (rng.integers(0, 0x60, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)

    q8 = [b.input(f"q8w{k}", "int8", (n, k), gen=codes(-127, 128, np.int8)), b.input(f"q8s{k}", "float16", (n,),
                                                                                   gen=scales(73))]
    f8 = [b.input(f"f8w{k}", "uint8", (n, k), gen=e4m3), b.input(f"f8s{k}", "float16", (n,), gen=scales(8))]
    swiglu = {"epilogue": SWIGLU, "gate_input": 0}
    b.node("NormLinearQ", [a, r, g, *q8], {"epsilon": 1e-5, "linear": "LinearQ8"}, outputs=2)
    b.node("NormLinearQ", [a, None, g, *q8, b.input(f"q8b{k}", dtype, (n,))],
           {"epsilon": 1e-5, "linear": "LinearQ8"} | swiglu)
    b.node("NormLinearQ", [a, r, g, *f8], {"epsilon": 1e-5, "linear": "LinearF8"} | swiglu, outputs=2)
    if k % 32 == 0:  # int4 groups of 32
        q4 = [b.input(f"q4w{k}", "uint8", (n, k // 2), gen=codes(0, 256, np.uint8)),
              b.input(f"q4s{k}", "float16", (n, k // 32), gen=scales(4.6))]
        q4_attrs = {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 32}
        b.node("NormLinearQ", [a, r, g, *q4], q4_attrs, outputs=2)
        b.node("NormLinearQ", [a, r, g, *q4], q4_attrs | swiglu, outputs=2)
        zero = b.input(f"q4z{k}", "uint8", (n, k // 32), gen=codes(0, 16, np.uint8))
        b.node("NormLinearQ", [a, None, g, *q4, None, zero], q4_attrs | swiglu)


@pytest.mark.parametrize("ahead", ["0", "1"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prologue_linears_match_reference(dtype, ahead, monkeypatch):
    """ahead: ATLAS_NORM_LOADS_AHEAD (lin_norm_stage's loads of a row issued together)."""
    from atlasc.codegen.linear_prologue import NORM_AHEAD_ENV

    monkeypatch.setenv(NORM_AHEAD_ENV, ahead)
    builder = build_prologue(dtype)
    graph = builder.done()
    rtol, atol = TOL[dtype]
    plan_fn = functools.partial(plan_for, transposed={"at"})
    rng = np.random.default_rng(21)
    for m in (1, 2, 3, 5, 8):
        feeds = builder.inputs(rng, {"m": m})
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn)


# NormLinearRotary: 4 q heads, 2 kv heads of 64 dims (N = 512), one cache layer per node
ROT_KV = {"layers": 6, "max_batch": 4, "kv_heads": 2, "max_seq": 16, "head_dim": 64}
ROT_HEADS = {"q_heads": 4, "kv_heads": ROT_KV["kv_heads"], "head_dim": ROT_KV["head_dim"]}


def build_rotary(dtype: str, k: int = 4096) -> Builder:
    """NormLinearRotary over K (rows: batch <= 4 x seq <= 2, past_seq <= 10): float with the residual add and
    full rotary (cos / sin shared by the batch); float with bias and partial rotary (32 of 64 dims, tables
    per batch row); float without rotary; int8, int4 (groups of 32, zero points) and FP8 with full rotary."""
    from atlasc.ir import symbolic as S

    b = Builder(f"rotary_{dtype}", {"batch": (1, ROT_KV["max_batch"]), "seq": (1, 2), "past_seq": (0, 10)})
    cast = (lambda g: (lambda rng, shape: g(rng, shape).astype(np.dtype(dtype))))
    n = (ROT_HEADS["q_heads"] + 2 * ROT_HEADS["kv_heads"]) * ROT_HEADS["head_dim"]
    a, r = b.input("a", dtype, ("batch", "seq", k)), b.input("r", dtype, ("batch", "seq", k))
    g = b.input("g", dtype, (k,))
    cos, sin = b.input("cos", dtype, (1, "seq", 64)), b.input("sin", dtype, (1, "seq", 64))
    cos_b, sin_b = b.input("cos_b", dtype, ("batch", "seq", 32)), b.input("sin_b", dtype, ("batch", "seq", 32))
    w = b.input("w", dtype, (n, k), gen=cast(_weight(k)))
    past = S.sym("past_seq")

    def rot(layer, ins, attrs, outputs):
        b.node("NormLinearRotary", ins, {"epsilon": 1e-5, "linear": "Linear", "layer": layer, "past": past}
               | ROT_HEADS | attrs, outputs=outputs)

    rot(0, [a, r, g, cos, sin, w], {}, 4)
    rot(1, [a, None, g, cos_b, sin_b, w, b.input("bias", dtype, (n,))], {}, 3)
    rot(2, [a, r, g, None, None, w], {}, 4)
    unit = 1 / np.sqrt(k)

    def codes(lo, hi, dt):
        return lambda rng, shape: rng.integers(lo, hi, shape).astype(dt)

    def scales(spread):
        return lambda rng, shape: (rng.uniform(0.5, 1.5, shape) * unit / spread).astype(np.float16)

    q8 = [b.input("q8w", "int8", (n, k), gen=codes(-127, 128, np.int8)),
          b.input("q8s", "float16", (n,), gen=scales(73))]
    rot(3, [a, r, g, cos, sin, *q8], {"linear": "LinearQ8"}, 4)
    if k % 32 == 0:  # int4 groups of 32 (else layer 4 stays as it was)
        q4 = [b.input("q4w", "uint8", (n, k // 2), gen=codes(0, 256, np.uint8)),
              b.input("q4s", "float16", (n, k // 32), gen=scales(4.6)), None,
              b.input("q4z", "uint8", (n, k // 32), gen=codes(0, 16, np.uint8))]
        rot(4, [a, None, g, cos, sin, *q4], {"linear": "LinearQ4", "group_size": 32}, 3)
    e4m3 = lambda rng, shape: (rng.integers(0, 0x60, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)  # noqa: E731
    f8 = [b.input("f8w", "uint8", (n, k), gen=e4m3), b.input("f8s", "float16", (n,), gen=scales(8))]
    rot(5, [a, r, g, cos, sin, *f8], {"linear": "LinearF8"}, 4)
    return b


def rotary_plan(graph, upper, kv_cache=None):
    """plan_for with the rotary builder's cache geometry."""
    return plan_for(graph, upper, kv_cache, kv=ROT_KV)


DECODE_ENVS = ({"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 3, "seq": 1, "past_seq": 7},
               {"batch": 4, "seq": 2, "past_seq": 7})


def check_with_cache(builder: Builder, dtype: str, plan_fn, kv: dict, rng, envs=DECODE_ENVS) -> None:
    """Run builder's graph (nodes writing the KV cache of geometry kv) at DECODE_ENVS on the GPU against the
    reference: every output, the whole cache afterwards, and no cache row outside [past, past + seq) of
    the batch's rows touched."""
    graph = builder.done()
    rtol, atol = TOL[dtype]
    shape = (kv["layers"], 2, kv["max_batch"], kv["kv_heads"], kv["max_seq"], kv["head_dim"])
    for env in envs:
        cache = rng.uniform(-1, 1, shape).astype(np.dtype(dtype))
        feeds = builder.inputs(rng, env)
        state, state_ref = {"kv_cache": cache.copy()}, {"kv_cache": cache.copy()}
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn,
                                state=state, state_ref=state_ref, symbols={"past_seq": env["past_seq"]})
        np.testing.assert_allclose(state["kv_cache"].astype(np.float64), state_ref["kv_cache"].astype(np.float64),
                                   rtol=rtol, atol=atol)
        p, n, s = env["past_seq"], env["batch"], env["seq"]
        untouched = np.ones(shape, bool)
        untouched[:, :, :n, :, p:p + s] = False
        np.testing.assert_array_equal(state["kv_cache"][untouched], cache[untouched])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("ahead", ["0", "1"])
def test_norm_linear_rotary_matches_reference(dtype, ahead, monkeypatch):
    """K = 4096 (float16: the tensor-core paths) and K = 70 (the scalar GEMV and quant.cu's fallback; no int4)
    at rows 1 .. 8, past 0 and 7: q, the present views and the whole cache (new rows written, nothing else);
    ahead: ATLAS_NORM_LOADS_AHEAD."""
    from atlasc.codegen.linear_prologue import NORM_AHEAD_ENV

    monkeypatch.setenv(NORM_AHEAD_ENV, ahead)
    rng = np.random.default_rng(33)
    for k in (4096, 70):
        check_with_cache(build_rotary(dtype, k), dtype, rotary_plan, ROT_KV, rng)
