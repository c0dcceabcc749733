"""Shape programs the way exporters write them, on inputs with named (dynamic) dims.

Each test builds a small ONNX graph whose Reshape/Expand/Slice/... operands are computed from
`Shape` at run time, imports it, and checks that
  * the folded operand is an IR attribute of dims that are symbolic expressions in the input symbols
    (nothing data-dependent, no leftover int64 shape arithmetic in the graph),
  * the graph verifies,
  * `interpret` equals onnxruntime on two different sets of input shapes (nothing got baked to one
    example size), including a zero-size case where the model allows one (past length 0).
float32 tolerance: rtol 1e-5, atol 1e-6 (MatMul cases: atol 1e-5, float32 dot products in another order).
"""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as H
from onnx import numpy_helper as NH

from atlasc.frontend import import_onnx
from atlasc.ir import interpret, verify
from atlasc.ir import symbolic as S

I64 = np.int64
INT64_MAX = int(np.iinfo(np.int64).max)


def model(nodes, inputs, outputs, inits=None, opset=17):
    """inputs: [(name, elem_type, dims)] with str dims for dynamic axes; inits: {name: array}."""
    ins = [H.make_tensor_value_info(n, t, dims) for n, t, dims in inputs]
    outs = [H.make_empty_tensor_value_info(o) for o in outputs]
    init = [NH.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    return H.make_model(H.make_graph(nodes, "shape_program", ins, outs, initializer=init),
                        opset_imports=[H.make_opsetid("", opset)])


def ints(*v):
    return np.array(v, I64)


def sym(*names):
    return tuple(S.sym(n) if isinstance(n, str) else n for n in names)


def feeds_for(m, dims: dict[str, int], seed: int):
    """Random inputs for model `m` with every named dim bound by `dims`."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in m.graph.input:
        shape = tuple(dims[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim)
        et = vi.type.tensor_type.elem_type
        if et == TensorProto.FLOAT:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
        elif et == TensorProto.BOOL:
            feeds[vi.name] = rng.random(shape) < 0.5
        else:
            feeds[vi.name] = rng.integers(-5, 5, shape).astype(I64)
    return feeds


def check_runs(m, graph, dim_sets, atol=1e-6):
    """interpret == onnxruntime for every binding in dim_sets (the same imported graph each time)."""
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in m.graph.output]
    for i, dims in enumerate(dim_sets):
        feeds = feeds_for(m, dims, zlib.crc32(repr(sorted(dims.items())).encode()) + i)
        want = sess.run(names, feeds)
        got = interpret(graph, feeds)
        for name, w in zip(names, want):
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, \
                f"{name} with {dims}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=f"{name} with {dims}")
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{name} with {dims}")


def imported(m):
    graph = import_onnx(m)
    verify(graph)
    return graph


def only_node(graph, op):
    nodes = [n for n in graph.nodes if n.op == op]
    assert len(nodes) == 1, f"expected one {op} node, got {len(nodes)}:\n{graph}"
    return nodes[0]


def assert_symbolic(dims, graph, expected=None):
    """dims are ints/Exprs over the graph's input symbols, at least one symbolic; == expected if given."""
    dims = tuple(dims)
    assert any(isinstance(d, S.Expr) for d in dims), f"{dims} has no symbolic dim: baked to the example size?"
    input_symbols = set().union(*(S.symbols_of(d) for v in graph.inputs for d in v.shape))
    for d in dims:
        assert isinstance(d, (int, S.Expr)), f"{d!r} is not a dim"
        assert S.symbols_of(d) <= input_symbols, f"{d} uses symbols outside the inputs' {sorted(input_symbols)}"
    if expected is not None:
        assert dims == tuple(expected), f"{S.shape_str(dims)} != {S.shape_str(expected)}"


def no_shape_arithmetic(graph, allowed):
    ops = {n.op for n in graph.nodes}
    assert ops <= set(allowed) | {"Identity"}, f"leftover ops {sorted(ops - set(allowed))}:\n{graph}"


# -----------------------------------------------------------------------------------------------


def test_torchscript_shape_gather_unsqueeze_concat_reshape():
    """x[batch, seq, 8] -> Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), Unsqueeze(Gather(.., 1)), 2, 4))."""
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("Gather", ["shp", "i0"], ["b"], axis=0),
        H.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        H.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        H.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
        H.make_node("Concat", ["b1", "s1", "c2", "c4"], ["target"], axis=0),
        H.make_node("Reshape", ["x", "target"], ["r"]),
        H.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", 8])], ["y"],
              {"i0": np.array(0, I64), "i1": np.array(1, I64), "ax0": ints(0), "c2": ints(2), "c4": ints(4)},
              opset=13)
    g = imported(m)
    no_shape_arithmetic(g, {"Reshape", "Transpose"})
    assert_symbolic(only_node(g, "Reshape").attrs["shape"], g, sym("batch", "seq", 2, 4))
    assert g.outputs[0].shape == sym("batch", 2, "seq", 4)
    check_runs(m, g, [{"batch": 2, "seq": 5}, {"batch": 3, "seq": 1}])


