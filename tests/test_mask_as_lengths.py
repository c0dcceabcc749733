"""mask-as-lengths (on by default; ATLAS_MASK_LENGTHS=0 off): the Attention reads attention_mask [B, T]
and applies causal / window itself. On every decoder fixture: prefill (empty and non-empty past) and
decode compute the same outputs and cache on the reference as the pipeline without it, bit for bit, on
left-padded batches of fresh random tokens; fewer kernels per step; mistral's sliding window (8) is
recognized; a mask with an extra term is declined with the reason; the llama and mistral artifacts
compile with nvcc for sm90 and their CPU-runtime greedy tokens equal onnxruntime's."""

from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np
import pytest

from atlasc.compiler import compile_model
from atlasc.frontend import import_onnx
from atlasc.ir import interpret
from atlasc.ir.graph import Graph, Node, SymbolInfo, Value, constant
from atlasc.ir.program import CompileOptions, Program
from atlasc.passes.mask_as_lengths import ENV, RULE, mask_as_lengths, rewrite_graph
from atlasc.passes.rewrite import RewriteStats
from atlasc.pipeline import run_pipeline
from atlasc.runtime.generate import Sampling

from conftest import FIXTURES

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
WINDOWS = {"mistral": 8}
OPTIONS = CompileOptions(archs=("sm90",), max_batch=4, max_seq=64)  # as tests/test_compile.py: shares its cubins


class _env:
    """ATLAS_MASK_LENGTHS set to value inside the block (the cached builders below run outside tests)."""

    def __init__(self, value: str):
        self.value = value

    def __enter__(self):
        self.old = os.environ.get(ENV)
        os.environ[ENV] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.old


@functools.cache
def programs(name: str):
    """(with the pass, without it, the pass's record): the default pipeline, plans included."""
    out = []
    for value in ("1", "0"):
        with _env(value):
            out.append(run_pipeline(Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, OPTIONS),
                                    verify_each=True))
    record = next(r for r in out[0][1].records if r.name == "mask-as-lengths")
    return out[0][0], out[1][0], record


def _kernels(program, entry: str) -> int:
    return sum(program.plans[entry].needs_kernel(n) for n in program.entries[entry].nodes)


def _run(program, name: str, entry: str, b: int, s: int, past: int, pad: list[int], seed: int):
    """One step on the reference: fresh random tokens, left padding of pad[i] keys, a random cache."""
    rng = np.random.default_rng(seed)
    z = np.load(FIXTURES / f"{name}.decode.npz")
    vocab_hi = int(z["out.logits"].shape[-1])
    kv = program.kv_cache
    state = {"kv_cache": rng.uniform(-1, 1, kv.shape).astype(np.dtype(kv.dtype))}
    mask = np.ones((b, past + s), np.int64)
    for row, n in enumerate(pad):
        mask[row, :n] = 0
    graph = program.entries[entry]
    feed = {"input_ids": rng.integers(0, vocab_hi, (b, s)).astype(np.int64), "attention_mask": mask,
            "position_ids": np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, past:]} | Sampling().inputs(0)
    feed = {v.name: feed[v.name] for v in graph.inputs}
    symbols = {program.roles["past"]: past} | ({program.roles["seq"]: s} if entry == "prefill" else {})
    out = interpret(graph, feed, state=state, symbols=symbols)
    return out, state["kv_cache"]


# (entry, batch, seq, past, left padding per row): prefill from empty, a chunk on a past, decode steps
STEPS = [("prefill", 3, 7, 0, [0, 3, 6]), ("prefill", 2, 4, 6, [0, 8]), ("decode", 3, 1, 9, [0, 2, 9]),
         ("decode", 4, 1, 20, [0, 13, 1, 5])]


@pytest.mark.parametrize("name", DECODERS)
def test_outputs_unchanged_with_left_padding(name):
    got_p, base_p, _ = programs(name)
    for i, (entry, b, s, past, pad) in enumerate(STEPS):
        got, cache_got = _run(got_p, name, entry, b, s, past, pad, seed=i)
        want, cache_want = _run(base_p, name, entry, b, s, past, pad, seed=i)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} {entry} pad {pad}")
        np.testing.assert_array_equal(cache_got, cache_want, err_msg=f"cache {entry} pad {pad}")


@pytest.mark.parametrize("name", DECODERS)
def test_every_attention_reads_attention_mask_and_fewer_kernels_run(name):
    got_p, base_p, record = programs(name)
    layers = got_p.kv_cache.layers
    assert record.applied == {RULE: layers * len(got_p.entries)}, record
    for entry, graph in got_p.entries.items():
        atts = [n for n in graph.nodes if n.op == "Attention"]
        assert len(atts) == layers
        for att in atts:
            assert att.inputs[3].name == "attention_mask" and att.attrs["key_mask"] == 1
            assert att.attrs["causal"] == 1 and att.attrs["window"] == WINDOWS.get(name, 0)
        assert not {"GatherND", "Range", "Where"} & {n.op for n in graph.nodes}, entry
        assert _kernels(got_p, entry) < _kernels(base_p, entry), entry
    assert _kernels(base_p, "prefill") - _kernels(got_p, "prefill") >= 8


def test_on_by_default_off_with_0_and_bad_values_rejected(monkeypatch):
    from atlasc.errors import UsageError
    from atlasc.passes.mask_as_lengths import enabled

    monkeypatch.delenv(ENV, raising=False)
    assert enabled()
    monkeypatch.setenv(ENV, "0")
    program = Program({"decode": Graph("decode")}, OPTIONS)
    _, stats = mask_as_lengths(program)
    assert not stats.applied and stats.declined[RULE] == f"{ENV}=0"
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(UsageError, match=ENV):
        mask_as_lengths(program)


