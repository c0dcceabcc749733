"""Property tests for atlasc.ir.symbolic: arithmetic, division, proofs, substitution, serialization.

Dims are polynomials over non-negative integer symbols, possibly with max/min/floordiv/mod atoms.
`evaluate` is the ground truth every property is checked against.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlasc.ir import symbolic as S

SYMS = ("a", "b", "c")
settings.register_profile("atlasc", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("atlasc")


@st.composite
def polys(draw, nonneg=False, max_terms=4, syms=SYMS):
    """A random polynomial: up to max_terms terms, coefficients in [-5, 5] (or [0, 5]), degree <= 2 per symbol."""
    terms = draw(st.lists(st.tuples(st.integers(0 if nonneg else -5, 5),
                                    st.tuples(*[st.integers(0, 2)] * len(syms))), max_size=max_terms))
    d = 0
    for coeff, exps in terms:
        t = coeff
        for s, e in zip(syms, exps):
            for _ in range(e):
                t = S.mul(t, S.sym(s))
        d = S.add(d, t)
    return d


@st.composite
def positive_polys(draw):
    """A polynomial >= 1 for every non-negative binding: non-negative coefficients and a constant >= 1."""
    return S.add(draw(polys(nonneg=True, max_terms=3)), draw(st.integers(1, 4)))


@st.composite
def dims(draw, depth=1):
    """A polynomial, possibly with one layer of max/min/floordiv/mod atoms (divisors always >= 1)."""
    base = draw(polys())
    if depth == 0 or not draw(st.booleans()):
        return base
    kind = draw(st.sampled_from(["max", "min", "floordiv", "mod"]))
    x = draw(dims(depth=depth - 1))
    if kind in ("floordiv", "mod"):
        y = draw(st.one_of(st.integers(1, 5), positive_polys()))
        atom = (S.floordiv if kind == "floordiv" else S.mod)(x, y)
    else:
        y = draw(dims(depth=depth - 1))
        atom = (S.dmax if kind == "max" else S.dmin)(x, y)
    return S.add(S.mul(atom, draw(st.integers(-3, 3))), base)


envs = st.fixed_dictionaries({s: st.integers(0, 6) for s in SYMS})
bounds_st = st.fixed_dictionaries({s: st.integers(0, 2) for s in SYMS})


def grid(bounds, span=4):
    """Every binding with lower[s] <= s < lower[s] + span."""
    for vals in itertools.product(*(range(bounds[s], bounds[s] + span) for s in SYMS)):
        yield dict(zip(SYMS, vals))


# -- arithmetic ------------------------------------------------------------------------------


@given(dims(), dims(), envs)
def test_add_sub_mul_evaluate(x, y, env):
    ex, ey = S.evaluate(x, env), S.evaluate(y, env)
    assert S.evaluate(S.add(x, y), env) == ex + ey
    assert S.evaluate(S.sub(x, y), env) == ex - ey
    assert S.evaluate(S.mul(x, y), env) == ex * ey
    assert S.evaluate(x + y, env) == ex + ey and S.evaluate(x * y, env) == ex * ey and S.evaluate(-x, env) == -ex


@given(dims(), st.integers(1, 7), envs)
def test_floordiv_mod_by_positive_int(x, k, env):
    ex = S.evaluate(x, env)
    assert S.evaluate(S.floordiv(x, k), env) == ex // k
    assert S.evaluate(S.mod(x, k), env) == ex % k


@given(dims(), positive_polys(), envs)
def test_floordiv_mod_by_positive_polynomial(x, y, env):
    ex, ey = S.evaluate(x, env), S.evaluate(y, env)
    assert ey >= 1
    assert S.evaluate(S.floordiv(x, y), env) == ex // ey
    assert S.evaluate(S.mod(x, y), env) == ex % ey


@given(polys(), polys(nonneg=True, max_terms=2), st.integers(1, 4), envs)
def test_floordiv_with_common_factor(x, y, k, env):
    """(x*c) // (y*c) for a divisor that is a product of symbols (e.g. Reshape's -1): exact when y*c > 0."""
    c = S.mul(k, S.mul(S.sym("a"), S.sym("b")))
    den = S.mul(S.add(y, 1), c)
    eden = S.evaluate(den, env)
    if eden == 0:
        return
    num = S.mul(x, c)
    assert S.evaluate(S.floordiv(num, den), env) == S.evaluate(num, env) // eden


@given(dims(), dims())
def test_exact_div_of_product(x, y):
    if y == 0:
        return
    assert S.exact_div(S.mul(x, y), y) == x


@given(polys(), positive_polys(), envs)
def test_exact_div_is_exact_when_it_answers(x, y, env):
    q = S.exact_div(x, y)
    if q is not None:
        assert S.evaluate(S.mul(q, y), env) == S.evaluate(x, env)


# -- proofs are sound ------------------------------------------------------------------------


@given(dims(), dims(), bounds_st)
def test_prove_ge_is_sound(x, y, bounds):
    if S.prove_ge(x, y, bounds):
        for env in grid(bounds):
            assert S.evaluate(x, env) >= S.evaluate(y, env), env


