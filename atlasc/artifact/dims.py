"""Evaluating the manifest's dims at run time, without the compiler.

A dim in the manifest is an int or `{"poly": [[coeff, [atom, ...]], ...]}` (what
`atlasc.ir.symbolic.to_json` writes): a sum of terms, each a coefficient times atoms, an atom being
a symbol name or `{"max"|"min"|"floordiv"|"mod": [dim, dim]}`. tests/test_artifact_dims.py checks
this evaluator against atlasc.ir.symbolic on random expressions.
"""

from __future__ import annotations

from collections.abc import Mapping

from atlasc.errors import ArtifactError

_FUNCS = {"max": max, "min": min, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b}


def evaluate_dim(d, env: Mapping[str, int]) -> int:
    """The integer value of a manifest dim with the symbols bound by env."""
    if isinstance(d, int):
        return d
    total = 0
    for coeff, atoms in d["poly"]:
        v = coeff
        for a in atoms:
            if isinstance(a, str):
                if a not in env:
                    raise ArtifactError(f"symbol {a} is not bound")
                v *= env[a]
            else:
                (kind, args), = a.items()
                v *= _FUNCS[kind](*(evaluate_dim(x, env) for x in args))
        total += v
    return total


def symbol_of(d) -> str | None:
    """The symbol's name if the dim is exactly one bare symbol, else None."""
    if isinstance(d, dict) and len(d["poly"]) == 1:
        coeff, atoms = d["poly"][0]
        if coeff == 1 and len(atoms) == 1 and isinstance(atoms[0], str):
            return atoms[0]
    return None


def dim_str(d) -> str:
    """Readable form (for messages)."""
    if isinstance(d, int):
        return str(d)
    parts = []
    for coeff, atoms in d["poly"]:
        names = [a if isinstance(a, str) else f"{next(iter(a))}(...)" for a in atoms]
        body = "*".join(names)
        parts.append(body if coeff == 1 and body else f"{coeff}*{body}" if body else str(coeff))
    return " + ".join(parts)
