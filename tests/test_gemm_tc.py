"""linear_gemm_tc (codegen/gemm.py + gemm.cu, ATLAS_LINEAR_PREFILL=auto|tc|mma) without a GPU: the emitter
calls it only in the M > 32 branch of a float16 Linear with K % 32 == 0 (others keep today's paths): by
default (auto) before the MMA prefill for calls with enough output tiles, with tc for every call, never
with mma; its dynamic shared memory and a grid of 128 x 128 tiles; the choice is recorded; the module
compiles for sm80 and sm90 with no more register spills. GPU numerics: tests/test_kernels_gemm_gpu.py."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import REPO
from test_codegen_matmul_attention import ARCHS, _nvcc_log, _nvcc_logs, generate
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


def test_auto_by_default_chooses_by_output_tiles(monkeypatch):
    """Unset (or auto): linear_gemm_tc for calls with >= GEMM_TC_MIN_TILES output tiles of 128 x 128, the
    MMA prefill below that, both in one kernel (its shared memory: the tc stages dynamic, lin_red static);
    mma: the MMA prefill only, no dynamic shared memory."""
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    _, _, mod = _gen(4096, 6144, 512, "table")
    assert f"{CALL}__half, 2, false>(" in mod.source and "linear_mma_prefill<" in mod.source
    assert f"((M + 127) / 128) * ((N + 127) / 128) >= {gemm.GEMM_TC_MIN_TILES}) {CALL}" in mod.source
    assert mod.source.index(CALL) < mod.source.index("linear_mma_prefill<")
    assert mod.launches["run"][0].smem == gemm.gemm_smem() and "lin_red[8192]" in mod.source
    assert codegen_choices()["linear_prefill"] == "auto"
    assert codegen_choices()["linear_gemm_tc"]["min_tiles"] == gemm.GEMM_TC_MIN_TILES
    monkeypatch.setenv(gemm.PREFILL_ENV, "auto")
    assert _gen(4096, 6144, 512, "table")[2].source == mod.source
    monkeypatch.setenv(gemm.PREFILL_ENV, "mma")
    _, _, mma = _gen(4096, 6144, 512, "table")
    assert CALL not in mma.source and "linear_mma_prefill<" in mma.source
    assert mma.launches["run"][0].smem == 0
    assert codegen_choices()["linear_prefill"] == "mma" and "linear_gemm_tc" not in codegen_choices()


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
    """--variant tc: the default path table with ATLAS_LINEAR_PREFILL=tc; mma: the MMA prefill only (and the
    environment restored)."""
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    assert "tc" in kernel_lab.LAB_VARIANTS
    tc = kernel_lab.generate(4096, 6144, 128, "tc")[2].source
    assert CALL in tc and "linear_mma_prefill<" not in tc
    assert CALL not in kernel_lab.generate(4096, 6144, 128, "mma")[2].source
    assert linear.path_choice() == "table" and gemm.prefill_choice() == "auto"


def _spills(log: str) -> dict[str, int]:
    """kernel -> stack frame bytes + spill store bytes, from ptxas -v."""
    return {k: int(a) + int(b) for k, a, b in
            re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores", log)}


def test_tc_adds_no_spills(monkeypatch, tmp_path):
    """The prefill-sized Linear graph of the GPU tests (K 64 / 4096, N 8 / 1000 / 4096, bias, 3-D x with
    padded rows), sm80 and sm90: the default kernels (auto: linear_gemm_tc and the MMA prefill in one)
    spill no more in all than the same kernels with the MMA prefill alone (ATLAS_LINEAR_PREFILL=mma), and
    at most 16 bytes more in any one. (Not zero: with nvcc 13, ptxas caps these kernels at 128 registers
    on sm90 and the decode branch they share spills a few bytes either way; measured here: mma alone
    12-104 bytes in 11 of 15 sm90 kernels, auto 8 more in two of them, 272 fewer in all. ATLAS_LINEAR_PREFILL=tc
    alone, when written: no more than mma in every kernel, none where the decode branch does not spill.)"""
    b = build_linear("float16", 130, ks=(64, 4096), ns=(8, 1000, 4096))
    monkeypatch.setenv(gemm.PREFILL_ENV, "mma")
    base = generate(b, plan_kw={b.g.name: STRIDED_PLAN})
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    auto = generate(b, plan_kw={b.g.name: STRIDED_PLAN})
    tc = {launch.kernel for launch in auto.launches[b.g.name]
          if any(CALL in k and f" {launch.kernel}(" in k for k in _kernels(auto.source))}
    assert len(tc) >= 12
    logs = _nvcc_logs([(src, arch) for arch in ARCHS for src in (auto.source, base.source)], tmp_path)
    for arch, (after_log, before_log) in zip(ARCHS, zip(logs[::2], logs[1::2])):
        spills, before = _spills(after_log), _spills(before_log)
        assert tc <= set(spills)
        assert sum(spills[k] for k in tc) <= sum(before[k] for k in tc), arch
        assert all(spills[k] <= before[k] + 16 for k in tc), (arch, {k: (spills[k], before[k]) for k in tc})


def test_tc_not_for_a_compile_that_targets_sm75(monkeypatch):
    """Its 60 KB of stages do not fit sm75's 64 KB per block beside the static arrays: a compile for sm75
    keeps the MMA prefill (no dynamic shared memory); sm80 / sm86 / sm90 keep linear_gemm_tc."""
    from atlasc.codegen.generate import generate_module

    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    g, plan, upper = kernel_lab.build(4096, 6144, 512)
    for archs, tc in [(("sm80", "sm86", "sm90"), True), (("sm75", "sm90"), False)]:
        mod = generate_module({"run": (g, plan)}, {"run": upper}, archs=archs)
        assert (CALL in mod.source) == tc, archs
        assert mod.launches["run"][0].smem == (gemm.gemm_smem() if tc else 0)


def test_shared_memory_over_an_arch_limit_is_a_one_line_error():
    """check_shared_memory: a launch asking for more shared memory than an arch's blocks can have names the
    entry, node, kernel, bytes and arch (the launch would fail on that GPU); within every limit it passes."""
    from atlasc.codegen.generate import GeneratedModule, Launch, Variant, check_shared_memory

    big = Variant(1, "decode_0001_NormLinear_batch1", (1, 1, 1), (256, 1, 1), 120 * 1024)
    mod = GeneratedModule("", {"decode": [Launch("n0", "Linear", "decode_0000_Linear", (1, 1, 1), (256, 1, 1), 0),
                                          Launch("n1", "NormLinear", "decode_0001_NormLinear", (1, 1, 1),
                                                 (256, 1, 1), 64 * 1024, "batch", (big,))]})
    check_shared_memory(mod, ("sm80", "sm90"))
    with pytest.raises(CodegenError, match="^decode node n1 .*decode_0001_NormLinear_batch1.* needs 122880 bytes "
                                           "of shared memory per block; sm86 allows 101376$") as info:
        check_shared_memory(mod, ("sm86", "sm90"))
    assert "sm86" in info.value.hint and "\n" not in str(info.value)


def test_skinny_splits_fill_the_gpu():
    """K splits of linear_gemm_skinny: the fewest (1, 2, 4, 8) with tiles x splits >= SKINNY_TARGET, each split
    at least SKINNY_STAGES k tiles, K a multiple of SKINNY_BK (else 0: not applicable)."""
    assert gemm.skinny_splits(6144, 4096) == 8  # 48 tiles
    assert gemm.skinny_splits(28672, 4096) == 2  # 224 tiles
    assert gemm.skinny_splits(4096, 14336) == 8 and gemm.skinny_splits(4096, 4096) == 8  # 32 tiles
    assert gemm.skinny_splits(128256, 4096) == 1  # 1002 tiles
    assert gemm.skinny_splits(300, 1024) == 8 and gemm.skinny_splits(300, 512) == 4  # 512 / 4 = 4 k tiles of 32
    assert gemm.skinny_splits(200, 128) == 1 and gemm.skinny_splits(200, 100) == 0
    assert gemm.skinny_scratch(300, 8) == (256, 4 * 3 * 8 * 32 * 128) and gemm.skinny_scratch(300, 1) == (0, 0)


def test_skinny_gemm_is_the_batch_bucket_above_8(monkeypatch, tmp_path):
    """ATLAS_LINEAR_SKINNY=1 with a decode bucket at 8 rows: the float16 Linear kernels that run only for M
    9..32 are linear_gemm_skinny (+ linear_tiled where lin_mma_ok fails), with its stages as dynamic
    shared memory and its split partials as scratch; the bucket-8 kernels and the kernels of other rows
    (the 3-D x over `s`, the 1-D x) keep the decode paths. Unset: no skinny kernel. ptxas sm80 / sm90: no
    spills."""
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import generate_module

    b = build_linear("float16", 32, ks=(128, 1024), ns=(200, 300))
    graph = b.done()
    plan, _ = plan_for(graph, b.upper, None, **STRIDED_PLAN)
    buckets = {"run": ("m", (8,))}
    monkeypatch.delenv(gemm.SKINNY_ENV, raising=False)
    base = generate_module({"run": (graph, plan)}, {"run": b.upper}, buckets=buckets)
    assert "atlas::linear_gemm_skinny<" not in base.source
    monkeypatch.setenv(gemm.SKINNY_ENV, "1")
    mod = generate_module({"run": (graph, plan)}, {"run": b.upper}, buckets=buckets)
    kernels = {re.search(r"void (?:__launch_bounds__\(\d+\) )?(\w+)\(", k).group(1): k for k in _kernels(mod.source)}
    skinny = {name for name, text in kernels.items() if "atlas::linear_gemm_skinny<" in text}
    by_kernel = {launch.kernel: launch for launch in mod.launches["run"]}
    # the 8 Linear nodes of x[m, K] and the K-major one: their default kernels (M > 8)
    assert len(skinny) == 9 and all(by_kernel[k].smem == gemm.skinny_smem() for k in skinny)
    assert all("linear_gemv_setup" not in kernels[k] and "atlas::linear_tiled<" in kernels[k] for k in skinny)
    assert all(v.upto == 8 and v.kernel not in skinny for k in skinny for v in by_kernel[k].variants)
    assert ", 8>(x, w, bias" in mod.source and ", 1>(x, w, bias" in mod.source  # K = 1024 x N 300, K = 128
    assert mod.scratch_bytes >= sum(gemm.skinny_scratch(300, 8))
    assert codegen_choices()["linear_skinny"] is True
    monkeypatch.setenv(gemm.SKINNY_ENV, "yes")
    with pytest.raises(CodegenError, match=gemm.SKINNY_ENV):
        gemm.skinny_enabled()
    monkeypatch.setenv(gemm.SKINNY_ENV, "1")
    for arch in ARCHS:
        log = _nvcc_log(mod.source, arch, tmp_path)
        assert "spill" not in log.replace("0 bytes spill", ""), log[-3000:]
