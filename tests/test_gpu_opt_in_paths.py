"""End to end on the GPU (marker `gpu`) for the opt-in kernel paths (those not on by default, and those that were
opt-in until these tests passed): mask-as-lengths (ATLAS_MASK_LENGTHS=1), the FlashAttention-2 prefill
(ATLAS_ATTENTION_PREFILL=fa2), early weights, early K / V (ATLAS_ATTENTION_EARLY_KV=1) and the scalar normalizations
(ATLAS_NORM_VEC=0, the default's fallback), the dims read after the wait (ATLAS_DIMS_EARLY=0, the fallback), every
decoder fixture's greedy tokens against onnxruntime's. A file of their own, so that examples/gpu_check.sh
(pytest-xdist, one worker per file) compiles their artifacts beside test_gpu_runtime.py's, not after them.
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.generate import generate

from conftest import FIXTURES
from test_gpu_runtime import DECODERS, TOL, assert_same_greedy, device, entry_of, stored_greedy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-opt-in-artifacts"))


def _greedy_matches_onnxruntime(model, name: str) -> None:
    """Greedy tokens and logits of `model` as onnxruntime's stored ones at batch 1 and 4 (left padding), prompt 17,
    32 steps (logits compared where the tokens agree); closes the model."""
    tol = TOL[entry_of(name)["dtype"]]
    for batch in (1, 4):
        prompts, want_tokens, want_logits = stored_greedy(name, batch, 17)
        got = generate(model, prompts, 32, keep_logits=True)
        assert_same_greedy(got.tokens, want_tokens, want_logits, tol["atol"])
        if got.tokens == want_tokens:
            for step, logits in enumerate(got.step_logits):
                np.testing.assert_allclose(logits.astype(np.float64), want_logits[step + 1].astype(np.float64), **tol)
    model.close()


def _compiled_with(name: str, env: str, value: str, tag: str, build_dir, monkeypatch, max_batch: int = 4):
    """(GpuModel, CUDA source) of the decoder fixture `name` compiled for this GPU with env=value set."""
    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv(env, value)
    path = f"{build_dir}/{name}-{tag}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path,
                  CompileOptions(archs=(device().arch,), max_batch=max_batch, max_seq=64))
    return GpuModel(open_artifact(path), device=device()), open_artifact(path).source()


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("batch,length", [(1, 17), (4, 17)])
def test_greedy_with_mask_lengths_matches_onnxruntime(name, batch, length, build_dir, monkeypatch):
    """ATLAS_MASK_LENGTHS=1 (mask-as-lengths, opt-in until this test passes on a GPU): the attention
    kernels read attention_mask and apply causal / window themselves (no mask subgraph kernels); greedy
    tokens and logits as onnxruntime's, batch 4 with left padding, 32 steps (mistral: past its window)."""
    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv("ATLAS_MASK_LENGTHS", "1")
    path = f"{build_dir}/{name}-masklengths.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path, CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64))
    model = GpuModel(open_artifact(path), device=device())
    applied = {p["name"]: p["applied"] for p in model.manifest.report["passes"]}["mask-as-lengths"]
    assert sum(applied.values()) == 2 * model.manifest.kv_cache.layers  # prefill and decode, every layer
    prompts, want_tokens, want_logits = stored_greedy(name, batch, length)
    got = generate(model, prompts, 32, keep_logits=True)
    model.close()
    tol = TOL[entry_of(name)["dtype"]]
    assert_same_greedy(got.tokens, want_tokens, want_logits, tol["atol"])
    if got.tokens == want_tokens:
        np.testing.assert_allclose(got.prefill_logits[:, -1].astype(np.float64), want_logits[0].astype(np.float64),
                                   **tol)
        for step, logits in enumerate(got.step_logits):
            np.testing.assert_allclose(logits.astype(np.float64), want_logits[step + 1].astype(np.float64), **tol)


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("mask_lengths", ["0", "1"], ids=["mask", "keys"])
def test_greedy_with_fa2_prefill_matches_onnxruntime(name, mask_lengths, build_dir, monkeypatch):
    """ATLAS_ATTENTION_PREFILL=fa2 (tensor-core prefill attention, opt-in until this test passes on a GPU):
    the fp16 decoders' prefill Attention nodes run attention_fa2 (the report says so; fp32 ones decline
    it and keep today's kernel), with the default pipeline's mask tensor and with mask-as-lengths (KEYS);
    greedy tokens as onnxruntime's, batch 4 with left padding, prefill length 17, 32 steps."""
    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv("ATLAS_ATTENTION_PREFILL", "fa2")
    monkeypatch.setenv("ATLAS_MASK_LENGTHS", mask_lengths)
    path = f"{build_dir}/{name}-fa2-{mask_lengths}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path, CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64))
    model = GpuModel(open_artifact(path), device=device())
    codegen = model.manifest.report["codegen"]
    assert codegen["attention_prefill"] == "fa2"
    fa2 = {k for k, c in codegen.get("kernels", {}).items() if c["attention"] == "fa2"}
    layers = model.manifest.kv_cache.layers
    if entry_of(name)["dtype"] == "fp16":  # every layer's prefill Attention launches an fa2 kernel
        launched = [n.kernel for e in model.manifest.entries.values() for n in e.nodes if n.kernel in fa2]
        assert len(launched) == layers and all(k.startswith("prefill_") for k in fa2), codegen.get("kernels")
    else:
        assert not fa2
    prompts, want_tokens, want_logits = stored_greedy(name, 4, 17)
    got = generate(model, prompts, 32, keep_logits=True)
    model.close()
    assert_same_greedy(got.tokens, want_tokens, want_logits, TOL[entry_of(name)["dtype"]]["atol"])


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("mode", ["1", "2"])
def test_greedy_with_early_weights_matches_onnxruntime(name, mode, build_dir, monkeypatch):
    """ATLAS_EARLY_WEIGHTS=1 / 2 (codegen/linear.py early_pro): the batch-1 decode projections load their first
    weights before they wait for the previous kernel (2: and let the next kernel launch early); greedy tokens and
    logits as onnxruntime's at batch 1 (the batch-1 kernels), 32 steps, CUDA graphs with programmatic edges."""
    from atlasc.runtime.gpu import GpuModel

    monkeypatch.setenv("ATLAS_EARLY_WEIGHTS", mode)
    path = f"{build_dir}/{name}-early{mode}.atlas"
    compile_model(FIXTURES / f"{name}.onnx", path, CompileOptions(archs=(device().arch,), max_batch=4, max_seq=64))
    model = GpuModel(open_artifact(path), device=device())
    assert model.manifest.report["codegen"]["early_weights"] == mode
    prompts, want_tokens, want_logits = stored_greedy(name, 1, 17)
    got = generate(model, prompts, 32, keep_logits=True)
    model.close()
    tol = TOL[entry_of(name)["dtype"]]
    assert_same_greedy(got.tokens, want_tokens, want_logits, tol["atol"])
    if got.tokens == want_tokens:
        for step, logits in enumerate(got.step_logits):
            np.testing.assert_allclose(logits.astype(np.float64), want_logits[step + 1].astype(np.float64), **tol)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_with_early_kv_matches_onnxruntime(name, build_dir, monkeypatch):
    """ATLAS_ATTENTION_EARLY_KV=1 (codegen/attention.py, opt-in until measured): every decode attention kernel asks
    L2 for its K / V rows before it waits for the QKV projection (a hint, reading the dims before the wait); greedy
    tokens and logits as onnxruntime's at batch 1 and batch 4 (left padding), 32 steps, CUDA graphs with
    programmatic edges."""
    model, source = _compiled_with(name, "ATLAS_ATTENTION_EARLY_KV", "1", "earlykv", build_dir, monkeypatch)
    assert model.manifest.report["codegen"]["attention_early_kv"] is True
    assert "atlas::attention_prefetch_kv<" in source
    _greedy_matches_onnxruntime(model, name)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_with_dims_after_the_wait_matches_onnxruntime(name, build_dir, monkeypatch):
    """ATLAS_DIMS_EARLY=0 (codegen/generate.py; the default 1, every kernel reading its dims before it waits for the
    previous one, is tested by every decoder test): the kernels read the dims through the buffer's pointer after
    the wait; greedy tokens and logits as onnxruntime's at batch 1 and batch 4 (left padding), 32 steps, CUDA graphs
    with programmatic edges."""
    model, source = _compiled_with(name, "ATLAS_DIMS_EARLY", "0", "dimslate", build_dir, monkeypatch)
    assert model.manifest.report["codegen"]["dims_early"] is False and "dims_buf" not in source
    _greedy_matches_onnxruntime(model, name)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_without_norm_vec_matches_onnxruntime(name, build_dir, monkeypatch):
    """ATLAS_NORM_VEC=0 (codegen/reduce.py; the default 1 is tested by every decoder test): the last-axis
    normalizations the compiled model keeps as kernels (prefill's and the unfused decode ones: max batch 16 leaves the
    batch-9-16 bucket's norms out of the projections) take norm_block alone; greedy tokens and logits as
    onnxruntime's at batch 1 and 4, 32 steps, CUDA graphs on."""
    model, source = _compiled_with(name, "ATLAS_NORM_VEC", "0", "normblock", build_dir, monkeypatch, max_batch=16)
    assert model.manifest.report["codegen"]["norm_vec"] is False
    assert "atlas::rd::norm_rows_vec<" not in source
    _greedy_matches_onnxruntime(model, name)


