"""Kernel lab for the Linear family (codegen/linear.py + linear.cu): check, then time, its paths.

    python examples/kernel_lab.py                 # Llama-3-8B and Llama-3.2-1B projection shapes,
                                                  # M in 1, 2, 4, 8, 16, 32, 128, paths simt and mma
    python examples/kernel_lab.py --quick         # one shape, M = 1 (smoke test)
    python examples/kernel_lab.py --shapes "8B o,1B down" --ms 8,32 --variant simt,mma,table
    python examples/kernel_lab.py --ms 1,8 --variant table,norm,gated   # the fused decode projections
    python examples/kernel_lab.py --shapes "1B down,1B o" --ms 1 --variant mma --u 2,4,8   # loads in flight
    python examples/kernel_lab.py --ms 16,32 --variant table --ft 1,2,4,auto   # x shared by FT feature tiles
    python examples/kernel_lab.py --ms 1,8 --variant table --ks 1,2,4,auto --shapes "1B down,8B o"   # K split
    python examples/kernel_lab.py --ms 1,8 --bucket 8 --variant table --ks 1,2,auto   # batch 1 in the 1-8 kernel
    python examples/kernel_lab.py --ms 128,512,4096 --variant mma,tc --shapes "8B qkv,8B gate_up,8B down"
                                                  # prefill: the MMA prefill vs the tiled GEMM (gemm.cu)

For each (K x N, M, variant) it builds a one-node graph `Linear(x[m, K], w[N, K])` (fp16) with the
compile-time maximum m = M (the variants a kernel compiled for max_batch M would hold; --bucket B: m = max(B, M),
timed at M rows, as a step's kernel for a batch bucket runs a smaller batch), generates the
same kernel the compiler emits with ATLAS_LINEAR_PATH=variant (linear.py: "simt" = the CUDA-core GEMV /
tiled paths, "mma" = the tensor-core paths for every M, "table" = what the compiler emits by default, per
linear.DECODE_PATH, with ATLAS_LINEAR_PREFILL's default auto at M > 32; "tc" = "table" with
ATLAS_LINEAR_PREFILL=tc: gemm.cu's tiled tensor-core GEMM for every M > 32; "mma" runs with
ATLAS_LINEAR_PREFILL=mma: the MMA prefill for every M > 32), compiles every kernel with nvcc in
parallel, checks the output once against numpy (float32 accumulation; tolerance 2e-2 of max |y|), then
times it with CUDA events around a captured CUDA graph of launches that rotate among copies of the arena
(arena_count: enough copies that ROTATE_BYTES, over 3x the 50 MB L2, pass between two launches on the
same copy, so that no launch finds its weights in L2, as in a decode step where the whole model passes
between two uses of a layer), at least 30 launches, replayed 20 times after a warm-up: the median replay
over the launch count is the time per launch. GB/s counts weight + x + y bytes; % is of 4.30 TB/s;
TFLOP/s counts 2 * M * N * K. The last table puts the variants side by side per (shape, M) and names the
fastest: what linear.DECODE_PATH should say for each M bucket.

Two more variants time the fused decode projections of fuse-linear-prologue (M <= 8) with the default
path table: "norm" = NormLinear(a, b, g, w) (the residual add + RMSNorm staged in shared memory by
every block, the sum written by block 0) and "gated" = the same with the SwiGLU epilogue (y has N / 2
columns; gate/up shapes). Set against "table", they show what the prologue and the epilogue cost.
Their reference: b = 0 and g = 1, so x = fp16(a / rms(a)) (and silu(gate) * up in float32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from atlasc.codegen import gemm, generate_module, linear
from atlasc.codegen.nvcc import compile_cubins
from atlasc.ir import Graph, Node, SymbolInfo, Value
from atlasc.ir import symbolic as S
from atlasc.ir.memory import MemoryPlan, Placement, align
from atlasc.runtime.cudagraph import CapturedGraph
from atlasc.runtime.device import Device, KernelTable

PEAK = 4.30e12
SHAPES = {  # (K, N)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "8B lm_head": (4096, 128256),
    "1B qkv": (2048, 3072), "1B o": (2048, 2048), "1B gate_up": (2048, 16384), "1B down": (8192, 2048),
    "1B lm_head": (2048, 128256),
}
MS = (1, 2, 4, 8, 16, 32, 128)
VARIANTS = ("simt", "mma")
FUSED = ("norm", "gated")  # fuse-linear-prologue's NormLinear, and with the SwiGLU epilogue
# Linear variants: ATLAS_LINEAR_PATH values, and "tc" = the default table with ATLAS_LINEAR_PREFILL=tc (the
# tiled tensor-core GEMM of gemm.cu for M > 32; "mma" with ATLAS_LINEAR_PREFILL=mma, the others unset: auto)
LAB_VARIANTS = (*linear.PATHS, "tc")
SWIGLU = (("Sigmoid", (), (("in", 0),)), ("Mul", (), (("in", 0), ("step", 0))), ("Mul", (), (("step", 1), ("in", 1))))
ARENAS = 3  # the fewest arena copies a timing rotates among
MAX_ARENAS = 256
ROTATE_BYTES = 160 << 20  # bytes that pass through L2 between two launches on the same copy (L2: 50 MB)
LAUNCHES = 30
REPLAYS = 20


def build(k: int, n: int, m_max: int, kind: str = "linear"):
    """(graph, plan, upper): Linear(x[m, k], w[n, k]) (kind "norm": NormLinear(x, b, g, w) with the sum s
    as a second output; "gated": the same with the SwiGLU epilogue, y [m, n / 2]), every value in its
    own 256-aligned buffer; inputs in the order x, w (then b, g)."""
    g = Graph(f"lin_{kind}_{k}x{n}_m{m_max}")
    g.symbols = {"m": SymbolInfo(1, m_max)}
    x = Value("x", "float16", (S.sym("m"), k))
    w = Value("w", "float16", (n, k))
    n_out = n // 2 if kind == "gated" else n
    y = Value("y", "float16", (S.sym("m"), n_out))
    g.inputs = [x, w]
    if kind == "linear":
        g.nodes = [Node("Linear", [x, w], [y])]
        g.outputs = [y]
    else:
        b, gamma, s = Value("b", "float16", x.shape), Value("g", "float16", (k,)), Value("s", "float16", x.shape)
        attrs = {"epsilon": 1e-5} | ({"epilogue": SWIGLU, "gate_input": 0} if kind == "gated" else {})
        g.inputs += [b, gamma]
        g.nodes = [Node("NormLinear", [x, b, gamma, w], [y, s], attrs)]
        g.outputs = [y, s]
    plan = MemoryPlan(symbols=("m",))
    plan.dims_offset = 0
    off = 256
    sizes = {"x": m_max * k, "w": n * k, "y": m_max * n_out, "b": m_max * k, "g": k, "s": m_max * k}
    for v in [*g.inputs, *g.outputs]:
        plan.placements[v.name] = Placement("activations", off, sizes[v.name] * 2)
        off = align(off + sizes[v.name] * 2)
    plan.arena_bytes = off
    return g, plan, {"m": m_max}


def reference(x: np.ndarray, w: np.ndarray, kind: str) -> np.ndarray:
    """float32 reference of a variant's y (b = 0, g = 1 for the fused ones)."""
    if kind in FUSED:
        xf = x.astype(np.float32)
        x = (xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(1e-5))).astype(np.float16)
    y = x.astype(np.float32) @ w.T.astype(np.float32)
    if kind == "gated":
        h = y.shape[-1] // 2
        gate, up = y[:, :h], y[:, h:]
        y = gate / (1 + np.exp(-gate)) * up
    return y


