"""GPU numerics of the copy-engine + wgmma decode projection (codegen/linear_tma.py) against the reference.

Kernels generated for an sm90-only compile whose rows run above 8 and at most 32 (the decode step's batch-9..32
kernels): a plain Linear (tiles of 64 rows, with and without bias; N = 1000 leaves a partial tile; K = 14336
splits K four ways), LinearGated (SwiGLU, either half the gate, with bias; 500 pairs: a partial tile) and
LinearRotary over 128-dim heads (full rotary and none, with the KV-cache append); the same three with the norm
prologue (NormLinear plain and gated, NormLinearRotary; with the residual add, whose sum is checked too, and
without; the norm's scale all ones, as fold-norm-scale leaves it). Rows 9, 17 and 32. Each
kernel is checked to be the copy-engine one (its code names linear_tma_decode), then run against the reference
interpreter: float16 rtol 2e-2, atol 2e-3 (tests/test_kernels_linear_prologue_gpu.py's TOL).
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import check_against_reference
from test_codegen_matmul_attention import Builder, plan_for
from test_fuse_linear import _weight
from test_kernels_linear_prologue_gpu import SWIGLU, TOL, check_with_cache

from atlasc.codegen import generate_module
from atlasc.ir.graph import constant

pytestmark = pytest.mark.gpu

ROWS = (9, 17, 32)
ARCHS = ("sm90",)
LOWER = {"m": 8}


def _cast(gen):
    return lambda rng, shape: gen(rng, shape).astype(np.float16)


def uses_tma(graph, upper, lower, kv=None) -> bool:
    """Whether every node of graph gets the copy-engine kernel in an sm90 compile running above `lower`."""
    if kv is None:
        plan, spec = plan_for(graph, upper, None)[0], None
    else:
        shape = (kv["layers"], 2, kv["max_batch"], kv["kv_heads"], kv["max_seq"], kv["head_dim"])
        plan, offset = plan_for(graph, upper, np.zeros(shape, np.float16), kv=kv)
        spec = {**kv, "offset": offset, "dtype": "float16"}
    mod = generate_module({"run": (graph, plan)}, {"run": upper}, spec, archs=ARCHS, lower={"run": lower})
    return mod.source.count("atlas::linear_tma_decode<") == len(graph.nodes) and bool(mod.tensor_maps)


def build_plain() -> Builder:
    b = Builder("tma_plain", {"m": (1, 32)})
    for k, n, bias in ((4096, 1000, True), (4096, 6144, False), (14336, 256, False)):
        x = b.input(f"x{k}_{n}", "float16", ("m", k))
        w = b.input(f"w{k}_{n}", "float16", (n, k), gen=_cast(_weight(k)))
        b.node("Linear", [x, w, *([b.input(f"b{k}_{n}", "float16", (n,))] if bias else [])])
    return b


def build_gated() -> Builder:
    b = Builder("tma_gated", {"m": (1, 32)})
    k = 4096
    x = b.input("x", "float16", ("m", k))
    w = b.input("w", "float16", (1000, k), gen=_cast(_weight(k)))
    b.node("LinearGated", [x, w, b.input("b", "float16", (1000,))], {"epilogue": SWIGLU, "gate_input": 0})
    w2 = b.input("w2", "float16", (512, k), gen=_cast(_weight(k)))
    b.node("LinearGated", [x, w2], {"epilogue": SWIGLU, "gate_input": 1})
    return b


def build_norm() -> Builder:
    """NormLinear on the copy-engine path: plain (PLAIN layout) and gated (SwiGLU), with the residual add (a + r,
    the sum an output) and without; the scale g a constant of ones (the kernel's form: fold-norm-scale moved g into
    the weight), a and r ~ 3."""
    b = Builder("tma_norm", {"m": (1, 32)})
    k = 4096

    def big(rng, shape):
        return (3 * rng.standard_normal(shape)).astype(np.float16)

    a, r = b.input("a", "float16", ("m", k), gen=big), b.input("r", "float16", ("m", k), gen=big)
    g = constant("g", np.ones(k, np.float16))
    w = b.input("w", "float16", (1000, k), gen=_cast(_weight(k)))
    b.node("NormLinear", [a, r, g, w, b.input("bias", "float16", (1000,))], {"epsilon": 1e-5}, outputs=2)
    b.node("NormLinear", [a, None, g, w], {"epsilon": 1e-6})
    b.node("NormLinear", [a, r, g, w], {"epsilon": 1e-5, "epilogue": SWIGLU, "gate_input": 0}, outputs=2)
    b.node("NormLinear", [a, None, g, w], {"epsilon": 1e-5, "epilogue": SWIGLU, "gate_input": 1})
    return b


@pytest.mark.parametrize("pipe", ["0", "1"])
@pytest.mark.parametrize("build", [build_plain, build_gated, build_norm])
def test_tma_projections_match_reference(monkeypatch, build, pipe):
    """Each layout, with ATLAS_LINEAR_TMA_PIPE 0 and 1 (a stage's wgmma group kept in flight or not)."""
    monkeypatch.setenv("ATLAS_LINEAR_TMA_PIPE", pipe)
    builder = build()
    graph = builder.done()
    assert uses_tma(graph, builder.upper, LOWER)
    rtol, atol = TOL["float16"]
    rng = np.random.default_rng(51)
    for m in ROWS:
        feeds = builder.inputs(rng, {"m": m})
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_for,
                                archs=ARCHS, lower=LOWER, repeat=2)


