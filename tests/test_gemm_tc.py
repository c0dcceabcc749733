"""linear_gemm_tc (codegen/gemm.py + gemm.cu, ATLAS_LINEAR_PREFILL=tc) without a GPU: the emitter calls it
only when enabled, only in the M > 32 branch of a float16 Linear with K % 32 == 0 (others keep today's
paths), with its dynamic shared memory and a grid of 128 x 128 tiles; the choice is recorded; the module
compiles for sm80 and sm90 with no register spills. GPU numerics: tests/test_kernels_gemm_gpu.py."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import REPO
from test_codegen_matmul_attention import ARCHS, _nvcc_log, generate
from test_fuse_linear import STRIDED_PLAN, build_linear

from atlasc.codegen import gemm, linear
from atlasc.codegen.generate import CodegenError, codegen_choices

sys.path.insert(0, str(REPO / "examples"))
import kernel_lab  # noqa: E402

CALL = "atlas::linear_gemm_tc<"


def _gen(k: int, n: int, m: int, path: str = "table"):
    """(graph, plan, module) of the kernel lab's Linear with ATLAS_LINEAR_PATH=path, ATLAS_LINEAR_PREFILL as set."""
    return kernel_lab.generate_with_env(kernel_lab.build(k, n, m), {linear.PATH_ENV: path})


def _kernels(source: str) -> list[str]:
    return source.split('extern "C"')[1:]


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    _, _, mod = _gen(4096, 6144, 512, "table")
    assert CALL not in mod.source and "linear_mma_prefill<" in mod.source
    assert mod.launches["run"][0].smem == 0
    assert "linear_prefill" not in codegen_choices()


def test_tc_replaces_the_mma_prefill(monkeypatch):
    """M up to 512: the M > 32 branch calls linear_gemm_tc (the decode branch is unchanged); 61440 bytes of
    dynamic shared memory; the grid covers 4 x 48 tiles (or the decode paths' blocks, if more)."""
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    _, _, mod = _gen(4096, 6144, 512, "table")
    (launch,) = mod.launches["run"]
    assert f"{CALL}__half, 2, false>(x, w, bias, bias_stride, y, M, N, K, lin_xoff, lin_yoff)" in mod.source
    assert "linear_mma_prefill<" not in mod.source and "linear_mma_decode<" in mod.source
    assert "lin_xoff[128]" in mod.source
    assert launch.smem == gemm.gemm_smem() == 3 * 2 * 128 * 40 * 2
    assert launch.grid[0] >= gemm.gemm_tiles(512, 6144) == 4 * 48
    assert mod.choices["linear_prefill"] == "tc" and mod.choices["linear_gemm_tc"]["stages"] == 3


def test_tc_only_where_it_applies(monkeypatch):
    """Decode-sized kernels (M <= 32), K % 32 != 0, float32 and ATLAS_LINEAR_PATH=simt keep today's paths."""
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    assert CALL not in _gen(4096, 6144, 32, "table")[2].source
    assert _gen(4096, 6144, 32, "table")[2].launches["run"][0].smem == 0
    assert CALL not in _gen(4096, 6144, 512, "simt")[2].source
    mod = generate(build_linear("float16", 130, ks=(72, 4096), ns=(8,)),
                   build_linear("float32", 130, ks=(64,), ns=(8,)))
    tc = [k for k in _kernels(mod.source) if CALL in k]
    assert tc and all("K = 4096LL" in k and "__half" in k for k in tc)
    assert not [k for k in _kernels(mod.source) if CALL in k and ("K = 72LL" in k or "float* " in k)]
    assert all(k.count("lin_xoff[128]") == 1 for k in tc)


def test_bad_value_is_rejected(monkeypatch):
    monkeypatch.setenv(gemm.PREFILL_ENV, "cutlass")
    with pytest.raises(CodegenError, match=gemm.PREFILL_ENV):
        _gen(4096, 6144, 512, "table")


def test_kernel_lab_tc_variant(monkeypatch):
    """--variant tc: the default path table with ATLAS_LINEAR_PREFILL=tc (and the environment restored)."""
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    assert "tc" in kernel_lab.LAB_VARIANTS
    assert CALL in kernel_lab.generate(4096, 6144, 128, "tc")[2].source
    assert CALL not in kernel_lab.generate(4096, 6144, 128, "mma")[2].source
    assert linear.path_choice() == "table" and not gemm.prefill_choice()


def _spills(log: str) -> dict[str, int]:
    """kernel -> stack frame bytes + spill store bytes, from ptxas -v."""
    return {k: int(a) + int(b) for k, a, b in
            re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores", log)}


def test_tc_adds_no_spills(monkeypatch, tmp_path):
    """The prefill-sized Linear graph of the GPU tests (K 64 / 4096, N 8 / 1000 / 4096, bias, 3-D x with
    padded rows), sm80 and sm90: every kernel with linear_gemm_tc spills no more than the same kernel with
    the default prefill path. (Not zero: with nvcc 13, ptxas caps these kernels at 128 registers on sm90 and
    the decode branch they share spills a few bytes either way, up to 56 bytes in the default kernels; the
    kernels whose decode branch does not spill, K = 64 and 4096 with 2-D x, are spill-free with tc.)"""
    b = build_linear("float16", 130, ks=(64, 4096), ns=(8, 1000, 4096))
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    base = generate(b, plan_kw={b.g.name: STRIDED_PLAN})
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    mod = generate(b, plan_kw={b.g.name: STRIDED_PLAN})
    tc = {launch.kernel for launch in mod.launches[b.g.name]
          if any(CALL in k and f" {launch.kernel}(" in k for k in _kernels(mod.source))}
    assert len(tc) >= 12
    for arch in ARCHS:
        spills, before = _spills(_nvcc_log(mod.source, arch, tmp_path)), _spills(_nvcc_log(base.source, arch, tmp_path))
        assert tc <= set(spills)
        assert all(spills[k] <= before[k] for k in tc), (arch, {k: (spills[k], before[k]) for k in tc})
        k64 = [launch.kernel for launch in mod.launches[b.g.name][:6]]  # K = 64 (the first six)
        assert all(spills[k] == 0 for k in k64 if k in tc), (arch, spills)
