"""fuse-linear-prologue: bit-identical decode entries on every decoder fixture, what fires (a Llama
decode layer in 5 kernels), the row limit that keeps prefill unfused, fusion off, serialization of
the fused ops, and the generated CUDA compiling (sm75 without tensor cores, sm80, sm90)."""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir import interpret
from atlasc.ir.program import CompileOptions, Program
from atlasc.ir.ops.prologue import PROLOGUE_MAX_M
from atlasc.passes.fuse_linear_prologue import ROTARY_ENV
from atlasc.pipeline import PIPELINES, run_pipeline
from atlasc.runtime.generate import Sampling

from conftest import FIXTURES, arch_params

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
LLAMA_LIKE = [n for n in DECODERS if not n.startswith("gpt2")]
FUSED_OPS = ("NormLinear", "ElementwiseLinear", "NormLinearQ", "NormLinearRotary")


@functools.cache
def before_after(name: str, max_batch: int = 4, quant: str = "none", zero_points: bool = False,
                 rotary: str = "auto"):
    """(program before, program after) fuse-linear-prologue: the default pipeline up to it, verified
    (quantized: int4 with groups of 32, so that the fixtures' K = 64 layers are quantized too), with
    ATLAS_ROTARY_EPILOGUE=rotary."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ROTARY_ENV, rotary)
        return _before_after(name, max_batch, quant, zero_points)


def _before_after(name: str, max_batch: int, quant: str, zero_points: bool):
    names = PIPELINES["default"]
    upto = names[: names.index("fuse-linear-prologue")]
    options = CompileOptions(archs=("sm90",), max_batch=max_batch, max_seq=64, quant=quant, group_size=32,
                             zero_points=zero_points)
    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, options)
    program, _ = run_pipeline(program, upto, verify_each=True)
    before = {k: g.clone() for k, g in program.entries.items()}
    program, report = run_pipeline(program, ["fuse-linear-prologue"], verify_each=True)
    return program, before, report.records[0]


def _decode(graph, program, name: str):
    z = np.load(FIXTURES / f"{name}.decode.npz")
    ins = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    kv = program.kv_cache
    state = {"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}
    past = ins["past_key_values.0.key"].shape[2]
    b = ins["input_ids"].shape[0]
    for layer in range(kv.layers):
        state["kv_cache"][layer, 0, :b, :, :past] = ins[f"past_key_values.{layer}.key"]
        state["kv_cache"][layer, 1, :b, :, :past] = ins[f"past_key_values.{layer}.value"]
    feed = {v.name: ins[v.name] for v in graph.inputs if v.name in ins} | Sampling().inputs(0)
    out = interpret(graph, feed, state=state, symbols={program.roles["past"]: past})
    return out, state["kv_cache"]


@pytest.mark.parametrize("rotary", ["auto", "1"])
@pytest.mark.parametrize("name", DECODERS)
def test_decode_entry_bit_identical(name, rotary):
    program, before, _ = before_after(name, rotary=rotary)
    got, cache_got = _decode(program.entries["decode"], program, name)
    want, cache_want = _decode(before["decode"], program, name)
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(cache_got, cache_want)


@pytest.mark.parametrize("rotary", ["auto", "1"])
@pytest.mark.parametrize("name", LLAMA_LIKE)
def test_llama_decode_layer_kernels(name, rotary):
    """With ATLAS_ROTARY_EPILOGUE=1: NormLinearRotary (norm, Q/K/V, rotary, cache append), Attention,
    Linear (o), NormLinear (gate/up + SwiGLU), Linear (down) per layer, 5 kernels; by default (auto) a float
    projection keeps QKVRotary after its NormLinear: 6. The last norm joins the LM head. Prefill keeps its
    separate norms, QKVRotary and SwiGLU."""
    program, before, record = before_after(name, rotary=rotary)
    layers = program.kv_cache.layers
    fused = rotary == "1"
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    assert decode["NormLinear"] == (1 if fused else 2) * layers + 1 and decode["Linear"] == 2 * layers, decode
    assert decode["NormLinearRotary"] == (layers if fused else 0), decode
    assert decode["QKVRotary"] == (0 if fused else layers), decode
    assert decode["RMSNormalization"] == decode["AddRMSNormalization"] == 0, decode
    assert decode["FusedElementwise"] < Counter(n.op for n in before["decode"].nodes)["FusedElementwise"]
    gated = [n for n in program.entries["decode"].nodes if n.op == "NormLinear" and n.attrs.get("epilogue")]
    assert len(gated) == layers, decode  # SwiGLU on every gate/up projection
    per_layer = sum(decode[op] for op in ("NormLinear", "NormLinearRotary", "ElementwiseLinear", "Linear",
                                          "QKVRotary", "Attention"))
    assert per_layer == (5 if fused else 6) * layers + 1, decode
    prefill = Counter(n.op for n in program.entries["prefill"].nodes)
    assert not any(prefill[op] for op in FUSED_OPS), prefill
    assert record.applied and any("rows may exceed" in why for why in record.declined.values())
    # the residual stream goes on from the fused node's second output
    graph = program.entries["decode"]
    for node in (n for n in graph.nodes if n.op == "NormLinear" and n.inputs[1] is not None):
        assert len(node.outputs) == 2
    for node in (n for n in graph.nodes if n.op == "NormLinearRotary"):
        assert len(node.outputs) == (4 if node.inputs[1] is not None else 3)


@pytest.mark.parametrize("quant,zero_points", [("int8", False), ("int4", False), ("int4", True), ("fp8", False)])
def test_quantized_decode_layer(quant, zero_points, monkeypatch):
    """Quantized projections take the norm, SwiGLU and the rotary the same way (NormLinearQ and
    NormLinearRotary, the default): 5 kernels per layer, the decode entry bit-identical on the CPU."""
    from atlasc.passes.fuse_linear_prologue import QUANT_ENV

    name = "llama-fp16"
    monkeypatch.delenv(QUANT_ENV, raising=False)
    program, before, _ = before_after(name, quant=quant, zero_points=zero_points)
    layers = program.kv_cache.layers
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    assert decode["NormLinearQ"] == layers + 1 and decode["NormLinear"] == 0, decode
    rotary = [n for n in program.entries["decode"].nodes if n.op == "NormLinearRotary"]
    assert len(rotary) == layers and all(n.attrs["linear"] != "Linear" for n in rotary), decode
    gated = [n for n in program.entries["decode"].nodes if n.op == "NormLinearQ" and n.attrs.get("epilogue")]
    assert len(gated) == layers
    got, cache_got = _decode(program.entries["decode"], program, name)
    want, cache_want = _decode(before["decode"], program, name)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(cache_got, cache_want)


def test_quantized_prologue_can_be_turned_off(monkeypatch):
    """With ATLAS_QUANT_PROLOGUE=0 quantized projections keep their separate norms (declined with the
    variable's name); the float ones still fuse."""
    from atlasc.passes.fuse_linear_prologue import QUANT_ENV

    monkeypatch.setenv(QUANT_ENV, "0")
    program, _, record = before_after("llama-fp16", max_batch=3, quant="int8")
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    assert decode["NormLinearQ"] == 0 and decode["AddRMSNormalization"] > 0, decode
    assert any(QUANT_ENV in why for why in record.declined.values())


def test_rows_above_the_limit_stay_unfused():
    """--max-batch 16: prefill and decode (up to 16 rows) keep their norms; only split-decode's
    decode_small (at most 8 rows) fuses."""
    program, before, record = before_after("llama", max_batch=PROLOGUE_MAX_M * 2)
    for name in ("prefill", "decode"):
        assert not [n for n in program.entries[name].nodes if n.op in FUSED_OPS]
        assert len(program.entries[name].nodes) == len(before[name].nodes)
    assert [n for n in program.entries["decode_small"].nodes if n.op in FUSED_OPS]
    assert record.applied and any("rows may exceed" in why for why in record.declined.values())


@pytest.mark.parametrize("rows", [1, 4])
def test_elementwise_prologue_only_for_one_row(rows):
    """A program feeding a Linear joins it (ElementwiseLinear, equal on the CPU) at one row; at more rows
    it is declined (every block would recompute it: docs/perf.md v7)."""
    from atlasc.ir import symbolic as S
    from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
    from atlasc.passes.fuse_linear_prologue import fuse_linear_prologue

    rng = np.random.default_rng(5)
    g = Graph("main")
    g.symbols = {"batch": SymbolInfo(1, rows)}
    x = Value("x", "float16", (S.sym("batch"), 16))
    h, y = Value("h", "float16", x.shape), Value("y", "float16", (S.sym("batch"), 8))
    prog = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))))
    g.inputs, g.outputs = [x], [y]
    g.nodes = [Node("FusedElementwise", [x], [h], {"program": prog, "out_shape": x.shape, "out_dtype": "float16"}),
               Node("Linear", [h, constant("w", rng.standard_normal((8, 16)).astype(np.float16))], [y])]
    program = Program({"main": g}, CompileOptions(max_batch=rows))
    program.bounds = {"main": {"batch": rows}}
    feed = {"x": rng.standard_normal((rows, 16)).astype(np.float16)}
    want = interpret(g.clone(), feed)["y"]
    program, stats = fuse_linear_prologue(program)
    ops = [n.op for n in program.entries["main"].nodes]
    if rows == 1:
        assert ops == ["ElementwiseLinear"] and stats.applied
        np.testing.assert_array_equal(interpret(program.entries["main"], feed)["y"], want)
    else:
        assert ops == ["FusedElementwise", "Linear"]
        assert any("only for 1 row" in why for why in stats.declined.values())


