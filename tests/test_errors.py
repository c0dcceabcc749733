"""One test per error class, through the command line: exit code 2, one `error:` line (plus an
optional `hint:` line) on stderr, no traceback; `--debug` shows the traceback. The message is part
of the interface. Models are built with onnx.helper (no torch)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import PROGRESS_LINE, REPO
from onnx import TensorProto, helper

from atlasc import errors


def assert_one_error(r, *needles: str) -> str:
    """The CLI failed the documented way (progress lines of a compile may come first); returns the
    error line."""
    assert r.code == 2, r
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r
    lines = [ln for ln in r.stderr.strip().splitlines() if not PROGRESS_LINE.match(ln)]
    assert lines and lines[0].startswith("error: "), r
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:]), r
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def add_model(batch="batch") -> onnx.ModelProto:
    """out = x + y, float32 [batch, 4]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["out"], name="add0")], "add", [x, y], [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def external_model(location: str) -> onnx.ModelProto:
    """out = x + w, where the weight w [4] lives in an external file at `location`."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], np.arange(4, dtype=np.float32).tobytes(), raw=True)
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["out"], name="add0")], "ext", [x], [out],
                              initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ---------------------------------------------------------------------------------------------
# UsageError


def test_missing_model_file(cli, tmp_path):
    for command in ("inspect", "run"):
        r = cli(command, tmp_path / "nope.onnx")
        assert_one_error(r, "nope.onnx")


def test_missing_inputs_file(cli, tmp_path):
    model = tmp_path / "add.onnx"
    onnx.save(add_model(), model)
    assert_one_error(cli("run", model, "--inputs", tmp_path / "nope.npz"), "nope.npz")


def test_inputs_file_not_npz(cli, tmp_path):
    model = tmp_path / "add.onnx"
    onnx.save(add_model(), model)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    assert_one_error(cli("run", model, "--inputs", bad), "bad.npz")


def test_bad_option_value_exits_2(cli, tmp_path):
    r = cli("run", tmp_path / "m.onnx", "--device", "tpu")
    assert r.code == 2 and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------
# ModelLoadError


def test_not_an_onnx_file(cli, tmp_path):
    path = tmp_path / "random.onnx"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_error(cli("inspect", path), "random.onnx")


def test_truncated_onnx(cli, tmp_path):
    data = add_model().SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    assert_one_error(cli("inspect", path))
    assert_one_error(cli("run", path))


def test_external_data_outside_model_folder_refused(cli, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())  # exists: still refused
    path = folder / "model.onnx"
    onnx.save(external_model("../outside.bin"), path)
    assert_one_error(cli("inspect", path), "outside.bin")


def test_external_data_absolute_path_refused(cli, tmp_path):
    outside = tmp_path / "abs.bin"
    outside.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(external_model(str(outside)), path)
    assert_one_error(cli("inspect", path))


def test_external_data_missing(cli, tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(external_model("weights.bin"), path)
    assert_one_error(cli("inspect", path), "weights.bin")


# ---------------------------------------------------------------------------------------------
# UnsupportedModelError: every unsupported op at once


def unsupported_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 1])
    step = helper.make_tensor("step", TensorProto.INT64, [], [4])
    flat = helper.make_tensor("flat", TensorProto.INT64, [1], [-1])
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["xf"], name="reshape0"),
        helper.make_node("NonZero", ["xf"], ["nz"], name="nonzero0"),
        helper.make_node("Unique", ["xf"], ["uniq"], name="unique0"),
        helper.make_node("STFT", ["x", "step"], ["spec"], name="stft0", onesided=1),
        helper.make_node("FancyOp", ["xf"], ["fancy"], name="fancy0", domain="com.example"),
    ]
    outputs = [helper.make_tensor_value_info(n, t, shape) for n, t, shape in
               (("nz", TensorProto.INT64, [1, "n"]), ("uniq", TensorProto.FLOAT, ["u"]),
                ("spec", TensorProto.FLOAT, [1, "frames", "bins", 2]), ("fancy", TensorProto.FLOAT, ["k"]))]
    graph = helper.make_graph(nodes, "unsupported", [x], outputs, initializer=[step, flat])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])


def test_unsupported_ops_listed_at_once(cli, tmp_path):
    path = tmp_path / "unsupported.onnx"
    onnx.save(unsupported_model(), path)
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.zeros((1, 16, 1), np.float32))
    line = assert_one_error(cli("run", path, "--inputs", npz), "NonZero", "Unique", "STFT", "FancyOp",
                            "nonzero0", "unique0", "stft0", "fancy0", "17")
    assert "Reshape" not in line


def test_inspect_lists_unsupported_without_failing(cli, tmp_path):
    import json

    path = tmp_path / "unsupported.onnx"
    onnx.save(unsupported_model(), path)
    r = cli("inspect", "--json", path)
    assert r.code == 0, r
    report = json.loads(r.stdout.strip().splitlines()[-1])
    listed = {u["op"].split("::")[-1] for u in report["unsupported_ops"]}
    assert {"NonZero", "Unique", "STFT", "FancyOp"} <= listed
    assert not report["import"]["ok"]
    r = cli("inspect", path)
    assert r.code == 0 and "STFT" in r.stdout


# ---------------------------------------------------------------------------------------------
# ShapeError


def test_inconsistent_shapes(cli, tmp_path):
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["out"], name="bad_add")], "g", [a, b], [out])
    path = tmp_path / "shapes.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    npz = tmp_path / "in.npz"
    np.savez(npz, a=np.zeros((2, 3), np.float32), b=np.zeros((4, 5), np.float32))
    assert_one_error(cli("run", path, "--inputs", npz))


# ---------------------------------------------------------------------------------------------
# InputError


@pytest.fixture
def add_onnx(tmp_path):
    path = tmp_path / "add.onnx"
    onnx.save(add_model(), path)
    return path


def _npz(tmp_path, **arrays):
    path = tmp_path / "case.npz"
    np.savez(path, **arrays)
    return path


def test_run_ok_baseline(cli, tmp_path, add_onnx):
    x, y = np.ones((3, 4), np.float32), np.full((3, 4), 2, np.float32)
    out = tmp_path / "out.npz"
    r = cli("run", add_onnx, "--inputs", _npz(tmp_path, x=x, y=y), "--out", out)
    assert r.code == 0, r
    np.testing.assert_array_equal(np.load(out)["out"], x + y)


def test_input_missing(cli, tmp_path, add_onnx):
    assert_one_error(cli("run", add_onnx, "--inputs", _npz(tmp_path, x=np.ones((3, 4), np.float32))), "y")


def test_input_unknown_name(cli, tmp_path, add_onnx):
    one = np.ones((3, 4), np.float32)
    assert_one_error(cli("run", add_onnx, "--inputs", _npz(tmp_path, x=one, y=one, z=one)), "z")


def test_input_wrong_dtype(cli, tmp_path, add_onnx):
    npz = _npz(tmp_path, x=np.ones((3, 4), np.float32), y=np.ones((3, 4), np.int32))
    assert_one_error(cli("run", add_onnx, "--inputs", npz), "y")


def test_input_wrong_rank(cli, tmp_path, add_onnx):
    npz = _npz(tmp_path, x=np.ones((3, 4), np.float32), y=np.ones((4,), np.float32))
    assert_one_error(cli("run", add_onnx, "--inputs", npz), "y")


def test_input_wrong_static_dim(cli, tmp_path, add_onnx):
    npz = _npz(tmp_path, x=np.ones((3, 4), np.float32), y=np.ones((3, 5), np.float32))
    assert_one_error(cli("run", add_onnx, "--inputs", npz), "y")


def test_input_inconsistent_symbol(cli, tmp_path, add_onnx):
    npz = _npz(tmp_path, x=np.ones((3, 4), np.float32), y=np.ones((2, 4), np.float32))
    assert_one_error(cli("run", add_onnx, "--inputs", npz))


# ---------------------------------------------------------------------------------------------
# every AtlasError class goes through the same boundary; --debug shows the traceback


@pytest.mark.parametrize("cls", [c for c in vars(errors).values()
                                 if isinstance(c, type) and issubclass(c, errors.AtlasError)])
def test_boundary_formats_every_error_class(cli, tmp_path, monkeypatch, cls):
    import atlasc.frontend.inspect as inspect_module

    err = cls([("Foo", "1", "n0")]) if cls is errors.UnsupportedModelError else cls("something [bad] happened",
                                                                                   "try this")

    def boom(path):
        raise err

    monkeypatch.setattr(inspect_module, "inspect_onnx", boom)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    line = assert_one_error(cli("inspect", model))
    assert line == f"error: {err.message}"


def test_debug_shows_traceback(tmp_path):
    path = tmp_path / "random.onnx"
    path.write_bytes(b"\x00\x01garbage" * 100)
    cmd = [sys.executable, "-m", "atlasc"]
    plain = subprocess.run([*cmd, "inspect", str(path)], capture_output=True, text=True, cwd=REPO, check=False)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
    debug = subprocess.run([*cmd, "--debug", "inspect", str(path)],
                           capture_output=True, text=True, cwd=REPO, check=False)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "ModelLoadError" in debug.stderr, debug.stderr
