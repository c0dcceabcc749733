"""Dims early (codegen/generate.py DIMS_EARLY, on by default; ATLAS_DIMS_EARLY=0 turns it off): every generated
kernel reads the dims it uses (d[i], the symbol values of the run-time dims buffer) before its atlas::pdl_enter, into
a local array; off, the kernels read them through the buffer's pointer after the wait. On the GPU every decoder test
runs the default, and tests/test_gpu_opt_in_paths.py::test_greedy_with_dims_after_the_wait_matches_onnxruntime the
fallback."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import FIXTURES, arch_params

KERNEL = re.compile(r'extern "C" __global__ void[^\n]*\{\n(.*?)\n\}', re.S)


def _llama_source(tmp_path, monkeypatch, early: str) -> str:
    from atlasc.artifact import open_artifact
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    if early:
        monkeypatch.setenv("ATLAS_DIMS_EARLY", early)
    else:
        monkeypatch.delenv("ATLAS_DIMS_EARLY", raising=False)
    path = tmp_path / f"llama-{early or 'default'}.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(archs=("sm90",), max_batch=8, max_seq=64))
    with open_artifact(path) as art:
        assert art.manifest.report["codegen"]["dims_early"] is (early != "0")
        return art.source()


def test_dims_are_read_before_the_wait(tmp_path, monkeypatch, no_nvcc):
    """By default (and with ATLAS_DIMS_EARLY=1: the same source), each kernel loads exactly the dims it reads, each
    once, all before its first wait (the wrapper's pdl_enter, or the one inside the early-weights kernels' lin_pro,
    after their declarations), and nothing reads the buffer after it; with ATLAS_DIMS_EARLY=0 no kernel has the
    local array."""
    source = _llama_source(tmp_path, monkeypatch, "")
    assert _llama_source(tmp_path, monkeypatch, "1") == source
    bodies = KERNEL.findall(source)
    assert len(bodies) > 20
    for body in bodies:
        head, wait, rest = body.partition("atlas::pdl_enter();")
        assert wait and "long long d[" in head and "dims_buf" not in rest
        loaded = re.findall(r"  d\[(\d+)\] = dims_buf\[(\d+)\];", head)
        assert all(i == j for i, j in loaded) and len({i for i, _ in loaded}) == len(loaded)
        reads = re.sub(r"  (long long d\[\d+\] = \{\}|d\[\d+\] = dims_buf\[\d+\]);", "", body)
        assert set(re.findall(r"(?<![\w.>])d\[(\d+)\]", reads)) == {i for i, _ in loaded}
    default = _llama_source(tmp_path, monkeypatch, "0")
    assert "dims_buf" not in default and "const long long* __restrict__ d =" in default


def test_attention_rows_kernels_keep_the_dims_after_the_wait(tmp_path, monkeypatch, no_nvcc):
    """attention_rows kernels (ATLAS_ATTENTION_PATH=rows here) are emitted with dims_late: holding the dims from
    before the wait spilled one (fp32 on sm80); the other kernels of the module still read theirs early."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "rows")
    bodies = KERNEL.findall(_llama_source(tmp_path, monkeypatch, ""))
    rows = [body for body in bodies if "atlas::attention_rows<" in body]
    assert rows and all("dims_buf" not in body and "const long long* __restrict__ d =" in body for body in rows)
    assert sum("dims_buf" in body for body in bodies) == len(bodies) - len(rows)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm75"))
def test_dims_early_kernels_compile(arch, monkeypatch):
    """An 8B-shape fused int4 projection (NormLinearQ at 8 rows) with the switch compiles with the registers and
    spills it has without it; a value other than 0 / 1 is a CodegenError naming the switch."""
    import sys

    from atlasc.codegen.generate import CodegenError

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    from quant_lab import generate as lab_generate
    from quant_lab import ptxas_report

    reports = {}
    for early in ("0", "1"):
        monkeypatch.setenv("ATLAS_DIMS_EARLY", early)
        source = lab_generate(4096, 6144, 8, "int4", "norm")[2].source
        assert ("dims_buf" in source) is (early == "1")
        reports[early] = ptxas_report(source, arch)
    assert reports["1"] == reports["0"] and reports["0"]
    monkeypatch.setenv("ATLAS_DIMS_EARLY", "yes")
    with pytest.raises(CodegenError, match="ATLAS_DIMS_EARLY='yes'"):
        lab_generate(4096, 6144, 8, "int4", "norm")
