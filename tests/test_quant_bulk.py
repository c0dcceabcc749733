"""The copy-engine int4 projection (codegen/quant_bulk.py, ATLAS_QUANT_BULK) on the CPU: where it is emitted
and where not, its tensor maps (uint8, no swizzle) in the module, the manifest and the driver call, its sm_90a build
without spills, its switches and its K split. Its numerics: tests/test_kernels_quant_bulk_gpu.py (GPU)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from test_codegen_matmul_attention import Builder, plan_for
from test_kernels_quant_bulk_gpu import (BITS, CALL, CASES, NORM_CASES, ROT_KV, build_bulk, build_bulk_norm,
                                         build_bulk_rotary, rotary_plan)
from test_linear_tma import assert_builds_without_spills

from atlasc.codegen import generate_module, quant_bulk
from atlasc.codegen.generate import CodegenError
from atlasc.codegen.nvcc import SM90A_MARKER


def _module(builder, archs=("sm90",)):
    graph = builder.done()
    return graph, generate_module({"run": (graph, plan_for(graph, builder.upper)[0])}, {"run": builder.upper}, None,
                                  archs=archs)


def _rotary_module(partial=False, const_g=False):
    """The GPU test's NormLinearRotary graph and its sm90 module (the cache views on their slots)."""
    from test_codegen_matmul_attention import kv_spec

    builder = build_bulk_rotary(partial, const_g)
    graph = builder.done()
    cache = np.zeros((ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"],
                      ROT_KV["head_dim"]), np.float16)
    plan, kv_offset = rotary_plan(graph, builder.upper, cache)
    return graph, generate_module({"run": (graph, plan)}, {"run": builder.upper}, kv_spec("float16", kv_offset, ROT_KV),
                                  archs=("sm90",))


