"""Dims as C expressions: a symbolic dim becomes code over the run-time dims buffer `d[]`; names as comment text."""

from __future__ import annotations

import re

from atlasc.ir import symbolic as S


def c_dim(d, symbol_index: dict[str, int]) -> str:
    """C expression (type long long) for dim d; symbol s reads d[symbol_index[s]]."""
    d = S.dim(d)
    if isinstance(d, int):
        return f"{d}LL"
    terms = []
    for mono, coeff in d.terms:
        factors = [_atom(a, symbol_index) for a in mono]
        if coeff != 1 or not factors:
            factors.insert(0, f"{coeff}LL")
        terms.append("*".join(factors))
    return "(" + " + ".join(terms) + ")"


def _atom(atom, symbol_index) -> str:
    if isinstance(atom, str):
        return f"d[{symbol_index[atom]}]"
    a, b = (c_dim(x, symbol_index) for x in atom.args)
    if atom.kind == "max":
        return f"atlas::imax({a}, {b})"
    if atom.kind == "min":
        return f"atlas::imin({a}, {b})"
    if atom.kind == "floordiv":
        return f"atlas::floordiv({a}, {b})"
    if atom.kind == "mod":
        return f"atlas::floormod({a}, {b})"
    raise ValueError(atom.kind)


C_TYPES = {
    "float32": "float",
    "float16": "__half",
    "float64": "double",
    "int64": "long long",
    "int32": "int",
    "int16": "short",
    "int8": "signed char",
    "uint8": "unsigned char",
    "bool": "bool",
}

# the type arithmetic happens in: float16 computes in float
COMPUTE_TYPES = {**C_TYPES, "float16": "float"}


def c_type(dtype: str) -> str:
    return C_TYPES[dtype]


def compute_type(dtype: str) -> str:
    return COMPUTE_TYPES[dtype]


def comment_text(text: str) -> str:
    """`text` safe inside a `//` comment of generated CUDA: names from the ONNX file may hold a newline (which would
    end the comment) or a backslash (which would splice the next line into it); those and any other character
    outside printable ASCII become '?'."""
    return re.sub(r"[^\x20-\x7e]|\\", "?", text)
