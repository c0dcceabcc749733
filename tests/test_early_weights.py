"""Early weights (ATLAS_EARLY_WEIGHTS, codegen/linear.py early_pro, linear.cu LinPro): a batch-1 decode
projection kernel issues its first round of weight loads before it waits for the previous kernel, then waits
and stages x. What the generated code must hold: with 0 every kernel waits first; with 1 or 2 (the default) each batch-1
projection kernel calls atlas::pdl_enter only inside its lin_pro, after the preload, with every decode call
taking lin_pro; nothing before the wait reads a tensor an earlier kernel wrote; it compiles for sm80 and sm90.
The GPU side (the same greedy tokens as onnxruntime) is tests/test_gpu_opt_in_paths.py."""

from __future__ import annotations

import re
import shutil

import pytest

from atlasc.codegen.generate import CodegenError
from atlasc.codegen.linear import EARLY_ENV, early_mode
from atlasc.compiler import program_module
from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline

from conftest import FIXTURES, arch_params, without_dims_loads

PROJECTIONS = ("Linear", "NormLinear", "NormLinearRotary")
WRAPPER = re.compile(r'^extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(unsigned char\* __restrict__ '
                     r'arena[^)]*\) \{$', re.M)


def _module(mode: str, monkeypatch):
    """(program, module) of the llama-fp16 fixture for sm90 at max batch 4 (the decode step's batch-1 kernels
    beside its batch-4 ones) with ATLAS_EARLY_WEIGHTS=mode."""
    monkeypatch.setenv(EARLY_ENV, mode)
    program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")},
                      CompileOptions(archs=("sm90",), max_batch=4, max_seq=64))
    program, _ = run_pipeline(program)
    return program, program_module(program, ("sm90",))


def _kernels(source: str) -> dict[str, str]:
    """kernel name -> its wrapper's text (from its definition to the next one)."""
    starts = list(WRAPPER.finditer(source))
    return {m.group(1): source[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(source))]
            for i, m in enumerate(starts)}


def _decode_projection_kernels(program, module) -> tuple[set[str], set[str]]:
    """(the batch-1 kernels, the other kernels) of the decode step's projections."""
    one, other = set(), set()
    for node in program.entries["decode"].nodes:
        if node.op in PROJECTIONS:
            launch = next(x for x in module.launches["decode"] if x.node == node.name)
            for variant in launch.variants:
                (one if variant.upto == 1 else other).add(variant.kernel)
            other.add(launch.kernel)
    return one, other


def test_mode_values(monkeypatch):
    monkeypatch.delenv(EARLY_ENV, raising=False)
    assert early_mode() == "2"
    for mode in ("0", "1", "2"):
        monkeypatch.setenv(EARLY_ENV, mode)
        assert early_mode() == mode
    monkeypatch.setenv(EARLY_ENV, "yes")
    with pytest.raises(CodegenError, match="ATLAS_EARLY_WEIGHTS='yes'"):
        early_mode()

def test_off(monkeypatch):
    """ATLAS_EARLY_WEIGHTS=0: no kernel has a lin_pro (each waits first, as test_batch_buckets.py checks of every
    definition at the default for the kernels without one)."""
    _, module = _module("0", monkeypatch)
    assert module.choices["early_weights"] == "0"
    assert "LinPro<" not in "".join(module.kernels) and "pdl_leave();  // early" not in module.source


@pytest.mark.parametrize("mode", ["1", "2", ""])
def test_batch1_projections_load_weights_before_the_wait(mode, monkeypatch):
    program, module = _module(mode, monkeypatch)
    mode = mode or "2"  # the default
    assert module.choices["early_weights"] == mode
    kernels = _kernels(without_dims_loads(module.source))  # the dims loads before the wait: test_dims_early.py
    one, other = _decode_projection_kernels(program, module)
    assert len(one) == 4 * program.kv_cache.layers + 1  # QKV, o, gate/up, down per layer; the LM head
    for name in one:
        text = kernels[name]
        head, lam = text.split("auto lin_pro_f = [&] {", 1)
        assert "pdl_enter" not in head, name  # the only wait is the one in lin_pro
        inside = lam.split("};", 1)[0]
        assert inside.strip().startswith("atlas::pdl_enter();"), name
        # what precedes the wait reads no tensor: views and offsets only, the staging runs inside lin_pro
        assert "lin_norm_stage" not in head and "lin_stage(" not in head, name
        calls = re.findall(r"atlas::linear_(?:gemv|mma_decode)<[^;]*;", text)
        assert calls and all(c.endswith(", lin_pro);") for c in calls), (name, calls)
        assert f"LinPro<decltype(lin_pro_f), {'true' if mode == '2' else 'false'}>" in text
    for name in other:  # the batch-4 kernels wait first, as before
        assert "LinPro<" not in kernels[name] and kernels[name].split("{", 1)[1].lstrip().startswith(
            "atlas::pdl_enter();"), name
    attention = [k for k, t in kernels.items() if k.startswith("decode") and "attention_decode<" in t]
    assert attention
    trigger = "atlas::pdl_enter();\n  atlas::pdl_leave();"
    assert all((trigger in kernels[k]) == (mode == "2") for k in attention)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm80"))
