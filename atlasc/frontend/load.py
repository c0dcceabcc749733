"""Loading ONNX files safely: clear errors for missing, malformed or truncated files, and external
data that is missing or whose path leaves the model's folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

from atlasc.errors import ModelLoadError
from atlasc.frontend.signature import detect_decoder


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
    model = _checked_proto(path)
    base = path.resolve().parent
    try:
        onnx.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise ModelLoadError(f"cannot read external data of {path}: {e}") from None
    return model


def _checked_proto(path: Path) -> onnx.ModelProto:
    """The ModelProto without its external data, after every check load_model promises."""
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends
        with open(path, "rb") as f:
            if f.read(4) == b"PK\x03\x04":  # a zip: an .npz, a renamed .atlas, ...
                raise ModelLoadError(f"{path} is a zip archive (an .npz or an .atlas artifact?), not an ONNX model",
                                     hint="compile takes the .onnx export; inspect and run also take .atlas "
                                          "artifacts") from None
        raise ModelLoadError(f"{path} is not a valid ONNX model (malformed or truncated): "
                             f"{type(e).__name__}") from None
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(f"{path} is not a valid ONNX model: it has no graph (empty or truncated file?)")
    check_input_dims(model)
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
    return model


def check_input_dims(model: onnx.ModelProto) -> None:
    """ModelLoadError for a graph input declared with a static dim below -1 (-1, a legacy spelling of an unknown
    dim, gets a symbol), or a decoder's past key / value input with a static batch, head or head_dim of 0 (the KV
    cache cannot be empty; other inputs may be empty tensors, and the past length is the cache's fill)."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers and v.type.tensor_type.HasField("shape")]
    sig = detect_decoder([v.name for v in inputs], [o.name for o in model.graph.output])
    kv = {name for pair in sig.past.values() for name in pair} if sig else set()
    for v in inputs:
        dims = v.type.tensor_type.shape.dim
        for axis, d in enumerate(dims):
            if not d.HasField("dim_value"):
                continue
            if d.dim_value < -1:
                raise ModelLoadError(f"input '{v.name}' has dimension {d.dim_value} at axis {axis}: static dims "
                                     f"must not be negative")
            if d.dim_value == 0 and v.name in kv and len(dims) == 4 and axis != 2:
                raise ModelLoadError(f"input '{v.name}' has dimension 0 at axis {axis}: a KV-cache input's static "
                                     f"dims must be positive")


# external initializers of at least this many bytes are mapped, not read (load_model_mapped)
MAP_MIN_BYTES = 1 << 20


def load_model_mapped(path: str | os.PathLike) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """load_model, except that large external initializers are not read into the ModelProto: they
    come back as read-only np.memmap arrays of the external-data file, by name (the proto keeps only
    their external reference). A compile then holds no second copy of the weights in protobuf memory,
    and pages of the file are read when a pass touches them. Same checks and errors as load_model."""
    path = Path(path)
    proto_only = _checked_proto(path)
    base = path.resolve().parent
    mapped: dict[str, np.ndarray] = {}
    for tensor in list(_external_tensors(proto_only)):
        array = _mapped(tensor, base)
        if array is not None:
            mapped[tensor.name] = array
    try:
        for tensor in _external_tensors(proto_only):
            if tensor.name in mapped:
                continue
            load_external_data_for_tensor(tensor, str(base))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    except Exception as e:
        raise ModelLoadError(f"cannot read external data of {path}: {e}") from None
    return proto_only, mapped


def _mapped(tensor: onnx.TensorProto, base: Path) -> np.ndarray | None:
    """The tensor's bytes as a memmap when it is large, has a fixed-size numpy dtype and its recorded
    length matches its shape (packed 4-bit types and odd layouts are read the usual way)."""
    info = ExternalDataInfo(tensor)
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except Exception:
        return None
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.STRING):
        return None
    shape = tuple(int(d) for d in tensor.dims)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MAP_MIN_BYTES or (info.length is not None and info.length != nbytes):
        return None
    return np.memmap(base / info.location, dtype=dtype.newbyteorder("<"), mode="r", offset=info.offset or 0,
                     shape=shape)
