"""Pre-quantized ONNX (issue 6): MatMul(x, DequantizeLinear(q, scale)) with constant int4 weights
blocked along K, or int8 per output channel, compiles to LinearQ4 / LinearQ8 holding the stored
integers (no requantization) and matches onnxruntime on random inputs (float16 scales: bit-exact up
to summation order; float32 scales are stored as float16, 2^-11 relative). int4 / uint4 zero points per
block become LinearQ4's zero-point input. Per-channel int8 zero points (asymmetric int8) and
other layouts are one-line errors, exit 2."""

from __future__ import annotations


import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as H
from onnx import numpy_helper as NH

from conftest import assert_compile_refused

from atlasc.errors import ShapeError
from atlasc.frontend import import_onnx
from atlasc.ir import interpret
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline


def dq_model(rng, dtype, kind, k=64, n=24, block=16, zero=None):
    """x[m, k] @ DequantizeLinear(q [k, n]) for kind int4 (blocked along K), uint4 (zp 8), int8 (per N)."""
    st = H.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if kind in ("int4", "uint4"):
        lo, hi = (-8, 7) if kind == "int4" else (0, 15)
        q = rng.integers(lo, hi + 1, (k, n))
        qt = H.make_tensor("q", TensorProto.INT4 if kind == "int4" else TensorProto.UINT4, (k, n), q.flatten().tolist())
        scale = rng.uniform(0.01, 0.1, (k // block, n)).astype(dtype)
        attrs = {"axis": 0, "block_size": block}
        zp_val = zero if zero is not None else (8 if kind == "uint4" else None)
        zp = None if zp_val is None else H.make_tensor(
            "z", TensorProto.INT4 if kind == "int4" else TensorProto.UINT4, (k // block, n),
            np.broadcast_to(zp_val, (k // block, n)).flatten().tolist())
    else:
        q = rng.integers(-127, 128, (k, n)).astype(np.int8)
        qt = NH.from_array(q, "q")
        scale = rng.uniform(0.001, 0.02, (n,)).astype(dtype)
        attrs = {"axis": 1}
        zp = None if zero is None else NH.from_array(np.broadcast_to(np.int8(zero), (n,)).copy(), "z")
    inits = [qt, NH.from_array(scale, "s")] + ([zp] if zp is not None else [])
    nodes = [H.make_node("DequantizeLinear", ["q", "s"] + (["z"] if zp is not None else []), ["w"], **attrs),
             H.make_node("MatMul", ["x", "w"], ["y"])]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", st, ["m", k])],
                     [H.make_tensor_value_info("y", st, ["m", n])], initializer=inits)
    return H.make_model(g, opset_imports=[H.make_opsetid("", 21)])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("kind, op", [("int4", "LinearQ4"), ("uint4", "LinearQ4"), ("int8", "LinearQ8")])
def test_prequantized_matmul_matches_onnxruntime(dtype, kind, op):
    rng = np.random.default_rng(len(kind))
    model = dq_model(rng, dtype, kind)
    x = rng.standard_normal((5, 64)).astype(dtype)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # its DQ+MatMul fusion
    want = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]  # (enabled, it would quantize x to int8 on the fly: another computation)
    program, _ = run_pipeline(Program({"main": import_onnx(model)}, CompileOptions(max_batch=8, max_seq=8)))
    graph = program.entries["forward"]
    assert [n.op for n in graph.nodes] == [op]
    got = interpret(graph, {"x": x})["y"]
    tol = 2e-3  # fp32: scales stored as fp16 (2^-11); fp16: onnxruntime rounds the dequantized weights to fp16
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("kind", ["int4", "uint4"])
def test_prequantized_int4_with_zero_points_matches_onnxruntime(dtype, kind):
    """Blocked int4 / uint4 weights with a zero point per block: LinearQ4 with its zero-point input."""
    rng = np.random.default_rng(11 + len(kind))
    model = dq_model(rng, dtype, kind, zero=3)
    zp = model.graph.initializer[2]
    lo, hi = (-8, 7) if kind == "int4" else (0, 15)
    vals = rng.integers(lo, hi + 1, tuple(zp.dims))
    model.graph.initializer[2].CopyFrom(H.make_tensor("z", zp.data_type, vals.shape, vals.flatten().tolist()))
    x = rng.standard_normal((5, 64)).astype(dtype)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    program, _ = run_pipeline(Program({"main": import_onnx(model)}, CompileOptions(max_batch=8, max_seq=8)))
    (node,) = program.entries["forward"].nodes
    assert node.op == "LinearQ4" and len(node.inputs) == 5
    assert np.array_equal(node.inputs[4].data, (vals - lo).T)
    got = interpret(program.entries["forward"], {"x": x})["y"]
    tol = 2e-3
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol * np.abs(want).max())


@pytest.mark.parametrize("kind, zero, needle", [("int8", 5, "zero points")])
def test_unsupported_prequantized_layouts_are_one_line_errors(tmp_path, kind, zero, needle):
    rng = np.random.default_rng(1)
    model = dq_model(rng, np.float32, kind, zero=zero)
    # a uniform non-zero zero point is folded; make it vary per channel to be asymmetric
    zp = model.graph.initializer[2]
    vals = NH.to_array(zp).astype(np.int8).copy()
    vals.flat[0] = vals.flat[0] - 1
    new = H.make_tensor("z", zp.data_type, vals.shape, vals.flatten().tolist())
    model.graph.initializer[2].CopyFrom(new)
    with pytest.raises(ShapeError, match=needle):
        run_pipeline(Program({"main": import_onnx(model)}, CompileOptions(max_batch=8, max_seq=8)))
    assert_compile_refused(model, tmp_path, needle)