def test_shape_start_end_opset15():
    """Reshape(x, Concat(Shape(x, end=2), [-1])) and Shape(x, start=-2) -> ReduceProd-free flatten."""
    nodes = [
        H.make_node("Shape", ["x"], ["lead"], end=2),
        H.make_node("Shape", ["x"], ["tail"], start=-2),
        H.make_node("Concat", ["lead", "m1"], ["target"], axis=0),
        H.make_node("Reshape", ["x", "target"], ["y"]),
        H.make_node("Cast", ["tail"], ["tail_f"], to=TensorProto.FLOAT),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", "heads", 4])], ["y", "tail_f"],
              {"m1": ints(-1)}, opset=15)
    g = imported(m)
    assert_symbolic(only_node(g, "Reshape").attrs["shape"], g,
                    (S.sym("batch"), S.sym("seq"), S.mul(S.sym("heads"), 4)))
    check_runs(m, g, [{"batch": 2, "seq": 3, "heads": 2}, {"batch": 1, "seq": 7, "heads": 3}])


@pytest.mark.parametrize("target, expected", [
    ((0, 0, 3, -1), ("batch", "seq", 3, "h/3")),
    ((-1, 0), ("batch*h", "seq")),  # the 0 copies the input's dim 1
    ((0, -1), ("batch", "seq*h")),
    ((0, 0, -1, 2), ("batch", "seq", "h/2", 2)),
])
def test_reshape_zero_and_minus_one_on_symbolic_dims(target, expected):
    nodes = [H.make_node("Reshape", ["x", "t"], ["y"])]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", "h"])], ["y"], {"t": ints(*target)}, opset=14)
    g = imported(m)
    b, s, h = S.sym("batch"), S.sym("seq"), S.sym("h")
    table = {"batch": b, "seq": s, "h": h, "batch*h": S.mul(b, h), "seq*h": S.mul(s, h),
             "h/3": S.floordiv(h, 3), "h/2": S.floordiv(h, 2)}
    want = tuple(table[e] if isinstance(e, str) else e for e in expected)
    assert_symbolic(only_node(g, "Reshape").attrs["shape"], g, want)
    check_runs(m, g, [{"batch": 2, "seq": 3, "h": 6}, {"batch": 1, "seq": 5, "h": 12}])


