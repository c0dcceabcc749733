"""Every op of the IR op table, checked against an ONNX oracle on fresh random inputs.

Method: build a one-node ONNX model with `onnx.helper` (shape-like operands as initializers, data as
graph inputs so nothing folds away), import it with `import_onnx`, run the IR with `interpret`, and
compare with `onnx.reference.ReferenceEvaluator` (or onnxruntime where noted).

Tolerances (see `assert_close`):
  * float32: rtol 1e-5, atol 1e-6, unless a test passes a looser one with a comment saying why;
  * float16: rtol 1e-3 and atol 1e-3 * max(1, max |expected|), i.e. about one fp16 ulp relative
    to the output's magnitude (fp16 has an 11-bit significand: 2**-10 ~ 9.8e-4);
  * integers and booleans: exact.
Where the reference evaluator computes float16 *internally* in float16 (reductions, normalizations,
softmax, attention), the IR follows onnxruntime and accumulates in float32; those cases use the
reference run on the same inputs upcast to float32 and rounded back to float16 (`fp16_via_fp32`).

`COVERED` collects (at import time, via `@covers`) the IR ops these tests exercise; the last test
fails if an op registered in `atlasc.ir.OPS` has no test here.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper as H
from onnx import numpy_helper as NH
from onnx.reference import ReferenceEvaluator

from atlasc.frontend import import_onnx
from atlasc.ir import OPS, Graph, Node, SymbolInfo, Value, constant, interpret, verify
from atlasc.ir import symbolic as S
from atlasc.ir.ops import TensorType

F32, F16, I64, I32, BOOL = np.float32, np.float16, np.int64, np.int32, np.bool_
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)

COVERED: set[str] = set()


def covers(*ops):
    COVERED.update(ops)
    return lambda f: f


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: fresh, varied, reproducible inputs per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rand(rng, shape, dtype, lo=-3.0, hi=3.0):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
    return rng.uniform(lo, hi, size=shape).astype(dtype)


class C:
    """An operand passed as an initializer (a compile-time constant) instead of a graph input."""

    def __init__(self, arr):
        self.arr = np.asarray(arr)


def build(op, args, attrs=None, *, opset, outputs=1, domain_opsets=None):
    """A one-node model: args are arrays (graph inputs), C(...) (initializers) or None (omitted)."""
    names, inputs, inits = [], [], []
    for i, a in enumerate(args):
        if a is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(a, C):
            inits.append(NH.from_array(a.arr, name))
        else:
            inputs.append(H.make_tensor_value_info(name, H.np_dtype_to_tensor_dtype(a.dtype), a.shape))
    out_names = [f"out{i}" for i in range(outputs)] if isinstance(outputs, int) else list(outputs)
    node = H.make_node(op, names, out_names, **(attrs or {}))
    graph = H.make_graph([node], f"{op}_test", inputs,
                         [H.make_empty_tensor_value_info(o) for o in out_names if o], initializer=inits)
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)])


def feeds_of(args):
    return {f"in{i}": a for i, a in enumerate(args) if a is not None and not isinstance(a, C)}


def run_oracle(model, feeds, oracle):
    if oracle == "ort":
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    return ReferenceEvaluator(model).run(None, feeds)


def assert_close(got, exp, rtol=None, atol=None, what=""):
    exp = np.asarray(exp)
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype}, oracle {exp.dtype}"
    assert got.shape == exp.shape, f"{what}: shape {got.shape}, oracle {exp.shape}"
    if exp.dtype.kind in "biu":
        np.testing.assert_array_equal(got, exp, err_msg=what)
    elif exp.dtype == np.float16:
        finite = np.abs(exp[np.isfinite(exp)].astype(np.float32))
        mag = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32), rtol=1e-3,
                                   atol=1e-3 * mag, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_allclose(got, exp, rtol=1e-5 if rtol is None else rtol,
                                   atol=1e-6 if atol is None else atol, equal_nan=True, err_msg=what)


def check(op, args, attrs=None, *, opset, outputs=1, oracle="ref", rtol=None, atol=None, ir_op="same",
          fp16_via_fp32=False):
    """Import the one-node model, interpret it, compare every output with the oracle."""
    model = build(op, args, attrs, opset=opset, outputs=outputs)
    graph = import_onnx(model)
    verify(graph)
    ir_op = op if ir_op == "same" else ir_op
    if ir_op is not None:
        assert any(n.op == ir_op for n in graph.nodes), f"no {ir_op} node in the imported graph:\n{graph}"
    feeds = feeds_of(args)
    got = interpret(graph, feeds)
    if fp16_via_fp32 and any(np.asarray(a.arr if isinstance(a, C) else a).dtype == F16 for a in args
                             if a is not None):
        up = [None if a is None else (C(_up(a.arr)) if isinstance(a, C) else _up(a)) for a in args]
        exp = [e.astype(F16) if e.dtype == F32 else e
               for e in run_oracle(build(op, up, attrs, opset=opset, outputs=outputs), feeds_of(up), oracle)]
    else:
        exp = run_oracle(model, feeds, oracle)
    out_names = [f"out{i}" for i in range(outputs)] if isinstance(outputs, int) else [o for o in outputs if o]
    assert len(exp) == len(out_names)
    for name, e in zip(out_names, exp):
        assert_close(got[name], e, rtol, atol, what=f"{op} {name}")
    return got


def _up(a):
    return a.astype(F32) if a.dtype == F16 else a


FLOATS = [F32, F16]

# -- elementwise arithmetic -------------------------------------------------------------------

BIN_SHAPES = [((3, 4), (3, 4)), ((2, 1, 5), (4, 1)), ((), (3,)), ((4, 1), (1, 6)), ((0, 3), (3,))]


@covers("Add", "Sub", "Mul")
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
@pytest.mark.parametrize("dtype", [F32, F16, I64, I32])
@pytest.mark.parametrize("shapes", BIN_SHAPES)
def test_add_sub_mul(rng, op, dtype, shapes):
    check(op, [rand(rng, shapes[0], dtype, -9, 9), rand(rng, shapes[1], dtype, -9, 9)], opset=14)


def _nonzero(rng, shape, dtype, lo, hi):
    b = rand(rng, shape, dtype, lo, hi)
    return np.where(b == 0, np.ones_like(b), b)


@covers("Div")
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shapes", BIN_SHAPES)
def test_div_float(rng, dtype, shapes):
    a = rand(rng, shapes[0], dtype)
    b = rand(rng, shapes[1], dtype, 0.5, 3) * np.where(rng.random(shapes[1]) < 0.5, -1, 1).astype(dtype)
    check("Div", [a, b], opset=14)


@covers("Div")
@pytest.mark.parametrize("dtype", [I64, I32])
@pytest.mark.parametrize("shapes", BIN_SHAPES)
def test_div_int_truncates_toward_zero(rng, dtype, shapes):
    a = rand(rng, shapes[0], dtype, -20, 20)
    b = _nonzero(rng, shapes[1], dtype, -6, 6)
    got = check("Div", [a, b], opset=14)
    # spelled out: C semantics, -7 / 2 == -3 (numpy's // would give -4)
    want = np.trunc(a.astype(np.float64) / b.astype(np.float64)).astype(dtype)
    np.testing.assert_array_equal(got["out0"], want)


@covers("Pow")
@pytest.mark.parametrize("base, exp", [(F32, F32), (F16, F16), (F16, F32), (F32, I64), (I64, I64)])
@pytest.mark.parametrize("shapes", BIN_SHAPES[:4])
def test_pow(rng, base, exp, shapes):
    if np.dtype(base).kind == "f":
        x = rand(rng, shapes[0], base, 0.1, 2.5)
    else:
        x = rand(rng, shapes[0], base, -4, 4)
    y = rand(rng, shapes[1], exp, 0, 3) if np.dtype(exp).kind == "i" else rand(rng, shapes[1], exp, -2, 2)
    # float32 pow: numpy's powf differs from the oracle's by an ulp or two (still 1e-5 relative)
    check("Pow", [x, y], opset=15)


@covers("Mod")
@pytest.mark.parametrize("dtype", [I64, I32])
@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("shapes", BIN_SHAPES[:4])
def test_mod_int(rng, dtype, fmod, shapes):
    a = rand(rng, shapes[0], dtype, -20, 20)
    b = _nonzero(rng, shapes[1], dtype, -7, 7)
    check("Mod", [a, b], {"fmod": fmod}, opset=13)


@covers("Mod")
@pytest.mark.parametrize("dtype", FLOATS)
def test_mod_float_fmod(rng, dtype):
    a = rand(rng, (3, 5), dtype, -10, 10)
    b = _nonzero(rng, (5,), dtype, -4, 4)
    check("Mod", [a, b], {"fmod": 1}, opset=13)


VARIADIC_SHAPES = [[(3, 4)], [(3, 4), (4,)], [(2, 1, 4), (3, 1), (1,)], [(), (2, 3), (1, 3)]]


@covers("Max", "Min", "Sum")
@pytest.mark.parametrize("op", ["Max", "Min", "Sum"])
@pytest.mark.parametrize("dtype", [F32, F16, I64])
@pytest.mark.parametrize("shapes", VARIADIC_SHAPES)
def test_variadic(rng, op, dtype, shapes):
    check(op, [rand(rng, s, dtype, -9, 9) for s in shapes], opset=13)


# -- comparisons and logic -------------------------------------------------------------------


@covers("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")
@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [F32, F16, I64])
@pytest.mark.parametrize("shapes", BIN_SHAPES[:4])
def test_compare(rng, op, dtype, shapes):
    # small integer values (also as floats) so that ties occur
    a = rand(rng, shapes[0], I64, -2, 2).astype(dtype)
    b = rand(rng, shapes[1], I64, -2, 2).astype(dtype)
    check(op, [a, b], opset=16)


@covers("Equal")
def test_equal_bool(rng):
    check("Equal", [rand(rng, (4, 3), BOOL), rand(rng, (3,), BOOL)], opset=19)


@covers("And", "Or", "Xor")
@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
@pytest.mark.parametrize("shapes", BIN_SHAPES)
def test_logical(rng, op, shapes):
    check(op, [rand(rng, shapes[0], BOOL), rand(rng, shapes[1], BOOL)], opset=7)


@covers("Not")
@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
def test_not(rng, shape):
    check("Not", [rand(rng, shape, BOOL)], opset=1)


@covers("Where")
@pytest.mark.parametrize("dtype", [F32, F16, I64, BOOL])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((4,), (3, 1), ()), ((2, 1, 1), (1, 5), (3, 1))])
def test_where(rng, dtype, shapes):
    check("Where", [rand(rng, shapes[0], BOOL), rand(rng, shapes[1], dtype), rand(rng, shapes[2], dtype)],
          opset=16)


# -- unary -----------------------------------------------------------------------------------

UNARY_FLOAT_DOMAIN = {
    "Sqrt": (0.0, 9.0), "Reciprocal": (0.25, 4.0), "Exp": (-5.0, 5.0), "Log": (0.05, 20.0),
    "Tanh": (-4.0, 4.0), "Sigmoid": (-8.0, 8.0), "Erf": (-3.0, 3.0), "Cos": (-6.0, 6.0), "Sin": (-6.0, 6.0),
    "Floor": (-5.0, 5.0), "Ceil": (-5.0, 5.0), "Softplus": (-8.0, 8.0),
}


@covers(*UNARY_FLOAT_DOMAIN)
@pytest.mark.parametrize("op", sorted(UNARY_FLOAT_DOMAIN))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (0, 2)])
def test_unary_float(rng, op, dtype, shape):
    lo, hi = UNARY_FLOAT_DOMAIN[op]
    x = rand(rng, shape, dtype, lo, hi)
    if op == "Reciprocal":
        x = x * np.where(rng.random(shape) < 0.5, -1, 1).astype(dtype)
    # Erf, Sigmoid, Softplus: the IR computes in float64 and rounds once, the oracle in float32;
    # that differs by an ulp of float32 near 0 -> atol 1e-6 covers it, rtol stays 1e-5
    check(op, [x], opset=13)


@covers("Neg", "Abs", "Relu", "Sign", "Identity")
@pytest.mark.parametrize("op", ["Neg", "Abs", "Relu", "Sign", "Identity"])
@pytest.mark.parametrize("dtype", [F32, F16, I64, I32])
@pytest.mark.parametrize("shape", [(), (6,), (2, 3, 4)])
def test_unary_any(rng, op, dtype, shape):
    x = rand(rng, shape, dtype, -5, 5)
    if np.dtype(dtype).kind == "f":
        x.reshape(-1)[:1] = 0  # Sign(0) == 0
    check(op, [x], opset=14)


@covers("Identity")
def test_identity_bool(rng):
    check("Identity", [rand(rng, (3, 2), BOOL)], opset=14)


def _specials(rng, shape, dtype):
    x = rand(rng, shape, dtype).reshape(-1)
    idx = rng.permutation(x.size)
    x[idx[0]] = np.nan
    x[idx[1]] = np.inf
    x[idx[2]] = -np.inf
    return x.reshape(shape)


@covers("IsNaN")
@pytest.mark.parametrize("dtype", FLOATS)
def test_isnan(rng, dtype):
    check("IsNaN", [_specials(rng, (3, 5), dtype)], opset=20)


@covers("IsInf")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("attrs", [{}, {"detect_negative": 0}, {"detect_positive": 0},
                                   {"detect_negative": 0, "detect_positive": 0}])
def test_isinf(rng, dtype, attrs):
    check("IsInf", [_specials(rng, (4, 5), dtype)], attrs, opset=20)


CASTS = [(F32, I64), (F32, I32), (F32, F16), (F16, F32), (I64, F32), (I32, I64), (I64, I32), (F32, BOOL),
         (BOOL, F32), (I64, BOOL), (BOOL, I64), (F16, I64), (BOOL, F16)]


@covers("Cast")
@pytest.mark.parametrize("src, dst", CASTS)
@pytest.mark.parametrize("shape", [(), (3, 4)])
def test_cast(rng, src, dst, shape):
    x = rand(rng, shape, src, -50, 50)
    if np.dtype(src).kind == "f":
        x = (x * 1.37).astype(src)  # fractions, negative and positive: Cast truncates toward zero
        x.reshape(-1)[:1] = 0
    check("Cast", [x], {"to": H.np_dtype_to_tensor_dtype(np.dtype(dst))}, opset=19)


@covers("Cast")
def test_castlike(rng):
    x = rand(rng, (2, 3), F32, -9, 9)
    check("CastLike", [x, C(np.zeros((1,), I32))], opset=19, ir_op="Cast")


@covers("Clip")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("attrs", [{"min": -1.0, "max": 1.5}, {"min": 0.0}, {"max": -0.5}, {}])
def test_clip_opset6_attributes(rng, dtype, attrs):
    check("Clip", [rand(rng, (3, 4), dtype)], attrs, opset=6)


@covers("Clip")
@pytest.mark.parametrize("dtype", [F32, F16, I64])
@pytest.mark.parametrize("bounds", [(-1, 2), (0, None), (None, 1), (None, None)])
@pytest.mark.parametrize("as_input", [False, True])
def test_clip_opset13_inputs(rng, dtype, bounds, as_input):
    x = rand(rng, (2, 3, 4), dtype, -4, 4)
    args = [x]
    for b in bounds:
        if b is None:
            args.append(None)
        else:
            v = np.array(b, dtype)
            args.append(v if as_input else C(v))
    while args[-1] is None and len(args) > 1:
        args.pop()
    check("Clip", args, opset=13)


@covers("Gelu")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(8,), (2, 3, 5)])
def test_gelu(rng, dtype, approximate, shape):
    # the IR evaluates in float64 and rounds once; the oracle's float32 tanh/erf chain is a few ulps
    # off near the tails -> atol 1e-5 (values are O(1))
    check("Gelu", [rand(rng, shape, dtype, -4, 4)], {"approximate": approximate}, opset=20, atol=1e-5)


# -- reductions ------------------------------------------------------------------------------

REDUCE_OPS = ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL2"]


def _reduce_args(op, x, axes, opset):
    """(args, attrs): axes as an input where the opset says so, else as an attribute."""
    as_input = opset >= 18 or op == "ReduceSum"
    if axes is None:
        return [x], {}
    if as_input:
        return [x, C(np.array(axes, I64))], {}
    return [x], {"axes": list(axes)}


@covers(*REDUCE_OPS)
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes, keepdims", [(None, 1), (None, 0), ((1,), 1), ((1,), 0), ((-1, 0), 0), ((0, 2), 1)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce(rng, op, opset, axes, keepdims, dtype):
    lo, hi = (0.5, 1.5) if op == "ReduceProd" else (-3, 3)
    x = rand(rng, (3, 4, 5), dtype, lo, hi)
    args, attrs = _reduce_args(op, x, axes, opset)
    attrs["keepdims"] = keepdims
    # float32 sums of 60 terms: numpy's pairwise summation order differs from the oracle's -> rtol 1e-5
    # still holds; fp16 accumulates in float32 (see module docstring)
    check(op, args, attrs, opset=opset, fp16_via_fp32=True)


@covers(*REDUCE_OPS)
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_empty_axes(rng, op, noop):
    """opset 18: an empty axes input reduces everything, or nothing with noop_with_empty_axes=1."""
    x = rand(rng, (2, 3), F32, -1.5, 1.5)  # negative values: SumSquare/L2 still square each element
    check(op, [x, C(np.zeros((0,), I64))], {"noop_with_empty_axes": noop, "keepdims": 0}, opset=18,
          ir_op=op)


@covers("ReduceSum")
@pytest.mark.parametrize("noop", [0, 1])
def test_reducesum_opset13_noop(rng, noop):
    check("ReduceSum", [rand(rng, (3, 2), F32)], {"noop_with_empty_axes": noop}, opset=13)


@covers("ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd")
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("axes", [(0,), (-1,), None])
def test_reduce_int(rng, op, axes):
    x = rand(rng, (3, 4), I64, -3, 3)
    args, attrs = _reduce_args(op, x, axes, 18)
    check(op, args, attrs, opset=18)


@covers("ArgMax", "ArgMin")
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("select_last_index", [0, 1])
@pytest.mark.parametrize("dtype", [F32, F16, I64])
def test_arg(rng, op, axis, keepdims, select_last_index, dtype):
    x = rand(rng, (3, 4, 5), I64, -2, 2).astype(dtype)  # few distinct values: ties everywhere
    check(op, [x], {"axis": axis, "keepdims": keepdims, "select_last_index": select_last_index}, opset=13)


@covers("Softmax", "LogSoftmax")
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 7)])
def test_softmax(rng, op, axis, dtype, shape):
    # softmax divides by a float32 sum whose order differs from the oracle's: atol 1e-6 on [0, 1]
    # outputs, log-softmax values are O(5): rtol 1e-5 covers them
    check(op, [rand(rng, shape, dtype, -5, 5)], {"axis": axis}, opset=13, fp16_via_fp32=True)


# -- MatMul / Gemm ---------------------------------------------------------------------------


@covers("MatMul")
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)),
                                    ((2, 1, 3, 4), (3, 4, 2)), ((1, 4), (2, 4, 3)), ((0, 4), (4, 2))])
def test_matmul(rng, dtype, shapes):
    # float32 dot products of <= 4 terms: summation order can differ by an ulp -> default tolerance holds
    check("MatMul", [rand(rng, shapes[0], dtype), rand(rng, shapes[1], dtype)], opset=13, fp16_via_fp32=True)


@covers("MatMul")
def test_matmul_int64(rng):
    check("MatMul", [rand(rng, (2, 3), I64, -5, 5), rand(rng, (3, 4), I64, -5, 5)], opset=13)


@covers("Gemm")
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, -2.0)])
@pytest.mark.parametrize("bias", [None, (5,), (3, 5), (1, 5), (3, 1)])
def test_gemm(rng, dtype, trans_a, trans_b, alpha, beta, bias):
    a = rand(rng, (4, 3) if trans_a else (3, 4), dtype)
    b = rand(rng, (5, 4) if trans_b else (4, 5), dtype)
    args = [a, b] + ([] if bias is None else [rand(rng, bias, dtype)])
    check("Gemm", args, {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}, opset=13,
          fp16_via_fp32=True)


# -- normalizations --------------------------------------------------------------------------


@covers("LayerNormalization")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm(rng, dtype, axis, n_out, with_bias):
    x = rand(rng, (2, 3, 8), dtype)
    norm_shape = x.shape[axis:]
    args = [x, rand(rng, norm_shape, dtype, 0.5, 1.5)] + ([rand(rng, norm_shape, dtype)] if with_bias else [])
    # normalized outputs are O(3): float32 mean/variance in a different order -> atol 1e-5.
    # float16: onnxruntime, which (like the spec, stash_type=1) computes in float32 and returns float32
    # Mean/InvStdDev; the reference evaluator returns them as float16
    check("LayerNormalization", args, {"axis": axis, "epsilon": 1e-5}, opset=17, outputs=n_out, atol=1e-5,
          oracle="ort" if dtype == F16 else "ref")


@covers("LayerNormalization")
def test_layernorm_mean_only(rng):
    """Outputs 0 and 1 named, 2 omitted."""
    x = rand(rng, (4, 6), F32)
    check("LayerNormalization", [x, rand(rng, (6,), F32)], opset=17, outputs=["out0", "out1"], atol=1e-5)


@covers("RMSNormalization")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("epsilon", [1e-5, 0.1])
def test_rmsnorm(rng, dtype, axis, epsilon):
    x = rand(rng, (2, 3, 8), dtype)
    scale = rand(rng, x.shape[axis:], dtype, 0.5, 1.5)
    check("RMSNormalization", [x, scale], {"axis": axis, "epsilon": epsilon}, opset=23, atol=1e-5,
          fp16_via_fp32=True)


# -- RotaryEmbedding / Attention (opset 23) --------------------------------------------------


@covers("RotaryEmbedding")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot_dim", [0, 4])
@pytest.mark.parametrize("with_pos", [False, True])
def test_rotary(rng, dtype, rank, interleaved, rot_dim, with_pos):
    b, h, s, d = 2, 3, 5, 8
    x = rand(rng, (b, h, s, d) if rank == 4 else (b, s, h * d), dtype)
    half = (rot_dim or d) // 2
    if with_pos:
        max_pos = 11
        angles = rng.uniform(0, 6.3, (max_pos, half))
        pos = rng.integers(0, max_pos, (b, s)).astype(I64)
    else:
        angles = rng.uniform(0, 6.3, (b, s, half))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    attrs = {"interleaved": interleaved}
    if rot_dim:
        attrs["rotary_embedding_dim"] = rot_dim
    if rank == 3:
        attrs["num_heads"] = h
    args = [x, cos, sin] + ([pos] if with_pos else [])
    check("RotaryEmbedding", args, attrs, opset=23, fp16_via_fp32=True)


ATTENTION_CASES = {
    # name: (rank, q heads, kv heads, q seq, kv seq, past, causal, mask)
    "4d": (4, 2, 2, 3, 5, 0, 0, None),
    "3d": (3, 2, 2, 3, 5, 0, 0, None),
    "gqa": (4, 4, 2, 3, 5, 0, 0, None),
    "gqa_3d": (3, 4, 2, 3, 3, 0, 1, None),
    "past": (4, 2, 2, 2, 2, 3, 0, None),
    "past_gqa_causal": (4, 4, 2, 2, 2, 4, 1, None),
    "causal": (4, 2, 2, 4, 4, 0, 1, None),
    "bool_mask": (4, 2, 2, 3, 5, 0, 0, "bool"),
    "float_mask": (4, 2, 2, 3, 5, 0, 0, "float"),
    "bool_mask_4d_causal_past": (4, 4, 2, 2, 2, 3, 1, "bool4"),
    "float_mask_3d_past": (3, 2, 2, 1, 1, 4, 0, "float"),
    "zero_past": (4, 2, 2, 3, 3, -1, 1, None),  # past key/value with length 0
}


@covers("Attention")
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention(rng, dtype, case):
    rank, hq, hk, sq, skv, past, causal, mask = ATTENTION_CASES[case]
    b, d = 2, 4
    if rank == 4:
        q, k, v = rand(rng, (b, hq, sq, d), dtype), rand(rng, (b, hk, skv, d), dtype), rand(rng, (b, hk, skv, d), dtype)
        attrs = {}
    else:
        q = rand(rng, (b, sq, hq * d), dtype)
        k, v = rand(rng, (b, skv, hk * d), dtype), rand(rng, (b, skv, hk * d), dtype)
        attrs = {"q_num_heads": hq, "kv_num_heads": hk}
    if causal:
        attrs["is_causal"] = 1
    plen = max(past, 0)
    total = skv + plen
    args = [q, k, v]
    if mask == "bool":
        m = rng.random((sq, total)) < 0.7
        m[:, 0] = True  # no fully masked row
        args.append(m)
    elif mask == "bool4":
        m = rng.random((b, 1, sq, total)) < 0.7
        m[..., 0] = True
        args.append(m)
    elif mask == "float":
        args.append(rand(rng, (b, 1, sq, total), dtype, -2, 0))
    else:
        args.append(None)
    n_out = 1
    if past:
        args += [rand(rng, (b, hk, plen, d), dtype), rand(rng, (b, hk, plen, d), dtype)]
        n_out = 3
    # softmax and two float32 matmuls whose summation order differs from the oracle's -> atol 1e-5
    check("Attention", args, attrs, opset=23, outputs=n_out, atol=1e-5, fp16_via_fp32=True)


@covers("Attention")
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention_qk_output(rng, mode, softcap, scale):
    """The 4th output under every qk_matmul_output_mode, with a float mask and causal bias."""
    b, h, sq, skv, d = 1, 2, 3, 4, 4
    q, k, v = rand(rng, (b, h, sq, d), F32), rand(rng, (b, h, skv, d), F32), rand(rng, (b, h, skv, d), F32)
    m = rand(rng, (sq, skv), F32, -1, 0)
    attrs = {"qk_matmul_output_mode": mode, "is_causal": 1}
    if softcap:
        attrs["softcap"] = softcap
    if scale:
        attrs["scale"] = scale
    # mode 0 with softcap: onnxruntime, as the reference evaluator softcaps the mode-0 output, which the
    # spec defines as the plain Q.K^T product (onnxruntime agrees with the spec). Elsewhere the reference:
    # onnxruntime writes masked scores as -FLT_MAX where the reference (and the IR) write -inf
    oracle = "ort" if mode == 0 and softcap else "ref"
    check("Attention", [q, k, v, m], attrs, opset=23, outputs=["out0", "", "", "out3"], atol=1e-5, oracle=oracle)


# -- movement --------------------------------------------------------------------------------


@covers("Reshape")
@pytest.mark.parametrize("dtype", [F32, I64, BOOL])
@pytest.mark.parametrize("in_shape, target, allowzero", [
    ((2, 3, 4), (6, 4), 0), ((2, 3, 4), (0, -1), 0), ((2, 3, 4), (-1,), 0), ((2, 3, 4), (0, 0, 2, 2), 0),
    ((2, 3, 4), (4, -1, 3), 0), ((0, 3), (3, 0), 1), ((0, 3), (-1, 3), 0), ((2, 3, 4), (2, 12, 1, 1), 1),
    ((6,), (-1, 2, 1), 0),
])
def test_reshape(rng, dtype, in_shape, target, allowzero):
    check("Reshape", [rand(rng, in_shape, dtype), C(np.array(target, I64))], {"allowzero": allowzero}, opset=14)


@covers("Transpose")
@pytest.mark.parametrize("shape, perm", [((2, 3), None), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4, 5), (0, 2, 1, 3)),
                                         ((2, 3, 4), None), ((3,), (0,))])
@pytest.mark.parametrize("dtype", [F32, F16, I64])
def test_transpose(rng, shape, perm, dtype):
    check("Transpose", [rand(rng, shape, dtype)], {} if perm is None else {"perm": list(perm)}, opset=13)


@covers("Squeeze")
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("shape, axes", [((1, 3, 1, 2), None), ((1, 3, 1, 2), (0,)), ((1, 3, 1, 2), (-2, 0)),
                                         ((2, 1), (1,)), ((1,), None)])
def test_squeeze(rng, opset, shape, axes):
    x = rand(rng, shape, F32)
    if axes is None:
        check("Squeeze", [x], opset=opset)
    elif opset >= 13:
        check("Squeeze", [x, C(np.array(axes, I64))], opset=opset)
    else:
        check("Squeeze", [x], {"axes": list(axes)}, opset=opset)


@covers("Unsqueeze")
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("shape, axes", [((3, 2), (0,)), ((3, 2), (-1,)), ((3, 2), (0, 3)), ((3, 2), (-1, 1)),
                                         ((), (0,)), ((4,), (2, 0))])
@pytest.mark.parametrize("dtype", [F32, I64])
def test_unsqueeze(rng, opset, shape, axes, dtype):
    x = rand(rng, shape, dtype)
    if opset >= 13:
        check("Unsqueeze", [x, C(np.array(axes, I64))], opset=opset)
    else:
        # onnxruntime for unsorted axes: the reference evaluator's opset-11 Unsqueeze inserts them in the
        # given order, which the spec says does not matter
        check("Unsqueeze", [x], {"axes": list(axes)}, opset=opset,
              oracle="ort" if list(axes) != sorted(axes) else "ref")


@covers("Flatten")
@pytest.mark.parametrize("axis", [0, 1, 2, -1, 3])
def test_flatten(rng, axis):
    check("Flatten", [rand(rng, (2, 3, 4), F32)], {"axis": axis}, opset=13)


@covers("Expand")
@pytest.mark.parametrize("in_shape, shape", [((3, 1), (3, 4)), ((3, 1), (2, 1, 4)), ((1,), (5,)),
                                             ((2, 3), (3,)), ((2, 1, 4), (1, 3, 1)), ((3,), (0, 3))])
@pytest.mark.parametrize("dtype", [F32, I64, BOOL])
def test_expand(rng, in_shape, shape, dtype):
    check("Expand", [rand(rng, in_shape, dtype), C(np.array(shape, I64))], opset=13)


@covers("Tile")
@pytest.mark.parametrize("in_shape, reps", [((2, 3), (1, 2)), ((2, 3), (3, 1)), ((4,), (0,)), ((1, 2, 1), (2, 2, 3))])
def test_tile(rng, in_shape, reps):
    check("Tile", [rand(rng, in_shape, F32), C(np.array(reps, I64))], opset=13)


@covers("Concat")
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [F32, F16, I64, BOOL])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_concat(rng, axis, dtype, n):
    sizes = [2, 0, 3][:n]
    shapes = []
    for sz in sizes:
        s = [2, 3, 4]
        s[axis] = sz
        shapes.append(tuple(s))
    check("Concat", [rand(rng, s, dtype) for s in shapes], {"axis": axis}, opset=13)


@covers("Split")
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("variant", ["equal", "sizes", "num_outputs", "num_outputs_uneven", "attr11"])
def test_split(rng, axis, variant):
    shape = [6, 6, 7]
    shape[axis] = 7 if variant == "num_outputs_uneven" else 6
    x = rand(rng, tuple(shape), F32)
    if variant == "equal":
        check("Split", [x], {"axis": axis}, opset=13, outputs=3)
    elif variant == "sizes":
        check("Split", [x, C(np.array([1, 0, 5], I64))], {"axis": axis}, opset=13, outputs=3)
    elif variant == "num_outputs":
        check("Split", [x], {"axis": axis, "num_outputs": 2}, opset=18, outputs=2)
    elif variant == "num_outputs_uneven":  # 7 -> 3, 3, 1
        check("Split", [x], {"axis": axis, "num_outputs": 3}, opset=18, outputs=3)
    else:
        check("Split", [x], {"axis": axis, "split": [2, 4]}, opset=11, outputs=2)


SLICES = [
    # starts, ends, axes, steps (None: omitted)
    ([1], [3], [0], None),
    ([0, 1], [INT64_MAX, -1], [0, 1], None),
    ([-1], [INT64_MIN], [1], [-1]),
    ([INT64_MAX], [INT64_MIN], [-1], [-2]),
    ([-3, 10], [-1, -100], [2, 0], [1, -1]),
    ([1], [100], [1], [2]),
    ([4], [1], [1], [1]),  # empty: start after end
    ([2], [2], [0], None),  # empty
    ([5], [0], [2], [-3]),
    ([-100], [100], [0], None),  # clamped both sides
    ([0, 0, 0], [1, 1, 1], None, None),
    ([3], [-10], [1], [-1]),
]


@covers("Slice")
@pytest.mark.parametrize("starts, ends, axes, steps", SLICES)
@pytest.mark.parametrize("dtype", [F32, I64])
def test_slice(rng, starts, ends, axes, steps, dtype):
    x = rand(rng, (4, 5, 6), dtype)
    args = [x, C(np.array(starts, I64)), C(np.array(ends, I64))]
    if axes is not None or steps is not None:
        args.append(C(np.array(axes if axes is not None else list(range(len(starts))), I64)))
    if steps is not None:
        args.append(C(np.array(steps, I64)))
    check("Slice", args, opset=13)


@covers("Gather")
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("idx_shape", [(), (3,), (2, 2)])
@pytest.mark.parametrize("idx_dtype", [I64, I32])
def test_gather(rng, axis, idx_shape, idx_dtype):
    x = rand(rng, (4, 5, 3), F32)
    n = x.shape[axis]
    idx = rng.integers(-n, n, size=idx_shape).astype(idx_dtype)  # negative indices wrap
    check("Gather", [x, idx], {"axis": axis}, opset=13)


@covers("Gather")
def test_gather_constant_indices(rng):
    check("Gather", [rand(rng, (6, 2), I64), C(np.array([-1, 0, -6], I64))], {"axis": 0}, opset=13)


@covers("GatherND")
@pytest.mark.parametrize("batch_dims, data_shape, idx_shape", [
    (0, (3, 4), (2, 2)), (0, (3, 4, 5), (2, 1)), (0, (3, 4, 5), (2, 3, 2)), (1, (2, 3, 4), (2, 1)),
    (1, (2, 3, 4), (2, 5, 2)), (2, (2, 3, 4, 5), (2, 3, 1)),
])
@pytest.mark.parametrize("negative", [False, True])
def test_gathernd(rng, batch_dims, data_shape, idx_shape, negative):
    x = rand(rng, data_shape, F32)
    k = idx_shape[-1]
    bounds = data_shape[batch_dims:batch_dims + k]
    idx = np.stack([rng.integers(-b if negative else 0, b, size=idx_shape[:-1]) for b in bounds], -1).astype(I64)
    # onnxruntime: the reference evaluator does not wrap negative indices
    check("GatherND", [x, idx], {"batch_dims": batch_dims}, opset=13, oracle="ort" if negative else "ref")


@covers("ScatterND")
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("data_shape, idx", [((5,), [[1], [3]]), ((4, 3), [[0], [2]]),
                                             ((4, 3), [[1, 2], [3, 0], [0, 0]]), ((2, 3, 4), [[[1, 0]], [[0, 2]]])])
def test_scatternd(rng, reduction, data_shape, idx):
    idx = np.array(idx, I64)
    if reduction != "none" and idx.shape[0] > 1:  # duplicate an index: reductions must combine
        idx = np.concatenate([idx, idx[:1]], 0)
    upd_shape = idx.shape[:-1] + data_shape[idx.shape[-1]:]
    x = rand(rng, data_shape, F32)
    upd = rand(rng, upd_shape, F32)
    check("ScatterND", [x, C(idx) if reduction == "none" else idx, upd], {"reduction": reduction}, opset=18)


@covers("Trilu")
@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -1, 3, -5])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 3), (5, 2)])
def test_trilu(rng, upper, k, shape):
    args = [rand(rng, shape, F32)] + ([] if k is None else [C(np.array(k, I64))])
    check("Trilu", args, {"upper": upper}, opset=14)


@covers("CumSum")
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, -1, 1])
@pytest.mark.parametrize("dtype", [F32, I64])
def test_cumsum(rng, exclusive, reverse, axis, dtype):
    x = rand(rng, (3, 4, 2), dtype, -5, 5)
    # float32 prefix sums of <= 4 terms: identical order to the oracle
    check("CumSum", [x, C(np.array(axis, I64))], {"exclusive": exclusive, "reverse": reverse}, opset=14)


# -- sources ---------------------------------------------------------------------------------


def _dynamic_input(name, dtype, dims):
    return H.make_tensor_value_info(name, H.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims)


@covers("Range")
@pytest.mark.parametrize("dtype, start, limit, delta", [
    (I64, 0, 7, 1), (I64, 10, -3, -3), (I64, 2, 2, 1), (I32, -5, 9, 4),
    (F32, 0.5, 3.7, 0.4), (F32, 1.0, -2.0, -0.75), (F32, 0.0, 0.0, 1.0),
])
def test_range_folded(dtype, start, limit, delta):
    """Constant bounds: the importer folds Range with the op's own reference; compare the folded output."""
    args = [C(np.array(v, dtype)) for v in (start, limit, delta)]
    check("Range", args, opset=11, ir_op=None)