@pytest.mark.parametrize("quant,group", [("int8", 128), ("int4", 32), ("int4z", 32), ("fp8", 128)])
def test_quantized_early_weights_match_the_cpu_runtime(quant, group, build_dir, monkeypatch):
    """ATLAS_EARLY_QUANT=1 (opt-in, codegen/linear.py early_pro): the batch-1 quantized projections with float x
    load their first packed weights and scales before they wait (quant.cu linear_quant_mma's pro); at batch 1 the
    GPU gives the reference runtime's greedy tokens and logits on the same artifact (int4z: zero points)."""
    from atlasc.runtime.cpu import CpuModel
    from atlasc.runtime.gpu import GpuModel

    from test_gpu_runtime import _prompts

    if quant == "fp8" and int(device().arch[2:]) < 89:
        pytest.skip("fp8 needs sm89 or newer")
    monkeypatch.setenv("ATLAS_EARLY_QUANT", "1")
    path = f"{build_dir}/llama-fp16-{quant}-g{group}-early.atlas"
    compile_model(FIXTURES / "llama-fp16.onnx", path, CompileOptions(
        archs=(device().arch,), max_batch=4, max_seq=64, quant=quant.rstrip("z"), group_size=group,
        zero_points=quant == "int4z"))
    assert "linear_quant_mma<" in open_artifact(path).source() and "lin_pro);" in open_artifact(path).source()
    prompts = _prompts(1, 9, seed=23)
    want = generate(CpuModel(open_artifact(path)), prompts, 12, keep_logits=True)
    model = GpuModel(open_artifact(path), device=device())
    got = generate(model, prompts, 12, keep_logits=True)
    model.close()
    tol = TOL["fp16"]
    steps = [want.prefill_logits[:, -1]] + list(want.step_logits)
    assert_same_greedy(got.tokens, want.tokens, steps, tol["atol"])
    if got.tokens == want.tokens:
        for a, b in zip(got.step_logits, want.step_logits):
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), **tol)
