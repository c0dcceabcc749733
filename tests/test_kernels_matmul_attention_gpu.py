"""GPU numerics of MatMul / Gemm / Attention / RotaryEmbedding / KVAppend against the reference.

Each test builds one graph of many independent nodes (the builders of test_codegen_matmul_attention),
compiles it once (sized for the symbols' maxima) and runs it at two or more run-time sizes on fresh
seeded random inputs, comparing every output with the numpy interpreter. Tolerances:
- float32: rtol 1e-4, atol 1e-4 for matmuls (float32 accumulation in a different order than numpy's
  over K up to 257), 1e-5 for the rest;
- float16: both sides accumulate exactly-representable fp16 products in float32, but summation order
  differs, so the final rounding to fp16 may land one fp16 ulp apart: at |y| up to ~8 (K = 257 products
  of uniform [-1, 1] values) one ulp is 2^-7, hence atol 2e-2 for matmuls; attention / rotary outputs
  are O(1) (one ulp ~1e-3; the rotary reference even rounds every fp16 intermediate), hence 3e-3.
Attention tests run with both kernels (ATLAS_ATTENTION_PATH=rows and =fast, set before generating);
the decode-shaped cases average up to 4101 keys in float32 on both sides, so the same tolerances hold
(fp32: summation order only, ~1e-7 relative; fp16: one rounding of an O(1) or smaller output).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from atlasc.ir import symbolic as S
from kernel_harness import check_against_reference
from test_codegen_matmul_attention import (
    DECODE_PADDED,
    DECODE_TRANSPOSED,
    DECODE_UPPER,
    KEYS_PADDED,
    KEYS_UPPER,
    build_attention,
    build_attention_decode,
    build_attention_keys,
    build_kv,
    build_matmul,
    build_rotary,
    kv_state,
    plan_for,
)

pytestmark = pytest.mark.gpu
PATHS = ["rows", "fast"]  # ATLAS_ATTENTION_PATH values: every-variant kernel, the decode path (default)

TOL = {
    "matmul": {"float32": (1e-4, 1e-4), "float16": (1e-3, 2e-2)},
    "other": {"float32": (1e-4, 1e-5), "float16": (3e-3, 3e-3)},
}


def _run(builder, envs, dtype, kind, seed, plan_kw=None, **kw):
    graph = builder.done()
    rtol, atol = TOL[kind][dtype]
    plan_fn = functools.partial(plan_for, **(plan_kw or {}))
    rng = np.random.default_rng(seed)
    for env in envs:
        feeds = builder.inputs(rng, env)
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=builder.upper, plan_fn=plan_fn, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_matmul_gemm(dtype, transposed):
    """2-D/3-D/4-D (broadcast batch), 1-D operands, Gemm variants; odd sizes off the 64 tile; K to 257."""
    b = build_matmul(dtype)
    envs = [{"m": 70, "n": 67, "k": 257, "batch": 3}, {"m": 1, "n": 3, "k": 33, "batch": 2},
            {"m": 64, "n": 64, "k": 16, "batch": 1}]
    plan_kw = {"transposed": {"a2", "b3", "a4", "ga8", "gb9"}} if transposed else {}
    _run(b, envs, dtype, "matmul", 1, plan_kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "cache_strided_kv"])
def test_attention(monkeypatch, path, dtype, padded):
    """4-D/3-D, GQA, causal + past, bool/float/short masks, softcap, scale, present and qk outputs;
    zero past; K/V optionally laid out with cache-like row strides. With path=fast the short-mask node
    runs attention_decode (the others are declined: test_codegen_matmul_attention)."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", path)
    b = build_attention(dtype)
    envs = [{"batch": 2, "seq": 9, "past_seq": 12}, {"batch": 1, "seq": 3, "past_seq": 0},
            {"batch": 2, "seq": 1, "past_seq": 7}]
    plan_kw = {"padded": {"k", "v", "pk", "pv", "q3", "k3"}} if padded else {}
    _run(b, envs, dtype, "other", 2, plan_kw)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rotary(dtype):
    b = build_rotary(dtype)
    envs = [{"batch": 3, "seq": 11}, {"batch": 1, "seq": 1}, {"batch": 2, "seq": 5}]
    _run(b, envs, dtype, "other", 3, {"transposed": {"x0"}})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kv_append(monkeypatch, path, dtype):
    """KVAppend at past 0 and past > 0: the present views (gathered through their cache strides), an
    Attention reading them, and the whole cache afterwards (new rows written, nothing else touched)."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", path)
    b = build_kv(dtype)
    graph = b.done()
    rtol, atol = TOL["other"][dtype]
    rng = np.random.default_rng(4)
    cache = rng.uniform(-1, 1, kv_state(dtype).shape).astype(kv_state(dtype).dtype)
    for env in [{"batch": 2, "seq": 3, "past_seq": 0}, {"batch": 1, "seq": 4, "past_seq": 5},
                {"batch": 2, "seq": 6, "past_seq": 10}]:
        feeds = b.inputs(rng, env)
        state, state_ref = {"kv_cache": cache.copy()}, {"kv_cache": cache.copy()}
        got = check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=b.upper, plan_fn=plan_for,
                                      state=state, state_ref=state_ref, symbols={"past_seq": env["past_seq"]})
        np.testing.assert_array_equal(state["kv_cache"], state_ref["kv_cache"])
        assert not np.array_equal(state["kv_cache"], cache)
        p, s, n = env["past_seq"], env["seq"], env["batch"]
        np.testing.assert_array_equal(state["kv_cache"][1, 0, :n, :, p:p + s], feeds["k_new"])
        np.testing.assert_array_equal(got["kvappend1_out0"][:, :, p:], feeds["k_new"])
        cache = state["kv_cache"]  # the next step appends to this cache


def _decode_plan(graph, upper, kv_cache=None):
    """plan_for with the decode builder's cache views, and `k_odd` re-placed at the end of the arena with
    rows 65 elements apart (not 16-byte aligned: attention_decode must notice and run attention_rows)."""
    from atlasc.ir.dtypes import to_numpy
    from atlasc.ir.memory import Placement, align

    plan, kv_offset = plan_for(graph, upper, kv_cache, padded=DECODE_PADDED, transposed=DECODE_TRANSPOSED)
    v = next(x for x in graph.inputs if x.name == "k_odd")
    b, h, t, d = (S.evaluate(x, upper) for x in v.shape)
    row = d + 1
    off = align(plan.arena_bytes)
    n = b * h * t * row * to_numpy(v.dtype).itemsize
    plan.placements[v.name] = Placement("activations", off, n, (h * t * row, t * row, row, 1))
    plan.arena_bytes = align(off + n)
    return plan, kv_offset


# (batch, query rows, past): contexts past + seq of 1, 2, 18, 301, 4101 keys at decode (seq 1), and
# chunks of 3 rows (every GQA tile then has rows of several positions)
DECODE_ENVS = [{"batch": 1, "seq": 1, "past_seq": 0}, {"batch": 5, "seq": 1, "past_seq": 1},
               {"batch": 5, "seq": 1, "past_seq": 17}, {"batch": 1, "seq": 1, "past_seq": 300},
               {"batch": 5, "seq": 1, "past_seq": 300}, {"batch": 1, "seq": 1, "past_seq": 4100},
               {"batch": 5, "seq": 1, "past_seq": 4100}, {"batch": 5, "seq": 3, "past_seq": 17},
               {"batch": 2, "seq": 3, "past_seq": 300}]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_decode_sequence_split(monkeypatch, dtype):
    """Generated for one query position (seq upper 1: attention_decode splits the keys into runs merged
    by the last one to finish), at the one-position contexts of DECODE_ENVS (1 to 4101 keys, batch 1
    and 5); launched three times in one arena, so the split counters must return to 0 every time."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "fast")
    b = build_attention_decode(dtype)
    graph = b.done()
    rtol, atol = TOL["other"][dtype]
    rng = np.random.default_rng(6)
    for env in [e for e in DECODE_ENVS if e["seq"] == 1]:
        feeds = b.inputs(rng, env)
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper={**DECODE_UPPER, "seq": 1},
                                plan_fn=_decode_plan, repeat=3)


