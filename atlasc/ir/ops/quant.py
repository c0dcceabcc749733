"""Weight-only quantized projections: LinearQ8 and LinearQ4 (made by the quantize pass).

    LinearQ8(x[..., K], wq int8 [N, K], scale float16 [N], bias[N]?)
        per-output-channel symmetric: w[n, k] ~= wq[n, k] * scale[n]
    LinearQ4(x[..., K], wq uint8 [N, K/2], scale float16 [N, K/group_size], bias[N]?, zero uint8 [N, K/group_size]?)
        two int4 per byte (low nibble = even k, high nibble = odd k), values in [-8, 7] stored + 8;
        w[n, k] ~= (nibble(n, k) - 8) * scale[n, k // group_size]
        with zero points (asymmetric; the bias slot may then be None): the nibble is the unsigned code
        and w[n, k] ~= (nibble(n, k) - zero[n, k // group_size]) * scale[n, k // group_size], zero in [0, 15]

References dequantize exactly in float32 (an int times a float16 scale is exact in float32), then
compute x.astype(float32) @ w^T (+ bias in float32) and round once to x's dtype, as Linear does.
x and bias are float32 or float16 (the same dtype); the scales are always float16.

LinearQ4 with the attribute act = "int8" (W4A8, the decode path of choose-int4-path) also quantizes
x per row: amax = max |x|, x_q = clip(rint(x * (127 / amax)), -127, 127) (float32 product and quotient,
round half to even), s_x = amax / 127; each group's dot product sum_k x_q[k] * (nibble[k] - z) is
exact in int32 (the kernel's dp4a: unsigned nibbles times signed int8 bytes, minus z times the group's
sum of x_q), and y = s_x * sum_g dot_g * scale_g (+ bias), the group sum in float64 here (the kernel
adds in float32 in its own order: equal within float32 rounding), rounded once to x's dtype.
LinearQ8 with act = "int8" (W8A8) quantizes x the same way; its dot product over the whole row is exact
in int32 and y = float32(float32(dot) * scale[n]) * s_x (+ bias), each step rounded to float32: the
kernel computes exactly this (bit-identical before the rounding to x's dtype).
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir.ops.linear import matmul_rows
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


def _e4m3_table() -> np.ndarray:
    """float32 value of every FP8 E4M3 byte (the "fn" variant: no infinities, NaN at S.1111.111):
    sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    v = np.where((e == 15) & (b & 7 == 7), np.nan, v)
    return np.where(b >> 7, -v, v).astype(np.float32)


E4M3 = _e4m3_table()
E4M3_MAX = 448.0