def test_fusion_off_is_a_no_op():
    program = Program({"main": import_onnx(FIXTURES / "llama.onnx")},
                      CompileOptions(max_batch=4, max_seq=64, fusion=False))
    program, report = run_pipeline(program, verify_each=True)
    assert not report.records[PIPELINES["default"].index("fuse-linear-prologue")].applied
    for graph in program.entries.values():
        assert not [n for n in graph.nodes if n.op in FUSED_OPS]


def test_fused_ops_serialize():
    from atlasc.ir.serialize import decode_attrs, encode_attrs

    program, _, _ = before_after("llama", rotary="1")
    fused = [n for n in program.entries["decode"].nodes if n.op in FUSED_OPS]
    assert {n.op for n in fused} == {"NormLinear", "NormLinearRotary"}
    for node in fused:
        assert decode_attrs(node.op, json.loads(json.dumps(encode_attrs(node.attrs)))) == node.attrs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_prologue_kernels_compile(arch):
    """The GPU test's graphs (every path: MMA decode, 16-byte and scalar GEMV, quant.cu's tensor-core path
    and fallback; float32 and float16) in one module compile for sm90 and for sm75 (no tensor cores)."""
    from atlasc.codegen.nvcc import compile_cubins
    from test_codegen_matmul_attention import generate
    from test_kernels_linear_prologue_gpu import build_prologue

    builders = [build_prologue(dtype, ks=(128, 70)) for dtype in ("float32", "float16")]  # every path, fewer kernels
    mod = generate(*builders, plan_kw={b.g.name: {"transposed": {"at"}} for b in builders})
    assert "atlas::lin_norm_stage<float" in mod.source and "atlas::lin_norm_stage<__half" in mod.source
    assert "atlas::XFn<" in mod.source and "lin_red, lin_epi);" in mod.source and "vec, lin_epi);" in mod.source
    assert "atlas::linear_mma_decode<__half" in mod.source and "atlas::linear_mma_decode<float" not in mod.source
    assert "atlas::linear_quant_mma<__half, 2, 4, 32, " in mod.source and ", true>(xv, " in mod.source
    assert compile_cubins(mod.source, (arch,))[arch]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_norm_loads_ahead_switch(arch, monkeypatch):
    """ATLAS_NORM_LOADS_AHEAD=1: lin_norm_stage takes AHEAD = the 16-byte chunks per thread of a row (K 64 -> 1, 4096
    float16 -> 2), none beyond NORM_AHEAD_MAX (float32 K 4096: 4) or off it, and the module compiles; unset, the
    source is the default form's; another value is a CodegenError naming the switch."""
    from atlasc.codegen import linear_prologue
    from atlasc.codegen.generate import CodegenError
    from atlasc.codegen.nvcc import compile_cubins
    from test_codegen_matmul_attention import generate
    from test_kernels_linear_prologue_gpu import build_prologue

    def source(dtype, ks):
        b = build_prologue(dtype, ks=ks)
        return generate(b, plan_kw={b.g.name: {"transposed": {"at"}}}).source

    monkeypatch.delenv(linear_prologue.NORM_AHEAD_ENV, raising=False)
    default = source("float16", (64, 4096))
    assert "atlas::lin_norm_stage<__half, true, 2>(" in default and ", 2, 1>(" not in default
    monkeypatch.setenv(linear_prologue.NORM_AHEAD_ENV, "1")
    ahead = source("float16", (64, 4096))
    for chunks in (1, 2):  # K 64, K 4096
        assert f"atlas::lin_norm_stage<__half, true, 2, {chunks}>(" in ahead
    assert "atlas::lin_norm_stage<__half, true, 2>(" not in ahead
    wide = source("float32", (4096,))
    assert "atlas::lin_norm_stage<float, true, 2>(" in wide and "atlas::lin_norm_stage<float, true, 2, " not in wide
    assert compile_cubins(ahead, (arch,))[arch]
    monkeypatch.setenv(linear_prologue.NORM_AHEAD_ENV, "2")
    with pytest.raises(CodegenError, match=linear_prologue.NORM_AHEAD_ENV):
        source("float16", (64,))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_rotary_prologue_kernels_compile(arch):
    """The GPU test's NormLinearRotary graphs (float and quantized, full / partial / no rotary; float16 and
    float32, K = 4096 and 70) compile for sm90 (sm75: the float16 K = 4096 one), their epilogue being
    LinRotary."""
    from atlasc.codegen import generate_module
    from atlasc.codegen.nvcc import compile_cubins
    from test_codegen_matmul_attention import kv_spec
    from test_kernels_linear_prologue_gpu import ROT_KV, build_rotary, rotary_plan

    entries = {}
    for dtype in ("float32", "float16"):
        for k in (4096, 70):
            b = build_rotary(dtype, k)
            graph = b.done()
            cache = np.zeros((ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"],
                              ROT_KV["head_dim"]), np.dtype(dtype))
            plan, kv_offset = rotary_plan(graph, b.upper, cache)
            mod = generate_module({"run": (graph, plan)}, {"run": b.upper}, kv_spec(dtype, kv_offset, ROT_KV))
            assert "atlas::LinRotary<" in mod.source and "lin_epi);" in mod.source
            assert len(mod.launches["run"]) == len(graph.nodes)
            entries[f"{dtype}_{k}"] = mod.source
    chosen = entries if arch == "sm90" else {"float16_4096": entries["float16_4096"]}
    assert all(compile_cubins(src, (arch,))[arch] for src in chosen.values())