def _check_decode_switched(monkeypatch, switches: dict[str, str], seed: int, one_position: bool) -> None:
    """attention_decode (ATLAS_ATTENTION_PATH=fast, the given ATLAS_ATTENTION_* switches) against the reference on
    build_attention_decode's nodes, three launches per arena (the split counters return to 0): at the
    one-position contexts of DECODE_ENVS generated for seq 1 (the sequence split), or at all of them."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "fast")
    for name, value in switches.items():
        monkeypatch.setenv(f"ATLAS_ATTENTION_{name}", value)
    b = build_attention_decode("float16")
    graph = b.done()
    rtol, atol = TOL["other"]["float16"]
    rng = np.random.default_rng(seed)
    upper = {**DECODE_UPPER, "seq": 1} if one_position else b.upper
    for env in [e for e in DECODE_ENVS if e["seq"] == 1 or not one_position]:
        feeds = b.inputs(rng, env)
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=upper, plan_fn=_decode_plan, repeat=3)


@pytest.mark.parametrize("min_keys,vpf,warps,mma,merge", [("32", "0", "8", "0", "0"), ("256", "1", "8", "0", "0"),
                                                          ("64", "1", "4", "0", "0"), ("32", "0", "2", "0", "0"),
                                                          ("32", "0", "2", "1", "0"), ("32", "1", "8", "0", "1")])
def test_attention_decode_short_context_switches(monkeypatch, min_keys, vpf, warps, mma, merge):
    """ATLAS_ATTENTION_SPLIT_MIN_KEYS (runs of at least 32 / 64 / 256 keys), ATLAS_ATTENTION_VPREFETCH=1 (V rows
    prefetched into L2), ATLAS_ATTENTION_WARPS (4 / 2 warps per block) and ATLAS_ATTENTION_WARP_MERGE=1 (the split
    merged by a warp per row), on the SIMT path (ATLAS_ATTENTION_MMA=0) and on tensor cores, keep attention_decode
    equal to the reference at every one-position context of DECODE_ENVS."""
    _check_decode_switched(monkeypatch, {"SPLIT_MIN_KEYS": min_keys, "VPREFETCH": vpf, "WARPS": warps, "MMA": mma,
                                         "WARP_MERGE": merge}, seed=7, one_position=True)


@pytest.mark.parametrize("min_keys,warps,merge", [("256", "8", "0"), ("32", "4", "0"), ("32", "8", "1"),
                                                   ("32", "4", "1"), ("32", "2", "1")])
def test_attention_decode_mma(monkeypatch, min_keys, warps, merge):
    """attention_decode's scores and values on tensor cores (ATLAS_ATTENTION_MMA, on by default: float16, head
    dims 64 / 128; 256 keeps the SIMT path) equal the reference on build_attention_decode's nodes (GQA groups
    1 / 4 / 8, masks with a fully masked batch row, causal, past inputs, 3-D inputs) at every context of
    DECODE_ENVS, with runs of at least 256 keys and 8 warps, and of 32 keys and 8 / 4 / 2 warps (the split's
    merge), that merge by a thread per row and by a warp per row (ATLAS_ATTENTION_WARP_MERGE=1; 2 warps: fewer
    warps than rows). Tolerance as the other float16 attention tests: P is rounded to fp16 as in attention_fa2."""
    _check_decode_switched(monkeypatch, {"MMA": "1", "SPLIT_MIN_KEYS": min_keys, "WARPS": warps,
                                         "WARP_MERGE": merge}, seed=9, one_position=False)


@pytest.mark.parametrize("path,mma", [("rows", ""), ("fast", ""), ("fast", "0")], ids=["rows", "fast", "fast-simt"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_decode(monkeypatch, path, mma, dtype):
    """Decode shapes (build_attention_decode): K/V as KV-cache views with row strides of the maximal
    context (4103), GQA groups 1/4/8, head dims 64/128/256, left-padded bool and additive masks with a
    fully masked batch row (batch 0 when B > 1: output 0), causal, past inputs, 3-D inputs, the
    [B, S, H*D] output; plus a transposed K and an unaligned K, which attention_rows serves. fast-simt:
    ATLAS_ATTENTION_MMA=0 (float16 off tensor cores)."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", path)
    monkeypatch.setenv("ATLAS_ATTENTION_MMA", mma)
    b = build_attention_decode(dtype)
    graph = b.done()
    rtol, atol = TOL["other"][dtype]
    rng = np.random.default_rng(5)
    assert b.upper == DECODE_UPPER
    for env in DECODE_ENVS:
        feeds = b.inputs(rng, env)
        check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=b.upper, plan_fn=_decode_plan)


