"""Bad models and calibration files found by an adversarial audit, in the frontend and calibration: each is one
typed AtlasError (through the CLI: exit code 2, one `error:` line, no traceback). Before the fixes: a Range over
a non-scalar raised TypeError, an out-of-range Gather index and out-of-vocabulary --calib ids with --gptq / --smooth
raised IndexError, a text file as --calib was answered with numpy's advice to unpickle it, a KV-cache input with 0
heads gave an internal Concat's error and negative dims compiled, and an ai.onnx opset newer than the frontend knows
was accepted. Models are built with onnx.helper or edited from the fixtures in memory."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import FIXTURES
from onnx import TensorProto, helper, numpy_helper
from test_errors import add_model, assert_one_error

from atlasc.errors import AtlasError, InputError, ModelLoadError, ShapeError, UsageError

LLAMA = FIXTURES / "llama.onnx"
COMPILE = ("--arch", "sm90", "--max-batch", "2", "--max-seq", "32")


def _model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _save(tmp_path, model: onnx.ModelProto, name="m.onnx"):
    path = tmp_path / name
    onnx.save(model, path)
    return path


def _npz(tmp_path, name="in.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _all_commands_refuse(cli, tmp_path, path, npz, *needles, inspect_exits_2=True) -> None:
    """compile and run exit 2 with one error line holding every needle (the import fails before nvcc); inspect
    too, or (inspect_exits_2 False: an import error) reports the same message as `import failed`."""
    out = tmp_path / "m.atlas"
    assert_one_error(cli("compile", path, "-o", out, *COMPILE), *needles)
    assert not out.exists()
    assert_one_error(cli("run", path, "--inputs", npz), *needles)
    r = cli("inspect", path)
    if inspect_exits_2:
        assert_one_error(r, *needles)
    else:
        assert r.code == 0 and "import failed" in r.stdout, r
        assert all(n in r.stdout for n in needles), r.stdout


# ---------------------------------------------------------------------------------------------
# 1. malformed graphs: a non-scalar Range bound, a cycle, nodes out of order


def test_range_over_a_non_scalar_is_a_shape_error(cli, tmp_path):
    """Range's limit is Shape(x), a 1-D tensor: the node and the operand are named (was TypeError: not a scalar)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    out = helper.make_tensor_value_info("out", TensorProto.INT64, ["n"])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape0"),
             helper.make_node("Range", ["zero", "s", "one"], ["out"], name="range0")]
    inits = [helper.make_tensor(name, TensorProto.INT64, [], [v]) for name, v in (("zero", 0), ("one", 1))]
    path = _save(tmp_path, _model(nodes, [x], [out], inits))
    npz = _npz(tmp_path, x=np.zeros((2, 3), np.float32))
    _all_commands_refuse(cli, tmp_path, path, npz, "node 'range0' (Range)", "limit must be a scalar", "[2]",
                         inspect_exits_2=False)
    from atlasc.frontend import import_onnx

    with pytest.raises(ShapeError, match=r"node 'range0' \(Range\): Range limit must be a scalar"):
        import_onnx(onnx.load(path))


def test_a_cycle_is_one_error_line(cli, tmp_path):
    """a = x + b, b = relu(a): one error line (onnx-graphsurgeon's toposort finds the cycle), and nothing of its
    log."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="before"),
             helper.make_node("Add", ["r", "b"], ["a"], name="add0"),
             helper.make_node("Relu", ["a"], ["b"], name="relu0"),
             helper.make_node("Identity", ["b"], ["out"], name="after")]
    path = _save(tmp_path, _model(nodes, [x], [out]))
    r = cli("run", path, "--inputs", _npz(tmp_path, x=np.ones(2, np.float32)))
    assert_one_error(r, "the ONNX graph is not a DAG: Cycle detected")
    assert "[C]" not in r.stdout + r.stderr


def test_nodes_out_of_topological_order_are_sorted(cli, tmp_path):
    """ONNX lists nodes in topological order; a graph that does not (its reader first) is still imported, sorted."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["a"], ["out"], name="late"), helper.make_node("Neg", ["x"], ["a"], name="early")]
    path = _save(tmp_path, _model(nodes, [x], [out]))
    result = tmp_path / "out.npz"
    r = cli("run", path, "--inputs", _npz(tmp_path, x=np.array([1, -2], np.float32)), "--out", result)
    assert r.code == 0, r
    np.testing.assert_array_equal(np.load(result)["out"], [0, 2])


