"""Large external initializers are memory-mapped at import, not read into protobuf memory
(atlasc/frontend/load.py load_model_mapped), and the large constants passes make are spilled to files
(Program.new_array): same graph, same artifact, same errors."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import atlasc.frontend.load as load
from atlasc.compiler import compile_model
from atlasc.errors import ModelLoadError
from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from build_llama import CONFIGS, main, write  # noqa: E402


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny Llama with its weights in an external-data file, mapped from 1 KB on."""
    path = tmp_path / "tiny.onnx"
    write(CONFIGS["tiny"], path, seed=3)
    monkeypatch.setattr(load, "MAP_MIN_BYTES", 1024)
    return path


def _is_mapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = a.base
    return False


def test_mapped_import_equals_the_read_import(tiny):
    mapped = import_onnx(tiny)
    read = import_onnx(load.load_model(tiny))  # a ModelProto: every tensor read into memory
    m = {c.name: c.data for c in mapped.constants()}
    r = {c.name: c.data for c in read.constants()}
    assert m.keys() == r.keys()
    assert sum(_is_mapped(a) for a in m.values()) >= 2 * CONFIGS["tiny"].layers * 4  # every projection
    assert not any(_is_mapped(a) for a in r.values())
    for name, a in m.items():
        assert a.dtype == r[name].dtype and np.array_equal(a, r[name]), name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_mapped_compile_gives_the_same_artifact(tiny, tmp_path, monkeypatch, no_nvcc):
    opts = CompileOptions(archs=("sm90",), max_batch=2, max_seq=32, prefill_logits="last")
    compile_model(tiny, tmp_path / "mapped.atlas", opts)
    monkeypatch.setattr(load, "MAP_MIN_BYTES", 1 << 62)  # nothing mapped
    compile_model(tiny, tmp_path / "read.atlas", opts)
    assert (tmp_path / "mapped.atlas").read_bytes() == (tmp_path / "read.atlas").read_bytes()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_spilled_constants_give_the_same_artifact(tiny, tmp_path, monkeypatch, quant, no_nvcc):
    """The merged (and quantized) weights passes make go to files in a temporary directory during a
    compile (Program.new_array), which is gone afterwards; the artifact is the same as from memory."""
    import atlasc.ir.program as program_mod

    opts = CompileOptions(archs=("sm90",), max_batch=2, max_seq=32, prefill_logits="last", quant=quant)
    monkeypatch.setattr(program_mod, "SPILL_MIN_BYTES", 1)  # every constant a pass makes is spilled
    spilled = compile_model(tiny, tmp_path / "spilled.atlas", opts)
    made = [c.data for g in spilled.program.entries.values() for c in g.constants()
            if c.name.startswith("merged_") or c.name.endswith(("__q4", "__scale"))]
    assert made and all(_is_mapped(a) for a in made)
    base = made[0]
    while not isinstance(base, np.memmap):
        base = base.base
    assert not Path(base.filename).parent.exists()  # the spill directory is removed after the write
    monkeypatch.setattr(program_mod, "SPILL_MIN_BYTES", 1 << 62)  # nothing spilled
    kept = compile_model(tiny, tmp_path / "memory.atlas", opts)
    assert not any(_is_mapped(c.data) and c.name.startswith("merged_")
                   for g in kept.program.entries.values() for c in g.constants())
    assert (tmp_path / "spilled.atlas").read_bytes() == (tmp_path / "memory.atlas").read_bytes()


def test_full_spill_disk_is_one_error(tiny, tmp_path, monkeypatch, cli):
    """No room in TMPDIR for a spilled constant: a one-line error naming the directory (exit 2), no
    artifact, and the spill directory removed."""
    import errno
    import tempfile

    import atlasc.ir.program as program_mod
    from test_compile_cli import one_error

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(program_mod, "SPILL_MIN_BYTES", 1)
    monkeypatch.setattr(program_mod.os, "posix_fallocate", full)
    spill_root = tmp_path / "tmp"
    spill_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_root))
    out = tmp_path / "x.atlas"
    one_error(cli("compile", tiny, "-o", out, "--arch", "sm90", "--max-seq", "32", "--quant", "int8"),
              "no room", "spill")
    assert not out.exists() and list(spill_root.iterdir()) == []


def test_truncated_external_data_is_one_error(tiny):
    data = tiny.with_name(tiny.name + ".data")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        import_onnx(tiny)


def test_packed_int4_initializers_are_read_not_mapped(tmp_path, monkeypatch):
    """A tensor whose bytes are not its numpy shape (4-bit, packed) is read the usual way."""
    monkeypatch.setattr(load, "MAP_MIN_BYTES", 1)
    q = onnx.helper.make_tensor("q", onnx.TensorProto.INT4, [64, 32], bytes(64 * 32 // 2), raw=True)
    f = onnx.numpy_helper.from_array(np.ones((64, 32), np.float32), "f")
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [64, 32])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [64, 32])
    node = onnx.helper.make_node("Add", ["x", "f"], ["y"])
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y], [q, f]),
                                   opset_imports=[onnx.helper.make_opsetid("", 21)])
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    proto, mapped = load.load_model_mapped(path)
    assert set(mapped) == {"f"} and np.array_equal(mapped["f"], np.ones((64, 32), np.float32))
    q_loaded = next(t for t in proto.graph.initializer if t.name == "q")
    assert not onnx.external_data_helper.uses_external_data(q_loaded) and len(q_loaded.raw_data) == 64 * 32 // 2


def test_build_llama_layers_keeps_the_shapes_with_fewer_layers(tmp_path):
    """--layers N: the config's shapes with N decoder layers (quick kernel studies of the real shapes)."""
    path = tmp_path / "two.onnx"
    main(["tiny", str(path), "--layers", "1"])
    graph = import_onnx(path)
    caches = [v.name for v in graph.inputs if v.name.startswith("past_key_values.")]
    assert sorted(caches) == ["past_key_values.0.key", "past_key_values.0.value"]
    hidden = CONFIGS["tiny"].hidden
    assert any(c.data.shape == (CONFIGS["tiny"].vocab, hidden) for c in graph.constants())
    with pytest.raises(SystemExit) as e:
        main(["tiny", str(path), "--layers", "-1"])
    assert e.value.code == 2