def dequant_f8(wq: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes [N, K] and float16 scales [N] -> float32 [N, K] (exact: a table lookup and one
    float32 product, what the kernel computes)."""
    return E4M3[np.asarray(wq, np.uint8)] * scale.astype(np.float32)[:, None]


def dequant_q4(packed: np.ndarray, scale: np.ndarray, group_size: int, zero: np.ndarray | None = None) -> np.ndarray:
    """float32 [N, K]: (nibble - 8) * scale per group, or (nibble - zero) * scale with zero points
    (exact in float32: an integer in [-15, 15] times a float16)."""
    q = unpack_int4(packed)
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size).astype(np.float32)
    if zero is not None:  # nibble - zero = (nibble - 8) + (8 - zero)
        g += (8 - np.asarray(zero, np.float32))[:, :, None]
    g *= scale.astype(np.float32)[:, :, None]  # the same products as repeating the scales, without the copy
    return g.reshape(n, k)


def dequant(op: str, wq: np.ndarray, scale: np.ndarray, group_size: int = 128,
            zero: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, K] of a quantized layer's weight rows (wq, scale and zero sliced alike along N)."""
    if op == "LinearQ8":
        return dequant_q8(wq, scale)
    if op == "LinearF8":
        return dequant_f8(wq, scale)
    return dequant_q4(wq, scale, group_size, zero)


def q4_zero(node) -> object:
    """The zero-point input of a LinearQ4 node (a Value), or None when it is symmetric."""
    return node.inputs[4] if node.op == "LinearQ4" and len(node.inputs) > 4 else None


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
    if len(ins) > 4 and ins[3] is None:  # LinearQ4 with zero points and no bias
        return [TensorType(x.dtype, tuple(x.shape[:-1]) + (n,))]
    if len(ins) > 3 and ins[3] is not None:
        b = ins[3]
        if b.dtype != x.dtype:
            raise ShapeError(f"{name}: bias is {b.dtype}, x {x.dtype}")
        if len(b.shape) != 1:
            raise ShapeError(f"{name}: bias must be [N], got rank {len(b.shape)}")
        if b.shape[0] != n:
            raise DimMismatch(b.shape[0], n, f"{name}: bias ")
    return [TensorType(x.dtype, tuple(x.shape[:-1]) + (n,))]


def _per_channel_infer(op: str, wq_dtype: str, what: str):
    """infer of LinearQ8 / LinearF8: wq [N, K] of wq_dtype, scale [N]."""

    def infer(ins, attrs):
        wq, scale = ins[1], ins[2]
        if wq.dtype != wq_dtype:
            raise ShapeError(f"{op}: wq must be {what}, got {wq.dtype}")
        _check_act(op, attrs)
        if len(wq.shape) == 2 and tuple(scale.shape) != (wq.shape[0],):
            raise ShapeError(f"{op}: scale must be [N] = [{wq.shape[0]}], got {list(scale.shape)}")
        return _common(ins, op, wq.shape[1] if len(wq.shape) == 2 else None)

    return infer


def _q4_infer(ins, attrs):
    wq, scale = ins[1], ins[2]
    g = int(attrs["group_size"])
    if wq.dtype != "uint8":
        raise ShapeError(f"LinearQ4: wq must be uint8 (packed int4), got {wq.dtype}")
    if len(wq.shape) != 2:
        raise ShapeError(f"LinearQ4: wq must be [N, K/2], got rank {len(wq.shape)}")
    if g < 2 or g % 2:
        raise ShapeError(f"LinearQ4: group_size must be even and >= 2, got {g}")
    _check_act("LinearQ4", attrs)
    k = 2 * wq.shape[1]
    if k % g:
        raise ShapeError(f"LinearQ4: group_size {g} does not divide K = {k}")
    if tuple(scale.shape) != (wq.shape[0], k // g):
        raise ShapeError(f"LinearQ4: scale must be [N, K/group] = [{wq.shape[0]}, {k // g}], "
                         f"got {list(scale.shape)}")
    if len(ins) > 4:
        zero = ins[4]
        if zero.dtype != "uint8" or tuple(zero.shape) != tuple(scale.shape):
            raise ShapeError(f"LinearQ4: zero points must be uint8 {list(scale.shape)} like the scales, "
                             f"got {zero.dtype} {list(zero.shape)}")
    return _common(ins, "LinearQ4", k)


def quantize_rows_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x_q int8 [.., K], s_x float32 [..]): x's rows quantized symmetrically to [-127, 127] (W4A8)."""
    xf = np.asarray(x, np.float32)
    amax = np.max(np.abs(xf), axis=-1)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xf * inv[..., None]), -127, 127).astype(np.int8)
    return xq, (amax / np.float32(127)).astype(np.float32)


def w4a8_group_dots(xq: np.ndarray, packed: np.ndarray, group_size: int, zero: np.ndarray | None = None) -> np.ndarray:
    """int64 [M, N, K/G]: sum over each group of x_q[m, k] * (nibble[n, k] - z[n, g]) (z = 8 without zero
    points), exactly; x_q int8 [M, K], packed uint8 [N, K/2]."""
    nib = (unpack_int4(packed).astype(np.int64) + 8)  # the unsigned codes
    m, k = xq.shape
    n, g = nib.shape[0], k // group_size
    x = xq.astype(np.int64).reshape(m, g, group_size)
    dots = np.einsum("mgk,ngk->mng", x, nib.reshape(n, g, group_size))
    z = np.full((n, g), 8, np.int64) if zero is None else np.asarray(zero, np.int64)
    return dots - z[None] * x.sum(axis=-1)[:, None, :]


