"""The copy engine's tensor maps of an artifact (MemorySpec.tensor_maps), encoded for this arena and written into it.

A map holds the global address of its matrix, so it can only be made once the arena exists: the load encodes each
with the driver's cuTensorMapEncodeTiled (libcuda through ctypes; pycuda has no binding) and copies the 128-byte
results into their slots before any launch. The kernels read them there by address (codegen/linear_tma.cu).
"""

from __future__ import annotations

import ctypes

import numpy as np

from atlasc.artifact import TENSOR_MAP_BYTES
from atlasc.errors import AtlasError
from atlasc.runtime.cudagraph import CudaGraphError, _libcuda

DATA_TYPES = {"float16": 6, "uint8": 0}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _UINT8
SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
# float16 maps feed wgmma (linear_tma.cu: the 128-byte swizzle); uint8 maps are int4 / int8 weight rows read by lanes
# (quant_bulk.cu: no swizzle, CU_TENSOR_MAP_SWIZZLE_NONE)
SWIZZLES = {"float16": SWIZZLE_128B, "uint8": 0}
L2_PROMOTION_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B


class TensorMapError(AtlasError):
    """The driver refused to encode one of the artifact's tensor maps."""


def encode(base: int, spec) -> bytes:
    """The 128 bytes of the tensor map `spec` (a TensorMapSpec) for an arena at device address `base`."""
    buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
    aligned = (ctypes.addressof(buf) + 63) // 64 * 64  # CUtensorMap is 64-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims, strides = (u64 * 2)(spec.cols, spec.rows), (u64 * 1)(spec.row_bytes)
    box, elem = (u32 * 2)(spec.box_cols, spec.box_rows), (u32 * 2)(1, 1)
    if spec.dtype not in DATA_TYPES:
        raise TensorMapError(f"tensor map at arena offset {spec.slot}: dtype {spec.dtype} is not supported")
    try:
        encode_tiled = _libcuda().cuTensorMapEncodeTiled
    except (CudaGraphError, AttributeError) as e:  # no libcuda, or one older than CUDA 12 (no tensor maps)
        raise TensorMapError(f"the artifact's copy-engine kernels need cuTensorMapEncodeTiled (CUDA 12+ driver): "
                             f"{e}", hint="compile with ATLAS_LINEAR_TMA=0") from None
    result = encode_tiled(
        ctypes.c_void_p(aligned), DATA_TYPES[spec.dtype], 2, ctypes.c_void_p(base + spec.address), dims, strides,
        box, elem, 0, SWIZZLES[spec.dtype], L2_PROMOTION_256B, 0)
    if result != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused the tensor map at arena offset {spec.slot} "
                             f"({spec.rows} x {spec.cols}, box {spec.box_rows} x {spec.box_cols}): CUresult {result}")
    return ctypes.string_at(aligned, TENSOR_MAP_BYTES)


def write_tensor_maps(dev, arena, specs) -> None:
    """Encode every map for `arena` (the device's encode_tensor_map: encode() on a real one) and copy each into its
    slot (then synchronize)."""
    for spec in specs:
        dev.upload(arena, spec.slot, np.frombuffer(dev.encode_tensor_map(int(arena), spec), dtype=np.uint8))
    if specs:
        dev.synchronize()
