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
    int8 (plain, gated, copy): nvcc for sm_90a succeeds and ptxas reports no spill."""
    from atlasc.codegen.nvcc import NvccNotFoundError, nvcc_path

    try:
        nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert w4_bulk_lab.main(["--ptxas", "--variant", "plain,gated,copy", "--ofs", "0,1", "--quant", "int4,int8"]) == 0
    out = capsys.readouterr().out
    entries = re.findall(r"Compiling entry function '(w4_bulk_\w+)'", out)
    assert len(entries) == (5 + 3) * len(w4_bulk_lab.CONFIGS)  # int4: plain / gated x OFS 0 / 1, copy; int8: three
    assert "spill" in out and not re.search(r"[1-9]\d* bytes spill", out)


@pytest.mark.parametrize("argv", [["--variant", "fused"], ["--ofs", "2"], ["--quant", "fp8"], ["--configs", "32-4-1"],
                                  ["--configs", "16-16-1"]])
def test_bad_options_exit_before_the_device(argv):
    with pytest.raises(SystemExit) as e:
        w4_bulk_lab.main(argv)
    assert e.value.code not in (0, None)
