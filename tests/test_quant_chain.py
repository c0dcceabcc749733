"""Chains of copy-engine projections (codegen/quant_chain.py, ATLAS_QUANT_BULK_CHAIN) on the CPU: which launches chain
and which do not, the chain kernel's text (its phases in order, the ring, coherent sources, no block-wide barrier in
a phase), its sm_90a build without spills, the artifact's launches and records, the runtime's grid cap and the
profile's bytes. Numerics: tests/test_kernels_quant_bulk_gpu.py (test_chain_*) and tests/test_gpu_runtime.py (GPU)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from test_codegen_matmul_attention import plan_for
from test_kernels_quant_bulk_gpu import CALL, CHAIN_CALL, build_bulk, build_bulk_norm, build_chain

from atlasc.codegen import generate_module, quant_bulk, quant_chain
from atlasc.codegen.generate import CodegenError, KernelCode
from atlasc.codegen.nvcc import flags, nvcc_path

BULK = {"path": "bulk", "early": True, "config": [16, 11, 1]}


def _module(builder, steps=True, upper=None):
    graph = builder.done()
    upper = upper or builder.upper
    return graph, generate_module({"run": (graph, plan_for(graph, upper)[0])}, {"run": upper}, None,
                                  archs=("sm90",), decode_steps={"run": "m"} if steps else None)


@pytest.fixture
def chain_on(monkeypatch):
    monkeypatch.setenv(quant_bulk.BULK_ENV, "1")
    monkeypatch.setenv(quant_chain.CHAIN_ENV, "1")


def test_runs_rule():
    """Runs of at least two consecutive copy-engine launches with early copies, whatever their warps; anything else
    (another kernel, copies after the wait) ends a run. The block takes the most warps of a run's phases."""
    other = {"path": "bulk", "early": True, "config": [8, 11, 1]}
    late = {**BULK, "early": False}
    kernels = [("a", BULK), ("b", BULK), ("c", {"attention": "fast"}), ("d", BULK), ("e", other), ("f", other),
               ("g", BULK), ("h", None), ("i", BULK), ("j", late), ("k", BULK), ("l", BULK), ("m", BULK)]
    assert quant_chain.chain_runs(kernels) == [[0, 1], [3, 4, 5, 6], [10, 11, 12]]
    assert quant_chain.chain_runs([("a", BULK)]) == []
    codes = [KernelCode("", (1, 1, 1), smem=1000, choice=c) for c in (other, BULK, other)]
    assert quant_chain.block_warps(codes) == 16


def test_ring_stages():
    """The chain's ring: the phases' fewest stages, fewer where the largest phase's x area leaves no room, none where
    not even 2 stages fit; slots of the block's warps (a phase of 8 warps among 16-warp ones: its x area as its kernel
    had it, plus a float per extra warp for a norm source)."""
    stage = 16 * 16 * 64

    def code(stages, x_area, w=16, norm=False):
        choice = {**BULK, "config": [w, stages, 1], **({"norm": True} if norm else {})}
        return KernelCode("", (1, 1, 1), smem=stages * 16 * w * 64 + x_area, choice=choice)

    assert quant_chain.smem([code(11, 1000), code(11, 3000, w=8, norm=True)], 11) == 11 * stage + 3000 + 4 * 8
    assert quant_chain.smem([code(11, 1000), code(11, 3000, w=8)], 11) == 11 * stage + 3000

    assert quant_chain.ring_stages([code(11, 1000), code(9, 2000)], 227 * 1024) == 9
    assert quant_chain.ring_stages([code(11, 1000), code(11, 60000)], 227 * 1024) == (227 * 1024 - 60000) // stage
    assert quant_chain.ring_stages([code(11, 1000), code(11, 220000)], 227 * 1024) == 0
    assert quant_chain.smem([code(11, 1000), code(9, 2000)], 9) == 9 * stage + 2000
    assert quant_chain.barrier_index([KernelCode("", (1, 1, 1), counters=c) for c in (0, 33, 8)]) == 64


