"""ATLAS_INT8_L2_HINT=1 (codegen/quant.py l2_hint, off by default): the int8 weight loads of the quantized Linear
kernels (quant.cu's tensor-core path, act_int8.cu's linear_w8a8) carry ld.global's L2::256B prefetch-size hint on
sm80+; the default source has no trace of it. The GPU numerics with the hint: tests/test_kernels_quant_gpu.py and
tests/test_kernels_act_int8_gpu.py (test_*_int8_l2_hint)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, arch_params

sys.path.insert(0, str(REPO / "examples"))


def _source(monkeypatch, hint: str, mode: str, variant: str = "table") -> str:
    from quant_lab import generate as lab_generate

    if hint:
        monkeypatch.setenv("ATLAS_INT8_L2_HINT", hint)
    else:
        monkeypatch.delenv("ATLAS_INT8_L2_HINT", raising=False)
    a8 = variant == "a8"
    return lab_generate(4096, 256, 1, mode, "table" if a8 else variant, act="int8" if a8 else "")[2].source


def _ptx(source: str, arch: str) -> str:
    from atlasc.codegen.nvcc import flags, nvcc_path

    with tempfile.TemporaryDirectory(prefix="atlasc-ptx-") as tmp:
        (Path(tmp) / "k.cu").write_text(source)
        cmd = [nvcc_path(), *(f for f in flags(arch, source) if f != "-cubin"), "-ptx", "k.cu", "-o", "k.ptx"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (Path(tmp) / "k.ptx").read_text()


def test_the_switch_defines_the_hint_in_the_prelude_only(monkeypatch, no_nvcc):
    """Off (unset or 0): the source is what it was (no define); on: one `#define ATLAS_INT8_L2 1` before the kernel
    library, and the codegen choices say so; any other value is a CodegenError naming the variable."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    default = _source(monkeypatch, "", "int8")
    assert "#define ATLAS_INT8_L2" not in default and _source(monkeypatch, "0", "int8") == default
    assert codegen_choices()["int8_l2_hint"] is False
    hinted = _source(monkeypatch, "1", "int8")
    assert hinted.count("#define ATLAS_INT8_L2 1") == 1 and hinted.index("#define ATLAS_INT8_L2") < hinted.index(
        "namespace atlas")
    assert hinted.replace("#define ATLAS_INT8_L2 1\n", "") == default
    assert codegen_choices()["int8_l2_hint"] is True
    monkeypatch.setenv("ATLAS_INT8_L2_HINT", "256")
    with pytest.raises(CodegenError, match="ATLAS_INT8_L2_HINT='256'"):
        _source(monkeypatch, "256", "int8")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_the_hint_reaches_the_int8_loads_only(arch, monkeypatch):
    """With the switch, the int8 kernels' PTX (the tensor-core path with float x, and W8A8 with int8 x) has
    L2::256B loads on sm80+ and none on sm75 (which has no such hint: the plain load); the int4 kernel's has none;
    without the switch no kernel has any."""
    hinted = arch != "sm75"
    for variant in ("table", "a8"):
        assert ("L2::256B" in _ptx(_source(monkeypatch, "1", "int8", variant), arch)) is hinted, variant
        assert "L2::256B" not in _ptx(_source(monkeypatch, "", "int8", variant), arch), variant
    assert "L2::256B" not in _ptx(_source(monkeypatch, "1", "int4"), arch)
