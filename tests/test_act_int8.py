"""Int8 activations at decode: W4A8 (LinearQ4 with act = "int8": the reference's exact integer part
against an emulation of act_int8.cu's dp4a layout, hypothesis) and W8A8 (LinearQ8), the activation
quantization, the error against float activations, choose-decode-path (ATLAS_INT4_PATH /
ATLAS_INT8_PATH), and the kernels compiling for sm75 and sm90."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest
from conftest import arch_params
from hypothesis import given, settings
from hypothesis import strategies as st

from atlasc.ir.ops.quant import (dequant_q4, dequant_q8, quantize_rows_int8, w4a8_group_dots, w4a8_matmul,
                                 w8a8_matmul)
from atlasc.passes.quantize import quantize_int4, quantize_int8


def nibble_bytes(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 [..., 4] low and high nibbles of each byte of the packed uint32 words (the even / odd k)."""
    lo = np.stack([(words >> (8 * b)) & 0x0F for b in range(4)], axis=-1).astype(np.int64)
    hi = np.stack([(words >> (8 * b + 4)) & 0x0F for b in range(4)], axis=-1).astype(np.int64)
    return lo, hi


def emulate_dp4a(xq: np.ndarray, packed: np.ndarray, group: int, zero: np.ndarray | None) -> np.ndarray:
    """int64 [M, N, K/G] the way linear_w4a8 computes it: x_q as int8 words (word 2j: the even k of weight
    word j, 2j + 1 the odd ones), each 16-byte chunk's 4 weight words split into low / high nibble bytes,
    unsigned x signed byte products (dp4a.u32.s32), minus z times the chunk's sum of x_q, then the G / 32
    chunks (lanes) of a group added (the shuffles)."""
    m, k = xq.shape
    n = packed.shape[0]
    words = packed.view(np.uint32).reshape(n, k // 8)  # little-endian: byte b of word j = packed[8j/2 + b]
    xb = xq.astype(np.int64).reshape(m, k // 8, 8)
    x_even, x_odd = xb[:, :, 0::2], xb[:, :, 1::2]  # the bytes of words 2j and 2j + 1
    lo, hi = nibble_bytes(words)
    dot_words = np.einsum("mjb,njb->mnj", x_even, lo) + np.einsum("mjb,njb->mnj", x_odd, hi)
    chunk_dot = dot_words.reshape(m, n, k // 32, 4).sum(-1)  # a lane's 4 words = 32 k
    chunk_xs = xb.reshape(m, k // 32, 32).sum(-1)
    lanes = group // 32
    z = np.full((n, k // group), 8, np.int64) if zero is None else zero.astype(np.int64)
    z_chunk = np.repeat(z, lanes, axis=1)
    per_chunk = chunk_dot - z_chunk[None] * chunk_xs[:, None, :]
    return per_chunk.reshape(m, n, k // group, lanes).sum(-1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.sampled_from([32, 64, 128, 256]), st.integers(1, 4),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_dp4a_emulation_equals_the_exact_group_dots(m, n, group, groups, zp, seed):
    rng = np.random.default_rng(seed)
    k = group * groups
    xq = rng.integers(-127, 128, (m, k)).astype(np.int8)
    packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    zero = rng.integers(0, 16, (n, groups)).astype(np.uint8) if zp else None
    want = w4a8_group_dots(xq, packed, group, zero)
    np.testing.assert_array_equal(emulate_dp4a(xq, packed, group, zero), want)
    assert np.abs(want).max() < 2**31  # int32 accumulation cannot overflow


def emulate_w4a8_mma(xq: np.ndarray, packed: np.ndarray, group: int, zero: np.ndarray | None) -> np.ndarray:
    """int64 [M, N, K/G] the way linear_w4a8_mma computes it: act8_quantize_block's step sums (8-k chunk
    i = m * K/8 + j summed into xs[i // 16]), per 64-byte step and lane c the m16n8k32 products of each
    word's even-k codes with x word 2j and odd-k codes with word 2j + 1, minus z times the step's xs, then
    the steps of a group added (the kernel adds them in float32 after the scale)."""
    m, k = xq.shape
    n, steps = packed.shape[0], k // 128
    xb = xq.astype(np.int64).reshape(m, steps, 4, 4, 8)  # step, lane c, word w, k
    chunk_sums = xb.reshape(m * (k // 8), 8).sum(-1)
    xs = chunk_sums.reshape(-1, 16).sum(-1).reshape(m, steps)  # xs[i // 16], row-major over (m, step)
    x_even, x_odd = xb[..., 0::2], xb[..., 1::2]  # x words 2j and 2j + 1
    lo, hi = nibble_bytes(packed.view(np.uint32).reshape(n, steps, 4, 4))
    dots = np.einsum("mscwb,nscwb->mns", x_even, lo) + np.einsum("mscwb,nscwb->mns", x_odd, hi)
    z = np.full((n, k // group), 8, np.int64) if zero is None else zero.astype(np.int64)
    per_step = dots - np.repeat(z, group // 128, axis=1)[None] * xs[:, None, :]
    return per_step.reshape(m, n, k // group, group // 128).sum(-1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.sampled_from([128, 256, 512]), st.integers(1, 3),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_w4a8_mma_emulation_equals_the_exact_group_dots(m, n, group, groups, zp, seed):
    rng = np.random.default_rng(seed)
    k = group * groups
    xq = rng.integers(-127, 128, (m, k)).astype(np.int8)
    packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    zero = rng.integers(0, 16, (n, groups)).astype(np.uint8) if zp else None
    np.testing.assert_array_equal(emulate_w4a8_mma(xq, packed, group, zero), w4a8_group_dots(xq, packed, group, zero))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_activation_quantization(rows, k, spread, seed):
    """|x_q| <= 127, each nonzero row reaches 127, x = x_q * s_x within half a step; zero rows give 0."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * spread).astype(np.float16)
    x[0] = 0
    xq, sx = quantize_rows_int8(x)
    assert xq.dtype == np.int8 and sx.dtype == np.float32 and np.abs(xq.astype(int)).max() <= 127
    assert sx[0] == 0 and not xq[0].any()
    for r in range(1, rows):
        if np.abs(x[r]).max() > 0:
            assert np.abs(xq[r].astype(int)).max() == 127
            err = np.abs(x[r].astype(np.float64) - xq[r].astype(np.float64) * sx[r])
            assert err.max() <= sx[r] * 0.5 * (1 + 1e-5)


def test_w4a8_close_to_the_w4a16_projection():
    """The activation quantization adds ~0.3% relative error on Gaussian rows (K = 1024, g128)."""
    rng = np.random.default_rng(3)
    k, n = 1024, 64
    w = (rng.standard_normal((n, k)) / 32).astype(np.float16)
    packed, scale = quantize_int4(w, 128)
    x = rng.standard_normal((3, 1, k)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    got = w4a8_matmul(x, packed, scale, 128, bias).astype(np.float64)
    want = (x.astype(np.float64) @ dequant_q4(packed, scale, 128).T.astype(np.float64)) + bias
    assert got.shape == (3, 1, n)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel


def test_w8a8_is_the_exact_dot_scaled_in_float32():
    """W8A8 = float32(float32(int dot) * scale) * s_x (+ bias): what linear_w8a8 computes step by step; and
    close to the float-activation projection."""
    rng = np.random.default_rng(5)
    k, n = 512, 48
    w = (rng.standard_normal((n, k)) / 16).astype(np.float16)
    wq, scale = quantize_int8(w)
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    got = w8a8_matmul(x, wq, scale)
    xq, sx = quantize_rows_int8(x.reshape(2, k))
    dots = xq.astype(np.int64) @ wq.astype(np.int64).T
    assert np.abs(dots).max() < 2**31
    want = ((dots.astype(np.float32) * scale.astype(np.float32)) * sx[:, None]).astype(np.float32)
    np.testing.assert_array_equal(got.reshape(2, n), want)
    ref = x.reshape(2, k).astype(np.float64) @ dequant_q8(wq, scale).T.astype(np.float64)
    assert np.linalg.norm(got.reshape(2, n) - ref) / np.linalg.norm(ref) < 1e-2


def _compiled(monkeypatch, path: str, max_batch: int = 4, group: int = 32, quant: str = "int4"):
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import PIPELINES, run_pipeline

    from conftest import FIXTURES

    monkeypatch.setenv("ATLAS_INT4_PATH" if quant == "int4" else "ATLAS_INT8_PATH", path)
    names = PIPELINES["default"]
    options = CompileOptions(archs=("sm90",), max_batch=max_batch, max_seq=64, quant=quant, group_size=group)
    program = Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")}, options)
    program, report = run_pipeline(program, names[: names.index("schedule")], verify_each=True)
    return program, report


def _int4_nodes(graph, op: str = "LinearQ4"):
    return [n for n in graph.nodes if n.op == op or n.attrs.get("linear") == op]


@pytest.mark.parametrize("quant,op,paths", [("int4", "LinearQ4", ("w4a8", "w4a16")),
                                            ("int8", "LinearQ8", ("w8a8", "w8a16"))])
def test_choose_decode_path_marks_decode_only(monkeypatch, quant, op, paths):
    """ATLAS_INT4_PATH=w4a8 / ATLAS_INT8_PATH=w8a8: every int4 / int8 projection of the decode entry (rows
    <= 8) gets act = int8, the prefill's keep float activations; the decode entry then stays close to
    its float-activation twin."""
    from test_fuse_linear_prologue import _decode

    w4a8, report = _compiled(monkeypatch, paths[0], quant=quant)
    w4a16, _ = _compiled(monkeypatch, paths[1], quant=quant)
    decode = _int4_nodes(w4a8.entries["decode"], op)
    assert decode and all(n.attrs["act"] == "int8" for n in decode)
    assert all(n.attrs.get("act", "") == "" for n in _int4_nodes(w4a8.entries["prefill"], op))
    assert all(n.attrs.get("act", "") == "" for g in w4a16.entries.values() for n in _int4_nodes(g, op))
    record = next(r for r in report.records if r.name == "choose-decode-path")
    assert sum(record.applied.values()) == len(decode)
    assert any("rows may exceed" in why for why in record.declined.values())  # the prefill's
    got, _ = _decode(w4a8.entries["decode"], w4a8, "llama-fp16")
    want, _ = _decode(w4a16.entries["decode"], w4a16, "llama-fp16")
    logits = next(k for k in want if "logits" in k)
    a, b = got[logits].astype(np.float64).ravel(), want[logits].astype(np.float64).ravel()
    assert not np.array_equal(a, b)  # the activations were quantized
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99


def test_choose_decode_path_declines_with_reasons(monkeypatch):
    """More than 8 rows (prefill, and decode with --max-batch 16 where only split-decode's decode_small
    changes), or a group size the dp4a layout cannot split: W4A16 stays, and -vv says why."""
    program, report = _compiled(monkeypatch, "w4a8", max_batch=16)
    for name in ("prefill", "decode"):
        assert all(n.attrs.get("act", "") == "" for n in _int4_nodes(program.entries[name]))
    assert all(n.attrs["act"] == "int8" for n in _int4_nodes(program.entries["decode_small"]))
    record = next(r for r in report.records if r.name == "choose-decode-path")
    assert any("rows may exceed 8" in why for why in record.declined.values())
    _, report = _compiled(monkeypatch, "w4a8", group=16)
    record = next(r for r in report.records if r.name == "choose-decode-path")
    assert any("group size 16" in why for why in record.declined.values())


def test_bad_decode_path_is_a_usage_error(monkeypatch):
    from atlasc.errors import UsageError

    with pytest.raises(UsageError, match="ATLAS_INT4_PATH='w4a4'"):
        _compiled(monkeypatch, "w4a4")
    monkeypatch.delenv("ATLAS_INT4_PATH")
    with pytest.raises(UsageError, match="ATLAS_INT8_PATH='w4a8'"):
        _compiled(monkeypatch, "w4a8", quant="int8")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", arch_params("sm90", "sm80", "sm75"))
def test_act_int8_kernels_compile(arch):
    """The GPU test's graphs (plain LinearQ4 / LinearQ8, NormLinearQ with SwiGLU, NormLinearRotary; zero
    points; float16 and float32 x) compile for the arch (sm75, sm80: the float16 one), every node quantizing
    its x first."""
    from atlasc.codegen import generate_module
    from atlasc.codegen.nvcc import compile_cubins

    from test_codegen_matmul_attention import kv_spec
    from test_kernels_act_int8_gpu import KV_SHAPE, ROT_KV, build_act8, act8_plan

    for dtype in ("float16", "float32"):
        b = build_act8(dtype)
        graph = b.done()
        plan, kv_offset = act8_plan(graph, b.upper, np.zeros(KV_SHAPE, np.dtype(dtype)))
        mod = generate_module({"run": (graph, plan)}, {"run": b.upper}, kv_spec(dtype, kv_offset, ROT_KV))
        # the int8 weights (K = 1024) in W8A8's early form: the block quantizes x after its first weight loads
        # (float16 x; float32 keeps the v5 form)
        int8_nodes = sum(n.op == "LinearQ8" or n.attrs.get("linear") == "LinearQ8" for n in graph.nodes)
        early = int8_nodes if dtype == "float16" else 0
        assert mod.source.count("atlas::act8_quantize<") == len(graph.nodes) - early
        assert mod.source.count(", false>(xv, M, K, act8_x, nullptr, act8_sx, act8_max)") == (2 if early else 0)
        assert mod.source.count(", false>(x, M, K, act8_x, nullptr, act8_sx, act8_max)") == (1 if early else 0)
        assert "atlas::linear_w4a8<" in mod.source and "atlas::linear_w8a8<" in mod.source
        # the tensor-core W4A8 kernel (groups of 128: the plain LinearQ4 with zero points, the NormLinearQ and
        # the last NormLinearRotary),
        # in the same kernel as its run-time fallback
        assert mod.source.count("atlas::linear_w4a8_mma<") == 3
        assert "atlas::linear_w4a8_mma<" + ("__half" if dtype == "float16" else "float") + ", 3, 128, " in mod.source
        ops = Counter(n.op for n in graph.nodes)
        assert ops["LinearQ4"] and ops["LinearQ8"] and ops["NormLinearQ"] == 2 and ops["NormLinearRotary"] == 3
        if dtype == "float16" or arch == "sm90":
            assert compile_cubins(mod.source, (arch,))[arch]


def test_w4a8_path_switch(monkeypatch):
    """linear_w4a8_mma is emitted for int4 groups of a multiple of 128 and static K % 128 == 0, not for
    other groups, int8, or ATLAS_W4A8_PATH=dp4a; a bad value is a CodegenError naming the variable."""
    from atlasc.codegen import act_int8
    from atlasc.codegen.generate import CodegenError

    monkeypatch.delenv(act_int8.W4A8_PATH_ENV, raising=False)
    assert act_int8.w4a8_mma_applies(4, 128, 4096) and act_int8.w4a8_mma_applies(4, 256, 512)
    assert not act_int8.w4a8_mma_applies(4, 64, 4096) and not act_int8.w4a8_mma_applies(4, 128, 4160)
    assert not act_int8.w4a8_mma_applies(8, 0, 4096) and not act_int8.w4a8_mma_applies(4, 128, None)
    lines, blocks = act_int8.act8_calls("n", "__half", 2, 4, 128, False, "false", 4096, 1, "x", 0, n_upper=6144)
    assert blocks == 6144 // 16 and "atlas::linear_w4a8_mma<__half, 2, 128, 8, " in "\n".join(lines)  # split 8
    monkeypatch.setenv(act_int8.W4A8_PATH_ENV, "dp4a")
    lines, blocks = act_int8.act8_calls("n", "__half", 2, 4, 128, False, "false", 4096, 1, "x", 0, n_upper=6144)
    assert blocks == 0 and "linear_w4a8_mma" not in "\n".join(lines) and "atlas::linear_w4a8<" in "\n".join(lines)
    monkeypatch.setenv(act_int8.W4A8_PATH_ENV, "tc")
    with pytest.raises(CodegenError, match=act_int8.W4A8_PATH_ENV):
        act_int8.w4a8_mma_applies(4, 128, 4096)


def test_w8a8_early_switch(monkeypatch):
    """W8A8's early form (the block quantizes x after its first weight loads) for int8 weights with a static K %
    128 == 0 and float16 x, with W8A8_U chunks in flight per lane (ATLAS_QUANT_U overrides); the v5 form for another
    K, float32 x or ATLAS_W8A8_EARLY=0; a bad value is a CodegenError naming the variable."""
    from atlasc.codegen import act_int8
    from atlasc.codegen.generate import CodegenError

    monkeypatch.delenv(act_int8.W8A8_EARLY_ENV, raising=False)
    monkeypatch.delenv("ATLAS_QUANT_U", raising=False)
    assert act_int8.w8a8_early(8, 4096) and not act_int8.w8a8_early(8, 4160) and not act_int8.w8a8_early(4, 4096)
    lines = "\n".join(act_int8.act8_calls("n", "__half", 2, 8, 0, False, "false", 4096, 1, "x", 0, n_upper=4096)[0])
    assert f"atlas::linear_w8a8<__half, 2, 1, {act_int8.W8A8_U}, false>(" in lines and ", act8_pre);" in lines
    assert "act8_quantize_block<__half, 2, false>(x, M, K, act8_x, nullptr" in lines
    assert "atlas::act8_quantize<" not in lines
    lines = "\n".join(act_int8.act8_calls("n", "float", 2, 8, 0, False, "false", 4096, 1, "x", 0, n_upper=4096)[0])
    assert f"atlas::linear_w8a8<float, 2, 1, {act_int8.ACT8_U}, false>(" in lines and "act8_pre" not in lines
    monkeypatch.setenv("ATLAS_QUANT_U", "6")
    lines = "\n".join(act_int8.act8_calls("n", "__half", 2, 8, 0, False, "false", 4096, 1, "x", 0, n_upper=4096)[0])
    assert "atlas::linear_w8a8<__half, 2, 1, 6, false>(" in lines
    for k, env in ((4160, "1"), (4096, "0")):
        monkeypatch.setenv(act_int8.W8A8_EARLY_ENV, env)
        lines = "\n".join(act_int8.act8_calls("n", "__half", 2, 8, 0, False, "false", k, 1, "x", 0, n_upper=4096)[0])
        assert "atlas::act8_quantize<__half, 2, false>(x, M, K" in lines and "act8_pre" not in lines
        assert f"atlas::linear_w8a8<__half, 2, 1, {act_int8.ACT8_U}, false>(" in lines
    monkeypatch.setenv(act_int8.W8A8_EARLY_ENV, "yes")
    with pytest.raises(CodegenError, match="ATLAS_W8A8_EARLY='yes' is not 0 or 1"):
        act_int8.w8a8_early(8, 4096)
    assert not act_int8.w8a8_early(4, 4096)  # int4 compiles never read it


@pytest.mark.parametrize("quant,path", [("int4", "w4a8"), ("int8", "w8a8")])
def test_accuracy_report_covers_the_int8_activation_decode(monkeypatch, quant, path):
    """The compile's accuracy report adds the decode step with int8 activations against float activations
    (the prefill it already compares never runs them); nothing is added without them."""
    from atlasc.accuracy import decode_act_report, random_prompts

    program, _ = _compiled(monkeypatch, path, quant=quant)
    vocab = int(program.entries["prefill"].outputs[0].shape[-1])
    ids = random_prompts(vocab, prompts=5, length=6)
    report = decode_act_report(program, ids)
    assert report["entry"] == "decode" and report["steps"] == 5
    assert 0 < report["kl_divergence"] < 0.05 and report["top1_agreement"] >= 0.6, report
    plain, _ = _compiled(monkeypatch, "w4a16" if quant == "int4" else "w8a16", quant=quant)
    assert decode_act_report(plain, ids) == {}


def _decode_act_by_whole_copies(program, ids, rows: int) -> tuple[float, float]:
    """(KL, top-1 agreement) of decode_act_report's comparison done the plain way: a prefill per `rows` prompts,
    each decode step on a copy of the whole cache."""
    from atlasc.accuracy import _feeds, _softmax
    from atlasc.ir.interpreter import interpret

    name = "decode"
    graph, twin = program.entries[name], program.entries[name].clone("twin")
    for node in twin.nodes:
        if node.attrs.get("act", "").startswith("int8"):
            node.attrs["act"] = ""
    kv, past, length = program.kv_cache, program.roles["past"], ids.shape[1]
    kl, agree = [], []
    for start in range(0, ids.shape[0], rows):
        chunk = ids[start:start + rows]
        state = {"kv_cache": np.zeros(kv.shape, np.dtype(kv.dtype))}
        interpret(program.entries["prefill"], _feeds(program.entries["prefill"], chunk[:, :-1]), state=state,
                  symbols={past: 0})
        outs = [interpret(g, _feeds(graph, chunk[:, -1:], length - 1), state={"kv_cache": state["kv_cache"].copy()},
                          symbols={past: length - 1})[graph.outputs[0].name] for g in (graph, twin)]
        q, p = (_softmax(o.astype(np.float64).reshape(-1, o.shape[-1])) for o in outs)
        kl += list(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300)), axis=-1))
        agree += list(p.argmax(-1) == q.argmax(-1))
    return float(np.mean(kl)), float(np.mean(agree))


@pytest.mark.parametrize("path,rows", [("w4a8", 4), ("w4a8-fused1", 1)])
def test_decode_act_report_reuses_one_prefill(monkeypatch, path, rows):
    """decode_act_report runs one prefill per max_batch prompts and starts each decode step from a fresh cache
    holding only the prefill's rows and positions it needs (no copy of the whole cache): the same KL and
    agreement as a prefill per step's prompts with whole copies, over more prompts than max_batch (a chunk
    boundary), with steps of 4 rows (W4A8 everywhere) and of 1 row (int8 x only at one row); and, given
    accuracy_report's quantized prefill caches of the same prompts (as the compile does), with no prefill at all."""
    from atlasc.accuracy import _cache_rows, decode_act_report, random_prompts

    program, _ = _compiled(monkeypatch, path)
    assert program.kv_cache.max_batch == 4
    vocab = int(program.entries["prefill"].outputs[0].shape[-1])
    ids = random_prompts(vocab, prompts=6, length=5, seed=3)
    import atlasc.accuracy as accuracy

    runs = []  # the graphs decode_act_report interprets
    interpret = accuracy.interpret
    counting = lambda g, *a, **k: runs.append(g.name) or interpret(g, *a, **k)  # noqa: E731
    monkeypatch.setattr(accuracy, "interpret", counting)
    report = decode_act_report(program, ids)
    monkeypatch.setattr(accuracy, "interpret", interpret)
    prefill = program.entries["prefill"].name
    steps = -(-4 // rows) + -(-2 // rows)  # 6 prompts: chunks of max_batch 4 and 2, steps of `rows` prompts
    assert runs.count(prefill) == 2 and len(runs) == 2 + 2 * steps
    kl, agree = _decode_act_by_whole_copies(program, ids, rows)
    assert report["steps"] == 6 and report["kl_divergence"] > 0
    assert report["kl_divergence"] == pytest.approx(kl, rel=1e-3, abs=1e-9) and report["top1_agreement"] == agree
    caches = []  # the accuracy report's quantized prefill caches: no prefill runs, the same numbers
    accuracy.accuracy_report(program, ids, caches)
    assert len(caches) == 2
    monkeypatch.setattr(accuracy, "interpret", counting)
    runs.clear()
    reused = decode_act_report(program, ids, caches)
    monkeypatch.setattr(accuracy, "interpret", interpret)
    assert prefill not in runs and len(runs) == 2 * steps and reused["steps"] == 6
    assert reused["kl_divergence"] == pytest.approx(kl, rel=1e-3, abs=1e-9) and reused["top1_agreement"] == agree
    cache = np.random.default_rng(0).standard_normal((2, 2, 4, 3, 8, 5)).astype(np.float16)
    rows_of = _cache_rows(cache, 1, 2, 6)
    assert np.array_equal(rows_of[:, :, :2, :, :6], cache[:, :, 1:3, :, :6])
    assert not rows_of[:, :, 2:].any() and not rows_of[:, :, :, :, 6:].any()


def test_shared_memory_bound_declines():
    """A fused norm's staged rows plus the int8 rows must fit the same 200 KB as the staging alone."""
    from atlasc.ir import symbolic as S
    from atlasc.ir.graph import Graph, Node, SymbolInfo, Value
    from atlasc.passes.choose_decode_path import choose_graph
    from atlasc.passes.rewrite import RewriteStats

    def graph(k):
        g = Graph("g")
        g.symbols = {"m": SymbolInfo(1, 8)}
        a = Value("a", "float16", (S.sym("m"), k))
        node = Node("NormLinearQ", [a, None, Value("g", "float16", (k,)), Value("wq", "uint8", (64, k // 2)),
                                    Value("s", "float16", (64, k // 128))], [Value("y", "float16", (S.sym("m"), 64))],
                    {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128, "act": ""}, name="n")
        g.nodes = [node]
        return g, node

    for k, fits in ((8192, True), (12800, False)):
        g, node = graph(k)
        stats = RewriteStats()
        choose_graph(g, {"m": 8}, {"LinearQ4": {"rows 1", "rows 2..8"}}, stats)
        assert (node.attrs["act"] == "int8") == fits, (k, stats.declined)
        if not fits:
            assert "shared memory" in next(iter(stats.declined.values()))