@pytest.mark.parametrize("mode,quant,fused", [("0", "int8", False), ("auto", "none", False), ("auto", "int8", True),
                                             ("1", "none", True), ("", "none", True)])
def test_rotary_epilogue_modes(mode, quant, fused):
    """ATLAS_ROTARY_EPILOGUE: 0 keeps QKVRotary its own kernel even for quantized projections, auto fuses
    quantized ones only, 1 (the default, unset) float ones too; declined candidates say nothing of it (not a
    decline: the NormLinear is made either way)."""
    program, _, _ = before_after("llama", quant=quant, rotary=mode)
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    layers = program.kv_cache.layers
    assert decode["NormLinearRotary"] == (layers if fused else 0), decode
    assert decode["QKVRotary"] == (0 if fused else layers), decode


def test_rotary_epilogue_bad_value_is_a_usage_error(monkeypatch):
    from atlasc.errors import UsageError

    monkeypatch.setenv(ROTARY_ENV, "yes")
    with pytest.raises(UsageError, match="ATLAS_ROTARY_EPILOGUE='yes'"):
        _before_after("llama", 4, "none", False)


def test_prologue_grid_cap_switch(monkeypatch):
    """The fused kernels' grid cap: PROLOGUE_MAX_GRID above one row or with int8 x, at one row none for
    quantized weights and FLOAT_MAX_GRID_ONE_ROW for float ones; ATLAS_PROLOGUE_MAX_GRID replaces it
    everywhere; a value that is not a positive integer is a CodegenError naming it."""
    from atlasc.codegen import linear_prologue
    from atlasc.codegen.generate import CodegenError

    from atlasc.codegen.generate import MAX_GRID

    monkeypatch.delenv(linear_prologue.GRID_ENV, raising=False)
    for weights in ("quantized", "float", "act8"):
        assert linear_prologue.grid_cap(8, weights) == linear_prologue.PROLOGUE_MAX_GRID
    assert linear_prologue.grid_cap(1, "quantized") == MAX_GRID  # one row: no cap
    assert linear_prologue.grid_cap(1, "float") == linear_prologue.FLOAT_MAX_GRID_ONE_ROW
    assert linear_prologue.grid_cap(1, "act8") == linear_prologue.PROLOGUE_MAX_GRID
    assert linear_prologue.grid_cap(1, "act8", gated=True) == linear_prologue.ACT8_GATED_GRID_ONE_ROW == 396
    assert linear_prologue.grid_cap(8, "act8", gated=True) == linear_prologue.PROLOGUE_MAX_GRID
    assert linear_prologue.grid_cap(1, "quantized", gated=True) == MAX_GRID
    monkeypatch.setenv(linear_prologue.GRID_ENV, "100000")
    assert linear_prologue.grid_cap(1, "act8") == linear_prologue.grid_cap(8, "float") == 100000
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv(linear_prologue.GRID_ENV, bad)
        with pytest.raises(CodegenError, match=linear_prologue.GRID_ENV):
            linear_prologue.grid_cap(1)