def w4a8_matmul(x: np.ndarray, packed: np.ndarray, scale: np.ndarray, group_size: int, bias=None,
                zero: np.ndarray | None = None) -> np.ndarray:
    """LinearQ4 with act = "int8" (see the module docstring), rounded once to x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows_int8(x.reshape(-1, k))
    n = packed.shape[0]
    y = np.empty((xq.shape[0], n), np.float32)
    step = max(1, REF_CHUNK_ROWS)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        dots = w4a8_group_dots(xq, packed[r0:r1], group_size, None if zero is None else zero[r0:r1])
        y[:, r0:r1] = (np.einsum("mng,ng->mn", dots.astype(np.float64), scale[r0:r1].astype(np.float64))
                       * sx[:, None].astype(np.float64)).astype(np.float32)
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    return y.reshape(lead + (n,)).astype(x.dtype)


def w8a8_matmul(x: np.ndarray, wq: np.ndarray, scale: np.ndarray, bias=None) -> np.ndarray:
    """LinearQ8 with act = "int8" (see the module docstring), rounded once to x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows_int8(x.reshape(-1, k))
    n = wq.shape[0]
    y = np.empty((xq.shape[0], n), np.float32)
    xi = xq.astype(np.int64)
    for r0 in range(0, n, REF_CHUNK_ROWS):
        r1 = min(n, r0 + REF_CHUNK_ROWS)
        dots = xi @ np.asarray(wq[r0:r1], np.int64).T
        y[:, r0:r1] = (dots.astype(np.float32) * scale[r0:r1].astype(np.float32)) * sx[:, None]
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    return y.reshape(lead + (n,)).astype(x.dtype)


ACT8_MAX_M = 8  # rows the int8-activation kernels (codegen/act_int8.cu) stage per block


def act8_why_not(bits: int, group: int, k, m_upper: int) -> str | None:
    """Why the int8-activation kernel cannot serve this projection (None: it can)."""
    if m_upper > ACT8_MAX_M:
        return f"its rows may exceed {ACT8_MAX_M} (prefill, or --max-batch above {ACT8_MAX_M})"
    step = 32 if bits == 4 else 16  # k per 16-byte chunk
    if not isinstance(k, int) or k % step:
        return f"K = {k} is not a static multiple of {step}"
    if bits == 4:
        lanes = group // 32
        if group % 32 or lanes > 32 or lanes & (lanes - 1):
            return f"group size {group} is not 32 x a power of two up to 1024"
    return None


# the attribute `act` of LinearQ4 / LinearQ8 (and the fused ops carrying them): float activations, int8
# activations (W4A8 / W8A8), or int8 only for a call of one row (a decode batch of 1: the rows-1 bucket's
# kernel takes int8, every other call float)
ACT_VALUES = ("", "int8", "int8@1")


def act_int8(act: str, rows: int) -> bool:
    """Whether a projection with attribute `act` quantizes x to int8 for a call of `rows` rows."""
    return act == "int8" or (act == "int8@1" and rows == 1)


def _check_act(op: str, attrs: dict) -> None:
    if attrs.get("act", "") not in ACT_VALUES:
        raise ShapeError(f"{op}: act must be '' (float activations), 'int8' or 'int8@1' (int8 for one row), "
                         f"got {attrs['act']!r}")


REF_CHUNK_ROWS = 1024  # weight rows per step of w4a8_matmul (its int64 products stay ~M x 1024 x K / G)


def _reference(op: str):
    """x @ dequant(W)^T (+ bias) in float32, dequantized a block of rows at a time, rounded once."""

    def ref(ins, attrs):
        x, wq, s = ins[0], ins[1], ins[2]
        bias = ins[3] if len(ins) > 3 else None
        zero = ins[4] if len(ins) > 4 else None
        g = int(attrs.get("group_size", 128))
        k = 2 * wq.shape[1] if op == "LinearQ4" else wq.shape[1]
        int8 = act_int8(attrs.get("act", ""), int(np.prod(x.shape[:-1])))
        if op == "LinearQ4" and int8:
            return [w4a8_matmul(x, wq, s, g, bias, zero)]
        if op == "LinearQ8" and int8:
            return [w8a8_matmul(x, wq, s, bias)]

        def rows(r0, r1):
            return dequant(op, wq[r0:r1], s[r0:r1], g, None if zero is None else zero[r0:r1])

        return [matmul_rows(x, rows, wq.shape[0], k, bias)]

    return ref


