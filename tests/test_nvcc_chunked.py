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


def test_prefill_logits_last_keeps_the_tokens_and_the_last_position(tmp_path, monkeypatch):
    """--prefill-logits last: the LM head runs on one position; tokens and last-position logits are
    those of the all-positions build (CPU executor over the real artifacts)."""
    import numpy as np

    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    results = {}
    for mode in ("all", "last"):
        path = tmp_path / f"llama-{mode}.atlas"
        compile_model(FIXTURES / "llama.onnx", path,
                      CompileOptions(archs=("sm80",), max_batch=2, max_seq=32, prefill_logits=mode))
        with open_artifact(path) as art:
            assert (art.manifest.entries["prefill"].outputs[0].shape[1] == 1) == (mode == "last")
            results[mode] = generate(CpuModel(art), [[5, 17, 42, 9], [3, 4]], 6, keep_logits=True)
    assert results["last"].tokens == results["all"].tokens
    # float32 (numpy matmul over 1 row vs all rows may round differently in the last bit)
    np.testing.assert_allclose(results["last"].prefill_logits, results["all"].prefill_logits[:, -1:], rtol=1e-5,
                               atol=1e-6)


def test_concurrent_builds_of_one_module_do_not_collide(tmp_path, monkeypatch):
    """Parallel builds of the same model (GPU test workers, CI) compile identical chunks in the same
    hash-named folder: each holds it exclusively, so neither deletes the other's files mid-nvcc."""
    from concurrent.futures import ThreadPoolExecutor

    from atlasc.codegen import nvcc

    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    prelude = "static __device__ __forceinline__ int twice(int x) { return 2 * x; }\n"
    chunks = [prelude + f'extern "C" __global__ void k{i}(int* p) {{ p[{i}] = twice({i}); }}\n' for i in range(6)]
    with ThreadPoolExecutor(4) as pool:
        cubins = list(pool.map(lambda j: nvcc.compile_chunked(f"race{j}", chunks, ("sm80",))["sm80"], range(4)))
    assert all(c[:4] == b"\x7fELF" for c in cubins)