def test_encoder_mask_becomes_padding_only():
    """minilm's [B, 1, S, S] padding mask: causal 0, no window; the forward output is unchanged."""
    with _env("1"):
        got = run_pipeline(Program({"main": import_onnx(FIXTURES / "minilm.onnx")}, OPTIONS), verify_each=True)[0]
    with _env("0"):
        base = run_pipeline(Program({"main": import_onnx(FIXTURES / "minilm.onnx")}, OPTIONS), verify_each=True)[0]
    atts = [n for n in got.entries["forward"].nodes if n.op == "Attention"]
    assert atts and all(a.attrs["key_mask"] == 1 and a.attrs["causal"] == 0 and a.attrs["window"] == 0 for a in atts)
    z = np.load(FIXTURES / "minilm.forward.npz")
    feed = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    feed["attention_mask"] = feed["attention_mask"].copy()
    feed["attention_mask"][1, 5:] = 0  # right padding
    a = interpret(got.entries["forward"], feed, symbols={})
    b = interpret(base.entries["forward"], feed, symbols={})
    for key in b:
        np.testing.assert_array_equal(a[key], b[key])


def _hand_built(extra: bool) -> Graph:
    """Attention over [B, 1, S, T] = where(am != 0 and t <= past + s, 0, min) (+ 1 on key 0 if extra)."""
    g = Graph("decode")
    g.symbols = {"batch": SymbolInfo(1, 4), "past": SymbolInfo(0, 31)}
    from atlasc.ir import symbolic as S

    t = S.add(S.sym("past"), 1)
    am = Value("attention_mask", "int64", (S.sym("batch"), t))
    q = Value("q", "float32", (S.sym("batch"), 2, 1, 8))
    k = Value("k", "float32", (S.sym("batch"), 2, t, 8))
    v = Value("v", "float32", (S.sym("batch"), 2, t, 8))
    g.inputs = [am, q, k, v]
    pad = Value("pad", "bool", am.shape)
    flat = Value("flat", "float32", am.shape)
    g.nodes = [Node("Equal", [am, constant("zero", np.zeros((), np.int64))], [pad], {}, name="eq"),
               Node("Where", [pad, constant("fill", np.array(np.finfo(np.float32).min, np.float32)),
                              constant("open", np.zeros((), np.float32))], [flat], {}, name="where")]
    if extra:
        bump = np.zeros((1, 32), np.float32)
        bump[0, 0] = 1.0
        sliced = Value("bump_t", "float32", (1, t))
        plus = Value("plus", "float32", am.shape)
        g.nodes += [Node("Slice", [constant("bump", bump)], [sliced], {"starts": (0,), "ends": (t,), "axes": (1,),
                                                                       "steps": (1,)}, name="slice"),
                    Node("Add", [flat, sliced], [plus], {}, name="add")]
        flat = plus
    mask = Value("mask", "float32", (S.sym("batch"), 1, 1, t))
    y = Value("y", "float32", q.shape)
    g.nodes += [Node("Unsqueeze", [flat], [mask], {"axes": (1, 2)}, name="unsq"),
                Node("Attention", [q, k, v, mask], [y], {"scale": 0.3}, name="att")]
    g.outputs = [y]
    return g


def test_a_mask_with_an_extra_term_is_declined():
    roles, bounds = {"batch": "batch", "past": "past"}, {"batch": 4, "past": 31}
    for extra in (False, True):
        g = _hand_built(extra)
        stats = RewriteStats()
        rewrite_graph(g, roles, bounds, stats)
        att = g.nodes[-1]
        if not extra:  # the same graph without the extra term is padding only: rewritten
            assert stats.applied == {RULE: 1} and att.attrs["key_mask"] == 1 and att.inputs[3].name == "attention_mask"
            continue
        assert not stats.applied and att.inputs[3].name == "mask"
        (why,) = stats.declined.values()
        assert "extra term" in why


nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@functools.cache
def _artifact(name: str, folder: str) -> str:
    path = f"{folder}/{name}.atlas"
    with _env("1"):
        compile_model(FIXTURES / f"{name}.onnx", path, OPTIONS)
    return path


@nvcc
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_compiles_for_sm90_and_greedy_matches_onnxruntime(name, tmp_path_factory):
    """A real nvcc compile of the KEYS kernels (prefill: attention_decode tiles, decode: the sequence
    split); the artifact's report records the pass; the CPU runtime's greedy tokens equal onnxruntime's."""
    from atlasc.artifact import open_artifact
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.generate import generate
    from ort_reference import ort_greedy

    path = _artifact(name, str(tmp_path_factory.mktemp("mask_lengths")))
    with open_artifact(path) as art:
        assert art.cubin("sm90")[:4] == b"\x7fELF"
        assert "atlas::attention_decode<" in art.source() and ", true>(args" in art.source()
        passes = {p["name"]: p["applied"] for p in art.manifest.report["passes"]}
        assert passes["mask-as-lengths"] == {RULE: 2 * 2}
        prompts = [[5, 17, 42, 7, 99, 3, 11, 12, 13, 14], [3, 8]]  # mistral: past the window of 8
        want, _ = ort_greedy(FIXTURES / f"{name}.onnx", prompts, 12)
        assert generate(CpuModel(art), prompts, 12).tokens == want
