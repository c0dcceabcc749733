"""GPU numerics of the offset dequantization (ATLAS_QUANT_OFS=1, quant.cu QlinOfs) against the reference.

The path applies to kernels of one row of float16 x with int4 groups of a multiple of 128 (quant.py ofs_applies):
the graph's rows are bounded by 1. It covers LinearQ4 (x from global memory) with K in {128, 4096, 14336}
(one step, the 8B shapes' K), groups of 128 and 256 (a group spans two steps), with and without bias and zero
points, N not a multiple of 16; NormLinearQ (x staged by the fused RMSNorm in shared memory, then again in
the OFS order) plain, with the residual sum, and with the SwiGLU epilogue, symmetric and with zero points; and
NormLinearRotary over int4 (the decode step's QKV projection: rotary and both cache appends as its epilogue).
int8 and FP8 nodes (LinearQ8 with K in {64, 4096, 14336}, with and without bias, NormLinearQ int8 with the SwiGLU
epilogue, LinearF8) never take it: int8's form (one correction of -1152 sum x per row) was measured and removed
(docs/perf.md v28: 4.4e-3 of max |y| off at K = 14336 in this file's second trial).

The chain of MMAs starts at minus the step's offset sums, so its float32 partial sums are ~1000x larger than
the result: each output is checked against the reference with the tolerance of the other quantized kernels
(2e-2 of max |y|, tests/test_kernels_quant_gpu.py) and against the default path's own error on the same
inputs: at most twice it plus 1e-3 of max |y| (the fp16 output rounding of either path may flip). The offsets
grow with the mean of x, not its spread (the tensor cores' float32 sums truncate relative to their largest
term), so the second trial shifts every x by +0.5 (uniform on [-0.5, 1.5]: mean 0.87 of the spread).
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes.quantize import quantize_fp8, quantize_int4, quantize_int4_asym, quantize_int8

# (K, N, group); N = 16384: the width where ATLAS_QUANT_OFS=auto takes the path (quant.OFS_MIN_N)
LINEAR_CASES = [(128, 40, 128), (4096, 1000, 128), (14336, 72, 128), (512, 70, 256), (128, 16384, 128)]
ZP_CASES = [(4096, 72, 128), (512, 40, 256)]
INT8_CASES = [(64, 40), (4096, 1000), (14336, 72)]  # (K, N)
SWIGLU = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))), ("Mul", (), (("step", 1), ("in", 1))))


def _const(b, name, a):
    return b.input(name, str(a.dtype), a.shape, gen=lambda rng, shape, a=a: a)


def build_ofs():
    """LinearQ4 / LinearQ8 / LinearF8 and NormLinearQ nodes over one row of float16 x (see the module docstring)."""
    from test_codegen_matmul_attention import Builder

    b = Builder("quant_ofs", {"m": (1, 1)})
    xs = {}
    for i, (k, n, group) in enumerate(LINEAR_CASES + ZP_CASES):
        w = np.random.default_rng(30 + i).uniform(-1 if i < len(LINEAR_CASES) else -0.5, 1, (n, k)) / np.sqrt(k)
        if k not in xs:
            xs[k] = b.input(f"x{k}", "float16", ("m", k))
        if i < len(LINEAR_CASES):
            wq, scale = quantize_int4(w.astype(np.float32), group)
            zero = None
        else:
            wq, scale, zero = quantize_int4_asym(w.astype(np.float32), group)
        ins = [xs[k], _const(b, f"w{i}", wq), _const(b, f"s{i}", scale)]
        tail = [_const(b, f"z{i}", zero)] if zero is not None else []
        b.node("LinearQ4", ins + ([None] if tail else []) + tail, {"group_size": group})
        b.node("LinearQ4", ins + [b.input(f"b{i}", "float16", (n,))] + tail, {"group_size": group})
    for i, (k, n) in enumerate(INT8_CASES):
        w = (np.random.default_rng(60 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        if k not in xs:
            xs[k] = b.input(f"x{k}", "float16", ("m", k))
        ins = [xs[k], *(_const(b, f"{name}8_{i}", a) for name, a in zip("ws", quantize_int8(w)))]
        b.node("LinearQ8", ins)
        b.node("LinearQ8", ins + [b.input(f"b8_{i}", "float16", (n,))])
    wf, sf = quantize_fp8((np.random.default_rng(70).uniform(-1, 1, (40, 4096)) / 64).astype(np.float32))
    b.node("LinearF8", [xs[4096], _const(b, "wf", wf), _const(b, "sf", sf)])  # FP8 codes: never OFS
    k, n = 4096, 1000
    w = np.random.default_rng(40).uniform(-1, 1, (n, k)) / np.sqrt(k)
    wq, scale = quantize_int4(w.astype(np.float32), 128)
    wq_z, scale_z, zero = quantize_int4_asym(w.astype(np.float32) + 0.3 / np.sqrt(k), 128)
    a, r = b.input("a", "float16", ("m", k)), b.input("r", "float16", ("m", k))
    g = b.input("g", "float16", (k,))
    q4 = [_const(b, "nw", wq), _const(b, "ns", scale)]
    q4z = [_const(b, "nwz", wq_z), _const(b, "nsz", scale_z), None, _const(b, "nz", zero)]
    attrs = {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128}
    swiglu = {"epilogue": SWIGLU, "gate_input": 0}
    b.node("NormLinearQ", [a, None, g, *q4], attrs)
    b.node("NormLinearQ", [a, r, g, *q4], attrs | swiglu, outputs=2)
    b.node("NormLinearQ", [a, None, g, *q4z], attrs | swiglu)
    q8 = [_const(b, f"n{name}8", a) for name, a in zip("ws", quantize_int8(w.astype(np.float32)))]
    b.node("NormLinearQ", [a, r, g, *q8], {"epsilon": 1e-5, "linear": "LinearQ8"} | swiglu, outputs=2)
    return b


def test_ofs_is_emitted_for_one_row_only(monkeypatch):
    """(CPU) ATLAS_QUANT_OFS=1 reaches every int4 node of the graph (rows bounded by 1), none of the int8 and FP8
    ones, with or without a K split (ATLAS_QUANT_KSPLIT=1); 0 none; auto (the default) the two int4 ones of N = 16384;
    with rows up to 2 none of them takes it."""
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import quant
    from atlasc.codegen.generate import generate_module

    builder = build_ofs()
    graph = builder.done()
    plan, _ = plan_for(graph, builder.upper)
    monkeypatch.setenv(quant.OFS_ENV, "1")
    source = generate_module({"run": (graph, plan)}, {"run": builder.upper}).source
    int4 = [n for n in graph.nodes if n.attrs.get("linear", n.op) == "LinearQ4"]
    int8 = [n for n in graph.nodes if n.attrs.get("linear", n.op) == "LinearQ8"]
    assert len(int8) == 7 and source.count("atlas::QlinOfs{") == len(int4)
    monkeypatch.setenv(quant.KS_ENV, "1")
    source = generate_module({"run": (graph, plan)}, {"run": builder.upper}).source
    assert source.count("atlas::QlinOfs{") == len(int4) == len(graph.nodes) - len(int8) - 1
    monkeypatch.delenv(quant.KS_ENV)
    # the zero points' kernels read (1024 S_e + 64 S_o, S_e + S_o) as a float2: 8-byte aligned
    assert source.count("__shared__ __align__(8) float qlin_ofs_c[") == len(int4)
    monkeypatch.setenv(quant.OFS_ENV, "0")
    assert "atlas::QlinOfs{" not in generate_module({"run": (graph, plan)}, {"run": builder.upper}).source
    monkeypatch.delenv(quant.OFS_ENV)
    assert quant.OFS_MIN_N == 16384
    assert generate_module({"run": (graph, plan)}, {"run": builder.upper}).source.count("atlas::QlinOfs{") == 2
    monkeypatch.setenv(quant.OFS_ENV, "1")
    two = {"m": 2}
    assert "atlas::QlinOfs{" not in generate_module({"run": (graph, plan_for(graph, two)[0])}, {"run": two}).source
    monkeypatch.setenv(quant.OFS_ENV, "yes")
    with pytest.raises(quant.CodegenError, match="ATLAS_QUANT_OFS='yes' is not a choice"):
        generate_module({"run": (graph, plan)}, {"run": builder.upper})


@pytest.mark.gpu
def test_ofs_matches_reference_and_the_default_path(monkeypatch):
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import quant
    from atlasc.ir import interpret

    builder = build_ofs()
    graph = builder.done()
    rng = np.random.default_rng(8)
    monkeypatch.setenv(quant.KS_ENV, "1")  # every int8 node a single K range (as OFS's int8 form needed; kept)
    for trial in range(2):
        feeds = builder.inputs(rng, {"m": 1})
        if trial == 1:  # x with a mean (the projections' x, the fused nodes' a and residual r)
            feeds = {name: (v.astype(np.float32) + 0.5).astype(np.float16) if name[0] == "x" or name in ("a", "r")
                     else v for name, v in feeds.items()}
        want = interpret(graph, feeds)
        got = {}
        for mode in ("0", "1"):
            monkeypatch.setenv(quant.OFS_ENV, mode)
            got[mode] = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for)
        for name, w in want.items():
            w = w.astype(np.float64)
            top = max(np.abs(w).max(), 1e-3)
            err = {mode: np.abs(got[mode][name].astype(np.float64) - w).max() for mode in got}
            assert np.isfinite(err["1"]) and err["1"] <= 2e-2 * top, f"{name} trial {trial}: err {err['1']} / {top}"
            assert err["1"] <= 2 * err["0"] + 1e-3 * top, f"{name} trial {trial}: {err['1']} vs default {err['0']}"


@pytest.mark.gpu
def test_ofs_rotary_projection_matches_reference(monkeypatch):
    """NormLinearRotary over int4 groups of 128 (symmetric with the residual add, zero points without) at batch
    1, one new position after 0 and 7 cached ones: q, both present views and the whole cache (tolerances of
    tests/test_kernels_linear_prologue_gpu.py)."""
    from test_codegen_matmul_attention import Builder
    from test_kernels_linear_prologue_gpu import ROT_HEADS, ROT_KV, check_with_cache, rotary_plan

    from atlasc.codegen import quant
    from atlasc.ir import symbolic as S

    monkeypatch.setenv(quant.OFS_ENV, "1")
    k, n = 4096, (ROT_HEADS["q_heads"] + 2 * ROT_HEADS["kv_heads"]) * ROT_HEADS["head_dim"]
    b = Builder("ofs_rotary", {"batch": (1, 1), "seq": (1, 1), "past_seq": (0, 10)})
    a, r = b.input("a", "float16", ("batch", "seq", k)), b.input("r", "float16", ("batch", "seq", k))
    g = b.input("g", "float16", (k,))
    cos, sin = b.input("cos", "float16", (1, "seq", 64)), b.input("sin", "float16", (1, "seq", 64))
    w = (np.random.default_rng(41).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
    wq, scale = quantize_int4(w, 128)
    wq_z, scale_z, zero = quantize_int4_asym(w + 0.3 / np.sqrt(k), 128)
    attrs = {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128, "past": S.sym("past_seq")} | ROT_HEADS
    b.node("NormLinearRotary", [a, r, g, cos, sin, _const(b, "w", wq), _const(b, "s", scale)], attrs | {"layer": 0},
           outputs=4)
    b.node("NormLinearRotary", [a, None, g, cos, sin, _const(b, "wz", wq_z), _const(b, "sz", scale_z), None,
                                _const(b, "z", zero)], attrs | {"layer": 1}, outputs=3)
    graph = b.done()
    kv = ROT_KV
    cache = np.zeros((kv["layers"], 2, kv["max_batch"], kv["kv_heads"], kv["max_seq"], kv["head_dim"]), np.float16)
    plan, kv_offset = rotary_plan(graph, b.upper, cache)
    spec = {"offset": kv_offset, "layers": kv["layers"], "max_batch": kv["max_batch"], "kv_heads": kv["kv_heads"],
            "max_seq": kv["max_seq"], "head_dim": kv["head_dim"], "dtype": "float16"}
    from atlasc.codegen.generate import generate_module

    assert generate_module({"run": (graph, plan)}, {"run": b.upper}, spec).source.count("atlas::QlinOfs{") == 2
    envs = ({"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 1, "seq": 1, "past_seq": 7})
    check_with_cache(b, "float16", rotary_plan, ROT_KV, np.random.default_rng(42), envs=envs)


def test_ofs_keeps_within_the_smallest_arch_shared_memory():
    """(CPU) A fused projection of K = 16384 stages its row (32 KB of dynamic shared memory); the offset
    dequantization's 32 KB more fit sm90 (227 KB per block) but not beside sm75's 64 KB: a compile for sm75 leaves
    it out, so the kernel still launches there."""
    from test_codegen_matmul_attention import Builder, plan_for

    from atlasc.codegen.generate import generate_module

    k, n = 16384, 16384
    b = Builder("ofs_room", {"m": (1, 1)})
    a, g = b.input("a", "float16", ("m", k)), b.input("g", "float16", (k,))
    w, s = b.input("w", "uint8", (n, k // 2)), b.input("s", "float16", (n, k // 128))
    b.node("NormLinearQ", [a, None, g, w, s], {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128})
    graph = b.done()
    plan, _ = plan_for(graph, b.upper)
    source = {arch: generate_module({"run": (graph, plan)}, {"run": b.upper}, archs=(arch,)).source
              for arch in ("sm90", "sm75")}
    assert "atlas::QlinOfs{" in source["sm90"] and "atlas::QlinOfs{" not in source["sm75"]


def test_min_blocks_bounds_the_one_row_kernels(monkeypatch, tmp_path):
    """(CPU) ATLAS_QUANT_MIN_BLOCKS=4: every kernel of the one-row graph (int4, int8 and FP8, plain and fused with the
    RMSNorm) gets __launch_bounds__(256, 4): ptxas (sm90) gives each 64 registers or fewer, and spills none in the
    symmetric ones of K >= 4096 (the Llama shapes' kind; the zero points' kernels spill 28-54 bytes, K = 128 8-16:
    what the A/B would weigh); unset or 0 none is bounded, nor any kernel of rows up to 2; values other than 0, 2,
    3, 4 are a CodegenError."""
    import re

    from test_codegen_matmul_attention import _nvcc_log, plan_for

    from atlasc.codegen import quant
    from atlasc.codegen.generate import generate_module

    builder = build_ofs()
    graph = builder.done()
    plan, _ = plan_for(graph, builder.upper)

    def source(value: str | None, upper=builder.upper, plan=plan) -> str:
        if value is None:
            monkeypatch.delenv(quant.MIN_BLOCKS_ENV, raising=False)
        else:
            monkeypatch.setenv(quant.MIN_BLOCKS_ENV, value)
        return generate_module({"run": (graph, plan)}, {"run": upper}).source

    bounded = source("4")
    assert bounded.count('__launch_bounds__(256, 4) run_') == len(graph.nodes)
    assert ", 4) run_" not in source(None) and source("0") == source(None)
    two = {"m": 2}
    assert ", 4) run_" not in source("4", two, plan_for(graph, two)[0])
    report = {}  # kernel -> (registers, spill stores, spill loads)
    for block in _nvcc_log(bounded, "sm90", tmp_path).split("Compiling entry function ")[1:]:
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        report[block.split("'")[1]] = (int(re.search(r"Used (\d+) registers", block).group(1)), int(spill.group(1)),
                                       int(spill.group(2)))
    assert len(report) == len(graph.nodes) and max(r for r, _, _ in report.values()) <= 64
    for i, node in enumerate(graph.nodes):
        zero_points = node.attrs.get("linear", node.op) == "LinearQ4" and len(node.inputs) > 4 + (node.op != "LinearQ4")
        if node.inputs[0].shape[-1] >= 4096 and not zero_points:
            (kernel,) = [k for k in report if k.startswith(f"run_{i:04d}_")]
            assert report[kernel][1:] == (0, 0), (kernel, report[kernel])
    for bad in ("1", "5", "x"):
        with pytest.raises(quant.CodegenError, match=quant.MIN_BLOCKS_ENV):
            source(bad)


@pytest.mark.gpu
def test_min_blocks_kernels_match_reference(monkeypatch):
    """ATLAS_QUANT_MIN_BLOCKS=4 (the same code at 64 registers): the one-row graph's outputs against the reference
    within the quantized kernels' 2e-2 of max |y|, with the default offset dequantization (auto) and with it on."""
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import quant
    from atlasc.ir import interpret

    builder = build_ofs()
    graph = builder.done()
    feeds = builder.inputs(np.random.default_rng(9), {"m": 1})
    want = interpret(graph, feeds)
    monkeypatch.setenv(quant.MIN_BLOCKS_ENV, "4")
    for mode in ("auto", "1"):
        monkeypatch.setenv(quant.OFS_ENV, mode)
        got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for)
        for name, w in want.items():
            w = w.astype(np.float64)
            top = max(np.abs(w).max(), 1e-3)
            err = np.abs(got[name].astype(np.float64) - w).max()
            assert np.isfinite(err) and err <= 2e-2 * top, f"{name} (OFS {mode}): err {err} / {top}"
