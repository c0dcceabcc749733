"""Greedy-generation references from onnxruntime for the decoder fixtures.

For each decoder fixture writes `examples/fixtures/<name>.greedy.npz` with, per configuration
`b{batch}_l{length}` (batch 1 and 4, longest prompt 1 and 17, 32 new tokens): the prompts
(`.prompts`, left-padded with -1), the greedy tokens (`.tokens`) and the last-position logits of
every step (`.logits`). The GPU machine's onnxruntime cannot load every fixture, so the GPU tests
compare against these files; tests/test_compile.py checks they still equal a live onnxruntime run.

    python examples/greedy_refs.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
sys.path.insert(0, str(HERE.parent / "tests"))

from ort_reference import ort_greedy  # noqa: E402

CONFIGS = [(1, 1), (1, 17), (4, 1), (4, 17)]
NEW_TOKENS = 32


def prompts_for(batch: int, length: int) -> list[list[int]]:
    """Deterministic prompts; in a batch the lengths differ (left padding), the longest is `length`."""
    rng = np.random.default_rng(batch * 100 + length)
    return [[int(t) for t in rng.integers(1, 200, size=max(1, length - 3 * i))] for i in range(batch)]


def main() -> None:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    for f in manifest:
        if f["kind"] != "decoder":
            continue
        arrays = {}
        for batch, length in CONFIGS:
            prompts = prompts_for(batch, length)
            tokens, logits = ort_greedy(FIXTURES / f"{f['name']}.onnx", prompts, NEW_TOKENS)
            key = f"b{batch}_l{length}"
            padded = np.full((batch, length), -1, np.int64)
            for i, p in enumerate(prompts):
                padded[i, length - len(p):] = p
            arrays[f"{key}.prompts"] = padded
            arrays[f"{key}.tokens"] = np.array(tokens, np.int64)
            arrays[f"{key}.logits"] = np.stack(logits)
        np.savez_compressed(FIXTURES / f"{f['name']}.greedy.npz", **arrays)
        print(f["name"], "ok")


if __name__ == "__main__":
    main()
