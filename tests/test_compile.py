"""Every fixture compiles for sm90 (real nvcc), llama-fp16 for every supported arch, each arch its own
compile as a per-arch CI pipeline would run it; and each fixture's artifact, executed on the CPU over a
numpy arena laid out by the memory plan, reproduces onnxruntime.

- decoders: each case (prefill with an empty past, a left-padded decode step, a chunk on top of a
  past) through the matching entry point with the case's past loaded into the KV cache, logits and
  cache compared; then greedy generation, 16 tokens, equal to onnxruntime's with past/present;
- encoders: the forward entry on the case's inputs.
Tolerances as in test_fixtures.py (fp32 atol 1e-4 / rtol 1e-3, fp16 3e-2).
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

from atlasc.artifact import open_artifact
from atlasc.codegen.nvcc import SUPPORTED_ARCHS
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.cpu import CpuModel
from atlasc.runtime.generate import Sampling, generate

from conftest import FIXTURES, TOL
from ort_reference import ort_greedy

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
NAMES = [f["name"] for f in MANIFEST]
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
# sm90 only: a second arch for every fixture doubled the nvcc time (CI time, .ci/run);
# test_compiles_for_every_supported_arch covers the others
OPTIONS = CompileOptions(archs=("sm90",), max_batch=4, max_seq=64)
EVERY_ARCH_FIXTURE = "llama-fp16"  # float16: the tensor-core paths and their pre-sm80 fallbacks


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


@functools.cache
def _compiled(name: str, folder: str):
    path = f"{folder}/{name}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path, OPTIONS)
    return path


@pytest.fixture
def artifact(build_dir):
    def get(name: str):
        return open_artifact(_compiled(name, str(build_dir)))

    return get


def entry_of(name: str) -> dict:
    return next(f for f in MANIFEST if f["name"] == name)


def load_case(name, case):
    z = np.load(FIXTURES / f"{name}.{case}.npz")
    return ({k[3:]: z[k] for k in z.files if k.startswith("in.")},
            {k[4:]: z[k] for k in z.files if k.startswith("out.")})


def _check_cubins(art, arch: str) -> None:
    """The artifact holds `arch`'s cubins (ELF), and every launch names a kernel one of them (a chunked
    build's parts) defines."""
    assert art.manifest.archs == (arch,)
    parts = art.cubins(arch)
    assert parts and all(part[:4] == b"\x7fELF" for part in parts)
    names = b"".join(parts)
    for e in art.manifest.entries.values():
        for node in e.nodes:
            assert node.kernel.encode() in names
            assert all(v.kernel.encode() in names for v in node.variants)


@pytest.mark.parametrize("name", NAMES)
def test_compiles_for_sm90(name, artifact):
    with artifact(name) as art:
        expected = {"prefill", "decode"} if entry_of(name)["kind"] == "decoder" else {"forward"}
        assert set(art.manifest.entries) == expected
        _check_cubins(art, "sm90")


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHS if a != OPTIONS.archs[0]])
def test_compiles_for_every_supported_arch(arch, tmp_path):
    """llama-fp16 compiled for one arch at a time, as a per-arch CI pipeline builds it (the source is
    generated for that arch alone: the shared memory per block, tensor cores and FP8 differ), and nvcc
    builds it; the sm90 build is test_compiles_for_sm90's."""
    from dataclasses import replace

    path = tmp_path / f"{arch}.atlas"
    compile_model(FIXTURES / f"{EVERY_ARCH_FIXTURE}.onnx", path, replace(OPTIONS, archs=(arch,)))
    with open_artifact(path) as art:
        _check_cubins(art, arch)


@pytest.mark.parametrize("name,case", [(f["name"], c) for f in MANIFEST if f["kind"] == "decoder"
                                       for c in f["cases"]])
