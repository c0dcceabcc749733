"""Kernel lab for decode attention (codegen/attention.py + attention.cu): check, then time, both paths.

    python examples/attention_lab.py                  # Llama-3-8B and Llama-3.2-1B decode shapes,
                                                      # contexts 256, 1024, 4096, batch 1 and 32,
                                                      # paths rows and fast
    python examples/attention_lab.py --quick          # 1B, context 256, batch 1 (smoke test)
    python examples/attention_lab.py --models 8B --contexts 4096 --batches 1,32 --path fast

For each (model, context T, batch B, path) it builds a one-node graph as the compiler emits it for a
decoder: `Attention(q [B, Hq, 1, D], k, v, mask [B, 1, 1, T]){out_bshd}` in fp16 whose K and V are
KV-cache views [B, Hk, T, D] with the cache's strides (rows of MAX_SEQ = 4352 positions, more than the
context), an additive mask with a few left-padded keys per batch row, and y [B, 1, Hq * D]. The code is
generated with ATLAS_ATTENTION_PATH=path ("rows": attention_rows, "fast": attention_decode with its
sequence split, "nosplit": attention_decode with ATLAS_ATTENTION_SPLIT=1), checked
once against numpy (float32; tolerance 2e-3 + 1e-2 * max |y|), then timed as examples/kernel_lab.py
does (CUDA graph of launches rotating among enough arena copies, each with its own K/V, that none is
served from L2; median of replays).
GB/s counts the bytes a decode step must read or write: K + V once (B * Hk * T * D * 2 * 2) + q + y;
% is of 4.30 TB/s. The last table puts the paths side by side.
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


def build(model: str, ctx: int, batch: int):
    """(graph, plan, upper): the decode Attention node with K/V as cache views, 256-aligned buffers."""
    hq, hk, d = MODELS[model]
    g = Graph(f"att_{model}_t{ctx}_b{batch}")
    g.symbols = {"batch": SymbolInfo(1, batch), "ctx": SymbolInfo(1, ctx)}
    B, T = S.sym("batch"), S.sym("ctx")
    q = Value("q", "float16", (B, hq, 1, d))
    k = Value("k", "float16", (B, hk, T, d))
    v = Value("v", "float16", (B, hk, T, d))
    mask = Value("mask", "float16", (B, 1, 1, T))
    y = Value("y", "float16", (B, 1, hq * d))
    g.inputs = [q, k, v, mask]
    g.nodes = [Node("Attention", [q, k, v, mask], [y], OPS["Attention"].fill_attrs({"out_bshd": 1}),
                    name="attention")]
    g.outputs = [y]
    plan = MemoryPlan(symbols=("batch", "ctx"))
    plan.dims_offset = 0
    off = 256
    cache = (hk * MAX_SEQ * d, MAX_SEQ * d, d, 1)
    for value, elems, strides in ((q, batch * hq * d, None), (k, batch * hk * MAX_SEQ * d, cache),
                                  (v, batch * hk * MAX_SEQ * d, cache), (mask, batch * ctx, None),
                                  (y, batch * hq * d, None)):
        plan.placements[value.name] = Placement("activations", off, elems * 2, strides)
        off = align(off + elems * 2)
    plan.arena_bytes = off
    return g, plan, {"batch": batch, "ctx": ctx}


LAB_PATHS = (*attention.PATHS, "nosplit")


def generate(model: str, ctx: int, batch: int, path: str):
    """(graph, plan, module) of build(...) generated with ATLAS_ATTENTION_PATH=path ("nosplit": fast, no
    sequence split)."""
    env = {attention.PATH_ENV: "fast", attention.SPLIT_ENV: "1"} if path == "nosplit" else {
        attention.PATH_ENV: path, attention.SPLIT_ENV: ""}
    return generate_with_env(build(model, ctx, batch), env)


def inputs(model: str, ctx: int, batch: int, rng):
    """q [B, Hq, 1, D], the cache [B, Hk, MAX_SEQ, D] (rows past ctx are zeros), mask [B, 1, 1, ctx]."""
    hq, hk, d = MODELS[model]
    q = rng.standard_normal((batch, hq, 1, d), dtype=np.float32).astype(np.float16)
    cache_k = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    cache_v = np.zeros((batch, hk, MAX_SEQ, d), np.float16)
    cache_k[:, :, :ctx] = rng.standard_normal((batch, hk, ctx, d), dtype=np.float32).astype(np.float16)
    cache_v[:, :, :ctx] = rng.uniform(-1, 1, (batch, hk, ctx, d)).astype(np.float16)
    pads = np.arange(batch) % 7  # left padding: batch row b masks its first b % 7 keys
    mask = np.where(np.arange(ctx)[None, :] >= pads[:, None], 0.0, -np.inf).astype(np.float16)
    return q, cache_k, cache_v, mask.reshape(batch, 1, 1, ctx)


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
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    ap.add_argument("--path", default=",".join(LAB_PATHS),
                    help=f"comma-separated Attention paths, of {', '.join(LAB_PATHS)}")
    args = ap.parse_args(argv)
    models = ("1B",) if args.quick else tuple(args.models.split(","))
    contexts = (256,) if args.quick else tuple(int(x) for x in args.contexts.split(","))
    batches = (1,) if args.quick else tuple(int(x) for x in args.batches.split(","))
    paths = tuple(p for p in args.path.split(",") if p)
    bad = [p for p in paths if p not in LAB_PATHS] + [m for m in models if m not in MODELS]
    bad += [str(t) for t in contexts if not 1 <= t <= MAX_SEQ]
    if bad:
        ap.error(f"unknown or out of range: {', '.join(bad)}")

    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    cuda = dev.cuda
    t0 = time.perf_counter()
    keys = [(m, t, b, p) for m in models for t in contexts for b in batches for p in paths]
    mods = {key: generate(*key) for key in keys}
    with ThreadPoolExecutor(16) as pool:
        cubins = dict(zip(mods, pool.map(lambda key: compile_cubins(mods[key][2].source, (dev.arch,))[dev.arch],
                                         mods)))
    print(f"# {dev.name} ({dev.arch}): {len(mods)} kernels compiled in {time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    failed = False
    for model in models:
        hq, hk, d = MODELS[model]
        for ctx in contexts:
            for batch in batches:
                q, cache_k, cache_v, mask = inputs(model, ctx, batch, rng)
                ref = reference(q, cache_k, cache_v, mask, ctx)
                for path in paths:
                    g, plan, mod = mods[(model, ctx, batch, path)]
                    module = dev.load_module(cubins[(model, ctx, batch, path)])
                    launch = mod.launches["run"][0]
                    table = KernelTable(dev, module, [launch.kernel])
                    arenas = [dev.alloc_arena(mod.arena_bytes) for _ in range(arena_count(mod.arena_bytes))]
                    at = {v.name: plan.placement(v).offset for v in g.inputs + g.outputs}
                    for i, a in enumerate(arenas):
                        dev.upload(a, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))  # poison (NaN in fp16)
                        if mod.scratch_bytes:  # the split's counters start at 0
                            dev.upload(a, mod.scratch_offset, np.zeros(mod.scratch_bytes, np.uint8))
                        dev.upload(a, plan.dims_offset, np.array([batch, ctx], np.int64))
                        dev.upload(a, at["q"], q)
                        dev.upload(a, at["mask"], mask)
                        if i == 0:
                            dev.upload(a, at["k"], cache_k)
                            dev.upload(a, at["v"], cache_v)
                    dev.synchronize()
                    for a in arenas[1:]:
                        for name in ("k", "v"):
                            cuda.memcpy_dtod(int(a) + at[name], int(arenas[0]) + at[name], cache_k.nbytes)

                    def go(a):
                        table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a)

                    go(arenas[0])
                    dev.synchronize()
                    y = dev.download(arenas[0], at["y"], ref.size * 2).view(np.float16).reshape(ref.shape)
                    y = y.astype(np.float32)
                    err = float(np.max(np.abs(y - ref))) if np.all(np.isfinite(y)) else float("inf")
                    scale = float(np.max(np.abs(ref)))
                    ok = err <= 2e-3 + 1e-2 * scale
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