def test_prologue_act8_grid_switch(monkeypatch):
    """ATLAS_PROLOGUE_ACT8_GRID caps the one-row kernels with int8 x only (the float-x and multi-row caps keep
    their defaults); ATLAS_PROLOGUE_MAX_GRID wins over it; a bad value is a CodegenError naming it."""
    from atlasc.codegen import linear_prologue
    from atlasc.codegen.generate import MAX_GRID, CodegenError

    monkeypatch.delenv(linear_prologue.GRID_ENV, raising=False)
    monkeypatch.setenv(linear_prologue.ACT8_GRID_ENV, "396")
    assert linear_prologue.grid_cap(1, "act8") == 396
    monkeypatch.setenv(linear_prologue.ACT8_GRID_ENV, "264")
    assert linear_prologue.grid_cap(1, "act8", gated=True) == 264  # the gated kernels' default replaced too
    monkeypatch.setenv(linear_prologue.ACT8_GRID_ENV, "396")
    assert linear_prologue.grid_cap(8, "act8") == linear_prologue.PROLOGUE_MAX_GRID
    assert linear_prologue.grid_cap(1, "quantized") == MAX_GRID
    assert linear_prologue.grid_cap(1, "float") == linear_prologue.FLOAT_MAX_GRID_ONE_ROW
    monkeypatch.setenv(linear_prologue.GRID_ENV, "100")
    assert linear_prologue.grid_cap(1, "act8") == 100
    monkeypatch.delenv(linear_prologue.GRID_ENV)
    monkeypatch.setenv(linear_prologue.ACT8_GRID_ENV, "lots")
    with pytest.raises(CodegenError, match=linear_prologue.ACT8_GRID_ENV):
        linear_prologue.grid_cap(1, "act8")


