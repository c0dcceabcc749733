"""FusedElementwise kernels on the GPU: the fused groups of tests/test_fuse_elementwise.py (RMSNorm's
tail, SiLU * mul, a causal + padding mask chain with Where/Equal/Cast, GPT-2's tanh GELU, an integer
chain) against the reference interpreter, and against the unfused per-node kernels.

Each group runs at its symbols' maxima and at a smaller set with the SAME compile-time maxima, so
sizes come from the dims buffer. Inputs are seeded random values.

Tolerances vs the reference:
- float32: rtol 1e-5, atol 1e-6 (expf/tanhf/erff differ from numpy's float64 by a few float ulps);
- float16: rtol 1e-3, atol 2e-3, i.e. about one float16 ulp of a result of magnitude ~1 (a float32
  transcendental a few ulps off numpy's may flip one rounding to float16);
- integer and bool results: exact.
Against the unfused kernels the results must be bit-identical: the fused kernel uses the same per-op
expressions, rounds a float16 step where the unfused graph stored it, and never contracts two steps
into an FMA.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fuse_elementwise import GROUPS, fused

pytestmark = pytest.mark.gpu

TOL = {"float32": (1e-5, 1e-6), "float16": (1e-3, 2e-3), "exact": (0.0, 0.0)}


def tolerance(name: str) -> tuple[float, float]:
    for dt in ("float32", "float16"):
        if name.endswith(dt):
            return TOL[dt]
    return TOL["exact"]


def size_sets(group) -> list[dict[str, int]]:
    info = group.g.symbols
    return [{s: i.upper for s, i in info.items()}, {s: max(i.lower, i.upper // 2 - 1, 1) for s, i in info.items()}]


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_fused_group_matches_reference(name):
    from kernel_harness import check_against_reference

    group = GROUPS[name]()
    f = fused(group)
    assert any(n.op == "FusedElementwise" for n in f.g.nodes)
    rtol, atol = tolerance(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    for env in size_sets(group):
        feeds = group.inputs(rng, env)
        check_against_reference(f.g, feeds, rtol=rtol, atol=atol, upper=group.upper)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_fused_group_equals_unfused_kernels(name):
    from kernel_harness import run_on_gpu

    group = GROUPS[name]()
    f = fused(group)
    rng = np.random.default_rng(1 + sum(map(ord, name)))
    feeds = group.inputs(rng, size_sets(group)[1])
    want = run_on_gpu(group.g, feeds, upper=group.upper)
    got = run_on_gpu(f.g, feeds, upper=group.upper)
    for key, w in want.items():
        np.testing.assert_array_equal(got[key], w, err_msg=key)
