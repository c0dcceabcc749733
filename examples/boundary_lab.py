"""What the boundary between two pipelined decode steps costs, by how a step's inputs go up and its tokens come back.

A stand-in step (a CUDA graph of KERNELS spin kernels, each holding the GPU for SPIN_US) is run STEPS times in a
row, the way GpuModel.submit runs decode steps: two pinned stages used in turn, the host waiting for the step two
back before it rewrites that stage. Variants, per step:

- graph:    the graph alone (the floor).
- memcpy:   today's path: one host-to-device copy of the inputs on the stream, the graph, the tokens' copy back on a
            second stream (the next step's kernels wait for it).
- mapped:   no copy engine: a small kernel reads the inputs from mapped pinned host memory into the arena, the
            graph, a small kernel writes the tokens into mapped pinned host memory.
- mapped_g: as mapped, with the two small kernels inside the graph (one graph per stage).

Prints a table: us per step (median of ROUNDS) and the boundary (step - graph alone). Needs a GPU, pycuda and
nvcc (the kernels are compiled here with pycuda's SourceModule).

    python3 examples/boundary_lab.py --bytes 2304 --kernels 16 --spin-us 40 --steps 300 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

SOURCE = r"""
extern "C" __global__ void spin(unsigned long long ns, int* sink) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] += 1;
}
// n16 16-byte words from src to dst (either side may be mapped host memory)
extern "C" __global__ void copy16(uint4* dst, const uint4* src, int n16) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=2304, help="input bytes per step (dims + ids + mask + ...)")
    ap.add_argument("--tokens", type=int, default=8, help="token bytes copied back per step")
    ap.add_argument("--kernels", type=int, default=16)
    ap.add_argument("--spin-us", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="graph,memcpy,mapped,mapped_g")
    args = ap.parse_args()

    import pycuda.autoinit  # noqa: F401
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from atlasc.runtime.cudagraph import CapturedGraph

    mod = SourceModule(SOURCE, no_extern_c=True, arch="sm_90")
    spin, copy16 = mod.get_function("spin"), mod.get_function("copy16")
    n16 = -(-args.bytes // 16)
    t16 = -(-args.tokens // 16)
    arena = cuda.mem_alloc(1 << 20)
    sink = cuda.mem_alloc(16)
    inputs_at, tokens_at = int(arena), int(arena) + (1 << 19)
    stream, copy_stream = cuda.Stream(), cuda.Stream()
    flags = cuda.host_alloc_flags.DEVICEMAP
    stages = []
    for _ in range(2):
        pin_in = cuda.pagelocked_zeros(16 * n16, np.uint8, mem_flags=flags)
        pin_out = cuda.pagelocked_zeros(16 * t16, np.uint8, mem_flags=flags)
        stages.append({"in": pin_in, "out": pin_out, "in_dev": pin_in.base.get_device_pointer(),
                       "out_dev": pin_out.base.get_device_pointer(), "done": cuda.Event(), "ran": cuda.Event(),
                       "used": False})

    def body():
        for _ in range(args.kernels):
            spin(np.uint64(int(args.spin_us * 1e3)), sink, block=(32, 1, 1), grid=(1, 1), stream=stream)

    def stage_in(st):
        copy16(np.uintp(inputs_at), np.uintp(st["in_dev"]), np.int32(n16), block=(128, 1, 1),
               grid=(max(1, -(-n16 // 128)), 1), stream=stream)

    def stage_out(st):
        copy16(np.uintp(st["out_dev"]), np.uintp(tokens_at), np.int32(t16), block=(32, 1, 1), grid=(1, 1),
               stream=stream)

    plain = CapturedGraph(stream, body)
    in_graph = [CapturedGraph(stream, lambda st=st: (stage_in(st), body(), stage_out(st))) for st in stages]
    rng = np.random.default_rng(0)
    last = {"stage": None}

    def step(variant: str, i: int) -> None:
        st = stages[i % 2]
        if st["used"]:
            st["done"].synchronize()
        st["in"][:] = rng.integers(0, 255, st["in"].size, dtype=np.uint8) if i % 64 == 0 else st["in"]
        if variant == "graph":
            plain.launch()
            st["done"].record(stream)
        elif variant == "memcpy":
            cuda.memcpy_htod_async(inputs_at, st["in"], stream)
            if last["stage"] is not None:
                stream.wait_for_event(last["stage"]["done"])
            plain.launch()
            st["ran"].record(stream)
            copy_stream.wait_for_event(st["ran"])
            cuda.memcpy_dtoh_async(st["out"], tokens_at, copy_stream)
            st["done"].record(copy_stream)
        elif variant == "mapped":
            stage_in(st)
            plain.launch()
            stage_out(st)
            st["done"].record(stream)
        elif variant == "mapped_g":
            in_graph[i % 2].launch()
            st["done"].record(stream)
        st["used"] = True
        last["stage"] = st

    variants = args.variants.split(",")
    start, end = cuda.Event(), cuda.Event()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            for st in stages:
                st["used"] = False
            last["stage"] = None
            for i in range(8):  # warm-up
                step(v, i)
            cuda.Context.synchronize()
            start.record(stream)
            for i in range(args.steps):
                step(v, i)
            end.record(stream)
            end.synchronize()
            cuda.Context.synchronize()
            times[v].append(start.time_till(end) * 1e3 / args.steps)
    floor = statistics.median(times["graph"]) if "graph" in times else 0.0
    print(f"stand-in step: {args.kernels} kernels x {args.spin_us} us; {args.bytes} input bytes, {args.tokens} token "
          f"bytes; {args.steps} steps x {args.rounds} rounds")
    print("| variant | us per step (median) | min | max | boundary us (step - graph alone) |")
    print("|---|---|---|---|---|")
    for v in variants:
        med = statistics.median(times[v])
        print(f"| {v} | {med:.2f} | {min(times[v]):.2f} | {max(times[v]):.2f} | {med - floor:.2f} |")


if __name__ == "__main__":
    main()
