"""Symbolic dimensions.

A dim is a Python `int` or an `Expr`: an integer polynomial over named symbols (`batch`, `seq`,
`past_seq` ...) whose atoms may also be `max`, `min`, `floordiv` or `mod` of other dims. Exprs are
immutable, hashable, compare structurally (`==` is structural equality, not numeric truth) and are
kept canonical, so two spellings of the same polynomial are equal. An Expr whose value is a constant
is always returned as a plain int (see `dim`).

Every symbol is a non-negative integer. Comparisons that must be decided at compile time
(`prove_eq`, `prove_ge`) use that fact plus per-symbol lower bounds; they answer True, False or None
(unknown).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import reduce

# ---------------------------------------------------------------------------------------------
# atoms and monomials


@dataclass(frozen=True)
class Func:
    """A non-polynomial atom: max(a, b), min(a, b), floordiv(a, b) or mod(a, b)."""

    kind: str
    args: tuple  # of dims

    def __str__(self) -> str:
        if self.kind == "floordiv":
            return f"({_paren(self.args[0])} // {_paren(self.args[1])})"
        if self.kind == "mod":
            return f"({_paren(self.args[0])} % {_paren(self.args[1])})"
        return f"{self.kind}({', '.join(str(a) for a in self.args)})"


def _atom_key(atom) -> str:
    return atom if isinstance(atom, str) else "~" + str(atom)


def _paren(d) -> str:
    s = str(d)
    return f"({s})" if isinstance(d, Expr) and len(d.terms) > 1 else s


Monomial = tuple  # sorted tuple of atoms, repeated for powers; () is the constant monomial


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    return tuple(sorted(a + b, key=_atom_key))


def _mono_div(a: Monomial, b: Monomial) -> Monomial | None:
    rest = list(a)
    for atom in b:
        if atom not in rest:
            return None
        rest.remove(atom)
    return tuple(rest)


def _mono_order(m: Monomial):
    return (len(m), tuple(_atom_key(a) for a in m))


# ---------------------------------------------------------------------------------------------
# expressions


class Expr:
    """An integer polynomial over atoms; build with `sym(name)` and arithmetic on dims."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]):
        items = tuple(sorted(((m, c) for m, c in terms.items() if c != 0), key=lambda mc: _mono_order(mc[0])))
        object.__setattr__(self, "terms", items)
        object.__setattr__(self, "_hash", hash(items))

    def __setattr__(self, *_):
        raise AttributeError("Expr is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Expr) and self.terms == other.terms

    def __repr__(self) -> str:
        return f"Expr({self})"

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, coeff in sorted(self.terms, key=lambda mc: (-len(mc[0]), _mono_order(mc[0]))):  # highest degree first
            names = []
            for atom in mono:
                names.append(atom if isinstance(atom, str) else str(atom))
            body = "*".join(names)
            if not body:
                text = str(abs(coeff))
            elif abs(coeff) == 1:
                text = body
            else:
                text = f"{abs(coeff)}*{body}"
            sign = "-" if coeff < 0 else "+"
            parts.append((sign, text))
        out = ("-" if parts[0][0] == "-" else "") + parts[0][1]
        for sign, text in parts[1:]:
            out += f" {sign} {text}"
        return out

    # arithmetic, so numpy object arrays of dims work with + - * // %
    def __add__(self, o):
        return add(self, o)

    __radd__ = __add__

    def __sub__(self, o):
        return sub(self, o)

    def __rsub__(self, o):
        return sub(o, self)

    def __mul__(self, o):
        return mul(self, o)

    __rmul__ = __mul__

    def __neg__(self):
        return mul(self, -1)

    def __floordiv__(self, o):
        return floordiv(self, o)

    def __rfloordiv__(self, o):
        return floordiv(o, self)

    def __mod__(self, o):
        return mod(self, o)

    def __rmod__(self, o):
        return mod(o, self)

    def atoms(self) -> set:
        """Every atom (symbol name or Func) appearing in the polynomial."""
        return {a for m, _ in self.terms for a in m}

    def symbols(self) -> set[str]:
        """Every symbol name appearing anywhere, including inside Func atoms."""
        return symbols_of(self)


Dim = int | Expr


def _terms(d: Dim) -> dict:
    if isinstance(d, Expr):
        return dict(d.terms)
    if isinstance(d, (int,)) or hasattr(d, "__index__"):
        return {(): int(d)}
    raise TypeError(f"not a dim: {d!r}")


def dim(d) -> Dim:
    """Normalize: numpy ints become int, constant Exprs become int, other Exprs stay."""
    if isinstance(d, Expr):
        if not d.terms:
            return 0
        if len(d.terms) == 1 and d.terms[0][0] == ():
            return d.terms[0][1]
        return d
    if isinstance(d, bool):
        return int(d)
    if hasattr(d, "__index__"):
        return int(d)
    raise TypeError(f"not a dim: {d!r}")


def sym(name: str) -> Expr:
    """The symbol `name` as an expression."""
    return Expr({(name,): 1})


def _atom(f: Func) -> Expr:
    return Expr({(f,): 1})


def is_symbolic(d) -> bool:
    return isinstance(d, Expr)


def as_symbol(d) -> str | None:
    """The symbol's name if d is exactly one bare symbol (e.g. `seq`), else None."""
    if isinstance(d, Expr) and len(d.terms) == 1:
        mono, coeff = d.terms[0]
        if coeff == 1 and len(mono) == 1 and isinstance(mono[0], str):
            return mono[0]
    return None


def add(a: Dim, b: Dim) -> Dim:
    t = _terms(a)
    for m, c in _terms(b).items():
        t[m] = t.get(m, 0) + c
    return dim(Expr(t))


def sub(a: Dim, b: Dim) -> Dim:
    return add(a, mul(b, -1))


def mul(a: Dim, b: Dim) -> Dim:
    out: dict = {}
    for ma, ca in _terms(a).items():
        for mb, cb in _terms(b).items():
            m = _mono_mul(ma, mb)
            out[m] = out.get(m, 0) + ca * cb
    return dim(Expr(out))


def product(dims: Iterable[Dim]) -> Dim:
    return reduce(mul, dims, 1)


def exact_div(a: Dim, b: Dim) -> Dim | None:
    """a / b when b divides a exactly as polynomials (integer coefficients), else None."""
    tb = _terms(b)
    if not tb:
        return None
    lead_b = max(tb, key=_mono_order)
    cb = tb[lead_b]
    rem = _terms(a)
    quot: dict = {}
    while True:
        rem = {m: c for m, c in rem.items() if c != 0}
        if not rem:
            return dim(Expr(quot))
        lead_r = max(rem, key=_mono_order)
        cr = rem[lead_r]
        m = _mono_div(lead_r, lead_b)
        if m is None or cr % cb != 0:
            return None
        q = cr // cb
        quot[m] = quot.get(m, 0) + q
        for mb, c in tb.items():
            mm = _mono_mul(m, mb)
            rem[mm] = rem.get(mm, 0) - q * c


def floordiv(a: Dim, b: Dim) -> Dim:
    """a // b (floor). Exact polynomial quotients simplify; otherwise a floordiv atom."""
    a, b = dim(a), dim(b)
    if isinstance(a, int) and isinstance(b, int):
        if b == 0:
            raise ZeroDivisionError("dim division by zero")
        return a // b
    if b == 1:
        return a
    q = exact_div(a, b)
    if q is not None:
        return q
    # (a*c) // (b*c) == a // b for any c != 0 (and undefined for c == 0 either way): cancel the common
    # factor, so Reshape's -1 on [batch, seq, h] -> [batch, seq, 3, -1] gives h // 3
    c = _common_factor(a, b)
    if c != 1:
        a, b = exact_div(a, c), exact_div(b, c)
        return floordiv(a, b)
    return _atom(Func("floordiv", (a, b)))


def _common_factor(a: Dim, b: Dim) -> Dim:
    """The largest monomial (positive integer content times common atoms) dividing every term of a and b."""
    from math import gcd

    terms = list(_terms(a).items()) + list(_terms(b).items())
    content = 0
    common = None
    for mono, coeff in terms:
        content = gcd(content, coeff)
        if common is None:
            common = list(mono)
        else:
            rest = list(mono)
            common = [x for x in common if x in rest and (rest.remove(x) or True)]
    if not content:
        return 1
    return dim(Expr({tuple(sorted(common or (), key=_atom_key)): content}))


def mod(a: Dim, b: Dim) -> Dim:
    a, b = dim(a), dim(b)
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    if exact_div(a, b) is not None:
        return 0
    return _atom(Func("mod", (a, b)))


def dmax(a: Dim, b: Dim, bounds: Mapping[str, int] | None = None) -> Dim:
    """max(a, b), simplified when the order is provable."""
    a, b = dim(a), dim(b)
    if prove_ge(a, b, bounds):
        return a
    if prove_ge(b, a, bounds):
        return b
    x, y = sorted((a, b), key=str)
    return _atom(Func("max", (x, y)))


def dmin(a: Dim, b: Dim, bounds: Mapping[str, int] | None = None) -> Dim:
    """min(a, b), simplified when the order is provable."""
    a, b = dim(a), dim(b)
    if prove_ge(a, b, bounds):
        return b
    if prove_ge(b, a, bounds):
        return a
    x, y = sorted((a, b), key=str)
    return _atom(Func("min", (x, y)))


# ---------------------------------------------------------------------------------------------
# reasoning


def lower_bound(d: Dim, bounds: Mapping[str, int] | None = None) -> int | None:
    """A proven lower bound of d (symbols >= their bound, default 0), or None if unknown."""
    d = dim(d)
    if isinstance(d, int):
        return d
    total = 0
    for mono, coeff in d.terms:
        if mono == ():
            total += coeff
            continue
        if coeff < 0:
            return None  # a negative term of an unbounded-above polynomial: no lower bound known
        low = 1
        for atom in mono:
            la = _atom_lower(atom, bounds)
            if la is None or la < 0:
                return None
            low *= la
        total += coeff * low
    return total


def _atom_lower(atom, bounds) -> int | None:
    if isinstance(atom, str):
        return (bounds or {}).get(atom, 0)
    a = [lower_bound(x, bounds) for x in atom.args]
    if atom.kind == "max":
        known = [x for x in a if x is not None]
        return max(known) if known else None
    if atom.kind == "min":
        return None if None in a else min(a)
    if atom.kind == "floordiv":  # a // b >= 0 needs a >= 0 and b >= 0 (b < 0 flips the sign)
        if a[0] is None or a[0] < 0 or a[1] is None or a[1] < 0:
            return None
        return 0
    if atom.kind == "mod":  # a % b lies in [0, b) for b > 0 whatever a's sign; in (b, 0] for b < 0
        return 0 if a[1] is not None and a[1] >= 0 else None
    return None


def prove_ge(a: Dim, b: Dim, bounds: Mapping[str, int] | None = None) -> bool:
    """True only if a >= b for every admissible value of the symbols."""
    lb = lower_bound(sub(a, b), bounds)
    return lb is not None and lb >= 0


def prove_eq(a: Dim, b: Dim, bounds: Mapping[str, int] | None = None) -> bool | None:
    """True if a == b always, False if a != b always, None if it depends on the symbols."""
    diff = sub(a, b)
    if diff == 0:
        return True
    if isinstance(diff, int):
        return False
    lb = lower_bound(diff, bounds)
    if lb is not None and lb > 0:
        return False
    lb = lower_bound(mul(diff, -1), bounds)
    if lb is not None and lb > 0:
        return False
    return None


def symbols_of(d: Dim) -> set[str]:
    """Every symbol name d depends on."""
    if not isinstance(d, Expr):
        return set()
    out = set()
    for atom in d.atoms():
        if isinstance(atom, str):
            out.add(atom)
        else:
            for a in atom.args:
                out |= symbols_of(a)
    return out


def substitute(d: Dim, mapping: Mapping[str, Dim]) -> Dim:
    """Replace symbols by dims (simultaneously) and re-simplify."""
    d = dim(d)
    if isinstance(d, int) or not (symbols_of(d) & mapping.keys()):
        return d
    total: Dim = 0
    for mono, coeff in d.terms:
        term: Dim = coeff
        for atom in mono:
            term = mul(term, _subst_atom(atom, mapping))
        total = add(total, term)
    return total


def _subst_atom(atom, mapping) -> Dim:
    if isinstance(atom, str):
        return mapping.get(atom, sym(atom))
    args = [substitute(a, mapping) for a in atom.args]
    return {"max": dmax, "min": dmin, "floordiv": floordiv, "mod": mod}[atom.kind](*args)


def evaluate(d: Dim, env: Mapping[str, int]) -> int:
    """The integer value of d with every symbol bound by env (KeyError names a missing symbol)."""
    d = dim(d)
    if isinstance(d, int):
        return d
    total = 0
    for mono, coeff in d.terms:
        v = coeff
        for atom in mono:
            v *= env[atom] if isinstance(atom, str) else _eval_atom(atom, env)
        total += v
    return total


def _eval_atom(atom: Func, env) -> int:
    a, b = (evaluate(x, env) for x in atom.args)
    return {"max": max, "min": min, "floordiv": lambda x, y: x // y, "mod": lambda x, y: x % y}[atom.kind](a, b)


# ---------------------------------------------------------------------------------------------
# serialization (used by the artifact manifest; plain JSON types only)


def to_json(d: Dim):
    """A JSON-able form: an int, or {"poly": [[coeff, [atom...]], ...]} with atoms str or nested."""
    d = dim(d)
    if isinstance(d, int):
        return d
    return {"poly": [[c, [a if isinstance(a, str) else {a.kind: [to_json(x) for x in a.args]} for a in m]]
                     for m, c in d.terms]}


def from_json(j) -> Dim:
    """Inverse of to_json."""
    if isinstance(j, int):
        return j
    total: Dim = 0
    for coeff, atoms in j["poly"]:
        term: Dim = coeff
        for a in atoms:
            if isinstance(a, str):
                term = mul(term, sym(a))
            else:
                (kind, args), = a.items()
                term = mul(term, _atom(Func(kind, tuple(from_json(x) for x in args))))
        total = add(total, term)
    return total


def shape_str(shape) -> str:
    """Readable shape: [batch, seq + past_seq, 64]."""
    if shape is None:
        return "[?]"
    return "[" + ", ".join(str(s) for s in shape) + "]"
