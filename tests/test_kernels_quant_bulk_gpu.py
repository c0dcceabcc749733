"""GPU numerics of the copy-engine int4 / int8 projection (codegen/quant_bulk.py, ATLAS_QUANT_BULK=1) against the
reference.

An sm90-only compile of one-row LinearQ4 nodes (symmetric, groups of 128) and LinearQ8 nodes: K 4096 x N 4096
(Llama-3-8B's o), K 14336 x N 256 with a bias (down's K: 112 int4 / 224 int8 stages, split into K runs), K 128 x N 40
with a bias (one or two stages, a partial tile) and K 256 x N 1000 (a partial tile of the 128-row default); each
node is checked to be the copy-engine kernel, then run
twice in one arena (the K split's counters must be left at 0) against the reference interpreter, with the offset
dequantization off and on (ATLAS_QUANT_OFS), the K split forced to 1, 2 and 4 runs or by the rule, and two other
configurations (ATLAS_QUANT_BULK_CONFIG). NormLinearQ (the norm source, staged by the consumer warps) over K 4096,
int4 and int8: plain with N 1000 (a partial tile); with the residual add, its sum output and the SwiGLU epilogue
(N 2 x 500 pairs, bias); and with SwiGLU alone over N 2 x 4096 (64 tiles of 64 pairs). float16: 2e-2 of max |y|
(tests/test_kernels_quant_gpu.py's bound).
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes.quantize import quantize_int4, quantize_int8

pytestmark = pytest.mark.gpu

ARCHS = ("sm90",)
CASES = ((4096, 4096, False), (14336, 256, True), (128, 40, True), (256, 1000, False))  # (K, N, bias)
BITS = (4, 8)  # each case as LinearQ4 and as LinearQ8
# (N, residual add + sum output, SwiGLU, bias) of the NormLinearQ nodes over K = 4096, each int4 and int8
NORM_CASES = ((1000, False, False, False), (1000, True, True, True), (8192, False, True, False))
SWIGLU = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))), ("Mul", (), (("step", 1), ("in", 1))))
CALL = "atlas::linear_quant_bulk<"


def build_bulk():
    """A Builder of one-row LinearQ4 and LinearQ8 nodes the copy-engine path serves (CASES x BITS, in that order;
    weights from the real packers)."""
    from test_codegen_matmul_attention import Builder

    b = Builder("quant_bulk", {"m": (1, 1)})
    for i, (k, n, bias) in enumerate(CASES):
        w = (np.random.default_rng(10 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        x = b.input(f"x{i}", "float16", ("m", k))
        for bits in BITS:
            wq, scale = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
            wv = b.input(f"wq{i}_{bits}", str(wq.dtype), wq.shape, gen=lambda rng, shape, a=wq: a)
            sv = b.input(f"s{i}_{bits}", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
            bv = [b.input(f"b{i}_{bits}", "float16", (n,))] if bias else []
            if bits == 4:
                b.node("LinearQ4", [x, wv, sv, *bv], {"group_size": 128})
            else:
                b.node("LinearQ8", [x, wv, sv, *bv])
    return b


def build_bulk_norm():
    """A Builder of one-row NormLinearQ nodes the copy-engine path serves (NORM_CASES x BITS, in that order)."""
    from test_codegen_matmul_attention import Builder

    k = 4096
    b = Builder("quant_bulk_norm", {"m": (1, 1)})
    a, res, g = b.input("a", "float16", ("m", k)), b.input("r", "float16", ("m", k)), b.input("g", "float16", (k,))
    for i, (n, add, swiglu, bias) in enumerate(NORM_CASES):
        w = (np.random.default_rng(40 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        for bits in BITS:
            wq, scale = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
            wv = b.input(f"nw{i}_{bits}", str(wq.dtype), wq.shape, gen=lambda rng, shape, q=wq: q)
            sv = b.input(f"ns{i}_{bits}", "float16", scale.shape, gen=lambda rng, shape, q=scale: q)
            bv = [b.input(f"nb{i}_{bits}", "float16", (n,))] if bias else []
            attrs = {"epsilon": 1e-5, "linear": f"LinearQ{bits}", **({"group_size": 128} if bits == 4 else {})}
            if swiglu:
                attrs |= {"epilogue": SWIGLU, "gate_input": 0}
            b.node("NormLinearQ", [a, res if add else None, g, wv, sv, *bv], attrs, outputs=2 if add else 1)
    return b


def _check(monkeypatch, builder=build_bulk, **env):
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import generate_module
    from atlasc.ir import interpret

    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    builder = builder()
    graph = builder.done()
    plan = plan_for(graph, builder.upper)[0]
    mod = generate_module({"run": (graph, plan)}, {"run": builder.upper}, None, archs=ARCHS)
    assert mod.source.count(CALL) == len(graph.nodes) and len(mod.tensor_maps) == len(graph.nodes)
    feeds = builder.inputs(np.random.default_rng(), {"m": 1})
    want = interpret(graph, feeds)
    got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for, archs=ARCHS, repeat=2)
    for name, w in want.items():
        g, w = got[name].astype(np.float64), w.astype(np.float64)
        err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
        assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} {env}: err {err}"


@pytest.mark.parametrize("ofs", ["0", "1"])
@pytest.mark.parametrize("ks", ["auto", "1", "2", "4"])
def test_bulk_int4_matches_reference(monkeypatch, ofs, ks):
    _check(monkeypatch, ATLAS_QUANT_OFS=ofs, ATLAS_QUANT_BULK_KS=ks)


@pytest.mark.parametrize("config", ["4-8-4", "16-4-1"])
def test_bulk_int4_configurations(monkeypatch, config):
    _check(monkeypatch, ATLAS_QUANT_BULK_CONFIG=config)


@pytest.mark.parametrize("ofs", ["0", "1"])
@pytest.mark.parametrize("ks", ["auto", "2"])
def test_bulk_norm_matches_reference(monkeypatch, ofs, ks):
    """NormLinearQ: the norm staged by the consumer warps (its sum output checked too), plain and paired (SwiGLU)."""
    _check(monkeypatch, build_bulk_norm, ATLAS_QUANT_OFS=ofs, ATLAS_QUANT_BULK_KS=ks)