# ---------------------------------------------------------------------------------------------
# 2. Gather indices outside [-n, n-1]


def _gather_model() -> onnx.ModelProto:
    """out = table[idx], table a constant [4, 2]."""
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["k"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["k", 2])
    table = helper.make_tensor("table", TensorProto.FLOAT, [4, 2], np.arange(8, dtype=np.float32))
    return _model([helper.make_node("Gather", ["table", "idx"], ["out"], name="lookup")], [idx], [out], [table])


@pytest.mark.parametrize("bad", [4, -5, 10**9])
def test_gather_index_out_of_range(cli, tmp_path, bad):
    path = _save(tmp_path, _gather_model())
    npz = _npz(tmp_path, idx=np.array([0, bad], np.int64))
    assert_one_error(cli("run", path, "--inputs", npz), "lookup", "Gather", f"index {bad}", "axis 0 of size 4")


def test_gather_negative_indices_in_range_still_wrap(cli, tmp_path):
    path = _save(tmp_path, _gather_model())
    result = tmp_path / "out.npz"
    r = cli("run", path, "--inputs", _npz(tmp_path, idx=np.array([-1, -4, 3], np.int64)), "--out", result)
    assert r.code == 0, r
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(np.load(result)["out"], table[[3, 0, 3]])


def test_llama_input_ids_out_of_vocab(cli, tmp_path):
    """The audit's case: `atlasc run llama.onnx --inputs` with a token id past the vocabulary of 256."""
    with np.load(FIXTURES / "llama.prefill.npz") as z:
        feeds = {k[3:]: z[k] for k in z.files if k.startswith("in.")}
    feeds["input_ids"] = feeds["input_ids"].copy()
    feeds["input_ids"][1, 3] = 99999
    assert_one_error(cli("run", LLAMA, "--device", "cpu", "--inputs", _npz(tmp_path, **feeds)),
                     "node_embedding (Gather)", "index 99999", "size 256")


def test_interpreter_names_the_node():
    from atlasc.frontend import import_onnx
    from atlasc.ir import interpret

    with pytest.raises(InputError, match=r"^node lookup \(Gather\): index 7 is out of range"):
        interpret(import_onnx(_gather_model()), {"idx": np.array([7], np.int64)})


# ---------------------------------------------------------------------------------------------
# 3, 4. --calib: out-of-vocabulary and negative ids with --gptq / --smooth, a file that is not an .npz


def _calib(tmp_path, ids, name="calib.npz"):
    ids = np.asarray(ids)
    return str(_npz(tmp_path, name, input_ids=ids.astype(np.int64) if ids.dtype.kind == "i" else ids))


def _pipeline(model: str, calib: str, mode: str):
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline

    opts = (dict(quant="int4", group_size=32, gptq=True) if mode == "gptq" else dict(quant="int8", smooth=0.5))
    return run_pipeline(Program({"main": import_onnx(FIXTURES / model)}, CompileOptions(calib=calib, max_seq=32,
                                                                                        **opts)))


# smooth-quant finds no norm-fed projection to calibrate in the minilm encoder, so it never reads the file there
@pytest.mark.parametrize("model, mode", [("llama.onnx", "gptq"), ("llama.onnx", "smooth"), ("minilm.onnx", "gptq"),
                                         ("gpt2.onnx", "gptq"), ("gpt2.onnx", "smooth")])
@pytest.mark.parametrize("bad, got", [(100000, "[100000, 100000]"), (-5, "[-5, 3]")])
def test_calibration_ids_out_of_vocab(tmp_path, mode, model, bad, got):
    """The passes reject what the accuracy report does (one check, atlasc/ir/calibration.py), against the rows of
    the embedding table: a decoder's, an encoder's (no logits) and one read through a Reshape (gpt2)."""
    ids = [[bad, bad]] if bad > 0 else [[1, 2, 3], [bad, 0, 1]]
    with pytest.raises(UsageError, match=r"calibration token ids must lie in \[0, 256\), got " + got.replace("[", r"\[")
                       .replace("]", r"\]")):
        _pipeline(model, _calib(tmp_path, ids), mode)