@covers("Range")
@pytest.mark.parametrize("start, delta", [(0, 1), (1, 2), (0, 3), (9, -2), (8, -1)])
@pytest.mark.parametrize("n", [1, 5, 8])
def test_range_symbolic(start, delta, n):
    """Range(start, x.shape[0], delta) on a dynamic dim: the IR Range node runs at interpret time."""
    nodes = [
        H.make_node("Shape", ["x"], ["shp"]),
        H.make_node("Gather", ["shp", "zero"], ["lim"], axis=0),
        H.make_node("Range", ["start", "lim", "delta"], ["y"]),
    ]
    inits = [NH.from_array(np.array(0, I64), "zero"), NH.from_array(np.array(start, I64), "start"),
             NH.from_array(np.array(delta, I64), "delta")]
    model = H.make_model(H.make_graph(nodes, "r", [_dynamic_input("x", F32, ["n"])],
                                      [H.make_empty_tensor_value_info("y")], initializer=inits),
                         opset_imports=[H.make_opsetid("", 13)])
    graph = import_onnx(model)
    assert any(nd.op == "Range" for nd in graph.nodes)
    x = np.zeros((n,), F32)
    got = interpret(graph, {"x": x})["y"]
    assert_close(got, ReferenceEvaluator(model).run(None, {"x": x})[0])


