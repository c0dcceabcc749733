"""GPU numerics of the copy-engine int4 / int8 projection (codegen/quant_bulk.py, ATLAS_QUANT_BULK=1) against the
reference.

An sm90-only compile of one-row LinearQ4 nodes (symmetric, groups of 128) and LinearQ8 nodes: K 4096 x N 4096
(Llama-3-8B's o), K 14336 x N 256 with a bias (down's K: 112 int4 / 224 int8 stages, split into K runs), K 128 x N 40
with a bias (one or two stages, a partial tile) and K 256 x N 1000 (a partial tile of the default's 256 rows); each
node is checked to be the copy-engine kernel, then run
twice in one arena (the K split's counters must be left at 0) against the reference interpreter, with the offset
dequantization off and on (ATLAS_QUANT_OFS), the K split forced to 1, 2 and 4 runs or by the rule, two other
configurations (ATLAS_QUANT_BULK_CONFIG), and with the copies in flight capped and the producer held
(ATLAS_QUANT_BULK_INFLIGHT, ATLAS_QUANT_BULK_HOLD). NormLinearQ (the norm source, staged by the consumer warps) over
K 4096, int4 and int8: plain with N 1000 (a partial tile); with the residual add, its sum output and the SwiGLU epilogue
(N 2 x 500 pairs, bias); and with SwiGLU alone over N 2 x 4096 (64 tiles of 64 pairs). NormLinearRotary (the merged
QKV projection with the rotary and the KV-cache append; 4 q and 2 kv heads of 128 dims, K 4096) at past 0 and 7:
int4 with the residual add and full rotary, int8 with a bias and tables per batch row, int4 without rotary, and
partial rotary (64 of 128 dims: tiles of 32 pairs, 4 warps), at the default configuration and at 4-8-4; q, the sum,
the new cache rows, nothing else of the cache touched. The loop over tiles (ATLAS_QUANT_BULK_LOOP): at N blocks with
the K split at one run, for every kind above, and at auto on an LM-head-like NormLinearQ (K 2048 x N 40000: 157 tiles
on 132 blocks, a partial last tile). The norm's scale read before the wait (ATLAS_QUANT_BULK_G_EARLY=1): NormLinearQ
and NormLinearRotary. float16: 2e-2 of max |y| (tests/test_kernels_quant_gpu.py's
bound).
"""

from __future__ import annotations

import numpy as np
import pytest

from atlasc.passes.quantize import quantize_int4, quantize_int8

pytestmark = pytest.mark.gpu

ARCHS = ("sm90",)
CASES = ((4096, 4096, False), (14336, 256, True), (128, 40, True), (256, 1000, False))  # (K, N, bias)
BITS = (4, 8)  # each case as LinearQ4 and as LinearQ8
# (N, residual add + sum output, SwiGLU, bias) of the NormLinearQ nodes over K = 4096, each int4 and int8
NORM_CASES = ((1000, False, False, False), (1000, True, True, True), (8192, False, True, False))
SWIGLU = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))), ("Mul", (), (("step", 1), ("in", 1))))
CALL = "atlas::linear_quant_bulk<"
# NormLinearRotary: 4 q heads and 2 kv heads of Llama's 128 dims (N = 1024), one cache layer per node, one row
ROT_KV = {"layers": 4, "max_batch": 1, "kv_heads": 2, "max_seq": 16, "head_dim": 128}
ROT_HEADS = {"q_heads": 4, "kv_heads": ROT_KV["kv_heads"], "head_dim": ROT_KV["head_dim"]}


