"""Big modules compile in parallel chunks (nvcc -rdc per chunk, nvlink per arch): the linked cubin holds
every kernel of the schedule, and the artifact runs like a single-unit build (on the CPU executor).
Loading a linked cubin on the GPU is exercised by the GPU tests when a module exceeds the threshold."""

from __future__ import annotations

import shutil

import pytest

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.cpu import CpuModel
from atlasc.runtime.generate import generate

from conftest import FIXTURES
from ort_reference import ort_greedy

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("nvlink") is None,
                                reason="nvcc/nvlink not on PATH")


def test_chunked_build_links_every_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_NVCC_CHUNK", "8")  # llama's ~70 kernels -> chunks of 8
    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm80",), max_batch=2, max_seq=32))
    with open_artifact(path) as art:
        cubin = art.cubin("sm80")
        assert cubin[:4] == b"\x7fELF"
        kernels = [n.kernel for e in art.manifest.entries.values() for n in e.nodes if n.kernel]
        assert len(kernels) > 16
        assert all(k.encode() in cubin for k in kernels)
        tokens = generate(CpuModel(art), [[5, 17, 42]], 4).tokens
    assert tokens == ort_greedy(FIXTURES / "llama.onnx", [[5, 17, 42]], 4)[0]