def test_early_kernels_compile(arch, monkeypatch):
    """The batch-1 projection kernels with early weights (mode 2: the trigger too) compile; sm80 has no
    programmatic launch (pdl_enter / pdl_leave compile to nothing) and keeps the preload."""
    from atlasc.codegen.nvcc import compile_cubins

    program, module = _module("2", monkeypatch)
    one, _ = _decode_projection_kernels(program, module)
    kernels = _kernels(module.source)
    source = module.prelude + "\n" + "\n".join(kernels[k] for k in sorted(one))
    assert compile_cubins(source, (arch,))[arch]


def test_launch_bounds_keep_one_wave():
    """A grid that 3 or 4 blocks per H200 SM held in one wave keeps that bound (the preload's registers would
    otherwise leave 2: Llama-3-8B's QKV, 384 blocks, 70 -> 88 registers); the MMA decode kernels (<= 264
    blocks) get none."""
    from atlasc.codegen.linear import early_min_blocks

    assert [early_min_blocks(b) for b in (128, 256, 264, 265, 384, 396, 397, 528, 8016)] == [0, 0, 0, 3, 3, 3, 4, 4, 4]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_projections_only_with_early_quant(quant, monkeypatch):
    """The quantized projections with float x take lin_pro only with ATLAS_EARLY_QUANT=1 (opt-in: not yet measured
    on a GPU); then every tensor-core call takes it and the CUDA-core fallback runs it first; the kernels compile
    (sm90). Another value is a CodegenError naming the variable."""
    from atlasc.codegen.nvcc import compile_cubins

    def generated(early_quant: str):
        monkeypatch.setenv(EARLY_ENV, "2")
        monkeypatch.setenv("ATLAS_EARLY_QUANT", early_quant)
        # float x in every projection (sm90's default takes int8 x in the batch-1 gate/up and LM head kernels)
        monkeypatch.setenv("ATLAS_INT4_PATH" if quant == "int4" else "ATLAS_INT8_PATH", f"w{quant[3]}a16")
        program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")},
                          CompileOptions(archs=("sm90",), max_batch=4, max_seq=64, quant=quant, group_size=32))
        program, _ = run_pipeline(program)
        return program, program_module(program, ("sm90",))

    _, module = generated("")  # (the batch-1 kernels equal the batch-4 ones then: no kernel of their own)
    kernels = _kernels(module.source)
    assert not any("lin_pro" in t for t in kernels.values() if "linear_quant_mma<" in t)
    program, module = generated("1")
    kernels = _kernels(module.source)
    # (the fixture's K = 64 projections have no int4 tensor-core path: K % 128; their kernels hold the fallback only)
    quantized = [k for k, t in kernels.items() if "_batch1" in k and "atlas::linear_quant" in t]
    assert len(quantized) == 4 * program.kv_cache.layers + 1  # QKV, o, gate/up, down per layer; the LM head
    assert any("linear_quant_mma<" in kernels[k] for k in quantized)
    for name in quantized:
        text = kernels[name]
        head = text.split("auto lin_pro_f = [&] {", 1)[0]
        assert "pdl_enter" not in head and "lin_norm_stage" not in head, name
        calls = re.findall(r"atlas::linear_quant_mma<[^;]*;", text)
        assert all(c.endswith(", lin_pro);") for c in calls), (name, calls)
        assert "lin_pro(); atlas::linear_quant<" in text, name
    others = [k for k, t in kernels.items() if "_batch1" not in k and "atlas::linear_quant" in t]
    assert others and not any("lin_pro" in kernels[k] for k in others)
    source = module.prelude + "\n" + "\n".join(kernels[k] for k in sorted(quantized))
    assert compile_cubins(source, ("sm90",))["sm90"]
    with pytest.raises(CodegenError, match="ATLAS_EARLY_QUANT='yes'"):
        generated("yes")
