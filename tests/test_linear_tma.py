"""The copy-engine + wgmma decode projection (codegen/linear_tma.py) on the CPU: where it is emitted and where not,
its tensor maps in the module and the artifact, its sm_90a build and its registers.

Its numerics are tests/test_kernels_linear_tma_gpu.py's (GPU): here, what the compiler decides and builds.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from test_codegen_matmul_attention import plan_for
from test_kernels_linear_tma_gpu import TMA_KV, build_gated, build_norm, build_plain, build_rotary

from atlasc.artifact import Manifest, open_artifact
from atlasc.codegen import generate_module, linear_tma
from atlasc.codegen.nvcc import SM90A_MARKER, compile_cubins, flags, nvcc_path
from atlasc.compiler import CompileOptions, compile_model

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "fixtures"
CALL = "atlas::linear_tma_decode<"


def _module(builder, archs=("sm90",), lower=None, kv=None):
    graph = builder.done()
    if kv is None:
        plan, spec = plan_for(graph, builder.upper, None)[0], None
    else:
        shape = (kv["layers"], 2, kv["max_batch"], kv["kv_heads"], kv["max_seq"], kv["head_dim"])
        plan, offset = plan_for(graph, builder.upper, np.zeros(shape, np.float16), kv=kv)
        spec = {**kv, "offset": offset, "dtype": "float16"}
    return graph, generate_module({"run": (graph, plan)}, {"run": builder.upper}, spec, archs=archs,
                                  lower={"run": lower} if lower else None)


def assert_builds_without_spills(mod, tmp_path) -> None:
    """nvcc builds the module for sm_90a (HGMMA needs it), every kernel without register spills."""
    cu = tmp_path / "m.cu"
    cu.write_text(mod.source)
    proc = subprocess.run([nvcc_path(), *flags("sm90", mod.source), "-Xptxas=-v", str(cu), "-o",
                           str(tmp_path / "m.cubin")], capture_output=True, text=True)
    entries = proc.stderr.split("Compiling entry function '")[1:]
    assert proc.returncode == 0 and len(entries) == len(mod.launches["run"]), proc.stderr[-2000:]
    assert all(re.search(r"\b0 bytes spill stores", e) for e in entries), proc.stderr[-2000:]


@pytest.fixture(scope="module")
def tma_artifact(tmp_path_factory):
    """llama-fp16 compiled for sm90 at max batch 16: its decode entry (batches 9..16) takes the path."""
    path = tmp_path_factory.mktemp("tma") / "l.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(archs=("sm90",), max_batch=16, max_seq=64))
    return path


@pytest.mark.parametrize("build, lower, kv", [(build_plain, {"m": 8}, None), (build_gated, {"m": 8}, None),
                                              (build_rotary, {"batch": 8, "seq": 1}, TMA_KV)])
def test_emitted_for_sm90_rows_above_8(build, lower, kv):
    graph, mod = _module(build(), lower=lower, kv=kv)
    assert mod.source.count(CALL) == len(graph.nodes)
    assert mod.source.count(SM90A_MARKER) >= len(graph.nodes)
    # one map per matrix read (weights and x: nodes reading the same one share it), every slot in its region
    start, size = mod.tensor_map_region
    read = {n.inputs[0].name for n in graph.nodes} | {[v for v in n.inputs[1:] if v is not None and
                                                       len(v.shape) == 2][0].name for n in graph.nodes}
    assert len({t.slot for t in mod.tensor_maps}) == len(mod.tensor_maps) == len(read)
    assert all(start <= t.slot and t.slot + 128 <= start + size for t in mod.tensor_maps)
    assert start + size <= mod.scratch_offset
    for launch in mod.launches["run"]:
        assert launch.block[0] in (160, 288) and launch.smem > 48 * 1024


@pytest.mark.parametrize("archs, lower, env", [(("sm80",), {"m": 8}, {}), (("sm80", "sm90"), {"m": 8}, {}),
                                               (("sm90",), None, {}), (("sm90",), {"m": 4}, {}),
                                               (("sm90",), {"m": 8}, {"ATLAS_LINEAR_TMA": "0"})])
def test_not_emitted_elsewhere(archs, lower, env, monkeypatch):
    """Other archs (or sm90 beside another: one launch geometry serves them all), kernels that may run at 8 rows
    or fewer, and ATLAS_LINEAR_TMA=0 keep linear.cu's paths and reserve no tensor maps."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, mod = _module(build_plain(), archs=archs, lower=lower)
    assert CALL not in mod.source and SM90A_MARKER not in mod.source and not mod.tensor_maps