def _one(k=4096, n=4096, m=1, dtype="float16", group=128, zero=False):
    b = Builder("one", {"m": (1, m)})
    x = b.input("x", dtype, ("m", k))
    wq = b.input("wq", "uint8", (n, k // 2))
    s = b.input("s", "float16", (n, k // group))
    z = b.input("z", "uint8", (n, k // group)) if zero else None
    b.node("LinearQ4", [x, wq, s, None, z] if zero else [x, wq, s], {"group_size": group})
    return b


def _fp8():
    b = Builder("fp8", {"m": (1, 1)})
    b.node("LinearF8", [b.input("x", "float16", ("m", 4096)), b.input("wq", "uint8", (4096, 4096)),
                        b.input("s", "float16", (4096,))])
    return b


def test_emitted_with_the_switch_for_sm90(monkeypatch):
    """Every node of the GPU test's graph (int4 and int8) takes the path: the call with its bits, the sm_90a marker,
    one uint8 tensor map per node over the rows' bytes (K/2 int4, K int8; boxes of 16 W rows x 64 bytes, W the
    configuration's warps), and the choice recorded."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    graph, mod = _module(build_bulk())
    assert mod.source.count(CALL) == len(graph.nodes) == len(CASES) * len(BITS) and SM90A_MARKER in mod.source
    assert re.findall(r"linear_quant_bulk<\d+, (\d+),", mod.source) == [str(b) for _ in CASES for b in BITS]
    maps = sorted(mod.tensor_maps, key=lambda t: t.slot)
    assert [(t.dtype, t.rows, t.cols, t.row_bytes, t.box_rows, t.box_cols) for t in maps] == \
        [("uint8", n, k * b // 8, k * b // 8, 16 * quant_bulk.CONFIG[0], 64) for k, n, _ in CASES for b in BITS]
    kernels = mod.choices["kernels"]
    assert mod.choices["quant_bulk"] == "1" and len(kernels) == len(graph.nodes)
    assert all(c["path"] == "bulk" and c["config"] == list(quant_bulk.CONFIG) for c in kernels.values())


def test_norm_kinds_emitted(monkeypatch):
    """NormLinearQ nodes (int4 and int8; plain, with the residual add and its sum, with SwiGLU) take the path with
    the norm source (QbNorm, ADD when b is given, the sum's pointer when the node has it) and, paired, the epilogue
    and boxes of 8 W rows (16 W plain); without the switch they keep quant.cu's / act_int8.cu's kernels."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    graph, mod = _module(build_bulk_norm())
    calls = re.findall(r"atlas::linear_quant_bulk<\d+, (\d), [^>]*>\([^;]*?atlas::QbNorm<(true|false)>\{xs, [^,]+, "
                       r"(s\.p|nullptr)\}[^;]*?(, lin_epi)?\);", mod.source)
    want = [(str(b), str(add).lower(), "s.p" if add else "nullptr", ", lin_epi" if glu else "")
            for _, add, glu, _ in NORM_CASES for b in BITS]
    assert calls == want and len(graph.nodes) == len(want)
    maps = sorted(mod.tensor_maps, key=lambda t: t.slot)
    assert [(t.rows, t.cols, t.box_rows) for t in maps] == \
        [(n, 4096 * b // 8, (8 if glu else 16) * quant_bulk.CONFIG[0]) for n, _, glu, _ in NORM_CASES for b in BITS]
    assert all(c["norm"] and c.get("paired", False) == bool(NORM_CASES[i // 2][2])
               for i, c in enumerate(mod.choices["kernels"].values()))
    monkeypatch.setenv(quant_bulk.BULK_ENV, "0")
    _, off = _module(build_bulk_norm())
    assert CALL not in off.source and not off.tensor_maps


def test_int8_activations_keep_their_kernels(monkeypatch):
    """A NormLinearQ that choose-decode-path gave int8 activations (act int8: the sm90 batch-1 default of gate/up and
    the LM head) keeps act_int8.cu's kernel with the switch on: the reference's arithmetic is int8 x."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    b = Builder("act8", {"m": (1, 1)})
    k, n = 4096, 1024
    ins = [b.input("a", "float16", ("m", k)), None, b.input("g", "float16", (k,)),
           b.input("wq", "uint8", (n, k // 2)), b.input("s", "float16", (n, k // 128))]
    b.node("NormLinearQ", ins, {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128, "act": "int8"})
    _, mod = _module(b)
    assert CALL not in mod.source and "atlas::linear_w4a8" in mod.source


def test_g_early_reaches_the_norm_sources(monkeypatch, tmp_path):
    """ATLAS_QUANT_BULK_G_EARLY=1: every norm source of the GPU test's NormLinearQ and NormLinearRotary graphs with g
    a constant is QbNorm<ADD, true> and its choice says so, the plain projections' kernels are unchanged, and both
    modules build for sm_90a without spills; off (the default), or with g a graph input (which an earlier kernel
    might write), no kernel takes the flag."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    _, default = _module(build_bulk_norm(const_g=True))
    assert "QbNorm<true, true>" not in default.source and "QbNorm<false, true>" not in default.source
    monkeypatch.setenv(quant_bulk.G_EARLY_ENV, "1")
    _, computed = _module(build_bulk_norm())
    assert ", true>{xs," not in computed.source
    assert not any("g_early" in c for c in computed.choices["kernels"].values())
    for graph, mod in (_module(build_bulk_norm(const_g=True)), _rotary_module(partial=True, const_g=True)):
        sources = re.findall(r"atlas::QbNorm<(true|false)(, true)?>\{", mod.source)
        assert len(sources) == len(graph.nodes) and all(early for _, early in sources)
        assert all(c.get("g_early") is True for c in mod.choices["kernels"].values())
        assert mod.choices["quant_bulk_g_early"] is True
        assert_builds_without_spills(mod, tmp_path)
    _, plain = _module(build_bulk())
    assert not any("g_early" in c for c in plain.choices["kernels"].values())


def test_norm_kinds_build_without_spills(monkeypatch, tmp_path):
    """nvcc builds the norm test module for sm_90a, with and without OFS, no kernel spilling."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    for ofs in ("0", "1"):
        monkeypatch.setenv("ATLAS_QUANT_OFS", ofs)
        _, mod = _module(build_bulk_norm())
        assert_builds_without_spills(mod, tmp_path)


def test_rotary_emitted(monkeypatch):
    """NormLinearRotary nodes (int4 with the residual add, int8 with a bias, int4 without rotary) take the path with the
    norm source and LinRotary as the paired epilogue, boxes of 8 W = 64 rows (one half of a 128-dim head); a 64-dim
    partial rotary needs tiles of 32 pairs, so its kernel takes 4 warps (boxes of 32 rows, a map of its own)."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    graph, mod = _rotary_module()
    calls = re.findall(r"atlas::linear_quant_bulk<\d+, (\d), [^>]*>\([^;]*?atlas::QbNorm<(true|false)>\{xs, [^,]+, "
                       r"(s\.p|nullptr)\}[^;]*?, lin_epi\);", mod.source)
    assert calls == [("4", "true", "s.p"), ("8", "false", "nullptr"), ("4", "true", "s.p")]
    assert "atlas::LinRotary<__half> lin_epi" in mod.source
    # one map per weight (layers 0 and 2 share the int4 one): rows of 2048 / 4096 bytes
    assert sorted((t.rows, t.cols, t.box_rows) for t in mod.tensor_maps) == [(1024, 2048, 64), (1024, 4096, 64)]
    assert all(c["rotary"] and c["paired"] and c["norm"] for c in mod.choices["kernels"].values())
    graph, mod = _rotary_module(partial=True)
    assert mod.source.count(CALL) == len(graph.nodes) == 4
    assert sorted(t.box_rows for t in mod.tensor_maps) == [32, 64, 64]
    assert [c["config"][0] for c in mod.choices["kernels"].values()] == [8, 8, 8, 4]
    monkeypatch.setenv(quant_bulk.BULK_ENV, "0")
    _, off = _rotary_module()
    assert CALL not in off.source and not off.tensor_maps


def test_rotary_tiles():
    """A tile of P pairs keeps both rows consecutive where P divides D / 2 and R / 2 (R 0: no rotary): checked against
    LinRotary's pair rows (linear.cu row_a / row_b) enumerated in numpy."""
    from types import SimpleNamespace

    def rows(d, r):  # LinRotary's rows of each pair within one head
        i = np.arange(d // 2)
        return np.where(i < r // 2, i, i + r // 2), np.where(i < r // 2, i + r // 2, i + d // 2)

    for d, r, p in [(128, 128, 64), (128, 128, 32), (128, 64, 32), (128, 64, 64), (64, 64, 64), (128, 0, 64),
                    (128, 96, 32), (96, 96, 16), (128, 128, 128)]:
        cos = None if r == 0 else SimpleNamespace(shape=(1, "seq", r))
        node = SimpleNamespace(attrs={"head_dim": d}, inputs=[None, None, None, cos])
        ra, rb = rows(d, r)
        ok = (d // 2) % p == 0 and all(np.all(np.diff(x[t:t + p]) == 1) for x in (ra, rb) for t in range(0, d // 2, p))
        assert quant_bulk.rotary_tiles_ok(node, p) == ok, (d, r, p)
    dynamic = SimpleNamespace(attrs={"head_dim": 128}, inputs=[None, None, None, SimpleNamespace(shape=(1, "s", "r"))])
    assert not quant_bulk.rotary_tiles_ok(dynamic, 64)


def test_rotary_builds_without_spills(monkeypatch, tmp_path):
    """nvcc builds the rotary test module (with the partial rotary node's 4-warp kernel) for sm_90a, no kernel
    spilling."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    assert_builds_without_spills(_rotary_module(partial=True)[1], tmp_path)


@pytest.mark.parametrize("case", ["off", "sm80", "sm80+sm90", "tma off", "two rows", "zero points", "group 64",
                                  "float32", "fp8", "x too long"])
def test_not_emitted_elsewhere(monkeypatch, case):
    """Off for these one-layer graphs by default (no table entry chooses it for them); with ATLAS_QUANT_BULK=1 on
    only for an sm90-only compile with the copy engine allowed, one row of float16 x, int4 with symmetric groups of
    128 or int8 (not FP8 codes), and a K run whose staged x fits beside 2 stages: otherwise quant.cu's kernel as
    before."""
    if case != "off":
        monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    if case == "tma off":
        monkeypatch.setenv("ATLAS_LINEAR_TMA", "0")
    if case == "x too long":  # one K run of 131072 halves of x: 256 KB
        monkeypatch.setenv(quant_bulk.KS_ENV, "1")
    archs = {"sm80": ("sm80",), "sm80+sm90": ("sm80", "sm90")}.get(case, ("sm90",))
    builder = {"two rows": lambda: _one(m=2), "zero points": lambda: _one(zero=True),
               "group 64": lambda: _one(group=64), "float32": lambda: _one(dtype="float32"),
               "fp8": _fp8, "x too long": lambda: _one(k=131072, n=256)}.get(case, _one)()
    _, mod = _module(builder, archs)
    assert CALL not in mod.source and "atlas::linear_quant" in mod.source and not mod.tensor_maps


def test_builds_without_spills(monkeypatch, tmp_path):
    """nvcc builds the GPU test's module for sm_90a, with and without the offset dequantization, no kernel spilling."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    for ofs in ("0", "1"):
        monkeypatch.setenv("ATLAS_QUANT_OFS", ofs)
        _, mod = _module(build_bulk())
        flags = re.findall(r"atlas::linear_quant_bulk<\d+, (\d), \d+, \d+, (?:true|false), (true|false), true, \d+, "
                           r"(?:true|false)>\(", mod.source)
        assert flags == [(str(b), "true" if ofs == "1" and b == 4 else "false") for _ in CASES for b in BITS]
        assert_builds_without_spills(mod, tmp_path)


@pytest.mark.parametrize("env, value", [(quant_bulk.BULK_ENV, "2"), (quant_bulk.CONFIG_ENV, "8-6"),
                                        (quant_bulk.CONFIG_ENV, "32-4-1"), (quant_bulk.CONFIG_ENV, "8-1-2"),
                                        (quant_bulk.CONFIG_ENV, "16-4-4"),
                                        (quant_bulk.KS_ENV, "3"), (quant_bulk.MIN_N_ENV, "-1"),
                                        (quant_bulk.MIN_N_ENV, "16k"), (quant_bulk.EARLY_ENV, "2"),
                                        (quant_bulk.INFLIGHT_ENV, "-1"), (quant_bulk.INFLIGHT_ENV, "two"),
                                        (quant_bulk.HOLD_ENV, "yes"), (quant_bulk.MIN_RUN_ENV, "0"),
                                        (quant_bulk.MIN_RUN_ENV, "two"), (quant_bulk.LOOP_ENV, "-1"),
                                        (quant_bulk.LOOP_ENV, "many"), (quant_bulk.G_EARLY_ENV, "2")])
def test_switches_are_checked(monkeypatch, env, value):
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    monkeypatch.setenv(env, value)
    with pytest.raises(CodegenError, match=env):
        _module(_one())


def _kernels(source: str) -> list[str]:
    """The generated kernels' texts, one per extern "C" wrapper."""
    return ["extern" + part for part in source.split('extern "C" __global__')[1:]]


@pytest.mark.parametrize("early", ["0", "1"])
def test_early_copies_wait_inside(monkeypatch, tmp_path, early):
    """ATLAS_QUANT_BULK_EARLY=1 (the default): every bulk kernel's wrapper leaves out its pdl_enter, the call takes
    EARLY true (the kernel's consumers wait, its producer's copies do not) and the choice says so; =0: the wrapper
    waits before the call, as in v44, and that form builds for sm_90a without spills too (test_builds_without_spills
    builds the default; the GPU test checks numerics)."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    if early == "0":
        monkeypatch.setenv(quant_bulk.EARLY_ENV, "0")
    graph, mod = _module(build_bulk())
    flag = "true" if early == "1" else "false"
    kernels = [k for k in _kernels(mod.source) if CALL in k]
    assert len(kernels) == len(graph.nodes)
    for kernel in kernels:
        assert re.search(rf"atlas::linear_quant_bulk<\d+, \d, \d+, \d+, (?:true|false), (?:true|false), {flag}, \d+, "
                         r"(?:true|false)>\(", kernel)
        waits = kernel.count("atlas::pdl_enter();")
        assert waits == (0 if early == "1" else 1)
        if early == "0":
            assert kernel.index("atlas::pdl_enter();") < kernel.index(CALL)
    assert mod.choices["quant_bulk_early"] is (early == "1")
    assert all(c["early"] is (early == "1") for c in mod.choices["kernels"].values())
    if early == "0":
        assert_builds_without_spills(mod, tmp_path)


@pytest.mark.parametrize("inflight, hold", [("2", "1"), ("1", "0"), ("11", "1"), ("0", "0")])
def test_inflight_and_hold_reach_the_kernels(monkeypatch, tmp_path, inflight, hold):
    """ATLAS_QUANT_BULK_INFLIGHT=D and ATLAS_QUANT_BULK_HOLD: every bulk call takes D (lowered to 0, no cap, where D is
    not below the call's stages: the default configuration has 11) and HOLD, the choices record both, and the
    module builds for sm_90a without spills."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    monkeypatch.setenv(quant_bulk.INFLIGHT_ENV, inflight)
    monkeypatch.setenv(quant_bulk.HOLD_ENV, hold)
    graph, mod = _module(build_bulk())
    calls = re.findall(r"atlas::linear_quant_bulk<\d+, \d, \d+, (\d+), (?:true|false), (?:true|false), "
                       r"(?:true|false), (\d+), (true|false)>\(", mod.source)
    flag = "true" if hold == "1" else "false"
    assert len(calls) == len(graph.nodes)
    assert all(d == (inflight if int(inflight) < int(stages) else "0") and h == flag for stages, d, h in calls)
    assert mod.choices["quant_bulk_inflight"] == int(inflight) and mod.choices["quant_bulk_hold"] is (hold == "1")
    assert all(c["hold"] is (hold == "1") for c in mod.choices["kernels"].values())
    if inflight == "2":
        assert_builds_without_spills(mod, tmp_path)


def test_min_n_leaves_narrow_weights(monkeypatch):
    """ATLAS_QUANT_BULK_MIN_N=N: only the GPU test's weights of at least N rows (4096 of 4096 / 256 / 40 / 1000) take
    the path, one map each; the rest keep quant.cu's kernel."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    monkeypatch.setenv(quant_bulk.MIN_N_ENV, "1000")
    graph, mod = _module(build_bulk())
    wide = [n for k, n, _ in CASES if n >= 1000]
    assert mod.source.count(CALL) == len(wide) * len(BITS) == len(mod.tensor_maps) < len(graph.nodes)
    assert sorted(t.rows for t in mod.tensor_maps) == sorted(n for n in wide for _ in BITS)
    assert mod.choices["quant_bulk_min_n"] == 1000 and "atlas::linear_quant_mma<" in mod.source


def test_k_split_rule(monkeypatch):
    """Up to the configuration's blocks per SM on an H200's 132 SMs, every run at least MIN_RUN stages (or
    ATLAS_QUANT_BULK_MIN_RUN's): at the default
    16-11-1 the 8B o and down (16 tiles of 256 rows; 32 and 112 stages) take 8 runs (128 blocks), a wide weight
    (gate/up's 112 tiles) none; at 8-6-2 (264 blocks) o and down (32 tiles of 128 rows) take 8 too; forced values
    hold, without empty runs."""
    assert quant_bulk.ks_split(16, 32) == 8 and quant_bulk.ks_split(16, 112) == 8
    assert quant_bulk.ks_split(112, 32) == 1 and quant_bulk.ks_split(1, 4) == 1 and quant_bulk.ks_split(2, 8) == 2
    monkeypatch.setenv(quant_bulk.CONFIG_ENV, "8-6-2")
    assert quant_bulk.ks_split(32, 32) == 8 and quant_bulk.ks_split(32, 112) == 8
    assert quant_bulk.ks_split(224, 32) == 1
    monkeypatch.setenv(quant_bulk.KS_ENV, "4")
    assert quant_bulk.ks_split(224, 32) == 4 and quant_bulk.ks_split(1, 2) == 2
    # ATLAS_QUANT_BULK_MIN_RUN: Llama-3.2-1B's o (8 tiles of 16 stages) takes 4 runs at the default 4 stages a run,
    # 8 at 2, 16 at 1; the grid bound still holds (the 8B o's 16 tiles stay at 8 runs)
    monkeypatch.delenv(quant_bulk.KS_ENV)
    monkeypatch.delenv(quant_bulk.CONFIG_ENV)
    assert quant_bulk.ks_split(8, 16) == 4
    for min_run, ks in (("2", 8), ("1", 16)):
        monkeypatch.setenv(quant_bulk.MIN_RUN_ENV, min_run)
        assert quant_bulk.ks_split(8, 16) == ks and quant_bulk.ks_split(16, 32) == 8
    monkeypatch.delenv(quant_bulk.MIN_RUN_ENV)
    monkeypatch.setenv(quant_bulk.CONFIG_ENV, "8-6-2")
    # plan: runs of ceil(steps / ks) stages, as many as that fills (16 forced over 20 stages: 10 runs of 2)
    monkeypatch.setenv(quant_bulk.KS_ENV, "16")
    assert quant_bulk.plan(4096, 20 * 128, 4) == (8, 6, 2, 32, 10, 2)


def test_loop_rule(monkeypatch):
    """ATLAS_QUANT_BULK_LOOP: auto gives a weight of more tiles than 132 x the configuration's blocks per SM and one K
    run that many blocks (the LM head's 501 tiles: 132 at 16-11-1, 264 at 8-6-2), else a block an item; N: at most N
    blocks; 0: never."""
    assert quant_bulk.loop_grid(501, 1) == 132 and quant_bulk.loop_grid(132, 1) == 0
    assert quant_bulk.loop_grid(501, 2) == 0 and quant_bulk.loop_grid(112, 1) == 0
    monkeypatch.setenv(quant_bulk.CONFIG_ENV, "8-6-2")
    assert quant_bulk.loop_grid(1002, 1) == 264
    monkeypatch.setenv(quant_bulk.LOOP_ENV, "3")
    assert quant_bulk.loop_grid(4, 1) == 3 and quant_bulk.loop_grid(3, 1) == 0 and quant_bulk.loop_grid(16, 4) == 0
    monkeypatch.setenv(quant_bulk.LOOP_ENV, "0")
    assert quant_bulk.loop_grid(1002, 1) == 0


@pytest.mark.parametrize("loop", ["auto", "3"])
def test_loop_reaches_the_launches(monkeypatch, tmp_path, loop):
    """A looping kernel launches loop_grid's blocks with one counter (its claims) and records the grid: the LM
    head's shape (K 2048 x N 128256, 501 tiles) at auto; at ATLAS_QUANT_BULK_LOOP=3 with the K split forced to one
    run, the GPU test's weights of more than 3 tiles (int4 and int8: N 4096 and 1000), whose module builds for
    sm_90a without spills; the rest keep their tiles x runs."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    monkeypatch.setenv(quant_bulk.LOOP_ENV, loop)
    if loop == "auto":
        _, mod = _module(_one(k=2048, n=128256))
        (launch,) = mod.launches["run"]
        (choice,) = mod.choices["kernels"].values()
        assert launch.grid == (132, 1, 1) and choice["loop"] == 132 and choice["ks"] == 1
        assert mod.choices["quant_bulk_loop"] == "auto"
        return
    monkeypatch.setenv(quant_bulk.KS_ENV, "1")
    graph, mod = _module(build_bulk())
    grids = [launch.grid[0] for launch in mod.launches["run"]]
    tiles = [-(-n // 256) for _, n, _ in CASES for _ in BITS]
    assert grids == [3 if t > 3 else t for t in tiles]
    loops = [c.get("loop", 0) for c in mod.choices["kernels"].values()]
    assert sorted(loops) == sorted(3 if t > 3 else 0 for t in tiles) and mod.choices["quant_bulk_loop"] == "3"
    assert_builds_without_spills(mod, tmp_path)


def test_bucket_variants_record_their_choices(monkeypatch):
    """A projection compiled for up to 4 rows with a batch-1 bucket: the default kernel is quant.cu's (no bulk
    choice), the batch-1 variant the copy engine's, and the module's kernel choices name the variant with its path,
    K split and loop (the LM head's shape: 501 tiles on 132 blocks)."""
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    builder = _one(k=2048, n=128256, m=4)
    graph = builder.done()
    mod = generate_module({"run": (graph, plan_for(graph, builder.upper)[0])}, {"run": builder.upper}, None,
                          buckets={"run": ("m", (1,))}, archs=("sm90",))
    (launch,) = mod.launches["run"]
    (variant,) = launch.variants
    choices = mod.choices["kernels"]
    assert variant.kernel != launch.kernel and choices.get(launch.kernel, {}).get("path") != "bulk"
    assert choices[variant.kernel]["path"] == "bulk" and choices[variant.kernel]["loop"] == 132
    assert variant.grid == (132, 1, 1)


def test_manifest_and_driver_take_uint8_maps(monkeypatch):
    """The manifest accepts a uint8 map whose box is 64 bytes wide and refuses one wider than 128 bytes or of
    another dtype; the runtime asks the driver for UINT8 without swizzle (float16 keeps the 128-byte swizzle)."""
    from atlasc.artifact import TensorMapSpec
    from atlasc.runtime import tensor_maps

    calls = []

    class Driver:
        @staticmethod
        def cuTensorMapEncodeTiled(*args):
            calls.append((args[1], args[9]))  # data type, swizzle
            return 0

    monkeypatch.setattr(tensor_maps, "_libcuda", lambda: Driver)
    spec = TensorMapSpec(0, 256, 4096, 2048, 2048, 128, 64, "uint8")
    tensor_maps.encode(1 << 20, spec)
    tensor_maps.encode(1 << 20, dataclasses.replace(spec, dtype="float16", cols=1024))
    assert calls == [(0, 0), (6, tensor_maps.SWIZZLE_128B)]
    assert quant_bulk.smem_bytes(8, 6, 8) == 6 * 128 * 64 + 8 * 260 + 128
    assert quant_bulk.smem_bytes(8, 6, 8, 8) == 6 * 128 * 64 + 8 * 132 + 128
    assert quant_bulk.smem_bytes(8, 6, 1, 4, 4096) == 6 * 128 * 64 + 272 + 2 * 4096 + 4 * 8 + 128  # 260 -> 272
    assert np.iinfo(np.int32).max >= quant_bulk.SMEM_LIMIT


@pytest.mark.parametrize("quant, path", [("int4", "w4a16-bulk"), ("int8", "w8a16-bulk")])
def test_the_decode_path_choice_reaches_codegen(monkeypatch, tmp_path, quant, path):
    """ATLAS_QUANT_BULK unset (auto): the hidden-128 Llama's batch-1 projections take the copy-engine kernels exactly
    when choose-decode-path gives them that path (ATLAS_INT4_PATH=w4a16-bulk / ATLAS_INT8_PATH=w8a16-bulk here, the
    table's "bulk rows 1" otherwise): 2 layers x (QKV + rotary, o, gate/up + SwiGLU, down) + the LM head, with float
    x; the other quantization's path and the repo's table (its int4 entry passed over: K 128 < its min k 4096)
    leave quant.cu's kernels."""
    import sys

    from atlasc.compiler import program_module
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline
    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import build_llama

    onnx_path = tmp_path / "llama-h128.onnx"
    build_llama.write(build_llama.LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
                      onnx_path, seed=3)
    monkeypatch.delenv(quant_bulk.BULK_ENV, raising=False)

    own, other = ("ATLAS_INT4_PATH", "ATLAS_INT8_PATH")[::1 if quant == "int4" else -1]

    def source(env: str, var: str = own) -> str:
        for name in (own, other):
            monkeypatch.delenv(name, raising=False)
        if env:
            monkeypatch.setenv(var, env)
        program = Program({"main": import_onnx(onnx_path)}, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64,
                                                                          quant=quant, group_size=128))
        program, _ = run_pipeline(program)
        return program_module(program, ("sm90",)).source

    assert source(path).count(CALL) == 9
    assert source("").count(CALL) == 0
    assert source("w8a16-bulk" if quant == "int4" else "w4a16-bulk", other).count(CALL) == 0