def test_layer_chains_into_one_launch(chain_on, tmp_path):
    """build_chain's layer as a decode step of one row: one launch of a chain kernel whose four phases are the four
    projections in order (the first waits for the previous kernel, the last holds), on 132 blocks of 16 + 1 warps
    with one block per SM, no launch for the other three; coherent sources (the phases read what earlier ones wrote),
    row offsets without a block-wide barrier; the launch co_resident; recorded with its nodes and phases; it builds
    for sm_90a without spills."""
    graph, mod = _module(build_chain(4))
    launches = mod.launches["run"]
    assert [launch.kernel for launch in launches[1:]] == ["", "", ""] and launches[0].kernel
    assert launches[0].grid == (quant_bulk.SMS, 1, 1) and launches[0].block == (16 * 32 + 32, 1, 1)
    phases = re.findall(r"atlas::qb_chain_phase<\d, \d, 16, 16, (\d+), \w+, \w+, \d, \w+, (\w+), (\w+)>", mod.source)
    assert [(first, last) for _, first, last in phases] == [("true", "false"), ("false", "false"),
                                                            ("false", "false"), ("false", "true")]
    assert len({stages for stages, _, _ in phases}) == 1 and CALL not in mod.source
    body = mod.source[mod.source.index(f"{launches[0].kernel}(unsigned char"):]
    body = body[:body.index("\n}\n")]
    assert body.count("atlas::QbPlain<2, true>{x}") == 2 and body.count("atlas::QbNorm<true, false, true>") == 2
    assert "atlas::qb_row0" in body and "lin_offsets" not in body and "__syncthreads" not in body
    (choice,) = mod.choices["kernels"].values()
    assert choice["chain"] == [n.name for n in graph.nodes] and launches[0].co_resident
    assert not any(launch.co_resident for launch in launches[1:])
    assert choice["path"] == "bulk-chain" and len(choice["phases"]) == 4
    assert all(p["path"] == "bulk" for p in choice["phases"]) and mod.choices["quant_bulk_chain"] is True
    # the ring and the largest x area of the four (o, gate/up with the norm, down, the LM head with the norm)
    runs = [(quant_bulk.plan(n, 2048, 4, gated, norm)[5], norm)
            for n, gated, norm in ((2048, False, 0), (4096, True, 2048), (2048, False, 0), (1000, False, 2048))]
    x_area = max(quant_bulk.smem_bytes(16, 0, run, 4, norm) for run, norm in runs)
    assert launches[0].smem == int(phases[0][0]) * 16 * 16 * 64 + x_area <= quant_bulk.SMEM_LIMIT
    _builds_without_spills(mod, tmp_path, kernels=1)


@pytest.mark.parametrize("build", ["plain", "norm", "int8"])
def test_other_graphs_chain_and_build(chain_on, tmp_path, build):
    """The single kernels' GPU test graphs (int4 and int8 in turn, K up to 14336, biases, partial tiles; the norm
    sources) and the int8 layer chain too, and build for sm_90a without spills."""
    builder = {"plain": build_bulk, "norm": lambda: build_bulk_norm(const_g=True), "int8": lambda: build_chain(8)}
    graph, mod = _module(builder[build]())
    assert [bool(launch.kernel) for launch in mod.launches["run"]] == [True] + [False] * (len(graph.nodes) - 1)
    assert mod.source.count(CHAIN_CALL) == len(graph.nodes)
    _builds_without_spills(mod, tmp_path, kernels=1)


def _rotary_chain_module():
    """The single kernels' rotary GPU test graph (three NormLinearRotary of 8 warps for 128-dim heads, a fourth of 4
    for a 64-dim rotary) compiled as a decode step of one row."""
    from test_codegen_matmul_attention import kv_spec
    from test_kernels_quant_bulk_gpu import ROT_KV, build_bulk_rotary, rotary_plan

    builder = build_bulk_rotary(partial=True)
    graph = builder.done()
    cache = np.zeros((ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"],
                      ROT_KV["head_dim"]), np.float16)
    plan, kv_offset = rotary_plan(graph, builder.upper, cache)
    return generate_module({"run": (graph, plan)}, {"run": builder.upper}, kv_spec("float16", kv_offset, ROT_KV),
                           archs=("sm90",), decode_steps={"run": "batch"})


def test_rotary_phases_chain_and_build(chain_on, tmp_path):
    """The rotary graph (_rotary_chain_module) as one chain: blocks of 8 warps, the partial-rotary phase on 4 of them;
    it builds for sm_90a without spills."""
    mod = _rotary_chain_module()
    assert [bool(launch.kernel) for launch in mod.launches["run"]] == [True, False, False, False]
    warps = re.findall(r"atlas::qb_chain_phase<3, \d, (\d+), (\d+), ", mod.source)
    assert warps == [("8", "8"), ("8", "8"), ("8", "8"), ("8", "4")]
    _builds_without_spills(mod, tmp_path, kernels=1)


