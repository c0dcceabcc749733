"""fuse-linear: a projection by a constant weight  =>  Linear(x, W^T, b).

Matches (after canonicalize: constants on the right):

    y = MatMul(x, W)             W a 2-D constant [K, N], x [..., K] of W's dtype
        [-> Add(y, b)]           b a constant [N] (or [1, ..., 1, N]), y's only user, same shape out
    =>
    y = Linear(x, Wt, b)         Wt = W^T as a new contiguous constant [N, K]

    y = Gemm(x, W, [c])          x 2-D, transA=0, alpha=1, beta=1 (or no c); W a 2-D constant
                                 ([N, K] with transB=1, used as is; [K, N] with transB=0, transposed);
                                 c absent or a constant [N] / [1, N] / [1] (broadcast along N)
    =>
    y = Linear(x, Wt, c)

A constant read by several projections is transposed once (cached by the Value's identity), so
merged or shared weights cost one copy. Declines (reason shown at -vv): the weight is not a
constant, not 2-D, or its dtype differs from x's; Gemm with transA, alpha != 1, beta != 1 or a
bias that varies along M.

Requires: canonicalize, dce (the bias Add must have the constant on the right and the MatMul no
dead users). Guarantees: same outputs (float32: identical up to summation order; float16: the bias
is added before the single rounding, where the unfused graph rounds twice); graph outputs keep
their names; the graph verifies. Does nothing when `program.options.fusion` is False.
"""

from __future__ import annotations

import numpy as np

from atlasc.ir.graph import Graph, Node, Value, constant
from atlasc.ir.program import Program
from atlasc.passes.rewrite import Match, RewriteStats, Rule, apply_rules

FLOATS = ("float32", "float16")


class _Constants:
    """New constants made by this pass: transposed weights and 1-D biases, each made once."""

    def __init__(self):
        self.cache: dict[tuple[str, int], Value] = {}

    def transposed(self, graph: Graph, w: Value) -> Value:
        key = ("T", id(w))
        if key not in self.cache:
            # a view, not a copy: quantize reads it chunk by chunk and the artifact writer lays it out,
            # so a compile never holds a second float copy of the weights
            self.cache[key] = _existing_transpose(graph, w) or constant(f"{w.name}__T", w.data.T)
        return self.cache[key]

    def vector(self, b: Value, n: int) -> Value:
        """b as a 1-D constant [n] (b itself when it already is one)."""
        if len(b.shape) == 1 and b.shape[0] == n:
            return b
        key = ("N", id(b))
        if key not in self.cache:
            self.cache[key] = constant(f"{b.name}__N", np.ascontiguousarray(np.broadcast_to(b.data.reshape(-1), (n,))))
        return self.cache[key]


def _existing_transpose(graph: Graph, w: Value) -> Value | None:
    """A contiguous constant of the graph equal to W^T (a tied embedding), to read instead of a copy."""
    wt = w.data.T
    probe = wt[:2].copy() if wt.ndim == 2 else None  # a few rows first: random weights differ at once
    for c in graph.constants():
        d = c.data
        if c is w or d.shape != wt.shape or d.dtype != wt.dtype or not d.flags.c_contiguous:
            continue
        if wt.flags.c_contiguous and d.ctypes.data == wt.ctypes.data:
            return c
        # full comparisons of gigabyte weights are slow: compare two rows before the whole tensor
        if probe is not None and not np.array_equal(d[:2], probe):
            continue
        if np.array_equal(d, wt):
            return c
    return None


def _bias_vector(b: Value, n) -> str | None:
    """None when b is a constant that broadcasts as a [n] vector along the last axis, else the reason."""
    if not b.is_constant:
        return "the bias is not a constant"
    if not isinstance(n, int):
        return "N is symbolic"
    shape = tuple(b.data.shape)
    if any(d != 1 for d in shape[:-1]):
        return f"the bias {shape} varies along rows"
    if shape and shape[-1] not in (1, n):
        return f"the bias {shape} does not broadcast to [{n}]"
    return None


def _check_weight(x: Value, w: Value) -> str | None:
    if not w.is_constant:
        return "the weight is not a constant"
    if len(w.shape) != 2:
        return f"the weight has rank {len(w.shape)}, expected 2"
    if x.dtype != w.dtype:
        return f"x is {x.dtype}, the weight {w.dtype}"
    if x.dtype not in FLOATS:
        return f"dtype {x.dtype} (Linear takes float32 / float16)"
    return None


def _emit(out: Value, x: Value, wt: Value, b: Value | None) -> Match:
    new = Value(out.name + "__linear", out.dtype, out.shape)
    ins = [x, wt] if b is None else [x, wt, b]
    return Match(out, new, [Node("Linear", ins, [new])])


def _matmul_rule(consts: _Constants):
    def match(graph: Graph, node: Node):
        x, w = node.inputs
        reason = _check_weight(x, w)
        if reason:
            return reason
        out = node.outputs[0]
        n = w.shape[1]
        users = graph.users(out)
        is_output = any(o is out for o in graph.outputs)
        if len(users) == 1 and users[0].op == "Add" and not is_output:
            add = users[0]
            a0, a1 = add.inputs
            b = a1 if a0 is out else a0
            y = add.outputs[0]
            if b is not out and _bias_vector(b, n) is None and b.dtype == out.dtype and y.shape == out.shape:
                return _emit(y, x, consts.transposed(graph, w), consts.vector(b, n))
        return _emit(out, x, consts.transposed(graph, w), None)

    return match


def _gemm_rule(consts: _Constants):
    def match(graph: Graph, node: Node):
        x, w = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        reason = _check_weight(x, w)
        if reason:
            return reason
        if len(x.shape) != 2:
            return f"x has rank {len(x.shape)}"
        if node.attrs.get("transA", 0):
            return "transA=1"
        if float(node.attrs.get("alpha", 1.0)) != 1.0:
            return "alpha != 1"
        if c is not None and float(node.attrs.get("beta", 1.0)) != 1.0:
            return "beta != 1"
        wt = w if node.attrs.get("transB", 0) else consts.transposed(graph, w)
        n = wt.shape[0]
        b = None
        if c is not None:
            reason = _bias_vector(c, n)
            if reason:
                return reason
            if c.dtype != x.dtype:
                return f"the bias is {c.dtype}"
            b = consts.vector(c, n)
        return _emit(node.outputs[0], x, wt, b)

    return match


def rules(consts: _Constants) -> list[Rule]:
    return [
        Rule("MatMul(x, W) [+ b] => Linear(x, W^T, b)", ("MatMul",), _matmul_rule(consts)),
        Rule("Gemm(x, W, c) => Linear(x, W^T, c)", ("Gemm",), _gemm_rule(consts)),
    ]


def fuse_linear(program: Program) -> tuple[Program, RewriteStats]:
    """Rewrite every constant-weight MatMul / Gemm of every entry into Linear (see module docstring)."""
    stats = RewriteStats()
    if not program.options.fusion:
        return program, stats
    consts = _Constants()  # shared by the entries: one transposed copy per weight
    for name, graph in program.entries.items():
        program.entries[name] = apply_rules(graph, rules(consts), stats)
    return program, stats
