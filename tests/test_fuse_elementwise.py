"""fuse-elementwise: pass equivalence on every fixture (bit-identical on the CPU), structure, the
safety rule, serialization of FusedElementwise, and the generated CUDA compiling for sm80 + sm90.

The small group graphs built here (`build_*`) are shared with tests/test_kernels_fused_gpu.py.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter

import numpy as np
import pytest
from test_codegen_reduce_movement import Group

from atlasc.frontend import import_onnx
from atlasc.ir import interpret, verify
from atlasc.ir.graph import constant
from atlasc.ir.ops import get
from atlasc.ir.program import CompileOptions, Program
from atlasc.ir.serialize import decode_attrs, encode_attrs
from atlasc.passes.fuse_elementwise import find_groups, fuse_graph
from atlasc.passes.rewrite import RewriteStats
from atlasc.pipeline import PIPELINES, run_pipeline

from conftest import FIXTURES

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
NAMES = [f["name"] for f in MANIFEST]
CASES = [(f["name"], c) for f in MANIFEST for c in f["cases"]]


@functools.cache
def fused_main(name: str):
    """(unfused, fused) "main" graphs: canonicalize + dce, then fuse-elementwise, verified after each."""
    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")})
    program, _ = run_pipeline(program, ["canonicalize", "dce"], verify_each=True)
    before = program.entries["main"].clone()
    program, _ = run_pipeline(program, ["fuse-elementwise"], verify_each=True)
    return before, program.entries["main"]


def load_inputs(name: str, case: str) -> dict:
    z = np.load(FIXTURES / f"{name}.{case}.npz")
    return {k[3:]: z[k] for k in z.files if k.startswith("in.")}


# -- equivalence on the fixtures -----------------------------------------------------------------


@pytest.mark.parametrize("name,case", CASES)
def test_fixture_outputs_bit_identical(name, case):
    before, after = fused_main(name)
    ins = load_inputs(name, case)
    want, got = interpret(before, ins), interpret(after, ins)
    assert list(got) == list(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and got[key].shape == w.shape, key
        np.testing.assert_array_equal(got[key], w, err_msg=key)  # NaN == NaN here, bit-for-bit otherwise


@pytest.mark.parametrize("name", NAMES)
def test_fixture_structure(name):
    before, after = fused_main(name)
    fused = [n for n in after.nodes if n.op == "FusedElementwise"]
    assert fused, "every fixture has at least one elementwise chain"
    assert len(after.nodes) < len(before.nodes)
    # graph outputs keep their names and order
    assert [v.name for v in after.outputs] == [v.name for v in before.outputs]
    # every value some kept node reads, or the graph returns, is still defined
    defined = {v.name for v in after.inputs} | {o.name for n in after.nodes for o in n.outputs}
    for n in after.nodes:
        for i in n.inputs:
            assert i is None or i.is_constant or i.name in defined
    # the groups partition the replaced nodes: every vanished node is a step of exactly one fused node
    kept = {n.name for n in after.nodes}
    vanished = Counter(n.op for n in before.nodes if n.name not in kept)
    # ... except last-axis Split/Slice nodes whose outputs a fused node now reads through `slices`
    absorbed = Counter({op: vanished[op] for op in ("Split", "Slice") if vanished[op]})
    assert sum(absorbed.values()) <= sum(sl is not None for n in fused for sl in n.attrs.get("slices") or ())
    assert vanished - absorbed == Counter(step[0] for n in fused for step in n.attrs["program"])
    assert all(get(op).kind == "elementwise" for op in vanished - absorbed)


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama-fp16"])
def test_default_pipeline_entries(name):
    """On prefill/decode (after entry-points and the other fusions) groups form and the safety rule holds."""
    names = PIPELINES["default"]
    upto = names[: names.index("fuse-elementwise")]
    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, CompileOptions(max_batch=4, max_seq=64))
    program, _ = run_pipeline(program, upto, verify_each=True)
    before = {k: g.clone() for k, g in program.entries.items()}
    stats = RewriteStats()
    for entry, graph in program.entries.items():
        _check_safety(graph, find_groups(graph, stats))
        fuse_graph(graph, stats)
        verify(graph)
        assert [v.name for v in graph.outputs] == [v.name for v in before[entry].outputs]
        assert len(graph.nodes) < len(before[entry].nodes)


def _check_safety(graph, groups):
    """Style item 8: only values read by one node of the same group (never graph outputs) vanish."""
    outputs = {id(o) for o in graph.outputs}
    seen = set()
    for group in groups:
        members = {id(n) for n in group}
        assert not members & seen, "groups overlap"
        seen |= members
        for n in group[:-1]:
            v = n.outputs[0]
            assert id(v) not in outputs
            assert all(id(u) in members for u in graph.users(v))


def test_fusion_off_is_a_no_op():
    b = silu_mul_group("float32")
    program = Program({"main": b.g}, CompileOptions(fusion=False))
    program, report = run_pipeline(program, ["fuse-elementwise"], verify_each=True)
    assert [n.op for n in program.entries["main"].nodes] == ["Sigmoid", "Mul", "Mul"]
    assert not report.records[0].applied


# -- small groups: the safety rule, broadcasting, declines --------------------------------------


def rmsnorm_tail_group(dtype: str) -> Group:
    """x * (1 / sqrt(mean + eps)) * w, the fp16 spelling with llama's Cast; the [b, s, 1] steps are
    smaller than the output and get recomputed per element."""
    b = Group(f"rms_tail_{dtype}", {"b": (1, 3), "s": (1, 37)})
    x = b.input("x", "float32", ("b", "s", 64))
    ms = b.input("ms", "float32", ("b", "s", 1), gen=lambda rng, shape, env: rng.uniform(0.1, 2.0, shape))
    w = b.input("w", dtype, (64,))
    (t,) = b.node("Add", [ms, constant("eps", np.array(1e-6, np.float32))], returned=False)
    (t,) = b.node("Sqrt", [t], returned=False)
    (t,) = b.node("Reciprocal", [t], returned=False)
    (t,) = b.node("Mul", [x, t], returned=False)
    if dtype != "float32":
        (t,) = b.node("Cast", [t], {"to": dtype}, returned=False)
    b.node("Mul", [t, w], name="y")
    return b.done()


def silu_mul_group(dtype: str) -> Group:
    """a * sigmoid(a) * b (SwiGLU's tail)."""
    b = Group(f"silu_mul_{dtype}", {"n": (1, 70)})
    a = b.input("a", dtype, ("n", 96), gen=lambda rng, shape, env: rng.normal(0.0, 3.0, shape))
    u = b.input("u", dtype, ("n", 96))
    (s,) = b.node("Sigmoid", [a], returned=False)
    (t,) = b.node("Mul", [a, s], returned=False)
    b.node("Mul", [t, u], name="y")
    return b.done()


def mask_group(dtype: str) -> Group:
    """A causal + padding mask chain: two groups, because `ok` has two readers (Cast and Where)."""
    b = Group(f"mask_{dtype}", {"b": (1, 3), "s": (1, 19), "t": (1, 23)})
    qpos = b.input("qpos", "int64", ("s", 1), gen=lambda rng, shape, env: rng.integers(0, 30, shape))
    kpos = b.input("kpos", "int64", (1, "t"), gen=lambda rng, shape, env: rng.integers(0, 30, shape))
    mask = b.input("mask", "int64", ("b", 1, 1, "t"), gen=lambda rng, shape, env: rng.integers(0, 2, shape))
    scores = b.input("scores", dtype, ("b", 2, "s", "t"))
    (causal,) = b.node("LessOrEqual", [kpos, qpos], returned=False)
    (pad,) = b.node("Equal", [mask, constant("one", np.array(1, np.int64))], returned=False)
    (ok,) = b.node("And", [causal, pad], returned=False)
    (keep,) = b.node("Cast", [ok], {"to": dtype}, returned=False)
    (t,) = b.node("Mul", [scores, keep], returned=False)
    np_dt = np.dtype(np.float16 if dtype == "float16" else np.float32)
    (bias,) = b.node("Where", [ok, constant("zero", np.array(0, np_dt)), constant("neg", np.array(-1e4, np_dt))],
                     returned=False)
    b.node("Add", [t, bias], name="y")
    return b.done()


def gelu_tanh_group(dtype: str) -> Group:
    """GPT-2's tanh GELU as exported: 0.5 * x * (1 + tanh(0.79788 * (x + 0.044715 * x^3)))."""
    b = Group(f"gelu_tanh_{dtype}", {"n": (1, 50)})
    x = b.input("x", dtype, ("n", 80), gen=lambda rng, shape, env: rng.normal(0.0, 2.0, shape))
    np_dt = np.dtype(dtype)

    def c(name, v):
        return constant(name, np.array(v, np_dt))

    (h,) = b.node("Mul", [x, c("half", 0.5)], returned=False)
    (p,) = b.node("Pow", [x, c("three", 3.0)], returned=False)
    (p,) = b.node("Mul", [p, c("k", 0.044715)], returned=False)
    (p,) = b.node("Add", [x, p], returned=False)
    (p,) = b.node("Mul", [p, c("s2pi", 0.7978845608)], returned=False)
    (p,) = b.node("Tanh", [p], returned=False)
    (p,) = b.node("Add", [p, c("one", 1.0)], returned=False)
    b.node("Mul", [h, p], name="y")
    return b.done()


def int_group() -> Group:
    """Integer arithmetic (C-truncating Div, Python-style Mod), Max, Clip with an omitted min, Not."""
    b = Group("int_chain", {"n": (1, 40)})
    x = b.input("x", "int64", ("n", 8), gen=lambda rng, shape, env: rng.integers(-50, 50, shape))
    d = b.input("d", "int64", (8,), gen=lambda rng, shape, env: rng.choice([-3, -2, 2, 5], shape))
    (t,) = b.node("Div", [x, d], returned=False)
    (t,) = b.node("Mod", [t, constant("m", np.array(7, np.int64))], returned=False)
    (t,) = b.node("Max", [t, x], returned=False)
    (t,) = b.node("Clip", [t, None, constant("hi", np.array(20, np.int64))], returned=False)
    (t,) = b.node("Greater", [t, constant("z", np.array(3, np.int64))], returned=False)
    b.node("Not", [t], name="y")
    return b.done()


GROUPS = {
    **{f"rms_tail_{dt}": (lambda dt=dt: rmsnorm_tail_group(dt)) for dt in ("float32", "float16")},
    **{f"silu_mul_{dt}": (lambda dt=dt: silu_mul_group(dt)) for dt in ("float32", "float16")},
    **{f"mask_{dt}": (lambda dt=dt: mask_group(dt)) for dt in ("float32", "float16")},
    **{f"gelu_tanh_{dt}": (lambda dt=dt: gelu_tanh_group(dt)) for dt in ("float32", "float16")},
    "int_chain": int_group,
}
EXPECTED_GROUPS = {"rms_tail": 1, "silu_mul": 1, "mask": 2, "gelu_tanh": 1, "int_chain": 1}


def fused(group: Group) -> Group:
    """The group with its graph fused (a fresh copy; the unfused graph stays in group.g)."""
    out = Group(group.g.name, {})
    out.g, out.upper, out.gen = group.g.clone(), group.upper, group.gen
    fuse_graph(out.g, RewriteStats())
    verify(out.g)
    return out


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_group_fuses_and_matches(name):
    group = GROUPS[name]()
    f = fused(group)
    n_fused = sum(n.op == "FusedElementwise" for n in f.g.nodes)
    assert n_fused == EXPECTED_GROUPS[name.rsplit("_float", 1)[0]]
    assert len(f.g.nodes) == n_fused  # nothing left over in these chains
    assert [v.name for v in f.g.outputs] == ["y_out0"]
    rng = np.random.default_rng(7)
    feeds = group.inputs(rng, {s: i.upper for s, i in group.g.symbols.items()})
    want, got = interpret(group.g, feeds), interpret(f.g, feeds)
    np.testing.assert_array_equal(got["y_out0"], want["y_out0"])


def test_shared_value_and_graph_output_are_kept():
    b = Group("shared", {"n": (1, 8)})
    x = b.input("x", "float32", ("n", 4))
    (e,) = b.node("Exp", [x], returned=False)
    (s,) = b.node("Neg", [e], name="s")  # a graph output: may only be a root
    (t,) = b.node("Add", [s, e], returned=False)  # e now has two readers
    b.node("Mul", [t, t], name="y")
    g = b.done().g
    stats = RewriteStats()
    fuse_graph(g, stats)
    verify(g)
    ops = [n.op for n in g.nodes]
    assert ops == ["Exp", "Neg", "FusedElementwise"], ops
    assert [st[0] for st in g.nodes[-1].attrs["program"]] == ["Add", "Mul"]
    assert [v.name for v in g.outputs] == ["s_out0", "y_out0"]
    why = " | ".join(stats.declined.values())
    assert "is a graph output" in why and "has 2 readers" in why


def test_input_larger_than_the_output_declines():
    b = Group("grow", {"n": (1, 8)})
    x = b.input("x", "float32", ("n", 1))
    w = b.input("w", "float32", ("n", 6))
    (t,) = b.node("Exp", [x], returned=False)
    (t,) = b.node("Mul", [t, w], returned=False)  # [n, 6]: grows past Sum's other input
    b.node("Cast", [t], {"to": "float16"}, name="y")
    g = b.done().g
    fuse_graph(g, RewriteStats())
    assert [n.op for n in g.nodes] == ["FusedElementwise"]  # Exp broadcasts into [n, 6]: fine
    b = Group("shrink", {"n": (1, 8)})
    x = b.input("x", "float32", ("n", 6))
    (t,) = b.node("Exp", [x], returned=False)
    (t,) = b.node("ReduceSum", [t], {"axes": (1,), "keepdims": 1}, returned=False)
    b.node("Neg", [t], name="y")
    g = b.done().g
    fuse_graph(g, RewriteStats())
    assert [n.op for n in g.nodes] == ["Exp", "ReduceSum", "Neg"]  # a reduction breaks the chain


# -- the op itself -------------------------------------------------------------------------------


def test_serialize_round_trip():
    for name in ("mask_float16", "int_chain", "rms_tail_float16"):
        g = fused(GROUPS[name]()).g
        for n in g.nodes:
            text = json.dumps(encode_attrs(n.attrs))
            back = decode_attrs(n.op, json.loads(text))
            assert back == n.attrs
            assert isinstance(back["program"], tuple) and all(isinstance(s[2], tuple) for s in back["program"])
            hash(back["program"])


def test_shape_rule_rejects_bad_programs():
    from atlasc.errors import ShapeError
    from atlasc.ir.ops import TensorType

    op = get("FusedElementwise")
    x = TensorType("float32", (4, 3))
    good = {"program": (("Exp", (), (("in", 0),)),), "out_shape": (4, 3), "out_dtype": "float32"}
    assert op.infer([x], good) == [x]
    bad = [
        dict(good, program=(("MatMul", (), (("in", 0), ("in", 0))),)),  # not elementwise
        dict(good, program=(("Exp", (), (("step", 0),)),)),  # refers to itself
        dict(good, program=(("Exp", (), (("in", 1),)),)),  # no such input
        dict(good, out_shape=(4, 1)),  # inputs broadcast past out_shape
        dict(good, out_dtype="float16"),
    ]
    for attrs in bad:
        with pytest.raises(ShapeError):
            op.infer([x], attrs)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_generated_module_compiles_for_sm80_and_sm90():
    from kernel_harness import trivial_plan

    from atlasc.codegen import generate_module
    from atlasc.codegen.nvcc import compile_cubins

    groups = [fused(build()) for build in GROUPS.values()]
    entries, upper = {}, {}
    for k, f in enumerate(groups):
        entries[f"g{k}"] = (f.g, trivial_plan(f.g, f.upper)[0])
        upper[f"g{k}"] = f.upper
    mod = generate_module(entries, upper)
    assert sum(len(launches) for launches in mod.launches.values()) == sum(len(f.g.nodes) for f in groups)
    kernels = {launch.kernel for launches in mod.launches.values() for launch in launches}
    assert len(mod.kernels) == len(kernels)  # groups equal but for their offsets share one (codegen/share.py)
    assert "atlas::round_f16" in mod.source and "__fmul_rn" in mod.source
    cubins = compile_cubins(mod.source, ("sm80", "sm90"))
    assert all(c[:4] == b"\x7fELF" for c in cubins.values())
