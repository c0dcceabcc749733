"""Reduction and data-movement code generation (CPU: generate + nvcc; no GPU needed).

Every op and dtype variant of the `reduce` family (codegen/reduce.py) and the `movement` family
(codegen/movement.py) is generated and compiled for sm80 and sm90, all groups in ONE module (nvcc
costs about a second per module). The groups are built by the `build_*` functions below, which the
GPU tests (tests/test_kernels_reduce_movement_gpu.py) reuse for numeric checks at several run-time
sizes. Some values get a non-contiguous placement (`Group.strided`): a Transpose writes its output
through those strides and the ops under test read it through them.

Snapshot: the wrapper code generated for a small LayerNormalization + Concat graph must equal
tests/snapshots/reduce_movement.cu (the shared templates are left out, so that edits to other
families do not touch it). After an intended change, regenerate it with
    ATLAS_UPDATE_SNAPSHOTS=1 python -m pytest -q tests/test_codegen_reduce_movement.py -k snapshot
and review the diff.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import arch_params

from atlasc.codegen import generate_module
from atlasc.codegen.generate import HERE, CodegenError, _load_families
from atlasc.ir import OPS, Graph, Node, SymbolInfo, TensorType, Value, verify
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.memory import Placement

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
FLOATS = ("float32", "float16")


# -- graph building ------------------------------------------------------------------------------


class Group:
    """A test graph of mostly independent nodes: inputs with symbolic dims, outputs inferred by the
    op table; `strided` maps value names to element strides (dims) for their placement."""

    def __init__(self, name: str, symbols: dict[str, tuple[int, int]]):
        self.g = Graph(name)
        self.g.symbols = {s: SymbolInfo(lo, hi) for s, (lo, hi) in symbols.items()}
        self.upper = {s: hi for s, (_, hi) in symbols.items()}
        self.gen: dict[str, object] = {}  # input name -> generator(rng, shape, env)
        self.strided: dict[str, tuple] = {}
        self.n = 0

    def input(self, name: str, dtype: str, shape, gen=None) -> Value:
        v = Value(name, dtype, tuple(S.sym(d) if isinstance(d, str) else d for d in shape))
        self.g.inputs.append(v)
        if gen is not None:
            self.gen[name] = gen
        return v

    def node(self, op: str, inputs: list, attrs: dict | None = None, returned: bool = True,
             name: str | None = None, n_outputs: int | None = None) -> list[Value]:
        """Add `op` (its first n_outputs inferred outputs, all by default); returned: graph outputs."""
        self.n += 1
        name = name or f"{op.lower()}{self.n}"
        opdef = OPS[op]
        full = opdef.fill_attrs(dict(attrs or {}))
        types = opdef.infer([None if i is None else TensorType(i.dtype, i.shape) for i in inputs], full)
        outs = [Value(f"{name}_out{k}", t.dtype, t.shape) for k, t in enumerate(types[:n_outputs])]
        self.g.nodes.append(Node(op, list(inputs), outs, dict(attrs or {}), name=name))
        if returned:
            self.g.outputs.extend(outs)
        return outs

    def transposed(self, x: Value, perm: tuple, name: str) -> Value:
        """Transpose x (not returned); its output is stored with x's memory order (non-contiguous)."""
        (t,) = self.node("Transpose", [x], {"perm": perm}, returned=False, name=name)
        contiguous = [1] * len(x.shape)
        for i in range(len(x.shape) - 2, -1, -1):
            contiguous[i] = S.mul(contiguous[i + 1], x.shape[i + 1])
        self.strided[t.name] = tuple(contiguous[p] for p in perm)
        return t

    def done(self) -> Group:
        verify(self.g)
        return self

    def inputs(self, rng, env: dict[str, int]) -> dict[str, np.ndarray]:
        """Random inputs (never all zeros) at the run-time sizes env."""
        feeds = {}
        for v in self.g.inputs:
            shape = tuple(S.evaluate(d, env) for d in v.shape)
            if v.name in self.gen:
                feeds[v.name] = np.asarray(self.gen[v.name](rng, shape, env)).astype(to_numpy(v.dtype))
            elif v.dtype == "bool":
                feeds[v.name] = rng.random(shape) < 0.6
            elif v.dtype in ("int64", "int32"):
                feeds[v.name] = rng.integers(-5, 6, shape).astype(to_numpy(v.dtype))
            else:
                feeds[v.name] = rng.uniform(-1.0, 1.0, shape).astype(to_numpy(v.dtype))
        return feeds