@given(dims(), dims(), bounds_st)
def test_prove_eq_is_sound(x, y, bounds):
    verdict = S.prove_eq(x, y, bounds)
    if verdict is None:
        return
    for env in grid(bounds):
        assert (S.evaluate(x, env) == S.evaluate(y, env)) is verdict, env


@given(dims(), bounds_st)
def test_lower_bound_is_sound(x, bounds):
    lb = S.lower_bound(x, bounds)
    if lb is not None:
        for env in grid(bounds):
            assert S.evaluate(x, env) >= lb, env


@given(dims(), dims(), bounds_st)
def test_dmax_dmin_evaluate(x, y, bounds):
    hi, lo = S.dmax(x, y, bounds), S.dmin(x, y, bounds)
    for env in grid(bounds, span=3):
        ex, ey = S.evaluate(x, env), S.evaluate(y, env)
        assert S.evaluate(hi, env) == max(ex, ey)
        assert S.evaluate(lo, env) == min(ex, ey)


def test_lower_bound_examples():
    """The answers the soundness property above cannot demand (it accepts None): the tightest bound where one is
    provable, None where a negative term makes the polynomial unbounded below."""
    a, b = S.sym("a"), S.sym("b")
    assert S.lower_bound(7) == 7
    assert S.lower_bound(S.add(S.mul(2, a), 3)) == 3
    assert S.lower_bound(S.add(S.mul(2, a), 3), {"a": 4}) == 11
    assert S.lower_bound(S.mul(a, b), {"a": 2, "b": 3}) == 6
    assert S.lower_bound(S.floordiv(S.add(a, 9), 2), {"a": 1}) == 0  # a quotient of non-negatives: 0, not tighter
    assert S.lower_bound(S.floordiv(S.sub(a, 9), 2)) is None
    assert S.lower_bound(S.sub(a, b), {"a": 5}) is None


def test_prove_examples():
    a, b = S.sym("a"), S.sym("b")
    assert S.prove_ge(S.add(a, b), a) is True
    assert S.prove_ge(a, S.add(a, 1)) is False
    assert S.prove_eq(S.add(a, 1), a) is False
    assert S.prove_eq(a, b) is None
    assert S.prove_eq(S.sub(a, b), 0) is None
    assert S.prove_ge(a, 1, {"a": 1}) is True and S.prove_ge(a, 1) is False
    assert S.prove_ge(S.floordiv(a, -2), 0) is False  # a // -2 <= 0
    assert S.prove_ge(S.mod(a, S.sub(b, 5)), 0) is False  # the divisor's sign is unknown


# -- substitution ----------------------------------------------------------------------------


@given(dims(), st.dictionaries(st.sampled_from(SYMS), polys(nonneg=True, max_terms=3), max_size=3), envs)
def test_substitute_then_evaluate(x, mapping, env):
    """Symbols are non-negative, so they are replaced by non-negative polynomials."""
    env2 = {s: (S.evaluate(mapping[s], env) if s in mapping else env[s]) for s in SYMS}
    assert S.evaluate(S.substitute(x, mapping), env) == S.evaluate(x, env2)


@given(dims())
def test_substitute_identity_and_symbols(x):
    assert S.substitute(x, {}) == x
    assert S.substitute(x, {s: S.sym(s) for s in SYMS}) == x
    assert S.symbols_of(S.substitute(x, {s: 2 for s in SYMS})) == set()


# -- serialization and canonical form --------------------------------------------------------


@given(dims(depth=2))
def test_json_round_trip(x):
    j = S.to_json(x)
    assert S.from_json(json.loads(json.dumps(j))) == x


@given(polys(), polys(), polys())
def test_canonical_form(x, y, z):
    assert S.add(x, y) == S.add(y, x) and hash(S.add(x, y)) == hash(S.add(y, x))
    assert S.mul(x, y) == S.mul(y, x)
    assert S.add(S.add(x, y), z) == S.add(x, S.add(y, z))
    assert S.mul(S.mul(x, y), z) == S.mul(x, S.mul(y, z))
    assert S.mul(x, S.add(y, z)) == S.add(S.mul(x, y), S.mul(x, z))
    assert S.sub(S.add(x, y), y) == x
    d = S.sub(x, x)
    assert d == 0 and isinstance(d, int)


def test_two_spellings_of_a_square():
    a, b = S.sym("a"), S.sym("b")
    lhs = S.mul(S.add(a, b), S.add(a, b))
    rhs = S.add(S.add(S.mul(a, a), S.mul(2, S.mul(a, b))), S.mul(b, b))
    assert lhs == rhs and hash(lhs) == hash(rhs) and str(lhs) == str(rhs)
    assert (a + b) * (a + b) == a * a + 2 * a * b + b * b
    assert S.exact_div(lhs, S.add(a, b)) == S.add(a, b)
    assert S.floordiv(lhs, S.add(b, a)) == S.add(a, b)


def test_constants_are_ints():
    a = S.sym("a")
    assert type(S.add(a, S.mul(a, -1))) is int
    assert type(S.floordiv(S.mul(a, 6), S.mul(a, 3))) is int
    assert S.dim(S.Expr({(): 7})) == 7