def test_calibration_checks_are_shared(tmp_path):
    from atlasc.accuracy import load_calibration
    from atlasc.frontend import import_onnx
    from atlasc.ir.calibration import embedding_rows
    from atlasc.passes.gptq import load_feeds

    assert [embedding_rows(import_onnx(FIXTURES / f"{m}.onnx")) for m in ("llama", "minilm", "gpt2")] == [256] * 3
    graph = import_onnx(LLAMA)
    for ids, needle in (([[1, -1]], r"\[0, 256\)"), ([[1, 300]], r"\[0, 256\)"), ([[1.0, 2.0]], "2-D integer")):
        path = _calib(tmp_path, np.asarray(ids))
        for load in (lambda: load_calibration(path, 256, 32), lambda: load_feeds(path, graph)):
            with pytest.raises(UsageError, match=needle):
                load()
    assert load_feeds(_calib(tmp_path, [[0, 255]]), graph)["input_ids"].tolist() == [[0, 255]]


@pytest.mark.parametrize("content", [b"not an npz\n", b"\x93NUMPY\x01\x00v\x00{'descr': '<i8'", b""])
def test_calibration_file_that_is_not_an_npz(tmp_path, content):
    """Not a zip: one line saying so, nothing about loading it with allow_pickle."""
    from atlasc.accuracy import load_calibration
    from atlasc.frontend import import_onnx
    from atlasc.passes.gptq import load_feeds

    path = tmp_path / "text.npz"
    path.write_bytes(content)
    for load in (lambda: load_calibration(path, 256, 32), lambda: load_feeds(path, import_onnx(LLAMA)),
                 lambda: _pipeline("llama.onnx", str(path), "gptq"), lambda: _pipeline("llama.onnx", str(path),
                                                                                          "smooth")):
        with pytest.raises(UsageError) as e:
            load()
        assert e.value.message == f"calibration file {path} is not an .npz archive"
        assert "pickle" not in e.value.message + (e.value.hint or "")


def test_truncated_calibration_zip(tmp_path):
    from atlasc.accuracy import load_calibration

    good = _calib(tmp_path, [[1, 2]])
    path = tmp_path / "cut.npz"
    path.write_bytes(open(good, "rb").read()[:40])
    with pytest.raises(UsageError, match="is not a readable .npz"):
        load_calibration(path, 256, 32)


# ---------------------------------------------------------------------------------------------
# 5. input dims below -1, and a KV-cache input with 0 heads


def _llama_with_dim(value: int, axis: int) -> onnx.ModelProto:
    model = onnx.load(LLAMA)
    dim = next(v for v in model.graph.input if v.name == "past_key_values.0.key").type.tensor_type.shape.dim[axis]
    dim.Clear()
    dim.dim_value = value
    return model


@pytest.mark.parametrize("value, axis, rule", [(0, 1, "a KV-cache input's static dims must be positive"),
                                               (0, 3, "a KV-cache input's static dims must be positive"),
                                               (-4, 3, "static dims must not be negative")])
def test_kv_input_dim_refused_at_load(cli, tmp_path, value, axis, rule):
    """compile, run and inspect: one line naming the input, the dim and the axis (a 0 was an internal Concat's
    error, -4 compiled with head_dim -4)."""
    path = _save(tmp_path, _llama_with_dim(value, axis))
    with np.load(FIXTURES / "llama.prefill.npz") as z:
        npz = _npz(tmp_path, **{k[3:]: z[k] for k in z.files if k.startswith("in.")})
    line = assert_one_error(cli("inspect", path))
    assert line == f"error: input 'past_key_values.0.key' has dimension {value} at axis {axis}: {rule}", line
    _all_commands_refuse(cli, tmp_path, path, npz, "'past_key_values.0.key'", f"dimension {value} at axis {axis}")
    from atlasc.frontend import import_onnx

    with pytest.raises(ModelLoadError, match=rule):
        import_onnx(_llama_with_dim(value, axis))  # a ModelProto in memory: the same check


def test_negative_dim_of_any_input(cli, tmp_path):
    path = _save(tmp_path, add_model(batch=-3))
    one = np.ones((3, 4), np.float32)
    _all_commands_refuse(cli, tmp_path, path, _npz(tmp_path, x=one, y=one),
                         "input 'x' has dimension -3 at axis 0: static dims must not be negative")