def test_rotary_needs_whole_128_dim_heads():
    """LinearRotary with 64-dim heads (tests/test_kernels_linear_epilogue_gpu.py's) keeps the paired MMA decode."""
    from test_kernels_linear_epilogue_gpu import EPI_KV, build_linear_rotary

    _, mod = _module(build_linear_rotary("float16", 4096), lower={"batch": 8, "seq": 1}, kv=EPI_KV)
    assert CALL not in mod.source


def test_switch_is_checked(monkeypatch):
    monkeypatch.setenv("ATLAS_LINEAR_TMA", "yes")
    with pytest.raises(Exception, match="ATLAS_LINEAR_TMA='yes' is not 0 or 1"):
        linear_tma.tma_choice()


def test_k_split_rule(monkeypatch):
    """The measured rule (linear_tma.py): down (64 tiles, 224 steps) splits 4 ways, o (64 tiles, 64 steps) 2, the LM
    head (2004 tiles) not; ATLAS_LINEAR_TMA_KS_MIN_STEPS=48 (the lab's rule) keeps o whole; a bad value is an error."""
    from atlasc.codegen.generate import CodegenError

    assert linear_tma.ks_split(64, 224) == 4
    assert linear_tma.ks_split(64, 64) == 2
    assert linear_tma.ks_split(64, 32) == 1
    assert linear_tma.ks_split(2004, 64) == 1
    monkeypatch.setenv("ATLAS_LINEAR_TMA_KS_MIN_STEPS", "48")
    assert linear_tma.ks_split(64, 64) == 1 and linear_tma.ks_split(64, 224) == 4
    monkeypatch.setenv("ATLAS_LINEAR_TMA_KS_MIN_STEPS", "0")
    with pytest.raises(CodegenError, match="ATLAS_LINEAR_TMA_KS_MIN_STEPS='0' is not a positive integer"):
        linear_tma.ks_split(64, 64)


def test_sm90a_build_only_with_the_marker():
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags("sm90", f"x\n  {SM90A_MARKER}\n")
    assert "-gencode=arch=compute_90,code=sm_90" in flags("sm90", "x")
    assert "-gencode=arch=compute_80,code=sm_80" in flags("sm80", SM90A_MARKER)


def build_norm_rotary():
    return build_rotary(norm=True)


def test_norm_prologue_emitted():
    """NormLinear (plain and gated) and NormLinearRotary take the path with their norm in the kernel: TMA_ADD_RMS
    with the residual (b's own map, two x tiles a stage: the heads layout keeps 9 of its 10 stages to fit), TMA_RMS
    without; no K split (a block needs all of K for the row sums); every kernel within a block's shared memory."""
    graph, mod = _module(build_norm(), lower={"m": 8})
    assert mod.source.count(CALL) == len(graph.nodes) == 4
    assert mod.source.count("atlas::TMA_ADD_RMS, 0>(") == 2 and mod.source.count("atlas::TMA_RMS, 0>(") == 2
    assert len(mod.tensor_maps) == 4  # a, r (the residual), w in plain (64-row) and gated (128-row) boxes
    assert all(1 < linear_tma.SMEM_LIMIT - launch.smem for launch in mod.launches["run"])
    graph, mod = _module(build_norm_rotary(), lower={"batch": 8, "seq": 1}, kv=TMA_KV)
    assert "atlas::TMA_HEADS, 1, 2, 9, false, atlas::TMA_ADD_RMS, 0>(" in mod.source
    assert "atlas::TMA_HEADS, 1, 2, 10, true, atlas::TMA_RMS, 0>(" in mod.source
    assert linear_tma.fitted_stages(1, 2, 10, 2) == 9 and linear_tma.fitted_stages(2, 2, 3, 2) == 3
    assert linear_tma.smem_bytes(1, 2, 9, 2) <= linear_tma.SMEM_LIMIT < linear_tma.smem_bytes(1, 2, 10, 2)


@pytest.mark.parametrize("build, lower, kv", [(build_plain, {"m": 8}, None), (build_gated, {"m": 8}, None),
                                              (build_rotary, {"batch": 8, "seq": 1}, TMA_KV),
                                              (build_norm, {"m": 8}, None),
                                              (build_norm_rotary, {"batch": 8, "seq": 1}, TMA_KV)])
