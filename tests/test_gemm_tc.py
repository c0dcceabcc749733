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
from test_codegen_matmul_attention import ARCHS, _nvcc_logs, generate
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
    assert not [k for k in _kernels(mod.source) if CALL in k and ("K = 72LL" in k or "const float* w =" in k)]
    assert [k for k in _kernels(mod.source) if "const float* w =" in k]  # the float32 kernels are there
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


@pytest.mark.slow
def test_tc_kernels_spill_little(monkeypatch, tmp_path):
    """The prefill-sized Linear graph of the GPU tests (K 64 / 4096, N 8 / 1000 / 4096, bias, 3-D x with
    padded rows), generated for sm80 and for sm90 as a compile for that arch is: every kernel with
    linear_gemm_tc (auto, the default) keeps its stack frame and spill stores within 96 bytes, as the same
    kernels with the MMA prefill alone (ATLAS_LINEAR_PREFILL=mma) do on this graph. Not zero: ptxas
    holds these kernels to 128 registers on sm90 (the launch bounds' 2 blocks per SM) and the paths they
    share spill a few bytes, more or fewer as its heuristics move. Measured (docs/perf.md v20), sm90:
    auto 0-60 bytes per kernel, 356 in all, mma alone 0-56, 332; the code before v20 (GEMV fallbacks
    inlined): auto 0-92, 312, mma alone 0-92, 604. sm80 (no launch-bounds minimum: one block per SM by
    shared memory): auto 252 in all, mma alone 468."""
    from atlasc.codegen.generate import generate_module
    from test_codegen_matmul_attention import planned

    b = build_linear("float16", 130, ks=(64, 4096), ns=(8, 1000, 4096))
    graph, plan, _ = planned(b, "float16", **STRIDED_PLAN)

    def source(arch: str, prefill: str) -> str:
        monkeypatch.setenv(gemm.PREFILL_ENV, prefill)
        return generate_module({"g": (graph, plan)}, {"g": b.upper}, archs=(arch,)).source

    sources = [(source(arch, "auto"), source(arch, "mma")) for arch in ARCHS]
    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    tc = {re.search(r"\) (\w+)\(unsigned char", k).group(1) for k in _kernels(sources[0][0]) if CALL in k}
    assert len(tc) >= 12
    logs = _nvcc_logs([(src, arch) for arch, pair in zip(ARCHS, sources) for src in pair], tmp_path)
    for arch, (after_log, before_log) in zip(ARCHS, zip(logs[::2], logs[1::2])):
        spills, before = _spills(after_log), _spills(before_log)
        assert tc <= set(spills)
        assert all(spills[k] <= 96 for k in tc), (arch, {k: spills[k] for k in tc})
        assert all(before[k] <= 96 for k in tc), (arch, {k: before[k] for k in tc})


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


def test_auto_keeps_the_mma_prefill_alone_where_tc_and_its_arrays_do_not_fit(monkeypatch):
    """auto (the default) puts linear_gemm_tc's 60 KB of stages beside linear_mma_prefill's 32 KB of partial
    sums and the kernel's other arrays (43136 static bytes in all, ptxas): 104576 bytes, over the 99 KB of
    sm86 / sm89 / sm120, so a compile that targets one of them keeps the MMA prefill alone (the compile of
    llama-fp16 for sm86 failed with a shared-memory error before); tc alone (ATLAS_LINEAR_PREFILL=tc) has
    fewer arrays and fits."""
    from atlasc.codegen.generate import generate_module
    from atlasc.codegen.linear import static_smem

    monkeypatch.delenv(gemm.PREFILL_ENV, raising=False)
    g, plan, upper = kernel_lab.build(4096, 6144, 512)
    assert gemm.gemm_smem() + static_smem(gemm.GEMM_BM, 8192, True) == 104576
    for archs, tc, mma in [(("sm80",), True, True), (("sm90",), True, True), (("sm86",), False, True),
                           (("sm89", "sm90"), False, True), (("sm120",), False, True)]:
        source = generate_module({"run": (g, plan)}, {"run": upper}, archs=archs).source
        assert (CALL in source, "atlas::linear_mma_prefill<" in source) == (tc, mma), archs
    monkeypatch.setenv(gemm.PREFILL_ENV, "tc")
    source = generate_module({"run": (g, plan)}, {"run": upper}, archs=("sm86",)).source
    assert CALL in source and "atlas::linear_mma_prefill<" not in source


def test_two_blocks_per_sm_where_the_tc_stages_fit_twice():
    """A kernel with linear_gemm_tc asks __launch_bounds__ for 2 blocks per SM where two of its 104576 bytes of
    shared memory fit an SM (sm90, sm100: 228 KB), so ptxas keeps it at 128 registers; not where only one
    fits (sm80: 164 KB), nor in kernels without the tc path."""
    from atlasc.codegen.generate import generate_module
    from atlasc.ir.archs import blocks_per_sm

    assert [blocks_per_sm((a,), 104576) for a in ("sm80", "sm86", "sm90", "sm100")] == [1, 0, 2, 2]
    g, plan, upper = kernel_lab.build(4096, 6144, 512)
    for archs, bounds in [(("sm90",), "(256, 2)"), (("sm90", "sm100"), "(256, 2)"), ((), "(256, 2)"),
                          (("sm80",), "(256)"), (("sm80", "sm90"), "(256)")]:
        source = generate_module({"run": (g, plan)}, {"run": upper}, archs=archs).source
        assert CALL in source and f"__launch_bounds__{bounds} run_0000_Linear(" in source, archs
    g, plan, upper = kernel_lab.build(4096, 6144, 32)
    assert "__launch_bounds__(256) run_0000_Linear(" in generate_module({"run": (g, plan)}, {"run": upper}).source


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
