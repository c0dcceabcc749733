"""MatMul / Gemm / Attention / RotaryEmbedding / KVAppend code generation (CPU: generate + nvcc).

Every variant is generated and compiled for sm80 and sm90; many nodes share one module per test
(nvcc costs about a second per module). The graphs are built by the `build_*` functions below, which
the GPU tests (tests/test_kernels_matmul_attention_gpu.py) reuse for numeric checks. A snapshot test
pins the wrapper code generated for a small MatMul + KVAppend graph.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import arch_params

from atlasc.codegen import generate_module
from atlasc.codegen.attention import kv_slot_offset
from atlasc.codegen.generate import CodegenError
from atlasc.ir import OPS, Graph, Node, SymbolInfo, Value, verify
from atlasc.ir import symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.memory import MemoryPlan, Placement, align


@pytest.fixture(autouse=True)
def _one_kernel_per_node(monkeypatch):
    """These tests read each node's own kernel (its name, path and registers): no sharing between nodes
    that differ only in offsets (codegen/share.py, tested in tests/test_share_kernels.py)."""
    monkeypatch.setenv("ATLAS_SHARE_KERNELS", "0")

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
ARCHS = ("sm80", "sm90")


# -- graph building ----------------------------------------------------------------------------


class Builder:
    """A test graph of independent nodes: inputs with symbolic dims, outputs inferred by the op table."""

    def __init__(self, name: str, symbols: dict[str, tuple[int, int]]):
        self.g = Graph(name)
        self.g.symbols = {s: SymbolInfo(lo, hi) for s, (lo, hi) in symbols.items()}
        self.upper = {s: hi for s, (_, hi) in symbols.items()}
        self.gen: dict[str, callable] = {}  # input name -> custom generator(rng, shape)
        self.n = 0

    def input(self, name: str, dtype: str, shape, gen=None) -> Value:
        v = Value(name, dtype, tuple(S.sym(d) if isinstance(d, str) else d for d in shape))
        self.g.inputs.append(v)
        if gen is not None:
            self.gen[name] = gen
        return v

    def node(self, op: str, inputs: list, attrs: dict | None = None, outputs: int = 1, returned=None) -> list[Value]:
        """Add `op`; its first `outputs` results become graph outputs (or those flagged in `returned`)."""
        self.n += 1
        opdef = OPS[op]
        attrs = opdef.fill_attrs(dict(attrs or {}))
        types = opdef.infer([None if i is None else _tt(i) for i in inputs], attrs)
        outs = [Value(f"{op.lower()}{self.n}_out{k}", t.dtype, t.shape) for k, t in enumerate(types[:outputs])]
        self.g.nodes.append(Node(op, list(inputs), outs, attrs, name=f"{op.lower()}{self.n}"))
        for k, o in enumerate(outs):
            if returned is None or returned[k]:
                self.g.outputs.append(o)
        return outs

    def done(self) -> Graph:
        verify(self.g)
        return self.g

    def inputs(self, rng, env: dict[str, int]) -> dict[str, np.ndarray]:
        """Random inputs (never all zeros) at the run-time sizes env."""
        feeds = {}
        for v in self.g.inputs:
            shape = tuple(S.evaluate(d, env) for d in v.shape)
            if v.name in self.gen:
                feeds[v.name] = self.gen[v.name](rng, shape)
            elif v.dtype == "bool":
                feeds[v.name] = rng.random(shape) < 0.7
            elif v.dtype in ("int64", "int32"):
                feeds[v.name] = rng.integers(-5, 6, shape).astype(to_numpy(v.dtype))
            else:
                feeds[v.name] = rng.uniform(-1.0, 1.0, shape).astype(to_numpy(v.dtype))
        return feeds


def _tt(v: Value):
    from atlasc.ir import TensorType

    return TensorType(v.dtype, v.shape)


def build_matmul(dtype: str = "float32") -> Builder:
    """MatMul 2-D, 3-D, 4-D with broadcast batch, 1-D operands; Gemm with transA/transB, alpha, beta, bias."""
    b = Builder(f"matmul_{dtype}", {"m": (1, 70), "n": (1, 67), "k": (1, 260), "batch": (1, 3)})
    mm = lambda x, y: b.node("MatMul", [x, y])  # noqa: E731
    mm(b.input("a2", dtype, ("m", "k")), b.input("b2", dtype, ("k", "n")))
    mm(b.input("a3", dtype, ("batch", "m", "k")), b.input("b3", dtype, ("batch", "k", "n")))
    # batch broadcast: [batch, 1, m, k] @ [2, k, n] -> [batch, 2, m, n]
    mm(b.input("a4", dtype, ("batch", 1, "m", "k")), b.input("b4", dtype, (2, "k", "n")))
    mm(b.input("a4s", dtype, ("m", "k")), b.input("b4s", dtype, ("batch", 2, "k", "n")))
    mm(b.input("v1", dtype, ("k",)), b.input("b1", dtype, ("batch", "k", "n")))  # 1-D lhs
    mm(b.input("a1", dtype, ("batch", "m", "k")), b.input("w1", dtype, ("k",)))  # 1-D rhs
    mm(b.input("x1", dtype, ("k",)), b.input("y1", dtype, ("k",)))  # dot -> scalar
    # Gemm
    for ta, tb, bias, alpha, beta in [(0, 0, None, 1.0, 1.0), (1, 0, "mn", 0.5, 2.0), (0, 1, "n", 1.5, 1.0),
                                      (1, 1, "1", 1.0, -0.5), (0, 0, "m1", 1.0, 1.0)]:
        i = b.n
        ga = b.input(f"ga{i}", dtype, ("k", "m") if ta else ("m", "k"))
        gb = b.input(f"gb{i}", dtype, ("n", "k") if tb else ("k", "n"))
        ins = [ga, gb]
        if bias is not None:
            shape = {"mn": ("m", "n"), "n": ("n",), "1": (1,), "m1": ("m", 1)}[bias]
            ins.append(b.input(f"gc{i}", dtype, shape))
        b.node("Gemm", ins, {"transA": ta, "transB": tb, "alpha": alpha, "beta": beta})
    return b


def build_attention(dtype: str = "float32") -> Builder:
    """Attention 4-D / 3-D, GQA, causal with past, bool / float / short masks, softcap, scale, outputs."""
    b = Builder(f"attention_{dtype}", {"batch": (1, 2), "seq": (1, 9), "past_seq": (0, 12)})
    D = 16
    # 4-D GQA (4 q heads, 2 kv heads), causal with past, present outputs
    q = b.input("q", dtype, ("batch", 4, "seq", D))
    k = b.input("k", dtype, ("batch", 2, "seq", D))
    v = b.input("v", dtype, ("batch", 2, "seq", D))
    pk = b.input("pk", dtype, ("batch", 2, "past_seq", D))
    pv = b.input("pv", dtype, ("batch", 2, "past_seq", D))
    b.node("Attention", [q, k, v, None, pk, pv], {"is_causal": 1}, outputs=3)
    # 4-D, bool mask [batch, 1, seq, total] broadcast over heads, no causal, Dv != Dk
    v24 = b.input("v24", dtype, ("batch", 2, "seq", 24))
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    bm = b.input("bmask", "bool", ("batch", 1, "seq", total))
    b.node("Attention", [q, k, v24, bm, pk, b.input("pv24", dtype, ("batch", 2, "past_seq", 24))], outputs=1)
    # float additive mask [seq, seq] (2-D), scale and softcap, no past
    fm = b.input("fmask", dtype, ("seq", "seq"))
    b.node("Attention", [q, k, v, fm], {"scale": 0.3, "softcap": 2.0}, outputs=1)
    # a mask shorter than the keys (padded with -inf): [1, 1, 1, seq] against past + seq keys
    sm = b.input("smask", "bool", (1, 1, 1, "seq"))
    b.node("Attention", [q, k, v, sm, pk, pv], {"is_causal": 1}, outputs=1)
    # 3-D [B, S, H*D] inputs: 6 q heads, 3 kv heads, causal with past
    q3 = b.input("q3", dtype, ("batch", "seq", 6 * D))
    k3 = b.input("k3", dtype, ("batch", "seq", 3 * D))
    v3 = b.input("v3", dtype, ("batch", "seq", 3 * D))
    pk3 = b.input("pk3", dtype, ("batch", 3, "past_seq", D))
    pv3 = b.input("pv3", dtype, ("batch", 3, "past_seq", D))
    b.node("Attention", [q3, k3, v3, None, pk3, pv3], {"is_causal": 1, "q_num_heads": 6, "kv_num_heads": 3},
           outputs=3)
    # qk outputs: every mode
    for mode in range(4):
        b.node("Attention", [q, k, v, fm], {"qk_matmul_output_mode": mode, "softcap": 1.5 if mode else 0.0,
                                            "is_causal": 1}, outputs=4, returned=[True, False, False, True])
    return b


def left_padded_mask(kind: str):
    """Generator of a [B, 1, S, T] mask: batch row b masks its first pad_b keys (left padding, random),
    batch row 0 masks every key when B > 1 (a fully masked row: the output is 0); bool (True = attend)
    or additive (0 or a small negative bias where attended, -inf where masked)."""

    def gen(rng, shape):
        b, _, _, t = shape
        pads = rng.integers(0, max(1, t), b)
        if b > 1:
            pads[0] = t
        keep = np.arange(t)[None, :] >= pads[:, None]  # [B, T]
        keep = np.broadcast_to(keep[:, None, None, :], shape)
        if kind == "bool":
            return keep.copy()
        bias = -rng.uniform(0.0, 1.0, shape).astype(np.float32)
        return np.where(keep, bias, -np.inf).astype(kind)

    return gen


DECODE_UPPER = {"batch": 5, "seq": 3, "past_seq": 4100}


def build_attention_decode(dtype: str = "float16") -> Builder:
    """Decode-shaped Attention (the compiler's decoders: K/V are the cache views [B, Hk, past + seq, D],
    the query has seq = 1 at decode, a few rows for chunks): GQA groups 1, 4, 8, head dims 64 and 128,
    bool / additive left-padded masks, causal, past inputs, 3-D inputs, the [B, S, H*D] output layout.
    Plus two nodes the decode kernel must hand to attention_rows: K stored transposed (a non-unit
    head-dim stride, declined at code generation) and `k_odd`, whose rows the GPU test lays out with an
    odd stride (not 16-byte aligned: attention_decode checks that at run time and runs attention_rows)."""
    b = Builder(f"attention_decode_{dtype}", {k: (1 if k != "past_seq" else 0, v) for k, v in DECODE_UPPER.items()})
    hk = 2
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    mask = lambda name, kind, heads=1: b.input(name, kind, ("batch", heads, "seq", total),  # noqa: E731
                                               gen=left_padded_mask(kind))
    kv = {}
    for d in (64, 128):
        kv[d] = (b.input(f"k{d}", dtype, ("batch", hk, total, d)), b.input(f"v{d}", dtype, ("batch", hk, total, d)))
    qs = {(d, g): b.input(f"q{d}_g{g}", dtype, ("batch", g * hk, "seq", d)) for d in (64, 128) for g in (1, 4, 8)}
    add64, bool128 = mask("amask", dtype), mask("bmask", "bool")
    # group 1 (MHA), additive mask, the compiler's [B, S, H*D] output
    b.node("Attention", [qs[64, 1], *kv[64], add64], {"out_bshd": 1})
    # group 4, additive mask broadcast over heads; group 8, bool mask
    b.node("Attention", [qs[64, 4], *kv[64], add64])
    b.node("Attention", [qs[64, 8], *kv[64], mask("bmask64", "bool")], {"out_bshd": 1})
    b.node("Attention", [qs[128, 8], *kv[128], bool128])
    # group 4, no mask, a scale; group 1, causal (no past: keys up to the row index) with a bool mask
    b.node("Attention", [qs[128, 4], *kv[128]], {"scale": 0.05})
    b.node("Attention", [qs[128, 1], *kv[128], bool128], {"is_causal": 1})
    # a per-head additive mask [B, Hq, S, T]
    b.node("Attention", [qs[64, 4], *kv[64], mask("hmask", dtype, heads=4 * hk)])
    # past inputs (the cache) + new keys, causal, bool mask over past + new
    pk = b.input("pk", dtype, ("batch", hk, "past_seq", 128))
    pv = b.input("pv", dtype, ("batch", hk, "past_seq", 128))
    kn = b.input("kn", dtype, ("batch", hk, "seq", 128))
    vn = b.input("vn", dtype, ("batch", hk, "seq", 128))
    b.node("Attention", [qs[128, 4], kn, vn, bool128, pk, pv], {"is_causal": 1})
    # 3-D inputs [B, S, H*D]: 8 query heads over 2 kv heads, additive mask
    q3 = b.input("q3", dtype, ("batch", "seq", 8 * 64))
    k3 = b.input("k3", dtype, ("batch", total, hk * 64))
    v3 = b.input("v3", dtype, ("batch", total, hk * 64))
    b.node("Attention", [q3, k3, v3, add64], {"q_num_heads": 8, "kv_num_heads": hk})
    # head dim 256 (the largest the decode kernel takes), group 4
    b.node("Attention", [b.input("q256", dtype, ("batch", 4 * hk, "seq", 256)),
                         b.input("k256", dtype, ("batch", hk, total, 256)),
                         b.input("v256", dtype, ("batch", hk, total, 256)), add64])
    # handed to attention_rows: K transposed (declined), k_odd with unaligned rows (run-time check)
    b.node("Attention", [qs[64, 4], b.input("kt", dtype, ("batch", hk, total, 64)), kv[64][1], add64])
    b.node("Attention", [qs[64, 4], b.input("k_odd", dtype, ("batch", hk, total, 64)), kv[64][1], add64])
    return b


def left_padded_keys(dtype: str):
    """Generator of attention_mask [B, T] (0/1): row b hides its first pad_b keys (random), row 1 hides
    every key when B > 1 (all-hidden rows: the export's fill decides their output), row 0 none."""

    def gen(rng, shape):
        b, t = shape
        pads = rng.integers(0, max(1, t), b)
        pads[0] = 0
        if b > 1:
            pads[1] = t
        return (np.arange(t)[None, :] >= pads[:, None]).astype(to_numpy(dtype))

    return gen


KEYS_UPPER = {"batch": 5, "seq": 9, "past_seq": 300}
F32_MIN = float(np.finfo(np.float32).min)


def build_attention_keys(dtype: str = "float16") -> Builder:
    """Attention with key_mask=1 (mask-as-lengths): attention_mask [B, T] (int64, int32, bool) read by
    the kernel, which applies causal / window itself; the fills the exports use (float32 min, float16
    min, -inf: the causal key range is then cut short); GQA groups 1 / 2 / 4, head dims 64 / 128; K/V as
    cache views [B, Hk, past + seq, D], queries the last seq positions (prefill, chunk, decode shapes)."""
    b = Builder(f"attention_keys_{dtype}", {k: (1 if k != "past_seq" else 0, v) for k, v in KEYS_UPPER.items()})
    hk = 2
    total = S.add(S.sym("past_seq"), S.sym("seq"))
    am = {t: b.input(f"am_{t}", t, ("batch", total), gen=left_padded_keys(t)) for t in ("int64", "int32", "bool")}
    kv = {d: (b.input(f"k{d}", dtype, ("batch", hk, total, d)), b.input(f"v{d}", dtype, ("batch", hk, total, d)))
          for d in (64, 128)}
    q = lambda d, g: b.input(f"q{d}_g{g}_{b.n}", dtype, ("batch", g * hk, "seq", d))  # noqa: E731
    keys = lambda causal, window, fill: {"key_mask": 1, "causal": causal, "window": window,  # noqa: E731
                                         "mask_fill": fill}
    # Llama-like: causal, float32 min fill, group 4, the [B, S, H*D] output
    b.node("Attention", [q(64, 4), *kv[64], am["int64"]], {**keys(1, 0, F32_MIN), "out_bshd": 1})
    # Mistral-like: causal + window 5, -inf fill (keys past a row's position skipped), group 1
    b.node("Attention", [q(128, 1), *kv[128], am["int64"]], {**keys(1, 5, float("-inf")), "scale": 0.05})
    # an fp16 export's fill, group 2, int32 mask
    b.node("Attention", [q(64, 2), *kv[64], am["int32"]], keys(1, 0, -65504.0))
    # encoder-like: padding only (causal 0), bool mask, -inf fill (all-hidden rows: 0)
    b.node("Attention", [q(128, 4), *kv[128], am["bool"]], keys(0, 0, float("-inf")))
    # bidirectional with a window and float32 min fill
    b.node("Attention", [q(64, 1), *kv[64], am["int64"]], keys(0, 3, F32_MIN))
    return b


KEYS_PADDED = {"k64", "v64", "k128", "v128"}


# values of build_attention_decode laid out as KV-cache views (rows at the maxima's strides)
DECODE_PADDED = {"k64", "v64", "k128", "v128", "k256", "v256", "pk", "pv", "kn", "vn", "k3", "v3", "k_odd"}
DECODE_TRANSPOSED = {"kt"}


def build_rotary(dtype: str = "float32") -> Builder:
    """RotaryEmbedding: 4-D / 3-D, position ids or per-token caches, interleaved, partial rotary."""
    b = Builder(f"rotary_{dtype}", {"batch": (1, 3), "seq": (1, 11)})
    max_pos, D = 32, 16
    pos_gen = lambda rng, shape: rng.integers(0, max_pos, shape).astype(np.int64)  # noqa: E731
    for i, (rank, interleaved, rot, with_pos) in enumerate([(4, 0, 0, True), (4, 1, 0, True), (3, 0, 8, True),
                                                            (3, 1, 12, False), (4, 0, 8, False)]):
        half = (rot or D) // 2
        x = b.input(f"x{i}", dtype, ("batch", 3, "seq", D) if rank == 4 else ("batch", "seq", 3 * D))
        if with_pos:
            cos = b.input(f"cos{i}", dtype, (max_pos, half))
            sin = b.input(f"sin{i}", dtype, (max_pos, half))
            pos = b.input(f"pos{i}", "int64", ("batch", "seq"), gen=pos_gen)
            ins = [x, cos, sin, pos]
        else:
            ins = [x, b.input(f"cos{i}", dtype, ("batch", "seq", half)),
                   b.input(f"sin{i}", dtype, ("batch", "seq", half))]
        b.node("RotaryEmbedding", ins, {"interleaved": interleaved, "rotary_embedding_dim": rot,
                                        "num_heads": 3 if rank == 3 else 0})
    return b


KV = {"layers": 2, "max_batch": 2, "kv_heads": 2, "max_seq": 16, "head_dim": 8}


def build_kv(dtype: str = "float32", attention: bool = True) -> Builder:
    """KVAppend of keys (layer 1) and values (layer 0); optionally an Attention reading both cache views."""
    b = Builder(f"kv_{dtype}", {"batch": (1, KV["max_batch"]), "seq": (1, 6), "past_seq": (0, 10)})
    h, d = KV["kv_heads"], KV["head_dim"]
    past = S.sym("past_seq")
    kn = b.input("k_new", dtype, ("batch", h, "seq", d))
    vn = b.input("v_new", dtype, ("batch", h, "seq", d))
    (pk,) = b.node("KVAppend", [kn], {"layer": 1, "kind": "key", "past": past})
    (pv,) = b.node("KVAppend", [vn], {"layer": 0, "kind": "value", "past": past})
    if attention:
        q = b.input("q", dtype, ("batch", 2 * h, "seq", d))
        mask = b.input("mask", "bool", ("batch", 1, "seq", S.add(past, S.sym("seq"))))
        b.node("Attention", [q, pk, pv, mask])
    return b


# -- plans -------------------------------------------------------------------------------------


def kv_spec(dtype: str, offset: int, kv: dict = KV) -> dict:
    return {**kv, "offset": offset, "dtype": dtype}


def plan_for(graph: Graph, upper: dict[str, int], kv_cache: np.ndarray | None = None, *,
             transposed=(), padded=(), kv: dict = KV) -> tuple[MemoryPlan, int | None]:
    """A trivial plan (every value its own buffer) with views: cache outputs (KVAppend's, the present
    outputs of QKVRotary / NormLinearRotary) on their cache slot of geometry kv, values named in
    `transposed` stored with their last two dims swapped, values named in `padded` laid out as at their
    maximal shape (row strides of a cache view)."""
    from atlasc.passes.plan_memory import cache_kind

    plan = MemoryPlan(symbols=tuple(graph.symbols))
    off = align(8 * max(1, len(plan.symbols)))
    kv_offset = None
    if kv_cache is not None:
        kv_offset = off
        off = align(off + kv_cache.nbytes)
    kv_out = {o.name: (n.attrs["layer"], cache_kind(n, i)) for n in graph.nodes for i, o in enumerate(n.outputs)
              if cache_kind(n, i) is not None}
    for v in graph.all_values():
        if v.name in plan.placements:
            continue
        item = to_numpy(v.dtype).itemsize
        up = [S.evaluate(d, upper) for d in v.shape]
        n = int(np.prod(up, dtype=np.int64)) * item
        if v.name in kv_out:
            spec = kv_spec(str(kv_cache.dtype), kv_offset, kv)
            strides = (kv["kv_heads"] * kv["max_seq"] * kv["head_dim"], kv["max_seq"] * kv["head_dim"],
                       kv["head_dim"], 1)
            slot = kv_slot_offset(spec, *kv_out[v.name])
            plan.placements[v.name] = Placement("kv_cache", slot, n, strides)
            continue
        strides = None
        if v.name in transposed:
            shape = list(v.shape)
            swapped = shape[:-2] + [shape[-1], shape[-2]]
            st = [S.dim(1)] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                st[i] = S.mul(st[i + 1], swapped[i + 1])
            st[-2], st[-1] = st[-1], st[-2]
            strides = tuple(st)
        elif v.name in padded:
            st = [1] * len(up)
            for i in range(len(up) - 2, -1, -1):
                st[i] = st[i + 1] * up[i + 1]
            strides = tuple(st)
        plan.placements[v.name] = Placement("activations", off, n, strides)
        off = align(off + max(n, 1))
    plan.arena_bytes = off
    return plan, kv_offset


def kv_state(dtype: str) -> np.ndarray:
    shape = (KV["layers"], 2, KV["max_batch"], KV["kv_heads"], KV["max_seq"], KV["head_dim"])
    return np.zeros(shape, to_numpy(dtype))


def planned(builder: Builder, dtype: str = "float32", **plan_kw):
    """(graph, plan, kv spec or None) for builder's graph."""
    graph = builder.done()
    kv = kv_state(dtype) if any(n.op == "KVAppend" for n in graph.nodes) else None
    plan, kv_offset = plan_for(graph, builder.upper, kv, **plan_kw)
    return graph, plan, (kv_spec(dtype, kv_offset) if kv is not None else None)


def generate(*builders: Builder, dtype: str = "float32", plan_kw: dict | None = None):
    """One module with an entry per builder (named by its graph); plan_kw: builder name -> plan_for options."""
    entries, upper, spec = {}, {}, None
    for b in builders:
        graph, plan, kv = planned(b, dtype, **(plan_kw or {}).get(b.g.name, {}))
        entries[b.g.name] = (graph, plan)
        upper[b.g.name] = b.upper
        spec = kv or spec
    return generate_module(entries, upper, spec)


def compile_or_skip(source: str):
    from atlasc.codegen.nvcc import NvccNotFoundError, compile_cubins

    try:
        cubins = compile_cubins(source, ARCHS)
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    assert set(cubins) == set(ARCHS) and all(cubins.values())
    return cubins


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_matmul_gemm_compile(dtype):
    b = build_matmul(dtype)
    mod = generate(b, dtype=dtype, plan_kw={b.g.name: {"transposed": {"a2", "b3", "ga8"}}})
    launches = mod.launches[b.g.name]
    assert len(launches) == 12
    assert all(launch.block == (256, 1, 1) for launch in launches)
    assert mod.source.count("atlas::matmul_tiled<") == 12
    compile_or_skip(mod.source)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_rotary_kv_compile(dtype):
    """Attention, RotaryEmbedding and KVAppend variants in one module per dtype (three entries)."""
    att, rot, kv = build_attention(dtype), build_rotary(dtype), build_kv(dtype)
    mod = generate(att, rot, kv, dtype=dtype,
                   plan_kw={att.g.name: {"padded": {"k", "v"}}, rot.g.name: {"transposed": {"x0"}}})
    # the default path: attention_decode where it applies (2 nodes), attention_rows for the other 7;
    # counts include the prelude's template text once
    assert mod.source.count("atlas::attention_rows<") == 8 and mod.source.count("atlas::attention_decode<") == 2
    assert mod.source.count("atlas::rotary<") == 5 and mod.source.count("atlas::kv_append<") == 2
    compile_or_skip(mod.source)


def test_attention_launch_shape():
    b = build_attention("float16")
    launch = generate(b, dtype="float16").launches[b.g.name][0]
    # one block per (batch, q head, query row) at the maxima: 2 * 4 * 9
    assert launch.grid == (72, 1, 1) and launch.block == (128, 1, 1)
    assert launch.smem == 4 * (16 + 4 * (16 + 2))


def test_kv_append_must_sit_on_the_cache():
    b = build_kv("float32", attention=False)
    graph, plan, spec = planned(b)
    generate_module({"run": (graph, plan)}, {"run": b.upper}, spec)  # fine as planned
    out = graph.nodes[0].outputs[0]
    p = plan.placements[out.name]
    plan.placements[out.name] = Placement(p.region, p.offset + 256, p.nbytes, p.strides)
    with pytest.raises(CodegenError, match="cache slot"):
        generate_module({"run": (graph, plan)}, {"run": b.upper}, spec)
    plan.placements[out.name] = p
    with pytest.raises(CodegenError, match="KV cache"):
        generate_module({"run": (graph, plan)}, {"run": b.upper}, None)
    with pytest.raises(CodegenError, match="float16 cache"):
        generate_module({"run": (graph, plan)}, {"run": b.upper}, {**spec, "dtype": "float16"})


def test_unsupported_variants_raise():
    b = Builder("bad", {"n": (1, 4)})
    x = b.input("x", "int32", ("n", 4, "n", 8))
    b.node("Attention", [x, x, x])
    graph, plan, _ = planned(b)
    with pytest.raises(CodegenError, match="Attention on int32"):
        generate_module({"run": (graph, plan)}, {"run": b.upper})


def test_snapshot_matmul_kv_append():
    """The wrappers generated for a MatMul + KVAppend graph equal tests/snapshots/matmul_kv_append.cu.

    Only the part after the shared library text (common.cuh and every family's .cu) is pinned, so other
    families' template edits do not churn it. To regenerate on purpose after a deliberate codegen
    change: `ATLAS_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_codegen_matmul_attention.py -k snapshot`.
    """
    b = Builder("snap", {"m": (1, 64), "past_seq": (0, 8), "seq": (1, 8), "batch": (1, 2)})
    b.node("MatMul", [b.input("a", "float16", ("m", 32)), b.input("w", "float16", (32, 48))])
    b.node("KVAppend", [b.input("k", "float16", ("batch", 2, "seq", 8))],
           {"layer": 1, "kind": "value", "past": S.sym("past_seq")})
    mod = generate(b, dtype="float16")
    from atlasc.codegen.generate import HERE, _load_families

    prefix = "\n".join(["// generated by atlasc: do not edit", (HERE / "common.cuh").read_text(), *_load_families()])
    assert mod.source.startswith(prefix)
    text = mod.source[len(prefix):]
    path = SNAPSHOTS / "matmul_kv_append.cu"
    if os.environ.get("ATLAS_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing snapshot {path}: run with ATLAS_UPDATE_SNAPSHOTS=1 to create it"
    assert text == path.read_text(), "generated code changed: if on purpose, rerun with ATLAS_UPDATE_SNAPSHOTS=1"


# -- the decode attention path (ATLAS_ATTENTION_PATH=fast) ---------------------------------------


def _kernels_of(source: str) -> list[str]:
    import re

    return re.findall(r"atlas::attention_(decode|rows)<", source)


def _kernel_text(mod, launch) -> str:
    """The body of a launch's kernel in a generated module (from its definition to the next kernel)."""
    start = mod.source.index(f" {launch.kernel}(unsigned char* __restrict__ arena) {{")
    end = mod.source.find('extern "C"', start)
    return mod.source[start:end if end >= 0 else None]


def test_attention_path_env(monkeypatch):
    """fast is the default (GPU-validated, docs/perf.md v5); rows forces attention_rows everywhere;
    anything else is a CodegenError naming the variable."""
    b = build_attention_decode("float16")
    monkeypatch.delenv("ATLAS_ATTENTION_PATH", raising=False)
    default = generate(b, dtype="float16").source
    assert "decode" in _kernels_of(default)
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "fast")
    assert generate(b, dtype="float16").source == default
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "rows")
    assert set(_kernels_of(generate(b, dtype="float16").source)) == {"rows"}
    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "flash")
    with pytest.raises(CodegenError, match="ATLAS_ATTENTION_PATH='flash'"):
        generate(b, dtype="float16")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_fast_falls_back(monkeypatch, dtype):
    """With ATLAS_ATTENTION_PATH=fast, only the variants attention_decode handles get it: softcap, qk and
    present outputs, Dv != Dk and a transposed K keep attention_rows (fast_decline says why)."""
    from atlasc.codegen import attention

    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "fast")
    att = build_attention(dtype)
    graph, plan, _ = planned(att)
    reasons = {}
    for node in graph.nodes:
        from atlasc.codegen.generate import KernelContext

        ctx = KernelContext(node, plan, att.upper, "k", None)
        reasons[node.name] = attention.fast_decline(ctx, node)
    # build_attention: 1 present outputs, 2 Dv 24 != Dk 16, 3 softcap, 4 short mask + past + causal
    # (fast), 5 3-D with present outputs, 6-9 qk outputs (7-9 with a softcap)
    assert reasons["attention1"] == "present or qk outputs"
    assert reasons["attention2"].startswith("head dims")
    assert reasons["attention3"] == "softcap"
    assert reasons["attention4"] is None
    assert reasons["attention5"] == "present or qk outputs"
    assert reasons["attention6"] == "present or qk outputs"  # qk mode 0; modes 1-3 also have a softcap
    assert all(reasons[f"attention{i}"] in ("softcap", "present or qk outputs") for i in range(7, 10))
    assert _kernels_of(generate(att, dtype=dtype).source) == ["rows"] * 3 + ["decode"] + ["rows"] * 5

    dec = build_attention_decode(dtype)
    mod = generate(dec, dtype=dtype, plan_kw={dec.g.name: {"padded": DECODE_PADDED, "transposed": DECODE_TRANSPOSED}})
    kinds = _kernels_of(mod.source)
    # the transposed K (second to last node) is declined; k_odd is only known unaligned at run time
    assert kinds == ["decode"] * 10 + ["rows", "decode"]
    launches = mod.launches[dec.g.name]
    assert all(launch.block == (attention.FAST_WARPS * 32, 1, 1) for i, launch in enumerate(launches) if i != 10)
    # q64 group 4 over 2 kv heads at batch 5, seq 3: 4 * 3 = 12 rows per kv head -> 2 tiles of 8
    assert launches[1].grid == (5 * 2 * 2, 1, 1)
    assert launches[1].smem == max(attention.fast_smem(64, 8), 4 * (64 + 8 * 66))
    # a head dim attention_decode cannot split: 24 (fp16 or fp32 lanes would not pack into a warp)
    assert attention.fast_v_elems(24, 2) is None and attention.fast_v_elems(128, 2) == 4
    assert attention.fast_v_elems(96, 2) == 1 and attention.fast_v_elems(256, 4) == 4


