"""Build a Llama-architecture decoder as ONNX directly (onnx.helper, no torch), with seeded random
weights, in the real shapes of Llama-3.2-1B or Llama-3-8B (or a tiny config for tests).

The graph is spelled the way Hugging Face Llama exports come out (decomposed RMSNorm in float32,
rotate-half rotary from position_ids, repeat_kv by Unsqueeze/Expand/Reshape, softmax attention
with an additive causal + padding mask, SiLU-gated MLP) with the flat KV-cache interface of the
fixtures: inputs input_ids, attention_mask [batch, past + seq], position_ids, past_key_values.{i}.key
/value; outputs logits and present.{i}.key/value. Weights go to an external-data file beside the
model (the 8B one is ~16 GB), so the export takes seconds, not the minutes a 32-layer torch export
takes; it is meant to run on the GPU machine before a benchmark.

    python examples/build_llama.py llama-3.2-1b /tmp/models/llama1b.onnx
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


CONFIGS = {
    "tiny": LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256),
    "llama-3.2-1b": LlamaShape(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
    "llama-3-8b": LlamaShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
}

F16, F32, I64, BOOL = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


class WeightFile:
    """The external-data file: initializers are appended as they are made (4 KB aligned), so the model
    never holds its weights in protobuf memory (an 8B model would need 16 GB more, and minutes)."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close())

    def tensor(self, arr: np.ndarray, name: str) -> onnx.TensorProto:
        pad = -self.f.tell() % 4096
        self.f.write(b"\0" * pad)
        offset = self.f.tell()
        np.ascontiguousarray(arr).tofile(self.f)
        t = onnx.TensorProto(name=name, dims=list(arr.shape), data_type=helper.np_dtype_to_tensor_dtype(arr.dtype))
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def close(self) -> None:
        self.f.close()


def random_fp16(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    """Seeded random fp16 straight from random bits (no float32 normal draw: ~10x faster for the 8B's
    8 G weights): random sign and mantissa, exponent so that |w| lies in [scale / 2, 2 * scale)."""
    n = int(np.prod(shape))
    r = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
    e0 = int(np.clip(round(math.log2(scale)) + 15, 2, 29))  # the fp16 exponent field of ~scale
    exp = (e0 - 1 + ((r >> 10) & 1)).astype(np.uint16)
    return ((r & np.uint16(0x83FF)) | (exp << np.uint16(10))).view(np.float16).reshape(shape)


class Builder:
    def __init__(self, seed: int, dtype=np.float16, weights: WeightFile | None = None):
        self.nodes, self.inits = [], []
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.weights = weights
        self.n = 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def const(self, arr, base="c") -> str:
        name = self.name(base)
        arr = np.asarray(arr)
        if self.weights is not None and arr.nbytes >= 1024:
            self.inits.append(self.weights.tensor(arr, name))
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, shape, scale: float, base: str) -> str:
        if self.dtype == np.float16:
            return self.const(random_fp16(self.rng, shape, scale), base)
        w = (self.rng.standard_normal(shape, dtype=np.float32) * scale).astype(self.dtype)
        return self.const(w, base)

    def op(self, op_type: str, inputs, n_out: int = 1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # -- blocks --------------------------------------------------------------------------------
    def rmsnorm(self, x: str, width: int, eps: float) -> str:
        w = self.const((1.0 + 0.1 * self.rng.standard_normal(width)).astype(self.dtype), "norm_w")
        xf = self.op("Cast", [x], to=F32)
        var = self.op("ReduceMean", [self.op("Pow", [xf, self.const(np.float32(2.0))]), self.const(np.array([-1]))],
                      keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [var, self.const(np.float32(eps))])])])
        return self.op("Mul", [w, self.op("Cast", [self.op("Mul", [xf, inv])], to=F16)])

    def heads(self, x: str, n: int, d: int) -> str:
        return self.op("Transpose", [self.op("Reshape", [x, self.const(np.array([0, 0, n, d]))])], perm=[0, 2, 1, 3])

    def rotary(self, x: str, cos: str, sin: str, d: int) -> str:
        half = d // 2
        x1 = self.op("Slice", [x, self.const(np.array([0])), self.const(np.array([half])), self.const(np.array([3]))])
        x2 = self.op("Slice", [x, self.const(np.array([half])), self.const(np.array([d])), self.const(np.array([3]))])
        rot = self.op("Concat", [self.op("Neg", [x2]), x1], axis=-1)
        return self.op("Add", [self.op("Mul", [x, cos]), self.op("Mul", [rot, sin])])

    def repeat_kv(self, kv: str, shape_src: str, kv_heads: int, groups: int, d: int) -> str:
        if groups == 1:
            return kv
        shape = self.op("Shape", [shape_src])  # [B, Hkv, T, D] at run time
        b = self.op("Gather", [shape, self.const(np.array(0))], axis=0)
        t = self.op("Gather", [shape, self.const(np.array(2))], axis=0)
        unsq = lambda v: self.op("Unsqueeze", [v, self.const(np.array([0]))])  # noqa: E731
        target5 = self.op("Concat", [unsq(b), self.const(np.array([kv_heads, groups])), unsq(t),
                                     self.const(np.array([d]))], axis=0)
        expanded = self.op("Expand", [self.op("Unsqueeze", [kv, self.const(np.array([2]))]), target5])
        target4 = self.op("Concat", [unsq(b), self.const(np.array([kv_heads * groups])), unsq(t),
                                     self.const(np.array([d]))], axis=0)
        return self.op("Reshape", [expanded, target4])


