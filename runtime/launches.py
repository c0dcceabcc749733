"""Which kernel each node launches for given symbol values: the default or one of its batch-bucket variants.

An artifact may hold, for some nodes of an entry, kernels generated for smaller maxima of one symbol
(the decode batch: codegen/generate.py `generate_module(buckets=...)`). A run uses, per node, the
tightest variant whose `upto` covers the symbol's value; runs of one bucket share a schedule (and a
captured CUDA graph).
"""

from __future__ import annotations

from collections.abc import Mapping


def entry_buckets(entry) -> tuple[str, tuple[int, ...]]:
    """(symbol, sorted upto values) of the entry's kernel variants; ("", ()) when it has none."""
    symbols = {n.symbol for n in entry.nodes if n.variants}  # at most one (Manifest.check)
    uptos = sorted({v.upto for n in entry.nodes for v in n.variants})
    return (symbols.pop() if symbols else "", tuple(uptos))


def bucket_of(buckets: tuple[str, tuple[int, ...]], env: Mapping[str, int]) -> int | None:
    """The smallest bucket value covering env's value of the bucket symbol; None: the default kernels."""
    symbol, uptos = buckets
    value = env.get(symbol)
    if value is None:
        return None
    return next((u for u in uptos if value <= u), None)


def node_launch(node, env: Mapping[str, int]) -> tuple:
    """(kernel, grid, block, smem, args) of a manifest node for the symbol values env: its tightest variant
    whose upto covers env[node.symbol], else the default launch (valid for every size). args: the arena
    offsets a kernel shared by several nodes takes after the arena pointer (codegen/share.py)."""
    value = env.get(node.symbol) if node.variants else None
    if value is not None:
        for v in node.variants:
            if value <= v.upto:
                return v.kernel, tuple(v.grid), tuple(v.block), v.smem, tuple(v.args)
    return node.kernel, tuple(node.grid), tuple(node.block), node.smem, tuple(node.args)