@pytest.mark.parametrize("path,mma", [("rows", ""), ("fast", ""), ("fast", "0")])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_key_mask(monkeypatch, path, mma, dtype):
    """key_mask=1 (mask-as-lengths, ATLAS_MASK_LENGTHS=1; not yet run on a GPU when written): the kernels
    read attention_mask [B, T] and apply causal / window / the export's fill themselves
    (build_attention_keys: int64 / int32 / bool masks, windows 5 and 3, fills float32 min, float16 min
    and -inf, a fully hidden batch row, prefill / chunk / decode shapes). Generated for prefill maxima
    and for decode (seq 1: the sequence split); same tolerances as test_attention (one fp16 rounding).
    The fast path with its defaults (float16 on tensor cores) and with ATLAS_ATTENTION_MMA=0 (SIMT)."""
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", path)
    monkeypatch.setenv("ATLAS_ATTENTION_MMA", mma)
    b = build_attention_keys(dtype)
    graph = b.done()
    rtol, atol = TOL["other"][dtype]
    rng = np.random.default_rng(8)
    plan_fn = functools.partial(plan_for, padded=KEYS_PADDED)
    envs = [{"batch": 3, "seq": 9, "past_seq": 0}, {"batch": 2, "seq": 4, "past_seq": 20},
            {"batch": 5, "seq": 1, "past_seq": 300}, {"batch": 1, "seq": 1, "past_seq": 0},
            {"batch": 4, "seq": 1, "past_seq": 37}]
    for env in envs:
        for upper in ([KEYS_UPPER] + ([{**KEYS_UPPER, "seq": 1}] if env["seq"] == 1 else [])):
            feeds = b.inputs(rng, env)
            check_against_reference(graph, feeds, rtol=rtol, atol=atol, upper=upper, plan_fn=plan_fn,
                                    symbols={"past_seq": env["past_seq"]})


