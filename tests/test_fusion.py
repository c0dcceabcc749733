"""The LLM fusion passes (RMSNorm, attention) on every decoder fixture: reference-equivalent entries,
and what fired. Outputs of the fused program are compared with onnxruntime's (the fixture cases) at
the fixture tolerances, and with the unfused program's."""

from __future__ import annotations

import functools
import json
from collections import Counter

import numpy as np
import pytest

from atlasc.frontend import import_onnx
from atlasc.ir import interpret
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline
from atlasc.runtime.generate import Sampling

from conftest import FIXTURES, TOL

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
# fixtures spelled as Llama's (RMSNorm, rotary); GPT-2 has LayerNorm, learned positions, split heads
LLAMA_LIKE = [n for n in DECODERS if not n.startswith("gpt2")]
GPT2_LIKE = [n for n in DECODERS if n.startswith("gpt2")]


@pytest.mark.parametrize("name", GPT2_LIKE)
def test_gpt2_split_heads_attention_is_fused(name):
    """GPT-2's Split -> Reshape -> Transpose heads (no rotary) feed one Attention per layer, which
    writes [B, S, H*D] straight into c_proj."""
    program = compiled(name, True)
    for entry in ("prefill", "decode"):
        counted = ops(program, entry)
        assert counted["Attention"] == program.kv_cache.layers and counted["Softmax"] == 0, counted
        atts = [n for n in program.entries[entry].nodes if n.op == "Attention"]
        assert all(n.attrs.get("out_bshd") for n in atts)
        # the split into heads and both cache appends: one QKVRotary without tables (no rotary)
        rot = [n for n in program.entries[entry].nodes if n.op == "QKVRotary"]
        assert len(rot) == program.kv_cache.layers and all(len(n.inputs) == 1 for n in rot), counted
        assert counted["KVAppend"] == 0 and counted["Split"] == 0 and counted["Transpose"] == 0, counted
        # residual adds joined their LayerNorms (ln_2 of every layer, ln_1 of the next, ln_f)
        assert counted["AddLayerNormalization"] == 2 * program.kv_cache.layers + 1, counted


@functools.cache
def compiled(name: str, fusion: bool) -> Program:
    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")},
                      CompileOptions(max_batch=4, max_seq=64, fusion=fusion))
    program, _ = run_pipeline(program, verify_each=True)
    return program