def test_ptxas_no_spills(build, lower, kv, tmp_path):
    """nvcc builds the kernels for sm_90a (HGMMA needs it) without register spills."""
    _, mod = _module(build(), lower=lower, kv=kv)
    assert_builds_without_spills(mod, tmp_path)
    assert compile_cubins(mod.source, ("sm90",))["sm90"]


def test_artifact_carries_the_maps(tma_artifact):
    """An sm90 compile at max batch 16 (a decode entry above decode_small): its maps lie in the arena, in the
    region "tensor_maps" before the scratch, survive the manifest's JSON round trip, and the report counts them."""
    art = open_artifact(tma_artifact)
    m = art.manifest
    maps = m.memory.tensor_maps
    region = m.memory.regions["tensor_maps"]
    assert maps and m.report["codegen"]["tensor_maps"] == len(maps)
    assert all(region.offset <= t.slot < region.offset + region.nbytes for t in maps)
    assert region.offset + region.nbytes <= m.memory.regions["scratch"].offset
    weights = {w.offset for w in m.weights}
    assert any(t.address in weights for t in maps)  # weight maps point at the weights
    assert Manifest.from_json(m.to_json()) == m
    assert CALL in art.source()


def test_configuration_overrides(monkeypatch):
    """ATLAS_LINEAR_TMA_GATED (and _PLAIN / _HEADS) pick a layout's NC-CH-S for A/B timing: used in the kernel and
    recorded; malformed or impossible ones are one-line errors."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    monkeypatch.setenv("ATLAS_LINEAR_TMA_GATED", "2-2-4")
    _, mod = _module(build_gated(), lower={"m": 8})
    assert "atlas::TMA_GATED, 2, 2, 4, " in mod.source
    assert codegen_choices()["linear_tma_config"]["gated"] == [2, 2, 4]
    for bad, why in (("2-1-4", "CH = 2"), ("x", "NC-CH-STAGES"), ("2-2-9", "bytes of stages"), ("5-2-2", "256")):
        monkeypatch.setenv("ATLAS_LINEAR_TMA_GATED", bad)
        with pytest.raises(CodegenError, match=why):
            linear_tma.config(linear_tma.GATED)
    monkeypatch.setenv("ATLAS_LINEAR_TMA_PLAIN", "2-2-4")  # BN 256: allowed
    assert linear_tma.config(linear_tma.PLAIN) == (2, 2, 4)


@pytest.fixture(scope="module")
def tma_manifest(tma_artifact):
    return open_artifact(tma_artifact).manifest


@pytest.mark.parametrize("field, value, why", [
    ("slot", 8, "64-byte aligned slot of the region tensor_maps"),
    ("slot", -64, "64-byte aligned slot"),
    ("address", 10 ** 15, "outside the arena"),
    ("address", 8, "16-byte aligned rows"),
    ("box_rows", 512, "at most 256 rows"),
    ("dtype", "float32", "float16 or uint8 matrix"),
    ("box_cols", 128, "boxes of at most 256 rows x 128 bytes"),  # 128 float16 = 256 bytes
])
def test_manifest_refuses_bad_tensor_maps(tma_manifest, field, value, why):
    """A corrupt manifest's tensor map (a slot off its region, a matrix off the arena, misaligned, an impossible box)
    is an ArtifactError naming the field, before the runtime would write 128 bytes anywhere."""
    from atlasc.errors import ArtifactError

    doc = tma_manifest.to_json()
    doc["memory"]["tensor_maps"][0][field] = value
    with pytest.raises(ArtifactError, match=rf"memory.tensor_maps\[0\]: .*{why}"):
        Manifest.from_json(doc)


def test_encode_without_the_driver_is_one_line(tma_manifest, monkeypatch):
    """No libcuda (or one without tensor maps): a TensorMapError with a hint, not a traceback from ctypes."""
    from atlasc.runtime import tensor_maps
    from atlasc.runtime.cudagraph import CudaGraphError

    def missing():
        raise CudaGraphError("cannot load libcuda")

    monkeypatch.setattr(tensor_maps, "_libcuda", missing)
    with pytest.raises(tensor_maps.TensorMapError, match="cuTensorMapEncodeTiled") as info:
        tensor_maps.encode(0, tma_manifest.memory.tensor_maps[0])
    assert "ATLAS_LINEAR_TMA=0" in info.value.hint


def test_failed_maps_free_the_arena(tma_artifact):
    """GpuModel (on the fake device) whose tensor maps cannot be encoded raises that error and frees its arena."""
    from fake_gpu import FakeDevice

    from atlasc.runtime.gpu import GpuModel
    from atlasc.runtime.tensor_maps import TensorMapError

    path = tma_artifact
    dev = FakeDevice()

    def refuse(base, spec):
        raise TensorMapError("refused")

    dev.encode_tensor_map = refuse
    with pytest.raises(TensorMapError, match="refused"):
        GpuModel(open_artifact(path), device=dev, cuda_graphs=False)
    assert dev.freed == 1


def test_norm_prologue_needs_the_folded_scale():
    """A NormLinear whose scale is not a constant of ones (an input, or a constant not folded into its weight)
    cannot take the copy-engine norm prologue; above 8 rows code generation then says so in one line
    (fuse-linear-prologue never makes it); with the scale all ones it does."""
    from test_codegen_matmul_attention import Builder

    from atlasc.codegen.generate import CodegenError
    from atlasc.ir.graph import constant

    for scale, ok in ((None, False), (2.0, False), (1.0, True)):
        b = Builder("unfolded", {"m": (1, 32)})
        a = b.input("a", "float16", ("m", 4096))
        g = b.input("g", "float16", (4096,)) if scale is None else constant("g", np.full(4096, scale, np.float16))
        b.node("NormLinear", [a, None, g, b.input("w", "float16", (256, 4096))], {"epsilon": 1e-5})
        if ok:
            assert CALL in _module(b, lower={"m": 8})[1].source
            continue
        with pytest.raises(CodegenError, match="stages at most 8 rows"):
            _module(b, lower={"m": 8})


def test_heads_k_split(monkeypatch, tmp_path):
    """ATLAS_LINEAR_TMA_HEADS_KS=2 (the default) splits a LinearRotary's K in two runs: twice the blocks of 1,
    partial sums in the scratch and one counter per tile, recorded in the report; its kernels build for sm_90a
    without spills; a norm prologue keeps K whole (it needs every k for the rows' sums); a bad value is a one-line
    error."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    monkeypatch.setenv("ATLAS_LINEAR_TMA_HEADS_KS", "1")
    _, one = _module(build_rotary(), lower={"batch": 8, "seq": 1}, kv=TMA_KV)
    monkeypatch.delenv("ATLAS_LINEAR_TMA_HEADS_KS")  # the default: 2
    _, two = _module(build_rotary(), lower={"batch": 8, "seq": 1}, kv=TMA_KV)
    assert [2 * launch.grid[0] for launch in one.launches["run"]] == [launch.grid[0] for launch in two.launches["run"]]
    assert ", 2LL, atlas::TmaNorm" in two.source and codegen_choices()["linear_tma_config"]["heads_ks"] == 2
    assert_builds_without_spills(two, tmp_path)
    _, normed = _module(build_norm_rotary(), lower={"batch": 8, "seq": 1}, kv=TMA_KV)
    assert ", 1LL, atlas::TmaNorm<__half>{arena" in normed.source
    monkeypatch.setenv("ATLAS_LINEAR_TMA_HEADS_KS", "3")
    with pytest.raises(CodegenError, match="ATLAS_LINEAR_TMA_HEADS_KS='3' is not 1, 2 or 4"):
        linear_tma.heads_ks()


def test_pipe_switch(monkeypatch, tmp_path):
    """ATLAS_LINEAR_TMA_PIPE=1 (a stage's wgmma group kept in flight) instantiates the kernels with PIPE 1, recorded
    in the report; the norm kernels build for sm_90a without spills; a bad value is a one-line error."""
    from atlasc.codegen.generate import CodegenError, codegen_choices

    assert ", atlas::TMA_ADD_RMS, 0>(" in _module(build_norm(), lower={"m": 8})[1].source
    monkeypatch.setenv("ATLAS_LINEAR_TMA_PIPE", "1")
    _, mod = _module(build_norm(), lower={"m": 8})
    assert ", atlas::TMA_ADD_RMS, 1>(" in mod.source and codegen_choices()["linear_tma_config"]["pipe"] == 1
    assert_builds_without_spills(mod, tmp_path)
    monkeypatch.setenv("ATLAS_LINEAR_TMA_PIPE", "2")
    with pytest.raises(CodegenError, match="ATLAS_LINEAR_TMA_PIPE='2' is not 0 or 1"):
        linear_tma.pipe()
