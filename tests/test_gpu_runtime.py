"""End to end on the GPU (marker `gpu`): every fixture compiled for this GPU and run by the PyCUDA
runtime matches onnxruntime.

- decoder cases (empty past, left-padded decode step, chunk on a past) through prefill/decode with
  the past loaded into the device KV cache: logits and cache within the fixture tolerance;
- greedy generation, 32 steps, batch 1 and 4, prefill lengths 1 and 17: tokens equal onnxruntime's;
- CUDA graphs on and off give identical logits; the run allocates no device memory after load;
- encoders: the forward outputs.
Tolerances: fp32 atol 1e-4 / rtol 1e-3 (kernels accumulate in float32 in another order than numpy);
fp16 3e-2, as in test_fixtures.py.
"""

from __future__ import annotations

import functools
import json
import re
import shutil

import numpy as np
import pytest

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.generate import Sampling, generate

from conftest import FIXTURES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")]

MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
DECODERS = [f["name"] for f in MANIFEST if f["kind"] == "decoder"]
TOL = {"fp32": {"atol": 1e-4, "rtol": 1e-3}, "fp16": {"atol": 3e-2, "rtol": 3e-2}}


@functools.cache
def device():
    from atlasc.runtime.device import Device

    return Device()


@functools.cache
def artifact_path(name: str, folder: str) -> str:
    path = f"{folder}/{name}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path,
                  CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64))
    return path


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-artifacts"))


@functools.cache
def _model(name: str, folder: str, graphs: bool):
    from atlasc.runtime.gpu import GpuModel

    art = open_artifact(artifact_path(name, folder))
    return GpuModel(art, device=device(), cuda_graphs=graphs)


def entry_of(name):
    return next(f for f in MANIFEST if f["name"] == name)


def load_case(name, case):
    z = np.load(FIXTURES / f"{name}.{case}.npz")
    return ({k[3:]: z[k] for k in z.files if k.startswith("in.")},
            {k[4:]: z[k] for k in z.files if k.startswith("out.")})


@pytest.mark.parametrize("name,case", [(f["name"], c) for f in MANIFEST if f["kind"] == "decoder"
                                       for c in f["cases"]])
def test_decoder_cases(name, case, build_dir):
    model = _model(name, build_dir, True)
    m = model.manifest
    ins, want = load_case(name, case)
    past_len = ins["past_key_values.0.key"].shape[2]
    b, s = ins["input_ids"].shape
    cache = np.zeros_like(model.read_kv_cache())
    for layer in range(m.kv_cache.layers):
        cache[layer, 0, :b, :, :past_len] = ins[f"past_key_values.{layer}.key"]
        cache[layer, 1, :b, :, :past_len] = ins[f"past_key_values.{layer}.value"]
    model.write_kv_cache(cache)
    entry = "decode" if s == 1 else "prefill"
    feed = {i.name: ins[i.name] for i in m.entries[entry].inputs if i.name in ins} | Sampling().inputs(0)
    out = model.run(entry, feed, {m.report["roles"]["past"]: past_len})
    tol = TOL[entry_of(name)["dtype"]]
    np.testing.assert_allclose(out["logits"].astype(np.float64), want["logits"].astype(np.float64), **tol)
    cache = model.read_kv_cache()
    for layer in range(m.kv_cache.layers):
        for k, kind in enumerate(("key", "value")):
            np.testing.assert_allclose(cache[layer, k, :b, :, :past_len + s].astype(np.float64),
                                       want[f"present.{layer}.{kind}"].astype(np.float64), **tol)


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # different lengths in a batch exercise left padding; the longest has `length` tokens
    return [list(rng.integers(1, 200, size=max(1, length - 3 * i))) for i in range(batch)]


def stored_greedy(name: str, batch: int, length: int):
    """onnxruntime's greedy run (examples/greedy_refs.py; test_compile.py checks it against a live run)."""
    z = np.load(FIXTURES / f"{name}.greedy.npz")
    key = f"b{batch}_l{length}"
    prompts = [[int(t) for t in row if t >= 0] for row in z[f"{key}.prompts"]]
    return prompts, z[f"{key}.tokens"].tolist(), list(z[f"{key}.logits"])


