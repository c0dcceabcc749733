"""A/B of compiled decoders by their decode step alone: every artifact is loaded in one process and its step
replayed in turn (runtime/bench.py step_times: ten steps back to back in one CUDA graph, no host in between),
round after round, so clock and placement drift between processes, which moves one `atlasc bench` by ~3%
(docs/perf.md v16), hits every artifact alike. Prints each artifact's median us per step per round, the
median over rounds and its ratio to the first artifact's.

    python examples/replay_ab.py a.atlas b.atlas --batch 1,32 --context 256 --rounds 5
    python examples/replay_ab.py a.atlas --pdl 0,1          # one artifact, plain and programmatic graphs

GPU machine only (pycuda).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from atlasc.artifact import open_artifact
from atlasc.runtime.bench import step_times
from atlasc.runtime.device import Device
from atlasc.runtime.gpu import GpuModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    ap.add_argument("--context", default="256", help="tokens in the cache, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10, help="graph replays per artifact and round (median taken)")
    ap.add_argument("--pdl", default="", help="load each artifact once per ATLAS_PDL value, e.g. 0,1")
    args = ap.parse_args()
    dev = Device()  # one context for all: a model's kernels launch only in the context that loaded them
    models = []  # (label, GpuModel)
    for path in args.artifacts:
        for pdl in args.pdl.split(",") if args.pdl else [None]:
            if pdl is not None:
                os.environ["ATLAS_PDL"] = pdl  # read by GpuModel at load
            label = path.stem + (f" pdl={pdl}" if pdl is not None else "")
            models.append((label, GpuModel(open_artifact(path), device=dev, cuda_graphs=False)))
    cases = [(b, c) for b in map(int, args.batch.split(",")) for c in map(int, args.context.split(","))]
    results = {(label, case): [] for label, _ in models for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            for label, model in models:
                results[label, case].append(statistics.median(step_times(model, *case, replays=args.replays)))
    width = max(len(label) for label, _ in models)
    for case in cases:
        print(f"== batch {case[0]}, context {case[1]}: us per decode step, {args.rounds} rounds")
        first = statistics.median(results[models[0][0], case])
        for label, _ in models:
            values = results[label, case]
            med = statistics.median(values)
            print(f"{label:<{width}}  " + " ".join(f"{v:8.1f}" for v in values) +
                  f"  median {med:8.1f}  x{med / first:.4f}")


if __name__ == "__main__":
    main()