@pytest.mark.parametrize("archs,fused", [(("sm90",), True), (("sm86", "sm90"), False), (("sm80",), True),
                                         (("sm75",), False)])
def test_staging_fits_the_smallest_arch(archs, fused):
    """8 rows of K = 8192 in float16 stage 128 KB: fused for sm90 (227 KB per block) and sm80 (163 KB), not
    in a compile that also targets sm86 (99 KB) or sm75 (64 KB), whose launch would fail."""
    from atlasc.ir import symbolic as S
    from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
    from atlasc.ir.ops.prologue import staging_limit
    from atlasc.passes.fuse_linear_prologue import fuse_linear_prologue

    rng = np.random.default_rng(6)
    k = 8192
    g = Graph("main")
    g.symbols = {"batch": SymbolInfo(1, 8)}
    a = Value("a", "float16", (S.sym("batch"), k))
    x, y = Value("x", "float16", a.shape), Value("y", "float16", (S.sym("batch"), 16))
    scale = constant("g", rng.standard_normal(k).astype(np.float16))
    g.inputs, g.outputs = [a], [y]
    g.nodes = [Node("RMSNormalization", [a, scale], [x], {"epsilon": 1e-5}),
               Node("Linear", [x, constant("w", rng.standard_normal((16, k)).astype(np.float16))], [y])]
    program = Program({"main": g}, CompileOptions(archs=archs, max_batch=8))
    program.bounds = {"main": {"batch": 8}}
    program, stats = fuse_linear_prologue(program)
    ops = [n.op for n in program.entries["main"].nodes]
    assert (ops == ["NormLinear"]) == fused, (ops, stats.declined)
    if not fused:
        assert any(f"{staging_limit(archs) // 1024} KB" in why for why in stats.declined.values())