def generate_with_env(built, env: dict[str, str], archs: tuple[str, ...] = ()):
    """(graph, plan, module) of a built (graph, plan, upper), generated with the environment variables
    `env` set (the codegen reads its path choices from them), restored afterwards; archs: the compile's target
    archs (() = unknown, as for every arch; ("sm90",) allows the sm90-only copy-engine paths)."""
    g, plan, upper = built
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        return g, plan, generate_module({"run": (g, plan)}, {"run": upper}, archs=archs)
    finally:
        for var, value in saved.items():
            if value is None:
                del os.environ[var]
            else:
                os.environ[var] = value


VARIANT_KEYS = ("ft", "u", "s", "ks", "ofs", "mb")  # forced options in a variant name, after the path: /ftFT, /uU,
# /sS, /ksKS, /ofsO, /mbN


def with_options(variants, key: str, values: str) -> tuple[str, ...]:
    """Each variant name once per comma-separated value, as name/<key><value> (unchanged when values is "")."""
    return tuple(f"{v}/{key}{x}" for v in variants for x in values.split(",")) if values else tuple(variants)


def split_variant(name: str) -> tuple[str, dict[str, str]]:
    """(path, {key: value}) of a variant name path[/ftFT][/uU][/sS][/ksKS][/ofsO][/mbN] (kernel_lab.py,
    quant_lab.py)."""
    path, *opts = name.split("/")
    found = {}
    for opt in opts:
        key = next(k for k in VARIANT_KEYS if opt.startswith(k))
        found[key] = opt[len(key):]
    return path, found