def strided_plan(group: Group):
    """trivial_plan with `group.strided` applied (each strided value moved to a fresh buffer)."""
    from kernel_harness import trivial_plan

    from atlasc.ir.memory import align

    def plan_fn(graph, upper, kv=None):
        plan, kv_offset = trivial_plan(graph, upper, kv)
        for name, strides in group.strided.items():
            v = next(x for x in graph.all_values() if x.name == name)
            extent = 1 + sum((S.evaluate(d, upper) - 1) * S.evaluate(s, upper) for d, s in zip(v.shape, strides))
            nbytes = max(extent, 1) * to_numpy(v.dtype).itemsize
            off = plan.arena_bytes
            plan.placements[name] = Placement("activations", off, nbytes, tuple(strides))
            plan.arena_bytes = align(off + nbytes)
        return plan, kv_offset

    return plan_fn


def positive(rng, shape, env):
    return rng.uniform(0.25, 1.25, shape)


def near_one(rng, shape, env):
    return rng.uniform(0.9, 1.1, shape) * rng.choice([-1.0, 1.0], shape)


def with_neg_inf(rng, shape, env):
    """Softmax input with scattered -inf and, where there are rows, fully -inf rows."""
    x = rng.uniform(-4.0, 4.0, shape)
    x[rng.random(shape) < 0.1] = -np.inf
    if x.size and x.ndim >= 2:
        x[0, ..., 0, :] = -np.inf  # rows along the last axis
        x[..., 0] = np.where(rng.random(x[..., 0].shape) < 0.5, -np.inf, x[..., 0])
    return x


def build_reduce(dtype: str) -> Group:
    b = Group(f"reduce_{dtype}", {"b": (1, 4), "s": (1, 24), "n": (1, 80)})
    x = b.input("x", dtype, ("b", "s", "n"), positive)
    xp = b.input("xp", dtype, ("b", "s", "n"), near_one)
    xt = b.transposed(x, (0, 2, 1), "xt")  # (b, n, s), strided
    b.node("ReduceSum", [x], {"axes": (-1,)})
    b.node("ReduceMean", [x], {"axes": (1,), "keepdims": 0})
    b.node("ReduceMax", [x], {"axes": (0, 2)})
    b.node("ReduceMin", [x], {"keepdims": 0})
    b.node("ReduceProd", [xp], {"axes": (-1,)})
    b.node("ReduceSumSquare", [x], {"axes": (0,)})
    b.node("ReduceL2", [x], {"axes": (1, 2), "keepdims": 1})
    b.node("ReduceSum", [x], {"axes": (), "noop_with_empty_axes": 1})
    b.node("ReduceSumSquare", [x], {"noop_with_empty_axes": 1})
    b.node("ReduceSum", [xt], {"axes": (-1,), "keepdims": 0})
    b.node("ReduceMean", [xt], {"axes": (1,)})
    b.node("ReduceMax", [xt], {"axes": (0, 1), "keepdims": 0})
    b.node("ArgMax", [x], {"axis": -1})
    b.node("ArgMin", [x], {"axis": 0, "keepdims": 0, "select_last_index": 1})
    b.node("ArgMax", [xt], {"axis": 1, "select_last_index": 1})
    b.node("ArgMin", [xt], {"axis": -1, "keepdims": 0})
    return b.done()


def build_reduce_int() -> Group:
    """Integer reductions and ArgMax/ArgMin with many ties (first/last index)."""
    b = Group("reduce_int", {"b": (1, 4), "s": (1, 24), "n": (1, 80)})
    x = b.input("xi", "int64", ("b", "s", "n"))
    y = b.input("yi", "int32", ("b", "s", "n"))
    b.node("ReduceSum", [x], {"axes": (-1,)})
    b.node("ReduceMax", [y], {"axes": (1,)})
    b.node("ReduceMin", [x], {"axes": (0, 2), "keepdims": 0})
    b.node("ReduceMean", [y], {"axes": (-1,)})
    b.node("ReduceSumSquare", [y], {"axes": (0,)})
    b.node("ArgMax", [x], {"axis": -1})
    b.node("ArgMax", [x], {"axis": -1, "select_last_index": 1})
    b.node("ArgMin", [y], {"axis": 1, "keepdims": 0})
    b.node("ArgMin", [y], {"axis": 1, "keepdims": 0, "select_last_index": 1})
    return b.done()


