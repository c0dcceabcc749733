"""`inspect_onnx`: a JSON-able report on an ONNX model, behind `atlasc inspect`.

The report is built from the ONNX graph itself, so it also describes models atlasc cannot import:
their unsupported ops are listed, not raised. When the import succeeds, the inputs and outputs
carry the IR's symbolic dims (e.g. the mask length as `past_seq + seq`) and the report adds the IR
op histogram and the symbols with their bounds.

Architecture hints are read from names, shapes and op types, never from the file name:

- kind: `decoder` when KV-cache inputs are present (`past_key_values.N.key|value`, `past.N.key`,
  `past_key.N` ...), `encoder` when there is no past and an output like `last_hidden_state`;
- layers, kv heads and head_dim from the past inputs' shapes `[batch, kv_heads, past_seq, head_dim]`;
- vocab from the last dim of `logits`;
- norm (LayerNormalization op, RMSNormalization op, or the decomposed x * 1/sqrt(mean(x^2) + eps)),
  attention (an Attention op or decomposed MatMul + Softmax), rotary (RotaryEmbedding or Sin/Cos),
  GELU flavour (Gelu op, Erf, Tanh) and SiLU.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from atlasc.errors import AtlasError, UnsupportedModelError

# KV-cache names exporters use: layer index and key/value in either order.
_PAST_PATTERNS = (
    re.compile(r"^past(?:_key_values)?[._/](?P<layer>\d+)[._/](?P<kv>key|value)s?$"),
    re.compile(r"^past[._]?(?P<kv>key|value)s?[._/](?P<layer>\d+)$"),
)
_PRESENT = re.compile(r"^present")
_ENCODER_OUTPUTS = ("last_hidden_state", "hidden_states", "pooler_output", "sentence_embedding")


def inspect_onnx(path: str | Path) -> dict[str, Any]:
    """Describe the ONNX model at `path` as a JSON-able dict.

    Keys: `model`, `graph_name`, `producer`, `opsets` ({domain: version}), `inputs` / `outputs`
    (lists of {name, dtype, shape}; a dim is an int or a readable expression string), `nodes`,
    `ops` (ONNX op_type histogram, non-default domains written `domain::Op`), `parameters`
    ({count, bytes, tensors} over floating-point initializers and Constant nodes),
    `constant_bytes` (all initializers and constants), `unsupported_ops` (list of {op, opset, node}),
    `import` ({ok, error, nodes, ops, symbols}) and `hints` (see the module docstring).

    Raises `ModelLoadError` when the file cannot be read; an unsupported or unimportable model is
    reported, not raised.
    """
    from atlasc.frontend import import_onnx, load_model, unsupported_ops

    path = Path(path)
    model = load_model(path)
    g = model.graph

    report: dict[str, Any] = {
        "model": str(path),
        "graph_name": g.name,
        "producer": " ".join(x for x in (model.producer_name, model.producer_version) if x),
        "opsets": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "inputs": [_onnx_value(v) for v in _real_inputs(g)],
        "outputs": [_onnx_value(v) for v in g.output],
        "nodes": len(g.node),
        "ops": dict(sorted(Counter(_op_name(n) for n in g.node).items(), key=lambda kv: (-kv[1], kv[0]))),
    }
    report.update(_parameters(g))
    unsupported = unsupported_ops(model)
    report["unsupported_ops"] = [{"op": op, "opset": opset, "node": node} for op, opset, node in unsupported]

    # hints before the import, which may rewrite the ModelProto in place
    report["hints"] = architecture_hints(model, report["inputs"], report["outputs"])

    imported: dict[str, Any] = {"ok": False, "error": None}
    if unsupported:
        imported["error"] = str(UnsupportedModelError(unsupported))
    else:
        try:
            graph = import_onnx(model)
        except AtlasError as e:
            imported["error"] = e.message
        else:
            imported.update(_ir_summary(graph))
            # the IR's dims are the better description (e.g. total_seq -> past_seq + seq)
            report["inputs"] = [_ir_value(v) for v in graph.inputs]
            report["outputs"] = [_ir_value(v) for v in graph.outputs]
    report["import"] = imported
    return report


# ---------------------------------------------------------------------------------------------
# values and parameters


def _real_inputs(g: onnx.GraphProto) -> list:
    """Graph inputs that are not initializers (old exporters list weights as inputs too)."""
    inits = {t.name for t in g.initializer}
    return [v for v in g.input if v.name not in inits]


def _onnx_value(v: onnx.ValueInfoProto) -> dict[str, Any]:
    t = v.type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "unknown"
    shape: list | None = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return {"name": v.name, "dtype": dtype, "shape": shape}


def _ir_value(v) -> dict[str, Any]:
    return {"name": v.name, "dtype": str(v.dtype), "shape": [d if isinstance(d, int) else str(d) for d in v.shape]}


def _op_name(n: onnx.NodeProto) -> str:
    return n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"


def _tensor_size(t: onnx.TensorProto) -> tuple[int, int, bool]:
    """(elements, bytes, is floating point) of a tensor, from its header only (no data read)."""
    numel = int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1
    try:
        dt = helper.tensor_dtype_to_np_dtype(t.data_type)
    except (KeyError, ValueError):
        return numel, 0, False
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return numel, (numel + 1) // 2, False
    return numel, numel * dt.itemsize, np.issubdtype(dt, np.floating)


def _parameters(g: onnx.GraphProto) -> dict[str, Any]:
    tensors = list(g.initializer)
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            tensors += [a.t for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    count = nbytes = ntensors = all_bytes = 0
    for t in tensors:
        numel, b, floating = _tensor_size(t)
        all_bytes += b
        if floating:
            count += numel
            nbytes += b
            ntensors += 1
    return {"parameters": {"count": count, "bytes": nbytes, "tensors": ntensors}, "constant_bytes": all_bytes}


def _ir_summary(graph) -> dict[str, Any]:
    symbols = {}
    for name, info in getattr(graph, "symbols", {}).items():
        symbols[name] = {"lower": _jsonable(getattr(info, "lower", None)),
                         "upper": _jsonable(getattr(info, "upper", None))}
    ops = Counter(n.op for n in graph.nodes)
    return {"ok": True, "nodes": len(graph.nodes),
            "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))), "symbols": symbols}


def _jsonable(x):
    return x if x is None or isinstance(x, (int, float, str)) else str(x)


# ---------------------------------------------------------------------------------------------
# architecture hints


def _past_layer(name: str) -> tuple[int, str] | None:
    for pat in _PAST_PATTERNS:
        m = pat.match(name)
        if m:
            return int(m.group("layer")), m.group("kv")
    return None


def architecture_hints(model: onnx.ModelProto, inputs: list[dict], outputs: list[dict]) -> dict[str, Any]:
    """Guess the architecture from I/O names and shapes and from the op types (see module docstring)."""
    g = model.graph
    ops = Counter(n.op_type for n in g.node)
    hints: dict[str, Any] = {"kind": "unknown"}

    past = {}
    for v in inputs:
        hit = _past_layer(v["name"])
        if hit:
            past[hit] = v
    presents = [v["name"] for v in outputs if _PRESENT.match(v["name"])]
    out_names = {v["name"] for v in outputs}
    if past:
        hints["kind"] = "decoder"
        hints["kv_cache"] = {"inputs": len(past), "outputs": len(presents)}
        hints["layers"] = len({layer for layer, _ in past})
        shape = next(iter(past.values()))["shape"]
        if shape and len(shape) == 4:
            if isinstance(shape[1], int):
                hints["kv_heads"] = shape[1]
            if isinstance(shape[3], int):
                hints["head_dim"] = shape[3]
    elif any(name in out_names for name in _ENCODER_OUTPUTS):
        hints["kind"] = "encoder"
    elif "logits" in out_names:
        hints["kind"] = "decoder (no kv cache)"

    for v in outputs:
        if v["name"] == "logits" and v["shape"] and isinstance(v["shape"][-1], int):
            hints["vocab"] = v["shape"][-1]

    hints["norm"] = _norm_style(g, ops)
    if ops["Attention"] or any(n.op_type in ("Attention", "MultiHeadAttention", "GroupQueryAttention")
                               for n in g.node):
        hints["attention"] = "Attention op"
    elif ops["Softmax"]:
        hints["attention"] = "decomposed (MatMul + Softmax)"
    else:
        hints["attention"] = None
    if ops["RotaryEmbedding"]:
        hints["rotary"] = "RotaryEmbedding op"
    elif ops["Sin"] and ops["Cos"]:
        hints["rotary"] = "Sin/Cos"
    else:
        hints["rotary"] = None
    hints["activation"] = _activation(g, ops)
    return hints


def _norm_style(g: onnx.GraphProto, ops: Counter) -> str | None:
    if ops["RMSNormalization"] or ops["SimplifiedLayerNormalization"] or ops["SkipSimplifiedLayerNormalization"]:
        return "rmsnorm (op)"
    if ops["LayerNormalization"] or ops["SkipLayerNormalization"]:
        return "layernorm (op)"
    # decomposed: ReduceMean(x^2), with x^2 = Pow(x, 2) or Mul(x, x); layernorm if x = a - mean(a)
    producer = {o: n for n in g.node for o in n.output}
    rms = ln = 0
    for n in g.node:
        if n.op_type != "ReduceMean" or not n.input:
            continue
        sq = producer.get(n.input[0])
        if sq is None:
            continue
        if sq.op_type == "Pow" or (sq.op_type == "Mul" and len(sq.input) == 2 and sq.input[0] == sq.input[1]):
            x = producer.get(sq.input[0])
            if x is not None and x.op_type == "Sub" and any(
                    (p := producer.get(i)) is not None and p.op_type == "ReduceMean" for i in x.input[1:]):
                ln += 1
            else:
                rms += 1
    if rms and (ops["Sqrt"] or ops["Reciprocal"] or ops["Div"]):
        return "rmsnorm (decomposed)"
    if ln:
        return "layernorm (decomposed)"
    return None


def _activation(g: onnx.GraphProto, ops: Counter) -> str | None:
    for n in g.node:
        if n.op_type in ("Gelu", "FastGelu", "BiasGelu"):
            approx = next((a.s.decode() for a in n.attribute if a.name == "approximate"), "none")
            return "gelu-tanh (op)" if approx == "tanh" or n.op_type == "FastGelu" else "gelu (op)"
    if ops["Erf"]:
        return "gelu-erf"
    if ops["Tanh"]:
        return "gelu-tanh"
    if ops["Sigmoid"] or ops["Silu"] or ops["Swish"]:
        return "silu"
    return None
