"""fuse-linear-epilogue: bit-identical decode entries on every decoder fixture at batch 9..32, what fires (a Llama
decode layer at batch 9..32 in 7 kernels), what is declined (prefill, float32, sm75, ATLAS_LINEAR_EPILOGUE=0,
fusion off), serialization of the fused ops, and the generated CUDA compiling (sm80, sm90) without spills."""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections import Counter

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.passes.fuse_linear_epilogue import ENV, GATED_RULE, ROTARY_RULE
from atlasc.pipeline import PIPELINES, run_pipeline

from conftest import FIXTURES
from test_fuse_linear_prologue import DECODERS, _decode

FUSED_OPS = ("LinearGated", "LinearRotary")


@functools.cache
def before_after(name: str, max_batch: int = 32, archs: tuple[str, ...] = ("sm90",)):
    """(program before, program after, the pass's record): the default pipeline up to fuse-linear-epilogue,
    verified, then the pass (ATLAS_LINEAR_EPILOGUE unset; ATLAS_TMA_NORM=0, else fuse-linear-prologue's copy-engine
    norms take the sm90 compiles' gate/up projections first: tests/test_fuse_linear_prologue.py)."""
    from atlasc.passes.fuse_linear_prologue import TMA_NORM_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        mp.setenv(TMA_NORM_ENV, "0")
        names = PIPELINES["default"]
        program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")},
                          CompileOptions(archs=archs, max_batch=max_batch, max_seq=64))
        program, _ = run_pipeline(program, names[: names.index("fuse-linear-epilogue")], verify_each=True)
        before = {k: g.clone() for k, g in program.entries.items()}
        program, report = run_pipeline(program, ["fuse-linear-epilogue"], verify_each=True)
        return program, before, report.records[0]


@pytest.mark.parametrize("name", DECODERS)
def test_decode_entry_bit_identical(name):
    """The batch-9..32 decode entry and decode_small compute what they did before the pass, bit for bit, KV cache
    included (the pass fires on the float16 llama-fp16; the float32 fixtures and GPT-2's QKV, read by more than
    the rotary, keep their nodes)."""
    program, before, record = before_after(name)
    assert bool(record.applied) == (name == "llama-fp16"), record.applied
    for entry in ("decode", "decode_small"):
        got, cache_got = _decode(program.entries[entry], program, name)
        want, cache_want = _decode(before[entry], program, name)
        assert list(got) == list(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        np.testing.assert_array_equal(cache_got, cache_want)


@pytest.mark.parametrize("name", ["llama-fp16"])  # the float16 Llama-like fixture (the others are float32)
def test_llama_decode_layer_kernels_at_batch_32(name):
    """float16, --max-batch 32: the decode entry (batch 9..32) runs each layer as AddRMSNormalization,
    LinearRotary, Attention, Linear (o), AddRMSNormalization, LinearGated, Linear (down): 7 kernels, no QKVRotary and
    no SwiGLU kernel; decode_small (prologues fused) and prefill (rows unbounded: declined) keep their ops."""
    program, before, record = before_after(name)
    layers = program.kv_cache.layers
    decode = Counter(n.op for n in program.entries["decode"].nodes)
    assert decode["LinearRotary"] == decode["LinearGated"] == layers, decode
    assert decode["QKVRotary"] == 0 and decode["Linear"] == 2 * layers + 1, decode  # o, down; the LM head
    assert Counter(n.op for n in before["decode"].nodes)["FusedElementwise"] - decode["FusedElementwise"] == layers
    per_layer = sum(decode[op] for op in ("AddRMSNormalization", "LinearRotary", "Attention", "Linear",
                                          "LinearGated"))
    assert per_layer == 7 * layers + 1, decode  # the LM head
    for entry in ("decode_small", "prefill"):
        assert not [n for n in program.entries[entry].nodes if n.op in FUSED_OPS], entry
    assert record.applied == {ROTARY_RULE: layers, GATED_RULE: layers}
    assert any("rows may exceed 32" in why for why in record.declined.values())


@pytest.mark.parametrize("name,archs,why", [("llama", ("sm90",), "not a float16 input"),
                                            ("llama-fp16", ("sm75", "sm90"), "below sm80")])
def test_declined_for_float32_and_old_archs(name, archs, why):
    """float32 projections and compiles that include an arch without the MMA decode keep their readers apart (the
    paired GEMV would read the weights once per row), and say why."""
    program, _, record = before_after(name, archs=archs)
    assert not record.applied
    assert not [n for g in program.entries.values() for n in g.nodes if n.op in FUSED_OPS]
    assert any(why in w for w in record.declined.values()), record.declined


def test_switch_and_fusion_off(monkeypatch):
    """ATLAS_LINEAR_EPILOGUE=0 and --no-fusion: the pass changes nothing; another value is a UsageError."""
    from atlasc.errors import UsageError
    from atlasc.passes.fuse_linear_epilogue import fuse_linear_epilogue

    for env, fusion in (("0", True), ("1", False)):
        monkeypatch.setenv(ENV, env)
        program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")},
                          CompileOptions(archs=("sm90",), max_batch=32, max_seq=64, fusion=fusion))
        program, report = run_pipeline(program, verify_each=True)
        assert not report.records[PIPELINES["default"].index("fuse-linear-epilogue")].applied
        assert not [n for g in program.entries.values() for n in g.nodes if n.op in FUSED_OPS]
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(UsageError, match="ATLAS_LINEAR_EPILOGUE='yes' is not 0 or 1"):
        fuse_linear_epilogue(program)