def build_bulk():
    """A Builder of one-row LinearQ4 and LinearQ8 nodes the copy-engine path serves (CASES x BITS, in that order;
    weights from the real packers)."""
    from test_codegen_matmul_attention import Builder

    b = Builder("quant_bulk", {"m": (1, 1)})
    for i, (k, n, bias) in enumerate(CASES):
        w = (np.random.default_rng(10 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        x = b.input(f"x{i}", "float16", ("m", k))
        for bits in BITS:
            wq, scale = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
            wv = b.input(f"wq{i}_{bits}", str(wq.dtype), wq.shape, gen=lambda rng, shape, a=wq: a)
            sv = b.input(f"s{i}_{bits}", "float16", scale.shape, gen=lambda rng, shape, a=scale: a)
            bv = [b.input(f"b{i}_{bits}", "float16", (n,))] if bias else []
            if bits == 4:
                b.node("LinearQ4", [x, wv, sv, *bv], {"group_size": 128})
            else:
                b.node("LinearQ8", [x, wv, sv, *bv])
    return b


def _norm_scale(b, k: int, const_g: bool):
    """The norm's scale g: a graph input, or (const_g) a constant of random values, as a compiled model's (only a
    constant may be read before the wait: ATLAS_QUANT_BULK_G_EARLY)."""
    from atlasc.ir.graph import constant

    if not const_g:
        return b.input("g", "float16", (k,))
    return constant("g", np.random.default_rng(60).uniform(0.5, 1.5, k).astype(np.float16))


def build_bulk_norm(const_g: bool = False):
    """A Builder of one-row NormLinearQ nodes the copy-engine path serves (NORM_CASES x BITS, in that order); g a
    constant with const_g."""
    from test_codegen_matmul_attention import Builder

    k = 4096
    b = Builder("quant_bulk_norm", {"m": (1, 1)})
    a, res, g = b.input("a", "float16", ("m", k)), b.input("r", "float16", ("m", k)), _norm_scale(b, k, const_g)
    for i, (n, add, swiglu, bias) in enumerate(NORM_CASES):
        w = (np.random.default_rng(40 + i).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        for bits in BITS:
            wq, scale = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
            wv = b.input(f"nw{i}_{bits}", str(wq.dtype), wq.shape, gen=lambda rng, shape, q=wq: q)
            sv = b.input(f"ns{i}_{bits}", "float16", scale.shape, gen=lambda rng, shape, q=scale: q)
            bv = [b.input(f"nb{i}_{bits}", "float16", (n,))] if bias else []
            attrs = {"epsilon": 1e-5, "linear": f"LinearQ{bits}", **({"group_size": 128} if bits == 4 else {})}
            if swiglu:
                attrs |= {"epilogue": SWIGLU, "gate_input": 0}
            b.node("NormLinearQ", [a, res if add else None, g, wv, sv, *bv], attrs, outputs=2 if add else 1)
    return b


def build_bulk_rotary(partial: bool = False, const_g: bool = False):
    """A Builder of one-row NormLinearRotary nodes over K = 4096 (layers 0-2; with `partial` a fourth, whose 64-dim
    rotary needs tiles of at most 32 pairs, i.e. at most 4 warps): int4 with the residual add, its sum and full
    rotary; int8 with a bias and cos / sin per batch row; int4 without rotary (weights from the real packers); g a
    constant with const_g."""
    from atlasc.ir import symbolic as S
    from test_codegen_matmul_attention import Builder

    k, d = 4096, ROT_HEADS["head_dim"]
    n = (ROT_HEADS["q_heads"] + 2 * ROT_HEADS["kv_heads"]) * d
    b = Builder("quant_bulk_rotary", {"batch": (1, 1), "seq": (1, 1), "past_seq": (0, 10)})
    a, res, g = (b.input("a", "float16", ("batch", "seq", k)), b.input("r", "float16", ("batch", "seq", k)),
                 _norm_scale(b, k, const_g))
    cos, sin = b.input("cos", "float16", (1, "seq", d)), b.input("sin", "float16", (1, "seq", d))
    cos_b, sin_b = b.input("cos_b", "float16", ("batch", "seq", d)), b.input("sin_b", "float16", ("batch", "seq", d))
    w = (np.random.default_rng(70).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
    packed = {bits: quantize_int4(w, 128) if bits == 4 else quantize_int8(w) for bits in BITS}
    weights = {bits: [b.input(f"rw{bits}", str(q.dtype), q.shape, gen=lambda rng, shape, c=q: c),
                      b.input(f"rs{bits}", "float16", sc.shape, gen=lambda rng, shape, c=sc: c)]
               for bits, (q, sc) in packed.items()}
    past = S.sym("past_seq")

    def rot(layer, bits, ins, extra, outputs):
        attrs = {"epsilon": 1e-5, "linear": f"LinearQ{bits}", "layer": layer, "past": past, **ROT_HEADS,
                 **({"group_size": 128} if bits == 4 else {})}
        b.node("NormLinearRotary", [*ins, *weights[bits], *extra], attrs, outputs=outputs)

    rot(0, 4, [a, res, g, cos, sin], [], 4)
    rot(1, 8, [a, None, g, cos_b, sin_b], [b.input("rbias", "float16", (n,))], 3)
    rot(2, 4, [a, res, g, None, None], [], 4)
    if partial:
        cos_p, sin_p = b.input("cos_p", "float16", (1, "seq", 64)), b.input("sin_p", "float16", (1, "seq", 64))
        rot(3, 4, [a, None, g, cos_p, sin_p], [], 3)
    return b


def build_lm_head():
    """A Builder of one int4 NormLinearQ of the LM head's K (2048) and 40000 rows: 157 tiles of 256, more than the
    132 blocks ATLAS_QUANT_BULK_LOOP=auto runs them on (the last tile 64 rows)."""
    from test_codegen_matmul_attention import Builder

    k, n = 2048, 40000
    b = Builder("quant_bulk_lm_head", {"m": (1, 1)})
    a, g = b.input("a", "float16", ("m", k)), b.input("g", "float16", (k,))
    w = (np.random.default_rng(90).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
    wq, scale = quantize_int4(w, 128)
    wv = b.input("lw", "uint8", wq.shape, gen=lambda rng, shape: wq)
    sv = b.input("ls", "float16", scale.shape, gen=lambda rng, shape: scale)
    b.node("NormLinearQ", [a, None, g, wv, sv], {"epsilon": 1e-5, "linear": "LinearQ4", "group_size": 128})
    return b


def build_chain(bits: int = 4):
    """A Builder of a Llama layer's projections after the attention, one row, hidden 2048, each reading the one before
    (codegen/quant_chain.py's chain): o (2048 x 2048), the residual add and RMSNorm with gate/up and SwiGLU (2 x 2048
    rows, its sum output), down (2048 x 2048), and the residual add and RMSNorm of that sum with an LM-head-like
    projection (1000 rows: a partial tile); int4 g128 or int8 weights from the real packers, the scales g constants."""
    from atlasc.ir.graph import constant
    from test_codegen_matmul_attention import Builder

    k = 2048
    b = Builder("quant_chain", {"m": (1, 1)})
    x, res = b.input("x", "float16", ("m", k)), b.input("r", "float16", ("m", k))
    rng = np.random.default_rng(80)
    g1, g2 = (constant(f"g{i}", rng.uniform(0.5, 1.5, k).astype(np.float16)) for i in (1, 2))
    group = {"group_size": 128} if bits == 4 else {}

    def weights(name: str, n: int, seed: int):
        w = (np.random.default_rng(seed).uniform(-1, 1, (n, k)) / np.sqrt(k)).astype(np.float32)
        wq, scale = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
        return [b.input(f"{name}_w", str(wq.dtype), wq.shape, gen=lambda rng, shape, q=wq: q),
                b.input(f"{name}_s", "float16", scale.shape, gen=lambda rng, shape, q=scale: q)]

    norm = {"epsilon": 1e-5, "linear": f"LinearQ{bits}", **group}
    (o,) = b.node(f"LinearQ{bits}", [x, *weights("o", k, 81)], group)
    h, s1 = b.node("NormLinearQ", [res, o, g1, *weights("gu", 2 * k, 82)],
                   {**norm, "epilogue": SWIGLU, "gate_input": 0}, outputs=2)
    (d,) = b.node(f"LinearQ{bits}", [h, *weights("d", k, 83)], group)
    b.node("NormLinearQ", [s1, d, g2, *weights("lm", 1000, 84)], norm, outputs=2)
    return b


def rotary_plan(graph, upper, kv_cache=None):
    """plan_for with build_bulk_rotary's cache geometry."""
    from test_codegen_matmul_attention import plan_for

    return plan_for(graph, upper, kv_cache, kv=ROT_KV)


def _check(monkeypatch, builder=build_bulk, **env):
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import generate_module
    from atlasc.ir import interpret

    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    builder = builder()
    graph = builder.done()
    plan = plan_for(graph, builder.upper)[0]
    mod = generate_module({"run": (graph, plan)}, {"run": builder.upper}, None, archs=ARCHS)
    assert mod.source.count(CALL) == len(graph.nodes) and len(mod.tensor_maps) == len(graph.nodes)
    feeds = builder.inputs(np.random.default_rng(), {"m": 1})
    want = interpret(graph, feeds)
    got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for, archs=ARCHS, repeat=2)
    for name, w in want.items():
        g, w = got[name].astype(np.float64), w.astype(np.float64)
        err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
        assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} {env}: err {err}"


@pytest.mark.parametrize("ofs", ["0", "1"])
@pytest.mark.parametrize("ks", ["auto", "1", "2", "4"])
def test_bulk_int4_matches_reference(monkeypatch, ofs, ks):
    _check(monkeypatch, ATLAS_QUANT_OFS=ofs, ATLAS_QUANT_BULK_KS=ks)


@pytest.mark.parametrize("config", ["4-8-4", "16-4-1"])
def test_bulk_int4_configurations(monkeypatch, config):
    _check(monkeypatch, ATLAS_QUANT_BULK_CONFIG=config)


@pytest.mark.parametrize("config, inflight, hold",
                         [("8-6-2", "2", "1"), ("", "2", "1"), ("", "1", "0"), ("", "0", "0")])
@pytest.mark.parametrize("build", ["plain", "norm"])
def test_bulk_inflight_and_hold(monkeypatch, config, inflight, hold, build):
    """ATLAS_QUANT_BULK_INFLIGHT (the producer's copies in flight capped) and ATLAS_QUANT_BULK_HOLD (the producer warp
    kept until its last stage is taken) at the default configuration (16-11-1) and at v44-v46's 8-6-2, and without
    either (v46's form): the same results, run twice in one arena (the K split's counters back at 0)."""
    env = {"ATLAS_QUANT_BULK_INFLIGHT": inflight, "ATLAS_QUANT_BULK_HOLD": hold, "ATLAS_QUANT_OFS": "1"}
    if config:
        env["ATLAS_QUANT_BULK_CONFIG"] = config
    _check(monkeypatch, build_bulk if build == "plain" else build_bulk_norm, **env)


@pytest.mark.parametrize("loop, inflight, hold", [("3", "2", "1"), ("1", "0", "0"), ("5", "1", "1")])
@pytest.mark.parametrize("build", ["plain", "norm"])
def test_bulk_loop_matches_reference(monkeypatch, loop, inflight, hold, build):
    """ATLAS_QUANT_BULK_LOOP=N with one K run: a weight of more than N tiles (plain: 16 and 4 tiles; norm: 4, 4 and
    32) runs on N blocks that claim the rest, at the copies-in-flight caps and holds the claims follow; the same
    results, run twice in one arena (the claim counter back at 0)."""
    env = {"ATLAS_QUANT_BULK_LOOP": loop, "ATLAS_QUANT_BULK_KS": "1", "ATLAS_QUANT_BULK_INFLIGHT": inflight,
           "ATLAS_QUANT_BULK_HOLD": hold}
    _check(monkeypatch, build_bulk if build == "plain" else build_bulk_norm, **env)


@pytest.mark.parametrize("ks", ["auto", "2"])
def test_bulk_g_early_matches_reference(monkeypatch, ks):
    """ATLAS_QUANT_BULK_G_EARLY=1 with g a constant: the norm sources read their first bytes of g before the wait
    (plain, with the residual add and its sum, SwiGLU; int4 and int8), one K run or two (the second run's first word
    is not k 0)."""
    _check(monkeypatch, lambda: build_bulk_norm(const_g=True), ATLAS_QUANT_BULK_G_EARLY="1", ATLAS_QUANT_BULK_KS=ks)


def test_bulk_loop_lm_head_shape(monkeypatch):
    """ATLAS_QUANT_BULK_LOOP=auto (the default) on build_lm_head's 157 tiles: 132 blocks, 25 tiles claimed."""
    _check(monkeypatch, build_lm_head)


@pytest.mark.parametrize("ofs", ["0", "1"])
@pytest.mark.parametrize("ks", ["auto", "2"])
def test_bulk_norm_matches_reference(monkeypatch, ofs, ks):
    """NormLinearQ: the norm staged by the consumer warps (its sum output checked too), plain and paired (SwiGLU)."""
    _check(monkeypatch, build_bulk_norm, ATLAS_QUANT_OFS=ofs, ATLAS_QUANT_BULK_KS=ks)


@pytest.mark.parametrize("config, ks, loop, g_early", [("", "auto", "auto", "0"), ("", "1", "auto", "0"),
                                                       ("4-8-4", "auto", "auto", "0"), ("4-8-4", "1", "auto", "0"),
                                                       ("", "1", "3", "0"), ("", "auto", "auto", "1")])
def test_bulk_rotary_matches_reference(monkeypatch, config, ks, loop, g_early):
    """NormLinearRotary: q, the sum and the whole cache after each run (the new row written, nothing else touched);
    with ATLAS_QUANT_BULK_LOOP=3 the 8 and 16 tiles on 3 blocks; with ATLAS_QUANT_BULK_G_EARLY=1 (g a constant) the
    norm's scale read before the wait."""
    from atlasc.codegen import generate_module
    from test_codegen_matmul_attention import kv_spec

    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_KS", ks)
    monkeypatch.setenv("ATLAS_QUANT_BULK_LOOP", loop)
    monkeypatch.setenv("ATLAS_QUANT_BULK_G_EARLY", g_early)
    if config:
        monkeypatch.setenv("ATLAS_QUANT_BULK_CONFIG", config)
    builder = build_bulk_rotary(partial=True, const_g=g_early == "1")
    graph = builder.done()
    rng = np.random.default_rng()
    shape = (ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"], ROT_KV["head_dim"])
    cache = rng.uniform(-1, 1, shape).astype(np.float16)
    plan, kv_offset = rotary_plan(graph, builder.upper, cache)
    mod = generate_module({"run": (graph, plan)}, {"run": builder.upper}, kv_spec("float16", kv_offset, ROT_KV),
                          archs=ARCHS)
    assert mod.source.count(CALL) == len(graph.nodes)
    assert mod.source.count(", true>{xs,") == (len(graph.nodes) if g_early == "1" else 0)  # QbNorm's G_EARLY
    _check_rotary_runs(builder, graph, rng)


def _check_rotary_runs(builder, graph, rng, **run_args) -> None:
    """Run build_bulk_rotary's graph on the GPU at past 0 and 7 (run_on_gpu's run_args, twice in one arena) from a
    random cache: q, the sums and the new cache rows against the reference's, nothing else of the cache touched."""
    from kernel_harness import run_on_gpu

    from atlasc.ir import interpret

    shape = (ROT_KV["layers"], 2, ROT_KV["max_batch"], ROT_KV["kv_heads"], ROT_KV["max_seq"], ROT_KV["head_dim"])
    for past in (0, 7):
        env = {"batch": 1, "seq": 1, "past_seq": past}
        cache = rng.uniform(-1, 1, shape).astype(np.float16)
        feeds = builder.inputs(rng, env)
        state, state_ref = {"kv_cache": cache.copy()}, {"kv_cache": cache.copy()}
        want = interpret(graph, feeds, state=state_ref, symbols={"past_seq": past})
        got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=rotary_plan, archs=ARCHS, repeat=2, state=state,
                         symbols={"past_seq": past}, **run_args)
        new_rows = (state["kv_cache"][:, :, 0, :, past], state_ref["kv_cache"][:, :, 0, :, past])
        for name, (g, w) in [*((n, (got[n], w)) for n, w in want.items()), ("cache rows", new_rows)]:
            g, w = g.astype(np.float64), w.astype(np.float64)
            err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
            assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} past {past}: err {err}"
        untouched = np.ones(shape, bool)
        untouched[:, :, :1, :, past] = False
        np.testing.assert_array_equal(state["kv_cache"][untouched], cache[untouched])


CHAIN_CALL = "atlas::qb_chain_phase<"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("ks, cap", [("auto", 0), ("1", 0), ("auto", 5), ("2", 3)])
def test_chain_matches_reference(monkeypatch, bits, ks, cap):
    """ATLAS_QUANT_BULK_CHAIN=1 on build_chain's layer as a decode step of one row: its four projections, each reading
    the one before, run as the phases of one kernel (one launch) on 132 blocks, or on 5 or 3 (grid_cap: a GPU of
    fewer SMs, so that blocks take several items, and with the K split forced to 2 runs, items of both runs, x
    staged again), the K split by the rule or off; every output (each phase's, the sums) against the reference, run
    twice in one arena (the grid barrier's words and the split's counters back at 0)."""
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.codegen import generate_module
    from atlasc.ir import interpret

    for name, value in {"ATLAS_QUANT_BULK": "1", "ATLAS_QUANT_BULK_CHAIN": "1", "ATLAS_QUANT_BULK_KS": ks}.items():
        monkeypatch.setenv(name, value)
    builder = build_chain(bits)
    graph = builder.done()
    mod = generate_module({"run": (graph, plan_for(graph, builder.upper)[0])}, {"run": builder.upper}, None,
                          archs=ARCHS, decode_steps={"run": "m"})
    assert [bool(launch.kernel) for launch in mod.launches["run"]] == [True, False, False, False]
    assert mod.source.count(CHAIN_CALL) == 4 and CALL not in mod.source
    feeds = builder.inputs(np.random.default_rng(), {"m": 1})
    want = interpret(graph, feeds)
    got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for, archs=ARCHS, repeat=2,
                     decode_steps={"run": "m"}, grid_cap=cap)
    for name, w in want.items():
        g, w = got[name].astype(np.float64), w.astype(np.float64)
        err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
        assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name} ks {ks} cap {cap}: err {err}"