def run_case(program: Program, name: str, case: str):
    z = np.load(FIXTURES / f"{name}.{case}.npz")
    ins = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    kv = program.kv_cache
    state = {"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}
    past = ins["past_key_values.0.key"].shape[2]
    b, s = ins["input_ids"].shape
    for layer in range(kv.layers):
        state["kv_cache"][layer, 0, :b, :, :past] = ins[f"past_key_values.{layer}.key"]
        state["kv_cache"][layer, 1, :b, :, :past] = ins[f"past_key_values.{layer}.value"]
    graph = program.entries["decode" if s == 1 else "prefill"]
    feed = {v.name: ins[v.name] for v in graph.inputs if v.name in ins} | Sampling().inputs(0)
    out = interpret(graph, feed, state=state, symbols={program.roles["past"]: past})
    return out["logits"], z["out.logits"], state["kv_cache"]


def ops(program: Program, entry: str) -> Counter:
    return Counter(n.op for n in program.entries[entry].nodes)


@pytest.mark.parametrize("name,case", [(n, c) for n in DECODERS for c in ("prefill", "decode", "chunk")])
def test_fused_program_matches_onnxruntime_and_unfused(name, case):
    tol = TOL[next(f for f in MANIFEST if f["name"] == name)["dtype"]]
    fused, want, cache_fused = run_case(compiled(name, True), name, case)
    unfused, _, cache_unfused = run_case(compiled(name, False), name, case)
    np.testing.assert_allclose(fused.astype(np.float64), want.astype(np.float64), **tol)
    np.testing.assert_allclose(fused.astype(np.float64), unfused.astype(np.float64), **tol)
    np.testing.assert_allclose(cache_fused.astype(np.float64), cache_unfused.astype(np.float64), **tol)


@pytest.mark.parametrize("name", LLAMA_LIKE)
def test_rmsnorm_and_attention_fire_on_every_llama_spelling(name):
    program = compiled(name, True)
    layers = program.kv_cache.layers
    for entry in ("prefill", "decode"):
        counted = ops(program, entry)
        # the first norm reads the embedding; every later one is fused with its residual add (at
        # decode both kinds then join the projection they feed: tests/test_fuse_linear_prologue.py)
        norms = counted["RMSNormalization"], counted["AddRMSNormalization"]
        assert norms == ((1, 2 * layers) if entry == "prefill" else (0, 0)), counted
        assert counted["Attention"] == layers, counted
        assert counted["Softmax"] == 0
        # one linear layer per projection group: qkv, o, gate/up, down per layer, and the lm head
        linears = sum(counted[op] for op in ("Linear", "NormLinear", "ElementwiseLinear", "NormLinearRotary"))
        assert linears == 4 * layers + 1 and counted["MatMul"] == 0, counted
        # no repeat_kv copies of the cache left: only the fused attention reads the KV-cache views
        graph = program.entries[entry]
        for kv in (n for n in graph.nodes if n.op == "KVAppend"):
            assert {u.op for u in graph.users(kv.outputs[0])} <= {"Attention"}, entry
        for rot in (n for n in graph.nodes if n.op in ("QKVRotary", "NormLinearRotary")):
            for present in rot.outputs[1:3]:
                assert {u.op for u in graph.users(present)} == {"Attention"}, entry


@pytest.mark.parametrize("name", LLAMA_LIKE)  # llama-opset23 spells rotary as the RotaryEmbedding op
def test_decode_layer_is_a_handful_of_kernels(name):
    """QKV split + rotary + cache appends fold into one QKVRotary, the attention writes [B, S, H*D],
    SwiGLU reads the merged gate/up halves in place, reshapes alias: per layer at most 9 launches at
    prefill, 5 at decode (the norms, SwiGLU and the rotary + cache appends run inside the projections)."""
    program = compiled(name, True)
    layers = program.kv_cache.layers
    for entry in ("prefill", "decode"):
        counted = ops(program, entry)
        assert counted["QKVRotary"] + counted["NormLinearRotary"] == layers and counted["KVAppend"] == 0, counted
        # decode: the QKV projection takes the rotary (ATLAS_ROTARY_EPILOGUE=1); prefill keeps QKVRotary
        assert counted["NormLinearRotary"] == (layers if entry == "decode" else 0), counted
        assert counted["Split"] == 0 and counted["Transpose"] == 0, counted
        graph, plan = program.entries[entry], program.plans[entry]
        launched = [n for n in graph.nodes if plan.needs_kernel(n)]
        projections = ("Linear", "NormLinear", "ElementwiseLinear", "NormLinearRotary")
        per_layer = Counter(n.op for n in launched if n.op in (
            "AddRMSNormalization", "QKVRotary", "Attention", "FusedElementwise", *projections))
        # prefill: AddRMSNorm x2, Linear x4, QKVRotary, Attention, SwiGLU; decode: 6 (+ the final norm, lm
        # head, and the step's shared rotary/mask prologue elementwise groups)
        assert sum(per_layer[op] for op in projections) == 4 * layers + 1
        assert sum(per_layer.values()) <= (9 if entry == "prefill" else 6) * layers + 8, per_layer


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_no_fusion_leaves_the_decomposed_graph(name):
    fused, unfused = compiled(name, True), compiled(name, False)
    assert ops(unfused, "decode")["Attention"] == 0 and ops(unfused, "decode")["RMSNormalization"] == 0
    assert len(fused.entries["decode"].nodes) < len(unfused.entries["decode"].nodes)