@pytest.mark.parametrize("batch", [-1, 0])
def test_unknown_and_empty_dims_still_run(cli, tmp_path, batch):
    """-1 (a legacy spelling of a dynamic dim) gets a symbol; 0 is an empty tensor, valid ONNX (tests/test_ops.py)."""
    path = _save(tmp_path, add_model(batch=batch))
    arr = np.ones((3 if batch else 0, 4), np.float32)
    r = cli("run", path, "--inputs", _npz(tmp_path, x=arr, y=arr))
    assert r.code == 0, r


# ---------------------------------------------------------------------------------------------
# 6. an ai.onnx opset newer than the frontend knows


@pytest.mark.parametrize("domain", ["", "ai.onnx"])
def test_opset_newer_than_onnx_knows(cli, tmp_path, domain):
    model = add_model()
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid(domain, 99))
    path = _save(tmp_path, model)
    one = np.ones((3, 4), np.float32)
    _all_commands_refuse(cli, tmp_path, path, _npz(tmp_path, x=one, y=one), "opset 99, newer than the installed onnx",
                         inspect_exits_2=False)


def test_ops_changed_after_the_newest_known_opset_are_refused(tmp_path, monkeypatch):
    """At an opset past MAX_OPSET, an op whose definition changed since is refused by name; one that did not still
    imports. MAX_OPSET is lowered to 13 so that opset 21 (known to every onnx the project supports) is past it:
    Reshape changed at 14 and later, Add at 14, MatMul last at 13."""
    from atlasc.frontend import import_onnx, importer

    monkeypatch.setattr(importer, "MAX_OPSET", 13)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [12])
    shape = numpy_helper.from_array(np.array([12], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="r"), helper.make_node("Add", ["r", "r"], ["y"])]
    with pytest.raises(AtlasError, match="opset 21, where Add, Reshape changed after opset 13"):
        import_onnx(_model(nodes, [x], [y], [shape], opset=21))
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 2])
    import_onnx(_model([helper.make_node("MatMul", ["x", "w"], ["z"])], [x], [z], [w], opset=21))


def test_newest_supported_opset_imports(cli, tmp_path):
    from atlasc.frontend.importer import MAX_OPSET

    model = add_model()
    model.opset_import[0].version = MAX_OPSET
    one = np.ones((3, 4), np.float32)
    assert cli("run", _save(tmp_path, model), "--inputs", _npz(tmp_path, x=one, y=one)).code == 0


def test_gptq_reads_the_calibration_file_as_the_report_does(tmp_path):
    """--gptq / --smooth take the file's only array as the token ids when it has no `input_ids` (np.savez(path,
    ids) names it arr_0), as the accuracy report does, and refuse a decoder's prompts longer than --max-seq
    before minutes of calibration rather than in the report at the end."""
    from atlasc.frontend import import_onnx
    from atlasc.passes.gptq import load_feeds

    graph = import_onnx(FIXTURES / "llama.onnx")
    np.savez(tmp_path / "bare.npz", np.arange(16, dtype=np.int64).reshape(2, 8))
    feeds = load_feeds(str(tmp_path / "bare.npz"), graph, 32)
    assert feeds["input_ids"].shape == (2, 8)
    with pytest.raises(UsageError, match="more than --max-seq 32"):
        load_feeds(_calib(tmp_path, np.ones((1, 33), np.int64)), graph, 32)
    load_feeds(_calib(tmp_path, np.ones((1, 33), np.int64), "encoder.npz"), import_onnx(FIXTURES / "minilm.onnx"), 32)


# ---------------------------------------------------------------------------------------------
# 7. NaN and infinite weights (compiled before: the artifact generated token 0 forever)


def _llama_with(values: dict[str, tuple[tuple[int, ...], float]]) -> onnx.ModelProto:
    """The llama fixture with the given initializers' elements set ({name: (index, value)})."""
    model = onnx.load(LLAMA)
    for init in model.graph.initializer:
        if init.name in values:
            data = numpy_helper.to_array(init).copy()
            index, value = values[init.name]
            data[index] = value
            init.CopyFrom(numpy_helper.from_array(data, init.name))
    return model


def _weight_of(op: str, position: int) -> str:
    model = onnx.load(LLAMA)
    names = {i.name for i in model.graph.initializer}
    return next(n.input[position] for n in model.graph.node if n.op_type == op and n.input[position] in names)


