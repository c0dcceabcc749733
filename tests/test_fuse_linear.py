"""fuse-linear (MatMul / Gemm by a constant weight => Linear) and its CUDA kernels (CPU side).

Equivalence: the reference interpreter on every fixture case before and after the pass. Tolerances
relative to the unfused graph: float32 rtol = atol = 1e-5 (only the BLAS summation order of
x @ W versus x @ (W^T)^T differs); float16 1e-3 of max |y| (the fused bias add rounds once where
the unfused graph rounds twice, and one flipped fp16 rounding, 2^-11 relative, may propagate).
The kernels are generated for a graph of Linear variants and compiled with nvcc for sm80 and sm90.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir import Graph, Node, SymbolInfo, Value, interpret, verify
from atlasc.ir import symbolic as S
from atlasc.ir.graph import constant
from atlasc.ir.program import Program
from atlasc.pipeline import run_pipeline
from atlasc.passes.fuse_linear import fuse_linear

from conftest import FIXTURES, arch_params

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
CASES = [(f["name"], case, f["dtype"]) for f in MANIFEST for case in f["cases"]]
RULE_MM = "MatMul(x, W) [+ b] => Linear(x, W^T, b)"
RULE_GEMM = "Gemm(x, W, c) => Linear(x, W^T, c)"


@functools.cache
def _programs(name: str):
    """(unfused, fused) main graphs and the fused pass's stats for fixture `name`."""
    before, _ = run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}), ["canonicalize", "dce"],
                             verify_each=True)
    after, report = run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}),
                                 ["canonicalize", "dce", "fuse-linear"], verify_each=True)
    return before.entries["main"], after.entries["main"], report.records[-1]


def _case(name: str, case: str) -> dict:
    z = np.load(FIXTURES / f"{name}.{case}.npz")
    return {k[3:]: z[k] for k in z.files if k.startswith("in.")}


