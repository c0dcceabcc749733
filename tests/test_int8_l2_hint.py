"""The int8 weight loads of the quantized Linear kernels (quant.cu's tensor-core path, act_int8.cu's linear_w8a8)
carry ld.global's L2::256B prefetch-size hint on sm80+ (codegen/quant.py l2_hint, on by default; docs/perf.md v42);
ATLAS_INT8_L2_HINT=0 defines ATLAS_INT8_L2_OFF in the prelude and keeps the plain loads. The GPU numerics: every
int8 GPU test runs the default, tests/test_kernels_{quant,act_int8}_gpu.py's test_*_int8_l2_hint the fallback."""

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


def test_the_fallback_is_a_define_in_the_prelude(monkeypatch, no_nvcc):
    """On (unset or 1, the same source): no define; 0: one `#define ATLAS_INT8_L2_OFF 1` before the kernel library,
    the rest of the source unchanged, and the codegen choices say so; any other value is a CodegenError naming the
    variable."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    default = _source(monkeypatch, "", "int8")
    assert "#define ATLAS_INT8_L2_OFF" not in default and _source(monkeypatch, "1", "int8") == default
    assert codegen_choices()["int8_l2_hint"] is True
    plain = _source(monkeypatch, "0", "int8")
    assert plain.count("#define ATLAS_INT8_L2_OFF 1") == 1
    assert plain.index("#define ATLAS_INT8_L2_OFF") < plain.index("namespace atlas")
    assert plain.replace("#define ATLAS_INT8_L2_OFF 1\n", "") == default
    assert codegen_choices()["int8_l2_hint"] is False
    monkeypatch.setenv("ATLAS_INT8_L2_HINT", "256")
    with pytest.raises(CodegenError, match="ATLAS_INT8_L2_HINT='256'"):
        _source(monkeypatch, "256", "int8")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_the_hint_reaches_the_int8_loads_only(arch, monkeypatch):
    """By default the int8 kernels' PTX (the tensor-core path with float x, and W8A8 with int8 x) has L2::256B loads
    on sm80+ and none on sm75 (which has no such hint: the plain load); the int4 kernel's has none; with
    ATLAS_INT8_L2_HINT=0 no kernel has any."""
    hinted = arch != "sm75"
    for variant in ("table", "a8"):
        assert ("L2::256B" in _ptx(_source(monkeypatch, "", "int8", variant), arch)) is hinted, variant
        assert "L2::256B" not in _ptx(_source(monkeypatch, "0", "int8", variant), arch), variant
    assert "L2::256B" not in _ptx(_source(monkeypatch, "", "int4"), arch)
