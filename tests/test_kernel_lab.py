"""examples/kernel_lab.py without a GPU: the kernels it would time are the ones the compiler emits (fused
variants included), its float32 references are right, and bad options fail before any device work."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import kernel_lab  # noqa: E402


def test_fused_variants_are_the_compilers_kernels():
    """norm / gated: one NormLinear launch staging M x K float16 values, the gated one with SwiGLU; the
    grid is the fused kernels' cap."""
    from atlasc.codegen.linear_prologue import PROLOGUE_MAX_GRID

    for variant in ("norm", "gated"):
        g, plan, mod = kernel_lab.generate(2048, 16384, 8, variant)
        (launch,) = mod.launches["run"]
        assert launch.op == "NormLinear" and launch.smem == 8 * 2048 * 2 and launch.grid[0] == PROLOGUE_MAX_GRID
        assert ("lin_epi" in mod.source) == (variant == "gated")
        assert g.outputs[0].shape[-1] == (8192 if variant == "gated" else 16384)


def test_u_variants_set_the_steps_in_flight():
    _, _, mod = kernel_lab.generate(8192, 2048, 1, "mma", "8")
    assert set(re.findall(r"linear_mma_decode<__half, 2, 1, (\d+),", mod.source)) == {"8"}


def test_ft_variants_share_x_fragments(monkeypatch):
    """--ft: each variant's MMA decode calls carry its feature tiles (U divided by them); auto takes 2 only
    for x tiles of 16+ rows and wide enough outputs (linear.decode_ft)."""
    from atlasc.codegen import linear

    for ft, tile in (("1", ""), ("2", ", 2"), ("4", ", 4")):
        _, _, mod = kernel_lab.generate(4096, 28672, 32, "table", "", ft)
        u = max(1, linear.MMA_DECODE_U[4] // int(ft))
        assert f"linear_mma_decode<__half, 2, 4, {u}, false{tile}>" in mod.source
    assert kernel_lab.split_variant("mma/u2/ft4") == ("mma", {"u": "2", "ft": "4"})
    assert kernel_lab.with_options(("mma",), "ft", "1,auto") == ("mma/ft1", "mma/ftauto")
    monkeypatch.delenv(linear.FT_ENV, raising=False)  # auto is the default
    cases = ((1, 28672), (2, 28672), (4, 28672), (2, 6144), (4, 6144), (2, 4096), (4, 4096), (4, 128256),
             (4, None))
    assert [linear.decode_ft(j, n) for j, n in cases] == [1, 2, 2, 1, 2, 1, 1, 2, 1]
    monkeypatch.setenv(linear.FT_ENV, "1")
    assert {linear.decode_ft(j, n) for j, n in cases} == {1}
    monkeypatch.setenv(linear.FT_ENV, "3")
    with pytest.raises(linear.CodegenError, match="ATLAS_LINEAR_FT"):
        linear.decode_ft(4, 28672)


def test_ks_variants_split_k_across_blocks(monkeypatch):
    """--ks / ATLAS_LINEAR_KSPLIT: a plain Linear's MMA decode calls carry KS with the scratch's partial sums and
    counters (counters at the scratch's start, partial sums past every kernel's counters), and the grid has KS
    blocks per 16 outputs; auto splits the narrow Llama projections (N / 16 blocks under KS_MIN_BLOCKS; at one
    row only those under KS_MIN_BLOCKS_M1) while each warp keeps two rounds of U steps, and leaves wide ones,
    x tiles of 9+ rows and shared feature tiles alone. One call serves a run even where M = 1 splits differently:
    its run-time split picks (two inlined copies cost 80-104 registers against 56)."""
    from atlasc.codegen import linear
    from atlasc.codegen.generate import COUNTER_BYTES

    monkeypatch.delenv(linear.KS_ENV, raising=False)  # auto is the default
    for ks, calls, blocks in (("1", [(8, "")], 128), ("2", [(8, ", 1, 2")], 256), ("4", [(8, ", 1, 4")], 512),
                              ("auto", [(8, ", 1, 4")], 512)):
        _, _, mod = kernel_lab.generate(8192, 2048, 8, "table", ks=ks)
        (launch,) = mod.launches["run"]
        split = ks != "1"
        assert launch.grid[0] == blocks and bool(mod.scratch_bytes) == split
        got = re.findall(r"M <= (\d+)\) atlas::linear_mma_decode<__half, 2, 1, 4, false(, 1, \d)?>\((.*?)\);",
                         mod.source)
        assert [(int(hi), tile) for hi, tile, _ in got] == calls
        assert all(("lin_ws, lin_cnt" in args) == bool(tile) for _, tile, args in got)
        if split:
            assert f"lin_cnt = reinterpret_cast<unsigned int*>(arena + {mod.scratch_offset}LL)" in mod.source
            assert f"lin_ws = reinterpret_cast<float*>(arena + {mod.scratch_offset + COUNTER_BYTES}LL)" in mod.source
            assert mod.scratch_bytes >= COUNTER_BYTES + 4 * blocks * 128
    _, _, mod = kernel_lab.generate(4096, 4096, 8, "table", ks="auto")  # 8B o: 1 at one row, 2 at 2-8, one call
    assert re.findall(r"linear_mma_decode<__half, 2, 1, 4, false, 1, 2>\(.*?lin_cnt, M == 1 \? 1 : 2\);",
                      mod.source)
    assert mod.launches["run"][0].grid[0] == 512
    assert kernel_lab.split_variant("table/ks4") == ("table", {"ks": "4"})
    shapes = {"1B down": (2048, 8192), "1B o": (2048, 2048), "1B qkv": (3072, 2048), "8B o": (4096, 4096),
              "8B down": (4096, 14336), "8B qkv": (6144, 4096), "8B gate_up": (28672, 4096)}
    assert {name: (linear.decode_ks(1, n, k, one_row=True), linear.decode_ks(1, n, k))
            for name, (n, k) in shapes.items()} == {
        "1B down": (4, 4), "1B o": (1, 1), "1B qkv": (1, 1), "8B o": (1, 2), "8B down": (1, 2), "8B qkv": (1, 1),
        "8B gate_up": (1, 1)}
    assert linear.decode_ks(1, 2048, 8192, one_row=True, alone=True) == 2  # a kernel for one row only
    assert linear.run_ks(0, 1, 1, 2048, 8192) == (2, 2) and linear.run_ks(0, 8, 1, 2048, 8192) == (4, 4)
    assert linear.decode_ks(2, 2048, 8192) == linear.decode_ks(1, 2048, None) == 1
    assert linear.run_ks(0, 8, 1, 4096, 4096) == (1, 2) and linear.run_ks(0, 1, 1, 4096, 4096) == (1, 1)
    assert linear.run_ks(1, 8, 1, 4096, 4096) == (2, 2) and linear.run_ks(0, 8, 1, 2048, 2048) == (1, 1)
    monkeypatch.setenv(linear.KS_ENV, "8")
    assert linear.decode_ks(4, 2048, 8192) == 8 and linear.decode_ks(4, 128256, 4096) == 1  # FT 2 there
    monkeypatch.setenv(linear.KS_ENV, "3")
    with pytest.raises(linear.CodegenError, match="ATLAS_LINEAR_KSPLIT"):
        linear.decode_ks(1, 2048, 8192)


def test_references():
    """b = 0 and g = 1: x / rms(x) feeds the projection; gated: silu(gate) * up of its halves."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 16)).astype(np.float16)
    w = rng.standard_normal((8, 16)).astype(np.float16)
    plain = kernel_lab.reference(x, w, "table")
    np.testing.assert_allclose(plain, x.astype(np.float32) @ w.astype(np.float32).T, rtol=1e-6)
    xf = x.astype(np.float32)
    normed = (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)).astype(np.float16).astype(np.float32)
    y = normed @ w.astype(np.float32).T
    np.testing.assert_allclose(kernel_lab.reference(x, w, "norm"), y, rtol=1e-6)
    gate, up = y[:, :4], y[:, 4:]
    np.testing.assert_allclose(kernel_lab.reference(x, w, "gated"), gate / (1 + np.exp(-gate)) * up, rtol=1e-5)


@pytest.mark.parametrize("argv", [["--variant", "norm", "--ms", "32"], ["--variant", "fast"]])
def test_bad_options_exit_2_before_the_device(argv, capsys):
    with pytest.raises(SystemExit) as e:
        kernel_lab.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_decode_grid_counts_only_the_paths_taken(monkeypatch):
    """A block per 16 * FT MMA features where MMA serves the bucket, a warp per GEMV feature group only for
    the buckets it does not; a batch-bucket kernel leaves out the buckets a tighter kernel serves (the
    default decode kernel of a --max-batch 32 artifact runs for batches above 8 only)."""
    from atlasc.codegen import linear
    from atlasc.codegen.generate import generate_module

    n, variants = 28672, linear.gemv_variants(32)
    runs = linear.decode_choice("float16", 4096, n, variants)
    assert linear.decode_grid(n, variants, runs, n) == n // 16  # GEMV (M = 1, 2 features per warp) and MMA
    monkeypatch.setenv(linear.FT_ENV, "2")
    assert linear.decode_grid(n, variants, runs, n) == n // 16  # M = 1 still takes the GEMV
    assert linear.decode_grid(n, variants, runs, n, m_lower=8) == n // 32
    assert linear.decode_grid(n, variants, runs, n, m_lower=8, paired=True) == n // 16
    g, plan, upper = kernel_lab.build(4096, n, 32)
    (launch,) = generate_module({"run": (g, plan)}, {"run": upper}, buckets={"run": ("m", (1, 8))}).launches["run"]
    assert launch.grid[0] == n // 32 and {v.upto: v.grid[0] for v in launch.variants} == {1: n // 16, 8: n // 32}


def test_floor_kernels_compile_and_the_labs_take_floor(capsys):
    """lab_floor.cu (the labs' --floor: a kernel that only streams n bytes, and an empty one) compiles for
    sm80 and sm90 with both entry points and no spills; both labs accept --floor."""
    import subprocess

    import lab_floor
    import quant_lab
    from atlasc.codegen.nvcc import NvccNotFoundError, flags, nvcc_path

    source = lab_floor.SOURCE.read_text()
    try:
        nvcc = nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    for arch in ("sm80", "sm90"):
        r = subprocess.run([nvcc, *flags(arch), "-Xptxas", "-v", "-cubin", "-o", "/dev/null", "-x", "cu",
                            str(lab_floor.SOURCE)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr
        assert "Function properties for lab_read" in r.stderr and "Function properties for lab_empty" in r.stderr
        assert "0 bytes spill stores" in r.stderr and not re.search(r"[1-9]\d* bytes spill stores", r.stderr)
    assert "__ldcs" in source and lab_floor.DATA_OFFSET % 16 == 0
    for lab in (kernel_lab, quant_lab):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            lab.main(["--help"])
        assert e.value.code == 0 and "--floor" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["norm", "gated"])
def test_quant_lab_fused_variants(kind):
    """quant_lab --variant norm / gated: one NormLinearQ launch (int4 g128, the table path's tensor-core call,
    gated: the SwiGLU epilogue) whose reference-interpreter output equals the lab's float32 reference within
    the lab's tolerance (b = 0, g = 1, fresh random x and weights)."""
    import quant_lab
    from atlasc.ir import interpret
    from atlasc.passes.quantize import dequantize_int4, quantize_int4

    k, n, m = 256, 64, 3
    g, plan, mod = quant_lab.generate(k, n, m, "int4", kind)
    (launch,) = mod.launches["run"]
    assert launch.op == "NormLinearQ" and "linear_quant_mma<" in mod.source
    assert ("epilogue" in g.nodes[0].attrs) == (kind == "gated")
    rng = np.random.default_rng()
    w = ((rng.random((n, k), dtype=np.float32) * 2 - 1) / np.sqrt(k)).astype(np.float16)
    x = (rng.random((m, k), dtype=np.float32) * 2 - 1).astype(np.float16)
    wq, scale = quantize_int4(w, quant_lab.GROUP)
    feed = {"x": x, "wq": wq, "scale": scale, "b": np.zeros((m, k), np.float16), "g": np.ones(k, np.float16)}
    got = interpret(g, feed, symbols={"m": m})["y"].astype(np.float32)
    want = kernel_lab.reference(x, dequantize_int4(wq, scale, quant_lab.GROUP), kind)
    assert got.shape == want.shape == (m, n // 2 if kind == "gated" else n)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quant_lab_copy_engine_variants(mode):
    """quant_lab --variant bulk / norm-bulk / gated-bulk: the one-row kernel on the copy-engine path of an sm90-only
    compile (linear_quant_bulk, its weight's tensor map for the lab to write into each arena copy; the fused kinds as
    NormLinearQ, gated with the paired epilogue); the plain table variant stays off it; a kernel the path declines
    (two rows) stops the lab with a message instead of timing another kernel; ptxas sees the sm_90a build."""
    import quant_lab

    from atlasc.codegen.nvcc import NvccNotFoundError

    k, n = 4096, 512
    for variant, op in (("bulk", f"LinearQ{mode[-1]}"), ("norm-bulk", "NormLinearQ"), ("gated-bulk", "NormLinearQ")):
        g, plan, mod = quant_lab.generate(k, n, 1, mode, variant)
        (launch,) = mod.launches["run"]
        assert launch.op == op and "atlas::linear_quant_bulk<" in mod.source and mod.tensor_maps
        assert ("epilogue" in g.nodes[0].attrs) == (variant == "gated-bulk")
    assert "linear_quant_bulk<" not in quant_lab.generate(k, n, 1, mode, "table")[2].source
    with pytest.raises(SystemExit, match="declined"):
        quant_lab.generate(k, n, 2, mode, "bulk")
    try:
        report = quant_lab.ptxas_report(quant_lab.generate(k, n, 1, mode, "bulk")[2].source, "sm90")
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    ((regs, st, ld),) = report.values()
    assert regs > 16 and st == ld == 0  # sm_90 (not 90a) compiles the copy-engine body away: a handful of registers