def _copy_engine_program(monkeypatch, archs=("sm90",), tma_norm="1"):
    """llama-fp16 at --max-batch 16 up to and through fuse-linear-prologue, for `archs`, ATLAS_TMA_NORM=tma_norm."""
    from atlasc.passes.fuse_linear_prologue import TMA_NORM_ENV

    monkeypatch.setenv(TMA_NORM_ENV, tma_norm)
    names = PIPELINES["default"]
    options = CompileOptions(archs=archs, max_batch=16, max_seq=64)
    program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")}, options)
    program, _ = run_pipeline(program, names[: names.index("fuse-linear-prologue")], verify_each=True)
    before = {k: g.clone() for k, g in program.entries.items()}
    program, report = run_pipeline(program, ["fuse-linear-prologue"], verify_each=True)
    return program, before, report.records[0]


def test_copy_engine_norms_above_8_rows(monkeypatch):
    """An sm90-only compile at --max-batch 16: the decode entry (batches 9..16) fuses each gate/up projection's
    AddRMSNormalization (the copy-engine kernel sums each row's squares from its stages) and the norm's scale folds
    into the weight in every entry (fold_norm_scale.py: prefill's and decode_small's readers of the weight read it
    folded, their norms a scale of ones); the LM head and the 16-dim heads' QKV projection keep their norms and
    scales, declined with the reason; the decode entry computes what it did to float16 tolerance (the fold rounds
    W g once)."""
    from atlasc.passes.fold_norm_scale import RULE

    program, before, record = _copy_engine_program(monkeypatch)
    layers = program.kv_cache.layers
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    gated = [n for n in program.entries["decode"].nodes if n.op == "NormLinear"]
    assert len(gated) == layers and all(n.attrs.get("epilogue") and n.inputs[1] is not None for n in gated), decode
    norms = decode["AddRMSNormalization"] + decode["RMSNormalization"]
    assert norms == layers + 1, decode  # the QKV projections' (the first without a residual) and the LM head's
    assert not any(n.op in FUSED_OPS for n in program.entries["prefill"].nodes)
    assert record.applied[RULE] == layers
    folded = {id(n.inputs[3]) for n in gated}
    assert all(np.all(n.inputs[2].data == 1) for n in gated)
    for entry, graph in program.entries.items():  # every reader of a folded weight: scale-free norms
        producers = graph.producers()
        readers = [n for n in graph.nodes if any(id(v) in folded for v in n.inputs if v is not None)]
        assert len(readers) == layers, entry
        for n in readers:
            g = n.inputs[2] if n.op == "NormLinear" else producers[id(n.inputs[0])].inputs[-1]
            assert np.all(g.data == 1), (entry, n.name)
    whys = list(record.declined.values())
    assert any("the LM head keeps its norm kernel" in w for w in whys), whys
    assert any("fuses into gate/up projections only" in w for w in whys), whys
    kept = [n for n in program.entries["decode"].nodes if n.op in ("AddRMSNormalization", "RMSNormalization")]
    assert kept and not any(np.all(n.inputs[-1].data == 1) for n in kept)  # QKV's and the LM head's scales stay
    # prefill (reading the folded weights through scale-free norms) against its graph before the pass
    z = np.load(FIXTURES / "llama-fp16.prefill.npz")
    prefill = program.entries["prefill"]
    feed = {v.name: z["in." + v.name] for v in prefill.inputs if "in." + v.name in z.files}
    feed |= Sampling().inputs(0)
    runs = []
    for graph in (prefill, before["prefill"]):
        state = {"kv_cache": np.zeros(program.kv_cache.shape, np.dtype(program.kv_cache.dtype))}
        runs.append(interpret(graph, feed, state=state, symbols={program.roles["past"]: 0}))
    np.testing.assert_allclose(runs[0]["logits"].astype(np.float32), runs[1]["logits"].astype(np.float32),
                               rtol=2e-2, atol=2e-3)
    got, cache_got = _decode(program.entries["decode"], program, "llama-fp16")
    want, cache_want = _decode(before["decode"], program, "llama-fp16")
    for key in want:
        if want[key].dtype.kind == "f":
            np.testing.assert_allclose(got[key].astype(np.float32), want[key].astype(np.float32), rtol=2e-2,
                                       atol=2e-3, err_msg=key)
    np.testing.assert_allclose(cache_got.astype(np.float32), cache_want.astype(np.float32), rtol=2e-2, atol=2e-3)