def assert_same_greedy(got, want, want_logits, atol):
    """Tokens equal onnxruntime's, except that a sequence may take the other branch of a near-tie: where
    the reference's two best logits are within the tolerance (fp16 rounding can flip them), the rest of
    that sequence is not compared. Any other difference fails."""
    for i, (g, w) in enumerate(zip(got, want)):
        for t, (a, b) in enumerate(zip(g, w)):
            if a == b:
                continue
            top2 = np.sort(want_logits[t][i].astype(np.float64))[-2:]
            assert top2[1] - top2[0] <= 2 * atol, (i, t, a, b, top2)
            break


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("batch,length", [(1, 1), (1, 17), (4, 1), (4, 17)])
def test_greedy_32_steps_match_onnxruntime(name, batch, length, build_dir):
    prompts, want_tokens, want_logits = stored_greedy(name, batch, length)
    got = generate(_model(name, build_dir, True), prompts, 32, keep_logits=True)
    tol = TOL[entry_of(name)["dtype"]]
    assert_same_greedy(got.tokens, want_tokens, want_logits, tol["atol"])
    if got.tokens != want_tokens:
        return  # a near-tie changed the continuation: the later logits belong to different prefixes
    np.testing.assert_allclose(got.prefill_logits[:, -1].astype(np.float64), want_logits[0].astype(np.float64),
                               **tol)
    for step, logits in enumerate(got.step_logits):
        np.testing.assert_allclose(logits.astype(np.float64), want_logits[step + 1].astype(np.float64), **tol)


@pytest.mark.gpu_alone  # free memory is device-wide: a parallel test process allocating would fail it
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cuda_graphs_equal_eager_and_no_allocation_after_load(name, build_dir):
    prompts = _prompts(2, 9, seed=7)
    eager = _model(name, build_dir, False)
    graphed = _model(name, build_dir, True)
    a = generate(eager, prompts, 8, keep_logits=True)
    free_before = device().free_memory()[0]
    b = generate(graphed, prompts, 8, keep_logits=True)
    c = generate(graphed, prompts, 8, keep_logits=True)
    free_after = device().free_memory()[0]
    assert free_after == free_before
    assert a.tokens == b.tokens == c.tokens
    for x, y in zip(a.step_logits, b.step_logits):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", [f["name"] for f in MANIFEST if f["kind"] == "encoder"])
def test_encoder_forward(name, build_dir):
    ins, want = load_case(name, "forward")
    out = _model(name, build_dir, True).run("forward", ins)
    for k, w in want.items():
        np.testing.assert_allclose(out[k], w, **TOL["fp32"], err_msg=k)


def test_batch_bucket_kernels_agree(build_dir):
    """An artifact compiled for batch 16 runs batch 1 on split-decode's decode_small with its batch-1
    kernels, batch 5 on decode_small's defaults (fused: batch <= 8) and batch 12 on decode: the same
    prompt in every row gives batch 1's tokens and logits in every row (fp32 fixture, atol 1e-4)."""
    from atlasc.runtime.gpu import GpuModel
    from atlasc.runtime.launches import bucket_of

    path = f"{build_dir}/llama-b16.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=(device().arch,), max_batch=16, max_seq=64))
    model = GpuModel(open_artifact(path), device=device())
    prompt = _prompts(1, 9, seed=3)[0]
    one = generate(model, [prompt], 12, keep_logits=True)
    assert model.routed["decode"] == "decode_small"
    assert bucket_of(model.buckets["decode_small"], model.last_env["decode_small"]) == 1
    for batch, entry in ((5, "decode_small"), (12, "decode")):
        got = generate(model, [prompt] * batch, 12, keep_logits=True)
        assert model.routed["decode"] == entry
        assert bucket_of(model.buckets[entry], model.last_env[entry]) is None
        assert got.tokens == one.tokens * batch
        for a, b in zip(got.step_logits, one.step_logits):
            np.testing.assert_allclose(a, np.repeat(b, batch, axis=0), **TOL["fp32"])
    model.close()


def test_epilogue_projections_match_the_cpu_runtime(build_dir, monkeypatch):
    """float16 at batch 12 (--max-batch 16: the decode entry above decode_small) runs its QKV projection with the
    rotary and the cache append (LinearRotary) and its gate/up projection with SwiGLU (LinearGated) in one kernel
    each (fuse-linear-epilogue; on sm90 the copy-engine kernels, codegen/linear_tma.py, for all but the fixture's
    16-dim-head QKV); greedy tokens and logits as the reference runtime's on the same artifact, 12 steps."""
    monkeypatch.delenv("ATLAS_LINEAR_EPILOGUE", raising=False)
    path = f"{build_dir}/llama-fp16-b16-epilogue.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(archs=(device().arch,), max_batch=16,
                                                                     max_seq=64))
    source = open_artifact(path).source()
    # the decode kernels; on sm90 the gate/up projection takes its norm too (the copy-engine NormLinear's prologue)
    gated = "atlas::TMA_ADD_RMS, 0>(" if device().arch == "sm90" else "_LinearGated("
    assert "decode_0" in source and "_LinearRotary(" in source and gated in source
    decode_matches_the_cpu_runtime(path, batch=12, seed=17)


