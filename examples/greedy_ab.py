"""Greedy generations of two decoder artifacts side by side on the GPU: how many tokens agree, and how far their
logits are apart over the first steps (two builds of one model that differ in a kernel choice, e.g. a K split).

    python3 examples/greedy_ab.py a.atlas b.atlas --batch 1 --new 48

Prompts: --batch random prompts of --prompt tokens (seeded). With random weights the logits are nearly flat, so
a rounding difference can flip a near-tie and the two generations part from there; the logits of the steps
before any flip say how close the kernels are.
"""

from __future__ import annotations

import argparse

import numpy as np

from atlasc.artifact import open_artifact
from atlasc.runtime.device import Device
from atlasc.runtime.generate import generate
from atlasc.runtime.gpu import GpuModel


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--steps", type=int, default=8, help="decode steps whose logits are compared")
    args = ap.parse_args(argv)
    dev = Device()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 1000, args.prompt)] for _ in range(args.batch)]
    runs = []
    for path in (args.a, args.b):
        model = GpuModel(open_artifact(path), device=dev)
        result = generate(model, prompts, args.new, keep_logits=True)
        runs.append((result.tokens, np.stack(result.step_logits).astype(np.float32)))
        model.close()
    (ta, la), (tb, lb) = runs
    same = sum(x == y for row_a, row_b in zip(ta, tb) for x, y in zip(row_a, row_b))
    total = sum(len(row) for row in ta)
    first = min((next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(ta, tb)))
    diff = float(np.abs(la[: args.steps] - lb[: args.steps]).max())
    print(f"batch {args.batch}: tokens equal {same}/{total} (first difference at token {first}); first "
          f"{args.steps} steps' logits max |a - b| {diff:.4f} of max |logit| {float(np.abs(la).max()):.2f}")


if __name__ == "__main__":
    main()