def test_chain_rotary_matches_reference(monkeypatch):
    """build_bulk_rotary's graph (with the partial rotary: three phases of 8 warps, one of 4 on blocks of 8) as one
    chain on a decode step of one row, at past 0 and 7: q, the sums and the new cache rows against the reference,
    nothing else of the cache touched, run twice in one arena."""
    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_CHAIN", "1")
    builder = build_bulk_rotary(partial=True)
    _check_rotary_runs(builder, builder.done(), np.random.default_rng(), decode_steps={"run": "batch"})


@pytest.mark.parametrize("build", ["plain", "norm"])
def test_chain_of_independent_projections(monkeypatch, build):
    """The GPU test graphs of the single kernels (plain: int4 and int8 in turn, K up to 14336, partial tiles, biases;
    norm: the norm sources, int4 and int8) as one chain on a decode step of one row, run twice in one arena: the same
    results as the reference."""
    from kernel_harness import run_on_gpu
    from test_codegen_matmul_attention import plan_for

    from atlasc.ir import interpret

    monkeypatch.setenv("ATLAS_QUANT_BULK", "1")
    monkeypatch.setenv("ATLAS_QUANT_BULK_CHAIN", "1")
    builder = build_bulk() if build == "plain" else build_bulk_norm(const_g=True)
    graph = builder.done()
    feeds = builder.inputs(np.random.default_rng(), {"m": 1})
    want = interpret(graph, feeds)
    got = run_on_gpu(graph, feeds, upper=builder.upper, plan_fn=plan_for, archs=ARCHS, repeat=2,
                     decode_steps={"run": "m"})
    for name, w in want.items():
        g, w = got[name].astype(np.float64), w.astype(np.float64)
        err = np.abs(g - w).max() if np.all(np.isfinite(g)) else np.inf
        assert err <= 2e-2 * max(np.abs(w).max(), 1e-3), f"{name}: err {err}"
