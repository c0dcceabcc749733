"""The peer's decode GEMMs: torch's float16 `F.linear` (cuBLAS) on the projection shapes kernel_lab.py times.

    python3 examples/peer_gemm_lab.py                          # 8B shapes, M = 1, 8, 16, 32
    python3 examples/peer_gemm_lab.py --ms 32 --shapes "8B gate_up,8B down"

Needs torch with CUDA (the GPU machine). Timed the way kernel_lab.py times atlasc's kernels, so the two
tables compare row by row: a CUDA graph of launches rotating among copies of the weights (enough copies
that over 160 MB pass through the 50 MB L2 between two uses of one copy, as in a decode step), at least
30 launches, replayed 20 times after a warm-up; the median replay over the launch count is the time per
launch. GB/s counts weight + x + y bytes; % is of 4.30 TB/s. y = x @ w.T with w [N, K], the layout the
compiler's weights have.
"""

from __future__ import annotations

import argparse
import statistics
import sys

PEAK = 4.30e12
SHAPES = {  # (K, N), as in kernel_lab.py
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "8B lm_head": (4096, 128256),
    "1B qkv": (2048, 3072), "1B o": (2048, 2048), "1B gate_up": (2048, 16384), "1B down": (8192, 2048),
    "1B lm_head": (2048, 128256),
}
ROTATE_BYTES = 160 << 20
LAUNCHES = 30
REPLAYS = 20


def time_linear(torch, k: int, n: int, m: int) -> tuple[float, float]:
    """Median us per F.linear(x[m, k], w[n, k]) and its largest error against a float32 product."""
    f = torch.nn.functional
    wbytes = n * k * 2
    copies = max(3, min(64, -(-ROTATE_BYTES // wbytes) + 1))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(copies)]
    ref = x.float() @ ws[0].float().T
    err = float((f.linear(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
    launches = max(LAUNCHES, copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # cuBLAS picks and allocates its workspace before capture
        for i in range(3):
            torch.matmul(x, ws[i % copies].T, out=ys[i % copies])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            torch.matmul(x, ws[i % copies].T, out=ys[i % copies])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches * 1e3)
    del graph, ws, ys
    torch.cuda.empty_cache()
    return statistics.median(times), err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8B qkv,8B o,8B gate_up,8B down,8B lm_head",
                    help="comma-separated shape names (kernel_lab.py's)")
    ap.add_argument("--ms", default="1,8,16,32", help="comma-separated M values")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: peer_gemm_lab.py needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: peer_gemm_lab.py needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(f"error: unknown shapes {', '.join(unknown)} (known: {', '.join(SHAPES)})", file=sys.stderr)
        return 2
    ms = [int(m) for m in args.ms.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| shape | M | torch F.linear us | GB/s | % of 4.30 TB/s | TFLOP/s | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        k, n = SHAPES[name]
        for m in ms:
            us, err = time_linear(torch, k, n, m)
            nbytes = 2 * (n * k + m * k + m * n)
            print(f"| {name} | {m} | {us:.2f} | {nbytes / us / 1e3:.0f} | {100 * nbytes / us / 1e-6 / PEAK:.1f} | "
                  f"{2 * m * n * k / us / 1e6:.1f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
