"""examples/w4_bulk_lab.py without a GPU: its kernels compile for sm_90a without spills, its float32 reference is
the compiler's int4 dequantization, and bad options fail before any device work."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import w4_bulk_lab  # noqa: E402


def test_reference_is_the_compilers_dequantization():
    """The lab's y = x @ dequant(wq)^T equals the one from atlasc's dequant_q4 (nibble layout, value + 8, group
    scales) and dequant_q8 (codes times the row's scale) on fresh random codes, scales and x, over more rows than
    one of its chunks."""
    from atlasc.ir.ops.quant import dequant_q4, dequant_q8

    rng = np.random.default_rng()
    n, k = 8192 + 40, 256
    wq = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // w4_bulk_lab.GROUP)).astype(np.float16)
    x = rng.standard_normal(k).astype(np.float16)
    want = dequant_q4(wq, scale, w4_bulk_lab.GROUP, None).astype(np.float32) @ x.astype(np.float32)
    np.testing.assert_allclose(w4_bulk_lab.reference(wq, scale, x), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # int8: codes times the row's scale (quant.cu's W8A16 layout)
    q8 = rng.integers(-127, 128, (n, k), dtype=np.int8)
    s8 = rng.uniform(0.01, 0.1, n).astype(np.float16)
    want8 = dequant_q8(q8, s8).astype(np.float32) @ x.astype(np.float32)
    np.testing.assert_allclose(w4_bulk_lab.reference(q8, s8, x), want8, rtol=1e-5, atol=1e-5 * np.abs(want8).max())


def test_kernels_compile_without_spills(capsys):
    """Every default configuration, int4 (plain and gated with and without the offset dequantization, copy) and
    int8 (plain, gated, copy), and the same kinds with --layout chunks in the compiler's 16-11-1: nvcc for sm_90a
    succeeds and ptxas reports no spill."""
    from atlasc.codegen.nvcc import NvccNotFoundError, nvcc_path

    try:
        nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert w4_bulk_lab.main(["--ptxas", "--variant", "plain,gated,copy", "--ofs", "0,1", "--quant", "int4,int8"]) == 0
    # --layout chunks (the producer's 1-D copies) in the configuration the compiler runs
    assert w4_bulk_lab.main(["--ptxas", "--variant", "plain,gated,copy", "--ofs", "0,1", "--quant", "int4,int8",
                             "--layout", "chunks", "--configs", "16-11-1"]) == 0
    out = capsys.readouterr().out
    entries = re.findall(r"Compiling entry function '(w4_bulk_\w+)'", out)
    # int4: plain / gated x OFS 0 / 1, copy; int8: three; from rows in every configuration, from chunks in one
    assert len(entries) == (5 + 3) * (len(w4_bulk_lab.CONFIGS) + 1)
    assert sum(name.endswith("_1") for name in entries) == 5 + 3  # the CHUNK kernels
    assert "spill" in out and not re.search(r"[1-9]\d* bytes spill", out)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_chunks_hold_each_stage_as_shared_memory_does(gated, dtype):
    """--layout chunks: chunk (tile, step) of chunked() is the stage the 2-D boxes would copy for it, byte for byte:
    the box's rows' 64 bytes of that step in row order (gated: the gate rows, then the up rows N/2 + ..), rows past
    the weight's end zero; on fresh random codes, int4 (uint8 [N, K/2]) and int8 ([N, K]), N not a multiple of a
    tile."""
    rng = np.random.default_rng()
    n, row_bytes, box = 2 * 200, 256, 64  # gated: 200 pairs, tiles of 64 pairs (the last one short)
    wq = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8).view(dtype)
    flat = w4_bulk_lab.chunked(wq, box, gated)
    codes, steps = wq.view(np.uint8), row_bytes // 64
    halves = (codes[:n // 2], codes[n // 2:]) if gated else (codes,)
    tiles = -(-halves[0].shape[0] // box)
    stage = len(halves) * box * 64
    assert flat.dtype == np.uint8 and flat.size == tiles * steps * stage
    for t in range(tiles):
        for s in range(steps):
            got = flat[(t * steps + s) * stage:(t * steps + s + 1) * stage].reshape(len(halves) * box, 64)
            want = np.zeros_like(got)
            for i, h in enumerate(halves):
                rows = h[t * box:(t + 1) * box, s * 64:(s + 1) * 64]
                want[i * box:i * box + rows.shape[0]] = rows
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("argv", [["--variant", "fused"], ["--layout", "tiles"], ["--ofs", "2"], ["--quant", "fp8"],
                                  ["--configs", "32-4-1"], ["--configs", "16-16-1"]])
def test_bad_options_exit_before_the_device(argv):
    with pytest.raises(SystemExit) as e:
        w4_bulk_lab.main(argv)
    assert e.value.code not in (0, None)
