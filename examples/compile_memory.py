"""Compile time and host memory of one compile: wall time per stage and the peak anonymous memory.

    python examples/build_llama.py llama-3.2-1b /tmp/l1b/m.onnx
    python examples/compile_memory.py /tmp/l1b/m.onnx --quant int4 --arch sm90 --max-batch 8 --max-seq 512

A thread samples /proc/self/status every 20 ms: RssAnon is the memory the compile itself holds (the
weights of a memory-mapped ONNX file are file-backed pages, evictable, counted in max RSS only); max
RSS is the kernel's high-water mark of both. nvcc runs in child processes, which are not counted.
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=None, help="artifact path (default: MODEL with .atlas)")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=512)
    args = ap.parse_args(argv)

    peak_kb = [0]

    def sample() -> None:
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak_kb[0] = max(peak_kb[0], int(line.split()[1]))
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    from atlasc.compiler import compile_model
    from atlasc.ir.program import CompileOptions

    out = args.output or args.model.with_suffix(f".{args.quant}.atlas")
    options = CompileOptions(archs=tuple(args.arch.split(",")), max_batch=args.max_batch, max_seq=args.max_seq,
                             quant=args.quant, group_size=args.group_size)
    t = time.perf_counter()
    result = compile_model(args.model, out, options)
    wall = time.perf_counter() - t
    time.sleep(0.05)
    q = result.manifest.report.get("quantization", {})
    print(f"{args.model.name} --quant {args.quant}: {wall:.1f} s wall; stages "
          + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    print(f"peak anonymous memory {peak_kb[0] / 1e6:.2f} GB; max RSS {max_rss:.2f} GB")
    if q:
        print(f"weights {q['bytes_before'] / 1e6:.0f} MB -> {q['bytes_after'] / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