def decode_matches_the_cpu_runtime(path, batch: int, seed: int, steps: int = 12) -> None:
    """The float16 artifact at `path`, run on this GPU for `batch` prompts of 9 tokens and `steps` greedy steps through
    its `decode` entry (above decode_small), gives the CPU reference runtime's tokens and logits (fp16 tolerance)."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    prompts = _prompts(batch, 9, seed=seed)
    want = generate(CpuModel(open_artifact(path)), prompts, steps, keep_logits=True)
    model = GpuModel(open_artifact(path), device=device())
    got = generate(model, prompts, steps, keep_logits=True)
    assert model.routed["decode"] == "decode"
    model.close()
    logits = [want.prefill_logits[:, -1]] + list(want.step_logits)
    assert_same_greedy(got.tokens, want.tokens, logits, TOL["fp16"]["atol"])
    if got.tokens == want.tokens:
        for a, b in zip(got.step_logits, want.step_logits):
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), **TOL["fp16"])


@pytest.mark.parametrize("quant,env", [("int4", "ATLAS_INT4_PATH=w4a8"), ("int8", "ATLAS_INT8_PATH=w8a8"),
                                       ("int8", "ATLAS_INT8_PATH=w8a8-fused1")])
def test_int8_activations_match_the_cpu_runtime(quant, env, build_dir, monkeypatch):
    """W4A8 / W8A8 decode (act_int8.cu, fused with the norms, SwiGLU and the rotary epilogue) end to end:
    the GPU gives the reference runtime's greedy tokens and logits on the same artifact, at batch 3 and
    batch 1 (w8a8-fused1: int8 activations only in the batch-1 kernels of the fused gate/up and LM head)."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    name, value = env.split("=")
    monkeypatch.setenv(name, value)
    path = f"{build_dir}/llama-fp16-{quant}-{value}.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(
        archs=(device().arch,), max_batch=4, max_seq=64, quant=quant, group_size=32))
    model = GpuModel(open_artifact(path), device=device())
    for prompts in (_prompts(3, 9, seed=13), _prompts(1, 9, seed=19)):
        want = generate(CpuModel(open_artifact(path)), prompts, 12, keep_logits=True)
        got = generate(model, prompts, 12, keep_logits=True)
        tol = TOL[entry_of("llama-fp16")["dtype"]]
        steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
        assert_same_greedy(got.tokens, want.tokens, steps, tol["atol"])
    model.close()


@pytest.mark.parametrize("name,quant,group", [("llama-fp16", "int8", 128), ("llama-fp16", "int4", 32),
                                              ("llama", "int4", 16), ("llama-fp16", "int4z", 32),
                                              ("llama-fp16", "fp8", 128)])
