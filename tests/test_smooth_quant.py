"""smooth-quant (`--quant int8 --smooth ALPHA --calib prompts.npz`): the fold keeps the float function, lowers the
int8-activation (W8A8) error where x has outlier channels, and reaches the artifact's report; bad options are
one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES

from atlasc.errors import UsageError
from atlasc.ir import interpret
from atlasc.ir.graph import constant
from atlasc.ir.ops.quant import w8a8_matmul
from atlasc.ir.program import CompileOptions, Program
from atlasc.passes import smooth_quant as sq
from atlasc.passes.gptq import load_feeds
from atlasc.passes.quantize import quantize_int8
from atlasc.passes.rewrite import RewriteStats
from atlasc.pipeline import run_pipeline

OUTLIERS = (3, 17)  # channels of every smoothed input made 30x larger (and their weight columns 30x smaller)


def _calib(tmp_path, seed: int = 0, prompts: int = 4, length: int = 12) -> str:
    path = tmp_path / f"calib{seed}.npz"
    np.savez(path, input_ids=np.random.default_rng(seed).integers(0, 256, (prompts, length)).astype(np.int64))
    return str(path)


def _float_program(name: str, **options) -> Program:
    from atlasc.frontend import import_onnx

    program = Program({"main": import_onnx(FIXTURES / f"{name}.onnx")}, CompileOptions(max_batch=4, **options))
    program, _ = run_pipeline(program, ["canonicalize", "dce", "fuse-linear"], verify_each=True)
    return program


def test_smoothing_scales():
    s = sq.smoothing_scales(np.array([4.0, 0.0, 1.0, 9.0, 1e12]), np.array([1.0, 2.0, 0.0, 1.0, 1e-12]), 0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0, 3.0, sq.SCALE_LIMIT])
    np.testing.assert_allclose(sq.smoothing_scales(np.array([8.0]), np.array([2.0]), 1.0), [8.0])


def test_a_graph_output_and_float16_range_are_kept(tmp_path):
    """An input that is also a graph output is declined (smoothing would change it); with float16 weights the
    scales stop where a scaled column would leave float16's range."""
    calib = _calib(tmp_path)
    program = _float_program("llama-fp16", quant="int8", smooth=1.0, calib=calib)
    graph = program.entries["main"]
    found = sq._candidates(graph, program, RewriteStats())
    x = found[0][0]
    graph.outputs.append(x)
    for _, _, users in found[1:]:  # weights whose columns alpha 1 would scale by max|x| (far past float16)
        for u in users:
            w = u.inputs[1]
            u.inputs[1] = constant(f"{w.name}__big", (np.asarray(w.data, np.float32) * 1e3).astype(np.float16))
    with np.errstate(over="ignore", invalid="ignore"):  # the inflated weights overflow float16 activations
        program, stats = sq.smooth_quant(program)
    assert stats.declined[f"{sq.RULE} at {x.name}"] == "it is a graph output (its values would change)"
    assert stats.applied == {sq.RULE: len(found) - 1}
    for _, _, users in found[1:]:
        for u in users:
            assert np.isfinite(u.inputs[1].data).all() and np.abs(u.inputs[1].data).max() <= sq.FP16_ROOM


def test_the_fold_keeps_the_float_function(tmp_path):
    """llama (float32, 2 layers): the norm-fed inputs (QKV and gate/up of each layer, the LM head) and the SwiGLU
    products (down's input, divided in the up projection's rows) are smoothed, the attention outputs (o's input)
    declined with the reason; the logits on fresh prompts equal the unsmoothed graph's to float32 rounding."""
    calib = _calib(tmp_path)
    program = _float_program("llama", quant="int8", smooth=0.5, calib=calib)
    before = _float_program("llama").entries["main"]
    program, stats = sq.smooth_quant(program)
    graph = program.entries["main"]
    assert stats.applied == {sq.RULE: 7}
    assert list(stats.declined.values()) == [
        "its producer is not a per-channel scale by a constant (norm or Mul) nor a gated product"] * 2
    assert len(program.smoothing["inputs"]) == 7 and program.smoothing["alpha"] == 0.5
    down = [r for r in program.smoothing["inputs"] if all(n.startswith("Linear:") for n in r["divided"])]
    assert len(down) == 2  # the up projections' rows took the division
    assert all(r["scale_max"] > r["scale_min"] > 0 for r in program.smoothing["inputs"])
    feeds = load_feeds(_calib(tmp_path, seed=7, prompts=2, length=9), graph)
    want, got = interpret(before, feeds)["logits"], interpret(graph, feeds)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _inject_outliers(program: Program) -> None:
    """Make OUTLIERS channels of every smoothable input 30x larger and their weight columns 30x smaller: the same
    float function, int8 activations now dominated by two channels per row."""
    graph = program.entries["main"]
    for x, targets, users in sq._candidates(graph, program, RewriteStats()):
        f = np.ones(x.shape[-1])
        f[list(OUTLIERS)] = 30.0
        for n, i, rows in targets:
            c = n.inputs[i]
            n.inputs[i] = constant(f"{c.name}__outlier", (np.asarray(c.data) * (f[:, None] if rows else f)).astype(
                c.data.dtype))
        for u in users:
            w = u.inputs[1]
            u.inputs[1] = constant(f"{w.name}__outlier", (np.asarray(w.data) / f).astype(w.data.dtype))


