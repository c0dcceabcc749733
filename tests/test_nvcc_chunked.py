"""Big modules compile in parallel chunks, one cubin per chunk (no -rdc, no nvlink): the artifact carries
them as parts (cubin/<arch>.cubin, .1, .2, ...), every kernel of the schedule lives in exactly one part,
each kernel keeps the registers a single-unit build gives it (relocatable code tripled the decode GEMVs'),
and the artifact runs like a single-unit build (on the CPU executor; tests/test_gpu_runtime.py loads a
chunked build on the GPU)."""

from __future__ import annotations

import shutil

import pytest

from atlasc.artifact import open_artifact
from atlasc.codegen.cubin import kernel_registers
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.cpu import CpuModel
from atlasc.runtime.generate import generate

from conftest import FIXTURES
from ort_reference import ort_greedy

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

def test_chunked_build_keeps_every_kernel_and_its_registers(tmp_path, monkeypatch):
    from atlasc.codegen.nvcc import compile_cubins

    monkeypatch.setenv("ATLAS_NVCC_CHUNK", "8")  # llama's ~70 kernels -> chunks of 8
    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "llama.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm80",), max_batch=2, max_seq=32))
    with open_artifact(path) as art:
        parts = art.cubins("sm80")
        assert len(parts) > 4 and all(p[:4] == b"\x7fELF" for p in parts)
        per_part = [kernel_registers(p) for p in parts]
        kernels = {n.kernel for e in art.manifest.entries.values() for n in e.nodes if n.kernel}
        assert len(kernels) > 16
        for k in kernels:
            assert sum(k in regs for regs in per_part) == 1, k
        whole = kernel_registers(compile_cubins(art.source(), ("sm80",))["sm80"])
        chunked = {k: v for regs in per_part for k, v in regs.items()}
        assert {k: chunked[k] for k in kernels} == {k: whole[k] for k in kernels}
        tokens = generate(CpuModel(art), [[5, 17, 42]], 4).tokens
    assert tokens == ort_greedy(FIXTURES / "llama.onnx", [[5, 17, 42]], 4)[0]


def test_prefill_logits_last_keeps_the_tokens_and_the_last_position(tmp_path, no_nvcc):
    """--prefill-logits last: the LM head runs on one position; tokens and last-position logits are
    those of the all-positions build (CPU executor over the artifacts; their cubins are not run)."""
    import numpy as np

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
        builds = list(pool.map(lambda j: nvcc.compile_chunked(chunks, ("sm80",))["sm80"], range(4)))
    assert all(len(parts) == 6 and all(c[:4] == b"\x7fELF" for c in parts) for parts in builds)
    assert all(parts == builds[0] for parts in builds)


def _count_under_lock(args) -> None:
    from atlasc.codegen.nvcc import exclusive

    counter, lock, rounds = args
    for _ in range(rounds):
        with exclusive(lock):
            counter.write_text(str(int(counter.read_text()) + 1))


def test_build_locks_exclude_each_other_and_leave_no_files(tmp_path, monkeypatch):
    """nvcc.exclusive, the lock around a cubin's build and its temporary folder: 6 processes adding 1 to a file 25
    times each under it lose no update, and the lock file is gone afterwards; a real build leaves no lock file in
    TMPDIR or the cache (they used to pile up, one per source and arch)."""
    import multiprocessing
    import tempfile

    from atlasc.codegen.nvcc import compile_cubins

    counter, lock = tmp_path / "counter", tmp_path / "build.lock"
    counter.write_text("0")
    with multiprocessing.get_context("fork").Pool(6) as pool:
        pool.map(_count_under_lock, [(counter, lock, 25)] * 6)
    assert counter.read_text() == "150" and not lock.exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("ATLAS_CACHE_DIR", str(tmp_path / "cache"))
    compile_cubins('extern "C" __global__ void atlasc_lock_test() {}\n', ("sm90",))
    assert not list((tmp_path / "tmp").iterdir()), list((tmp_path / "tmp").iterdir())
    assert [p.suffix for p in (tmp_path / "cache" / "cubin").iterdir()] == [".cubin"]
