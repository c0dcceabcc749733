"""A small timing table on the GPU for the bundled fixtures (tiny models: this measures launch and
runtime overhead, not bandwidth). Prints: model, batch, CUDA graphs, prefill ms, decode ms/step,
tokens/s. Run on the GPU machine (examples/gpu_check.sh calls it)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from atlasc.artifact import open_artifact
from atlasc.compiler import compile_model
from atlasc.ir.program import CompileOptions
from atlasc.runtime.device import Device
from atlasc.runtime.generate import generate
from atlasc.runtime.gpu import GpuModel

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def main(names: list[str]) -> None:
    dev = Device()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = f"{tmp}/{name}.atlas"
            compile_model(FIXTURES / f"{name}.onnx", path, CompileOptions(archs=(dev.arch,), max_batch=8,
                                                                          max_seq=256))
            art = open_artifact(path)
            for graphs in (False, True):
                model = GpuModel(art, device=dev, cuda_graphs=graphs)
                for batch in (1, 8):
                    prompts = [list(np.random.default_rng(batch).integers(1, 200, 32)) for _ in range(batch)]
                    generate(model, prompts, 8)  # warm up (graph capture happens here)
                    t = generate(model, prompts, 64).timing()
                    rows.append((name, batch, "on" if graphs else "off", t["prefill_ms"], t["decode_ms_per_step"],
                                 t["tokens_per_s"], sum(1 for n in art.manifest.entries["decode"].nodes if n.kernel)))
                model.close()
    print(f"{'model':<12} {'batch':>5} {'graphs':>6} {'prefill ms':>10} {'decode ms/step':>15} {'tok/s':>9} "
          f"{'kernels/step':>12}")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:>5} {r[2]:>6} {r[3]:>10.3f} {r[4]:>15.3f} {r[5]:>9.1f} {r[6]:>12}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama", "gpt2"])