@covers("Range")
def test_range_ir_float():
    """The IR Range reference run directly (float bounds are always folded on import)."""
    g = Graph("r")
    out = Value("y", "float32", (4,))
    g.nodes.append(Node("Range", [], [out], {"start": 0.5, "limit": 2.5, "delta": 0.5, "dtype": "float32"}))
    g.outputs.append(out)
    verify(g)
    np.testing.assert_array_equal(interpret(g, {})["y"], np.array([0.5, 1.0, 1.5, 2.0], F32))


@covers("ConstantOfShape")
@pytest.mark.parametrize("value", [None, np.array([1.5], F32), np.array([-3], I64), np.array([2.0], F16),
                                   np.array([True]), np.array([7], I32)])
@pytest.mark.parametrize("shape", [(2, 3), (0, 4), ()])
def test_constant_of_shape_folded(value, shape):
    attrs = {} if value is None else {"value": NH.from_array(value)}
    check("ConstantOfShape", [C(np.array(shape, I64))], attrs, opset=20, ir_op=None)


@covers("ConstantOfShape")
@pytest.mark.parametrize("value", [None, np.array([1.5], F32), np.array([-3], I64)])
@pytest.mark.parametrize("shape", [(3, 2), (1, 5), (0, 2)])
def test_constant_of_shape_symbolic(value, shape):
    """ConstantOfShape(Shape(x)) on dynamic dims: the IR node runs at interpret time."""
    attrs = {} if value is None else {"value": NH.from_array(value)}
    nodes = [H.make_node("Shape", ["x"], ["shp"]), H.make_node("ConstantOfShape", ["shp"], ["y"], **attrs)]
    # symbols named past* may be 0 (others are >= 1 by the importer's convention)
    model = H.make_model(H.make_graph(nodes, "c", [_dynamic_input("x", F32, ["past_a", "b"])],
                                      [H.make_empty_tensor_value_info("y")]),
                         opset_imports=[H.make_opsetid("", 20)])
    graph = import_onnx(model)
    assert any(nd.op == "ConstantOfShape" for nd in graph.nodes)
    x = np.zeros(shape, F32)
    assert_close(interpret(graph, {"x": x})["y"], ReferenceEvaluator(model).run(None, {"x": x})[0])


