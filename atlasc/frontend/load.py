"""Loading ONNX files safely: clear errors for missing, malformed or truncated files, and external
data that is missing or whose path leaves the model's folder."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from atlasc.errors import ModelLoadError


def _external_tensors(model: onnx.ModelProto):
    for init in model.graph.initializer:
        if uses_external_data(init):
            yield init
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and uses_external_data(attr.t):
                yield attr.t


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX model with its external data.

    Guarantees: returns a ModelProto whose tensors all hold their data; otherwise raises
    ModelLoadError with one line saying what is wrong (missing file, not an ONNX protobuf,
    truncated file, external data missing / too short / outside the model's folder).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise ModelLoadError(f"{path} is not a valid ONNX model (malformed or truncated): "
                             f"{type(e).__name__}") from None
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(f"{path} is not a valid ONNX model: it has no graph (empty or truncated file?)")
    base = path.resolve().parent
    for tensor in _external_tensors(model):
        info = ExternalDataInfo(tensor)
        location = Path(info.location)
        target = (base / location).resolve()
        if location.is_absolute() or not target.is_relative_to(base):
            raise ModelLoadError(f"external data of tensor '{tensor.name}' points outside the model's folder: "
                                 f"{info.location}", hint="external data must live next to the model file")
        if not target.is_file():
            raise ModelLoadError(f"external data file for tensor '{tensor.name}' is missing: {target}")
        size = target.stat().st_size
        offset = info.offset or 0
        if info.length is not None and offset + info.length > size:
            raise ModelLoadError(f"external data file {target.name} is truncated: tensor '{tensor.name}' needs "
                                 f"bytes {offset}..{offset + info.length}, the file has {size}")
    try:
        onnx.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise ModelLoadError(f"cannot read external data of {path}: {e}") from None
    return model