def test_fused_ops_serialize():
    from atlasc.ir.serialize import decode_attrs, encode_attrs

    program, _, _ = before_after("llama-fp16")
    fused = [n for n in program.entries["decode"].nodes if n.op in FUSED_OPS]
    assert {n.op for n in fused} == set(FUSED_OPS)
    for node in fused:
        assert decode_attrs(node.op, json.loads(json.dumps(encode_attrs(node.attrs)))) == node.attrs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_epilogue_kernels_compile_without_spills(arch):
    """The GPU test's graphs (tests/test_kernels_linear_epilogue_gpu.py: LinearGated at K 4096 / 64, LinearRotary
    at K 4096; MMA decode at J 1 / 2 / 4 and the chunked GEMV) compile for sm80 and sm90, each kernel without
    register spills (a paired GEMV over 32 rows took 244 registers)."""
    from atlasc.codegen import generate_module
    from test_codegen_matmul_attention import kv_spec, plan_for
    from test_kernels_linear_epilogue_gpu import EPI_KV, build_gated, build_linear_rotary

    sys_path_examples()
    from quant_lab import ptxas_report

    gated, rot = build_gated(), build_linear_rotary()
    g_graph, r_graph = gated.done(), rot.done()
    cache = np.zeros((EPI_KV["layers"], 2, EPI_KV["max_batch"], EPI_KV["kv_heads"], EPI_KV["max_seq"],
                      EPI_KV["head_dim"]), np.float16)
    g_plan, _ = plan_for(g_graph, gated.upper, transposed={"xt"})
    r_plan, kv_offset = plan_for(r_graph, rot.upper, cache, transposed={"xt"}, kv=EPI_KV)
    mod = generate_module({"gated": (g_graph, g_plan), "rot": (r_graph, r_plan)},
                          {"gated": gated.upper, "rot": rot.upper}, kv_spec("float16", kv_offset, EPI_KV))
    for j in (1, 2, 4):
        assert re.search(rf"linear_mma_decode<__half, \d, {j}, \d+, (true|false)>\(xs, .*lin_red, lin_epi\);",
                         mod.source)
    assert mod.source.count("atlas::LinRowsFrom<decltype(lin_epi)>{lin_epi, m0}") == len(g_graph.nodes) + len(
        r_graph.nodes)
    assert mod.source.count("atlas::LinRotary<__half> lin_epi{") == len(r_graph.nodes)
    report = ptxas_report(mod.source, arch)  # nvcc with the compiler's flags (raises if it fails)
    assert report and not [k for k, (_, stores, loads) in report.items() if stores or loads], report


def sys_path_examples() -> None:
    import sys

    from conftest import REPO

    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
