"""atlasc.frontend: ONNX files -> IR graphs (onnx + onnx-graphsurgeon; numpy folding, no onnxruntime)."""

from __future__ import annotations

import os

import onnx

from atlasc.frontend.handlers import HANDLERS
from atlasc.frontend.importer import Importer, handler_key
from atlasc.frontend.load import check_input_dims, load_model, load_model_mapped
from atlasc.frontend.simplify import cse
from atlasc.ir.graph import Graph
from atlasc.ir.verify import verify

SUPPORTED_OPS = frozenset(HANDLERS)


def unsupported_ops(model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """(op, opset, one node name) for every distinct op of `model` the importer cannot handle."""
    opsets = {(imp.domain or ""): imp.version for imp in model.opset_import}
    seen: dict[str, tuple[str, str, str]] = {}
    for node in model.graph.node:
        key = handler_key(node.op_type, node.domain)
        if key in SUPPORTED_OPS:
            continue
        seen.setdefault(key, (key, str(opsets.get(node.domain or "", "?")), node.name or "(unnamed)"))
    return list(seen.values())


def import_onnx(model: str | os.PathLike | onnx.ModelProto) -> Graph:
    """Import an ONNX model (path or ModelProto) into a verified IR graph.

    Guarantees: the graph verifies; its inputs and outputs are the model's, by name; every
    shape-computing subgraph is folded into dims; interpreting it reproduces the model's outputs.
    Raises ModelLoadError, UnsupportedModelError (all unsupported ops at once) or ShapeError.
    """
    mapped = {}
    if not isinstance(model, onnx.ModelProto):
        model, mapped = load_model_mapped(model)  # large external weights stay in their file (memmap)
    else:
        check_input_dims(model)  # what loading a file checks of the graph itself
    graph = Importer(model, mapped).run()
    graph = cse(graph)
    verify(graph)
    return graph


__all__ = ["SUPPORTED_OPS", "import_onnx", "load_model", "unsupported_ops"]