# (batch, query rows, past): prefill of 3 (a short prompt: fa2 is the default), 16, 100, 128 and 513
# rows (one row past a 64-row tile multiple), on an empty past and on one of 5, 37 or 64 positions; the
# keys are past + seq (cache views, K/V padded)
FA2_ENVS = [{"batch": 2, "seq": 3, "past_seq": 5}, {"batch": 2, "seq": 16, "past_seq": 0},
            {"batch": 1, "seq": 100, "past_seq": 37},
            {"batch": 2, "seq": 128, "past_seq": 0}, {"batch": 2, "seq": 128, "past_seq": 64},
            {"batch": 1, "seq": 513, "past_seq": 0}, {"batch": 2, "seq": 513, "past_seq": 64}]


@pytest.mark.parametrize("warps", ["", "8"], ids=["auto", "w8"])
def test_attention_fa2(monkeypatch, warps):
    """ATLAS_ATTENTION_PREFILL=fa2 (not yet run on a GPU when written): attention_fa2 against the reference
    on build_attention_prefill (head dims 16 / 64 / 128, GQA groups 1 / 2 / 4, the default pipeline's
    additive mask with fp16-lowest and -inf fills and a bool one, all-hidden batch rows and query rows,
    the causal attribute with past inputs, the KEYS form with causal + window 37, 3-D inputs; the four
    nodes fa2 declines run today's kernels), with 4 warps (auto) and 8 per block. Tolerance as the
    other fp16 attention tests: fa2 rounds P to fp16 (2^-11 relative per weight) and Y once, so an O(1)
    output lands within one or two fp16 ulps (3e-3)."""
    from test_flash_attention import PREFILL_PADDED, PREFILL_TRANSPOSED, build_attention_prefill

    monkeypatch.setenv("ATLAS_ATTENTION_PREFILL", "fa2")
    monkeypatch.setenv("ATLAS_ATTENTION_FA2_WARPS", warps)
    b = build_attention_prefill("float16")
    _run(b, FA2_ENVS, "float16", "other", 9, {"padded": PREFILL_PADDED, "transposed": PREFILL_TRANSPOSED})