# LinearRotary: 4 q heads, 2 kv heads of 128 dims (N = 1024), batch 9..16, seq 1
TMA_KV = {"layers": 2, "max_batch": 16, "kv_heads": 2, "max_seq": 16, "head_dim": 128}
TMA_HEADS = {"q_heads": 4, "kv_heads": 2, "head_dim": 128}
TMA_ENVS = ({"batch": 9, "seq": 1, "past_seq": 7}, {"batch": 16, "seq": 1, "past_seq": 0},
            {"batch": 13, "seq": 1, "past_seq": 3})


def build_rotary(norm: bool = False) -> Builder:
    """Two LinearRotary nodes (one cache layer each): rotary and bias-free, no rotary with a bias; with `norm`,
    NormLinearRotary with the residual add (its sum an output) and without instead."""
    from atlasc.ir import symbolic as S

    b = Builder("tma_rotary", {"batch": (1, TMA_KV["max_batch"]), "seq": (1, 1), "past_seq": (0, 10)})
    k, n = 4096, 8 * 128
    x = b.input("x", "float16", ("batch", "seq", k))
    cos, sin = b.input("cos", "float16", (1, "seq", 128)), b.input("sin", "float16", (1, "seq", 128))
    w = b.input("w", "float16", (n, k), gen=_cast(_weight(k)))
    bias = b.input("bias", "float16", (n,))
    past = S.sym("past_seq")
    if not norm:
        b.node("LinearRotary", [x, cos, sin, w], {"layer": 0, "past": past} | TMA_HEADS, outputs=3)
        b.node("LinearRotary", [x, None, None, w, bias], {"layer": 1, "past": past} | TMA_HEADS, outputs=3)
        return b
    r = b.input("r", "float16", ("batch", "seq", k))
    g = constant("g", np.ones(k, np.float16))
    attrs = {"epsilon": 1e-5, "linear": "Linear", "past": past} | TMA_HEADS
    b.node("NormLinearRotary", [x, r, g, cos, sin, w], attrs | {"layer": 0}, outputs=4)
    b.node("NormLinearRotary", [x, None, g, None, None, w, bias], attrs | {"layer": 1}, outputs=3)
    return b


@pytest.mark.parametrize("norm, heads_ks, pipe", [(False, "1", "0"), (True, "1", "0"), (False, "2", "0"),
                                                   (False, "2", "1"), (True, "1", "1")])
def test_tma_linear_rotary_matches_reference(monkeypatch, norm, heads_ks, pipe):
    """LinearRotary / NormLinearRotary on the heads layout; ATLAS_LINEAR_TMA_HEADS_KS=2 splits its K in two runs
    (the tile's last item adds the partial sums, then rotates and appends to the cache); ATLAS_LINEAR_TMA_PIPE."""
    import functools

    import kernel_harness

    monkeypatch.setenv("ATLAS_LINEAR_TMA_HEADS_KS", heads_ks)
    monkeypatch.setenv("ATLAS_LINEAR_TMA_PIPE", pipe)
    builder = build_rotary(norm)
    graph = builder.done()
    lower = {"batch": 8, "seq": 1}
    plan_fn = functools.partial(plan_for, kv=TMA_KV)
    assert uses_tma(graph, builder.upper, lower, kv=TMA_KV)
    run = kernel_harness.run_on_gpu
    monkeypatch.setattr(kernel_harness, "run_on_gpu", functools.partial(run, archs=ARCHS, lower=lower))
    check_with_cache(builder, "float16", plan_fn, TMA_KV, np.random.default_rng(53), envs=TMA_ENVS)


def test_tma_decode_matches_the_cpu_runtime(tmp_path):
    """gpt2-fp16 compiled for this GPU (sm90) at --max-batch 16 runs its batch-12 decode steps' projections (Linear
    with bias, kernels shared by its layers) on the copy-engine path; greedy tokens and logits as the reference
    runtime's on the same artifact, 12 steps (llama-fp16's case: test_gpu_runtime.py's
    test_epilogue_projections_match_the_cpu_runtime)."""
    from conftest import FIXTURES
    from kernel_harness import device
    from test_gpu_runtime import decode_matches_the_cpu_runtime

    from atlasc.artifact import open_artifact
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    if device().arch != "sm90":
        pytest.skip("the copy-engine path is for sm90 GPUs")
    path = f"{tmp_path}/gpt2-fp16-b16-tma.atlas"
    compile_model(FIXTURES / "gpt2-fp16.onnx", path, CompileOptions(archs=("sm90",), max_batch=16, max_seq=64))
    art = open_artifact(path)
    assert "atlas::linear_tma_decode<" in art.source() and art.manifest.memory.tensor_maps
    decode_matches_the_cpu_runtime(path, batch=12, seed=29)