def build_reduce_empty(dtype: str) -> Group:
    """Reductions that stay defined when b = 0 (empty rows, or an empty reduced axis)."""
    b = Group(f"reduce_empty_{dtype}", {"b": (0, 4), "n": (1, 80)})
    x = b.input("x", dtype, ("b", 3, "n"), positive)
    b.node("ReduceSum", [x], {"axes": (-1,)})
    b.node("ReduceSum", [x], {"axes": (0,)})
    b.node("ReduceL2", [x], {"axes": (0, 1)})
    b.node("ReduceProd", [x], {"axes": (0,), "keepdims": 0})
    b.node("ArgMax", [x], {"axis": -1})
    b.node("ReduceMax", [x], {"axes": (1, 2)})
    return b.done()


def build_softmax(dtype: str) -> Group:
    b = Group(f"softmax_{dtype}", {"b": (0, 3), "s": (1, 20), "n": (1, 300)})
    x = b.input("x", dtype, ("b", "s", "n"))
    xi = b.input("xinf", dtype, ("b", "s", "n"), with_neg_inf)
    xt = b.transposed(x, (0, 2, 1), "xt")
    b.node("Softmax", [x], {"axis": -1})
    b.node("Softmax", [x], {"axis": 1})
    b.node("LogSoftmax", [x], {"axis": -1})
    b.node("LogSoftmax", [x], {"axis": -2})
    b.node("Softmax", [xi], {"axis": -1})
    b.node("Softmax", [xi], {"axis": 1})
    b.node("LogSoftmax", [xi], {"axis": -1})
    b.node("Softmax", [xt], {"axis": -1})
    b.node("LogSoftmax", [xt], {"axis": 1})
    return b.done()


def build_norm(dtype: str) -> Group:
    b = Group(f"norm_{dtype}", {"b": (0, 3), "s": (1, 20), "n": (1, 700)})
    x = b.input("x", dtype, ("b", "s", "n"))
    scale = b.input("scale", dtype, ("n",))
    bias = b.input("bias", dtype, ("n",))
    scale2 = b.input("scale2", dtype, ("n", 1))
    bias_s = b.input("bias_s", dtype, ("s",))
    xt = b.transposed(x, (0, 2, 1), "xt")  # (b, n, s)
    b.node("LayerNormalization", [x, scale, bias], {"axis": -1, "epsilon": 1e-5})  # Y, Mean, InvStdDev
    b.node("LayerNormalization", [x, scale], {"axis": 1, "epsilon": 1e-3}, n_outputs=1)  # over (s, n)
    b.node("LayerNormalization", [xt, scale2, bias_s], {"axis": 1}, n_outputs=2)  # strided; scale (n, 1)
    b.node("RMSNormalization", [x, scale], {"axis": -1, "epsilon": 1e-6})
    b.node("RMSNormalization", [xt, bias_s], {"axis": -1})
    b.node("RMSNormalization", [x, scale], {"axis": 1})
    return b.done()


def build_norm_vec(dtype: str) -> Group:
    """Normalizations over the last axis of rows that reduce.cu's norm_rows_vec takes (ATLAS_NORM_VEC=1): contiguous
    [m, n] rows with n up to 4096 (a decode batch's hidden size: two 16-byte pieces per thread in float16), plain and
    with the residual add (both outputs), RMS and Layer (with bias and the statistics); and one whose rows are strided
    (a transposed x: the run-time check sends it to norm_block). Rows not a multiple of 16 bytes fall back too."""
    b = Group(f"norm_vec_{dtype}", {"m": (1, 32), "n": (1, 4096)})
    x, r = b.input("x", dtype, ("m", "n")), b.input("r", dtype, ("m", "n"))
    scale, bias = b.input("scale", dtype, ("n",)), b.input("bias", dtype, ("n",))
    scale_m = b.input("scale_m", dtype, ("m",))
    b.node("RMSNormalization", [x, scale], {"axis": -1, "epsilon": 1e-6})
    b.node("LayerNormalization", [x, scale, bias], {"axis": -1, "epsilon": 1e-5})  # Y, Mean, InvStdDev
    b.node("AddRMSNormalization", [x, r, scale], {"axis": -1, "epsilon": 1e-6})  # y, s
    b.node("AddLayerNormalization", [x, r, scale, bias], {"axis": -1, "epsilon": 1e-5})
    b.node("RMSNormalization", [b.transposed(x, (1, 0), "xt"), scale_m], {"axis": -1})  # rows n apart
    return b.done()


