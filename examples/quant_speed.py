"""Time the int4 / int8 weight quantizers (passes/quantize.py) on one random weight, CPU only.

    python examples/quant_speed.py                              # 4096 x 4096, g128, 1 thread, 3 repeats
    python examples/quant_speed.py --shape 14336x4096 --threads 1,4,16
    git show REV:passes/quantize.py > /tmp/q_old.py && python examples/quant_speed.py --module /tmp/q_old.py

Prints the median seconds per call of quantize_int4 (symmetric), quantize_int4_asym (zero points) and
quantize_int8 for each thread count (QUANT_THREADS). --module loads the quantizer from another file (e.g.
an older revision) so that two versions can be timed on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096", help="N x K of the weight")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", default="1", help="comma-separated QUANT_THREADS values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--module", default="", help="a quantize.py to load instead of atlasc.passes.quantize")
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.shape.lower().split("x"))
    q = load(args.module)
    w = (np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16)
    print(f"{'quantizer':20s} {'threads':>7s} {'median s':>9s}   ({n} x {k}, g{args.group_size}, "
          f"{args.module or 'atlasc.passes.quantize'})")
    for threads in (int(t) for t in args.threads.split(",")):
        q.QUANT_THREADS = threads
        for name, fn in (("quantize_int4", lambda: q.quantize_int4(w, args.group_size)),
                         ("quantize_int4_asym", lambda: q.quantize_int4_asym(w, args.group_size)),
                         ("quantize_int8", lambda: q.quantize_int8(w))):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            print(f"{name:20s} {threads:7d} {statistics.median(times):9.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
