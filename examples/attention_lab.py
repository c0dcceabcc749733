"""Kernel lab for decode attention (codegen/attention.py + attention.cu): check, then time, both paths.

    python examples/attention_lab.py                  # Llama-3-8B and Llama-3.2-1B decode shapes,
                                                      # contexts 256, 1024, 4096, batch 1 and 32,
                                                      # paths rows and fast
    python examples/attention_lab.py --quick          # 1B, context 256, batch 1 (smoke test)
    python examples/attention_lab.py --models 8B --contexts 4096 --batches 1,32 --path fast
    python examples/attention_lab.py --contexts 256,1024,4096 --path fast,nosplit,vpf,mk32,mk256,w4,w2
                                                      # the short-context A/B switches (AB_PATHS)
    python examples/attention_lab.py --models 8B --batches 1 --mask keys
                                                      # the mask a compiled decoder's step reads (below)

For each (model, context T, batch B, path) it builds a one-node graph as the compiler emits it for a
decoder: `Attention(q [B, Hq, 1, D], k, v, mask [B, 1, 1, T]){out_bshd}` in fp16 whose K and V are
KV-cache views [B, Hk, T, D] with the cache's strides (rows of MAX_SEQ = 4352 positions, more than the
context), an additive mask with a few left-padded keys per batch row (`--mask keys`: the same padding as
attention_mask [B, T] int64 that the kernel turns into the bias itself, key_mask=1: the form a compiled
decoder's step takes, since mask-as-lengths is on by default), and y [B, 1, Hq * D]. The code is
generated with ATLAS_ATTENTION_PATH=path ("rows": attention_rows, "fast": attention_decode with its
sequence split, "nosplit": attention_decode with ATLAS_ATTENTION_SPLIT=1), checked
once against numpy (float32; tolerance 2e-3 + 1e-2 * max |y|), then timed as examples/kernel_lab.py
does (CUDA graph of launches rotating among enough arena copies, each with its own K/V, that none is
served from L2; median of replays).
GB/s counts the bytes a decode step must read or write: K + V once (B * Hk * T * D * 2 * 2) + q + y;
% is of 4.30 TB/s. The last table puts the paths side by side.

Prefill mode (`--prefill`): the prefill Attention of a decoder at sequence length T (Sq = T keys, past 0):
q [B, Hq, T, D], K/V cache views [B, Hk, T, D] (rows of MAX_SEQ positions), y [B, T, Hq * D], and the
mask as the default pipeline gives it (`--mask tensor`: an additive fp16 [B, 1, T, T] with 0 on and
below the diagonal and -65504 above it; `keys`: mask-as-lengths' attention_mask [B, T] of ones with
causal=1 and fill -65504; `causal`: no mask, is_causal=1). Paths: fa2 (ATLAS_ATTENTION_PREFILL=fa2,
warps auto), fa2w8 (8 warps, 128 rows per block), fast, rows. Checked once against numpy on two query
heads (the first and the last; float32 reference; tolerance 2e-3 + 1e-2 * max |y|), timed as above.
TFLOP/s counts the causal work: 4 * B * Hq * D * T * (T + 1) / 2 (two matrix products over the visible
(query, key) pairs, 2 FLOP per multiply-add); % is of 790 TFLOP/s (the H200's measured dense fp16/bf16
cuBLAS rate, KINDS.md).

    python examples/attention_lab.py --prefill --seqs 512,2048,4096 --path fa2,fa2w8,fast
    python examples/attention_lab.py --prefill --models 8B --seqs 4096 --mask keys --path fa2
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from kernel_lab import PEAK, arena_count, generate_with_env, time_launches

from atlasc.codegen import attention
from atlasc.codegen.nvcc import compile_cubins
from atlasc.ir import OPS, Graph, Node, SymbolInfo, Value
from atlasc.ir import symbolic as S
from atlasc.ir.memory import MemoryPlan, Placement, align

MODELS = {"8B": (32, 8, 128), "1B": (32, 8, 64)}  # (q heads, kv heads, head dim)
CONTEXTS = (256, 1024, 4096)
BATCHES = (1, 32)
MAX_SEQ = 4352  # the cache's row stride in positions (> every context timed)


def build(model: str, ctx: int, batch: int, mask: str = "tensor"):
    """(graph, plan, upper): the decode Attention node with K/V as cache views, 256-aligned buffers. mask
    "tensor": an additive float16 [B, 1, 1, T]; "keys": attention_mask [B, T] int64 read by the kernel
    (key_mask=1, causal, fill -65504: what mask-as-lengths, on by default, gives a compiled decoder)."""
    hq, hk, d = MODELS[model]
    g = Graph(f"att_{model}_t{ctx}_b{batch}_{mask}")
    g.symbols = {"batch": SymbolInfo(1, batch), "ctx": SymbolInfo(1, ctx)}
    B, T = S.sym("batch"), S.sym("ctx")
    q = Value("q", "float16", (B, hq, 1, d))
    k = Value("k", "float16", (B, hk, T, d))
    v = Value("v", "float16", (B, hk, T, d))
    attrs = {"out_bshd": 1}
    if mask == "keys":
        m = Value("mask", "int64", (B, T))
        attrs.update({"key_mask": 1, "causal": 1, "mask_fill": F16_MIN})
    else:
        m = Value("mask", "float16", (B, 1, 1, T))
    y = Value("y", "float16", (B, 1, hq * d))
    g.inputs = [q, k, v, m]
    g.nodes = [Node("Attention", [q, k, v, m], [y], OPS["Attention"].fill_attrs(attrs), name="attention")]
    g.outputs = [y]
    plan = MemoryPlan(symbols=("batch", "ctx"))
    plan.dims_offset = 0
    off = 256
    cache = (hk * MAX_SEQ * d, MAX_SEQ * d, d, 1)
    for value, nbytes, strides in ((q, batch * hq * d * 2, None), (k, batch * hk * MAX_SEQ * d * 2, cache),
                                   (v, batch * hk * MAX_SEQ * d * 2, cache),
                                   (m, batch * ctx * (8 if mask == "keys" else 2), None),
                                   (y, batch * hq * d * 2, None)):
        plan.placements[value.name] = Placement("activations", off, nbytes, strides)
        off = align(off + nbytes)
    plan.arena_bytes = off
    return g, plan, {"batch": batch, "ctx": ctx}


# the short-context A/B variants of "fast" (not in the default set), each spelled in full so that its meaning
# stays as measured in docs/perf.md v13 / v14: the split's runs of at least 32 / 64 / 256 keys, V rows
# prefetched into L2 with the K reads or not, 4 or 2 warps per block (attention.py MIN_KEYS_ENV,
# VPREFETCH_ENV, WARPS_ENV, MMA_ENV, WARP_MERGE_ENV; TARGET_ENV 256, the split's target before v39, unless named).
# "fast" is the default kernel of a one-node graph (since v39: runs of 256 keys, V prefetch, 8 warps, tensor cores,
# the split merged by a warp per row, its units within one wave of 132 blocks; a compiled decoder's kernels for
# batches above 8 take 4 warps and 256 blocks); "mmawm" is v34-v38's default (256 blocks), "mma" / "w4mma" v15-v33's
# (the merge's first form), "mk256vpf" v14's (SIMT), "v13" v13's (64 keys, no prefetch).
def _ab(min_keys: int, vpf: bool, warps: int = 8, mma: bool = False, merge: bool = False,
        target: str = "256") -> dict[str, str]:
    return {attention.MIN_KEYS_ENV: str(min_keys), attention.VPREFETCH_ENV: str(int(vpf)),
            attention.WARPS_ENV: str(warps), attention.MMA_ENV: str(int(mma)),
            attention.WARP_MERGE_ENV: str(int(merge)), attention.TARGET_ENV: target}


AB_PATHS = {"v13": _ab(64, False), "vpf": _ab(64, True), "mk32": _ab(32, False), "mk256": _ab(256, False),
            "mk256vpf": _ab(256, True), "w4": _ab(64, False, 4), "w2": _ab(64, False, 2),
            "w4vpf": _ab(64, True, 4), "w4mk256vpf": _ab(256, True, 4),
            # mma*: scores and values on tensor cores (ATLAS_ATTENTION_MMA=1, the default since v15), runs of at
            # least 256 / 64 / 32 keys, 8, 4 or 2 warps
            "mma": _ab(256, True, 8, True), "mma64": _ab(64, True, 8, True), "mma32": _ab(32, True, 8, True),
            "w4mma": _ab(256, True, 4, True), "w4mma64": _ab(64, True, 4, True), "w2mma": _ab(256, True, 2, True),
            # *wm: the split's runs merged by a warp per row (ATLAS_ATTENTION_WARP_MERGE=1), runs of 256 / 128 / 64
            "mmawm": _ab(256, True, 8, True, True), "mma128wm": _ab(128, True, 8, True, True),
            "mma64wm": _ab(64, True, 8, True, True), "w4mma128wm": _ab(128, True, 4, True, True),
            "w4mma64wm": _ab(64, True, 4, True, True),
            # runs of at least 512 / 1024 / 2048 keys (docs/perf.md v39: fewer blocks than v38's split target of 256
            # at batches 2-8)
            "mma512wm": _ab(512, True, 8, True, True), "mma1024wm": _ab(1024, True, 8, True, True),
            "mma2048wm": _ab(2048, True, 8, True, True),
            # 4 warps, the split's units within one wave of 132 blocks (the 8-warp kernel's default since v39), or
            # capped at 264 / 396 blocks: one / one and a half waves of the 4-warp kernel at 2 blocks per SM (its
            # default, ceil(256 / units) runs, takes two waves at batches 9-15 and 17-31 of Llama-3-8B)
            "w4mmawm": _ab(256, True, 4, True, True),  # what a compiled decoder runs at batches 9-32 (v39)
            "w4mmawmt132": _ab(256, True, 4, True, True, "132"), "w4mmawmt264": _ab(256, True, 4, True, True, "264"),
            "w4mmawmt396": _ab(256, True, 4, True, True, "396")}
LAB_PATHS = (*attention.PATHS, "nosplit")
PREFILL_PATHS = ("fa2", "fa2w8", "fast", "rows")
PREFILL_SEQS = (512, 2048, 4096)
MASKS = ("tensor", "keys", "causal")
MMA_PEAK = 790e12  # dense fp16 / bf16 FLOP/s measured on the H200 (cuBLAS, KINDS.md)
F16_MIN = -65504.0


def check(y: np.ndarray, ref: np.ndarray) -> tuple[bool, float, float]:
    """(ok, max |error|, max |ref|) of a kernel's float32 output against the reference: ok when the error
    is within 2e-3 + 1e-2 * max |ref| (and every value finite)."""
    err = float(np.max(np.abs(y - ref))) if np.all(np.isfinite(y)) else float("inf")
    scale = float(np.max(np.abs(ref)))
    return err <= 2e-3 + 1e-2 * scale, err, scale


def build_prefill(model: str, seq: int, batch: int, mask: str):
    """(graph, plan, upper): the prefill Attention node at T = seq (past 0), K/V as cache views."""
    hq, hk, d = MODELS[model]
    g = Graph(f"prefill_{model}_t{seq}_b{batch}_{mask}")
    g.symbols = {"batch": SymbolInfo(1, batch), "seq": SymbolInfo(1, seq)}
    B, T = S.sym("batch"), S.sym("seq")
    q = Value("q", "float16", (B, hq, T, d))
    k = Value("k", "float16", (B, hk, T, d))
    v = Value("v", "float16", (B, hk, T, d))
    y = Value("y", "float16", (B, T, hq * d))
    attrs = {"out_bshd": 1}
    ins, sizes = [q, k, v], []
    if mask == "tensor":
        m = Value("mask", "float16", (B, 1, T, T))
        ins.append(m)
        sizes.append((m, batch * seq * seq * 2))
    elif mask == "keys":
        m = Value("mask", "int64", (B, T))
        ins.append(m)
        sizes.append((m, batch * seq * 8))
        attrs.update({"key_mask": 1, "causal": 1, "mask_fill": F16_MIN})
    else:
        attrs["is_causal"] = 1
    g.inputs = list(ins)
    g.nodes = [Node("Attention", ins, [y], OPS["Attention"].fill_attrs(attrs), name="attention")]
    g.outputs = [y]
    plan = MemoryPlan(symbols=("batch", "seq"))
    plan.dims_offset = 0
    off = 256
    cache = (hk * MAX_SEQ * d, MAX_SEQ * d, d, 1)
    for value, nbytes, strides in [(q, batch * hq * seq * d * 2, None), (k, batch * hk * MAX_SEQ * d * 2, cache),
                                   (v, batch * hk * MAX_SEQ * d * 2, cache),
                                   *[(m, n, None) for m, n in sizes], (y, batch * hq * seq * d * 2, None)]:
        plan.placements[value.name] = Placement("activations", off, nbytes, strides)
        off = align(off + nbytes)
    plan.arena_bytes = off
    return g, plan, {"batch": batch, "seq": seq}


def generate_prefill(model: str, seq: int, batch: int, mask: str, path: str):
    env = {attention.SPLIT_ENV: "", "ATLAS_ATTENTION_PREFILL": "fa2" if path.startswith("fa2") else "off",
           "ATLAS_ATTENTION_FA2_WARPS": "8" if path == "fa2w8" else "",
           attention.PATH_ENV: "rows" if path == "rows" else "fast"}
    return generate_with_env(build_prefill(model, seq, batch, mask), env)


def prefill_flops(model: str, seq: int, batch: int) -> float:
    hq, _, d = MODELS[model]
    return 4.0 * batch * hq * d * seq * (seq + 1) / 2


def prefill_inputs(model: str, seq: int, batch: int, mask: str, rng):
    """q, the caches [B, Hk, MAX_SEQ, D] (rows past seq zero), the mask array (None for causal)."""
    hq, hk, d = MODELS[model]
    q = rng.standard_normal((batch, hq, seq, d), dtype=np.float32).astype(np.float16)
    ck = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    cv = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    ck[:, :, :seq] = rng.standard_normal((batch, hk, seq, d), dtype=np.float32).astype(np.float16)
    cv[:, :, :seq] = rng.uniform(-1, 1, (batch, hk, seq, d)).astype(np.float16)
    if mask == "tensor":
        tri = np.where(np.arange(seq)[None, :] <= np.arange(seq)[:, None], 0.0, F16_MIN).astype(np.float16)
        return q, ck, cv, np.ascontiguousarray(np.broadcast_to(tri, (batch, 1, seq, seq)))
    if mask == "keys":
        return q, ck, cv, np.ones((batch, seq), np.int64)
    return q, ck, cv, None


def prefill_reference(q, ck, cv, seq: int, heads) -> np.ndarray:
    """y[:, :, h] for h in heads, float32: causal softmax(q k^T / sqrt(D)) v (every mask form is causal)."""
    batch, hq, _, d = q.shape
    group = hq // ck.shape[1]
    tri = np.where(np.arange(seq)[None, :] <= np.arange(seq)[:, None], 0.0, -np.inf).astype(np.float32)
    out = []
    for h in heads:
        k = ck[:, h // group, :seq].astype(np.float32)
        v = cv[:, h // group, :seq].astype(np.float32)
        s = np.einsum("bid,bjd->bij", q[:, h].astype(np.float32), k) / np.float32(np.sqrt(d)) + tri
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out.append(np.einsum("bij,bjd->bid", p, v))
    return np.stack(out, axis=1)  # [B, len(heads), T, D]


def main_prefill(args, ap) -> int:
    models = tuple(args.models.split(","))
    seqs = tuple(int(x) for x in args.seqs.split(","))
    batches = (1,) if args.batches is None else tuple(int(x) for x in args.batches.split(","))
    paths = tuple(p for p in (args.path or "fa2,fa2w8,fast").split(",") if p)
    bad = [p for p in paths if p not in PREFILL_PATHS] + [m for m in models if m not in MODELS]
    bad += [str(t) for t in seqs if not 16 <= t <= MAX_SEQ] + ([args.mask] if args.mask not in MASKS else [])
    if bad:
        ap.error(f"unknown or out of range: {', '.join(bad)}")
    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    t0 = time.perf_counter()
    keys = [(m, t, b, p) for m in models for t in seqs for b in batches for p in paths]
    mods = {key: generate_prefill(key[0], key[1], key[2], args.mask, key[3]) for key in keys}
    with ThreadPoolExecutor(16) as pool:
        cubins = dict(zip(mods, pool.map(lambda key: compile_cubins(mods[key][2].source, (dev.arch,))[dev.arch],
                                         mods)))
    print(f"# {dev.name} ({dev.arch}): {len(mods)} prefill kernels ({args.mask} mask) compiled in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    rows, failed = [], False
    for model in models:
        hq, _, d = MODELS[model]
        for seq in seqs:
            for batch in batches:
                q, ck, cv, mask = prefill_inputs(model, seq, batch, args.mask, rng)
                heads = (0, hq - 1)
                ref = prefill_reference(q, ck, cv, seq, heads)
                for path in paths:
                    g, plan, mod = mods[(model, seq, batch, path)]
                    launch = mod.launches["run"][0]
                    table = KernelTable(dev, dev.load_module(cubins[(model, seq, batch, path)]), [launch.kernel])
                    nbytes = q.nbytes * 2 + 2 * batch * ck.shape[1] * seq * d * 2 + (0 if mask is None else mask.nbytes)
                    arenas = [dev.alloc_arena(mod.arena_bytes) for _ in range(arena_count(nbytes))]
                    at = {v.name: plan.placement(v).offset for v in g.inputs + g.outputs}
                    for a in arenas:
                        dev.upload(a, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))  # poison (NaN in fp16)
                        dev.upload(a, plan.dims_offset, np.array([batch, seq], np.int64))
                        for name, arr in (("q", q), ("k", ck), ("v", cv), ("mask", mask)):
                            if arr is not None:
                                dev.upload(a, at[name], arr)
                    dev.synchronize()

                    def go(a):
                        table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a, args=launch.args)

                    go(arenas[0])
                    dev.synchronize()
                    y = dev.download(arenas[0], at["y"], q.nbytes).view(np.float16).reshape(batch, seq, hq, d)
                    ok, err, scale = check(y.astype(np.float32).transpose(0, 2, 1, 3)[:, list(heads)], ref)
                    failed |= not ok
                    us = time_launches(dev, go, arenas)
                    tflops = prefill_flops(model, seq, batch) / (us * 1e-6) / 1e12
                    choice = mod.choices.get("kernels", {}).get(launch.kernel, {})
                    tiles = f"{choice['br']}x{choice['bc']}" if choice.get("attention") == "fa2" else "-"
                    rows.append((model, seq, batch, path, us, tflops, 100 * tflops * 1e12 / MMA_PEAK, tiles,
                                 "ok" if ok else f"FAIL err {err:.3g} / max {scale:.3g}"))
                    for a in arenas:
                        a.free()
                    print(f"  {model} T={seq:<5d} B={batch:<3d} {path:6s} {us:10.1f} us {tflops:7.1f} TFLOP/s "
                          f"{rows[-1][6]:5.1f}%  {tiles:6s} {rows[-1][8]}", flush=True)
    print(f"\n{'model':5s} {'T':>5s} {'B':>4s} {'path':6s} {'us':>10s} {'TFLOP/s':>8s} {'%790':>6s} "
          f"{'tile':>6s}  check")
    for model, seq, batch, path, us, tf, pct, tiles, ok in rows:
        print(f"{model:5s} {seq:5d} {batch:4d} {path:6s} {us:10.1f} {tf:8.1f} {pct:5.1f}% {tiles:>6s}  {ok}")
    print(f"# causal FLOPs 4 * B * Hq * D * T * (T + 1) / 2; total {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


def generate(model: str, ctx: int, batch: int, path: str, mask: str = "tensor"):
    """(graph, plan, module) of build(...) generated with ATLAS_ATTENTION_PATH=path ("nosplit": fast, no
    sequence split; an AB_PATHS name: fast with that variant's switches; the others' switches cleared)."""
    env = {attention.PATH_ENV: "fast", attention.SPLIT_ENV: "1"} if path == "nosplit" else {
        attention.PATH_ENV: "fast" if path in AB_PATHS else path, attention.SPLIT_ENV: ""}
    env |= {attention.VPREFETCH_ENV: "", attention.MIN_KEYS_ENV: "", attention.TARGET_ENV: "", attention.WARPS_ENV: "",
            attention.MMA_ENV: "", attention.WARP_MERGE_ENV: ""} | AB_PATHS.get(path, {})
    return generate_with_env(build(model, ctx, batch, mask), env)


def inputs(model: str, ctx: int, batch: int, rng, mask_form: str = "tensor"):
    """q [B, Hq, 1, D], the cache [B, Hk, MAX_SEQ, D] (rows past ctx are zeros), the additive mask
    [B, 1, 1, ctx] (what the reference takes), and the mask the kernel reads (`mask_form` keys: the same
    left padding as attention_mask [B, ctx] int64, 1 for a visible key)."""
    hq, hk, d = MODELS[model]
    q = rng.standard_normal((batch, hq, 1, d), dtype=np.float32).astype(np.float16)
    cache_k = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    cache_v = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    cache_k[:, :, :ctx] = rng.standard_normal((batch, hk, ctx, d), dtype=np.float32).astype(np.float16)
    cache_v[:, :, :ctx] = rng.uniform(-1, 1, (batch, hk, ctx, d)).astype(np.float16)
    pads = np.arange(batch) % 7  # left padding: batch row b masks its first b % 7 keys
    visible = np.arange(ctx)[None, :] >= pads[:, None]
    mask = np.where(visible, 0.0, -np.inf).astype(np.float16).reshape(batch, 1, 1, ctx)
    return q, cache_k, cache_v, mask, (visible.astype(np.int64) if mask_form == "keys" else mask)


def reference(q, cache_k, cache_v, mask, ctx: int) -> np.ndarray:
    """y [B, 1, Hq * D] in float32: softmax(q k^T / sqrt(D) + mask) v per query head, kv head = h // group."""
    batch, hq, _, d = q.shape
    hk = cache_k.shape[1]
    qg = q.astype(np.float32).reshape(batch, hk, hq // hk, d)
    k = cache_k[:, :, :ctx].astype(np.float32)
    v = cache_v[:, :, :ctx].astype(np.float32)
    s = np.einsum("bkgd,bktd->bkgt", qg, k) / np.float32(np.sqrt(d)) + mask.astype(np.float32)[:, :, 0, None, :]
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bkgt,bktd->bkgd", p, v).reshape(batch, 1, hq * d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1B, context 256, batch 1")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated of 8B, 1B")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated contexts (keys)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (decode: 1,32; prefill: 1)")
    ap.add_argument("--path", default=None,
                    help=f"comma-separated Attention paths, of {', '.join((*LAB_PATHS, *AB_PATHS))} (decode, "
                         f"default {', '.join(LAB_PATHS)}) or "
                         f"{', '.join(PREFILL_PATHS)} (--prefill, default fa2,fa2w8,fast)")
    ap.add_argument("--prefill", action="store_true", help="time the prefill Attention (Sq = T) instead")
    ap.add_argument("--seqs", default=",".join(map(str, PREFILL_SEQS)), help="--prefill: comma-separated T")
    ap.add_argument("--mask", default="tensor", help=f"the mask form, of {', '.join(MASKS)} (decode: tensor or "
                                                     "keys; keys is what a compiled decoder's step reads)")
    ap.add_argument("--arenas", type=int, default=0,
                    help="arena copies to rotate among (default: enough that K/V come from DRAM; 1: from L2)")
    args = ap.parse_args(argv)
    if args.prefill:
        return main_prefill(args, ap)
    args.batches = args.batches or ",".join(map(str, BATCHES))
    args.path = args.path or ",".join(LAB_PATHS)
    models = ("1B",) if args.quick else tuple(args.models.split(","))
    contexts = (256,) if args.quick else tuple(int(x) for x in args.contexts.split(","))
    batches = (1,) if args.quick else tuple(int(x) for x in args.batches.split(","))
    paths = tuple(p for p in args.path.split(",") if p)
    bad = [p for p in paths if p not in (*LAB_PATHS, *AB_PATHS)] + [m for m in models if m not in MODELS]
    bad += [str(t) for t in contexts if not 1 <= t <= MAX_SEQ]
    bad += [args.mask] if args.mask not in ("tensor", "keys") else []
    if bad:
        ap.error(f"unknown or out of range: {', '.join(bad)}")

    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    cuda = dev.cuda
    t0 = time.perf_counter()
    keys = [(m, t, b, p) for m in models for t in contexts for b in batches for p in paths]
    mods = {key: generate(*key, mask=args.mask) for key in keys}
    with ThreadPoolExecutor(16) as pool:
        cubins = dict(zip(mods, pool.map(lambda key: compile_cubins(mods[key][2].source, (dev.arch,))[dev.arch],
                                         mods)))
    print(f"# {dev.name} ({dev.arch}): {len(mods)} kernels ({args.mask} mask) compiled in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    failed = False
    for model in models:
        hq, hk, d = MODELS[model]
        for ctx in contexts:
            for batch in batches:
                q, cache_k, cache_v, mask, kernel_mask = inputs(model, ctx, batch, rng, args.mask)
                ref = reference(q, cache_k, cache_v, mask, ctx)
                for path in paths:
                    g, plan, mod = mods[(model, ctx, batch, path)]
                    module = dev.load_module(cubins[(model, ctx, batch, path)])
                    launch = mod.launches["run"][0]
                    table = KernelTable(dev, module, [launch.kernel])
                    copies = args.arenas or arena_count(mod.arena_bytes)
                    arenas = [dev.alloc_arena(mod.arena_bytes) for _ in range(copies)]
                    at = {v.name: plan.placement(v).offset for v in g.inputs + g.outputs}
                    for i, a in enumerate(arenas):
                        dev.upload(a, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))  # poison (NaN in fp16)
                        if mod.scratch_bytes:  # the split's counters start at 0
                            dev.upload(a, mod.scratch_offset, np.zeros(mod.scratch_bytes, np.uint8))
                        dev.upload(a, plan.dims_offset, np.array([batch, ctx], np.int64))
                        dev.upload(a, at["q"], q)
                        dev.upload(a, at["mask"], kernel_mask)
                        if i == 0:
                            dev.upload(a, at["k"], cache_k)
                            dev.upload(a, at["v"], cache_v)
                    dev.synchronize()
                    for a in arenas[1:]:
                        for name in ("k", "v"):
                            cuda.memcpy_dtod(int(a) + at[name], int(arenas[0]) + at[name], cache_k.nbytes)

                    def go(a):
                        table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a, args=launch.args)

                    go(arenas[0])
                    dev.synchronize()
                    y = dev.download(arenas[0], at["y"], ref.size * 2).view(np.float16).reshape(ref.shape)
                    ok, err, scale = check(y.astype(np.float32), ref)
                    failed |= not ok
                    us = time_launches(dev, go, arenas)
                    nbytes = batch * hk * ctx * d * 2 * 2 + 2 * batch * hq * d * 2
                    gbs = nbytes / (us * 1e-6) / 1e9
                    rows.append((model, ctx, batch, path, us, gbs, 100 * gbs * 1e9 / PEAK, launch.grid[0],
                                 "ok" if ok else f"FAIL err {err:.3g} / max {scale:.3g}"))
                    for a in arenas:
                        a.free()
                    print(f"  {model} T={ctx:<5d} B={batch:<3d} {path:7s} {us:9.2f} us  {gbs:7.0f} GB/s  "
                          f"{rows[-1][6]:5.1f}%  {rows[-1][8]}", flush=True)
    print(f"\n{'model':5s} {'T':>5s} {'B':>4s} {'path':7s} {'us':>9s} {'GB/s':>7s} {'%4.3TB/s':>8s} "
          f"{'grid':>6s}  check")
    for model, ctx, batch, path, us, gbs, pct, grid, ok in rows:
        print(f"{model:5s} {ctx:5d} {batch:4d} {path:7s} {us:9.2f} {gbs:7.0f} {pct:7.1f}% {grid:6d}  {ok}")
    if len(paths) > 1:
        print(f"\n{'model':5s} {'T':>5s} {'B':>4s} " + " ".join(f"{p + ' us':>10s}" for p in paths) + "  fastest")
        for model in models:
            for ctx in contexts:
                for batch in batches:
                    t = {r[3]: r[4] for r in rows if r[:3] == (model, ctx, batch)}
                    print(f"{model:5s} {ctx:5d} {batch:4d} " + " ".join(f"{t[p]:10.2f}" for p in paths) +
                          f"  {min(t, key=t.get)}")
    print(f"# total {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