def test_reshape_minus_one_is_exact_quotient():
    """x[batch, seq, heads*? ...]: Reshape(x, [batch, -1, 4]) on [batch, seq, 8]: the -1 is 2*seq exactly."""
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("Slice", ["shp", "z", "one"], ["b"]),
        H.make_node("Concat", ["b", "m1", "c4"], ["t"], axis=0),
        H.make_node("Reshape", ["x", "t"], ["y"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", 8])], ["y"],
              {"z": ints(0), "one": ints(1), "m1": ints(-1), "c4": ints(4)}, opset=14)
    g = imported(m)
    assert_symbolic(only_node(g, "Reshape").attrs["shape"], g, (S.sym("batch"), S.mul(S.sym("seq"), 2), 4))
    check_runs(m, g, [{"batch": 2, "seq": 3}, {"batch": 4, "seq": 1}])


def test_expand_where_equal_minus_one():
    """HF style: Expand(x, Where(Equal(shape, -1), ones, shape)) with shape = [-1, seq, -1]."""
    nodes = [
        H.make_node("Shape", ["y"], ["ys"]),
        H.make_node("Gather", ["ys", "i1"], ["s"], axis=0),
        H.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
        H.make_node("Concat", ["m1", "s1", "m1"], ["shp"], axis=0),
        H.make_node("Equal", ["shp", "m1"], ["is_neg"]),
        H.make_node("Shape", ["shp"], ["shp_shape"]),
        H.make_node("ConstantOfShape", ["shp_shape"], ["ones"], value=NH.from_array(ints(1))),
        H.make_node("Where", ["is_neg", "ones", "shp"], ["target"]),
        H.make_node("Expand", ["x", "target"], ["out"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", 1, 4]), ("y", TensorProto.FLOAT, ["batch", "seq"])],
              ["out"], {"i1": np.array(1, I64), "ax0": ints(0), "m1": ints(-1)}, opset=13)
    g = imported(m)
    no_shape_arithmetic(g, {"Expand"})
    assert_symbolic(only_node(g, "Expand").attrs["shape"], g, (1, S.sym("seq"), 1))
    assert g.outputs[0].shape == sym("batch", "seq", 4)
    check_runs(m, g, [{"batch": 2, "seq": 3}, {"batch": 1, "seq": 6}])


def test_constant_of_shape_of_shape():
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("ConstantOfShape", ["shp"], ["c"], value=NH.from_array(np.array([0.5], np.float32))),
        H.make_node("Add", ["x", "c"], ["y"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["past_seq", "seq", 3])], ["y"])
    g = imported(m)
    assert_symbolic(only_node(g, "ConstantOfShape").attrs["shape"], g, sym("past_seq", "seq", 3))
    check_runs(m, g, [{"past_seq": 2, "seq": 4}, {"past_seq": 0, "seq": 1}])


def test_range_from_shape_positions():
    """position_ids = Unsqueeze(Range(0, Gather(Shape(x), 1), 1), 0), then Expand to [batch, seq]."""
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        H.make_node("Range", ["zero", "s", "one"], ["pos"]),
        H.make_node("Unsqueeze", ["pos", "ax0"], ["pos1"]),
        H.make_node("Slice", ["shp", "z", "two"], ["bs"]),
        H.make_node("Expand", ["pos1", "bs"], ["y"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", 2])], ["y"],
              {"i1": np.array(1, I64), "zero": np.array(0, I64), "one": np.array(1, I64), "ax0": ints(0),
               "z": ints(0), "two": ints(2)}, opset=13)
    g = imported(m)
    rng_node = only_node(g, "Range")
    assert rng_node.attrs["limit"] == S.sym("seq") and rng_node.attrs["start"] == 0
    assert_symbolic(only_node(g, "Expand").attrs["shape"], g, sym("batch", "seq"))
    check_runs(m, g, [{"batch": 2, "seq": 5}, {"batch": 3, "seq": 1}])


def test_range_past_offset_zero_size():
    """Range(past, past + seq, 1): cache positions; past may be 0."""
    nodes = [
        H.make_node("Shape", ["past"], ["ps"]),
        H.make_node("Gather", ["ps", "i2"], ["p"], axis=0),
        H.make_node("Shape", ["x"], ["xs"]),
        H.make_node("Gather", ["xs", "i1"], ["s"], axis=0),
        H.make_node("Add", ["p", "s"], ["total"]),
        H.make_node("Range", ["p", "total", "one"], ["y"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", 2]),
                      ("past", TensorProto.FLOAT, ["batch", 2, "past_seq", 2])], ["y"],
              {"i1": np.array(1, I64), "i2": np.array(2, I64), "one": np.array(1, I64)}, opset=13)
    g = imported(m)
    r = only_node(g, "Range")
    assert r.attrs["start"] == S.sym("past_seq") and r.attrs["limit"] == S.add(S.sym("past_seq"), S.sym("seq"))
    assert g.outputs[0].shape == sym("seq")
    check_runs(m, g, [{"batch": 1, "seq": 3, "past_seq": 0}, {"batch": 2, "seq": 1, "past_seq": 4}])


def test_slice_bounds_from_shapes_and_sentinels():
    """rotate_half: x[..., :h//2] and x[..., h//2:INT64_MAX]; last token: x[:, -1:]; drop last: x[:, :seq-1]."""
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("Gather", ["shp", "i2"], ["h"], axis=0),
        H.make_node("Div", ["h", "two"], ["half"]),
        H.make_node("Unsqueeze", ["half", "ax0"], ["half1"]),
        H.make_node("Slice", ["x", "z", "half1", "axm1"], ["x1"]),
        H.make_node("Slice", ["x", "half1", "big", "axm1"], ["x2"]),
        H.make_node("Neg", ["x2"], ["nx2"]),
        H.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        H.make_node("Slice", ["x", "m1", "big", "ax1"], ["last"]),
        H.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        H.make_node("Sub", ["s", "one"], ["s_1"]),
        H.make_node("Unsqueeze", ["s_1", "ax0"], ["s_11"]),
        H.make_node("Slice", ["x", "z", "s_11", "ax1"], ["head"]),
        H.make_node("Slice", ["x", "big", "small", "ax1", "m1"], ["rev"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "seq", "hidden"])], ["rot", "last", "head", "rev"],
              {"i1": np.array(1, I64), "i2": np.array(2, I64), "two": np.array(2, I64), "one": np.array(1, I64),
               "ax0": ints(0), "z": ints(0), "axm1": ints(-1), "ax1": ints(1), "big": ints(INT64_MAX),
               "small": ints(np.iinfo(np.int64).min), "m1": ints(-1)}, opset=13)
    g = imported(m)
    b, s, h = S.sym("batch"), S.sym("seq"), S.sym("hidden")
    slices = {n.outputs[0].name: n for n in g.nodes if n.op == "Slice"}
    assert slices["x1"].attrs["ends"] == (S.floordiv(h, 2),)
    assert slices["x2"].attrs["starts"] == (S.floordiv(h, 2),) and slices["x2"].attrs["ends"] == (h,)
    assert slices["last"].attrs["starts"] == (S.sub(s, 1),) and slices["last"].attrs["ends"] == (s,)
    assert slices["head"].attrs["ends"] == (S.sub(s, 1),)
    assert slices["rev"].attrs["starts"] == (S.sub(s, 1),) and slices["rev"].attrs["ends"] == (-1,)
    for n in slices.values():
        assert_symbolic(tuple(n.attrs["starts"]) + tuple(n.attrs["ends"]), g)
    assert g.outputs[1].shape == (b, 1, h) and g.outputs[2].shape == (b, S.sub(s, 1), h)
    check_runs(m, g, [{"batch": 2, "seq": 3, "hidden": 8}, {"batch": 1, "seq": 1, "hidden": 4}])


@pytest.mark.parametrize("n_out", [2, 3])
def test_split_num_outputs_symbolic(n_out):
    nodes = [H.make_node("Split", ["x"], [f"y{i}" for i in range(n_out)], axis=-1, num_outputs=n_out)]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", "hidden"])], [f"y{i}" for i in range(n_out)], opset=18)
    g = imported(m)
    assert_symbolic(only_node(g, "Split").attrs["split"], g)
    # uneven sizes too: ONNX makes the last chunk smaller (7 -> 4, 3; 7 -> 3, 3, 1)
    check_runs(m, g, [{"batch": 2, "hidden": 6}, {"batch": 1, "hidden": 7}, {"batch": 3, "hidden": 12}])


def test_max_of_shapes_broadcast():
    """Expand(a, Max(Shape(a), Shape(b))): a [n, 1], b [1, m] -> [n, m]."""
    nodes = [
        H.make_node("Shape", ["a"], ["sa"]),
        H.make_node("Shape", ["b"], ["sb"]),
        H.make_node("Max", ["sa", "sb"], ["t"]),
        H.make_node("Expand", ["a", "t"], ["y"]),
        H.make_node("Add", ["y", "b"], ["z"]),
    ]
    m = model(nodes, [("a", TensorProto.FLOAT, ["n", 1]), ("b", TensorProto.FLOAT, [1, "m"])], ["z"])
    g = imported(m)
    assert_symbolic(only_node(g, "Expand").attrs["shape"], g, sym("n", "m"))
    check_runs(m, g, [{"n": 2, "m": 3}, {"n": 5, "m": 1}])


@pytest.mark.parametrize("mask_dtype", [TensorProto.FLOAT, TensorProto.INT64])
def test_total_seq_mask_unifies_with_past_plus_seq(mask_dtype):
    """A mask [batch, total_seq] added to scores [batch, heads, seq, past_seq + seq]: total_seq := past + seq."""
    nodes = [
        H.make_node("Concat", ["past_k", "k"], ["kk"], axis=2),
        H.make_node("Transpose", ["kk"], ["kt"], perm=[0, 1, 3, 2]),
        H.make_node("MatMul", ["q", "kt"], ["scores"]),
        H.make_node("Unsqueeze", ["mask", "ax12"], ["m4"]),
    ]
    if mask_dtype == TensorProto.INT64:  # 1 = attend, 0 = masked: (1 - m) * -10000
        nodes += [H.make_node("Cast", ["m4"], ["mf"], to=TensorProto.FLOAT),
                  H.make_node("Sub", ["onef", "mf"], ["inv"]),
                  H.make_node("Mul", ["inv", "neg"], ["bias"])]
    else:
        nodes += [H.make_node("Identity", ["m4"], ["bias"])]
    nodes += [H.make_node("Add", ["scores", "bias"], ["biased"]),
              H.make_node("Softmax", ["biased"], ["probs"], axis=-1),
              H.make_node("Shape", ["mask"], ["ms"]),
              H.make_node("Gather", ["ms", "i1"], ["tot"], axis=0),
              H.make_node("Range", ["zero", "tot", "one"], ["pos"])]
    m = model(nodes, [
        ("q", TensorProto.FLOAT, ["batch", 2, "seq", 4]),
        ("k", TensorProto.FLOAT, ["batch", 2, "seq", 4]),
        ("past_k", TensorProto.FLOAT, ["batch", 2, "past_seq", 4]),
        ("mask", mask_dtype, ["batch", "total_seq"]),
    ], ["probs", "pos"], {"ax12": ints(1, 2), "onef": np.array(1.0, np.float32),
                          "neg": np.array(-10000.0, np.float32), "i1": np.array(1, I64),
                          "zero": np.array(0, I64), "one": np.array(1, I64)})
    g = imported(m)
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    assert "total_seq" not in g.symbols
    assert g.input("mask").shape == (S.sym("batch"), total)
    assert g.outputs[0].shape == (S.sym("batch"), 2, S.sym("seq"), total)
    assert only_node(g, "Range").attrs["limit"] == total  # the folded shape program follows the unification
    dim_sets = [{"batch": 2, "seq": 3, "past_seq": 0, "total_seq": 3},  # zero-size past
                {"batch": 1, "seq": 1, "past_seq": 5, "total_seq": 6}]
    check_runs(m, g, dim_sets, atol=1e-5)


def test_zero_size_past_concat_and_reshape():
    """past [batch, heads, past_seq, d] with past_seq = 0: Concat, Shape-driven Reshape to [batch, total, heads*d]."""
    nodes = [
        H.make_node("Concat", ["past", "x"], ["kv"], axis=2),
        H.make_node("Transpose", ["kv"], ["t"], perm=[0, 2, 1, 3]),
        H.make_node("Shape", ["t"], ["ts"]),
        H.make_node("Slice", ["ts", "z", "two"], ["bt"]),
        H.make_node("Concat", ["bt", "m1"], ["target"], axis=0),
        H.make_node("Reshape", ["t", "target"], ["y"]),
    ]
    m = model(nodes, [("x", TensorProto.FLOAT, ["batch", 2, "seq", 3]),
                      ("past", TensorProto.FLOAT, ["batch", 2, "past_seq", 3])], ["y"],
              {"z": ints(0), "two": ints(2), "m1": ints(-1)}, opset=13)
    g = imported(m)
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    assert_symbolic(only_node(g, "Reshape").attrs["shape"], g, (S.sym("batch"), total, 6))
    check_runs(m, g, [{"batch": 2, "seq": 3, "past_seq": 0}, {"batch": 1, "seq": 2, "past_seq": 4}])