def test_no_chain_without_the_switch_or_outside_a_one_row_step(monkeypatch, chain_on):
    """No chain: with ATLAS_QUANT_BULK_CHAIN unset (the default) or 0, outside a decode step, for a step of up to 4
    rows (its batch-1 kernels are bucket variants), or with the copies after the wait (ATLAS_QUANT_BULK_EARLY=0)."""
    def chained(mod):
        return any(c.get("chain") for c in mod.choices.get("kernels", {}).values())

    assert chained(_module(build_chain())[1])
    assert not chained(_module(build_chain(), steps=False)[1])
    monkeypatch.setenv(quant_bulk.EARLY_ENV, "0")
    assert not chained(_module(build_chain())[1])
    monkeypatch.delenv(quant_bulk.EARLY_ENV)
    builder = build_chain()
    graph = builder.done()
    upper = {"m": 4}
    mod = generate_module({"run": (graph, plan_for(graph, upper)[0])}, {"run": upper}, None, archs=("sm90",),
                          decode_steps={"run": "m"}, buckets={"run": ("m", (1,))})
    assert not chained(mod)
    for value in ("0", ""):
        monkeypatch.setenv(quant_chain.CHAIN_ENV, value)
        _, mod = _module(build_chain())
        assert not chained(mod) and mod.choices["quant_bulk_chain"] is False
    monkeypatch.setenv(quant_chain.CHAIN_ENV, "2")
    with pytest.raises(CodegenError, match=quant_chain.CHAIN_ENV):
        _module(build_chain())


def test_assemble_refuses_what_a_phase_cannot_be():
    """assemble refuses a phase whose bindings hold a block-wide barrier (the producer warp would not reach it in
    step with the consumers), one emitted as something else than a chain phase (e.g. quant.cu's kernel), and one
    with code outside its body; it takes phases that are none of these."""
    call = "  atlas::qb_chain_phase<1>(qb_ring);"
    good = KernelCode(call, (1, 1, 1), smem=1000, choice=BULK)
    bad = {"sync the whole block": KernelCode(call + "\n  __syncthreads();", (1, 1, 1), smem=1000, choice=BULK),
           "not emitted as one": KernelCode("  atlas::linear_quant_mma<1>();", (1, 1, 1), smem=1000, choice=BULK),
           "outside its body": KernelCode(call, (1, 1, 1), smem=1000, choice=BULK, prefetch="  prefetch();")}
    for message, phase in bad.items():
        with pytest.raises(CodegenError, match=message):
            quant_chain.assemble(["n0", "n1"], [good, phase], 2, "arena", 132, [BULK, BULK])
    code = quant_chain.assemble(["n0", "n1"], [good, good], 2, "arena", 132, [BULK, BULK])
    assert code.body.count(call) == 2 and code.grid == (132, 1, 1) and code.waits_inside