def test_nan_and_inf_weights_are_named(cli, tmp_path):
    """compile, run and inspect refuse, naming each initializer with its counts: a NaN in a MatMul weight and in a
    norm scale (read by a Mul), an inf in the embedding table."""
    matmul, embedding = _weight_of("MatMul", 1), _weight_of("Gather", 0)
    norm = "model.model.layers.0.input_layernorm.weight"
    path = _save(tmp_path, _llama_with({matmul: ((3, 5), np.nan), embedding: ((7, 1), -np.inf), norm: ((2,), np.nan)}))
    with np.load(FIXTURES / "llama.prefill.npz") as z:
        npz = _npz(tmp_path, **{k[3:]: z[k] for k in z.files if k.startswith("in.")})
    line = assert_one_error(cli("compile", path, "-o", tmp_path / "m.atlas", *COMPILE))
    assert line.startswith("error: constants holding NaN or infinite weights: "), line
    for needle in (f"'{matmul}' (1 NaN of", f"'{embedding}' (1 infinite of", f"'{norm}' (1 NaN of 64)"):
        assert needle in line, line
    _all_commands_refuse(cli, tmp_path, path, npz, f"'{matmul}'", f"'{embedding}'", f"'{norm}'", inspect_exits_2=False)


def test_inf_outside_weights_is_allowed(tmp_path):
    """A -inf mask constant (here added to x) is not a weight: the model imports and runs; a NaN there is refused."""
    from atlasc.frontend import import_onnx
    from atlasc.ir.interpreter import interpret

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    mask = numpy_helper.from_array(np.array([0.0, -np.inf], np.float32), "mask")
    graph = import_onnx(_model([helper.make_node("Add", ["x", "mask"], ["y"])], [x], [y], [mask]))
    out = interpret(graph, {"x": np.ones(2, np.float32)})
    np.testing.assert_array_equal(next(iter(out.values())), [1.0, -np.inf])
    mask = numpy_helper.from_array(np.array([0.0, np.nan], np.float32), "mask")
    with pytest.raises(ModelLoadError, match=r"'mask' \(1 NaN of 2\)"):
        import_onnx(_model([helper.make_node("Add", ["x", "mask"], ["y"])], [x], [y], [mask]))


def test_nan_in_a_memory_mapped_weight(tmp_path, monkeypatch):
    """A weight in external data over the mapping threshold is read through its memmap, across chunks."""
    from atlasc.frontend import finite, import_onnx

    w = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float16)  # 1 MiB: mapped
    w[1023, 511] = np.nan
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 512])
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [numpy_helper.from_array(w, "w")])
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.setattr(finite, "CHUNK_VALUES", 100_000)  # six chunks on the thread pool
    with pytest.raises(ModelLoadError, match=r"'w' \(1 NaN of 524288\)"):
        import_onnx(tmp_path / "m.onnx")


def test_constant_node_weights_are_checked():
    """A Constant node feeding a MatMul is a weight too (the importer folds its value like an initializer's)."""
    from atlasc.frontend import import_onnx

    value = numpy_helper.from_array(np.array([[np.nan, 1], [2, np.inf]], np.float32))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])
    nodes = [helper.make_node("Constant", [], ["w"], value=value), helper.make_node("MatMul", ["x", "w"], ["y"])]
    with pytest.raises(ModelLoadError, match=r"constant holding NaN or infinite weights: 'w' \(1 NaN and 1 infinite "
                                             r"of 4\)"):
        import_onnx(_model(nodes, [x], [y]))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", ">f4", "bfloat16"])
def test_non_finite_counts_every_float_type(dtype):
    """NaN of either sign and both infinities are counted; the largest finite values, subnormals and integers not."""
    import ml_dtypes

    from atlasc.frontend.finite import non_finite_counts

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    data = np.random.default_rng(1).standard_normal(1000).astype(dt)
    data[0], data[1] = float(ml_dtypes.finfo(dt).max), -float(ml_dtypes.finfo(dt).max)
    data[2] = float(ml_dtypes.finfo(dt).smallest_subnormal)
    assert non_finite_counts(data) == (0, 0)
    data[10], data[11], data[12], data[13], data[14] = np.nan, -np.nan, np.inf, -np.inf, np.nan
    assert non_finite_counts(data) == (3, 2)
    assert non_finite_counts(np.arange(10)) == (0, 0)