@covers("DimsTensor")
@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("bindings", [(2, 5), (1, 1), (7, 0)])
def test_dims_tensor(dtype, bindings):
    """DimsTensor is IR-only: build the graph directly and check the evaluated dims."""
    b, s = S.sym("batch"), S.sym("past")
    g = Graph("dims")
    g.symbols = {"batch": SymbolInfo(1), "past": SymbolInfo(0)}
    x = Value("x", "float32", (b, s))
    g.inputs.append(x)
    dims = (b, s, S.add(S.mul(b, s), 1), 4, S.floordiv(S.add(s, 1), 2), S.dmax(s, 3))
    vec = Value("vec", dtype, (len(dims),))
    scal = Value("scal", dtype, ())
    g.nodes.append(Node("DimsTensor", [], [vec], {"dims": dims, "dtype": dtype}))
    g.nodes.append(Node("DimsTensor", [], [scal], {"dims": (S.mul(b, 3),), "dtype": dtype, "scalar": True}))
    g.outputs += [vec, scal]
    verify(g)
    bv, sv = bindings
    out = interpret(g, {"x": np.zeros((bv, sv), F32)})
    want = np.array([bv, sv, bv * sv + 1, 4, (sv + 1) // 2, max(sv, 3)], dtype)
    assert out["vec"].dtype == np.dtype(dtype) and out["vec"].shape == (6,)
    np.testing.assert_array_equal(out["vec"], want)
    assert out["scal"].shape == () and out["scal"].dtype == np.dtype(dtype) and int(out["scal"]) == 3 * bv


@covers("FusedElementwise")
def test_fused_elementwise():
    """x * (1 / sqrt(ms + eps)) * w with a float16 store between steps; steps run their own references."""
    rng = np.random.default_rng(5)
    f32, f16 = np.float32, np.float16
    prog = (("Add", (), (("in", 1), ("in", 2))), ("Sqrt", (), (("step", 0),)), ("Reciprocal", (), (("step", 1),)),
            ("Mul", (), (("in", 0), ("step", 2))), ("Cast", (("to", "float16"),), (("step", 3),)),
            ("Mul", (), (("step", 4), ("in", 3))))
    g = Graph("fused")
    ins = [Value("x", "float32", (2, 3, 8)), Value("ms", "float32", (2, 3, 1)), Value("eps", "float32", ()),
           Value("w", "float16", (8,))]
    y = Value("y", "float16", (2, 3, 8))
    g.inputs, g.outputs = ins, [y]
    g.nodes.append(Node("FusedElementwise", ins, [y],
                        {"program": prog, "out_shape": (2, 3, 8), "out_dtype": "float16"}))
    verify(g)
    x, ms = rng.standard_normal((2, 3, 8)).astype(f32), rng.uniform(0.1, 2, (2, 3, 1)).astype(f32)
    w, eps = rng.standard_normal(8).astype(f16), np.array(1e-6, f32)
    want = (x * np.reciprocal(np.sqrt(ms + eps))).astype(f16) * w
    np.testing.assert_array_equal(interpret(g, {"x": x, "ms": ms, "eps": eps, "w": w})["y"], want)


@covers("Linear")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_linear(dtype):
    """Linear(x, w[N, K], b) = x @ w.T + b, float16 accumulated in float32 and rounded once (like MatMul)."""
    rng = np.random.default_rng(6)
    g = Graph("linear")
    x = Value("x", dtype, (2, 3, 16))
    w = constant("w", rng.standard_normal((5, 16)).astype(dtype))
    bias = constant("b", rng.standard_normal(5).astype(dtype))
    y = Value("y", dtype, (2, 3, 5))
    g.inputs, g.outputs = [x], [y]
    g.nodes.append(Node("Linear", [x, w, bias], [y]))
    verify(g)
    xv = rng.standard_normal((2, 3, 16)).astype(dtype)
    want = (xv.astype(np.float32) @ w.data.T.astype(np.float32) + bias.data.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(interpret(g, {"x": xv})["y"], want)


@covers("LinearQ8", "LinearQ4", "LinearF8")
@pytest.mark.parametrize("bits", [8, 4, "f8"])
def test_linear_quantized(bits):
    """Weight-only quantized Linear = x @ dequant(wq).T + b, dequantized exactly in float32, rounded once."""
    from atlasc.ir.ops.quant import dequant_f8
    from atlasc.passes.quantize import dequantize_int4, dequantize_int8, quantize_fp8, quantize_int4, quantize_int8

    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 32)).astype(np.float16)
    if bits == 8:
        wq, scale = quantize_int8(w)
        deq, op, attrs = dequantize_int8(wq, scale), "LinearQ8", {}
    elif bits == "f8":
        wq, scale = quantize_fp8(w)
        deq, op, attrs = dequant_f8(wq, scale), "LinearF8", {}
    else:
        wq, scale = quantize_int4(w, 16)
        deq, op, attrs = dequantize_int4(wq, scale, 16), "LinearQ4", {"group_size": 16}
    g = Graph("q")
    x = Value("x", "float16", (3, 32))
    y = Value("y", "float16", (3, 6))
    g.inputs, g.outputs = [x], [y]
    g.nodes.append(Node(op, [x, constant("wq", wq), constant("s", scale)], [y], attrs))
    verify(g)
    xv = rng.standard_normal((3, 32)).astype(np.float16)
    want = (xv.astype(np.float32) @ deq.astype(np.float32).T).astype(np.float16)
    np.testing.assert_array_equal(interpret(g, {"x": xv})["y"], want)


@covers("Sample")
def test_sample_greedy_and_seeded():
    """Sample is IR-only: greedy = first argmax of the last position; sampling is reproducible by seed.
    tests/test_sampling.py checks its distribution; this keeps the op table's coverage complete."""
    g = Graph("s")
    g.symbols["b"] = SymbolInfo(1)
    b = S.sym("b")
    logits = Value("logits", "float32", (b, 2, 11))
    fp, ip = Value("fp", "float32", (3,)), Value("ip", "int64", (3,))
    out = Value("tok", "int64", (b,))
    g.inputs = [logits, fp, ip]
    g.nodes = [Node("Sample", [logits, fp, ip], [out])]
    g.outputs = [out]
    verify(g)
    x = np.random.default_rng(11).normal(size=(8, 2, 11)).astype(np.float32)
    greedy = interpret(g, {"logits": x, "fp": np.array([0, 1, 0], np.float32), "ip": np.zeros(3, np.int64)})
    np.testing.assert_array_equal(greedy["tok"], x[:, -1].argmax(-1))

    def drawn(seed: int) -> np.ndarray:
        feed = {"logits": x, "fp": np.array([1.0, 0.9, 0], np.float32), "ip": np.array([seed, 3, 0], np.int64)}
        return interpret(g, feed)["tok"]

    from atlasc.ir.ops.sampling import uniform

    want = []  # the definition, in float64: the smallest most-likely set of mass >= 0.9, inverse CDF in index order
    for row, logits_row in enumerate(x[:, -1].astype(np.float64)):
        p = np.exp(logits_row - logits_row.max())
        order = np.argsort(-p)
        kept = order[: int(np.searchsorted(np.cumsum(p[order]), 0.9 * p.sum())) + 1]
        mass = np.where(np.isin(np.arange(p.size), kept), p, 0)
        want.append(int(np.searchsorted(np.cumsum(mass), uniform(5, 3, row) * mass.sum(), side="right")))
    np.testing.assert_array_equal(drawn(5), want)
    assert not np.array_equal(drawn(5), drawn(6))  # the seed is read


@covers("KVAppend")
@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("batch, seq, past", [(2, 3, 0), (1, 1, 5), (3, 2, 6)])
def test_kv_append(rng, kind, batch, seq, past):
    """KVAppend is IR-only and stateful: writes cache[layer, kind, :b, :, past:past+seq] in place and
    returns cache[layer, kind, :b, :, :past+seq]."""
    layers, max_batch, heads, max_seq, head_dim = 2, 3, 2, 8, 4
    b, s_, p_ = S.sym("batch"), S.sym("seq"), S.sym("past_seq")
    g = Graph("kv")
    g.symbols = {"batch": SymbolInfo(1), "seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
    x = Value("x", "float32", (b, heads, s_, head_dim))
    g.inputs.append(x)
    out = Value("present", "float32", (b, heads, S.add(p_, s_), head_dim))
    g.nodes.append(Node("KVAppend", [x], [out], {"layer": 1, "kind": kind, "past": p_}))
    g.outputs.append(out)
    verify(g)
    cache = rand(rng, (layers, 2, max_batch, heads, max_seq, head_dim), F32)
    before = cache.copy()
    xv = rand(rng, (batch, heads, seq, head_dim), F32)
    got = interpret(g, {"x": xv}, state={"kv_cache": cache}, symbols={"past_seq": past})["present"]
    k = 0 if kind == "key" else 1
    want = np.concatenate([before[1, k, :batch, :, :past], xv], axis=2)
    assert_close(got, want)
    after = before.copy()
    after[1, k, :batch, :, past:past + seq] = xv
    np.testing.assert_array_equal(cache, after)  # written in place, nothing else touched


@covers("KVAppend")
def test_kv_append_overflow(rng):
    from atlasc.errors import InputError

    g = Graph("kv")
    g.symbols = {"seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
    x = Value("x", "float32", (1, 1, S.sym("seq"), 2))
    out = Value("present", "float32", (1, 1, S.add(S.sym("past_seq"), S.sym("seq")), 2))
    g.inputs.append(x)
    g.nodes.append(Node("KVAppend", [x], [out], {"layer": 0, "kind": "key", "past": S.sym("past_seq")}))
    g.outputs.append(out)
    cache = np.zeros((1, 2, 1, 1, 4, 2), F32)
    with pytest.raises(InputError):
        interpret(g, {"x": np.ones((1, 1, 3, 2), F32)}, state={"kv_cache": cache}, symbols={"past_seq": 2})


@covers("DequantizeLinear")
@pytest.mark.parametrize("xt, st, axis, block, zp", [
    (np.int8, F32, 1, 0, False), (np.uint8, np.float16, 1, 0, True), (np.int8, F32, 0, 4, True),
    (np.uint8, np.float16, 1, 2, False), (np.int8, F32, 0, 0, False)])
def test_dequantize_linear(rng, xt, st, axis, block, zp):
    """(x - zero_point) * scale per tensor, per axis or per block, against onnx's reference (opset 21)."""
    x = rng.integers(np.iinfo(xt).min, np.iinfo(xt).max, (8, 6)).astype(xt)
    if block:
        sshape = tuple(-(-d // block) if i == axis else d for i, d in enumerate(x.shape))
    else:
        sshape = (x.shape[axis],) if axis == 1 else ()
    scale = rng.uniform(0.01, 0.2, sshape).astype(st)
    feeds = {"x": x, "s": scale}
    ins = ["x", "s"]
    if zp:
        feeds["z"] = rng.integers(0, 5, sshape).astype(xt)
        ins.append("z")
    attrs = {"axis": axis, "block_size": block}
    model = H.make_model(H.make_graph(
        [H.make_node("DequantizeLinear", ins, ["y"], **attrs)], "g",
        [H.make_tensor_value_info(k, H.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)) for k, v in feeds.items()],
        [H.make_tensor_value_info("y", H.np_dtype_to_tensor_dtype(np.dtype(st)), list(x.shape))]),
        opset_imports=[H.make_opsetid("", 21)])
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    g = Graph("dq")
    vals = [Value(k, str(v.dtype), v.shape) for k, v in feeds.items()]
    y = Value("y", str(np.dtype(st)), x.shape)
    g.inputs, g.nodes, g.outputs = vals, [Node("DequantizeLinear", vals, [y], attrs)], [y]
    verify(g)
    np.testing.assert_array_equal(interpret(g, feeds)["y"], want)


@covers("AddLayerNormalization")
@pytest.mark.parametrize("dtype, bias", [(F32, True), (np.float16, True), (F32, False)])
def test_add_layernorm(rng, dtype, bias):
    """AddLayerNormalization(a, b, w[, c]) = (LayerNormalization(a + b, w[, c]), a + b), the sum rounded
    first: equal to onnx's reference running Add then LayerNormalization (opset 17)."""
    a, b = rand(rng, (2, 3, 16), dtype), rand(rng, (2, 3, 16), dtype)
    w, c = rand(rng, (16,), dtype), rand(rng, (16,), dtype)
    feeds = {"a": a, "b": b, "w": w, **({"c": c} if bias else {})}
    dt = str(np.dtype(dtype))
    vals = [Value(k, dt, v.shape) for k, v in feeds.items()]
    y, s_ = Value("y", dt, a.shape), Value("s", dt, a.shape)
    g = Graph("aln")
    g.inputs, g.outputs = vals, [y, s_]
    g.nodes = [Node("AddLayerNormalization", vals, [y, s_], {"epsilon": 1e-5})]
    verify(g)
    got = interpret(g, feeds)
    tt = H.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = H.make_model(H.make_graph(
        [H.make_node("Add", ["a", "b"], ["s"]),
         H.make_node("LayerNormalization", ["s", "w"] + (["c"] if bias else []), ["y"], epsilon=1e-5, axis=-1)],
        "g", [H.make_tensor_value_info(k, tt, list(v.shape)) for k, v in feeds.items()],
        [H.make_tensor_value_info("y", tt, list(a.shape)), H.make_tensor_value_info("s", tt, list(a.shape))]),
        opset_imports=[H.make_opsetid("", 17)])
    want = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_array_equal(got["s"], want[1])
    tol = 1e-5 if dtype == F32 else 2e-3
    np.testing.assert_allclose(got["y"].astype(np.float64), want[0].astype(np.float64), rtol=tol, atol=tol)


@covers("AddRMSNormalization")
@pytest.mark.parametrize("dtype", [F32, np.float16])
def test_add_rmsnorm(rng, dtype):
    """AddRMSNormalization(a, b, w) = (RMSNormalization(a + b, w), a + b), the sum rounded to the dtype
    first: equal to onnxruntime running Add then RMSNormalization (opset 23)."""
    a, b = rand(rng, (2, 3, 16), dtype), rand(rng, (2, 3, 16), dtype)
    w = rand(rng, (16,), dtype)
    g = Graph("arms")
    va, vb, vw = Value("a", str(np.dtype(dtype)), a.shape), Value("b", str(np.dtype(dtype)), b.shape), \
        Value("w", str(np.dtype(dtype)), w.shape)
    y, s_ = Value("y", va.dtype, a.shape), Value("s", va.dtype, a.shape)
    g.inputs = [va, vb, vw]
    g.nodes = [Node("AddRMSNormalization", [va, vb, vw], [y, s_], {"epsilon": 1e-5})]
    g.outputs = [y, s_]
    verify(g)
    got = interpret(g, {"a": a, "b": b, "w": w})
    tt = H.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = H.make_model(H.make_graph(
        [H.make_node("Add", ["a", "b"], ["s"]),
         H.make_node("RMSNormalization", ["s", "w"], ["y"], epsilon=1e-5, axis=-1)], "g",
        [H.make_tensor_value_info(n, tt, list(x.shape)) for n, x in (("a", a), ("b", b), ("w", w))],
        [H.make_tensor_value_info("y", tt, list(a.shape)), H.make_tensor_value_info("s", tt, list(a.shape))]),
        opset_imports=[H.make_opsetid("", 23)])
    want = ReferenceEvaluator(model).run(None, {"a": a, "b": b, "w": w})
    np.testing.assert_array_equal(got["s"], want[1])
    tol = 1e-5 if dtype == F32 else 2e-3
    np.testing.assert_allclose(got["y"].astype(np.float64), want[0].astype(np.float64), rtol=tol, atol=tol)


@covers("NormLinear", "ElementwiseLinear")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prologue_linears(rng, dtype):
    """NormLinear / ElementwiseLinear equal their two ops run one after the other (numpy written out:
    the sum rounded, the norm in float32, the Linear accumulated in float32 and rounded once)."""
    a, b = rand(rng, (2, 1, 16), dtype), rand(rng, (2, 1, 16), dtype)
    gamma, w, bias = rand(rng, (16,), dtype), rand(rng, (5, 16), dtype), rand(rng, (5,), dtype)
    gu = rand(rng, (2, 1, 32), dtype)
    vals = {n: Value(n, dtype, x.shape) for n, x in (("a", a), ("b", b), ("g", gamma), ("w", w), ("bias", bias),
                                                      ("gu", gu))}
    y1, s1, y2, y3 = (Value(n, dtype, shape) for n, shape in
                      (("y1", (2, 1, 5)), ("s1", (2, 1, 16)), ("y2", (2, 1, 5)), ("y3", (2, 1, 5))))
    swiglu = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))),
              ("Mul", (), (("step", 1), ("in", 1))))
    g = Graph("prologue")
    g.inputs = list(vals.values())
    g.nodes = [
        Node("NormLinear", [vals["a"], vals["b"], vals["g"], vals["w"]], [y1, s1], {"epsilon": 1e-5}),
        Node("NormLinear", [vals["a"], None, vals["g"], vals["w"], vals["bias"]], [y2], {"epsilon": 1e-6}),
        Node("ElementwiseLinear", [vals["gu"], vals["gu"], vals["w"]], [y3],
             {"program": swiglu, "out_shape": (2, 1, 16), "out_dtype": dtype, "slices": ((0, 16), (16, 16)),
              "n_in": 2}),
    ]
    w4 = Value("w4", dtype, (4, 16))
    y4 = Value("y4", dtype, (2, 1, 2))
    g.inputs.append(w4)
    g.nodes.append(Node("NormLinear", [vals["a"], None, vals["g"], w4], [y4],
                        {"epsilon": 1e-6, "epilogue": swiglu, "gate_input": 1}))
    g.outputs = [y1, s1, y2, y3, y4]
    verify(g)
    w4v = rand(rng, (4, 16), dtype)
    got = interpret(g, {"a": a, "b": b, "g": gamma, "w": w, "bias": bias, "gu": gu, "w4": w4v})
    f = np.float32

    def rms(h, eps):
        hf = h.astype(f)
        return (hf * (1.0 / np.sqrt(np.mean(hf * hf, axis=-1, keepdims=True) + eps)) * gamma.astype(f)).astype(dtype)

    def lin(x, bias=None):
        y = x.astype(f) @ w.astype(f).T
        return (y if bias is None else y + bias.astype(f)).astype(dtype)

    s = (a + b).astype(dtype)
    np.testing.assert_array_equal(got["s1"], s)
    np.testing.assert_array_equal(got["y1"], lin(rms(s, f(1e-5))))
    np.testing.assert_array_equal(got["y2"], lin(rms(a, f(1e-6)), bias))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == "float32" else {"rtol": 2e-3, "atol": 2e-3}

    def silu_mul(gate, up):
        sig = (1.0 / (1.0 + np.exp(-gate.astype(f)))).astype(dtype)
        return ((gate * sig).astype(dtype) * up).astype(dtype)

    want3 = lin(silu_mul(gu[..., :16], gu[..., 16:]))
    np.testing.assert_allclose(got["y3"].astype(np.float64), want3.astype(np.float64), **tol)
    z = (rms(a, f(1e-6)).astype(f) @ w4v.astype(f).T).astype(dtype)  # gate_input 1: the second half is the gate
    np.testing.assert_allclose(got["y4"].astype(np.float64), silu_mul(z[..., 2:], z[..., :2]).astype(np.float64), **tol)


