"""Neural-network ops: MatMul, Gemm, Softmax, normalizations, and the opset-23 fused LLM ops.

Numeric choices: float16 normalizations and attention compute in float32 internally (ONNX
`stash_type=1`, `softmax_precision` float), then round to the input dtype, like onnxruntime.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.ops.common import broadcast_shapes, norm_axis, same_dtype
from atlasc.ir.ops.registry import Attr, DimMismatch, TensorType, register

# -- MatMul / Gemm ---------------------------------------------------------------------------


def _matmul_infer(ins, attrs):
    dt = same_dtype(ins, "MatMul")
    a, b = ins[0].shape, ins[1].shape
    if not a or not b:
        raise ShapeError("MatMul: scalar operand")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise DimMismatch(a2[-1], b2[-2], "MatMul: inner ")
    batch = broadcast_shapes(a2[:-2], b2[:-2], context="MatMul: ")
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return [TensorType(dt, out)]


def _matmul_ref(ins, attrs):
    a, b = ins
    if a.dtype == np.float16:  # accumulate in float32 like every fp16 GEMM we compare with
        return [np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)]
    return [np.matmul(a, b)]


register("MatMul", inputs=2, kind="opaque", infer=_matmul_infer, reference=_matmul_ref, doc="ONNX MatMul")


def _gemm_infer(ins, attrs):
    dt = same_dtype(ins, "Gemm")
    a, b = ins[0].shape, ins[1].shape
    m, k = (a[1], a[0]) if attrs["transA"] else a
    k2, n = (b[1], b[0]) if attrs["transB"] else b
    if k != k2:
        raise DimMismatch(k, k2, "Gemm: inner ")
    if len(ins) > 2 and ins[2] is not None:
        broadcast_shapes(ins[2].shape, (m, n), context="Gemm: bias ")
    return [TensorType(dt, (m, n))]


def _gemm_ref(ins, attrs):
    a, b = ins[0], ins[1]
    work = np.float32 if a.dtype == np.float16 else a.dtype
    a = a.T if attrs["transA"] else a
    b = b.T if attrs["transB"] else b
    y = attrs["alpha"] * np.matmul(a.astype(work), b.astype(work))
    if len(ins) > 2 and ins[2] is not None:
        y = y + attrs["beta"] * ins[2].astype(work)
    return [y.astype(ins[0].dtype)]


register("Gemm", inputs=(2, 3), kind="opaque",
         attrs={"alpha": Attr("float", 1.0), "beta": Attr("float", 1.0), "transA": Attr("int", 0),
                "transB": Attr("int", 0)},
         infer=_gemm_infer, reference=_gemm_ref, doc="ONNX Gemm")

# -- Softmax ---------------------------------------------------------------------------------


def _softmax(x, axis):
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    m = np.max(xf, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(xf - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return (e / np.where(s == 0, 1, s)).astype(x.dtype)


def _softmax_infer(ins, attrs):
    norm_axis(attrs["axis"], len(ins[0].shape), "Softmax")
    return [ins[0]]


register("Softmax", inputs=1, kind="reduction", attrs={"axis": Attr("int", -1)}, infer=_softmax_infer,
         reference=lambda ins, attrs: [_softmax(ins[0], attrs["axis"])], doc="ONNX Softmax (opset >= 13)")


def _log_softmax(x, axis):
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    m = np.max(xf, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):  # a row of only -inf is NaN (-inf - -inf), without numpy's warning
        y = xf - m - np.log(np.sum(np.exp(xf - m), axis=axis, keepdims=True))
    return y.astype(x.dtype)


register("LogSoftmax", inputs=1, kind="reduction", attrs={"axis": Attr("int", -1)}, infer=_softmax_infer,
         reference=lambda ins, attrs: [_log_softmax(ins[0], attrs["axis"])], doc="ONNX LogSoftmax")

# -- LayerNormalization / RMSNormalization ---------------------------------------------------


def _norm_infer(name, max_outputs):
    def infer(ins, attrs):
        x = ins[0]
        axis = norm_axis(attrs["axis"], len(x.shape), name)
        for t in ins[1:]:
            if t is not None:
                broadcast_shapes(t.shape, x.shape[axis:], context=f"{name}: scale/bias ")
        stat_shape = x.shape[:axis] + (1,) * (len(x.shape) - axis)
        outs = [TensorType(x.dtype, x.shape)]
        for _ in range(max_outputs - 1):
            outs.append(TensorType("float32", stat_shape))
        return outs

    return infer


def _layernorm_ref(ins, attrs, n_out=3):
    x = ins[0]
    axis = attrs["axis"] % x.ndim
    axes = tuple(range(axis, x.ndim))
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    mean = np.mean(xf, axis=axes, keepdims=True)
    var = np.mean(np.square(xf - mean), axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + attrs["epsilon"])
    y = (xf - mean) * inv
    y = y * ins[1].astype(xf.dtype)
    if len(ins) > 2 and ins[2] is not None:
        y = y + ins[2].astype(xf.dtype)
    return [y.astype(x.dtype), mean.astype(np.float32), inv.astype(np.float32)]


register("LayerNormalization", inputs=(2, 3), outputs=(1, 3), kind="reduction",
         attrs={"axis": Attr("int", -1), "epsilon": Attr("float", 1e-5), "stash_type": Attr("int", 1)},
         infer=_norm_infer("LayerNormalization", 3), reference=_layernorm_ref,
         doc="ONNX LayerNormalization (opset 17); statistics in float32")


def _rmsnorm_ref(ins, attrs):
    x = ins[0]
    axis = attrs["axis"] % x.ndim
    axes = tuple(range(axis, x.ndim))
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    inv = 1.0 / np.sqrt(np.mean(np.square(xf), axis=axes, keepdims=True) + attrs["epsilon"])
    return [(xf * inv * ins[1].astype(xf.dtype)).astype(x.dtype)]


register("RMSNormalization", inputs=2, kind="reduction",
         attrs={"axis": Attr("int", -1), "epsilon": Attr("float", 1e-5), "stash_type": Attr("int", 1)},
         infer=_norm_infer("RMSNormalization", 1), reference=_rmsnorm_ref,
         doc="ONNX RMSNormalization (opset 23); computed in float32")

def _add_norm(name: str, norm_ref):
    """(infer, reference) of `name` = the residual add s = a + b (rounded to the dtype, like the Add it
    replaces) followed by a normalization of s over the remaining inputs; outputs (y, s)."""

    def infer(ins, attrs):
        a, b = ins[0], ins[1]
        if a.dtype != b.dtype or tuple(S.dim(d) for d in a.shape) != tuple(S.dim(d) for d in b.shape):
            raise ShapeError(f"{name}: both addends must have one dtype and shape")
        y = _norm_infer(name, 1)([a, *ins[2:]], attrs)[0]
        return [y, TensorType(a.dtype, a.shape)]

    def reference(ins, attrs):
        s = ins[0] + ins[1]
        return [norm_ref([s, *ins[2:]], attrs)[0], s]

    return infer, reference


_ADD_NORM_ATTRS = {"axis": Attr("int", -1), "epsilon": Attr("float", 1e-5)}
_add_ln_infer, _add_ln_ref = _add_norm("AddLayerNormalization", _layernorm_ref)
_add_rms_infer, _add_rms_ref = _add_norm("AddRMSNormalization", _rmsnorm_ref)
register("AddLayerNormalization", inputs=(3, 4), outputs=2, kind="reduction", attrs=_ADD_NORM_ATTRS,
         infer=_add_ln_infer, reference=_add_ln_ref,
         doc="Residual add + LayerNorm: s = a + b (rounded), y = LayerNormalization(s, w[, c]); outputs y and s")
register("AddRMSNormalization", inputs=3, outputs=2, kind="reduction", attrs=_ADD_NORM_ATTRS,
         infer=_add_rms_infer, reference=_add_rms_ref,
         doc="Residual add + RMSNorm: s = a + b (rounded), y = RMSNormalization(s, w); outputs y and s")


# -- RotaryEmbedding (opset 23) --------------------------------------------------------------


def _rotary_infer(ins, attrs):
    x = ins[0]
    if len(x.shape) not in (3, 4):
        raise ShapeError("RotaryEmbedding: input must be rank 3 or 4")
    if len(x.shape) == 3 and not attrs["num_heads"]:
        raise ShapeError("RotaryEmbedding: rank-3 input needs num_heads")
    return [x]


def _rotary_ref(ins, attrs):
    x, cos, sin = ins[0], ins[1], ins[2]
    pos = ins[3] if len(ins) > 3 else None
    shape = x.shape
    xt = np.transpose(x, (0, 2, 1, 3)) if x.ndim == 4 else x.reshape(shape[0], shape[1], attrs["num_heads"], -1)
    dim = attrs["rotary_embedding_dim"] or xt.shape[3]
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rot, keep = xt[..., :dim], xt[..., dim:]
    if attrs["interleaved"]:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : dim // 2], rot[..., dim // 2:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if attrs["interleaved"]:
        rot = np.stack([real, imag], axis=-1).reshape(rot.shape)
    else:
        rot = np.concatenate([real, imag], axis=-1)
    out = np.concatenate([rot, keep], axis=-1).astype(x.dtype)
    return [np.transpose(out, (0, 2, 1, 3)).copy() if x.ndim == 4 else out.reshape(shape)]


register("RotaryEmbedding", inputs=(3, 4), kind="opaque",
         attrs={"interleaved": Attr("int", 0), "rotary_embedding_dim": Attr("int", 0), "num_heads": Attr("int", 0)},
         infer=_rotary_infer, reference=_rotary_ref, doc="ONNX RotaryEmbedding (opset 23)")

# -- Attention (opset 23) --------------------------------------------------------------------


def _attention_infer(ins, attrs):
    q, k, v = ins[0], ins[1], ins[2]
    past_k = ins[4] if len(ins) > 4 else None
    if len(q.shape) == 4:
        b, hq, sq, _ = q.shape
        _, hk, skv, _ = k.shape
        y = TensorType(q.dtype, (b, hq, sq, v.shape[3]))
        if attrs["out_bshd"]:
            y = TensorType(q.dtype, (b, sq, S.mul(hq, v.shape[3])))
        dv = v.shape[3]
        dk = k.shape[3]
    elif len(q.shape) == 3:
        if not attrs["q_num_heads"] or not attrs["kv_num_heads"]:
            raise ShapeError("Attention: rank-3 inputs need q_num_heads and kv_num_heads")
        b, sq, _ = q.shape
        hq, hk = attrs["q_num_heads"], attrs["kv_num_heads"]
        skv = k.shape[1]
        dk = S.floordiv(k.shape[2], hk)
        dv = S.floordiv(v.shape[2], hk)
        y = TensorType(q.dtype, (b, sq, S.mul(dv, hq)))
    else:
        raise ShapeError("Attention: Q must be rank 3 or 4")
    total = S.add(skv, past_k.shape[2]) if past_k is not None else skv
    if attrs["key_mask"]:
        m = ins[3] if len(ins) > 3 else None
        if m is None or len(m.shape) != 2 or past_k is not None:
            raise ShapeError("Attention key_mask=1: the mask must be attention_mask [batch, keys], without past inputs")
    outs = [y, TensorType(q.dtype, (b, hk, total, dk)), TensorType(q.dtype, (b, hk, total, dv)),
            TensorType(q.dtype, (b, hq, sq, total))]
    return outs


def key_mask_visible(am: np.ndarray, sq: int, skv: int, causal: int, window: int) -> np.ndarray:
    """bool [B, S, T]: key t is visible to query s of sequence b (key_mask=1 Attention).

    Queries are the last S of the T positions (past = T - S, query s at position past + s, as with the
    KV cache: K/V hold positions 0 .. T-1). Visible iff am[b, t] != 0, and (causal) t <= past + s, and
    (window > 0) past + s - t < window."""
    if am.ndim != 2 or am.shape[1] != skv:
        raise ShapeError(f"Attention key_mask: the mask must be [batch, {skv}] 0/1, got {list(am.shape)}")
    t = np.arange(skv)[None, :]
    pos = skv - sq + np.arange(sq)[:, None]
    rel = np.ones((sq, skv), bool)
    if causal:
        rel &= t <= pos
    if window:
        rel &= pos - t < window
    return (am != 0)[:, None, :] & rel[None]


def _attention_ref(ins, attrs):
    ins = list(ins) + [None] * (6 - len(ins))
    q, k, v, mask, past_k, past_v = ins[:6]
    dtype = q.dtype
    rank3 = q.ndim == 3
    if rank3:
        hq, hk = attrs["q_num_heads"], attrs["kv_num_heads"]
        q = q.reshape(q.shape[0], q.shape[1], hq, -1).transpose(0, 2, 1, 3)
        k = k.reshape(k.shape[0], k.shape[1], hk, -1).transpose(0, 2, 1, 3)
        v = v.reshape(v.shape[0], v.shape[1], hk, -1).transpose(0, 2, 1, 3)
    if past_k is not None:
        k = np.concatenate([past_k, k], axis=2)
        v = np.concatenate([past_v, v], axis=2)
    present_k, present_v = k, v
    sq, skv = q.shape[2], k.shape[2]
    scale = attrs["scale"] if attrs["scale"] else 1.0 / np.sqrt(q.shape[3])
    bias = np.zeros((sq, skv), np.float32)
    if mask is not None and attrs["key_mask"]:
        keep = key_mask_visible(mask, sq, skv, attrs["causal"], attrs["window"])  # [B, S, T]
        bias = bias + np.where(keep, np.float32(0), np.float32(attrs["mask_fill"]))[:, None]
    elif mask is not None:
        m = mask
        if m.shape[-1] < skv:
            pad = [(0, 0)] * (m.ndim - 1) + [(0, skv - m.shape[-1])]
            m = np.pad(m, pad, constant_values=False if m.dtype == np.bool_ else -np.inf)
        m = np.where(m, 0.0, -np.inf).astype(np.float32) if m.dtype == np.bool_ else m.astype(np.float32)
        bias = bias + m
    if attrs["is_causal"]:
        offset = past_k.shape[2] if past_k is not None else 0
        allowed = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + offset
        bias = bias + np.where(allowed, 0.0, -np.inf).astype(np.float32)
    group = q.shape[1] // k.shape[1]
    kf = np.repeat(k, group, axis=1).astype(np.float32)
    vf = np.repeat(v, group, axis=1).astype(np.float32)
    raw = np.matmul(q.astype(np.float32), np.swapaxes(kf, -1, -2)) * np.float32(scale)
    capped = raw
    if attrs["softcap"] and attrs["softcap"] > 0:
        capped = attrs["softcap"] * np.tanh(raw / attrs["softcap"])
    scores = capped + bias
    probs = _softmax(scores, -1)
    y = np.matmul(probs, vf).astype(dtype)
    if rank3 or attrs["out_bshd"]:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], sq, -1)
    # qk_matmul_output: 0 the scaled Q.K^T, 1 after softcap, 2 after softcap + mask/causal bias, 3 the softmax
    qk = {0: raw, 1: capped, 2: scores, 3: probs}[attrs["qk_matmul_output_mode"]]
    return [y, present_k.astype(dtype), present_v.astype(dtype), qk.astype(dtype)]


register("Attention", inputs=(3, 6), outputs=(1, 4), kind="opaque",
         attrs={"is_causal": Attr("int", 0), "kv_num_heads": Attr("int", 0), "q_num_heads": Attr("int", 0),
                "qk_matmul_output_mode": Attr("int", 0), "scale": Attr("float", 0.0),
                "softcap": Attr("float", 0.0), "softmax_precision": Attr("int", 0),
                "out_bshd": Attr("int", 0), "key_mask": Attr("int", 0), "causal": Attr("int", 0),
                "window": Attr("int", 0), "mask_fill": Attr("float", float("-inf"))},
         infer=_attention_infer, reference=_attention_ref,
         doc="ONNX Attention (opset 23): GQA by head grouping, optional past, bool/additive mask, causal; "
             "atlasc's out_bshd=1 (set by fuse-attention) writes a 4-D attention's output as [B, S, H*Dv]; "
             "atlasc's key_mask=1 (set by mask-as-lengths): the mask input is attention_mask [B, T] (0/1) and "
             "the bias is 0 where key_mask_visible (padding, `causal` with past = T - S, `window`), else "
             "mask_fill (-inf or the dtype's lowest value, as the export's mask had it)")