register("LinearQ8", inputs=(3, 4), attrs={"act": Attr("str", "")}, kind="opaque",
         infer=_per_channel_infer("LinearQ8", "int8", "int8"), reference=_reference("LinearQ8"),
         doc="x @ (wq int8 [N, K] * scale[N])^T (+ bias); float32 dequant and accumulation, one rounding; "
             "act = int8: x quantized per row, exact int32 dot (W8A8)")
register("LinearF8", inputs=(3, 4), kind="opaque",
         infer=_per_channel_infer("LinearF8", "uint8", "uint8 (E4M3 codes)"), reference=_reference("LinearF8"),
         doc="x @ (E4M3(wq uint8 [N, K]) * scale[N])^T (+ bias); float32 dequant and accumulation, one rounding")
register("LinearQ4", inputs=(3, 5), attrs={"group_size": Attr("int", 128), "act": Attr("str", "")}, kind="opaque",
         infer=_q4_infer,
         reference=_reference("LinearQ4"),
         doc="x @ (((int4 nibbles of wq [N, K/2]) - 8 or - zero[N, K/group]) * scale[N, K/group])^T (+ bias); "
             "float32, one rounding; act = int8: x quantized per row, exact int32 group dots (W4A8)")


# -- DequantizeLinear (ONNX opset 21, constants only: a pre-quantized export's weights) --------------


def _dq_infer(ins, attrs):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 else None
    if x.dtype not in ("int8", "uint8"):
        raise ShapeError(f"DequantizeLinear: input dtype {x.dtype} (supported: int8, uint8, int4, uint4)")
    if scale.dtype not in ("float32", "float16"):
        raise ShapeError(f"DequantizeLinear: scale dtype {scale.dtype} (supported: float32, float16)")
    if zp is not None and zp.dtype != x.dtype:
        raise ShapeError(f"DequantizeLinear: zero point is {zp.dtype}, input {x.dtype}")
    rank = len(x.shape)
    block = int(attrs["block_size"])
    if rank:
        axis = attrs["axis"] % rank
        if block > 0:
            want = tuple(-(-d // block) if i == axis else d for i, d in enumerate(x.shape))
            if tuple(scale.shape) != want:
                raise ShapeError(f"DequantizeLinear: blocked scale must be {list(want)}, got {list(scale.shape)}")
        elif len(scale.shape) == 1 and scale.shape[0] not in (1, x.shape[axis]):
            raise ShapeError(f"DequantizeLinear: per-axis scale of {scale.shape[0]} for axis size {x.shape[axis]}")
        elif len(scale.shape) > 1:
            raise ShapeError("DequantizeLinear: scale must be a scalar, 1-D per axis, or blocked")
    return [TensorType(scale.dtype, tuple(x.shape))]


def expand_scale(s: np.ndarray, shape: tuple, axis: int, block: int) -> np.ndarray:
    """A DequantizeLinear scale (or zero point) broadcast to the input's shape."""
    if block > 0:
        return np.repeat(s, block, axis=axis).take(range(shape[axis]), axis=axis)
    if s.ndim == 0 or s.size == 1:
        return np.broadcast_to(s.reshape(()), shape)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.broadcast_to(s.reshape(view), shape)


def _dq_ref(ins, attrs):
    x, scale = ins[0], ins[1]
    zp = ins[2] if len(ins) > 2 and ins[2] is not None else None
    axis = attrs["axis"] % max(x.ndim, 1)
    block = int(attrs["block_size"])
    s = expand_scale(scale, x.shape, axis, block).astype(np.float32)
    q = x.astype(np.float32)
    if zp is not None:
        q = q - expand_scale(zp, x.shape, axis, block).astype(np.float32)
    return [(q * s).astype(scale.dtype)]


register("DequantizeLinear", inputs=(2, 3), kind="opaque",
         attrs={"axis": Attr("int", 1), "block_size": Attr("int", 0)}, infer=_dq_infer, reference=_dq_ref,
         doc="ONNX DequantizeLinear (opset 21) of a constant: (x - zero_point) * scale, per tensor, axis or "
             "block; passes/quantize.py turns a MatMul weight of this form into LinearQ4/LinearQ8")