def build(cfg: LlamaShape, seed: int = 0, weights: WeightFile | None = None) -> onnx.ModelProto:
    """The ONNX model: initializers of 1 KB or more written to `weights` as they are made (else held in
    memory: save() moves them to external data)."""
    b = Builder(seed, weights=weights)
    d, hq, hkv = cfg.head_dim, cfg.heads, cfg.kv_heads
    groups = hq // hkv
    inputs = [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", I64, ["batch", "total_seq"]),
              helper.make_tensor_value_info("position_ids", I64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", F16, ["batch", "seq", cfg.vocab])]
    for i in range(cfg.layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", F16,
                                                        ["batch", hkv, "past_seq", d]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", F16,
                                                         ["batch", hkv, "total_seq", d]))
    x = b.op("Gather", [b.weight((cfg.vocab, cfg.hidden), 0.02, "embed"), "input_ids"], axis=0)
    # rotary tables from position_ids (float32, like HF), then fp16 [B, 1, S, D]
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    pos = b.op("Unsqueeze", [b.op("Cast", ["position_ids"], to=F32), b.const(np.array([-1]))])
    freqs = b.op("Mul", [pos, b.const(inv_freq.astype(np.float32))])
    emb = b.op("Concat", [freqs, freqs], axis=-1)
    cos = b.op("Unsqueeze", [b.op("Cast", [b.op("Cos", [emb])], to=F16), b.const(np.array([1]))])
    sin = b.op("Unsqueeze", [b.op("Cast", [b.op("Sin", [emb])], to=F16), b.const(np.array([1]))])
    # additive mask [B, 1, S, T]: causal (key pos <= past + query pos) and not padding
    mshape = b.op("Shape", ["attention_mask"])
    total = b.op("Gather", [mshape, b.const(np.array(1))], axis=0)
    seq = b.op("Gather", [b.op("Shape", ["input_ids"]), b.const(np.array(1))], axis=0)
    past = b.op("Sub", [total, seq])
    q_pos = b.op("Range", [past, total, b.const(np.array(1))])
    k_pos = b.op("Range", [b.const(np.array(0)), total, b.const(np.array(1))])
    causal = b.op("LessOrEqual", [b.op("Unsqueeze", [k_pos, b.const(np.array([0]))]),
                                  b.op("Unsqueeze", [q_pos, b.const(np.array([1]))])])
    pad = b.op("Unsqueeze", [b.op("Cast", ["attention_mask"], to=BOOL), b.const(np.array([1, 2]))])
    allowed = b.op("And", [causal, pad])
    mask = b.op("Where", [allowed, b.const(np.array(0.0, np.float16)), b.const(np.array(-65504.0, np.float16))])
    scale = b.const(np.array(1.0 / math.sqrt(d), np.float16))
    std = 1.0 / math.sqrt(cfg.hidden)
    for i in range(cfg.layers):
        h = b.rmsnorm(x, cfg.hidden, cfg.eps)
        q = b.heads(b.op("MatMul", [h, b.weight((cfg.hidden, hq * d), std, f"l{i}_wq")]), hq, d)
        k = b.heads(b.op("MatMul", [h, b.weight((cfg.hidden, hkv * d), std, f"l{i}_wk")]), hkv, d)
        v = b.heads(b.op("MatMul", [h, b.weight((cfg.hidden, hkv * d), std, f"l{i}_wv")]), hkv, d)
        q, k = b.rotary(q, cos, sin, d), b.rotary(k, cos, sin, d)
        present_k = f"present.{i}.key"
        present_v = f"present.{i}.value"
        b.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.key", k], [present_k], axis=2,
                                        name=f"cache_k_{i}"))
        b.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.value", v], [present_v], axis=2,
                                        name=f"cache_v_{i}"))
        kr = b.repeat_kv(present_k, present_k, hkv, groups, d)
        vr = b.repeat_kv(present_v, present_v, hkv, groups, d)
        scores = b.op("Add", [b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [kr], perm=[0, 1, 3, 2])]), scale]),
                              mask])
        probs = b.op("Cast", [b.op("Softmax", [b.op("Cast", [scores], to=F32)], axis=-1)], to=F16)
        attn = b.op("MatMul", [probs, vr])
        attn = b.op("Reshape", [b.op("Transpose", [attn], perm=[0, 2, 1, 3]), b.const(np.array([0, 0, hq * d]))])
        x = b.op("Add", [x, b.op("MatMul", [attn, b.weight((hq * d, cfg.hidden), std, f"l{i}_wo")])])
        h = b.rmsnorm(x, cfg.hidden, cfg.eps)
        g = b.op("MatMul", [h, b.weight((cfg.hidden, cfg.intermediate), std, f"l{i}_wg")])
        u = b.op("MatMul", [h, b.weight((cfg.hidden, cfg.intermediate), std, f"l{i}_wu")])
        act = b.op("Mul", [b.op("Mul", [g, b.op("Sigmoid", [g])]), u])
        down = b.weight((cfg.intermediate, cfg.hidden), 1.0 / math.sqrt(cfg.intermediate), f"l{i}_wd")
        x = b.op("Add", [x, b.op("MatMul", [act, down])])
    h = b.rmsnorm(x, cfg.hidden, cfg.eps)
    b.nodes.append(helper.make_node("MatMul", [h, b.weight((cfg.hidden, cfg.vocab), std, "lm_head")], ["logits"],
                                    name="lm_head"))
    graph = helper.make_graph(b.nodes, "llama", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="atlasc-build-llama")
    model.ir_version = 9
    return model


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write the model with all weights in one external-data file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def write(cfg: LlamaShape, path: Path, seed: int = 0) -> None:
    """Build and write the model, streaming its weights to `path`.data while building."""
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = WeightFile(path.with_name(path.name + ".data"))
    try:
        model = build(cfg, seed, weights)
    finally:
        weights.close()
    onnx.save_model(model, str(path))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: the config's); fewer keep the real shapes for quick kernel studies")
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.layers < 0:
        ap.error(f"--layers {args.layers}: expected a positive count")
    if args.layers:
        cfg = replace(cfg, layers=args.layers)
    write(cfg, args.out, args.seed)
    n = sum(int(np.prod(i.dims)) for i in onnx.load(str(args.out), load_external_data=False).graph.initializer)
    print(f"wrote {args.out}: {args.config}, {n / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