def generate(k: int, n: int, m: int, variant: str, u: str = "", ft: str = "", ks: str = ""):
    """(graph, plan, module) of build(k, n, m) generated with ATLAS_LINEAR_PATH=variant (a fused
    variant: its node with the default path table), ATLAS_LINEAR_U=u, ATLAS_LINEAR_FT=ft and
    ATLAS_LINEAR_KSPLIT=ks when given."""
    env = ({linear.U_ENV: u} if u else {}) | ({linear.FT_ENV: ft} if ft else {}) | \
        ({linear.KS_ENV: ks} if ks else {}) | \
        {gemm.PREFILL_ENV: "mma" if variant == "mma" else ""}  # at M > 32: mma the MMA prefill, others the default
    if variant in FUSED:
        return generate_with_env(build(k, n, m, variant), env | {linear.PATH_ENV: "table"})
    if variant == "tc":
        return generate_with_env(build(k, n, m), env | {linear.PATH_ENV: "table", gemm.PREFILL_ENV: "tc"})
    return generate_with_env(build(k, n, m), env | {linear.PATH_ENV: variant})


def check_output(dev, arena, offset: int, ref: np.ndarray) -> tuple[bool, float, float]:
    """(ok, max |error|, max |ref|) of the fp16 result at arena + offset against ref (float32):
    ok when the error is within 2e-2 of max |ref| (and every value finite)."""
    y = dev.download(arena, offset, ref.size * 2).view(np.float16).reshape(ref.shape).astype(np.float32)
    err = float(np.max(np.abs(y - ref))) if np.all(np.isfinite(y)) else float("inf")
    top = float(np.max(np.abs(ref)))
    return err <= 2e-2 * top, err, top


