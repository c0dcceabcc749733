"""Kernel lab for the weight-only quantized Linear kernels (codegen/quant.py + quant.cu): check, then time.

    python examples/quant_lab.py                       # int4 g128 and int8 on the Llama-3-8B shapes, M = 1
    python examples/quant_lab.py --ms 1,4,8 --quant int4 --shapes "8B qkv,8B down"
    python examples/quant_lab.py --variant table,simt  # the tensor-core path vs the CUDA-core fallback
    python examples/quant_lab.py --variant table,a8    # float activations vs int8 ones (W4A8 / W8A8 dp4a, M <= 8)
    python examples/quant_lab.py --split 1,4,8 --u 2,4 # sweep forced split-K ways x steps in flight (ATLAS_QUANT_*)
    python examples/quant_lab.py --quant int8 --ks 1,2,4 # a K split across blocks (ATLAS_QUANT_KSPLIT)
    python examples/quant_lab.py --quant int4 --ofs 0,1 # int4 at one row: the offset dequantization (ATLAS_QUANT_OFS)
    python examples/quant_lab.py --quant int4 --min-blocks 0,4   # launch bound of the one-row kernels
    python examples/quant_lab.py --ptxas sm80,sm90     # no GPU: ptxas registers / spills of each kernel
    python examples/quant_lab.py --variant table,norm,gated --quant int4 --shapes "8B gate_up"   # fused prologue cost
    python examples/quant_lab.py --quant int4,int8 --variant table,bulk,gated-bulk   # sm90: the copy-engine kernels

For each (shape, M, mode) it builds a one-node graph `LinearQ4(x[m, K], wq, scale)` (or LinearQ8 /
LinearF8 for --quant fp8) with
random fp16 weights quantized by passes/quantize.py, generates the kernel the compiler emits, checks it
once against numpy (x @ dequant(wq)^T in float32; tolerance 2e-2 of max |y|), then times it exactly as
examples/kernel_lab.py does (CUDA graph of launches rotating among enough arena copies that none is
served from L2, median of replays).
GB/s counts the bytes a decode step must read: packed weights + scales (+ x and y); % is of 4.30 TB/s.
--variant sets ATLAS_QUANT_PATH while generating (codegen/quant.py: "table" = what the compiler emits,
"simt" = the CUDA-core fallback only); "norm" / "gated" = fuse-linear-prologue's NormLinearQ (residual add +
RMSNorm staged by every block, b = 0 and g = 1; "gated" with the SwiGLU epilogue) on the table path; "a8" =
activations quantized per row to int8 in the kernel, W4A8 / W8A8 at decode (int4 g128: tensor cores; else
dp4a): its timings are passes/decode_paths.yaml's table; "norm-a8" / "gated-a8": the fused kinds with int8
activations (what a decode step runs when choose-decode-path takes W4A8 / W8A8); "bulk" / "norm-bulk" /
"gated-bulk": the same kinds with float x on the copy-engine path (codegen/quant_bulk.py, ATLAS_QUANT_BULK=1, an
sm90-only compile: the batch-1 default of an sm90 compile at K >= 4096), their tensor maps written into every arena
copy; sm90 GPUs only. --ptxas compiles the same
kernels for the given archs with `-Xptxas -v` and prints registers and spill bytes per kernel instead (exit
1 on any spill).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from lab_floor import spread_windows

from kernel_lab import (FUSED, PEAK, SHAPES, SWIGLU, arena_count, check_output, generate_with_env, reference,
                        split_variant, time_launches, with_options)

from atlasc.codegen import quant, quant_bulk
from atlasc.codegen.nvcc import compile_cubins, flags, nvcc_path
from atlasc.ir import Graph, Node, SymbolInfo, Value
from atlasc.ir import symbolic as S
from atlasc.ir.memory import MemoryPlan, Placement, align
from atlasc.ir.ops.prologue import PROLOGUE_SMEM_BYTES, staging_bytes
from atlasc.ir.ops.quant import ACT8_MAX_M, dequant_f8
from atlasc.passes.quantize import dequantize_int4, dequantize_int8, quantize_fp8, quantize_int4, quantize_int8
from atlasc.runtime.device import Device, KernelTable
from atlasc.runtime.tensor_maps import write_tensor_maps

GROUP = 128


def build(k: int, n: int, m_max: int, mode: str, act: str = "", kind: str = "linear"):
    """(graph, plan, upper) of LinearQ4/Q8(x[m, k], wq, scale) with 256-aligned buffers; act="int8" quantizes
    x per row to int8 inside the kernel (W4A8 / W8A8, decode only). kind "norm": NormLinearQ(x, b, g, wq,
    scale) with the sum s as a second output (fuse-linear-prologue's residual add + RMSNorm); "gated": the
    same with the SwiGLU epilogue, y [m, n / 2]."""
    g = Graph(f"q_{mode}_{kind}_{k}x{n}_m{m_max}")
    g.symbols = {"m": SymbolInfo(1, m_max)}
    x = Value("x", "float16", (S.sym("m"), k))
    if mode == "int4":
        wq, scale = Value("wq", "uint8", (n, k // 2)), Value("scale", "float16", (n, k // GROUP))
        op, attrs = "LinearQ4", {"group_size": GROUP, "act": act}
    else:  # int8, or fp8 (E4M3 codes: LinearF8, same bytes per weight)
        wq, scale = Value("wq", "uint8" if mode == "fp8" else "int8", (n, k)), Value("scale", "float16", (n,))
        op, attrs = ("LinearF8", {}) if mode == "fp8" else ("LinearQ8", {"act": act})
    n_out = n // 2 if kind == "gated" else n
    y = Value("y", "float16", (S.sym("m"), n_out))
    values = [x, wq, scale, y]
    if kind == "linear":
        g.inputs, g.nodes, g.outputs = [x, wq, scale], [Node(op, [x, wq, scale], [y], attrs)], [y]
    else:
        b, gamma, s = Value("b", "float16", x.shape), Value("g", "float16", (k,)), Value("s", "float16", x.shape)
        fused = {"epsilon": 1e-5, "linear": op, "act": act, "group_size": GROUP} | \
            ({"epilogue": SWIGLU, "gate_input": 0} if kind == "gated" else {})
        g.inputs = [x, wq, scale, b, gamma]
        g.nodes = [Node("NormLinearQ", [x, b, gamma, wq, scale], [y, s], fused)]
        g.outputs = [y, s]
        values += [b, gamma, s]
    plan = MemoryPlan(symbols=("m",))
    off = 256
    sizes = {"x": m_max * k * 2, "wq": n * k // (2 if mode == "int4" else 1),
             "scale": n * (k // GROUP if mode == "int4" else 1) * 2, "y": m_max * n_out * 2,
             "b": m_max * k * 2, "g": k * 2, "s": m_max * k * 2}
    for v in values:
        plan.placements[v.name] = Placement("activations", off, sizes[v.name])
        off = align(off + sizes[v.name])
    plan.arena_bytes = off
    return g, plan, {"m": m_max}


def generate(k: int, n: int, m: int, mode: str, variant: str = "table", split: str = "", u: str = "",
             act: str = "", ks: str = "", ofs: str = "", mb: str = ""):
    """(graph, plan, module) of build(k, n, m, mode, act) generated with ATLAS_QUANT_PATH=variant (and
    ATLAS_QUANT_SPLIT=split, ATLAS_QUANT_U=u, ATLAS_QUANT_KSPLIT=ks, ATLAS_QUANT_OFS=ofs, ATLAS_QUANT_MIN_BLOCKS=mb
    when given); variant "norm" / "gated": that fused kind with the default path table; a "-bulk" suffix (or
    "bulk" alone, the plain kind): on the copy-engine path in an sm90-only compile, SystemExit where it declined."""
    bulk = variant == "bulk" or variant.endswith("-bulk")
    base = variant.removesuffix("-a8").removesuffix("-bulk")
    kind = base if base in FUSED else "linear"
    env = {quant.PATH_ENV: "table" if kind != "linear" or bulk else variant, quant.SPLIT_ENV: split, quant.U_ENV: u,
           quant.KS_ENV: ks, quant.OFS_ENV: ofs, quant.MIN_BLOCKS_ENV: mb, quant_bulk.BULK_ENV: "1" if bulk else "0"}
    g, plan, mod = generate_with_env(build(k, n, m, mode, act, kind), env, ("sm90",) if bulk else ())
    if bulk and "atlas::linear_quant_bulk<" not in mod.source:
        sys.exit(f"quant_lab: {mode} {variant} {k}x{n} M={m}: the copy-engine path declined this kernel")
    return g, plan, mod


def ptxas_report(source: str, arch: str) -> dict[str, tuple[int, int, int]]:
    """kernel -> (registers, spill store bytes, spill load bytes): nvcc with the compiler's flags + -Xptxas -v."""
    with tempfile.TemporaryDirectory(prefix="atlasc-ptxas-") as tmp:
        (Path(tmp) / "k.cu").write_text(source)
        proc = subprocess.run([nvcc_path(), *flags(arch, source), "-Xptxas=-v", "k.cu", "-o", "k.cubin"], cwd=tmp,
                              capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-3000:]}")
    out = {}
    for block in (proc.stderr + proc.stdout).split("Compiling entry function ")[1:]:
        name = block.split("'")[1]
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        out[name] = (int(regs.group(1)) if regs else 0, int(spill.group(1)), int(spill.group(2)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8B qkv,8B o,8B gate_up,8B down,8B lm_head")
    ap.add_argument("--ms", default="1", help="comma-separated M values")
    ap.add_argument("--quant", default="int4,int8", help="comma-separated of int4 (g128), int8, fp8 (E4M3)")
    ap.add_argument("--variant", default="table",
                    help=f"comma-separated paths of {', '.join(quant.PATHS)}, a8 (int8 x, M <= 8), the fused "
                         f"{', '.join(FUSED)} (M <= 8) and their int8-x forms {', '.join(f + '-a8' for f in FUSED)}")
    ap.add_argument("--split", default="", help="comma-separated split-K ways to force (1, 2, 4, 8; default: "
                                                "quant.split_k); each becomes a variant name path/sS")
    ap.add_argument("--u", default="", help="comma-separated 1 KB steps in flight per warp to force (1 .. 8; "
                                            "default: quant.MMA_U); each becomes a variant name path/uU")
    ap.add_argument("--ks", default="", help="comma-separated K splits across blocks to force (1, 2, 4, 8 or auto; "
                                             "default: quant.quant_ks); each becomes a variant name path/ksKS")
    ap.add_argument("--ofs", default="", help="comma-separated 0 / 1 / auto: the offset dequantization of the one-row "
                                              "int4 kernels off / on / by width (ATLAS_QUANT_OFS); each becomes a "
                                              "variant name path/ofsO")
    ap.add_argument("--min-blocks", default="", help="comma-separated 0 / 2 / 3 / 4: the launch bound's blocks per "
                                                     "SM of the one-row kernels (ATLAS_QUANT_MIN_BLOCKS); each becomes "
                                                     "a variant name path/mbN")
    ap.add_argument("--ptxas", default="", help="comma-separated archs: print ptxas registers / spills, no GPU")
    ap.add_argument("--copies", type=int, default=1,
                    help="also time N copies of each kernel (the cubin loaded N times) launched round-robin, as a "
                         "model's per-layer kernels run: cold instruction caches, which one kernel repeated hides")
    ap.add_argument("--span-gb", type=float, default=0.0,
                    help="place the arena copies a timing rotates among as windows spread over one allocation of "
                         "this many GB (examples/lab_floor.py spread_windows), as a model's weights lie in its "
                         "arena: what address translation over gigabytes costs the kernel")
    ap.add_argument("--floor", action="store_true",
                    help="then time a kernel that only streams each row's packed bytes + scales, and an empty "
                         "kernel (examples/lab_floor.py): what any kernel of that size pays in this harness")
    args = ap.parse_args(argv)
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = tuple(int(m) for m in args.ms.split(","))
    modes = tuple(args.quant.split(","))
    if [q for q in modes if q not in ("int4", "int8", "fp8")]:
        ap.error(f"--quant takes int4, int8, fp8: {args.quant}")
    variants = tuple(v for v in args.variant.split(",") if v)
    known = (*quant.PATHS, "a8", *FUSED, *(f"{f}-a8" for f in FUSED), "bulk", *(f"{f}-bulk" for f in FUSED))
    bad = [v for v in variants if v not in known]
    if bad:
        ap.error(f"unknown --variant {', '.join(bad)} (expected: {', '.join(known)})")
    if any(v.endswith("bulk") for v in variants) and (max(ms) > 1 or "fp8" in modes):
        ap.error("the copy-engine variants (bulk, norm-bulk, gated-bulk) run at M = 1, int4 / int8 only")
    if any(v.removesuffix("-a8").removesuffix("-bulk") in FUSED for v in variants) and max(ms) > 8:
        ap.error("the fused variants (norm, gated) run at M <= 8 only")
    if any(v.endswith("a8") for v in variants) and (max(ms) > ACT8_MAX_M or "fp8" in modes):
        ap.error(f"--variant a8 needs --ms <= {ACT8_MAX_M} and int4 / int8 only (no int8 activations for fp8)")
    variants = with_options(with_options(with_options(variants, "s", args.split), "u", args.u), "ks", args.ks)
    variants = with_options(with_options(variants, "ofs", args.ofs), "mb", args.min_blocks)
    t0 = time.perf_counter()
    mods = {}
    for name, (k, n) in shapes.items():
        for m in ms:
            for mode in modes:
                for variant in variants:
                    path, opts = split_variant(variant)
                    fused = path.removesuffix("-a8").removesuffix("-bulk") in FUSED
                    if fused and not path.endswith("bulk") and staging_bytes(m, k, "float16") > PROLOGUE_SMEM_BYTES:
                        continue  # fuse-linear-prologue leaves such a norm unfused: nothing to time
                    a8 = path.endswith("a8")
                    mods[(name, m, mode, variant)] = generate(k, n, m, mode, "table" if path == "a8" else
                                                              path.removesuffix("-a8"),
                                                              opts.get("s", ""), opts.get("u", ""),
                                                              "int8" if a8 else "", opts.get("ks", ""),
                                                              opts.get("ofs", ""), opts.get("mb", ""))
    if args.ptxas:
        return ptxas_main(mods, tuple(a.strip() for a in args.ptxas.split(",")))
    dev = Device()
    if dev.arch != "sm90" and any(v.endswith("bulk") for v in variants):
        sys.exit(f"quant_lab: the copy-engine variants need an sm90 GPU, not {dev.arch}")
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
            if mode == "fp8":
                wq, scale = quantize_fp8(w)
                deq = dequant_f8(wq, scale)
            else:
                wq, scale = quantize_int4(w, GROUP) if mode == "int4" else quantize_int8(w)
                deq = dequantize_int4(wq, scale, GROUP) if mode == "int4" else dequantize_int8(wq, scale)
            for m, variant in ((m, v) for m in ms for v in variants):
                if (name, m, mode, variant) not in mods:
                    print(f"  {name:11s} M={m:<3d} {mode} {variant:10s} skipped: staging x needs more than "
                          f"{PROLOGUE_SMEM_BYTES // 1024} KB of shared memory", flush=True)
                    continue
                path = split_variant(variant)[0].removesuffix("-a8").removesuffix("-bulk")
                ref = reference(x[:m], deq, path if path in FUSED else "linear")
                g, plan, mod = mods[(name, m, mode, variant)]
                module = dev.load_module(cubins[(name, m, mode, variant)])
                launch = mod.launches["run"][0]
                table = KernelTable(dev, module, [launch.kernel])
                arenas, allocations = spread_windows(dev, mod.arena_bytes, int(args.span_gb * 1e9),
                                                     arena_count(mod.arena_bytes))
                for a in arenas:
                    dev.upload(a, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))
                    if mod.scratch_bytes:  # a K split's counters start at 0
                        dev.upload(a, mod.scratch_offset, np.zeros(mod.scratch_bytes, np.uint8))
                    dev.upload(a, plan.dims_offset, np.array([m], np.int64))
                    dev.upload(a, plan.placement("x").offset, x[:m])
                    dev.upload(a, plan.placement("wq").offset, wq)
                    dev.upload(a, plan.placement("scale").offset, scale)
                    if path in FUSED:  # b = 0, g = 1: x / rms(x) feeds the projection
                        dev.upload(a, plan.placement("b").offset, np.zeros(m * k, np.float16))
                        dev.upload(a, plan.placement("g").offset, np.ones(k, np.float16))
                    if mod.tensor_maps:  # the copy engine's maps of this copy (runtime/tensor_maps.py)
                        write_tensor_maps(dev, a, mod.tensor_maps)
                dev.synchronize()

                def go(a):
                    table.launch(launch.kernel, launch.grid, launch.block, launch.smem, a, args=launch.args)

                go(arenas[0])
                dev.synchronize()
                ok, err, top = check_output(dev, arenas[0], plan.placement("y").offset, ref)
                failed |= not ok
                us = time_launches(dev, go, arenas)
                copies_us = time_copies(dev, cubins[(name, m, mode, variant)], launch, arenas, args.copies)
                weight_bytes = wq.nbytes + scale.nbytes
                io = m * k + m * ref.shape[1] + (2 * m * k if path in FUSED else 0)  # fused: + b read, s written
                gbs = (weight_bytes + io * 2) / (us * 1e-6) / 1e9
                check = f"ok (err {err / top:.1e} of max |y|)" if ok else f"FAIL err {err:.3g} / max {top:.3g}"
                if copies_us:
                    check += f"  x{args.copies} copies {copies_us:.2f} us"
                rows.append((name, f"{k}x{n}", m, f"{mode} {variant}", us, gbs, 100 * gbs * 1e9 / PEAK, weight_bytes,
                             launch.grid[0], check))
                print(f"  {name:11s} M={m:<3d} {mode} {variant:10s} {us:9.2f} us {gbs:7.0f} GB/s {rows[-1][6]:5.1f}%  "
                      f"{rows[-1][-1]}", flush=True)
                for a in allocations:
                    a.free()
    print(f"\n{'shape':11s} {'KxN':>12s} {'M':>3s} {'quant path':15s} {'us':>9s} {'GB/s':>7s} {'%4.3TB/s':>8s} "
          f"{'MB read':>8s} {'grid':>6s}  check")
    for name, kn, m, mode, us, gbs, pct, nbytes, grid, ok in rows:
        print(f"{name:11s} {kn:>12s} {m:>3d} {mode:15s} {us:9.2f} {gbs:7.0f} {pct:7.1f}% {nbytes / 1e6:8.1f} "
              f"{grid:6d}  {ok}")
    if args.floor:
        from lab_floor import floor_rows, print_floor

        print_floor(floor_rows(dev, sorted({row[7] for row in rows})))
    print(f"# total {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


def time_copies(dev, cubin: bytes, launch, arenas, copies: int) -> float | None:
    """Median us per launch of `copies` separately loaded modules of one cubin, launched round-robin over
    the arenas (None when copies <= 1): every launch runs code at a new address, as each layer's kernel of
    a compiled model does."""
    if copies <= 1:
        return None
    tables = [KernelTable(dev, dev.load_module(cubin), [launch.kernel]) for _ in range(copies)]
    turn = iter(range(1 << 30))

    def go(a):
        tables[next(turn) % copies].launch(launch.kernel, launch.grid, launch.block, launch.smem, a, args=launch.args)

    return time_launches(dev, go, arenas)


def ptxas_main(mods, archs) -> int:
    """Print registers / spills of every generated kernel for each arch; 1 if any kernel spills."""
    jobs = [(key, arch) for key in mods for arch in archs]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        reports = list(pool.map(lambda job: ptxas_report(mods[job[0]][2].source, job[1]), jobs))
    spills = False
    print(f"{'shape':11s} {'M<=':>4s} {'quant path':10s} {'arch':5s} {'regs':>5s} {'spill st/ld':>12s}  "
          "tensor-core call")
    for ((name, m, mode, variant), arch), report in zip(jobs, reports):
        source = mods[(name, m, mode, variant)][2].source
        calls = re.findall(r"linear_quant_mma<([^>]*)>", source)
        for kernel, (regs, st, ld) in report.items():
            spills |= st > 0 or ld > 0
            print(f"{name:11s} {m:>4d} {mode + ' ' + variant:10s} {arch:5s} {regs:5d} {st:>6d}/{ld:<5d}  "
                  f"{'; '.join(calls) or '-'}  ({kernel})")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