def _nvcc_log(source: str, arch: str, tmp_path) -> str:
    """nvcc's output (with the compiler's own flags, -warn-spills among them) for one arch."""
    import subprocess
    import tempfile

    from atlasc.codegen.nvcc import NvccNotFoundError, flags, nvcc_path

    try:
        exe = nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    work = tempfile.mkdtemp(dir=tmp_path)  # its own folder: _nvcc_logs runs several at once
    src = os.path.join(work, f"{arch}.cu")
    with open(src, "w") as f:
        f.write(source)
    proc = subprocess.run([exe, *flags(arch), "-Xptxas=-v", f"{arch}.cu", "-o", f"{arch}.cubin"], capture_output=True,
                          text=True, cwd=work, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr + proc.stdout


def _nvcc_logs(jobs: list[tuple[str, str]], tmp_path) -> list[str]:
    """_nvcc_log of each (source, arch), compiled in parallel (one nvcc per core): the spill tests'
    several big modules take a fraction of the time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: _nvcc_log(job[0], job[1], tmp_path), jobs))


@pytest.mark.parametrize("arch", arch_params("sm90", "sm80"))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_decode_compiles_without_spills(monkeypatch, tmp_path, dtype, arch):
    """The decode kernels (head dims 8 to 256, GQA, masks, causal, past) compile for the arch and ptxas
    reports no spills (the wrapper declaration's launch bounds let it take up to 255 registers)."""
    import re

    monkeypatch.setenv("ATLAS_ATTENTION_PATH", "fast")
    dec, att, kv = build_attention_decode(dtype), build_attention(dtype), build_kv(dtype)
    mod = generate(dec, att, kv, dtype=dtype,
                   plan_kw={dec.g.name: {"padded": DECODE_PADDED, "transposed": DECODE_TRANSPOSED},
                            att.g.name: {"padded": {"k", "v"}}})
    assert _kernels_of(mod.source).count("decode") == 11 + 1 + 1
    log = _nvcc_log(mod.source, arch, tmp_path)
    assert "spill" not in log.replace("0 bytes spill", ""), log[-3000:]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255


def test_attention_decode_sequence_split():
    """Generated for one query position (seq upper 1), attention_decode may cut a row's keys into up
    to FAST_MAX_SPLIT runs (its partials and counters in the module's scratch, after the arena); with
    more query rows than one tile holds (seq upper 3 with GQA groups 4 and 8) it does not."""
    import re

    from atlasc.codegen import attention

    b = build_attention_decode("float16")
    graph, plan, _ = planned(b, "float16", padded=DECODE_PADDED, transposed=DECODE_TRANSPOSED)
    one = generate_module({"d": (graph, plan)}, {"d": {**DECODE_UPPER, "seq": 1}})
    # SPLIT, then the defaults or MIN_KEYS, VPF, MMA (tensor cores at head dims 64 / 128), WMERGE and TARGET (one
    # wave: the 8-warp tensor-core kernels)
    split = re.compile(rf", {attention.FAST_MAX_SPLIT}(, \w+, \d+, \w+, \w+(, \w+, (\d+))?)?>"
                       r"\(args, att_ws, att_cnt\);")
    found = split.findall(one.source)
    assert len(found) == 11  # every attention_decode node (the transposed K is declined)
    assert {target for _, _, target in found} == {"", str(attention.SPLIT_WAVE_SMS)}  # SIMT / 4 warps: the default
    assert one.scratch_bytes > 0 and one.scratch_offset >= plan.arena_bytes
    assert one.arena_bytes == one.scratch_offset + one.scratch_bytes
    # every kernel's counters at the scratch's start, its partials past the counters' area: a kernel with more
    # items (another batch bucket, another node) never finds another kernel's partial sums in its counters
    from atlasc.codegen.generate import COUNTER_BYTES

    assert set(re.findall(r"att_cnt = reinterpret_cast<unsigned int\*>\(arena \+ (\d+)LL\)", one.source)) == \
        {str(one.scratch_offset)}
    assert set(re.findall(r"att_ws = reinterpret_cast<float\*>\(arena \+ (\d+)LL\)", one.source)) == \
        {str(one.scratch_offset + COUNTER_BYTES)}
    # the grid: the split's target (batch 5 x 2 kv heads x 32 runs would be 320), never fewer than items
    assert max(launch.grid[0] for launch in one.launches["d"]) == attention.FAST_SPLIT_TARGET == 256
    assert attention.SPLIT_WAVE_SMS in {launch.grid[0] for launch in one.launches["d"]}
    cu = (Path(attention.__file__).parent / "attention.cu").read_text()
    assert f"ATT_SPLIT_TARGET = {attention.FAST_SPLIT_TARGET};" in cu
    # the defaults decode_template_tail leaves out are attention.cu's
    assert f"ATT_SPLIT_MIN_KEYS = {attention.FAST_SPLIT_MIN_KEYS};" in cu
    assert f"int MIN_KEYS = ATT_SPLIT_MIN_KEYS, bool VPF = {str(attention.FAST_VPREFETCH).lower()}, " in cu
    assert "bool VPF = true, bool MMA = false," in cu  # MMA spelled out where it applies
    assert f"bool WMERGE = {str(attention.WARP_MERGE).lower()}, int TARGET = ATT_SPLIT_TARGET>" in cu
    three = generate_module({"d": (graph, plan)}, {"d": DECODE_UPPER})
    assert 0 < len(split.findall(three.source)) < 11  # group 1: 3 rows fit one tile, the others do not
    # prefill-sized maxima never split (their scratch would be huge)
    assert attention.fast_split(rows_up=4 * 4352, r=4, items_up=32 * 8 * 4352, d=128) == 1
    assert attention.fast_split(rows_up=4, r=4, items_up=32 * 8, d=128) == attention.FAST_MAX_SPLIT
    compile_or_skip(one.source)


def test_attention_early_kv_prefetches_before_the_wait(monkeypatch, tmp_path):
    """ATLAS_ATTENTION_EARLY_KV=1: every decode attention_decode kernel (one query position) first binds its args in
    a scope of its own and calls attention_prefetch_kv with the same D / R / flags / SPLIT / MIN_KEYS and the
    elements of each K / V (and past) value's allocation, all before its pdl_enter; kernels for more query positions
    do not, and unset or 0 the module is the default's, byte for byte. It compiles for sm80 (no code there) and sm90
    without spills; any other value is a CodegenError naming the switch."""
    import re

    from atlasc.codegen import attention

    b = build_attention_decode("float16")
    graph, plan, _ = planned(b, "float16", padded=DECODE_PADDED, transposed=DECODE_TRANSPOSED)

    def source(upper: dict, value: str | None) -> str:
        if value is None:
            monkeypatch.delenv(attention.EARLY_KV_ENV, raising=False)
        else:
            monkeypatch.setenv(attention.EARLY_KV_ENV, value)
        return generate_module({"d": (graph, plan)}, {"d": upper}).source

    decode = {**DECODE_UPPER, "seq": 1}
    default = source(decode, None)
    assert "attention_prefetch_kv<" not in default
    assert source(decode, "0") == default
    early = source(decode, "1")
    calls = 0
    for node in graph.nodes:
        start = early.index(f"\n// {node.name}: ")
        kernel = early[start:early.index("\n}\n", start)]
        if "atlas::attention_decode<" not in kernel:
            continue
        calls += 1
        prefetch = re.search(r"atlas::attention_prefetch_kv<__half, \w+, (\d+), (\d+), (\w+), (\w+), (\d+), (\d+), "
                             r"(\d+)>\(args, (\d+)LL, (\d+)LL, (\d+)LL, (\d+)LL\);", kernel)
        assert prefetch, kernel[:400]
        assert prefetch.start() < kernel.index("atlas::pdl_enter();")
        d, r, has_past, causal, split, min_keys, target, ke, ve, pke, pve = prefetch.groups()
        assert int(split) == attention.FAST_MAX_SPLIT and int(min_keys) == attention.FAST_SPLIT_MIN_KEYS
        # the decode call's TARGET (the template's tenth argument after the flags, given only where not the
        # default), so that both cut the same runs
        tail = re.search(r"atlas::attention_decode<[^>]*, 32, \w+, \d+, \w+, \w+, \w+, (\d+)>\(args", kernel)
        assert target == (tail.group(1) if tail else str(attention.FAST_SPLIT_TARGET))
        call = re.search(r"atlas::attention_decode<__half, \w+, (\d+), \d+, (\d+), \d+, \d+, (\w+), \w+, (\w+),",
                         kernel)
        assert call.groups() == (d, r, has_past, causal)
        ins = list(node.inputs) + [None] * 6
        want = [plan.placement(v).nbytes // 2 if v is not None else 0 for v in (ins[1], ins[2], ins[4], ins[5])]
        assert [int(ke), int(ve), int(pke), int(pve)] == want and min(want[:2]) > 0
        assert (want[2] > 0) == (has_past == "true")
    assert calls == 11 and early.count("attention_prefetch_kv<") == 11
    assert "attention_prefetch_kv<" not in source(DECODE_UPPER, "1")  # up to 3 query positions: not a decode step
    log = _nvcc_log(early, "sm90", tmp_path)
    assert "spill" not in log.replace("0 bytes spill", ""), log[-3000:]
    compile_or_skip(early)
    for bad in ("2", "yes"):
        monkeypatch.setenv(attention.EARLY_KV_ENV, bad)
        with pytest.raises(CodegenError, match=attention.EARLY_KV_ENV):
            attention.early_kv_setting()


@pytest.mark.parametrize("max_batch", [8, 32])
def test_attention_early_kv_keeps_the_kernels_shared(monkeypatch, max_batch):
    """ATLAS_ATTENTION_EARLY_KV=1 adds no kernel to a decoder's module: the prefetch's bounds (its K / V cache slots'
    sizes) are the same in every layer and batch bucket, so the layers' attention kernels share as without it
    (a batch bound from the bucket once made each layer's batch-1 attention a kernel of its own)."""
    from atlasc.compiler import program_module
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline

    from conftest import FIXTURES

    opts = CompileOptions(archs=("sm90",), max_batch=max_batch, max_seq=64)
    program, _ = run_pipeline(Program({"main": import_onnx(FIXTURES / "llama-fp16.onnx")}, opts))
    counts = {}
    for value in ("0", "1"):
        monkeypatch.setenv("ATLAS_ATTENTION_EARLY_KV", value)
        module = program_module(program, opts.archs)
        counts[value] = (len(module.kernels), module.source.count("attention_prefetch_kv<"))
    assert counts["0"][0] == counts["1"][0] and counts["0"][1] == 0 and counts["1"][1] > 0, counts


@pytest.mark.parametrize("path", ["fast", "rows"])
def test_attention_key_mask_compiles(monkeypatch, path):
    """key_mask=1 nodes (mask-as-lengths) generate the KEYS kernels on both paths, for prefill-sized
    maxima and for decode (seq 1: the sequence split), fp32 and fp16, and compile for sm80 and sm90.
    The attention_mask itself is the kernel's mask view: no [B, 1, S, T] tensor is read."""
    import re

    monkeypatch.setenv("ATLAS_ATTENTION_PATH", path)
    kernel = "attention_decode" if path == "fast" else "attention_rows"
    sources = []
    for dtype in ("float32", "float16"):
        b = build_attention_keys(dtype)
        graph, plan, _ = planned(b, dtype, padded=KEYS_PADDED)
        for upper in (KEYS_UPPER, {**KEYS_UPPER, "seq": 1}):
            mod = generate_module({"k": (graph, plan)}, {"k": upper})
            calls = [line for line in mod.source.splitlines() if f"  atlas::{kernel}<" in line]
            assert len(calls) == 5 and all(re.search(r", true(, \d+)?>\(args(, att_ws, att_cnt)?\);$", line)
                                           for line in calls)
            assert mod.source.count("args.keys_fill = -INFINITY;") == 2
            assert mod.source.count("args.keys_window = 5LL;") == 1
            assert "atlas::View<long long, 4> mask;" in mod.source and "atlas::View<int, 4> mask;" in mod.source
            sources.append(mod.source)
    if path == "fast":
        assert any(", 32, true>(args, att_ws, att_cnt);" in src for src in sources)  # decode: split
    compile_or_skip(sources[1])
    compile_or_skip(sources[3])


def test_attention_key_mask_needs_attention_mask():
    b = Builder("bad_keys", {"batch": (1, 2), "seq": (1, 4)})
    q = b.input("q", "float32", ("batch", 2, "seq", 16))
    k = b.input("k", "float32", ("batch", 2, "seq", 16))
    m = b.input("m", "float32", ("batch", 1, "seq", "seq"))
    with pytest.raises(Exception, match="key_mask"):
        b.node("Attention", [q, k, k, m], {"key_mask": 1})


@pytest.mark.parametrize("value", ["0", "33", "x", "-1"])
def test_attention_split_env_rejects_bad_values(monkeypatch, value):
    """ATLAS_ATTENTION_SPLIT must be 1..FAST_MAX_SPLIT: anything else is a CodegenError naming it."""
    from atlasc.codegen import attention

    monkeypatch.setenv(attention.SPLIT_ENV, value)
    with pytest.raises(CodegenError, match="ATLAS_ATTENTION_SPLIT"):
        attention.fast_split(rows_up=4, r=4, items_up=8, d=64)
    monkeypatch.setenv(attention.SPLIT_ENV, "1")
    assert attention.fast_split(rows_up=4, r=4, items_up=8, d=64) == 1


@pytest.mark.parametrize("env,value", [("ATLAS_ATTENTION_SPLIT_MIN_KEYS", "0"),
                                       ("ATLAS_ATTENTION_SPLIT_MIN_KEYS", "x"),
                                       ("ATLAS_ATTENTION_VPREFETCH", "2"), ("ATLAS_ATTENTION_VPREFETCH", "yes"),
                                       ("ATLAS_ATTENTION_WARPS", "3"), ("ATLAS_ATTENTION_WARPS", "16"),
                                       ("ATLAS_ATTENTION_WARP_MERGE", "2")])
def test_attention_ab_env_rejects_bad_values(monkeypatch, env, value):
    """The short-context A/B switches take a key count (1 to 65536) / 0 or 1 / 2, 4 or 8 warps: else a
    CodegenError naming them."""
    from atlasc.codegen import attention

    monkeypatch.setenv(env, value)
    with pytest.raises(CodegenError, match=env):
        attention.decode_template_tail(32, False)
        attention.warps_setting()


def test_attention_decode_warps_by_head_dim_and_batch_bucket(monkeypatch):
    """attention_decode takes FAST_WARPS_WIDE (4) warps on tensor cores (float16 head dims 64 and 128) or at
    head dim 128 in a decode bucket's default kernel (batches above 8 of 32: the measured batch-32 win), or in
    any kernel of an entry that runs only above batch 8 (generate_module's `lower`), and FAST_WARPS (8) in the
    batch-1 / batch-8 kernels and for head dim 256 (SIMT, not measured); ATLAS_ATTENTION_WARPS=8 gives 8
    everywhere."""
    from atlasc.codegen import attention

    monkeypatch.setitem(DECODE_UPPER, "batch", 32)
    b = build_attention_decode("float16")
    graph, plan, _ = planned(b, "float16", padded=DECODE_PADDED, transposed=DECODE_TRANSPOSED)
    upper = {"d": {**DECODE_UPPER, "seq": 1}}
    heads = {}  # launch index -> head dim of its K
    for i, node in enumerate(n for n in graph.nodes if plan.needs_kernel(n)):
        k = node.inputs[1]
        heads[i] = k.shape[-1] if len(k.shape) == 4 else k.shape[-1] // node.attrs["kv_num_heads"]

    def warps(env: str | None, **kw) -> dict[int, tuple[int, list[int]]]:
        if env is None:
            monkeypatch.delenv(attention.WARPS_ENV, raising=False)
        else:
            monkeypatch.setenv(attention.WARPS_ENV, env)
        mod = generate_module({"d": (graph, plan)}, upper, **(kw or {"buckets": {"d": ("batch", (1, 8))}}))
        return {i: (launch.block[0] // 32, [v.block[0] // 32 for v in launch.variants])
                for i, launch in enumerate(mod.launches["d"]) if "attention_decode<" in _kernel_text(mod, launch)}

    auto = warps(None)
    for i, (default, variants) in auto.items():
        assert variants and all(v == attention.FAST_WARPS for v in variants), (i, variants)
        assert default == (attention.FAST_WARPS_WIDE if heads[i] in (64, 128) else attention.FAST_WARPS), (i, heads[i])
    assert {64, 128, 256} <= {heads[i] for i in auto}
    assert all(default == 8 and set(variants) == {8} for default, variants in warps("8").values())
    # no buckets, but the entry runs only above batch 8 (split-decode's `decode`): the same rule
    wide = warps(None, lower={"d": {"batch": 8}})
    assert wide.keys() == auto.keys() and all(wide[i][0] == auto[i][0] and not wide[i][1] for i in wide)
    assert all(default == 8 for default, _ in warps(None, lower={"d": {"batch": 4}}).values())
    assert attention.fast_warps(128, 0) == attention.fast_warps(64, 8) == attention.FAST_WARPS == 8


def _ab_sources(monkeypatch) -> tuple[str, str, str, str, str]:
    """The decode graph's source with v13's switches, the SIMT default, 4 and 2 warps, and the tensor-core
    default (see test_attention_ab_switches_change_only_their_kernels)."""
    import re

    from atlasc.codegen import attention

    b = build_attention_decode("float16")
    graph, plan, _ = planned(b, "float16", padded=DECODE_PADDED, transposed=DECODE_TRANSPOSED)
    upper = {"d": {**DECODE_UPPER, "seq": 1}}
    mma = generate_module({"d": (graph, plan)}, upper).source
    monkeypatch.setenv(attention.MMA_ENV, "0")
    default = generate_module({"d": (graph, plan)}, upper).source
    kernels = re.findall(r"attention_decode<__half, \w+, (\d+),[^>]*>", default)
    tails = re.findall(r"attention_decode<__half, \w+, (\d+),[^>]*?(, \d+, \w+, \d+, \w+, true(?:, true, 132)?)?>", mma)
    assert len(tails) == len(kernels) == 11
    assert all(bool(tail) == (d in ("64", "128")) for d, tail in tails) and sum(bool(t) for _, t in tails) >= 6
    monkeypatch.setenv(attention.MIN_KEYS_ENV, str(attention.FAST_SPLIT_MIN_KEYS))
    monkeypatch.setenv(attention.VPREFETCH_ENV, "1")
    assert generate_module({"d": (graph, plan)}, upper).source == default
    assert default.count(f", {attention.FAST_MAX_SPLIT}>(args, att_ws, att_cnt);") == 11
    monkeypatch.setenv(attention.MIN_KEYS_ENV, "64")
    monkeypatch.setenv(attention.VPREFETCH_ENV, "0")
    v13 = generate_module({"d": (graph, plan)}, upper).source
    assert v13.count(f", {attention.FAST_MAX_SPLIT}, false, 64, false>(args, att_ws, att_cnt);") == 11
    monkeypatch.delenv(attention.MIN_KEYS_ENV)
    assert f", {attention.FAST_MAX_SPLIT}, false, 256, false>(args" in generate_module({"d": (graph, plan)},
                                                                                        upper).source
    assert attention.decode_template_tail(1, True) == ", 1, true, 256, false"
    monkeypatch.delenv(attention.VPREFETCH_ENV)
    assert attention.decode_template_tail(1, True) == ", 1, true"
    monkeypatch.setenv(attention.WARP_MERGE_ENV, "0")  # the merge only where the split runs
    assert attention.decode_template_tail(32, False, True) == ", 32, false, 256, true, true, false"
    assert attention.decode_template_tail(1, True) == ", 1, true"
    monkeypatch.delenv(attention.WARP_MERGE_ENV)
    monkeypatch.setenv(attention.WARPS_ENV, "4")
    four = generate_module({"d": (graph, plan)}, upper).source
    monkeypatch.setenv(attention.WARPS_ENV, "2")
    two = generate_module({"d": (graph, plan)}, upper).source
    assert "__launch_bounds__(128" in four and "__launch_bounds__(64" in two
    return v13, default, four, two, mma


def test_split_target_is_one_wave_for_the_8_warp_tensor_core_kernel(monkeypatch):
    """split_target: SPLIT_WAVE_SMS (132: one block per SM of an H200) for 8 warps on tensor cores, 256 (attention.cu's
    default, left out of the template) for the others; ATLAS_ATTENTION_SPLIT_TARGET sets every kernel's, and only
    where the split runs; a value that is not auto or 1-65536 is a CodegenError naming it."""
    from atlasc.codegen import attention
    from atlasc.codegen.generate import CodegenError

    monkeypatch.delenv(attention.TARGET_ENV, raising=False)
    assert attention.split_target(8, True) == attention.SPLIT_WAVE_SMS == 132
    assert attention.split_target(4, True) == attention.split_target(8, False) == attention.FAST_SPLIT_TARGET == 256
    assert attention.target_setting() == "auto"
    assert attention.decode_template_tail(32, False, True, 132) == ", 32, false, 256, true, true, true, 132"
    assert attention.decode_template_tail(32, False, True, 256) == ", 32, false, 256, true, true"
    assert attention.decode_template_tail(1, False, True, 132) == ", 1, false, 256, true, true"
    monkeypatch.setenv(attention.TARGET_ENV, "96")
    assert attention.split_target(8, True) == attention.split_target(4, False) == 96
    assert attention.target_setting() == "96"
    for bad in ("0", "x", "70000"):
        monkeypatch.setenv(attention.TARGET_ENV, bad)
        with pytest.raises(CodegenError, match="ATLAS_ATTENTION_SPLIT_TARGET"):
            attention.split_target(8, True)


def test_split_runs_on_the_host(tmp_path):
    """attention.cu att_decode_splits (a __host__ __device__ function: this test compiles the library with nvcc and
    runs it on the CPU): TARGET 256 (ATT_SPLIT_TARGET) aims for 256 blocks, ceil(256 / items) runs as in v14-v38; any
    other TARGET is a cap, floor(TARGET / items) runs, so items x runs never exceeds max(items, TARGET) (the launch
    grid, attention.py); every count within 1 .. SPLIT and no more runs than MIN_KEYS-key pieces of the context."""
    import subprocess

    from atlasc.codegen.generate import HERE, _load_families
    from atlasc.codegen.nvcc import NvccNotFoundError, nvcc_path

    try:
        exe = nvcc_path()
    except NvccNotFoundError:
        pytest.skip("nvcc not found")
    cases = [(split, keys, target, items, skv) for split, keys, target in
             ((32, 256, 132), (32, 256, 256), (32, 128, 264), (16, 64, 132), (32, 256, 1)) for items in range(1, 301)
             for skv in (1, 255, 256, 1000, 4096, 8192)]
    calls = "\n".join(f"  printf(\"%lld\\n\", atlas::att_decode_splits<{s}, {k}, {t}>({i}, {n}));"
                       for s, k, t, i, n in cases)
    source = "\n".join([(HERE / "common.cuh").read_text(), *_load_families(),
                        f"#include <cstdio>\nint main() {{\n{calls}\n  return 0;\n}}\n"])
    (tmp_path / "splits.cu").write_text(source)
    build = subprocess.run([exe, "-std=c++17", "-arch=sm_90", "splits.cu", "-o", "splits"], cwd=tmp_path,
                           capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    got = [int(line) for line in subprocess.run([str(tmp_path / "splits")], capture_output=True, text=True,
                                                check=True).stdout.split()]
    assert len(got) == len(cases)
    for (split, keys, target, items, skv), runs in zip(cases, got):
        want = -(-target // items) if target == 256 else target // items
        assert runs == max(1, min(split, want, -(-skv // keys))), (split, keys, target, items, skv, runs)
        if target != 256:
            assert items * runs <= max(items, target)
    assert got[cases.index((32, 256, 132, 8, 4096))] == 16 and got[cases.index((32, 256, 256, 96, 4096))] == 3


def test_attention_ab_switches_change_only_their_kernels(monkeypatch):
    """ATLAS_ATTENTION_SPLIT_MIN_KEYS / ATLAS_ATTENTION_VPREFETCH reach attention_decode's MIN_KEYS / VPF
    template arguments; unset (or at their defaults: 256 keys, prefetch on) the generated text is the same
    as without them, so default builds keep their cached cubins; ATLAS_ATTENTION_WARPS sets the launch bounds.
    These are the SIMT path's switches (ATLAS_ATTENTION_MMA=0); ATLAS_ATTENTION_MMA=1 (the default) adds
    `, true` to the head-dim 64 / 128 kernels only. (Their spills: test_attention_ab_switch_kernels_spill_no_more.)"""
    _ab_sources(monkeypatch)


@pytest.mark.slow
def test_attention_ab_switch_kernels_spill_no_more(monkeypatch, tmp_path):
    """ptxas on _ab_sources: the default kernels spill no more than v13's, nor the 4- and 2-warp ones, all
    on sm90 (the 2-blocks-per-SM fp16 head-dim-64 split kernels spill a few bytes either way); the
    tensor-core kernels no more than the SIMT ones on sm90, none on sm80."""
    import re

    v13, default, four, two, mma = _ab_sources(monkeypatch)

    def spills(log: str) -> dict[str, int]:
        found = re.findall(r"Function properties for (\w+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores", log)
        return {name: int(n) for name, n in found}

    # every switch on sm90, the default (tensor-core) build on sm80 too (each is a full module)
    jobs = [(v13, "sm90"), (default, "sm90"), (four, "sm90"), (two, "sm90"), (mma, "sm90"), (mma, "sm80")]
    found = [spills(log) for log in _nvcc_logs(jobs, tmp_path)]
    for after in found[1:4]:
        assert found[0].keys() == after.keys() and len(after) == 12  # + the transposed-K node (attention_rows)
        assert all(after[k] <= found[0][k] for k in after), (found[0], after)
    assert found[4].keys() == found[1].keys() == found[5].keys()
    assert all(found[4][k] <= found[1][k] for k in found[1]), (found[4], found[1])
    assert not any(found[5].values()), found[5]


def test_attention_lab_ab_paths_are_the_switched_kernels(monkeypatch):
    """examples/attention_lab.py's A/B paths generate attention_decode with exactly their switches (the
    process's own settings cleared), "fast" with none of them."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import attention_lab as lab

    monkeypatch.setenv("ATLAS_ATTENTION_VPREFETCH", "0")  # must not leak into "fast" or "mk256vpf"
    monkeypatch.setenv("ATLAS_ATTENTION_WARPS", "2")  # nor into any path but w2
    monkeypatch.setenv("ATLAS_ATTENTION_MMA", "0")  # nor into "fast" or the mma paths
    monkeypatch.setenv("ATLAS_ATTENTION_WARP_MERGE", "0")  # nor into "fast" or the *wm paths
    mma = ", 32, false, 256, true, true, true, 132>(args"  # the default: one wave of 8-warp blocks
    v38 = ", 32, false, 256, true, true>(args"  # WMERGE and the target of 256 left out
    old = ", false>(args"  # the paths measured before the warp merge spell out its first form
    want = {"fast": mma, "v13": ", 32, false, 64, false, false" + old, "vpf": ", 32, false, 64, true, false" + old,
            "mk32": ", 32, false, 32, false, false" + old, "mk256": ", 32, false, 256, false, false" + old,
            "mk256vpf": ", 32, false, 256, true, false" + old, "w4": ", 32, false, 64, false, false" + old,
            "w2": ", 32, false, 64, false, false" + old, "w4vpf": ", 32, false, 64, true, false" + old,
            "w4mk256vpf": ", 32, false, 256, true, false" + old, "mma": ", 32, false, 256, true, true" + old,
            "mma64": ", 32, false, 64, true, true" + old, "mma32": ", 32, false, 32, true, true" + old,
            "w4mma": ", 32, false, 256, true, true" + old, "w4mma64": ", 32, false, 64, true, true" + old,
            "w2mma": ", 32, false, 256, true, true" + old, "mmawm": v38,
            "mma128wm": ", 32, false, 128, true, true>(args", "mma64wm": ", 32, false, 64, true, true>(args",
            "w4mma128wm": ", 32, false, 128, true, true>(args", "w4mma64wm": ", 32, false, 64, true, true>(args",
            "mma512wm": ", 32, false, 512, true, true>(args", "mma1024wm": ", 32, false, 1024, true, true>(args",
            "mma2048wm": ", 32, false, 2048, true, true>(args", "w4mmawmt132": mma,
            "w4mmawm": v38, "w4mmawmt264": mma.replace("132", "264"), "w4mmawmt396": mma.replace("132", "396")}
    assert set(want) == {"fast", *lab.AB_PATHS}
    for path, tail in want.items():
        _, _, mod = lab.generate("8B", 256, 1, path)
        calls = [line for line in mod.source.splitlines() if "atlas::attention_decode<" in line]
        assert len(calls) == 1 and tail in calls[0], (path, calls)
        warps = int(path[1]) if path.startswith("w") else 8
        assert f", 128, 4, 4, {warps}, " in calls[0] and mod.launches["run"][0].block == (32 * warps, 1, 1)


def _compiled_8b_attention(tmp_path, max_batch: int):
    """generate_module of a compiled Llama-3-8B-shaped decoder: the 8B's attention shapes, one layer, a small MLP
    and vocabulary (the attention kernel does not depend on them)."""
    from dataclasses import replace

    import build_llama

    from atlasc.compiler import _kv_dict, decode_buckets, narrowed_lower
    from atlasc.frontend import import_onnx
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline

    cfg = replace(build_llama.CONFIGS["llama-3-8b"], layers=1, intermediate=128, vocab=256)
    build_llama.write(cfg, tmp_path / "m.onnx", 0)
    program, _ = run_pipeline(Program({"main": import_onnx(tmp_path / "m.onnx")},
                                      CompileOptions(archs=("sm90",), max_batch=max_batch)))
    return generate_module({k: (g, program.plans[k]) for k, g in program.entries.items()}, program.bounds,
                           _kv_dict(program), decode_buckets(program), ("sm90",), narrowed_lower(program))


def _attention_call(module, entry: str) -> tuple[str, tuple]:
    """The attention_decode template an entry's Attention launch calls, and its (grid, block, smem)."""
    import re

    launch = next(x for x in module.launches[entry] if x.op == "Attention")
    template = re.search(r"atlas::attention_decode<[^>]*>", _kernel_text(module, launch)).group(0)
    return template, (launch.grid, launch.block, launch.smem)


def _attention_lab():
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import attention_lab

    return attention_lab


def test_attention_lab_w4mmawm_is_the_compiled_decoders_kernel_above_batch_8(tmp_path):
    """examples/attention_lab.py's w4mmawm path (the baseline of the split-cap A/B, docs/perf.md v40) is the
    attention_decode call a compiled Llama-3-8B-shaped decoder makes for batches 9-32: same template, same block
    (the grids differ with the batch)."""
    lab = _attention_lab()
    step = _attention_call(_compiled_8b_attention(tmp_path, 32), "decode")  # batches above 8 (decode_small: 1-8)
    assert step[1][1] == (128, 1, 1) and step[0].endswith(", 32, true, 256, true, true>")
    got = _attention_call(lab.generate("8B", 256, 12, "w4mmawm", mask="keys")[2], "run")
    assert got[0] == step[0] and got[1][1] == step[1][1]


def test_attention_lab_keys_mask_is_the_compiled_decoders_kernel(tmp_path):
    """examples/attention_lab.py --mask keys times the attention_decode call a compiled Llama-3-8B-shaped
    decoder's step makes (head dim 128, 32 / 8 heads, mask-as-lengths' attention_mask, batch 1): the same
    template arguments and launch geometry; --mask tensor (the additive mask) differs only in the mask."""
    lab = _attention_lab()
    mod = _compiled_8b_attention(tmp_path, 8)
    call = _attention_call
    step = call(mod, "decode")
    assert "long long" in step[0] and step[0].endswith(", 32, true, 256, true, true, true, 132>")  # int64 mask, KEYS
    assert call(lab.generate("8B", 256, 1, "fast", mask="keys")[2], "run") == step
    tensor = call(lab.generate("8B", 256, 1, "fast")[2], "run")
    assert tensor[1] == step[1] and tensor[0].replace("__half, __half", "__half, long long").replace(
        ", 32, false, ", ", 32, true, ") == step[0]
