"""Reduction and data-movement kernels on the GPU, compared with the numpy reference interpreter.

Each group graph of tests/test_codegen_reduce_movement.py runs at several run-time sizes with the
SAME compile-time maxima (one module, served from the nvcc cache after the first run), so the sizes
really come from the dims buffer: the maxima, a smaller set, and where a symbol's lower bound is 0,
a zero-size case. Inputs are fresh seeded random values (never zeros). Values listed in
`Group.strided` (a Transpose output) are placed non-contiguously, so the ops read strided inputs.

Tolerances (every output of a group is checked with the group's):
- float32: rtol 1e-5, atol 1e-6; Softmax/LogSoftmax and the normalizations: atol 1e-5;
- float16: rtol 1e-3, atol 2e-3, i.e. about one float16 ulp of a result of magnitude ~1 (both sides
  round once from float32; a different float32 summation order may flip that rounding);
- float64: rtol 1e-10, atol 1e-12; integer and bool results: exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_codegen_reduce_movement import (
    FLOATS,
    build_movement,
    build_norm,
    build_norm_vec,
    build_reduce,
    build_reduce_empty,
    build_reduce_int,
    build_softmax,
    build_sources,
    strided_plan,
)

pytestmark = pytest.mark.gpu

TOL = {
    "float32": (1e-5, 1e-6),
    "float32-smooth": (1e-5, 1e-5),
    "float16": (1e-3, 2e-3),
    "float64": (1e-10, 1e-12),
    "exact": (0.0, 0.0),
}

BUILDERS = {}
for _dt in FLOATS:
    BUILDERS[f"reduce_{_dt}"] = (lambda dt=_dt: build_reduce(dt), _dt)
    BUILDERS[f"reduce_empty_{_dt}"] = (lambda dt=_dt: build_reduce_empty(dt), _dt)
    BUILDERS[f"softmax_{_dt}"] = (lambda dt=_dt: build_softmax(dt), "float32-smooth" if _dt == "float32" else _dt)
    BUILDERS[f"norm_{_dt}"] = (lambda dt=_dt: build_norm(dt), "float32-smooth" if _dt == "float32" else _dt)
    BUILDERS[f"movement_{_dt}"] = (lambda dt=_dt: build_movement(dt), _dt)
BUILDERS["reduce_float64"] = (lambda: build_reduce("float64"), "float64")
BUILDERS["softmax_float64"] = (lambda: build_softmax("float64"), "float64")
BUILDERS["norm_float64"] = (lambda: build_norm("float64"), "float64")
BUILDERS["reduce_int"] = (build_reduce_int, "exact")
for _dt in ("int64", "int32", "bool"):
    BUILDERS[f"movement_{_dt}"] = (lambda dt=_dt: build_movement(dt), "exact")
BUILDERS["sources"] = (build_sources, "float32")


def size_sets(group, rng) -> list[tuple[str, dict[str, int]]]:
    """(label, symbol values): the maxima, a random smaller set, and zero where a symbol allows it."""
    info = group.g.symbols
    sets = [("max", {s: i.upper for s, i in info.items()}),
            ("small", {s: int(rng.integers(max(i.lower, 1), max(i.upper // 2, 1) + 1)) for s, i in info.items()})]
    zero = {s: (0 if i.lower == 0 else i.upper // 2 or 1) for s, i in info.items()}
    if any(i.lower == 0 for i in info.values()):
        sets.append(("zero", zero))
    return sets


def _check_sizes(group, tol: str, sizes, rng, what: str) -> None:
    """Run `group` at each (label, symbol values) of `sizes` on fresh inputs against the reference interpreter."""
    from kernel_harness import check_against_reference

    rtol, atol = TOL[tol]
    for label, env in sizes:
        feeds = group.inputs(rng, env)
        try:
            check_against_reference(group.g, feeds, rtol=rtol, atol=atol, upper=group.upper,
                                    plan_fn=strided_plan(group))
        except AssertionError as e:
            raise AssertionError(f"{what} at {label} sizes {env}: {e}") from None


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_group_matches_reference(name):
    build, tol = BUILDERS[name]
    group = build()
    rng = np.random.default_rng(sum(map(ord, name)))  # deterministic per group
    _check_sizes(group, tol, size_sets(group, rng), rng, name)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("vec", ["0", "1"])
def test_norm_vec_matches_reference(dtype, vec, monkeypatch):
    """The last-axis normalizations with ATLAS_NORM_VEC on (reduce.cu norm_rows_vec: rows in registers, 16-byte pieces)
    and off, against the reference: a decode batch's rows (32 x 4096), a partial last piece per thread (5 x 1000), rows
    whose length is not a multiple of 16 bytes (3 x 1001: the run-time check sends them to norm_block), one row of 8;
    the transposed x always takes norm_block. The group's tolerances (float16: one ulp at |y| ~ 1)."""
    from atlasc.codegen import reduce

    monkeypatch.setenv(reduce.NORM_VEC_ENV, vec)
    sizes = [("rows", {"m": m, "n": n}) for m, n in ((32, 4096), (5, 1000), (3, 1001), (1, 8))]
    _check_sizes(build_norm_vec(dtype), "float32-smooth" if dtype == "float32" else dtype, sizes,
                 np.random.default_rng(23), f"{dtype} ATLAS_NORM_VEC={vec}")