def test_decoder_cases_match_onnxruntime(name, case, artifact):
    with artifact(name) as art:
        model = CpuModel(art)
        ins, want = load_case(name, case)
        kv = art.manifest.kv_cache
        past_len = ins["past_key_values.0.key"].shape[2]
        b, s = ins["input_ids"].shape
        model.reset()
        cache = model.kv_cache()
        for layer in range(kv.layers):
            cache[layer, 0, :b, :, :past_len] = ins[f"past_key_values.{layer}.key"]
            cache[layer, 1, :b, :, :past_len] = ins[f"past_key_values.{layer}.value"]
        entry = "decode" if s == 1 else "prefill"
        feed = {i.name: ins[i.name] for i in art.manifest.entries[entry].inputs if i.name in ins} | Sampling().inputs(0)
        out = model.run(entry, feed, {art.manifest.report["roles"]["past"]: past_len})
        tol = TOL[entry_of(name)["dtype"]]
        np.testing.assert_allclose(out["logits"].astype(np.float64), want["logits"].astype(np.float64), **tol)
        for layer in range(kv.layers):
            for k, kind in enumerate(("key", "value")):
                np.testing.assert_allclose(cache[layer, k, :b, :, :past_len + s].astype(np.float64),
                                           want[f"present.{layer}.{kind}"].astype(np.float64), **tol)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_tokens_match_onnxruntime(name, artifact):
    prompts = [[5, 17, 42, 7, 99], [3, 8]]
    want, _ = ort_greedy(FIXTURES / f"{name}.onnx", prompts, 16)
    with artifact(name) as art:
        got = generate(CpuModel(art), prompts, 16)
    assert got.tokens == want


@pytest.mark.parametrize("name", DECODERS)
def test_stored_greedy_references_are_current(name):
    """The GPU tests compare with examples/fixtures/<name>.greedy.npz: it must equal a live onnxruntime run."""
    z = np.load(FIXTURES / f"{name}.greedy.npz")
    prompts = [[int(t) for t in row if t >= 0] for row in z["b4_l17.prompts"]]
    tokens, logits = ort_greedy(FIXTURES / f"{name}.onnx", prompts, 32)
    assert tokens == z["b4_l17.tokens"].tolist()
    np.testing.assert_allclose(np.stack(logits), z["b4_l17.logits"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", [f["name"] for f in MANIFEST if f["kind"] == "encoder"])
def test_encoder_forward_matches_onnxruntime(name, artifact):
    with artifact(name) as art:
        ins, want = load_case(name, "forward")
        out = CpuModel(art).run("forward", ins)
        for k, w in want.items():
            np.testing.assert_allclose(out[k], w, **TOL["fp32"], err_msg=k)


@pytest.mark.parametrize("when", ["right after mkdir", "inside the block", "in the removal"])
def test_a_stop_anywhere_removes_the_spill_directory(tmp_path, monkeypatch, when):
    """An exception (as the CLI's SIGINT / SIGTERM handler raises) raised the instant the spill folder exists,
    inside the compile that uses it, or in the middle of the folder's removal leaves no folder behind
    (tempfile.TemporaryDirectory made the folder before it armed its cleanup, and CI once saw a terminated
    compile leave it)."""
    import os

    import atlasc.compiler as compiler

    monkeypatch.setattr(compiler.tempfile, "gettempdir", lambda: str(tmp_path))
    real_mkdir = os.mkdir

    def mkdir_then_stop(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        raise SystemExit(143)

    if when == "right after mkdir":
        monkeypatch.setattr(os, "mkdir", mkdir_then_stop)
    real_unlink, stops = os.unlink, []

    def unlink_once_then_stop(path, *args, **kwargs):  # the first unlink of the removal is cut short
        if not stops:
            stops.append(path)
            raise SystemExit(143)
        return real_unlink(path, *args, **kwargs)

    if when == "in the removal":
        monkeypatch.setattr(os, "unlink", unlink_once_then_stop)
    with pytest.raises(SystemExit):
        with compiler.spill_directory() as spill:
            assert spill.is_dir() and spill.parent == tmp_path
            (spill / "w.bin").write_bytes(b"x" * 64)
            (spill / "u.bin").write_bytes(b"x" * 64)
            if when != "in the removal":
                raise SystemExit(143)
    assert list(tmp_path.iterdir()) == []
    assert bool(stops) == (when == "in the removal")


def test_the_spill_directory_leaves_a_folder_it_did_not_make(tmp_path, monkeypatch):
    """A name that exists already (a uuid4 collision) is an error, and that folder is not removed."""
    import uuid

    import atlasc.compiler as compiler

    monkeypatch.setattr(compiler.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(compiler.uuid, "uuid4", lambda: uuid.UUID(int=7))
    theirs = tmp_path / f"atlasc-spill-{uuid.UUID(int=7).hex}"
    theirs.mkdir()
    (theirs / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        with compiler.spill_directory():
            pass
    assert (theirs / "keep").read_text() == "x"