def test_fold_declines_a_weight_read_without_its_norm():
    """fold_norm_scale.foldable: a weight also read by a Linear whose x is not that norm's output cannot fold; one
    whose T(W g) overflows float16 neither (folded gives None)."""
    from atlasc.ir import symbolic as S
    from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
    from atlasc.passes.fold_norm_scale import foldable, folded

    k = 64
    g_ = Graph("two")
    g_.symbols = {"m": SymbolInfo(1, 32)}
    x, y = (Value(n, "float16", (S.sym("m"), k)) for n in ("x", "y"))
    g_.inputs = [x, y]
    scale = constant("g", np.full(k, 2.0, np.float16))
    w = constant("w", np.full((8, k), 40000.0, np.float16))
    w2 = constant("w2", np.ones((8, k), np.float16))
    n1, z1, z2, z3 = (Value(n, "float16", (S.sym("m"), s)) for n, s in (("n", k), ("z1", 8), ("z2", 8), ("z3", 8)))
    g_.nodes = [Node("RMSNormalization", [x, scale], [n1], {"axis": -1, "epsilon": 1e-5}),
                Node("Linear", [n1, w2], [z1], {}),
                Node("Linear", [y, w2], [z2], {}),
                Node("Linear", [y, w], [z3], {})]
    g_.outputs = [z1, z2, z3]
    program = Program({"main": g_}, CompileOptions(archs=("sm90",)))
    assert foldable(program) == {}  # w2 is also read from y; w is not norm-fed
    g_.nodes[2].inputs[1] = w2 = constant("w3", np.ones((8, k), np.float16))
    assert set(foldable(program)) == {id(g_.nodes[1].inputs[1])}
    assert folded(program, w, scale) is None  # 40000 * 2 overflows float16
    np.testing.assert_array_equal(folded(program, g_.nodes[1].inputs[1], scale), np.full((8, k), 2.0, np.float16))


@pytest.mark.parametrize("archs, tma_norm", [(("sm80", "sm90"), "1"), (("sm90",), "0")])
def test_copy_engine_norms_need_the_path(monkeypatch, archs, tma_norm):
    """Beside another arch (no copy-engine path) or with ATLAS_TMA_NORM=0 the decode entry keeps its norms."""
    program, _, record = _copy_engine_program(monkeypatch, archs, tma_norm)
    assert not any(n.op in FUSED_OPS for n in program.entries["decode"].nodes)
    assert any("only the copy-engine path fuses them" in w for w in record.declined.values())


def test_copy_engine_norm_switch_is_checked(monkeypatch):
    from atlasc.errors import UsageError
    from atlasc.passes.fuse_linear_prologue import TMA_NORM_ENV, tma_norm_mode

    monkeypatch.setenv(TMA_NORM_ENV, "on")
    with pytest.raises(UsageError, match="ATLAS_TMA_NORM='on' is not one of 0, 1, all"):
        tma_norm_mode()


