"""How a pipelined decode step's inputs and tokens cross PCIe, compared in one process on one artifact
(runtime/staging.py): "copies" (the copy engine: ATLAS_MAPPED_STAGING=0's path), "in-graph" (the staging kernels
inside the step's graph: the default) and "outside" (the same kernels launched around the plain graph). Prints each
graph's nodes, edges and programmatic edges, the median decode ms/step of generate() per mode and round (the
number `atlasc bench` reports), and each decode graph replayed alone.

    python3 examples/staging_ab.py model.atlas --prompt 128 --gen 128 --rounds 3

GPU machine only (pycuda).
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

from atlasc.artifact import open_artifact
from atlasc.runtime.cudagraph import _libcuda
from atlasc.runtime.device import Device
from atlasc.runtime.generate import generate
from atlasc.runtime.gpu import GpuModel
from atlasc.runtime.staging import blocks_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = Device()
    model = GpuModel(open_artifact(args.artifact), device=dev)
    print(f"pdl {model.pdl} {model.pdl_error}; staging {model.staging is not None} {model.staging_error}")
    lib = _libcuda()
    for key, g in model.graphs.items():
        edges, nodes = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.cuGraphGetEdges_v2(g.graph, None, None, None, ctypes.byref(edges))
        lib.cuGraphGetNodes(g.graph, None, ctypes.byref(nodes))
        print(key, f"nodes {nodes.value} edges {edges.value} programmatic {g.programmatic}")
    staging, in_graph = model.staging, model._staged_graph

    class Outside:  # the staging kernels on the stream around the plain graph
        def __init__(self, key, launches, slot):
            self.key, self.launches, self.slot = key, launches, slot

        def launch(self):
            stage, entry = model._stages[self.slot], self.key[0]
            out = next(o for o in model.manifest.entries[entry].outputs if o.name == "next_tokens")
            staging.copy_in(model.arena, stage.host_in, blocks_for(model._capacity(entry)), dev.stream)
            model._graph(self.key, self.launches).launch()
            staging.copy_out(stage.host_tokens, int(model.arena) + out.offset, stage.tokens.nbytes, dev.stream)

    prompts = [[int(x) for x in np.random.default_rng(0).integers(1, 1000, args.prompt)]]
    for rnd in range(args.rounds):
        for mode in ("copies", "in-graph", "outside"):
            model.staging = None if mode == "copies" else staging
            model._staged_graph = in_graph if mode == "in-graph" else Outside
            before = model.mapped_calls
            r = generate(model, prompts, args.gen)
            print(f"round {rnd} {mode}: median step {r.timing()['decode_ms_per_step']} ms, "
                  f"mapped calls {model.mapped_calls - before}")
    start, end = dev.cuda.Event(), dev.cuda.Event()
    for key, g in model.graphs.items():
        if key[0] == "prefill":
            continue
        for _ in range(3):
            g.launch()
        start.record(dev.stream)
        for _ in range(50):
            g.launch()
        end.record(dev.stream)
        end.synchronize()
        print(key, f"replayed alone: {start.time_till(end) * 1e3 / 50:.1f} us")


if __name__ == "__main__":
    main()