@covers("NormLinearQ")
@pytest.mark.parametrize("linear", ["LinearQ8", "LinearQ4", "LinearF8"])
def test_norm_linear_quantized(rng, linear):
    """NormLinearQ = (Add)RMSNormalization then the quantized projection (then the gated epilogue): equal
    to the two (three) nodes run one after the other."""
    from atlasc.ir.ops.prologue import epilogue_attrs
    from atlasc.passes.quantize import quantize_fp8, quantize_int4, quantize_int8

    dt = "float16"
    a, b, gamma = rand(rng, (3, 1, 64), np.float16), rand(rng, (3, 1, 64), np.float16), rand(rng, (64,), np.float16)
    w = (rng.standard_normal((8, 64)) / 8).astype(np.float16)
    if linear == "LinearQ8":
        wq, scale = quantize_int8(w)
        lin_attrs = {}
    elif linear == "LinearF8":
        wq, scale = quantize_fp8(w)
        lin_attrs = {}
    else:
        wq, scale = quantize_int4(w, 32)
        lin_attrs = {"group_size": 32}
    swiglu = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))),
              ("Mul", (), (("step", 1), ("in", 1))))
    va, vb, vg = (Value(n, dt, x.shape) for n, x in (("a", a), ("b", b), ("g", gamma)))
    cw, cs = constant("wq", wq), constant("scale", scale)
    fused, unfused = Graph("fused"), Graph("unfused")
    for graph in (fused, unfused):
        graph.inputs = [va, vb, vg]
    y1, s1, y2 = Value("y1", dt, (3, 1, 8)), Value("s1", dt, (3, 1, 64)), Value("y2", dt, (3, 1, 4))
    q_attrs = {"epsilon": 1e-5, "linear": linear, "group_size": lin_attrs.get("group_size", 0)}
    fused.nodes = [Node("NormLinearQ", [va, vb, vg, cw, cs], [y1, s1], q_attrs),
                   Node("NormLinearQ", [va, None, vg, cw, cs], [y2], q_attrs | {"epilogue": swiglu, "gate_input": 1})]
    x1, x2, z2 = Value("x1", dt, a.shape), Value("x2", dt, a.shape), Value("z2", dt, (3, 1, 8))
    unfused.nodes = [Node("AddRMSNormalization", [va, vb, vg], [x1, s1], {"epsilon": 1e-5}),
                     Node(linear, [x1, cw, cs], [y1], lin_attrs),
                     Node("RMSNormalization", [va, vg], [x2], {"epsilon": 1e-5}),
                     Node(linear, [x2, cw, cs], [z2], lin_attrs),
                     Node("FusedElementwise", [z2, z2], [y2], epilogue_attrs((3, 1, 8), dt, {"epilogue": swiglu,
                                                                                             "gate_input": 1}))]
    for graph in (fused, unfused):
        graph.outputs = [y1, s1, y2]
        verify(graph)
    feed = {"a": a, "b": b, "g": gamma}
    got, want = interpret(fused, feed), interpret(unfused, feed)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@covers("QKVRotary")