@pytest.mark.parametrize("head_dim, mode, fused", [(128, "all", True), (64, "all", False), (128, "1", False)])
def test_copy_engine_norm_into_qkv_rotary(head_dim, mode, fused, monkeypatch):
    """AddRMSNormalization -> Linear -> QKVRotary at 9..32 rows with ATLAS_TMA_NORM=all: NormLinearRotary (with the
    sum as its 4th output) where the heads are 128 wide, as the copy-engine kernel rotates them; 64-dim heads keep
    the norm, and so does the default (=1: gate/up projections only)."""
    from atlasc.passes.fuse_linear_prologue import TMA_NORM_ENV

    monkeypatch.setenv(TMA_NORM_ENV, mode)
    from atlasc.ir import symbolic as S
    from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
    from atlasc.passes.fuse_linear_prologue import fuse_graph
    from atlasc.passes.rewrite import RewriteStats

    k, heads = 256, 3
    g = Graph("qkv")
    g.symbols = {"batch": SymbolInfo(1, 32), "past_seq": SymbolInfo(0, 8)}
    x, r = (Value(n, "float16", (S.sym("batch"), 1, k)) for n in ("x", "r"))
    cos, sin = (Value(n, "float16", (1, 1, head_dim)) for n in ("cos", "sin"))
    g.inputs = [x, r, cos, sin]
    rng = np.random.default_rng(3)
    scale = constant("g", rng.uniform(0.5, 1.5, k).astype(np.float16))
    w = constant("w", rng.standard_normal((heads * head_dim, k)).astype(np.float16))
    normed, total = Value("n", "float16", x.shape), Value("s", "float16", x.shape)
    z = Value("z", "float16", (S.sym("batch"), 1, heads * head_dim))
    q, pk, pv = (Value(n, "float16", (S.sym("batch"), 1, 1, head_dim)) for n in ("q", "pk", "pv"))
    g.nodes = [Node("AddRMSNormalization", [x, r, scale], [normed, total], {"axis": -1, "epsilon": 1e-5}),
               Node("Linear", [normed, w], [z], {}),
               Node("QKVRotary", [z, cos, sin], [q, pk, pv], {"q_heads": 1, "kv_heads": 1, "head_dim": head_dim,
                                                             "layer": 0, "past": S.sym("past_seq")})]
    g.outputs = [q, total]
    stats = RewriteStats()
    fuse_graph(g, {"batch": 32, "past_seq": 8}, stats, ("sm90",), {"batch": 8}, can_fold=lambda w, g: None)
    ops = [n.op for n in g.nodes]
    assert ops == (["NormLinearRotary"] if fused else ["AddRMSNormalization", "Linear", "QKVRotary"]), stats.declined
    if fused:
        assert g.nodes[0].outputs[3] is total


def test_one_row_int8_x_grids_follow_their_epilogue(monkeypatch):
    """At one row on the 8B gate/up shape, the int8-x kernel with the SwiGLU epilogue launches
    ACT8_GATED_GRID_ONE_ROW blocks and the one without (as the LM head) PROLOGUE_MAX_GRID;
    ATLAS_PROLOGUE_ACT8_GRID replaces both."""
    import sys

    from atlasc.codegen import linear_prologue

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    from quant_lab import generate as lab_generate

    def grid(variant: str) -> int:
        launches = lab_generate(4096, 28672, 1, "int4", variant, act="int8")[2].launches["run"]
        return launches[0].grid[0]

    monkeypatch.delenv(linear_prologue.GRID_ENV, raising=False)
    monkeypatch.delenv(linear_prologue.ACT8_GRID_ENV, raising=False)
    assert grid("gated-a8") == linear_prologue.ACT8_GATED_GRID_ONE_ROW
    assert grid("norm-a8") == linear_prologue.PROLOGUE_MAX_GRID
    monkeypatch.setenv(linear_prologue.ACT8_GRID_ENV, "200")
    assert grid("gated-a8") == grid("norm-a8") == 200