def test_quantized_artifacts_match_the_cpu_runtime(name, quant, group, build_dir):
    """End to end with quantized weights: the GPU runs an int8 / int4 / fp8 artifact (int4z: int4 with
    zero points; tensor-core kernels where they apply: fp16, K a multiple of 64 / 128 with int4 groups of
    32 or more; the CUDA-core kernel elsewhere) and gives the reference runtime's greedy tokens and
    logits on the same artifact."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    if quant == "fp8" and int(device().arch[2:]) < 89:
        pytest.skip("fp8 needs sm89 or newer")
    path = f"{build_dir}/{name}-{quant}-g{group}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path, CompileOptions(
        archs=(device().arch,), max_batch=4, max_seq=64, quant=quant.rstrip("z"), group_size=group,
        zero_points=quant == "int4z"))
    prompts = _prompts(3, 9, seed=11)
    want = generate(CpuModel(open_artifact(path)), prompts, 12, keep_logits=True)
    model = GpuModel(open_artifact(path), device=device())
    got = generate(model, prompts, 12, keep_logits=True)
    model.close()
    tol = TOL[entry_of(name)["dtype"]]
    steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
    assert_same_greedy(got.tokens, want.tokens, steps, tol["atol"])
    if got.tokens == want.tokens:
        for a, b in zip(got.step_logits, want.step_logits):
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), **tol)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_without_fusion_matches_onnxruntime(name, build_dir):
    """Fusion off (`--no-fusion`: every fusion pass skipped, the unfused kernels): the same greedy tokens
    as onnxruntime for batch 4, prefill length 17, 32 steps."""
    from atlasc.runtime.gpu import GpuModel

    path = f"{build_dir}/{name}-nofusion.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path,
                  CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64, fusion=False))
    prompts, want_tokens, want_logits = stored_greedy(name, 4, 17)
    model = GpuModel(open_artifact(path), device=device())
    got = generate(model, prompts, 32, keep_logits=True)
    model.close()
    assert_same_greedy(got.tokens, want_tokens, want_logits, TOL[entry_of(name)["dtype"]]["atol"])


@pytest.mark.parametrize("pdl", ["", "0"], ids=["default", "plain"])
@pytest.mark.parametrize("name", ["llama", "llama-fp16", "gpt2"])
def test_programmatic_dependent_launch_keeps_the_tokens(name, pdl, build_dir, monkeypatch):
    """By default (sm90+) the captured graphs' kernel-to-kernel edges are programmatic (every kernel waits for
    its inputs in atlas::pdl_enter); ATLAS_PDL=0 keeps them plain. Greedy generation gives onnxruntime's
    tokens either way, through the pipelined loop (no per-step logits) and one step at a time."""
    from atlasc.runtime.gpu import GpuModel

    if int(device().arch[2:]) < 90:
        pytest.skip("programmatic dependent launch needs sm90")
    monkeypatch.setenv("ATLAS_PDL", pdl)
    model = GpuModel(open_artifact(artifact_path(name, build_dir)), device=device())
    assert model.pdl == (pdl != "0")
    prompts, want_tokens, want_logits = stored_greedy(name, 4, 17)
    got = generate(model, prompts, 32, keep_logits=True)
    piped = generate(model, prompts, 32)
    assert model.pdl == (pdl != "0"), model.pdl_error  # the driver took the programmatic edges
    assert model.graphs and all((g.programmatic > 0) == model.pdl for g in model.graphs.values())
    model.close()
    assert_same_greedy(got.tokens, want_tokens, want_logits, TOL[entry_of(name)["dtype"]]["atol"])
    assert piped.tokens == got.tokens


@pytest.mark.parametrize("capacity", ["default", "small", "eager"])
@pytest.mark.parametrize("name", ["llama", "llama-fp16", "gpt2"])
def test_mapped_staging_keeps_the_tokens(name, capacity, build_dir, monkeypatch):
    """ATLAS_MAPPED_STAGING=1 (default): a pipelined decode step's inputs come in and its tokens go out through the
    staging kernels of its graph (runtime/staging.py), not copies. Greedy tokens through the pipelined loop equal
    onnxruntime's and the one-step-at-a-time loop's, at batch 1 and 4. "small": a capacity that batch 1's attention
    mask outgrows after ~13 steps, so the generation switches to the copies midway, with the same tokens. "eager":
    without CUDA graphs (the staging kernels launched on the stream around the step's kernels)."""
    import atlasc.runtime.gpu as gpu

    monkeypatch.delenv("ATLAS_MAPPED_STAGING", raising=False)
    art = open_artifact(artifact_path(name, build_dir))
    entry = art.manifest.entries["decode"]
    mask = next((i for i in entry.inputs if i.name == "attention_mask"), None)
    if capacity == "small":
        if mask is None:
            pytest.skip("no attention mask input")
        monkeypatch.setattr(gpu, "MAX_BYTES", mask.offset - art.manifest.memory.dims_offset + 8 * 30)
    model = gpu.GpuModel(art, device=device(), cuda_graphs=capacity != "eager")
    assert model.staging is not None, model.staging_error
    for batch in (1, 4):
        prompts, want_tokens, want_logits = stored_greedy(name, batch, 17)
        stepped = generate(model, prompts, 32, keep_logits=True)
        before = model.mapped_calls
        piped = generate(model, prompts, 32)
        mapped = model.mapped_calls - before
        assert_same_greedy(piped.tokens, want_tokens, want_logits, TOL[entry_of(name)["dtype"]]["atol"])
        assert piped.tokens == stepped.tokens
        if batch == 1:  # 31 decode calls: all mapped, or the first ones (mask lengths 18 .. 30 fit)
            assert mapped == 31 if capacity != "small" else 0 < mapped < 31, mapped
    model.close()


def test_chunked_build_runs_on_the_gpu(build_dir, monkeypatch):
    """A chunked build (ATLAS_NVCC_CHUNK=8: one cubin part per 8 kernels, loaded as separate modules): the
    same greedy tokens as onnxruntime for batch 4, prefill length 17, 32 steps."""
    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv("ATLAS_NVCC_CHUNK", "8")
    path = f"{build_dir}/llama-chunked.atlas"
    compile_model(FIXTURES / "llama.onnx", path, CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64))
    art = open_artifact(path)
    assert len(art.cubins(device().arch)) > 4
    prompts, want_tokens, want_logits = stored_greedy("llama", 4, 17)
    model = GpuModel(art, device=device())
    got = generate(model, prompts, 32, keep_logits=True)
    model.close()
    assert_same_greedy(got.tokens, want_tokens, want_logits, TOL[entry_of("llama")["dtype"]]["atol"])


