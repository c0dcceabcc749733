"""The quantization accuracy report: quantized decoder vs its float twin on calibration prompts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from atlasc.accuracy import accuracy_report, load_calibration
from atlasc.errors import UsageError
from atlasc.frontend import import_onnx
from atlasc.ir.program import CompileOptions, Program
from atlasc.pipeline import run_pipeline

from conftest import FIXTURES, REPO


def quantized(name: str, mode: str, group: int = 16) -> Program:
    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")},
                      CompileOptions(max_batch=2, max_seq=32, quant=mode, group_size=group))
    return run_pipeline(program, verify_each=True)[0]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_int8_is_close_and_int4_is_measurably_worse(name):
    ids = np.random.default_rng(1).integers(0, 256, size=(3, 12))
    r8 = accuracy_report(quantized(name, "int8"), ids)
    r4 = accuracy_report(quantized(name, "int4"), ids)
    assert r8["prompts"] == 3 and r8["tokens_per_prompt"] == 12
    # int8 per channel: ~0.6% error per layer on these random weights (see the per-layer numbers)
    assert r8["kl_divergence"] < 1e-3 and r8["top1_agreement"] >= 0.9
    assert 0 < r8["max_layer_rel_error_on_calibration"] < 0.02
    # int4 with 15 levels per group: an order of magnitude more error, still a valid distribution
    assert r4["max_layer_rel_error_on_calibration"] > 3 * r8["max_layer_rel_error_on_calibration"]
    assert r4["kl_divergence"] > r8["kl_divergence"]
    assert set(r8["layer_rel_error_on_calibration"]) == set(r4["layer_rel_error_on_calibration"])


def test_calibration_file_is_validated(tmp_path):
    good = tmp_path / "c.npz"
    np.savez(good, input_ids=np.zeros((2, 5), np.int64))
    assert load_calibration(good, 256, 32).shape == (2, 5)
    for bad, message in [(np.zeros(5, np.int64), "2-D"), (np.zeros((2, 5), np.float32), "2-D integer"),
                         (np.full((1, 4), 300), "[0, 256)"), (np.zeros((1, 40), np.int64), "--max-seq")]:
        path = tmp_path / "bad.npz"
        np.savez(path, input_ids=bad)
        with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            load_calibration(path, 256, 32)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_compile_with_calibration_reports_it(tmp_path):
    calib = tmp_path / "calib.npz"
    np.savez(calib, input_ids=np.random.default_rng(2).integers(0, 256, size=(4, 8)))
    out = tmp_path / "q.atlas"
    cmd = [sys.executable, "-m", "atlasc", "compile", str(FIXTURES / "llama.onnx"), "-o", str(out), "--arch", "sm80",
           "--max-seq", "32", "--max-batch", "2", "--quant", "int8", "--calib", str(calib), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    assert r.returncode == 0, r.stderr
    acc = json.loads(r.stdout.splitlines()[-1])["quantization"]["accuracy"]
    assert acc["prompts"] == 4 and acc["calibration"] == str(calib)
    text = subprocess.run([sys.executable, "-m", "atlasc", "inspect", str(out)], capture_output=True, text=True,
                          cwd=REPO, check=False).stdout
    assert "top-1 agreement" in text and "KL" in text
    bad = subprocess.run(cmd[:-5] + ["--calib", str(calib)], capture_output=True, text=True, cwd=REPO, check=False)
    assert bad.returncode == 2 and "--calib only matters" in bad.stderr


def test_default_prompts_fit_one_chunk_at_max_batch_one():
    """Without --calib: 2 random prompts of 16 tokens, or 1 of 32 at --max-batch 1 (one pass of the
    report over the weights instead of two), never more than --max-seq tokens; deterministic."""
    from atlasc.accuracy import RANDOM_TOKENS, default_prompts

    two, one = default_prompts(256, 8, 512), default_prompts(256, 1, 512)
    assert two.shape == (2, RANDOM_TOKENS // 2) and one.shape == (1, RANDOM_TOKENS)
    assert default_prompts(256, 1, 20).shape == (1, 20) and default_prompts(256, 2, 10).shape == (2, 10)
    np.testing.assert_array_equal(two, default_prompts(256, 8, 512))
    assert two.dtype == np.int64 and 0 <= two.min() and two.max() < 256


@pytest.mark.parametrize("name,mode", [("llama", "int4"), ("llama", "int8"), ("qwen2", "int4")])  # qwen2: QKV bias
def test_layer_errors_equal_the_direct_formula(name, mode):
    """Each layer's error reuses the float twin's output as x W^T: equal to computing
    ||x W^T - x Wq^T|| / ||x W^T|| from the float weights (merged layers' parts, bias, the LM head) up to
    the float32 fixtures' rounding of the twin's output."""
    from atlasc.accuracy import QUANTIZED, _feeds, _float_twin
    from atlasc.ir.ops.quant import dequant, q4_zero

    program = quantized(name, mode)
    ids = np.random.default_rng(3).integers(0, 256, size=(2, 9))
    report = accuracy_report(program, ids)["layer_rel_error_on_calibration"]
    graph = program.entries["prefill"]
    twin, probes = _float_twin(graph, program.float_weights)
    kv = program.kv_cache
    from atlasc.ir.interpreter import interpret

    out = interpret(twin, _feeds(twin, ids), state={"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))},
                    symbols={program.roles["past"]: 0})
    nodes = {n.name: n for n in graph.nodes if n.op in QUANTIZED}
    checked = 0
    for name, x, _ in probes:
        node = nodes[name]
        xs = out[x.name].astype(np.float64).reshape(-1, x.shape[-1])
        zero = q4_zero(node)
        wq = dequant(node.op, node.inputs[1].data, node.inputs[2].data, node.attrs.get("group_size", 128),
                     None if zero is None else zero.data).astype(np.float64)
        w = program.float_weights[name]
        parts = w if isinstance(w, tuple) else ((name, w),)
        offset = 0
        for layer, part in parts:
            n = part.shape[0]
            y = xs @ np.asarray(part.data, np.float64).T
            want = np.linalg.norm(y - xs @ wq[offset:offset + n].T) / np.linalg.norm(y)
            assert report[layer] == pytest.approx(want, rel=1e-4), layer
            offset += n
            checked += 1
    assert checked == len(report) and checked > 3