def _gather_idx(bound_dim):
    def gen(rng, shape, env):
        m = env[bound_dim] if isinstance(bound_dim, str) else bound_dim
        return rng.integers(-m, m, shape) if m else np.zeros(shape)

    return gen


def _scatter_idx(dims):
    """Index rows over `dims` (ints or symbol names), negatives included, duplicates likely."""
    def gen(rng, shape, env):
        cols = []
        for d in dims:
            m = env[d] if isinstance(d, str) else d
            cols.append(rng.integers(-m, m, shape[:-1]))
        return np.stack(cols, axis=-1) if cols else np.zeros(shape)

    return gen


def build_movement(dtype: str) -> Group:
    b = Group(f"movement_{dtype}", {"b": (0, 3), "s": (1, 12), "n": (1, 40), "t": (1, 6)})
    x = b.input("x", dtype, ("b", "s", "n"))
    z = b.input("z", dtype, ("b", "s", "t"))
    w = b.input("w", dtype, ("b", S.add(S.sym("s"), S.sym("n")), 4))
    xt = b.transposed(x, (0, 2, 1), "xt")  # (b, n, s)
    b.node("Concat", [x, z, x], {"axis": -1})
    b.node("Concat", [xt, xt], {"axis": 0})
    b.node("Concat", [x], {"axis": 1})
    b.node("Split", [w], {"axis": 1, "split": (S.sym("s"), S.sym("n"))})
    b.node("Split", [xt], {"axis": -1, "split": (S.sym("s"),)})
    b.node("Split", [x], {"axis": 0, "split": (S.sym("b"), 0)})
    table = b.input("table", dtype, (10, "n"))
    ids = b.input("ids", "int64", ("b", "s"), _gather_idx(10))
    b.node("Gather", [table, ids], {"axis": 0})
    ids32 = b.input("ids32", "int32", ("t",), _gather_idx("s"))
    b.node("Gather", [xt, ids32], {"axis": -1})
    one = b.input("one", "int64", (), _gather_idx("n"))
    b.node("Gather", [x, one], {"axis": 2})
    # batch dim s, not b: the reference GatherND cannot take an empty batch
    data = b.input("gdata", dtype, ("s", 5, 6))
    gidx = b.input("gidx", "int64", ("s", 3, 1), _gather_idx(5))
    b.node("GatherND", [data, gidx], {"batch_dims": 1})
    x2 = b.input("x2", dtype, ("s", "n", 3))
    gidx2 = b.input("gidx2", "int32", ("t", 2), _scatter_idx(["s", "n"]))
    b.node("GatherND", [x2, gidx2])
    sdata = b.input("sdata", dtype, (6, "s", "n"))
    sidx = b.input("sidx", "int64", ("t", 1), _scatter_idx([6]))
    supd = b.input("supd", dtype, ("t", "s", "n"))
    b.node("ScatterND", [sdata, sidx, supd])
    sidx2 = b.input("sidx2", "int32", ("t", 2), _scatter_idx([6, "s"]))
    supd2 = b.input("supd2", dtype, ("t", "n"))
    b.node("ScatterND", [sdata, sidx2, supd2])
    b.node("Trilu", [x], {"upper": 1, "k": 0})
    b.node("Trilu", [x], {"upper": 0, "k": -1})
    b.node("Trilu", [xt], {"upper": 1, "k": 2})
    if dtype != "bool":
        b.node("CumSum", [x], {"axis": -1})
        b.node("CumSum", [x], {"axis": 1, "exclusive": 1, "reverse": 1})
        b.node("CumSum", [xt], {"axis": -1, "reverse": 1})
        b.node("CumSum", [xt], {"axis": 0, "exclusive": 1})
    return b.done()


