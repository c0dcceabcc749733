"""Kernel lab for the weight-only quantized Linear kernels (codegen/quant.py + quant.cu): check, then time.

    python examples/quant_lab.py                       # int4 g128 and int8 on the Llama-3-8B shapes, M = 1
    python examples/quant_lab.py --ms 1,8 --quant int4 --shapes "8B qkv,8B down"

For each (shape, M, mode) it builds a one-node graph `LinearQ4(x[m, K], wq, scale)` (or LinearQ8) with
random fp16 weights quantized by passes/quantize.py, generates the kernel the compiler emits, checks it
once against numpy (x @ dequant(wq)^T in float32; tolerance 2e-2 of max |y|), then times it exactly as
examples/kernel_lab.py does (CUDA graph of launches rotating among 3 arenas, median of replays).
GB/s counts the bytes a decode step must read: packed weights + scales (+ x and y); % is of 4.30 TB/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from kernel_lab import ARENAS, PEAK, SHAPES, time_launches

from atlasc.codegen import generate_module
from atlasc.codegen.nvcc import compile_cubins
from atlasc.ir import Graph, Node, SymbolInfo, Value
from atlasc.ir import symbolic as S
from atlasc.ir.memory import MemoryPlan, Placement, align
from atlasc.passes.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from atlasc.runtime.device import Device, KernelTable

GROUP = 128


def build(k: int, n: int, m_max: int, mode: str):
    """(graph, plan, upper) of LinearQ4/Q8(x[m, k], wq, scale) with 256-aligned buffers."""
    g = Graph(f"q_{mode}_{k}x{n}_m{m_max}")
    g.symbols = {"m": SymbolInfo(1, m_max)}
    x = Value("x", "float16", (S.sym("m"), k))
    if mode == "int4":
        wq, scale = Value("wq", "uint8", (n, k // 2)), Value("scale", "float16", (n, k // GROUP))
        node = Node("LinearQ4", [x, wq, scale], [], {"group_size": GROUP})
    else:
        wq, scale = Value("wq", "int8", (n, k)), Value("scale", "float16", (n,))
        node = Node("LinearQ8", [x, wq, scale], [], {})
    y = Value("y", "float16", (S.sym("m"), n))
    node.outputs = [y]
    g.inputs, g.nodes, g.outputs = [x, wq, scale], [node], [y]
    plan = MemoryPlan(symbols=("m",))
    off = 256
    sizes = {"x": m_max * k * 2, "wq": n * k // (2 if mode == "int4" else 1),
             "scale": n * (k // GROUP if mode == "int4" else 1) * 2, "y": m_max * n * 2}
    for v in (x, wq, scale, y):
        plan.placements[v.name] = Placement("activations", off, sizes[v.name])
        off = align(off + sizes[v.name])
    plan.arena_bytes = off
    return g, plan, {"m": m_max}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8B qkv,8B o,8B gate_up,8B down,8B lm_head")
    ap.add_argument("--ms", default="1", help="comma-separated M values")
    ap.add_argument("--quant", default="int4,int8", help="int4 (g128) and/or int8")
    args = ap.parse_args(argv)
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = tuple(int(m) for m in args.ms.split(","))
    modes = tuple(args.quant.split(","))
    dev = Device()
    t0 = time.perf_counter()
    mods = {}
    for name, (k, n) in shapes.items():
        for m in ms:
            for mode in modes:
                g, plan, upper = build(k, n, m, mode)
                mods[(name, m, mode)] = (g, plan, generate_module({"run": (g, plan)}, {"run": upper}))
    with ThreadPoolExecutor(16) as pool:
        cubins = dict(zip(mods, pool.map(lambda key: compile_cubins(mods[key][2].source, (dev.arch,))[dev.arch],
                                         mods)))
    print(f"# {dev.name} ({dev.arch}): {len(mods)} kernels compiled in {time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    rows, failed = [], False
    for name, (k, n) in shapes.items():
        w = ((rng.random((n, k), dtype=np.float32) * 2 - 1) / np.sqrt(k)).astype(np.float16)
        x = (rng.random((max(ms), k), dtype=np.float32) * 2 - 1).astype(np.float16)
        for mode in modes:
            wq, scale = quantize_int4(w, GROUP) if mode == "int4" else quantize_int8(w)
            deq = dequantize_int4(wq, scale, GROUP) if mode == "int4" else dequantize_int8(wq, scale)
            ref = x.astype(np.float32) @ deq.T
            for m in ms:
                g, plan, mod = mods[(name, m, mode)]
                module = dev.load_module(cubins[(name, m, mode)])
                launch = mod.launches["run"][0]
                table = KernelTable(dev, module, [launch.kernel])
                arenas = [dev.alloc_arena(plan.arena_bytes) for _ in range(ARENAS)]
                for a in arenas:
                    dev.upload(a, 0, np.full(plan.arena_bytes, 0xFF, np.uint8))
                    dev.upload(a, plan.dims_offset, np.array([m], np.int64))
                    dev.upload(a, plan.placement("x").offset, x[:m])
                    dev.upload(a, plan.placement("wq").offset, wq)
                    dev.upload(a, plan.placement("scale").offset, scale)
                dev.synchronize()

                def go(a):
                    table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a)

                go(arenas[0])
                dev.synchronize()
                y = dev.download(arenas[0], plan.placement("y").offset, m * n * 2).view(np.float16)
                y = y.reshape(m, n).astype(np.float32)
                err = float(np.max(np.abs(y - ref[:m]))) if np.all(np.isfinite(y)) else float("inf")
                top = float(np.max(np.abs(ref[:m])))
                ok = err <= 2e-2 * top
                failed |= not ok
                us = time_launches(dev, go, arenas)
                weight_bytes = wq.nbytes + scale.nbytes
                gbs = (weight_bytes + (m * k + m * n) * 2) / (us * 1e-6) / 1e9
                rows.append((name, f"{k}x{n}", m, mode, us, gbs, 100 * gbs * 1e9 / PEAK, weight_bytes,
                             "ok" if ok else f"FAIL err {err:.3g} / max {top:.3g}"))
                for a in arenas:
                    a.free()
    print(f"\n{'shape':11s} {'KxN':>12s} {'M':>3s} {'quant':5s} {'us':>9s} {'GB/s':>7s} {'%4.3TB/s':>8s} "
          f"{'MB read':>8s}  check")
    for name, kn, m, mode, us, gbs, pct, nbytes, ok in rows:
        print(f"{name:11s} {kn:>12s} {m:>3d} {mode:5s} {us:9.2f} {gbs:7.0f} {pct:7.1f}% {nbytes / 1e6:8.1f}  {ok}")
    print(f"# total {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
