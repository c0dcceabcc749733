"""Node attributes <-> plain JSON, for the artifact's launch schedule.

Dims become {"dim": symbolic.to_json(d)}, numpy arrays {"array": [...], "dtype": ..., "shape": [...]},
tuples lists; decoding uses the op's attribute schema to give tuples and arrays back, so a decoded
node runs the same reference as the original.
"""

from __future__ import annotations

import numpy as np

from atlasc.ir import symbolic as S
from atlasc.ir.ops import get


def encode(x):
    """One attribute value as JSON-able data."""
    if isinstance(x, S.Expr):
        return {"dim": S.to_json(x)}
    if isinstance(x, np.ndarray):
        return {"array": x.reshape(-1).tolist(), "dtype": str(x.dtype), "shape": list(x.shape)}
    if isinstance(x, (tuple, list)):
        return [encode(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def decode(x):
    """Inverse of encode (lists stay lists; see decode_attrs for tuples)."""
    if isinstance(x, dict) and "dim" in x:
        return S.from_json(x["dim"])
    if isinstance(x, dict) and "array" in x:
        return np.array(x["array"], dtype=x["dtype"]).reshape(x["shape"])
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x


def encode_attrs(attrs: dict) -> dict:
    return {k: encode(v) for k, v in sorted(attrs.items())}


def decode_attrs(op: str, attrs: dict) -> dict:
    """Attributes of a node of `op` as the op table expects them (tuples for ints/dims)."""
    schema = get(op).attrs
    out = {}
    for k, v in attrs.items():
        v = decode(v)
        if isinstance(v, list) and k in schema and schema[k].kind in ("ints", "dims"):
            v = tuple(v)
        if k in schema and schema[k].kind in ("steps", "any"):  # nested tuples (FusedElementwise's program)
            v = _deep_tuple(v)
        out[k] = v
    return out


def _deep_tuple(x):
    if isinstance(x, list):
        return tuple(_deep_tuple(v) for v in x)
    return x