def build_sources() -> Group:
    b = Group("sources", {"b": (0, 3), "s": (1, 50)})
    b.input("x", "float32", ("b", "s"))  # binds the symbols
    sym_b, sym_s = S.sym("b"), S.sym("s")
    b.node("Range", [], {"start": 0, "limit": sym_s, "delta": 1, "dtype": "int64"})
    b.node("Range", [], {"start": sym_s, "limit": 0, "delta": -2, "dtype": "int32"})
    b.node("Range", [], {"start": 0, "limit": sym_s, "delta": 1, "dtype": "float32"})
    b.node("Range", [], {"start": 0.5, "limit": 3.7, "delta": 0.3, "dtype": "float32"})
    b.node("Range", [], {"start": -1.0, "limit": 2.0, "delta": 0.25, "dtype": "float16"})
    b.node("Range", [], {"start": sym_b, "limit": S.add(sym_b, sym_s), "delta": 1, "dtype": "int64"})
    b.node("ConstantOfShape", [], {"shape": (sym_b, sym_s), "value": np.array([1.5], np.float32)})
    b.node("ConstantOfShape", [], {"shape": (sym_s,), "value": np.array([-0.25], np.float16)})
    b.node("ConstantOfShape", [], {"shape": (sym_b, 2), "value": np.array([7], np.int64)})
    b.node("ConstantOfShape", [], {"shape": (sym_s,), "value": np.array([-3], np.int32)})
    b.node("ConstantOfShape", [], {"shape": (3, sym_s), "value": np.array([True])})
    b.node("ConstantOfShape", [], {"shape": (), "value": np.array([np.inf], np.float32)})
    b.node("DimsTensor", [], {"dims": (sym_b, S.mul(sym_s, 3), 4)})
    b.node("DimsTensor", [], {"dims": (S.add(sym_s, 1),), "dtype": "int32", "scalar": True})
    return b.done()


def all_groups() -> list[Group]:
    groups = []
    for dt in FLOATS:
        groups += [build_reduce(dt), build_reduce_empty(dt), build_softmax(dt), build_norm(dt), build_movement(dt)]
    groups += [build_reduce("float64"), build_softmax("float64"), build_norm("float64")]
    groups += [build_reduce_int(), build_movement("int64"), build_movement("int32"), build_movement("bool")]
    groups.append(build_sources())
    return groups


def generate(groups: list[Group]):
    entries, upper = {}, {}
    for grp in groups:
        plan, _ = strided_plan(grp)(grp.g, grp.upper)
        entries[grp.g.name] = (grp.g, plan)
        upper[grp.g.name] = grp.upper
    return generate_module(entries, upper)


def _needs_nvcc():
    if not (os.environ.get("ATLAS_NVCC") or shutil.which("nvcc")):
        pytest.skip("nvcc not on PATH")


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", arch_params("sm90", "sm80"))
def test_every_variant_generates_and_compiles(arch):
    from atlasc.codegen.nvcc import compile_cubins

    groups = all_groups()
    mod = generate(groups)
    ops = {n.op for grp in groups for n in grp.g.nodes}
    assert ops >= {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL2",
                   "ArgMax", "ArgMin", "Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "Concat",
                   "Split", "Gather", "GatherND", "ScatterND", "Trilu", "CumSum", "Range", "ConstantOfShape",
                   "DimsTensor"}
    for grp in groups:
        assert len(mod.launches[grp.g.name]) == len(grp.g.nodes)
    _needs_nvcc()
    assert compile_cubins(mod.source, (arch,))[arch]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_norm_vec_is_emitted_and_compiles(dtype, monkeypatch):
    """ATLAS_NORM_VEC unset or 1: every last-axis normalization of the group gets the run-time checked norm_rows_vec
    call before its norm_block (pieces per thread from the rows' maximum: 4096 float16 values over 256 threads, 2 of
    8), the multi-axis LayerNormalization of build_norm none; the module compiles for sm75 and sm90; 0: norm_block
    alone; another value is a CodegenError naming the variable."""
    from atlasc.codegen import reduce
    from atlasc.codegen.nvcc import compile_cubins

    monkeypatch.delenv(reduce.NORM_VEC_ENV, raising=False)
    default = generate([build_norm_vec(dtype), build_norm(dtype)]).source
    monkeypatch.setenv(reduce.NORM_VEC_ENV, "0")
    off = generate([build_norm_vec(dtype), build_norm(dtype)]).source
    assert "norm_rows_vec<" not in off and off.count("norm_block<") == 11
    monkeypatch.setenv(reduce.NORM_VEC_ENV, "1")
    mod = generate([build_norm_vec(dtype), build_norm(dtype)])
    assert mod.source == default
    pieces = 2 if dtype == "float16" else 4
    calls = re.findall(r"norm_rows_vec<(\w+), (\w+), (\w+), (\w+), (\d+), float>", mod.source)
    assert calls.count(("true", "false", "false", "false", str(pieces))) == 1  # RMS over n
    assert calls.count(("false", "true", "true", "false", str(pieces))) == 1  # Layer with bias and statistics
    assert calls.count(("true", "false", "false", "true", str(pieces))) == 1  # the residual add + RMS
    assert calls.count(("false", "true", "false", "true", str(pieces))) == 1  # the residual add + Layer
    # rows of at most 32 (the transposed x) or 700 values (build_norm's three last-axis nodes): one piece per thread
    assert calls.count(("true", "false", "false", "false", "1")) == 3
    assert calls.count(("false", "true", "true", "false", "1")) == 1
    # build_norm's normalizations over two dims (two LayerNormalization, one RMS at axis 1) keep norm_block alone
    assert len(calls) == 8 and mod.source.count("norm_block<") == len(calls) + 3
    _needs_nvcc()
    assert set(compile_cubins(mod.source, ("sm75", "sm90"))) == {"sm75", "sm90"}
    monkeypatch.setenv(reduce.NORM_VEC_ENV, "yes")
    with pytest.raises(reduce.CodegenError, match="ATLAS_NORM_VEC='yes' is not 0 or 1"):
        generate([build_norm_vec(dtype)])