def test_llama_artifact_chains(monkeypatch, tmp_path):
    """A hidden-128 Llama (2 layers) compiled for one row with every int4 projection on the copy-engine path: the
    decode step's o, gate/up, down and the next layer's QKV + rotary (its 32-dim heads: 2 of the block's 16 warps),
    and the last layer's o, gate/up, down and LM head, run as two chains, 18 -> 12 launches; the chained nodes after
    each chain's first keep their manifest entries with no kernel; the prefill is unchanged; the manifest marks the
    chains co_resident and the runtime caps their grids at a GPU's SMs (co_resident_caps); with 2 consumer warps
    everywhere (ATLAS_QUANT_BULK_CONFIG=2-11-1) the chains are the same, on blocks of 2."""
    sys.path.insert(0, str(__import__("conftest").REPO / "tests"))
    from test_gpu_runtime import _llama_h128

    from atlasc.artifact import open_artifact
    from atlasc.compiler import CompileOptions, compile_model
    from atlasc.runtime.gpu import co_resident_caps

    monkeypatch.setenv("ATLAS_INT4_PATH", "w4a16-bulk")
    counts, arts = {}, {}
    for chain in ("0", "1"):
        monkeypatch.setenv(quant_chain.CHAIN_ENV, chain)
        path = tmp_path / f"h{chain}.atlas"
        compile_model(_llama_h128(tmp_path), path, CompileOptions(archs=("sm90",), max_batch=1, max_seq=64,
                                                                   quant="int4", group_size=128))
        arts[chain] = art = open_artifact(path)
        counts[chain] = {name: sum(1 for n in e.nodes if n.kernel) for name, e in art.manifest.entries.items()}
    assert counts["0"]["decode"] - counts["1"]["decode"] == 6 and counts["0"]["prefill"] == counts["1"]["prefill"]
    m = arts["1"].manifest
    kernels = m.report["codegen"]["kernels"]
    chains = {k: c["chain"] for k, c in kernels.items() if c.get("chain")}
    nodes = {n.name: n for n in m.entries["decode"].nodes}
    assert [[nodes[name].op for name in c] for c in chains.values()] == [
        ["LinearQ4", "NormLinearQ", "LinearQ4", "NormLinearRotary"], ["LinearQ4", "NormLinearQ", "LinearQ4",
                                                                      "NormLinearQ"]]
    for kernel, names in chains.items():
        assert nodes[names[0]].kernel == kernel and all(nodes[name].kernel == "" for name in names[1:])
    rotary_phase = r"atlas::qb_chain_phase<3, 4, 16, 2, \d+, false, false, \d, true, false, true>"  # 2 of 16 warps
    assert re.search(rotary_phase, arts["1"].source())
    assert co_resident_caps(m, 114) == {k: 114 for k in chains} and co_resident_caps(m, 0) == {}
    assert co_resident_caps(arts["0"].manifest, 114) == {}
    assert {n.kernel for n in m.entries["decode"].nodes if n.co_resident} == set(chains)
    monkeypatch.setenv(quant_bulk.CONFIG_ENV, "2-11-1")
    path = tmp_path / "h2.atlas"
    compile_model(_llama_h128(tmp_path), path, CompileOptions(archs=("sm90",), max_batch=1, max_seq=64,
                                                               quant="int4", group_size=128))
    m = open_artifact(path).manifest
    nodes = {n.name: n for n in m.entries["decode"].nodes}
    chains = [c["chain"] for c in m.report["codegen"]["kernels"].values() if c.get("chain")]
    assert [[nodes[name].op for name in c] for c in chains] == [
        ["LinearQ4", "NormLinearQ", "LinearQ4", "NormLinearRotary"], ["LinearQ4", "NormLinearQ", "LinearQ4",
                                                                      "NormLinearQ"]]


def test_kernel_table_caps_the_grid():
    """KernelTable.launch gives a kernel with a cap at most that many blocks, and the others their grid."""
    from atlasc.runtime.device import KernelTable

    calls = []

    class Func:
        def prepare(self, fmt):
            pass

        def prepared_async_call(self, grid, block, stream, *args, shared_size=0):
            calls.append(grid)

    table = KernelTable.__new__(KernelTable)
    table.device = type("D", (), {"stream": None, "cuda": type("C", (), {"Error": RuntimeError})})()
    table.funcs, table.static_smem = {"a": Func(), "b": Func()}, {"a": 0, "b": 0}
    table.dynamic_opt_in, table.formats = {}, {}
    table.grid_cap = {"a": 114}
    for name in ("a", "b"):
        table.launch(name, (132, 1, 1), (544, 1, 1), 0, 0)
        table.launch(name, (100, 1, 1), (544, 1, 1), 0, 0)
    assert calls == [(114, 1, 1), (100, 1, 1), (132, 1, 1), (100, 1, 1)]


def _builds_without_spills(mod, tmp_path, kernels: int) -> None:
    """nvcc builds the module for sm_90a, `kernels` entry functions, none spilling."""
    cu = tmp_path / "m.cu"
    cu.write_text(mod.source)
    proc = subprocess.run([nvcc_path(), *flags("sm90", mod.source), "-Xptxas=-v", str(cu), "-o",
                           str(tmp_path / "m.cubin")], capture_output=True, text=True)
    entries = proc.stderr.split("Compiling entry function '")[1:]
    assert proc.returncode == 0 and len(entries) == kernels, proc.stderr[-2000:]
    assert all(re.search(r"\b0 bytes spill stores", e) for e in entries), proc.stderr[-2000:]
