"""Time the weight quantizers of passes/quantize.py on random weights, CPU only, per thread count.

    python examples/quant_speed.py                              # 4096 x 4096, g128, 1 thread, 3 repeats
    python examples/quant_speed.py --shape 14336x4096 --shape 4096x28672 --threads 1,2 --only layer_int4
    python examples/quant_speed.py --shape 14336x4096 --threads 1 --only layer_int4 --profile
    git show REV:passes/quantize.py > /tmp/q_old.py && python examples/quant_speed.py --module /tmp/q_old.py

The weight [N, K] is float16 random normal * 0.02, read as the pass reads it: a transposed view of a
[K, N] array (fuse-linear's W^T; --contiguous for a plain [N, K] array). Quantizers: layer_int4,
layer_int4_zp and layer_int8 time _quantize_layer (what the pass runs per weight: codes, scales and the
relative error on ERROR_ROWS activation rows); int4, int4_asym and int8 the bare quantize_* functions.
Prints the median and the best seconds per call, the float16 MB/s and the speed-up over the first thread
count (both of the median) for each QUANT_THREADS value, and cpu/wall: the process's CPU seconds per wall
second, i.e. how many cores the call kept busy (near the thread count when nothing serializes it, whatever
else runs on the machine; it counts busy-waiting BLAS threads too). --profile prints the cProfile of one
call at the first thread count instead.
--module loads the quantizer from another file (e.g. an older revision) so that two versions can be
timed on the same machine.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import time

import numpy as np


def load(path: str | None):
    if not path:
        from atlasc.passes import quantize

        return quantize
    spec = importlib.util.spec_from_file_location("atlasc.passes.quantize_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUANTIZERS = {
    "layer_int4": lambda q, w, g: q._quantize_layer(w, "int4", g, seed=0),
    "layer_int4_zp": lambda q, w, g: q._quantize_layer(w, "int4", g, seed=0, zero_points=True),
    "layer_int8": lambda q, w, g: q._quantize_layer(w, "int8", g, seed=0),
    "int4": lambda q, w, g: q.quantize_int4(w, g),
    "int4_asym": lambda q, w, g: q.quantize_int4_asym(w, g),
    "int8": lambda q, w, g: q.quantize_int8(w),
}


def weight(n: int, k: int, contiguous: bool) -> np.ndarray:
    wt = (np.random.default_rng(0).standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float16)
    return np.ascontiguousarray(wt.T) if contiguous else wt.T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="N x K of the weight (NxK or N,K); repeat for several")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", default="1", help="comma-separated QUANT_THREADS values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="layer_int4,int4,int4_asym,int8",
                    help=f"comma-separated quantizers, of {', '.join(QUANTIZERS)}")
    ap.add_argument("--contiguous", action="store_true", help="a C-contiguous [N, K] weight, not a transposed view")
    ap.add_argument("--profile", action="store_true", help="cProfile one call per quantizer and shape instead")
    ap.add_argument("--chunk-elements", type=int, default=0, help="override CHUNK_ELEMENTS (weight elements per chunk)")
    ap.add_argument("--module", default="", help="a quantize.py to load instead of atlasc.passes.quantize")
    args = ap.parse_args(argv)
    q = load(args.module)
    if args.chunk_elements:
        q.CHUNK_ELEMENTS = args.chunk_elements
    threads = [int(t) for t in args.threads.split(",")]
    names = args.only.split(",")
    unknown = [n for n in names if n not in QUANTIZERS]
    if unknown:
        ap.error(f"unknown quantizer {', '.join(unknown)}: pick from {', '.join(QUANTIZERS)}")
    print(f"g{args.group_size}, {'contiguous' if args.contiguous else 'transposed view'}, median of "
          f"{args.repeats}, {args.module or 'atlasc.passes.quantize'}, CHUNK_ELEMENTS {q.CHUNK_ELEMENTS}")
    print(f"{'quantizer':14s} {'N x K':>12s} {'threads':>7s} {'median s':>9s} {'best s':>7s} {'MB/s':>7s} "
          f"{'speed-up':>8s} {'cpu/wall':>8s}")
    for shape in args.shape or ["4096x4096"]:
        n, k = (int(v) for v in shape.lower().replace(",", "x").split("x"))
        w = weight(n, k, args.contiguous)
        for name in names:
            fn = QUANTIZERS[name]
            if args.profile:
                q.QUANT_THREADS = threads[0]
                print(f"--- {name} {n} x {k}, {threads[0]} threads")
                prof = cProfile.Profile()
                prof.runcall(fn, q, w, args.group_size)
                pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                continue
            first = None
            for t in threads:
                q.QUANT_THREADS = t
                times, cpus = [], []
                for _ in range(args.repeats):
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn(q, w, args.group_size)
                    times.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                med = statistics.median(times)
                first = first or med
                print(f"{name:14s} {f'{n}x{k}':>12s} {t:7d} {med:9.3f} {min(times):7.3f} {w.nbytes / med / 1e6:7.0f} "
                      f"{first / med:7.2f}x {statistics.median(cpus) / med:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