def test_schedules_and_launch_shapes():
    grp = build_reduce("float32")
    mod = generate([grp])
    by_node = {launch.node: launch for launch in mod.launches[grp.g.name]}
    src = mod.source
    # last-axis reduction: block per row, a block sized to the row (n <= 80 -> 96 threads)
    first = grp.g.nodes[1]  # nodes[0] is the Transpose
    assert first.op == "ReduceSum" and by_node[first.name].block == (96, 1, 1)
    assert by_node[first.name].grid == (4 * 24, 1, 1)
    assert "reduce_block<atlas::rd::Sum<float>, float>" in src
    # reduction over the outer axis with many rows: a thread per row
    assert "reduce_thread<atlas::rd::SumSquare<float>, float>" in src


def test_strided_placement_is_used():
    grp = build_softmax("float32")
    plan, _ = strided_plan(grp)(grp.g, grp.upper)
    assert plan.placement("xt_out0").strides is not None
    mod = generate([grp])
    # the Transpose writes xt (b, n, s) with x's memory order: strides (s*n, 1, n) ...
    tr = mod.source.split("_0000_Transpose")[1].split("\n}\n")[0]
    assert "out.stride[1] = 1LL;" in tr and "out.stride[2] = (d[2]);" in tr
    # ... and the Softmax over xt's last axis reads it with that stride
    sm = mod.source.split("_0008_Softmax")[1].split("\n}\n")[0]
    assert "x.stride[2] = (d[2]);" in sm and "xr.stride[0] = x.stride[2];" in sm


def test_unsupported_variants_raise():
    b = Group("bad", {"n": (1, 8)})
    data = b.input("d", "float32", ("n", 4))
    idx = b.input("i", "int64", (2, 1))
    upd = b.input("u", "float32", (2, 4))
    b.node("ScatterND", [data, idx, upd], {"reduction": "add"})
    b.done()
    with pytest.raises(CodegenError, match="reduction"):
        generate([b])


def _snapshot_group() -> Group:
    b = Group("snap", {"b": (0, 8), "n": (1, 1024)})
    x = b.input("x", "float16", ("b", "n"))
    scale = b.input("scale", "float16", ("n",))
    bias = b.input("bias", "float16", ("n",))
    y = b.input("y", "float16", ("b", 16))
    b.node("LayerNormalization", [x, scale, bias], {"axis": -1, "epsilon": 1e-5}, name="ln")
    b.node("Concat", [x, y], {"axis": 1}, name="cat")
    return b.done()


def test_snapshot_layernorm_concat():
    """Wrapper code for a fixed graph; ATLAS_UPDATE_SNAPSHOTS=1 rewrites the checked-in file."""
    mod = generate([_snapshot_group()])
    prefix = "\n".join(["// generated by atlasc: do not edit", (HERE / "common.cuh").read_text(), *_load_families()])
    assert mod.source.startswith(prefix)
    got = mod.source[len(prefix):].lstrip("\n")
    path = SNAPSHOTS / "reduce_movement.cu"
    if os.environ.get("ATLAS_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"missing snapshot {path}; run with ATLAS_UPDATE_SNAPSHOTS=1 to create it"
    assert got == path.read_text(), f"generated code differs from {path} (ATLAS_UPDATE_SNAPSHOTS=1 to accept)"