def arena_count(nbytes: int) -> int:
    """Arena copies to rotate among for a kernel that reads nbytes: at least ARENAS, and enough that the
    other copies' bytes (ROTATE_BYTES) evict a copy from L2 before it is used again (at most MAX_ARENAS)."""
    return max(ARENAS, min(MAX_ARENAS, -(-ROTATE_BYTES // max(1, nbytes)) + 1))


def time_launches(dev, go, arenas) -> float:
    """Median us per launch of go(arena): a captured graph of max(LAUNCHES, len(arenas)) launches
    rotating among the arenas, replayed REPLAYS times after a warm-up."""
    cuda = dev.cuda
    launches = max(LAUNCHES, len(arenas))
    graph = CapturedGraph(dev.stream, lambda: [go(arenas[i % len(arenas)]) for i in range(launches)])
    for _ in range(3):
        graph.launch()
    start, end = cuda.Event(), cuda.Event()
    times = []
    for _ in range(REPLAYS):
        start.record(dev.stream)
        graph.launch()
        end.record(dev.stream)
        end.synchronize()
        times.append(end.time_since(start) / launches * 1e3)
    graph.close()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape (8B o_proj), M = 1")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--ms", default="", help="comma-separated M values (default: 1,2,4,8,16,32,128)")
    ap.add_argument("--variant", default=",".join(VARIANTS),
                    help=f"comma-separated Linear paths to time, of {', '.join(LAB_VARIANTS)}, or the fused "
                         f"decode projections {', '.join(FUSED)} (M <= 8; default: simt,mma)")
    ap.add_argument("--u", default="",
                    help="comma-separated MMA decode steps in flight per warp to compare (ATLAS_LINEAR_U; "
                         "default: the table, linear.MMA_DECODE_U); each value becomes a variant name path/uU")
    ap.add_argument("--ft", default="",
                    help="comma-separated MMA decode feature tiles per warp to compare (ATLAS_LINEAR_FT: 1, 2, 4, "
                         "auto); each value becomes a variant name path/ftFT (M > 8: x fragments shared by FT tiles)")
    ap.add_argument("--ks", default="",
                    help="comma-separated K splits across blocks of the plain MMA decode to compare "
                         "(ATLAS_LINEAR_KSPLIT: 1, 2, 4, 8, auto); each value becomes a variant name path/ksKS")
    ap.add_argument("--bucket", type=int, default=0,
                    help="compile each kernel for up to max(BUCKET, M) rows and time it at M (a step's kernel serves a "
                         "batch bucket: e.g. 8, the decode kernel of batches 1-8; default: M, a kernel for M rows)")
    ap.add_argument("--floor", action="store_true",
                    help="then time a kernel that only streams each row's bytes, and an empty kernel "
                         "(examples/lab_floor.py): what any kernel of that size pays in this harness")
    args = ap.parse_args(argv)
    shapes = {"8B o": SHAPES["8B o"]} if args.quick else SHAPES
    if args.shapes:
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = (1,) if args.quick else MS
    if args.ms:
        ms = tuple(int(m) for m in args.ms.split(","))
    variants = tuple(v for v in args.variant.split(",") if v)
    bad = [v for v in variants if v not in LAB_VARIANTS + FUSED]
    variants = with_options(with_options(with_options(variants, "u", args.u), "ft", args.ft), "ks", args.ks)
    if bad:
        ap.error(f"unknown --variant {', '.join(bad)} (expected: {', '.join(LAB_VARIANTS + FUSED)})")
    if any(v in FUSED for v in variants) and max(ms) > 8:
        ap.error("the fused variants (norm, gated) run at M <= 8 only")
    dev = Device()
    cuda = dev.cuda
    t0 = time.perf_counter()
    jobs = [(name, k, n, m, v) for name, (k, n) in shapes.items() for m in ms for v in variants]
    mods = {}
    for name, k, n, m, v in jobs:
        path, opts = split_variant(v)
        mods[(name, m, v)] = generate(k, n, max(m, args.bucket), path, opts.get("u", ""), opts.get("ft", ""),
                                      opts.get("ks", ""))
    with ThreadPoolExecutor(16) as pool:
        cubins = dict(zip(mods, pool.map(lambda key: compile_cubins(mods[key][2].source, (dev.arch,))[dev.arch],
                                         mods)))
    print(f"# {dev.name} ({dev.arch}): {len(mods)} kernels compiled in {time.perf_counter() - t0:.1f}s",
          flush=True)
    rng = np.random.default_rng(0)
    rows = []
    failed = False
    floor_bytes = set()
    for name, (k, n) in shapes.items():
        w = (rng.random((n, k), dtype=np.float32) * 2 - 1) * np.float32(1 / np.sqrt(k))
        w = w.astype(np.float16)
        x = (rng.random((max(ms), k), dtype=np.float32) * 2 - 1).astype(np.float16)
        for m in ms:
            for variant in variants:
                ref = reference(x[:m], w, split_variant(variant)[0])
                g, plan, mod = mods[(name, m, variant)]
                module = dev.load_module(cubins[(name, m, variant)])
                launch = mod.launches["run"][0]
                table = KernelTable(dev, module, [launch.kernel])
                arenas = [dev.alloc_arena(mod.arena_bytes) for _ in range(arena_count(plan.arena_bytes))]
                for a in arenas:
                    dev.upload(a, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))  # poison (NaN in fp16)
                    if mod.scratch_bytes:  # a K split's counters start at 0
                        dev.upload(a, mod.scratch_offset, np.zeros(mod.scratch_bytes, np.uint8))
                    dev.upload(a, plan.dims_offset, np.array([m], np.int64))
                    dev.upload(a, plan.placement(g.inputs[0]).offset, x[:m])
                dev.upload(arenas[0], plan.placement(g.inputs[1]).offset, w)
                if split_variant(variant)[0] in FUSED:  # b = 0, g = 1
                    for a in arenas:
                        dev.upload(a, plan.placement(g.inputs[2]).offset, np.zeros(m * k, np.float16))
                        dev.upload(a, plan.placement(g.inputs[3]).offset, np.ones(k, np.float16))
                dev.synchronize()
                for a in arenas[1:]:
                    cuda.memcpy_dtod(int(a) + plan.placement(g.inputs[1]).offset,
                                     int(arenas[0]) + plan.placement(g.inputs[1]).offset, w.nbytes)

                def go(a):
                    table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a, args=launch.args)

                go(arenas[0])
                dev.synchronize()
                ok, err, scale = check_output(dev, arenas[0], plan.placement(g.outputs[0]).offset, ref)
                failed |= not ok
                us = time_launches(dev, go, arenas)
                fused = split_variant(variant)[0] in FUSED
                nbytes = (n * k + m * k + m * ref.shape[1]) * 2 + (2 * m * k * 2 if fused else 0)
                gbs = nbytes / (us * 1e-6) / 1e9
                tflops = 2 * m * n * k / (us * 1e-6) / 1e12
                rows.append((name, f"{k}x{n}", m, variant, us, gbs, 100 * gbs * 1e9 / PEAK, tflops, launch.grid[0],
                             "ok" if ok else f"FAIL err {err:.3g} / max {scale:.3g}"))
                floor_bytes.add(nbytes)
                for a in arenas:
                    a.free()
                print(f"  {name:11s} M={m:<3d} {variant:5s} {us:8.2f} us  {gbs:7.0f} GB/s  {rows[-1][6]:5.1f}%  "
                      f"{tflops:6.1f} TFLOP/s  {rows[-1][9]}", flush=True)
    print(f"\n{'shape':11s} {'KxN':>12s} {'M':>4s} {'path':5s} {'us':>9s} {'GB/s':>7s} {'%4.3TB/s':>8s} "
          f"{'TFLOP/s':>8s} {'grid':>6s}  check")
    for name, kn, m, variant, us, gbs, pct, tflops, grid, ok in rows:
        print(f"{name:11s} {kn:>12s} {m:>4d} {variant:5s} {us:9.2f} {gbs:7.0f} {pct:7.1f}% {tflops:8.1f} "
              f"{grid:6d}  {ok}")
    if len(variants) > 1:
        print(f"\n{'shape':11s} {'M':>4s} " + " ".join(f"{v + ' us':>10s}" for v in variants) + "  fastest")
        for name in shapes:
            for m in ms:
                t = {r[3]: r[4] for r in rows if r[0] == name and r[2] == m}
                print(f"{name:11s} {m:>4d} " + " ".join(f"{t[v]:10.2f}" for v in variants) +
                      f"  {min(t, key=t.get)}")
    if args.floor:
        from lab_floor import floor_rows, print_floor

        print_floor(floor_rows(dev, sorted(floor_bytes)))
    print(f"# total {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