@pytest.mark.parametrize("batch, seq, past, rot, cos_batch", [(2, 3, 0, 8, 2), (1, 1, 5, 8, 1), (3, 2, 4, 4, 3)])
def test_qkv_rotary(rng, batch, seq, past, rot, cos_batch):
    """QKVRotary = split [B, S, (Hq + 2Hk) * D] into heads, rotate-half rotary on q and k over the first
    `rot` dims (element by element below), append k and v to the cache in place; q and presents out."""
    layers, max_batch, hq, hk, d, max_seq = 2, 3, 4, 2, 8, 8
    b, s_, p_ = S.sym("batch"), S.sym("seq"), S.sym("past_seq")
    g = Graph("qkvr")
    g.symbols = {"batch": SymbolInfo(1), "seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
    qkv = Value("qkv", "float32", (b, s_, (hq + 2 * hk) * d))
    cb = b if cos_batch > 1 else 1
    cos, sin = Value("cos", "float32", (cb, s_, rot)), Value("sin", "float32", (cb, s_, rot))
    q = Value("q", "float32", (b, hq, s_, d))
    pk, pv = (Value(n, "float32", (b, hk, S.add(p_, s_), d)) for n in ("pk", "pv"))
    g.inputs = [qkv, cos, sin]
    g.nodes = [Node("QKVRotary", [qkv, cos, sin], [q, pk, pv],
                    {"q_heads": hq, "kv_heads": hk, "head_dim": d, "layer": 1, "past": p_})]
    g.outputs = [q, pk, pv]
    verify(g)
    cache = rand(rng, (layers, 2, max_batch, hk, max_seq, d), F32)
    before = cache.copy()
    x, c, sn = rand(rng, (batch, seq, (hq + 2 * hk) * d), F32), rand(rng, (cos_batch, seq, rot), F32), \
        rand(rng, (cos_batch, seq, rot), F32)
    got = interpret(g, {"qkv": x, "cos": c, "sin": sn}, state={"kv_cache": cache}, symbols={"past_seq": past})
    heads = x.reshape(batch, seq, hq + 2 * hk, d).astype(np.float64)
    want = heads.copy()
    for bi, si, h, e in np.ndindex(batch, seq, hq + hk, rot):
        partner = -heads[bi, si, h, e + rot // 2] if e < rot // 2 else heads[bi, si, h, e - rot // 2]
        cbi = bi if cos_batch > 1 else 0
        want[bi, si, h, e] = heads[bi, si, h, e] * c[cbi, si, e] + partner * sn[cbi, si, e]
    want = want.transpose(0, 2, 1, 3)
    assert_close(got["q"], want[:, :hq].astype(F32))
    after = before.copy()
    after[1, 0, :batch, :, past:past + seq] = want[:, hq:hq + hk]
    after[1, 1, :batch, :, past:past + seq] = want[:, hq + hk:]
    np.testing.assert_allclose(cache, after, rtol=1e-6, atol=1e-6)  # written in place, nothing else touched
    assert_close(got["pk"], after[1, 0, :batch, :, :past + seq])
    assert_close(got["pv"], after[1, 1, :batch, :, :past + seq])


@covers("QKVRotary")
def test_qkv_rotary_without_tables(rng):
    """QKVRotary(qkv) alone (GPT-2: no rotary) is the split into heads plus both cache appends."""
    hq, hk, d, batch, seq, past = 2, 2, 4, 2, 3, 1
    b, s_, p_ = S.sym("batch"), S.sym("seq"), S.sym("past_seq")
    g = Graph("qkv")
    g.symbols = {"batch": SymbolInfo(1), "seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
    qkv = Value("qkv", "float32", (b, s_, (hq + 2 * hk) * d))
    q = Value("q", "float32", (b, hq, s_, d))
    pk, pv = (Value(n, "float32", (b, hk, S.add(p_, s_), d)) for n in ("pk", "pv"))
    g.inputs, g.outputs = [qkv], [q, pk, pv]
    g.nodes = [Node("QKVRotary", [qkv], [q, pk, pv],
                    {"q_heads": hq, "kv_heads": hk, "head_dim": d, "layer": 0, "past": p_})]
    verify(g)
    cache = rand(rng, (1, 2, 2, hk, 8, d), F32)
    x = rand(rng, (batch, seq, (hq + 2 * hk) * d), F32)
    got = interpret(g, {"qkv": x}, state={"kv_cache": cache}, symbols={"past_seq": past})
    heads = x.reshape(batch, seq, hq + 2 * hk, d).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(got["q"], heads[:, :hq])
    np.testing.assert_array_equal(cache[0, 0, :batch, :, past:past + seq], heads[:, hq:hq + hk])
    np.testing.assert_array_equal(got["pv"][:, :, past:], heads[:, hq + hk:])


def _fused_equals_unfused(graphs: dict, feed: dict, cache: np.ndarray, past: int) -> None:
    """The "fused" and "unfused" graphs give equal outputs and leave equal KV caches from `cache`, which they write."""
    results = {}
    for kind, g in graphs.items():
        state = {"kv_cache": cache.copy()}
        results[kind] = (interpret(g, feed, state=state, symbols={"past_seq": past}), state["kv_cache"])
    (got, cache_got), (want, cache_want) = results["fused"], results["unfused"]
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(cache_got, cache_want)
    assert not np.array_equal(cache_got, cache)


@covers("NormLinearRotary")
@pytest.mark.parametrize("linear,rot,add", [("Linear", 8, True), ("Linear", 4, False), ("LinearQ8", 8, True),
                                            ("Linear", 0, True)])
def test_norm_linear_rotary(rng, linear, rot, add):
    """NormLinearRotary = (Add)RMSNormalization, the QKV projection (float or quantized), QKVRotary (full,
    partial or no rotary): q, the presents, the sum and the cache equal the three nodes run in turn."""
    from atlasc.passes.quantize import quantize_int8

    hq, hk, d, batch, seq, past, k = 4, 2, 8, 2, 1, 3, 16
    n = (hq + 2 * hk) * d
    b, s_, p_ = S.sym("batch"), S.sym("seq"), S.sym("past_seq")
    a, r, gamma = (rand(rng, shape, F32) for shape in ((batch, seq, k), (batch, seq, k), (k,)))
    w = (rng.standard_normal((n, k)) / 4).astype(F32)
    cos, sin = rand(rng, (1, seq, max(rot, 1)), F32)[..., :rot], rand(rng, (1, seq, max(rot, 1)), F32)[..., :rot]
    va, vr, vg = Value("a", "float32", (b, s_, k)), Value("r", "float32", (b, s_, k)), Value("g", "float32", (k,))
    vc, vs = Value("cos", "float32", (1, s_, rot)), Value("sin", "float32", (1, s_, rot))
    tables = [vc, vs] if rot else []
    if linear == "Linear":
        proj, lin_attrs = [constant("w", w)], {}
    else:
        wq, scale = quantize_int8(w)
        proj, lin_attrs = [constant("wq", wq), constant("scale", scale)], {}
    heads = {"q_heads": hq, "kv_heads": hk, "head_dim": d, "layer": 1, "past": p_}
    q, pk, pv = Value("q", "float32", (b, hq, s_, d)), *(Value(x, "float32", (b, hk, S.add(p_, s_), d))
                                                         for x in ("pk", "pv"))
    sum_v = Value("s", "float32", (b, s_, k))
    outs = [q, pk, pv] + ([sum_v] if add else [])
    graphs = {}
    for kind in ("fused", "unfused"):
        g = Graph(kind)
        g.symbols = {"batch": SymbolInfo(1), "seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
        g.inputs = [va, vr, vg] + tables
        x, y = Value("x", "float32", (b, s_, k)), Value("y", "float32", (b, s_, n))
        if kind == "fused":
            attrs = {"epsilon": 1e-5, "linear": linear} | heads
            g.nodes = [Node("NormLinearRotary", [va, vr if add else None, vg, *(tables or [None, None]), *proj],
                            outs, attrs)]
        else:
            norm = (Node("AddRMSNormalization", [va, vr, vg], [x, sum_v], {"epsilon": 1e-5}) if add
                    else Node("RMSNormalization", [va, vg], [x], {"epsilon": 1e-5}))
            g.nodes = [norm, Node(linear, [x, *proj], [y], lin_attrs),
                       Node("QKVRotary", [y, *tables], [q, pk, pv], heads)]
        g.outputs = outs
        verify(g)
        graphs[kind] = g
    feed = {"a": a, "r": r, "g": gamma} | ({"cos": cos, "sin": sin} if rot else {})
    _fused_equals_unfused(graphs, feed, rand(rng, (2, 2, 3, hk, 8, d), F32), past)


@covers("LinearRotary")
@pytest.mark.parametrize("rot,bias", [(8, False), (4, True), (0, False)])
def test_linear_rotary(rng, rot, bias):
    """LinearRotary = Linear (with or without bias), QKVRotary (full, partial or no rotary): q, the presents and
    the cache equal the two nodes run in turn; cos without sin is a ShapeError."""
    from atlasc.errors import ShapeError

    hq, hk, d, batch, seq, past, k = 4, 2, 8, 3, 2, 3, 16
    n = (hq + 2 * hk) * d
    b, s_, p_ = S.sym("batch"), S.sym("seq"), S.sym("past_seq")
    x = rand(rng, (batch, seq, k), F32)
    proj = [constant("w", (rng.standard_normal((n, k)) / 4).astype(F32))]
    if bias:
        proj.append(constant("bias", rand(rng, (n,), F32)))
    cos, sin = (rand(rng, (batch, seq, max(rot, 1)), F32)[..., :rot] for _ in range(2))  # tables per batch row
    vx = Value("x", "float32", (b, s_, k))
    vc, vs = Value("cos", "float32", (b, s_, rot)), Value("sin", "float32", (b, s_, rot))
    tables = [vc, vs] if rot else []
    heads = {"q_heads": hq, "kv_heads": hk, "head_dim": d, "layer": 1, "past": p_}
    q, pk, pv = Value("q", "float32", (b, hq, s_, d)), *(Value(v, "float32", (b, hk, S.add(p_, s_), d))
                                                         for v in ("pk", "pv"))
    graphs = {}
    for kind in ("fused", "unfused"):
        g = Graph(kind)
        g.symbols = {"batch": SymbolInfo(1), "seq": SymbolInfo(1), "past_seq": SymbolInfo(0)}
        g.inputs, g.outputs = [vx] + tables, [q, pk, pv]
        if kind == "fused":
            g.nodes = [Node("LinearRotary", [vx, *(tables or [None, None]), *proj], [q, pk, pv], heads)]
        else:
            y = Value("y", "float32", (b, s_, n))
            g.nodes = [Node("Linear", [vx, *proj], [y]), Node("QKVRotary", [y, *tables], [q, pk, pv], heads)]
        verify(g)
        graphs[kind] = g
    feed = {"x": x} | ({"cos": cos, "sin": sin} if rot else {})
    _fused_equals_unfused(graphs, feed, rand(rng, (2, 2, 3, hk, 8, d), F32), past)
    if rot:
        with pytest.raises(ShapeError, match="give both cos and sin"):
            OPS["LinearRotary"].infer([TensorType("float32", (2, 1, k)), TensorType("float32", (1, 1, rot)), None,
                                       TensorType("float32", (n, k))], OPS["LinearRotary"].fill_attrs(heads))


@covers("LinearGated")
@pytest.mark.parametrize("gate,bias", [(0, True), (1, False)])
def test_linear_gated(rng, gate, bias):
    """LinearGated = Linear, then the epilogue program over the output's two halves (SwiGLU, either half the gate):
    equal to the Linear and the FusedElementwise run in turn; an odd width is a ShapeError."""
    from atlasc.errors import ShapeError

    swiglu = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))),
              ("Mul", (), (("step", 1), ("in", 1))))
    k, h, m = 16, 6, 3
    bsym = S.sym("batch")
    x = rand(rng, (m, k), F32)
    proj = [constant("w", (rng.standard_normal((2 * h, k)) / 4).astype(F32))]
    if bias:
        proj.append(constant("bias", rand(rng, (2 * h,), F32)))
    vx, vy = Value("x", "float32", (bsym, k)), Value("y", "float32", (bsym, h))
    halves = ((0, h), (h, h)) if gate == 0 else ((h, h), (0, h))
    results = {}
    for kind in ("fused", "unfused"):
        g = Graph(kind)
        g.symbols = {"batch": SymbolInfo(1)}
        g.inputs, g.outputs = [vx], [vy]
        if kind == "fused":
            g.nodes = [Node("LinearGated", [vx, *proj], [vy], {"epilogue": swiglu, "gate_input": gate})]
        else:
            z = Value("z", "float32", (bsym, 2 * h))
            g.nodes = [Node("Linear", [vx, *proj], [z]),
                       Node("FusedElementwise", [z, z], [vy], {"program": swiglu, "out_shape": (bsym, h),
                                                               "out_dtype": "float32", "slices": halves})]
        verify(g)
        results[kind] = interpret(g, {"x": x})["y"]
    np.testing.assert_array_equal(results["fused"], results["unfused"])
    z = x @ proj[0].data.T + (proj[1].data if bias else 0)
    g_, u_ = (z[:, :h], z[:, h:]) if gate == 0 else (z[:, h:], z[:, :h])
    assert_close(results["fused"], (g_ / (1 + np.exp(-g_)) * u_).astype(F32))
    with pytest.raises(ShapeError, match="even static width"):
        OPS["LinearGated"].infer([TensorType("float32", (2, k)), TensorType("float32", (7, k))],
                                 OPS["LinearGated"].fill_attrs({"epilogue": swiglu}))


# -- coverage --------------------------------------------------------------------------------


def test_every_registered_op_is_covered():
    missing = set(OPS) - COVERED
    assert not missing, f"ops registered in atlasc.ir.OPS without a test in test_ops.py: {sorted(missing)}"
    stale = COVERED - set(OPS)
    assert not stale, f"test_ops.py claims coverage of unregistered ops: {sorted(stale)}"
