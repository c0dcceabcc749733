"""KV-cache ops: the in-place cache of a decoder's entry points.

The cache is one persistent tensor `[layers, 2, max_batch, kv_heads, max_seq, head_dim]` (2: key,
value). `KVAppend` writes a step's new keys or values at positions [past, past + seq) of every
sequence and yields the cache's first past + seq positions as `present`: no copy of the past is made
(in the arena `present` is a strided view of the cache; the reference returns the same numbers).
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