def _llama_h128(build_dir):
    """examples/build_llama.py's Llama of hidden size 128 (2 layers, 4 heads of 32, 2 KV heads, intermediate 256,
    vocab 512, float16, seed 3) in build_dir, written once; its path."""
    import sys
    from pathlib import Path

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import build_llama

    onnx_path = Path(build_dir) / "llama-h128.onnx"
    if not onnx_path.exists():
        build_llama.write(build_llama.LlamaShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256,
                                                 vocab=512), onnx_path, seed=3)
    return onnx_path


@pytest.mark.parametrize("path", ["w4a16", "w4a8", "w4a8-fused1"])
def test_int4_groups_of_128_match_the_cpu_runtime(path, build_dir, monkeypatch):
    """A Llama of hidden size 128 (examples/build_llama.py, 2 layers, float16), int4 in groups of 128: every
    projection's K is a multiple of 128, so decode runs the tensor-core int4 kernels with whole-group steps,
    and with ATLAS_INT4_PATH=w4a8 the tensor-core W4A8 kernel (act_int8.cu linear_w4a8_mma: the fused
    norms, SwiGLU and the rotary epilogue), which no fixture (hidden 64) reaches. The GPU gives the
    reference runtime's greedy tokens and logits on the same artifact, at batch 3 and batch 1 (w4a8-fused1:
    int8 activations only in the batch-1 kernels of the fused gate/up and LM head)."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    onnx_path = _llama_h128(build_dir)
    monkeypatch.setenv("ATLAS_INT4_PATH", path)
    art_path = f"{build_dir}/llama-h128-int4-{path}.atlas"
    compile_model(onnx_path, art_path, CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64,
                                                      quant="int4", group_size=128))
    source = open_artifact(art_path).source()
    assert ("linear_w4a8_mma<" in source) == (path != "w4a16")
    model = GpuModel(open_artifact(art_path), device=device())
    for prompts in (_prompts(3, 9, seed=17), _prompts(1, 9, seed=19)):
        want = generate(CpuModel(open_artifact(art_path)), prompts, 12, keep_logits=True)
        got = generate(model, prompts, 12, keep_logits=True)
        steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
        assert_same_greedy(got.tokens, want.tokens, steps, TOL["fp16"]["atol"])
    model.close()


@pytest.mark.parametrize("quant, graphs, cap, config", [("int4", True, 0, ""), ("int4", False, 5, ""),
                                                       ("int8", True, 0, ""), ("int4", True, 3, ""),
                                                       ("int4", True, 0, "2-11-1")])
def test_chained_projections_keep_the_tokens(quant, graphs, cap, config, build_dir, monkeypatch):
    """ATLAS_QUANT_BULK_CHAIN=1 (codegen/quant_chain.py) on the hidden-128 Llama compiled for one row with every
    quantized projection on the copy-engine path: each layer's o, gate/up + SwiGLU, down and the next layer's QKV with
    its rotary and cache append (2 of the block's 16 warps; or the LM head after the last layer) run as one chain
    kernel per layer, inside CUDA graphs with programmatic edges or launched one by one, on every SM or capped at 5 /
    3 blocks (co_resident_caps: as on a GPU of fewer SMs), and with 2 warps everywhere (ATLAS_QUANT_BULK_CONFIG).
    Greedy tokens and logits equal the reference runtime's on the same artifact, 12 steps (the grid barrier's words
    back at 0 each launch)."""
    import atlasc.runtime.gpu as gpu
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    if device().arch != "sm90":
        pytest.skip("the copy-engine projections are built for sm_90a")
    monkeypatch.delenv("ATLAS_PDL", raising=False)
    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_CHAIN", "1")
    monkeypatch.setenv("ATLAS_INT4_PATH", "w4a16")
    monkeypatch.setenv("ATLAS_INT8_PATH", "w8a16")
    if config:
        monkeypatch.setenv("ATLAS_QUANT_BULK_CONFIG", config)
    art_path = f"{build_dir}/llama-h128-{quant}-chain{config}.atlas"
    compile_model(_llama_h128(build_dir), art_path, CompileOptions(archs=("sm90",), max_batch=1, max_seq=64,
                                                                   quant=quant, group_size=128))
    art = open_artifact(art_path)
    chains = [c["chain"] for c in art.manifest.report["codegen"]["kernels"].values() if c.get("chain")]
    assert sorted(map(len, chains)) == [4, 4]  # o, gate/up, down and the next QKV + rotary, or the LM head
    if cap:
        caps = gpu.co_resident_caps
        monkeypatch.setattr(gpu, "co_resident_caps", lambda m, sms: {k: cap for k in caps(m, sms)})
    model = GpuModel(art, device=device(), cuda_graphs=graphs)
    assert len(model.kernels.grid_cap) == 2
    prompts = _prompts(1, 9, seed=29)
    want = generate(CpuModel(open_artifact(art_path)), prompts, 12, keep_logits=True)
    got = generate(model, prompts, 12, keep_logits=True)
    if graphs:
        assert model.pdl and all(g.programmatic > 0 for g in model.graphs.values()), model.pdl_error
    model.close()
    steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
    assert_same_greedy(got.tokens, want.tokens, steps, TOL["fp16"]["atol"])


@pytest.mark.parametrize("quant, early, loop", [("int4", "1", "auto"), ("int4", "0", "auto"), ("int8", "1", "auto"),
                                               ("int4", "1", "1")])
def test_copy_engine_projections_keep_the_tokens(quant, early, loop, build_dir, monkeypatch):
    """ATLAS_QUANT_BULK=1 (codegen/quant_bulk.py) on the hidden-128 Llama with float x everywhere (w4a16 / w8a16): the
    batch-1 decode step's quantized projections (QKV + rotary and cache append, o, gate/up + SwiGLU, down, the LM
    head) run the copy-engine kernels inside CUDA graphs whose edges are programmatic, with the weight copies issued
    before the wait for the previous kernel (ATLAS_QUANT_BULK_EARLY=1, the default) or after it (0), and with
    ATLAS_QUANT_BULK_LOOP=1 (the kernels of more than one tile, QKV + rotary, gate/up and the LM head, on one block
    that claims the rest after the previous grid, step after step). Greedy tokens and logits equal the reference
    runtime's on the same artifact at batch 1 (the path serves one row)."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    if device().arch != "sm90":
        pytest.skip("the copy-engine projections are built for sm_90a")
    monkeypatch.delenv("ATLAS_PDL", raising=False)  # the default: programmatic edges on sm90
    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_EARLY", early)
    monkeypatch.setenv("ATLAS_QUANT_BULK_LOOP", loop)
    monkeypatch.setenv("ATLAS_INT4_PATH", "w4a16")
    monkeypatch.setenv("ATLAS_INT8_PATH", "w8a16")
    art_path = f"{build_dir}/llama-h128-{quant}-bulk{early}-loop{loop}.atlas"
    compile_model(_llama_h128(build_dir), art_path, CompileOptions(archs=("sm90",), max_batch=4, max_seq=64,
                                                                   quant=quant, group_size=128))
    art = open_artifact(art_path)
    flag = "true" if early == "1" else "false"
    calls = re.findall(r"atlas::linear_quant_bulk<\d+, \d, \d+, \d+, (?:true|false), (?:true|false), (\w+),",
                       art.source())
    assert calls == [flag] * 9  # 2 layers x (QKV + rotary, o, gate/up + SwiGLU, down) + the LM head
    loops = [c["loop"] for c in art.manifest.report["codegen"]["kernels"].values() if "loop" in c]
    # the batch-1 variants': 2 layers x (QKV + rotary, gate/up) + the LM head
    assert loops == ([1] * 5 if loop == "1" else [])
    model = GpuModel(art, device=device())
    prompts = _prompts(1, 9, seed=23)
    want = generate(CpuModel(open_artifact(art_path)), prompts, 12, keep_logits=True)
    got = generate(model, prompts, 12, keep_logits=True)
    assert model.pdl and model.graphs and all(g.programmatic > 0 for g in model.graphs.values()), model.pdl_error
    model.close()
    steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
    assert_same_greedy(got.tokens, want.tokens, steps, TOL["fp16"]["atol"])
