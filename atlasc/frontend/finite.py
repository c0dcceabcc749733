"""The weights of an ONNX model must be finite numbers.

A NaN or an infinity in a weight compiles into an artifact that generates garbage (a NaN logit row makes the
sampler pick token 0 forever), so the importer refuses it by name before any pass runs. A NaN is refused in every
float16 / bfloat16 / float32 / float64 initializer and Constant node (float8 ones are not read); an infinity only in
weights: the constants that feed a matrix product (MatMul, Gemm,
MatMulNBits, DequantizeLinear), an embedding Gather, or a fused normalization's scale and bias, since a mask
constant elsewhere may legitimately hold -inf.

The test reads the values' bit patterns (an exponent of all ones), in chunks on a few threads, so an 8B
model's 16 GB of float16 weights take seconds and are never converted.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx_graphsurgeon as gs

from atlasc.errors import ModelLoadError

# op type -> the input positions that hold weights
WEIGHT_INPUTS = {
    "MatMul": (0, 1), "Gemm": (0, 1, 2), "MatMulNBits": (2,), "DequantizeLinear": (1,), "Gather": (0,),
    "LayerNormalization": (1, 2), "RMSNormalization": (1,), "SimplifiedLayerNormalization": (1,),
    "SkipLayerNormalization": (2, 3, 4), "SkipSimplifiedLayerNormalization": (2,),
}
# float dtype -> (unsigned view, exponent mask): all exponent bits set is +-inf (mantissa 0) or NaN (mantissa not 0)
_EXPONENT = {
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
}
CHUNK_VALUES = 4 << 20
THREADS = max(1, min(8, os.cpu_count() or 1))


def non_finite_counts(array: np.ndarray) -> tuple[int, int]:
    """(NaN count, +-inf count) of `array`; (0, 0) for a non-float array. Reads the array once, by chunks."""
    if array.dtype.name == "bfloat16":  # ml_dtypes' type, as onnx returns bfloat16 initializers
        unsigned, exponent = np.uint16, 0x7F80
    elif array.dtype.newbyteorder("=") in _EXPONENT:
        unsigned, exponent = _EXPONENT[array.dtype.newbyteorder("=")]
    else:
        return 0, 0
    magnitude = (1 << (8 * array.dtype.itemsize - 1)) - 1  # every bit but the sign
    flat = array.reshape(-1)
    bits_dtype = np.dtype(unsigned).newbyteorder(array.dtype.byteorder)  # the same bytes, read as integers

    def count(start: int) -> tuple[int, int]:
        bits = flat[start:start + CHUNK_VALUES].view(bits_dtype) & unsigned(magnitude)
        return int(np.count_nonzero(bits > exponent)), int(np.count_nonzero(bits == exponent))

    starts = range(0, flat.size, CHUNK_VALUES)
    if len(starts) <= 1:
        parts = [count(s) for s in starts]
    else:
        with ThreadPoolExecutor(min(THREADS, len(starts))) as pool:  # numpy releases the GIL on these
            parts = list(pool.map(count, starts))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def constant_data(t: gs.Constant, mapped: dict[str, np.ndarray]) -> np.ndarray:
    """A constant's values: its memory-mapped external data when load_model_mapped mapped it, else gs's array."""
    data = mapped.get(t.name)
    return np.asarray(t.values) if data is None else data


def check_weights_finite(graph: gs.Graph, mapped: dict[str, np.ndarray]) -> None:
    """Raise ModelLoadError naming every initializer (or Constant node) that holds a NaN, and every weight that
    holds +-inf (see the module docstring), with the counts."""
    weights = {node.inputs[i].name for node in graph.nodes for i in WEIGHT_INPUTS.get(node.op, ())
               if i < len(node.inputs)}
    constants = [(t.name, constant_data(t, mapped)) for t in graph.tensors().values() if isinstance(t, gs.Constant)]
    constants += [(node.outputs[0].name, np.asarray(node.attrs["value"].values)) for node in graph.nodes
                  if node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant) and node.outputs]
    bad: list[str] = []
    for name, data in constants:
        nan, inf = non_finite_counts(data)
        inf = inf if name in weights else 0
        if nan or inf:
            what = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n)
            bad.append(f"'{name}' ({what} of {data.size})")
    if bad:
        raise ModelLoadError(f"constant{'s' if len(bad) > 1 else ''} holding NaN or infinite weights: "
                             f"{', '.join(bad)}", "the export or the checkpoint is broken; check its weights first")