def _w8a8_errors(program: Program, feeds) -> dict[str, float]:
    """Linear node name -> relative error of W8A8 (x quantized per row, W per output channel) against x W^T, on
    the calibration activations, for the norm-fed Linear nodes."""
    graph = program.entries["main"]
    found = sq._candidates(graph, program, RewriteStats())
    xs = [x for x, _, _ in found]
    graph.outputs.extend(xs)
    try:
        got = interpret(graph, feeds)
    finally:
        del graph.outputs[len(graph.outputs) - len(xs):]
    out = {}
    for v, _, users in found:
        x = got[v.name].reshape(-1, v.shape[-1]).astype(np.float32)
        for u in users:
            w = np.asarray(u.inputs[1].data, np.float32)
            wq, s = quantize_int8(w)
            y = x @ w.T
            out[u.name] = float(np.linalg.norm(w8a8_matmul(x, wq, s) - y) / np.linalg.norm(y))
    return out


def test_smoothing_lowers_the_int8_activation_error(tmp_path):
    """With two outlier channels in every smoothed input (the norm outputs, the SwiGLU products), W8A8's error on
    the calibration activations falls by more than 2x on every smoothed projection (alpha 0.5); without outliers it
    stays within 1.5x of the unsmoothed error."""
    calib = _calib(tmp_path)
    for outliers in (True, False):
        program = _float_program("llama", quant="int8", smooth=0.5, calib=calib)
        if outliers:
            _inject_outliers(program)
        feeds = load_feeds(calib, program.entries["main"])
        plain = _w8a8_errors(program, feeds)
        program, _ = sq.smooth_quant(program)
        smooth = _w8a8_errors(program, feeds)
        assert plain.keys() == smooth.keys() and len(plain) == 13  # 2 x (q, k, v, gate, up, down) + the LM head
        for name in plain:
            if outliers:
                assert smooth[name] < 0.5 * plain[name], (name, smooth[name], plain[name])
            else:
                assert smooth[name] < 1.5 * plain[name], (name, smooth[name], plain[name])


def test_the_report_and_bad_options(tmp_path, cli, no_nvcc):
    """The compile records the smoothing in the quantization report; --smooth without --quant int8 or --calib,
    or outside (0, 1], is a one-line error with exit code 2 and no file."""
    calib = _calib(tmp_path)
    out = tmp_path / "m.atlas"
    model = FIXTURES / "llama-fp16.onnx"
    r = cli("compile", model, "-o", out, "--arch", "sm90", "--max-seq", "64", "--quant", "int8", "--smooth", "0.5",
            "--calib", calib, "--json")
    assert r.code == 0, r.stderr
    from atlasc.artifact import open_artifact

    with open_artifact(out) as art:
        rep = art.manifest.report["quantization"]
    assert rep["smooth"]["alpha"] == 0.5 and len(rep["smooth"]["inputs"]) == 7
    assert rep["accuracy"]["top1_agreement"] > 0.5
    r = cli("inspect", out)
    assert r.code == 0 and "quantization int8, SmoothQuant alpha 0.5 on 7 inputs" in r.stdout
    for args, msg in ((("--quant", "int4", "--smooth", "0.5", "--calib", calib), "--smooth needs --quant int8"),
                      (("--quant", "int8", "--smooth", "0.5"), "--smooth needs --quant int8 and --calib"),
                      (("--quant", "int8", "--smooth", "1.5", "--calib", calib), "--smooth must be in (0, 1]"),
                      (("--quant", "int8", "--smooth", "0", "--calib", calib), "--smooth must be in (0, 1]")):
        bad = tmp_path / "bad.atlas"
        r = cli("compile", model, "-o", bad, "--arch", "sm90", *args)
        assert r.code == 2 and msg in r.stderr + r.stdout and not bad.exists(), (args, r.stderr)
    with pytest.raises(UsageError, match="--smooth needs"):
        sq.smooth_quant(_float_program("llama", quant="int8", smooth=0.5))
