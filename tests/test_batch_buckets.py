"""Decode kernels specialized per batch bucket (codegen/generate.py `buckets`, runtime/launches.py).

A decode Linear compiled for batch 32 carries every code path up to 32 rows, and the largest sets its
registers for all: the batch-1 variant must hold only the batch-1 paths (fewer registers: ptxas shows
it), every node's variant must be chosen by the run's batch, and artifacts must round-trip them.
"""

from __future__ import annotations

import re
import shutil

import pytest

from atlasc.artifact import Manifest, open_artifact
from atlasc.compiler import DECODE_BATCH_BUCKETS, compile_model
from atlasc.errors import ArtifactError
from atlasc.ir.program import CompileOptions
from atlasc.runtime.launches import bucket_of, entry_buckets, node_launch

from conftest import FIXTURES, without_dims_loads

TMA_CONFIG = {"plain": [1, 1, 8], "gated": [2, 2, 3], "heads": [1, 2, 10], "heads_ks": 2, "pipe": 0,
              "ks_min_steps": 32}  # linear_tma.py CONFIG
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """The llama fixture compiled for sm90 at max batch 32 (buckets 1 and 8 below it), without
    split-decode (ATLAS_SPLIT_DECODE=0: else its decode_small serves batches <= 8, tests/test_split_decode.py)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    path = tmp_path_factory.mktemp("buckets") / "llama.atlas"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATLAS_SPLIT_DECODE", "0")
        compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=32, max_seq=64))
    return open_artifact(path)


def test_decode_linears_get_their_own_batch_kernels(llama32):
    m = llama32.manifest
    assert DECODE_BATCH_BUCKETS == (1, 8)
    decode = m.entries["decode"]
    assert entry_buckets(decode) == ("batch", (1, 8))
    assert all(not n.variants for n in m.entries["prefill"].nodes)
    source = llama32.read_member("kernels.cu").decode()
    linears = [n for n in decode.nodes if n.op == "Linear"]
    assert linears
    for n in linears:
        assert [v.upto for v in n.variants] == [1, 8]
        # (a layer's kernels may be the first layer's, shared: codegen/share.py; batch 1's never are)
        b1, b8 = (v.kernel for v in n.variants)
        assert b1.endswith("_batch1") and b8 == f"{n.kernel}_batch8"
        # GEMV row buckets (the template's 3rd argument): batch 1 holds only MT = 1
        assert set(re.findall(r"linear_gemv<\w+, \d+, (\d+),", _kernel_body(source, b1))) == {"1"}
        assert max(map(int, re.findall(r"linear_gemv<\w+, \d+, (\d+),", _kernel_body(source, n.kernel)))) == 32
        assert "M <= 32" not in _kernel_body(source, b8)
    # elementwise and norm kernels keep one kernel and only get smaller grids
    norms = [n for n in decode.nodes if n.op == "RMSNormalization"]
    assert norms and all(v.kernel == n.kernel and v.grid[0] <= n.grid[0] for n in norms for v in n.variants)


def _kernel_body(source: str, name: str) -> str:
    start = source.index(f" {name}(unsigned char*")
    return source[start:source.index("\n}\n", start)]


def test_runs_pick_the_tightest_variant(llama32):
    decode = llama32.manifest.entries["decode"]
    lin = next(n for n in decode.nodes if n.op == "Linear")
    buckets = entry_buckets(decode)
    for batch, want_bucket, want_kernel in ((1, 1, f"{lin.kernel}_batch1"), (2, 8, f"{lin.kernel}_batch8"),
                                            (8, 8, f"{lin.kernel}_batch8"), (9, None, lin.kernel),
                                            (32, None, lin.kernel)):
        env = {"batch": batch, "seq": 1, "past_seq": 3}
        assert bucket_of(buckets, env) == want_bucket
        kernel, grid, block, smem, _ = node_launch(lin, env)
        assert kernel == want_kernel
    assert node_launch(lin, {})[0] == lin.kernel  # no batch known: the default serves every size


def test_manifest_round_trips_and_checks_variants(llama32):
    m = llama32.manifest
    assert Manifest.from_json(m.to_json()) == m
    j = m.to_json()
    node = next(n for n in j["entries"]["decode"]["nodes"] if n["variants"])
    node["variants"] = node["variants"][::-1]
    with pytest.raises(ArtifactError, match="strictly increasing upto"):
        Manifest.from_json(j)
    node["variants"] = node["variants"][::-1]
    for n in j["entries"]["decode"]["nodes"]:
        if n["variants"]:
            n["symbol"] = "nope"
    with pytest.raises(ArtifactError, match="known symbol"):
        Manifest.from_json(j)


@needs_nvcc
def test_batch1_variant_uses_fewer_registers(llama32):
    """ptxas on the generated source (the artifact's sm90 cubins): the batch-1 Linear needs far fewer
    registers than the default (batch up to 32) kernel, which is what lets more blocks per SM keep bytes in
    flight."""
    from atlasc.codegen.cubin import kernel_registers

    regs = {}
    for part in llama32.cubins("sm90"):
        regs.update(kernel_registers(part))
    lin = next(n for n in llama32.manifest.entries["decode"].nodes if n.op == "Linear")
    assert regs[f"{lin.kernel}_batch1"] <= 72 < regs[lin.kernel]


@needs_nvcc
def test_grids_stop_at_stride_grid(tmp_path, no_nvcc):
    """At a large maximum (32 x 4352 tokens) the size-proportional grids stop at STRIDE_GRID blocks and
    loop over the rest, instead of 65535 blocks of which a short prefill leaves nearly all idle."""
    from atlasc.codegen.generate import MAX_GRID, STRIDE_GRID

    path = tmp_path / "big.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=("sm90",), max_batch=32, max_seq=4352))
    nodes = [n for e in open_artifact(path).manifest.entries.values() for n in e.nodes if n.kernel]
    assert max(n.grid[0] for n in nodes) <= STRIDE_GRID < MAX_GRID
    assert any(n.grid[0] == STRIDE_GRID for n in nodes)  # the cap binds at these maxima


def test_artifact_records_the_kernel_choices(llama32, monkeypatch):
    """The report names the kernel paths and batch buckets that built the artifact; an ATLAS_*
    override is recorded as such."""
    from atlasc.codegen.generate import codegen_choices

    c = dict(llama32.manifest.report["codegen"])
    kernels = c.pop("kernels")  # float32: every Attention keeps today's kernel, fa2's decline recorded
    assert kernels and all(k["attention"] == "fast" and k["fa2_declined"].startswith("float32")
                           for k in kernels.values())
    assert c == {"linear_path": "table", "linear_ft": "auto", "linear_ksplit": "auto",
                 "quant_path": "table",
                 "quant_ksplit": "auto", "quant_ofs": "auto", "quant_min_blocks": 0, "quant_staged_u": 0,
                 "prologue_act8_grid": 0, "attention_path": "fast",
                 "attention_max_split": 32, "attention_split_min_keys": 256, "attention_split_target": "auto",
                 "attention_v_prefetch": True,
                 "attention_early_kv": False, "norm_vec": True, "norm_loads_ahead": False,
                 "attention_mma": True, "attention_warps": "auto", "attention_warp_merge": True,
                 "pdl_wait": True, "pdl_trigger": "end", "early_weights": "2", "early_quant": False,
                 "sample_split": True, "weight_prefetch": False, "weight_prefetch_mb": 0,
                 "share_kernels": True, "dims_early": True, "int8_l2_hint": True, "linear_tma": True,
                 "linear_tma_config": TMA_CONFIG, "quant_bulk": "auto", "quant_bulk_config": [16, 11, 1],
                 "quant_bulk_ks": "auto", "quant_bulk_min_run": 4, "quant_bulk_min_n": 0, "quant_bulk_early": True,
                 "quant_bulk_inflight": 2,
                 "quant_bulk_hold": True, "quant_bulk_loop": "auto", "quant_bulk_g_early": False,
                 "quant_bulk_chain": False,
                 "attention_prefill": "fa2",
                 "attention_fa2": {"bc": 64, "min_rows": 16, "warps": "auto"},
                 "linear_prefill": "auto", "linear_gemm_tc": {"tile": [128, 128, 32], "stages": 3, "min_tiles": 96},
                 "batch_buckets": {"decode": ["batch", [1, 8]]}}
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "rows")
    monkeypatch.setenv("ATLAS_ATTENTION_SPLIT", "4")
    monkeypatch.setenv("ATLAS_QUANT_PATH", "simt")
    monkeypatch.setenv("ATLAS_PREFETCH", "1")
    monkeypatch.setenv("ATLAS_LINEAR_FT", "2")
    monkeypatch.setenv("ATLAS_ATTENTION_PREFILL", "off")
    monkeypatch.setenv("ATLAS_LINEAR_PREFILL", "mma")
    monkeypatch.setenv("ATLAS_ATTENTION_SPLIT_MIN_KEYS", "128")
    monkeypatch.setenv("ATLAS_ATTENTION_SPLIT_TARGET", "200")
    monkeypatch.setenv("ATLAS_ATTENTION_VPREFETCH", "0")
    monkeypatch.setenv("ATLAS_ATTENTION_WARPS", "4")
    monkeypatch.setenv("ATLAS_ATTENTION_MMA", "0")
    monkeypatch.setenv("ATLAS_ATTENTION_WARP_MERGE", "0")
    monkeypatch.setenv("ATLAS_LINEAR_KSPLIT", "2")
    monkeypatch.setenv("ATLAS_QUANT_KSPLIT", "4")
    monkeypatch.setenv("ATLAS_SHARE_KERNELS", "0")
    monkeypatch.setenv("ATLAS_EARLY_WEIGHTS", "1")
    monkeypatch.setenv("ATLAS_SAMPLE_SPLIT", "0")
    monkeypatch.setenv("ATLAS_EARLY_QUANT", "1")
    monkeypatch.setenv("ATLAS_QUANT_OFS", "1")
    monkeypatch.setenv("ATLAS_QUANT_MIN_BLOCKS", "4")
    monkeypatch.setenv("ATLAS_QUANT_STAGED_U", "2")
    monkeypatch.setenv("ATLAS_PROLOGUE_ACT8_GRID", "396")
    monkeypatch.setenv("ATLAS_ATTENTION_EARLY_KV", "1")
    monkeypatch.setenv("ATLAS_NORM_VEC", "0")
    monkeypatch.setenv("ATLAS_NORM_LOADS_AHEAD", "1")
    monkeypatch.setenv("ATLAS_LINEAR_TMA", "0")
    monkeypatch.setenv("ATLAS_DIMS_EARLY", "0")
    monkeypatch.setenv("ATLAS_INT8_L2_HINT", "0")
    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_CONFIG", "16-4-1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_KS", "2")
    monkeypatch.setenv("ATLAS_QUANT_BULK_MIN_N", "16384")
    monkeypatch.setenv("ATLAS_QUANT_BULK_MIN_RUN", "2")
    monkeypatch.setenv("ATLAS_QUANT_BULK_EARLY", "0")
    monkeypatch.setenv("ATLAS_QUANT_BULK_INFLIGHT", "3")
    monkeypatch.setenv("ATLAS_QUANT_BULK_HOLD", "0")
    monkeypatch.setenv("ATLAS_QUANT_BULK_LOOP", "0")
    monkeypatch.setenv("ATLAS_QUANT_BULK_G_EARLY", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_CHAIN", "1")
    assert codegen_choices() == {"linear_path": "table", "linear_ft": "2", "linear_ksplit": "2",
                                 "quant_path": "simt",
                                 "quant_ksplit": "4", "quant_ofs": "1", "quant_min_blocks": 4, "quant_staged_u": 2,
                                 "prologue_act8_grid": 396, "attention_path": "rows",
                                 "attention_max_split": 4,
                                 "attention_split_min_keys": 128, "attention_split_target": "200",
                                 "attention_v_prefetch": False,
                                 "attention_early_kv": True, "norm_vec": False, "norm_loads_ahead": True,
                                 "attention_mma": False, "attention_warps": "4", "attention_warp_merge": False,
                                 "pdl_wait": True,
                                 "pdl_trigger": "end", "early_weights": "1", "early_quant": True,
                                 "sample_split": False,
                                 "weight_prefetch": True,
                                 "weight_prefetch_mb": 16,
                                 "share_kernels": False, "dims_early": False, "int8_l2_hint": False,
                                 "linear_tma": False, "linear_tma_config": TMA_CONFIG,
                                 "quant_bulk": "1", "quant_bulk_config": [16, 4, 1], "quant_bulk_ks": "2",
                                 "quant_bulk_min_run": 2, "quant_bulk_min_n": 16384, "quant_bulk_early": False,
                                 "quant_bulk_inflight": 3, "quant_bulk_hold": False, "quant_bulk_loop": "0",
                                 "quant_bulk_g_early": True, "quant_bulk_chain": True,
                                 "attention_prefill": "off",
                                 "linear_prefill": "mma"}


def test_every_kernel_starts_with_the_pdl_wait(llama32):
    """Each kernel definition's first statement after its dims loads (the dims are written before a call's first
    kernel: codegen/generate.py DIMS_EARLY) is atlas::pdl_enter() (griddepcontrol.wait on sm90+), so a graph whose
    edges are programmatic (runtime/cudagraph.py make_programmatic) never reads an input early (ATLAS_PREFETCH=1
    puts weight prefetches before it: tests/test_weight_prefetch.py)."""
    lines = without_dims_loads(llama32.source() if callable(llama32.source) else llama32.source).splitlines()
    defs = [i for i, line in enumerate(lines) if line.startswith('extern "C" __global__') and line.endswith("{")]
    launched = {k.kernel for e in llama32.manifest.entries.values() for n in e.nodes if n.kernel
                for k in (n, *n.variants)}
    assert len(defs) == len(launched) > 20  # one definition per kernel the manifest launches
    # ... except the batch-1 projections (early weights, the default: tests/test_early_weights.py), which wait
    # inside their lin_pro, after their first weight loads
    early = [i for i in defs if "_batch1" in lines[i] and "Linear" in lines[i]]
    assert early and all(lines[i + 1] == "  atlas::pdl_enter();" for i in defs if i not in early)
    assert all(lines[i + 1] != "  atlas::pdl_enter();" and "atlas::pdl_enter();" in lines[lines.index(
        "  auto lin_pro_f = [&] {", i) + 1] for i in early)
    ends = [lines.index("}", i) for i in defs]  # the wrapper's closing brace: the first bare one after it
    assert all(lines[j - 1] == "  atlas::pdl_leave();" for j in ends)


@pytest.mark.parametrize("max_batch, split, want", [(1, "0", {}), (4, "0", {"decode": ("batch", (1,))}),
                                                    (8, "0", {"decode": ("batch", (1,))}),
                                                    (16, "0", {"decode": ("batch", (1, 8))}),
                                                    (32, "1", {"decode_small": ("batch", (1,))})])
def test_buckets_stop_below_the_max_batch(max_batch, split, want, monkeypatch):
    """Only buckets below the entry's batch bound are recorded (and reserve tensor-map slots): at --max-batch 1 the
    artifact said `specialized kernels: decode batch <= 1, 8` with no such kernel."""
    from atlasc.compiler import decode_buckets
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import Program
    from atlasc.pipeline import run_pipeline

    monkeypatch.setenv("ATLAS_SPLIT_DECODE", split)
    options = CompileOptions(archs=("sm90",), max_batch=max_batch, max_seq=64)
    program, _ = run_pipeline(Program({"main": import_onnx(FIXTURES / "llama.onnx")}, options))
    assert decode_buckets(program) == want