@pytest.mark.parametrize("name,case,dtype", CASES)
def test_fixture_equivalence(name, case, dtype):
    before, after, _ = _programs(name)
    ins = _case(name, case)
    want = interpret(before, ins)
    got = interpret(after, ins)
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and g.shape == w.shape, key
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        if dtype == "fp16":
            scale = max(float(np.max(np.abs(w64))), 1.0) if w64.size else 1.0
            np.testing.assert_allclose(g64, w64, rtol=0, atol=1e-3 * scale, err_msg=key)
        else:
            np.testing.assert_allclose(g64, w64, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("name", [f["name"] for f in MANIFEST])
def test_fixture_counts(name):
    """Every MatMul / Gemm by a constant weight becomes a Linear; activation x activation ones stay."""
    before, after, record = _programs(name)
    const_mm = [n for n in before.nodes if n.op in ("MatMul", "Gemm") and n.inputs[1].is_constant]
    linears = [n for n in after.nodes if n.op == "Linear"]
    assert len(linears) == len(const_mm) > 0
    assert not [n for n in after.nodes if n.op in ("MatMul", "Gemm") and n.inputs[1].is_constant]
    assert sum(record.applied.values()) == len(const_mm)
    for n in linears:
        w = n.inputs[1]
        assert w.is_constant and w.shape[1] == n.inputs[0].shape[-1]
        # the export's own [N, K] array, or a transposed view of its [K, N] one: never a copy
        assert w.data.flags.c_contiguous or not w.data.flags.owndata


def test_fixture_biases_absorbed():
    """qwen2's q/k/v biases and gpt2's Gemm biases end up inside the Linear."""
    for name, expected in [("qwen2", 6), ("gpt2", 8)]:
        before, after, _ = _programs(name)
        with_bias = [n for n in after.nodes if n.op == "Linear" and len(n.inputs) == 3]
        assert len(with_bias) == expected, name
        assert len([n for n in after.nodes if n.op == "Add"]) == \
            len([n for n in before.nodes if n.op == "Add"]) - (expected if name == "qwen2" else 0)


def test_tied_embedding_read_not_copied():
    """gpt2-fp16's lm_head weight is a folded Transpose of the embedding: Linear reads the embedding."""
    _, after, _ = _programs("gpt2-fp16")
    emb = next(n.inputs[0] for n in after.nodes if n.op == "Gather" and n.inputs[0].name.endswith("wte.weight"))
    head = [n for n in after.nodes if n.op == "Linear" and n.inputs[1].shape[0] == emb.shape[0]]
    assert head and head[0].inputs[1] is emb


# -- declines and the shared-weight cache --------------------------------------------------------


def _graph(dtype="float32", m=3):
    """A graph with input x [m, 6] (m an int, or a symbol name bounded by [1, 8])."""
    g = Graph("t")
    if isinstance(m, str):
        g.symbols = {m: SymbolInfo(1, 8)}
        m = S.sym(m)
    x = Value("x", dtype, (m, 6))
    g.inputs.append(x)
    return g, x


def _node(g, op, ins, shape, dtype="float32", attrs=None, name=None, output=True):
    out = Value(name or f"{op.lower()}{len(g.nodes)}", dtype, shape)
    g.nodes.append(Node(op, ins, [out], attrs or {}))
    if output:
        g.outputs.append(out)
    return out


def _run(g):
    verify(g)
    rng = np.random.default_rng(0)
    ins = {v.name: rng.uniform(-1, 1, tuple(S.evaluate(d, {"m": 3}) for d in v.shape)).astype(np.dtype(v.dtype))
           for v in g.inputs}
    want = interpret(g, ins)
    p, stats = fuse_linear(Program({"main": g}))
    verify(p.entries["main"])
    got = interpret(p.entries["main"], ins)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    return p.entries["main"], stats


def test_declines_explain_themselves():
    g, x = _graph(m="m")
    rng = np.random.default_rng(1)
    w_in = Value("w_in", "float32", (6, 4))
    g.inputs.append(w_in)
    _node(g, "MatMul", [x, w_in], (x.shape[0], 4))  # weight not constant
    w3 = constant("w3", rng.standard_normal((2, 6, 4)).astype(np.float32))
    _node(g, "MatMul", [x, w3], (2, S.sym("m"), 4))  # 3-D weight
    w = constant("w", rng.standard_normal((6, 4)).astype(np.float32))
    g2, x2 = _graph()
    c = constant("c_mn", rng.standard_normal((3, 4)).astype(np.float32))
    _node(g2, "Gemm", [x2, w, c], (3, 4), attrs={"transB": 0})  # bias varies along M
    _node(g2, "Gemm", [x2, w], (3, 4), attrs={"alpha": 0.5})  # alpha
    _node(g, "MatMul", [x, w], (x.shape[0], 4))  # fused: the declines are per node
    out, stats = _run(g)
    out2, stats2 = _run(g2)
    assert [n.op for n in out.nodes] == ["MatMul", "MatMul", "Linear"]
    assert not [n for n in out2.nodes if n.op == "Linear"]
    reasons = " | ".join([*stats.declined.values(), *stats2.declined.values()])
    for text in ("not a constant", "rank 3", "varies along rows", "alpha != 1"):
        assert text in reasons, (text, reasons)


def test_dtype_mismatch_declined():
    g, x = _graph("float16")
    w = constant("w", np.ones((6, 4), np.float32))
    g.nodes.append(Node("MatMul", [x, w], [Value("y", "float32", (3, 4))]))
    _, stats = fuse_linear(Program({"main": g}))  # (the graph is ill-typed on purpose: never verified)
    assert any("x is float16, the weight float32" in r for r in stats.declined.values())


def test_shared_weight_transposed_once_and_bias_forms():
    g, x = _graph()
    rng = np.random.default_rng(2)
    w = constant("w", rng.standard_normal((6, 4)).astype(np.float32))
    b = constant("b", rng.standard_normal((1, 1, 4)).astype(np.float32))
    y1 = _node(g, "MatMul", [x, w], (x.shape[0], 4), output=False)
    _node(g, "Add", [y1, b], (1, x.shape[0], 4))  # bias adds a dim: not absorbed (shape changes)
    y2 = _node(g, "MatMul", [x, w], (x.shape[0], 4), output=False)
    b2 = constant("b2", rng.standard_normal((1, 4)).astype(np.float32))
    _node(g, "Add", [y2, b2], (x.shape[0], 4))  # absorbed as a [4] bias
    wt = constant("wt", rng.standard_normal((4, 6)).astype(np.float32))
    _node(g, "Gemm", [x, wt, constant("c1", np.float32([0.5]))], (x.shape[0], 4), attrs={"transB": 1})
    out, stats = _run(g)
    lin = [n for n in out.nodes if n.op == "Linear"]
    assert len(lin) == 3
    assert lin[0].inputs[1] is lin[1].inputs[1]  # one transposed copy of w
    assert lin[2].inputs[1] is wt  # transB=1: used as is
    assert [len(n.inputs) for n in lin] == [2, 3, 3]
    assert all(n.inputs[2].shape == (4,) for n in lin[1:])


def test_fusion_off_does_nothing():
    g, x = _graph()
    _node(g, "MatMul", [x, constant("w", np.ones((6, 4), np.float32))], (x.shape[0], 4))
    p = Program({"main": g})
    p = replace(p, options=replace(p.options, fusion=False))
    p, stats = fuse_linear(p)
    assert [n.op for n in p.entries["main"].nodes] == ["MatMul"] and not stats.applied


# -- kernels: generation + nvcc (sm80, sm90) -------------------------------------------------------

LIN_K = (64, 72, 4096)
LIN_N = (8, 1000, 4096)


def _weight(scale_k: int):
    """Weights scaled by 1/sqrt(K) so that |y| stays O(1) and tolerances mean the same at every K."""
    return lambda rng, shape: (rng.uniform(-1.0, 1.0, shape) / np.sqrt(scale_k)).astype(np.float32)


def build_linear(dtype: str, m_max: int = 100, ks=LIN_K, ns=LIN_N):
    """Linear nodes for every K x N, with and without bias, plus a 3-D x (row-padded by plan_for's
    `padded` layout), a 1-D x, and a 2-D x that plan_for's `transposed` layout stores K-major."""
    from test_codegen_matmul_attention import Builder

    b = Builder(f"linear_{dtype}_{m_max}", {"m": (1, m_max), "s": (1, max(1, m_max // 4))})
    cast = (lambda g: (lambda rng, shape: g(rng, shape).astype(np.dtype(dtype))))
    xs = {k: b.input(f"x{k}", dtype, ("m", k)) for k in ks}
    for k in ks:
        for n in ns:
            w = b.input(f"w{k}_{n}", dtype, (n, k), gen=cast(_weight(k)))
            bias = b.input(f"b{k}_{n}", dtype, (n,))
            b.node("Linear", [xs[k], w])
            b.node("Linear", [xs[k], w, bias])
    k, n = ks[-1], ns[-1]
    w = b.input("w3d", dtype, (n, k), gen=cast(_weight(k)))
    b.node("Linear", [b.input("x3d", dtype, (2, "s", k)), w, b.input("b3d", dtype, (n,))])
    b.node("Linear", [b.input("x1d", dtype, (k,)), w])
    k2 = ks[1] if len(ks) > 1 else ks[0]
    wt = b.input("wt", dtype, (ns[min(1, len(ns) - 1)], k2), gen=cast(_weight(k2)))
    b.node("Linear", [b.input("xt", dtype, ("m", k2)), wt])
    return b


STRIDED_PLAN = {"padded": {"x3d"}, "transposed": {"xt"}}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm80"))
def test_linear_kernels_compile(arch):
    """Decode-sized (m <= 4: GEMV variants only) and prefill-sized (m <= 100: + tiled) graphs, fp32 and
    fp16, with strided x; one module, compiled for the arch."""
    from atlasc.codegen.nvcc import compile_cubins
    from test_codegen_matmul_attention import generate

    builders = [build_linear(dt, m, ks=(72, 4096), ns=(8,)) for dt in ("float32", "float16") for m in (4, 100)]
    plan_kw = {bl.g.name: STRIDED_PLAN for bl in builders}
    mod = generate(*builders, plan_kw=plan_kw)
    assert "linear_tiled" in mod.source and "atlas::linear_gemv<__half, 2, 32, " in mod.source
    small = [k for k in mod.source.split('extern "C"') if "void __launch_bounds__(256) linear_float16_4_" in k]
    assert small and all("linear_tiled" not in k and ", 8, " not in k for k in small)  # only MT 1, 2, 4
    kernels = mod.source.split('extern "C"')[1:]
    # the tensor-core paths: float16 with K % 32 == 0 only (K = 4096 here; K = 72 keeps the CUDA-core ones)
    assert not [k for k in kernels if "linear_mma" in k and "__half" not in k]
    assert not [k for k in kernels if "linear_mma" in k and "K = 72LL" in k]
    assert "atlas::linear_mma_prefill<__half, 2, " in mod.source
    for j in (1, 2, 4):
        assert f"atlas::linear_mma_decode<__half, 2, {j}, " in mod.source
    # N = 8 is narrow: M = 1 takes the tensor-core decode too (codegen/linear.py MMA_M1_MAX_N)
    assert any("if (mma && M <= 4) atlas::linear_mma_decode<__half, 2, 1, " in k for k in small)
    assert compile_cubins(mod.source, (arch,))[arch]


def test_linear_path_choice(monkeypatch):
    """DECODE_PATH buckets merge into one MMA call per J; ATLAS_LINEAR_PATH overrides the table."""
    from atlasc.codegen import linear
    from atlasc.codegen.generate import CodegenError
    from test_codegen_matmul_attention import generate

    variants = linear.gemv_variants(32)
    assert linear.mma_runs(variants, {mt: mt > 1 for mt in variants}) == [(1, 8, 1), (8, 16, 2), (16, 32, 4)]
    assert linear.mma_runs(variants, {mt: mt in (2, 8, 32) for mt in variants}) == [(1, 2, 1), (4, 8, 1),
                                                                                      (16, 32, 4)]
    for path, has_mma, m1_mma in (("simt", False, False), ("mma", True, True)):
        monkeypatch.setenv(linear.PATH_ENV, path)
        src = "".join(generate(build_linear("float16", 100, ks=(4096,), ns=(8,))).source.split('extern "C"')[1:])
        assert ("linear_mma_prefill" in src) == has_mma and ("linear_mma_decode" in src) == has_mma
        assert ("if (mma && M <= 8) " in src) == m1_mma
        # the fallbacks: tiled, and with every bucket on the MMA decode no GEMV (test_prefill_linear_fallback)
        assert "linear_tiled" in src and ("linear_gemv<__half, 2, 1, " in src) == (path == "simt")
    # the table: M = 1 takes the MMA path only for narrow outputs (N <= MMA_M1_MAX_N)
    monkeypatch.setenv(linear.PATH_ENV, "table")
    for n, m1_mma in ((8, True), (linear.MMA_M1_MAX_N + 8, False)):
        src = "".join(generate(build_linear("float16", 4, ks=(64,), ns=(n,))).source.split('extern "C"')[1:])
        assert "linear_mma_decode<__half, 2, 1," in src
        assert ("if (mma && M <= 4) " in src) == m1_mma  # from M = 1
        assert ("if (mma && M > 1 && M <= 4) " in src) == (not m1_mma)
    monkeypatch.setenv(linear.PATH_ENV, "fast")
    with pytest.raises(CodegenError, match="ATLAS_LINEAR_PATH='fast'"):
        generate(build_linear("float16", 4, ks=(4096,), ns=(8,)))


def test_prefill_linear_fallback():
    """A prefill-sized float16 Linear (M up to 100, K = 4096) for sm80+ has no GEMV behind its MMA decode runs:
    where those cannot run (misaligned rows) the tiled path takes M <= 32 too; a bucket the table leaves to the
    GEMV (M = 1 with N > MMA_M1_MAX_N) keeps its GEMV. A compile that targets sm75 (no MMA code) and the
    decode-sized kernels (no tiled path) keep every GEMV."""
    from atlasc.codegen import linear
    from atlasc.codegen.generate import generate_module
    from test_codegen_matmul_attention import planned

    def kernels(m: int, archs: tuple[str, ...]) -> dict[int, str]:
        b = build_linear("float16", m, ks=(4096,), ns=(8, linear.MMA_M1_MAX_N + 8))
        graph, plan, _ = planned(b, "float16")
        source = generate_module({"g": (graph, plan)}, {"g": b.upper}, archs=archs).source
        found = {}
        for k in source.split('extern "C"')[1:]:
            n = int(re.search(r"const long long N = (\d+)LL", k).group(1))
            found.setdefault(n, k)
        return found

    def gemv_rows(kernel: str) -> list[int]:
        return [int(mt) for mt in re.findall(r"linear_gemv<__half, \d, (\d+),", kernel)]

    wide = linear.MMA_M1_MAX_N + 8
    tail = "else atlas::linear_tiled<__half, 2, false>(x, w, bias, bias_stride, y, N, K);"
    for archs in (("sm80",), ("sm90",), ("sm86", "sm90"), ()):
        prefill = kernels(100, archs)
        assert gemv_rows(prefill[8]) == [] and gemv_rows(prefill[wide]) == [1], archs
        for k in prefill.values():
            decode = k[k.index("if (M <= 32)"):k.index("\n  }\n")]
            assert decode.rstrip().endswith(tail), decode
        assert "const bool vec" not in prefill[8] and "const bool vec" in prefill[wide]
    assert gemv_rows(kernels(100, ("sm75",))[8]) == [1, 2, 4, 8, 16, 32]
    assert gemv_rows(kernels(100, ("sm75", "sm90"))[wide]) == [1, 2, 4, 8, 16, 32]
    assert gemv_rows(kernels(4, ("sm90",))[8]) == [1, 2, 4]  # decode-sized: no tiled path to fall back to


def test_linear_decode_steps_in_flight(monkeypatch):
    """ATLAS_LINEAR_U sets the MMA decode's weight steps in flight per warp (kernel_lab --u); a value
    outside 1 .. 8 is a CodegenError naming the variable."""
    from atlasc.codegen import linear
    from atlasc.codegen.generate import CodegenError
    from test_codegen_matmul_attention import generate

    def units() -> set[str]:
        src = generate(build_linear("float16", 4, ks=(64,), ns=(8,))).source
        return set(re.findall(r"linear_mma_decode<__half, 2, 1, (\d+),", src))

    assert units() == {str(linear.MMA_DECODE_U[1])}
    monkeypatch.setenv(linear.U_ENV, "8")
    assert units() == {"8"}
    monkeypatch.setenv(linear.U_ENV, "9")
    with pytest.raises(CodegenError, match="ATLAS_LINEAR_U='9'"):
        units()
