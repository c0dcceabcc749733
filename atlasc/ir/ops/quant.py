"""Weight-only quantized projections: LinearQ8 and LinearQ4 (made by the quantize pass).

    LinearQ8(x[..., K], wq int8 [N, K], scale float16 [N], bias[N]?)
        per-output-channel symmetric: w[n, k] ~= wq[n, k] * scale[n]
    LinearQ4(x[..., K], wq uint8 [N, K/2], scale float16 [N, K/group_size], bias[N]?)
        two int4 per byte (low nibble = even k, high nibble = odd k), values in [-8, 7] stored + 8;
        w[n, k] ~= (nibble(n, k) - 8) * scale[n, k // group_size]

References dequantize exactly in float32 (an int times a float16 scale is exact in float32), then
compute x.astype(float32) @ w^T (+ bias in float32) and round once to x's dtype, as Linear does.
x and bias are float32 or float16 (the same dtype); the scales are always float16.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.ops.registry import Attr, DimMismatch, TensorType, register


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [N, K/2] -> int8 [N, K] in [-8, 7] (low nibble = even k)."""
    p = np.asarray(packed, np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.int8)
    out[..., 0::2] = (p & 0x0F).astype(np.int8) - 8
    out[..., 1::2] = (p >> 4).astype(np.int8) - 8
    return out


def dequant_q8(wq: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return wq.astype(np.float32) * scale.astype(np.float32)[:, None]


def dequant_q4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    q = unpack_int4(packed).astype(np.float32)
    return q * np.repeat(scale.astype(np.float32), group_size, axis=1)


def _common(ins, name: str, k):
    x, wq, scale = ins[0], ins[1], ins[2]
    if x.dtype not in ("float32", "float16"):
        raise ShapeError(f"{name}: x dtype {x.dtype} (supported: float32, float16)")
    if len(x.shape) < 1:
        raise ShapeError(f"{name}: x must have rank >= 1")
    if len(wq.shape) != 2:
        raise ShapeError(f"{name}: wq must be 2-D, got rank {len(wq.shape)}")
    if scale.dtype != "float16":
        raise ShapeError(f"{name}: scale must be float16, got {scale.dtype}")
    if x.shape[-1] != k:
        raise DimMismatch(x.shape[-1], k, f"{name}: inner ")
    n = wq.shape[0]
    if len(ins) > 3 and ins[3] is not None:
        b = ins[3]
        if b.dtype != x.dtype:
            raise ShapeError(f"{name}: bias is {b.dtype}, x {x.dtype}")
        if len(b.shape) != 1:
            raise ShapeError(f"{name}: bias must be [N], got rank {len(b.shape)}")
        if b.shape[0] != n:
            raise DimMismatch(b.shape[0], n, f"{name}: bias ")
    return [TensorType(x.dtype, tuple(x.shape[:-1]) + (n,))]


def _q8_infer(ins, attrs):
    wq, scale = ins[1], ins[2]
    if wq.dtype != "int8":
        raise ShapeError(f"LinearQ8: wq must be int8, got {wq.dtype}")
    if len(wq.shape) == 2 and tuple(scale.shape) != (wq.shape[0],):
        raise ShapeError(f"LinearQ8: scale must be [N] = [{wq.shape[0]}], got {list(scale.shape)}")
    return _common(ins, "LinearQ8", wq.shape[1] if len(wq.shape) == 2 else None)


def _q4_infer(ins, attrs):
    wq, scale = ins[1], ins[2]
    g = int(attrs["group_size"])
    if wq.dtype != "uint8":
        raise ShapeError(f"LinearQ4: wq must be uint8 (packed int4), got {wq.dtype}")
    if len(wq.shape) != 2:
        raise ShapeError(f"LinearQ4: wq must be [N, K/2], got rank {len(wq.shape)}")
    if g < 2 or g % 2:
        raise ShapeError(f"LinearQ4: group_size must be even and >= 2, got {g}")
    k = 2 * wq.shape[1]
    if k % g:
        raise ShapeError(f"LinearQ4: group_size {g} does not divide K = {k}")
    if tuple(scale.shape) != (wq.shape[0], k // g):
        raise ShapeError(f"LinearQ4: scale must be [N, K/group] = [{wq.shape[0]}, {k // g}], "
                         f"got {list(scale.shape)}")
    return _common(ins, "LinearQ4", k)


def _apply(x: np.ndarray, w: np.ndarray, bias) -> np.ndarray:
    y = np.matmul(x.astype(np.float32), w.T)
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(x.dtype)


def _q8_ref(ins, attrs):
    bias = ins[3] if len(ins) > 3 else None
    return [_apply(ins[0], dequant_q8(ins[1], ins[2]), bias)]


def _q4_ref(ins, attrs):
    bias = ins[3] if len(ins) > 3 else None
    return [_apply(ins[0], dequant_q4(ins[1], ins[2], int(attrs["group_size"])), bias)]


register("LinearQ8", inputs=(3, 4), kind="opaque", infer=_q8_infer, reference=_q8_ref,
         doc="x @ (wq int8 [N, K] * scale[N])^T (+ bias); float32 dequant and accumulation, one rounding")
register("LinearQ4", inputs=(3, 4), attrs={"group_size": Attr("int", 128)}, kind="opaque", infer=_q4_infer,
         reference=_q4_ref,
         doc="x @ ((int4 nibbles of wq [N, K/2]) * scale[N, K/group])^T (+ bias); float32, one rounding")
