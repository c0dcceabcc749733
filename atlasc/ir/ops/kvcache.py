"""KV-cache ops: the in-place cache of a decoder's entry points.

The cache is one persistent tensor `[layers, 2, max_batch, kv_heads, max_seq, head_dim]` (2: key,
value). `KVAppend` writes a step's new keys or values at positions [past, past + seq) of every
sequence and yields the cache's first past + seq positions as `present`: no copy of the past is made
(in the arena `present` is a strided view of the cache; the reference returns the same numbers).

`QKVRotary` is the fused form of a layer's whole path from its merged QKV projection to attention:
split into heads, rotate q and k (rotate-half rotary over the first R dims), append k and v to the
cache; outputs q [B, Hq, S, D] and both `present` views.
"""

from __future__ import annotations

import numpy as np

from atlasc.errors import InputError, ShapeError
from atlasc.ir import symbolic as S
from atlasc.ir.ops.registry import Attr, TensorType, register

KINDS = ("key", "value")


def _kv_append_infer(ins, attrs):
    x = ins[0]
    if len(x.shape) != 4:
        raise ShapeError("KVAppend: new keys/values must be [batch, kv_heads, seq, head_dim]")
    if attrs["kind"] not in KINDS:
        raise ShapeError(f"KVAppend: kind must be key or value, got {attrs['kind']}")
    b, h, s, d = x.shape
    return [TensorType(x.dtype, (b, h, S.add(attrs["past"], s), d))]


def _kv_append_ref(ins, attrs, state):
    x = ins[0]
    cache = state["kv_cache"]
    b, _, s, _ = x.shape
    past = attrs["past"]
    if past + s > cache.shape[4] or b > cache.shape[2]:
        raise InputError(f"KV cache overflow: batch {b}, {past} + {s} positions, cache holds "
                         f"{cache.shape[2]} x {cache.shape[4]}")
    slot = cache[attrs["layer"], KINDS.index(attrs["kind"])]
    slot[:b, :, past:past + s] = x
    return [np.ascontiguousarray(slot[:b, :, :past + s])]


register("KVAppend", inputs=1, kind="opaque", stateful=True,
         attrs={"layer": Attr("int"), "kind": Attr("str"), "past": Attr("dim")},
         infer=_kv_append_infer, reference=_kv_append_ref,
         doc="Write new K or V of one layer into the persistent cache at [past, past+seq); yield cache[:past+seq]")


def _qkv_rotary_infer(ins, attrs):
    qkv = ins[0]
    cos, sin = (ins[1], ins[2]) if len(ins) > 1 else (None, None)
    hq, hk, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    if len(qkv.shape) != 3:
        raise ShapeError("QKVRotary: qkv must be [batch, seq, (q_heads + 2 kv_heads) * head_dim]")
    b, s, n = qkv.shape
    if n != (hq + 2 * hk) * d:
        raise ShapeError(f"QKVRotary: qkv width {n} is not ({hq} + 2 * {hk}) * {d}")
    if (cos is None) != (sin is None):
        raise ShapeError("QKVRotary: give both cos and sin, or neither (no rotary)")
    if cos is not None:
        for t in (cos, sin):
            if len(t.shape) != 3 or t.dtype != qkv.dtype:
                raise ShapeError(f"QKVRotary: cos/sin must be {qkv.dtype}[batch or 1, seq, rotary_dim]")
        r = cos.shape[2]
        if sin.shape[2] != r or isinstance(r, S.Expr) or r % 2 or r > d:
            raise ShapeError(f"QKVRotary: rotary_dim {r} must be even, static and <= head_dim {d}")
    present = (b, hk, S.add(attrs["past"], s), d)
    return [TensorType(qkv.dtype, (b, hq, s, d)), TensorType(qkv.dtype, present), TensorType(qkv.dtype, present)]


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x * cos + rotate_half(x) * sin over x's first R = cos.shape[-1] dims, each op rounded in x's dtype."""
    r = cos.shape[-1]
    a = x[..., :r]
    rh = np.concatenate([-a[..., r // 2:], a[..., :r // 2]], axis=-1)
    out = x.copy()
    out[..., :r] = (a * cos) + (rh * sin)
    return out


def _qkv_rotary_ref(ins, attrs, state):
    qkv = ins[0]
    hq, hk, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    b, s, _ = qkv.shape
    heads = qkv.reshape(b, s, hq + 2 * hk, d).transpose(0, 2, 1, 3)  # [b, H, s, d]
    cos, sin = (ins[1], ins[2]) if len(ins) > 1 else (np.zeros((1, s, 0), qkv.dtype),) * 2  # no rotary
    r = cos.shape[-1]
    c = np.broadcast_to(cos, (b, s, r))[:, None]
    sn = np.broadcast_to(sin, (b, s, r))[:, None]
    q = rotate_half(heads[:, :hq], c, sn)
    k = rotate_half(heads[:, hq:hq + hk], c, sn)
    v = heads[:, hq + hk:]
    presents = []
    for kind, x in (("key", k), ("value", v)):
        presents.append(_kv_append_ref([np.ascontiguousarray(x)],
                                       {"layer": attrs["layer"], "kind": kind, "past": attrs["past"]}, state)[0])
    return [np.ascontiguousarray(q), *presents]


register("QKVRotary", inputs=(1, 3), outputs=3, kind="opaque", stateful=True,
         attrs={"q_heads": Attr("int"), "kv_heads": Attr("int"), "head_dim": Attr("int"),
                "layer": Attr("int"), "past": Attr("dim")},
         infer=_qkv_rotary_infer, reference=_qkv_rotary_ref,
         doc="Merged QKV [B, S, (Hq+2Hk)*D] -> rotated q [B, Hq, S, D]; rotated k and v appended to the "
             "cache of `layer` at [past, past+S); yields q and both present views (no cos/sin: no rotary)")
